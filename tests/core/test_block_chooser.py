"""The block-size chooser as a pure function: it picks what the arithmetic says, estimates
acceptance with decay and a prior, and explores unmeasured widths deterministically."""

import json
from pathlib import Path

import pytest

from mlx_mtp import MTPError
from mlx_mtp.block_chooser import BlockChooser, best_drafts, expected_tokens


def test_expected_tokens_by_hand():
    a = [0.8, 0.5, 0.25]
    assert expected_tokens(a, 0) == 1.0
    assert expected_tokens(a, 1) == pytest.approx(1.8)
    assert expected_tokens(a, 2) == pytest.approx(1 + 0.8 + 0.4)
    assert expected_tokens(a, 3) == pytest.approx(1 + 0.8 + 0.4 + 0.1)


@pytest.mark.parametrize("acceptance,costs,want", [
    # 1/10 = 0.100, 1.8/15 = 0.120, 2.2/20 = 0.110: one draft
    ([0.8, 0.5], [10, 15, 20], 1),
    # 1.0/10, 1.9/11, 2.71/12, 3.439/13 = 0.1, 0.173, 0.226, 0.265: three drafts
    ([0.9, 0.9, 0.9], [10, 11, 12, 13], 3),
    # text the head cannot predict: 1/10 = 0.1 beats 1.05/14 = 0.075: no drafts (block 1)
    ([0.05, 0.05], [10, 14, 18], 0),
    # a tie (1/10 == 2/20) goes to the fewer drafts
    ([1.0], [10, 20], 0),
    # a cheap wide verify: 1/10, 1.5/12 = 0.125, 1.75/13 = 0.135, 1.875/13.5 = 0.139
    ([0.5, 0.5, 0.5], [10, 12, 13, 13.5], 3),
    # only as many drafts as costs are known for: width 3 unknown, so at most one draft
    ([0.9, 0.9], [10, 11], 1),
])
def test_best_drafts_is_the_arithmetic(acceptance, costs, want):
    assert best_drafts(acceptance, costs) == want


def test_acceptance_estimate_decays_and_shrinks_to_the_previous_position():
    c = BlockChooser(3, prior=0.5, prior_weight=1.0, decay=0.95)
    assert c.acceptance() == [0.5, 0.5, 0.5]
    c.observe(3, 1, 0.01)  # draft 1 kept, draft 2 rejected, draft 3 never judged
    assert c.acceptance() == pytest.approx([(1 + 0.5) / 2, (0 + 0.75) / 2, 0.375])
    c.observe(1, 1, 0.01)  # a drafting round: every position's old counts x 0.95 ...
    a1 = (1.95 + 0.5) / (1.95 + 1)
    a2 = (0 + a1) / (0.95 + 1)  # ... position 2's too, though this round did not judge it
    assert c.acceptance() == pytest.approx([a1, a2, a2])
    c.observe(0, 0, 0.01)  # a round without drafts leaves the counts as they are
    assert c.acceptance() == pytest.approx([a1, a2, a2])
    # the choice adds optimism / sqrt(n_j + 1) (n_j: decayed rounds that judged draft j)
    bonus = [0.0] + [c.optimism / (n + 1) ** 0.5 for n in (0.95, 0.0)]  # none at position 1
    assert c.optimistic_acceptance() == pytest.approx(
        [min(1.0, a + b) for a, b in zip([a1, a2, a2], bonus)])


def test_first_round_measures_width_one_then_explores_upwards_optimistically():
    c = BlockChooser(5, prior=0.5, prior_weight=1.0)
    assert c.choose() == 0
    c.observe(0, 0, 0.010)
    # width 2, the first unmeasured one, is valued at width 1's cost; wider ones wait
    assert c.costs() == [0.010, 0.010, None, None, None, None]
    assert c.choose() == 1  # 1.5 / 0.010 > 1 / 0.010
    c.observe(1, 1, 0.012)
    # a_1 = (1 + 0.5) / 2 = 0.75; a_2 = a_1 never judged, valued at 0.75 + 0.4 / sqrt(1), at most
    # 1: E(2) / 0.012 = 2.5 / 0.012 = 208 beats E(1) / 0.012 = 146 and 1 / 0.010 = 100
    assert c.optimistic_acceptance() == [0.75, 1.0, 1.0, 1.0, 1.0]
    assert c.costs() == [0.010, 0.012, 0.012, None, None, None]
    assert c.choose() == 2
    assert c.choose(limit=1) == 1  # the token budget bounds it
    c.observe(2, 0, 0.030)  # a dear width 3 that kept nothing
    # width 3, the widest measured, pooled with the line through widths 1 and 2 (0.014 at 3),
    # worth 2 samples: (0.030 + 2 x 0.014) / 3 = 0.01933; width 4 waits at that bound
    assert c.costs() == pytest.approx([0.010, 0.012, 0.058 / 3, 0.058 / 3, None, None])
    # a_1 = (0.9 + 0.5) / (1.9 + 1) = 0.4828 (draft 2 unjudged: a_2 = a_1 + 0.4 = 0.8828):
    # E(1) / 0.012 = 124 beats E(3) / 0.01933 = 2.285 / 0.01933 = 118 and 1 / 0.010 = 100
    assert c.choose() == 1


