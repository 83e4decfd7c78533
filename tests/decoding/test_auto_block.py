"""``block_size="auto"`` through the round loop: T=0 output is mlx-lm's greedy decode whatever the
choices; sampled output is plain sampling with per-position keys, so a seed reproduces it whatever
the choices; the gate probes every width auto may use; stats and CLI say which widths ran."""

import json

import mlx.core as mx
import numpy as np
import pytest
from support.chisquare import goodness_of_fit
from support.processes import cli
from support.reference import CODE_PROMPT, reference_greedy
from mlx_lm.sample_utils import make_sampler as mlx_make_sampler
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.utils import load_model as mlx_load_model
from support.choosers import STRETCHES, ScriptedChooser, StretchChooser
from support.oracle import ForcedHeadDrafter, TableDrafter

import mlx_mtp
from mlx_mtp import MTPError
from mlx_mtp.decoding.block_chooser import BlockChooser, RoundCosts
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.decoding.keyed_sampling import PositionKeys
from mlx_mtp.models.model import MTPModel

MAX_TOKENS = 24


SCRIPTS = ([0, 0, 3, 5, 1, 0, 2, 4, 0, 0, 5], [5, 1, 1, 0, 4], [0])





def tokens(model, prompt, block_size, max_tokens=MAX_TOKENS, **kw):
    return [t for t, _ in mlx_mtp.generate_step(mx.array(prompt), model,
                                                max_tokens=max_tokens,
                                                block_size=block_size, **kw)]


def code_prompt(path):
    return load_tokenizer(path).encode(CODE_PROMPT)


# ------------------------------------------------------------------------------ T=0 identity


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "moe", "next"])
def test_auto_is_mlx_lm_greedy_with_the_real_head(kind, request):
    path = request.getfixturevalue(f"{kind}_dir")
    model = mlx_mtp.load_model(path)
    prompt = code_prompt(path)
    ref = reference_greedy(path, prompt, MAX_TOKENS)
    stats = RunStats()
    assert tokens(model, prompt, "auto", stats=stats) == ref
    assert stats.block_size == "auto" and stats.max_block_size == 6
    assert sum(stats.block_sizes.values()) == stats.rounds
    assert stats.exactness["verdict"] == "equal"
    assert [w["width"] for w in stats.exactness["widths"]] == [2, 3, 4, 5, 6]
    for script in SCRIPTS:
        assert tokens(model, prompt, ScriptedChooser(5, script)) == ref, script


def test_choosers_sharing_round_costs_are_mlx_lm_greedy_and_start_from_them(dense_dir):
    """A session's generations on one RoundCosts: each is mlx-lm's greedy decode, the second
    starts from the round times the first measured, and both add theirs (the choice itself is
    tested as a pure function in test_block_chooser.py)."""
    model = mlx_mtp.load_model(dense_dir)
    prompt = code_prompt(dense_dir)
    ref = reference_greedy(dense_dir, prompt, MAX_TOKENS)
    shared = RoundCosts(window=64)  # more than both runs' rounds: no sample falls out
    first = ScriptedChooser(5, [0, 1, 5], round_costs=shared)
    assert tokens(model, prompt, first) == ref
    timed = {w: len(shared.of(w)) for w in range(1, 7)}
    assert timed[1] >= 1 and timed[2] >= 1 and timed[6] >= 1
    assert sum(timed.values()) == first.round  # every round of the first generation
    second = BlockChooser(5, round_costs=shared)
    assert set(second.median) >= {1, 2, 6}
    stats = RunStats()
    assert tokens(model, prompt, second, stats=stats) == ref
    assert second.round == stats.rounds
    assert sum(len(shared.of(w)) for w in range(1, 7)) == sum(timed.values()) + stats.rounds


def test_stretches_without_drafts_are_mlx_lm_greedy(dense_dir):
    """Rounds the chooser commits to drafting nothing run as pipelined one-token steps: the
    output stays mlx-lm's greedy decode, each step is observed, and the drafter catches up."""
    model = mlx_mtp.load_model(dense_dir)
    prompt = code_prompt(dense_dir)
    ref = reference_greedy(dense_dir, prompt, MAX_TOKENS)
    chooser, stats = StretchChooser(5, STRETCHES), RunStats()
    assert tokens(model, prompt, chooser, stats=stats) == ref
    assert stats.undrafted_steps >= 3 + 5  # the first two stretches fit in any 24 tokens
    assert chooser.observed.count(0) >= stats.undrafted_steps
    assert stats.host_syncs == stats.rounds  # one read per step or round


