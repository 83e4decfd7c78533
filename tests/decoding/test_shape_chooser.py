"""The chain-or-tree choice under ``auto`` (``ShapeChooser``): turns while exploring, then the
faster shape by its recent rate (mean tokens over median time), the slower one re-measured at gaps
that double while it stays behind and start again when the faster shape changes."""

from mlx_mtp.decoding.shape_chooser import ShapeChooser

CHAIN, TREE = False, True


def run(chooser, rounds, rate):
    """``rounds`` choices, each observed at ``rate[shape]`` tokens per second (3 tokens, a chain
    round of 2 drafts)."""
    shapes = []
    for _ in range(rounds):
        tree = chooser.choose()
        shapes.append(tree)
        chooser.record_round(tree, 3, 3 / rate[tree], drafts=2)
    return shapes


def probes(shapes, shape):
    return [i for i, s in enumerate(shapes) if s == shape]


def test_takes_turns_then_keeps_the_faster_shape_and_backs_off_the_other():
    c = ShapeChooser(depth=5, explore=2, reprobe=4, max_gap=16)
    assert run(c, 4, {CHAIN: 10.0, TREE: 20.0}) == [CHAIN, TREE, CHAIN, TREE]
    assert c.depth == 2  # the chain rounds' drafts
    shapes = run(c, 40, {CHAIN: 10.0, TREE: 20.0})
    # trees are faster; the chain is re-measured after 4, 8, then 16 rounds without it
    assert probes(shapes, CHAIN) == [3, 12, 29]
    assert c.rounds == {CHAIN: 5, TREE: 39}


def test_a_losing_tree_costs_ever_fewer_rounds():
    c = ShapeChooser(depth=3, explore=2, reprobe=4, max_gap=16)
    run(c, 4, {CHAIN: 20.0, TREE: 10.0})
    shapes = run(c, 60, {CHAIN: 20.0, TREE: 10.0})
    assert probes(shapes, TREE) == [4, 13, 30, 47]  # gaps 4, 8, 16, 16 (the cap)


def test_follows_a_change_of_the_faster_shape_and_watches_closely_again():
    c = ShapeChooser(depth=3, explore=2, reprobe=4, max_gap=16)
    run(c, 4, {CHAIN: 20.0, TREE: 10.0})
    run(c, 60, {CHAIN: 20.0, TREE: 10.0})  # the gap has grown to the cap
    shapes = run(c, 12, {CHAIN: 5.0, TREE: 10.0})
    # chains turn slow: the next tree probe (the cap: 16 rounds since the last) finds trees
    # faster, the chain's median time being half slow rounds by then; trees lead from there, the
    # chain re-measured at gap 4
    assert shapes == [CHAIN, CHAIN, CHAIN, CHAIN, TREE, TREE, TREE, TREE, CHAIN, TREE, TREE,
                      TREE]
    assert c.gap == 8  # back to 4 at the change, doubled after the chain probe that lost


def test_the_rate_is_mean_tokens_over_median_time():
    """Five rounds emitting 1, 1, 1, 6 and 1 tokens, the first in 500 ms (its graphs compiled),
    the others in 10 ms: 2 tokens a round at a median 10 ms, 200 tokens per second, where a
    median of per-round rates would say 100."""
    c = ShapeChooser(depth=3)
    for tokens, seconds in [(1, 0.5), (1, 0.01), (1, 0.01), (6, 0.01), (1, 0.01)]:
        c.record_round(CHAIN, tokens, seconds)
    assert c.rate(CHAIN) == 2 / 0.01 and c.rate(TREE) == 0.0


def test_a_round_without_time_counts_but_gives_no_rate():
    c = ShapeChooser(depth=2)
    c.record_round(TREE, 3, 0.0)
    assert c.rate(TREE) == 0.0 and c.rounds[TREE] == 1 and c.since[CHAIN] == 1