def simulate(chooser, acceptance, cost, rounds, cost_of=None):
    """Run ``rounds`` rounds against a device whose round of width w costs ``cost[w - 1]`` and
    whose drafter's j-th draft is kept iff ``acceptance[j - 1]`` is 1 (0/1 acceptances keep the
    simulation deterministic). Returns the choices."""
    choices = []
    for r in range(rounds):
        k = chooser.choose()
        accepted = next((j for j in range(k) if not acceptance[j]), k)
        wall = cost_of(r, k + 1) if cost_of else cost[k]
        chooser.observe(k, accepted, wall)
        choices.append(k)
    return choices


def test_it_settles_on_the_best_width_of_a_measured_device():
    # every draft kept; cost grows 2 ms a width: the arithmetic wants the widest block
    cost = [0.010 + 0.002 * w for w in range(6)]
    choices = simulate(BlockChooser(5), [1] * 5, cost, 40)
    assert choices[:6] == [0, 1, 2, 3, 4, 5]  # explored upwards while every step paid
    assert choices[-20:] == [5] * 20
    # a verify that gets dear past width 3 (BLIS-like): block 3 wins once measured
    steep = [0.010, 0.012, 0.013, 0.040, 0.045, 0.050]
    choices = simulate(BlockChooser(5), [1] * 5, steep, 40)
    assert choices[-20:] == [2] * 20
    assert best_drafts([0.99] * 5, steep) == 2


def test_undraftable_text_drafts_rarely():
    c = BlockChooser(5, probe_every=32)
    cost = [0.010 + 0.005 * w for w in range(6)]
    choices = simulate(c, [0] * 5, cost, 400)
    # The start: width 1, then width 2 (optimistic at width 1's cost; rejected, a_1 = 2.1 / 4),
    # then width 3 at width 2's cost: a_2 = a_1, never judged, valued at a_1 + 0.4 / sqrt(1):
    # E(2) = 1 + 0.525 + 0.525 * 0.925 = 2.01 beats E(1) = 1.525. Rejected: a_1 = 2.1 / 4.9
    # = 0.429 (the old count x 0.9, plus one), and width 4 at width 3's cost 0.020:
    # E(3) = 1 + 0.429 + 0.429 * 0.829 + 0.429 * 0.829^2 = 2.078, 103.9 / s beats 100 / s.
    assert choices[:4] == [0, 1, 2, 3]
    # Afterwards a_1 = 2.1 / 5.71 = 0.37 and no block can pay: no drafts, except one probe of one
    # draft after 4, 8, 16, then every 32 rounds without (each rejected probe doubles the wait).
    drafting = [i for i, k in enumerate(choices) if k]
    assert drafting == [1, 2, 3, 8, 17, 34] + list(range(67, 400, 33))
    assert all(choices[i] == 1 for i in drafting[3:])


def test_an_early_rejection_is_rechecked_soon():
    """The first draft of a run is rejected, and width 2 looks dear (2.1x width 1): the probe
    after 4 rounds is kept, and then the climb to the widest block."""
    cost = [0.010, 0.021, 0.020, 0.021, 0.023, 0.025]
    c, choices, drafted = BlockChooser(5), [], 0
    for _ in range(40):
        k = c.choose()
        c.observe(k, 0 if (k and not drafted) else k, cost[k])
        drafted += k > 0
        choices.append(k)
    assert choices[:11] == [0, 1, 0, 0, 0, 0, 1, 2, 3, 4, 5]
    assert choices[11:] == [5] * 29


def test_a_stale_outlier_measurement_is_measured_again():
    # width 3's first round hit a 1 s stall; it is avoided until the sample is stale
    cost = [0.010, 0.011, 0.012, 0.030, 0.040, 0.050]
    stalls = {}

    def cost_of(r, w):
        if w == 3 and w not in stalls:
            stalls[w] = r
            return 1.0
        return cost[w - 1]

    c = BlockChooser(5, stale_rounds=20)
    choices = simulate(c, [1] * 5, cost, 150, cost_of)
    stalled = stalls[3]
    assert 2 not in choices[stalled + 1 : stalled + 15]
    assert best_drafts([1.0] * 5, cost) == 2
    # settled on two drafts; the only other rounds re-measure stale width 1 and the neighbour
    # width 4, each at most once per 20 rounds
    steady = choices[-30:]
    assert set(steady) <= {0, 2, 3} and steady.count(0) <= 2 and steady.count(3) <= 2