def test_the_chooser_sees_every_emitted_id_in_order(dense_dir):
    """The loop shows the chooser the ids it emits (the prompt's first token, each round's,
    each pipelined step's), so a round's key is the last two ids before it."""
    model = mlx_mtp.load_model(dense_dir)
    prompt = code_prompt(dense_dir)

    class Watching(StretchChooser):
        def see_tokens(self, ids):
            self.seen.extend(ids)
            super().see_tokens(ids)

        def choose(self, limit=None):
            self.keys.append((tuple(self.seen[-2:]), tuple(self.recent)))
            return super().choose(limit)

    chooser = Watching(5, STRETCHES)
    chooser.seen, chooser.keys = [], []
    got = tokens(model, prompt, chooser)
    assert got == reference_greedy(dense_dir, prompt, MAX_TOKENS)
    assert chooser.seen == got
    assert len(chooser.keys) == chooser.asked > 0
    assert all(want == have for want, have in chooser.keys)
    assert chooser.keys[0] == ((got[0],), (got[0],))  # the first round: one id so far


def test_a_stretch_is_observed_at_its_mean_and_counted_whole(dense_dir):
    """A pipelined step has no time of its own (speculative._pipelined_steps): the chooser
    observes every step of a stretch at the stretch's mean, once it ends, and the steps'
    recorded times add up to that mean times the steps (the stretch's first step included; before,
    it went unobserved and the last looked like a 1 ms round). Those steps are left out of the
    spread of round times; block 1's steps are all pipelined: no spread at all."""
    model = mlx_mtp.load_model(dense_dir)
    prompt = code_prompt(dense_dir)

    class Logged(StretchChooser):
        def record_round(self, drafts, accepted, wall_s):
            self.walls.append(wall_s)
            super().record_round(drafts, accepted, wall_s)

    chooser, stats = Logged(5, [("stretch", 4), 2, ("stretch", 3), 1]), RunStats()
    chooser.walls, recorded = [], []
    record = stats.record_round

    def spy(drafted, accepted, wall_s, own_time=True):
        recorded.append((drafted, wall_s, own_time))
        record(drafted, accepted, wall_s, own_time)

    stats.record_round = spy
    tokens(model, prompt, chooser, max_tokens=16, stats=stats)
    # rounds: the stretch (4 steps), a round of 2 drafts, the stretch (3 steps), a round of 1...
    assert chooser.observed[:9] == [0, 0, 0, 0, 2, 0, 0, 0, 1]
    assert [own for _, _, own in recorded[:9]] == [False] * 4 + [True] + [False] * 3 + [True]
    for first, n in ((0, 4), (5, 3)):
        walls = chooser.walls[first:first + n]
        assert len(set(walls)) == 1  # one mean for the whole stretch
        steps = [w for _, w, _ in recorded[first:first + n]]
        assert sum(steps) == pytest.approx(walls[0] * n, rel=1e-12)
    assert set(stats.round_spread_by_width()) <= {2, 3}  # widths 1 only in stretches here
    one = RunStats()
    tokens(model, prompt, 1, max_tokens=16, stats=one)
    assert one.rounds == 15 and one.round_spread_by_width() == {}


def test_auto_with_forced_acceptance_and_every_width_is_exact(dense_dir):
    """The real head's state handling (including rounds without drafts, whose pairs the drafter
    gets later in one piece) under forced acceptance lengths, at every width 1..6."""
    model = mlx_mtp.load_model(dense_dir)
    prompt = code_prompt(dense_dir)
    n = 40
    ref = reference_greedy(dense_dir, prompt, n)
    for script in SCRIPTS[:2]:
        forced = ForcedHeadDrafter(model.drafter, prompt + ref, schedule=[5, 0, 2, 1, 4, 3],
                                   vocab_size=model.target.vocab_size)
        fm = MTPModel(model.mlx_model, model.target, forced)
        stats = RunStats()
        chooser = ScriptedChooser(5, script)
        assert tokens(fm, prompt, chooser, max_tokens=n, stats=stats) == ref, script
        assert stats.accepted == sum(forced.planned) > 0
        # every round ran the drafts chosen (the last ones cut to the token budget)
        assert chooser.observed[: len(script)] == script
        assert sum(stats.block_sizes.values()) == len(chooser.observed) == stats.rounds
        assert {k + 1 for k in script} <= set(stats.block_sizes)


