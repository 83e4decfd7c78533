"""The chain-or-tree choice under ``auto`` (``ShapeChooser``): turns while exploring, then the
faster shape by its recent median rate, the slower one re-measured every ``reprobe`` rounds."""

from mlx_mtp.decoding.shape_chooser import ShapeChooser


def run(chooser, rounds, rate):
    """``rounds`` choices, each observed at ``rate[shape]`` tokens per second (3 tokens)."""
    shapes = []
    for _ in range(rounds):
        tree = chooser.choose()
        shapes.append(tree)
        chooser.observe(tree, 3, 3 / rate[tree], drafts=2)
    return shapes


def test_takes_turns_then_keeps_the_faster_shape_and_reprobes_the_other():
    c = ShapeChooser(depth=5, explore=3, reprobe=4)
    shapes = run(c, 6, {False: 10.0, True: 20.0})
    assert shapes == [False, True, False, True, False, True]  # a chain first, then turns
    assert c.depth == 2  # the chain rounds' drafts
    shapes = run(c, 10, {False: 10.0, True: 20.0})
    # trees are faster: trees, and the chain once whenever it has not run for 4 rounds
    assert shapes == [True, True, True, False, True, True, True, True, False, True]
    assert c.rounds == {False: 5, True: 11}


def test_follows_a_change_of_the_faster_shape():
    c = ShapeChooser(depth=2, explore=2, reprobe=3, window=3)
    run(c, 4, {False: 10.0, True: 20.0})
    assert run(c, 3, {False: 10.0, True: 20.0}) == [True, True, False]  # the chain re-measured
    # trees turn slow: once the tree's median is a slow round (its second), chains take over,
    # and a tree is re-measured whenever none ran for 3 rounds
    shapes = run(c, 12, {False: 10.0, True: 5.0})
    assert shapes == [True, True, False, False, False, True, False, False, False, True, False,
                      False]
    assert c.rate(True) == 5.0


def test_a_round_without_time_counts_but_gives_no_rate():
    c = ShapeChooser(depth=2)
    c.observe(True, 3, 0.0)
    assert c.rate(True) == 0.0 and c.rounds[True] == 1 and c.since[False] == 1