def test_width_one_is_remeasured_when_stale():
    c = BlockChooser(2, stale_rounds=10)
    choices = simulate(c, [1, 1], [0.010, 0.011, 0.012], 40)
    zeros = [i for i, k in enumerate(choices) if k == 0]
    assert zeros[0] == 0 and all(b - a <= 11 for a, b in zip(zeros, zeros[1:]))
    assert len(zeros) >= 4


@pytest.mark.parametrize("kw,msg", [
    ({"max_drafts": -1}, "max_drafts must be a non-negative integer, got -1"),
    ({"max_drafts": 2, "decay": 0.0}, "BlockChooser needs 0 <= prior <= 1, prior_weight > 0, "
                                      "0 < decay <= 1"),
    ({"max_drafts": 2, "probe_every": 0}, "BlockChooser needs cost_window, stale_rounds, "
                                          "probe_every >= 1"),
    ({"max_drafts": 2, "optimism": -0.1}, "BlockChooser needs optimism >= 0, pooling >= 0"),
    ({"max_drafts": 2, "pooling": -1.0}, "BlockChooser needs optimism >= 0, pooling >= 0"),
])
def test_bad_settings(kw, msg):
    with pytest.raises(MTPError) as e:
        BlockChooser(**kw)
    assert str(e.value) == msg


def test_pooled_cost_is_the_median_or_the_line_through_its_neighbours_if_cheaper():
    observed = [(1, 0.010), (2, 0.030), (3, 0.020), (3, 0.022), (4, 0.040), (5, 0.090)]
    c = BlockChooser(4, pooling=1.0)
    for w, wall in observed:
        c.observe(w - 1, w - 1, wall)
    # width 2, between 1 (0.010) and 3 (0.021): (1 x 0.030 + 1 x 0.0155) / 2 = 0.02275
    # width 3, between 2 (0.030) and 4 (0.040): the line says 0.035, dearer: its median 0.021
    # width 4, between 3 (0.021) and 5 (0.090): the line says 0.0555, dearer: 0.040
    # width 5, the widest, on the line through 3 and 4 (0.059): (0.090 + 0.059) / 2 = 0.0745
    assert c.pooled() == pytest.approx({1: 0.010, 2: 0.02275, 3: 0.021, 4: 0.040, 5: 0.0745})
    assert c.costs() == pytest.approx([0.010, 0.02275, 0.021, 0.040, 0.0745])
    raw = BlockChooser(4, pooling=0.0)
    for w, wall in observed:
        raw.observe(w - 1, w - 1, wall)
    assert raw.pooled() == pytest.approx({1: 0.010, 2: 0.030, 3: 0.021, 4: 0.040, 5: 0.090})


# Round costs per width of the BLIS demo-pair record (benchmark_results/demo-pair-blis-vm-
# 2026-12-01.json: verify per width, drafter steps, accept hook; scripts/simulate_chooser.py).
RECORD_COST = [0.01827, 0.02491, 0.02887, 0.03631, 0.04142, 0.04269]
TRACES = Path(__file__).resolve().parents[1] / "data" / "demo_pair_traces.json"


def replay_trace(chooser, L, n=128):
    """The round loop on a recorded trace: a round of k drafts at output position p keeps
    min(L[p], k) (scripts/acceptance_traces.py checked that against real runs)."""
    emitted, p, choices = 1, 0, []
    while emitted < n:
        k = chooser.choose(min(chooser.max_drafts, n - emitted - 1))
        a = min(L[p], k)
        chooser.observe(k, a, RECORD_COST[k])
        choices.append(k)
        emitted += a + 1
        p += a + 1
    return choices


def test_on_recorded_traces_it_climbs_to_the_widest_block_and_stays():
    traces = json.loads(TRACES.read_text())["prompts"]
    # enumeration opens with a list whose odd positions reject every draft: two drafts there
    # land on them, and without optimism about the deeper positions (never judged again) the
    # block stayed at width 3 for rounds; the record's best fixed block there is the widest
    got = replay_trace(BlockChooser(5), traces["enumeration"]["L"])
    assert "".join(map(str, got)) == "0123455555555555555555552"  # the last cut by the budget
    stuck = replay_trace(BlockChooser(5, optimism=0.0), traces["enumeration"]["L"])
    assert "".join(map(str, stuck)) == "0123425222222222222555555555555552"
    got = replay_trace(BlockChooser(5), traces["prose"]["L"])
    assert "".join(map(str, got)) == "01234555555555555555555555555555"