def test_max_block_size_bounds_auto_and_the_probe(dense_dir):
    model = mlx_mtp.load_model(dense_dir)
    prompt = code_prompt(dense_dir)
    stats = RunStats()
    assert tokens(model, prompt, "auto", max_block_size=3, stats=stats) == \
        reference_greedy(dense_dir, prompt, MAX_TOKENS)
    assert max(stats.block_sizes) <= 3 and stats.max_block_size == 3
    assert [w["width"] for w in stats.exactness["widths"]] == [2, 3]
    assert stats.to_dict()["block_sizes"] == {str(w): n for w, n in
                                              sorted(stats.block_sizes.items())}
    one = RunStats()
    tokens(model, prompt, "auto", max_block_size=1, stats=one)
    assert one.block_sizes == {1: one.rounds} and one.exactness["verdict"] == "not_needed"


@pytest.mark.slow
def test_auto_on_gemma4_with_forced_acceptance_is_exact(tmp_path_factory):
    """The Gemma 4 assistant reads the target's K/V and keeps only the newest pair: rounds
    without drafts hand it their pairs later in one piece, which must re-arm it correctly."""
    from support.tiny_gemma4 import WINDOW, Checkpoints

    class ForcedAssistant(ForcedHeadDrafter):
        def bind_cache(self, cache):
            self.inner.bind_cache(cache)

    # one prompt shorter than the sliding window (decoding crosses it), one longer
    PROMPTS = {"short": [(7 * i + 3) % 300 for i in range(5)],
               "long": [(11 * i + 5) % 300 for i in range(40)]}
    assert len(PROMPTS["short"]) < WINDOW < len(PROMPTS["long"])

    ckpts = Checkpoints(tmp_path_factory)
    path = ckpts.target("e2b", "text")
    model = mlx_mtp.load_model(path, drafter=ckpts.assistant("e2b"))
    for name, prompt in PROMPTS.items():
        ref = reference_greedy(path, prompt, 32)
        assert tokens(model, prompt, "auto", max_tokens=32) == ref, name
        for script in SCRIPTS[:2]:
            forced = ForcedAssistant(model.drafter, prompt + ref, schedule=[5, 0, 2, 1, 4, 3],
                                     vocab_size=model.target.vocab_size)
            fm = MTPModel(model.mlx_model, model.target, forced)
            chooser, stats = ScriptedChooser(5, script), RunStats()
            assert tokens(fm, prompt, chooser, max_tokens=32, stats=stats) == ref, (name, script)
            assert chooser.observed[: len(script)] == script
            assert stats.accepted == sum(forced.planned) > 0


@pytest.mark.parametrize("kw,msg", [
    ({"block_size": "big"}, "block_size must be an integer or 'auto', got 'big'"),
    ({"block_size": "auto", "max_block_size": 17}, "max_block_size must be between 1 and 16, "
                                                   "got 17"),
    ({"block_size": "auto", "max_block_size": "6"}, "max_block_size must be an integer, "
                                                    "got '6'"),
])
def test_bad_auto_arguments(dense_dir, kw, msg):
    model = mlx_mtp.load_model(dense_dir)
    with pytest.raises(MTPError) as e:
        next(mlx_mtp.generate_step(mx.array([5]), model, **kw))
    assert str(e.value) == msg


# ----------------------------------------------------------------------- sampled: reproducible


def keyed_plain(path, prompt, n, sampler, seed):
    """Plain sampling with per-position keys, one token at a time through mlx-lm's own model:
    t_n = argmax(sampler's logits at n + Gumbel noise of (seed, n))."""
    model, _ = mlx_load_model(path)
    keys, seq = PositionKeys(seed), list(prompt)
    for i in range(n):
        logits = model(mx.array(seq)[None])[0, -1:]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        noise = keys.noise(i, logits.shape[-1])
        seq.append(mx.argmax(sampler.logits(logprobs) + noise, axis=-1).item())
    return seq[len(prompt):]


@pytest.mark.slow
@pytest.mark.parametrize("acceptance,rule,settings", [
    ("auto", "gumbel-coupled", dict(temp=1.0, top_k=20)),
    ("point-mass", "point-mass", dict(temp=1.0, top_k=20)),
    # no filter: the loop adds the noise to raw logits (no log-normalization), the reference
    # to logprobs
    ("auto", "gumbel-coupled", dict(temp=0.7))])
def test_sampled_auto_is_keyed_plain_sampling_whatever_the_choices(soft_dir, soft_model,
                                                                   acceptance, rule, settings):
    sampler = mlx_mtp.make_sampler(**settings)
    prompt, n = [5, 17], 30
    want = keyed_plain(soft_dir, prompt, n, sampler, seed=7)
    stats = RunStats()
    mx.random.seed(0)
    assert tokens(soft_model, prompt, "auto", max_tokens=n, sampler=sampler, seed=7,
                  acceptance=acceptance, stats=stats) == want
    assert stats.acceptance_rule == rule  # what auto chose depends on timings: not asserted
    for script in SCRIPTS:
        mx.random.seed(123)  # the global random state plays no part
        scripted = RunStats()
        assert tokens(soft_model, prompt, ScriptedChooser(5, script), max_tokens=n,
                      sampler=sampler, seed=7, acceptance=acceptance, stats=scripted) == want
        assert scripted.accepted > 0 or script == [0], script  # drafts were kept, not just made
    stretched = RunStats()
    assert tokens(soft_model, prompt, StretchChooser(5, STRETCHES), max_tokens=n,
                  sampler=sampler, seed=7, acceptance=acceptance, stats=stretched) == want
    assert stretched.undrafted_steps >= 3 + 5
    assert tokens(soft_model, prompt, "auto", max_tokens=n, sampler=sampler, seed=8,
                  acceptance=acceptance) != want


def test_coupled_drafts_agree_with_the_target_when_the_head_does(soft_model):
    """The coupled draft uses the target's own noise: with a head that agrees with its target
    most drafts are kept even at temperature 1 (point-mass keeps only the argmax)."""
    sampler = mlx_mtp.make_sampler(temp=1.0)
    rates = {}
    for acceptance in ("auto", "point-mass"):
        stats = RunStats()
        tokens(soft_model, [5, 17], ScriptedChooser(3, [3]), max_tokens=60, sampler=sampler,
               seed=3, acceptance=acceptance, stats=stats)
        rates[stats.acceptance_rule] = stats.acceptance_rate
    assert rates["gumbel-coupled"] > rates["point-mass"], rates


def test_coupled_rounds_draw_each_positions_noise_once(soft_model, monkeypatch):
    """A coupled draft and the target's draw at its position share G_n: the verify reuses the
    drafts' noise, so a round of k drafts makes k + 1 noise rows (not 2k + 1)."""
    made = []
    noise = PositionKeys.noise
    monkeypatch.setattr(PositionKeys, "noise",
                        lambda self, n, vocab: made.append(n) or noise(self, n, vocab))
    sampler = mlx_mtp.make_sampler(temp=1.0)
    stats = RunStats()
    out = tokens(soft_model, [5, 17], ScriptedChooser(3, [3, 1, 2]), max_tokens=30,
                 sampler=sampler, seed=3, stats=stats)
    assert stats.acceptance_rule == "gumbel-coupled" and stats.drafted > stats.rounds
    assert len(made) == 1 + stats.rounds + stats.drafted
    monkeypatch.setattr(PositionKeys, "noise", noise)
    assert tokens(soft_model, [5, 17], ScriptedChooser(3, [0]), max_tokens=30,
                  sampler=sampler, seed=3) == out  # the same draws as rounds without drafts


def test_coupled_drafts_on_a_draft_vocabulary_use_the_noise_of_their_ids(soft_model):
    """A drafter covering ids through a table must see G_n at those ids: the whole vocabulary
    in another order then drafts exactly the tokens the plain drafter drafts."""
    sampler = mlx_mtp.make_sampler(temp=1.0)
    drafted = []
    ids = range(soft_model.target.vocab_size)
    # the plain drafter's ids through the same spy (unpermuted), then the reversed vocabulary
    for table in (ids, ids[::-1]):
        drafter = TableDrafter(soft_model.drafter, table)
        model = MTPModel(soft_model.mlx_model, soft_model.target, drafter)
        stats = RunStats()
        tokens(model, [5, 17], ScriptedChooser(3, [3, 0, 2]), max_tokens=30, sampler=sampler,
               seed=5, stats=stats)
        assert stats.acceptance_rule == "gumbel-coupled" and stats.accepted > 0
        drafted.append(drafter.drafted)
    assert drafted[0] == drafted[1] and len(drafted[0]) > 10


def test_an_mlx_lm_sampler_function_is_reproducible_under_auto(soft_model):
    sampler = mlx_make_sampler(temp=1.0)
    prompt, n = [5, 17], 20
    runs = [tokens(soft_model, prompt, ScriptedChooser(5, s), max_tokens=n, sampler=sampler,
                   seed=4) for s in SCRIPTS]
    assert runs[0] == runs[1] == runs[2]
    assert tokens(soft_model, prompt, "auto", max_tokens=n, sampler=sampler, seed=5) != runs[0]


@pytest.mark.slow
def test_the_keyed_draw_has_the_sampled_distribution():
    logits = mx.array([[0.0, 1.0, 2.0, -1.0, 0.5, -mx.inf]])
    sampler = mlx_mtp.make_sampler(temp=0.7)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    probs = np.array(sampler.probs(logprobs))[0]
    keys = PositionKeys(11)
    from mlx_mtp.decoding.keyed_sampling import draw

    draws = draw(sampler, mx.repeat(logprobs, 4000, axis=0), keys, 0).tolist()
    stat, dof, p = goodness_of_fit(draws, {i: float(q) for i, q in enumerate(probs)})
    assert p > 1e-3 and dof == 4, (stat, dof, p)
    # and a biased draw (temperature 1 instead of 0.7) is caught by the same test
    biased = draw(mlx_mtp.make_sampler(temp=1.0), mx.repeat(logprobs, 4000, axis=0), keys,
                  0).tolist()
    assert goodness_of_fit(biased, {i: float(q) for i, q in enumerate(probs)})[2] < 1e-3


def test_speculative_sampling_is_refused_under_auto(soft_model):
    with pytest.raises(MTPError) as e:
        next(mlx_mtp.generate_step(mx.array([5]), soft_model,
                                   sampler=mlx_mtp.make_sampler(temp=1.0),
                                   acceptance="speculative-sampling"))
    assert str(e.value) == (
        "acceptance speculative-sampling cannot be reproduced with block size auto (its draws "
        "depend on the drafts per round, which auto picks from timings): use a fixed block size, "
        "or acceptance auto (gumbel-coupled) or point-mass")


# --------------------------------------------------------------------------------------- CLI


@pytest.mark.subprocess
def test_cli_auto_is_the_default_and_reports_the_widths(dense_dir):
    prompt = "def add(a, b):\n    return"
    out = json.loads(cli("--model", dense_dir, "--prompt", prompt, "--max-tokens", 16,
                         "--max-block-size", 4, "--ignore-chat-template", "--json").stdout)
    ref = reference_greedy(dense_dir, load_tokenizer(dense_dir).encode(prompt), 16)
    assert out["tokens"] == ref
    assert out["block_size"] == "auto" and out["max_block_size"] == 4
    assert sum(out["block_sizes"].values()) == out["rounds"]
    assert set(out["block_sizes"]) <= {"1", "2", "3", "4"}
    # each drafted width timed twice or more has its rounds' spread (the rounds are the width's
    # rounds); one-token steps (auto's stretches without drafts) have no time of their own, so
    # width 1 counts only its timed rounds, if any
    spread, used = out["round_spread_by_width"], out["block_sizes"]
    drafted = {w for w, n in used.items() if n >= 2 and w != "1"}
    assert spread and drafted <= set(spread) <= {w for w, n in used.items() if n >= 2}
    assert all(v["rounds"] == used[w] for w, v in spread.items() if w != "1")
    assert all(2 <= v["rounds"] <= used[w] and v["log_sd"] >= 0 for w, v in spread.items())
    assert [w["width"] for w in out["exactness"]["widths"]] == [2, 3, 4]
    text = cli("--model", dense_dir, "--prompt", prompt, "--max-tokens", 8,
               "--block-size", "auto", "--ignore-chat-template").stderr  # the stats table
    assert "auto (up to 6)" in text and "block sizes used (width: rounds)" in text


@pytest.mark.subprocess
def test_cli_auto_sampling_is_reproducible_and_says_its_rule(soft_dir):
    args = ["--model", soft_dir, "--prompt", "def add", "--ignore-chat-template",
            "--max-tokens", 24, "--temp", 1.0, "--top-k", 5, "--json"]
    a = json.loads(cli(*args, "--seed", 7).stdout)
    assert a["acceptance_rule"] == "gumbel-coupled" and a["block_size"] == "auto"
    assert json.loads(cli(*args, "--seed", 7).stdout)["tokens"] == a["tokens"]
    assert json.loads(cli(*args, "--seed", 7, "--max-block-size", 2).stdout)["tokens"] == \
        a["tokens"]
    r = cli(*args, "--seed", 7, "--acceptance", "speculative-sampling", check=False)
    assert r.returncode == 1 and r.stderr.startswith(
        "error: acceptance speculative-sampling cannot be reproduced with block size auto")


@pytest.mark.subprocess
@pytest.mark.parametrize("args,err", [
    (["--block-size", "x"], "error: argument --block-size: expected an integer or 'auto', "
                            "got 'x'"),
    (["--max-block-size", "auto"], "error: argument --max-block-size: expected an integer, "
                                   "got 'auto'"),
    (["--max-block-size", "0"], "error: argument --max-block-size: must be between 1 and 16, "
                                "got 0"),
])
def test_cli_bad_block_flags(args, err):
    r = cli(*args, check=False)
    assert r.returncode == 2 and r.stderr.strip() == err
