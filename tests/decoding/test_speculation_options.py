"""``SpeculationOptions``: every check of the speculation settings, its error line for each bad
value (the API's names, and the CLIs' flags with ``CLI_NAMES``), and what it derives."""

from dataclasses import FrozenInstanceError, replace
from types import SimpleNamespace

import pytest

from mlx_mtp import MTPError
from mlx_mtp.decoding.block_chooser import BlockChooser
from mlx_mtp.decoding.limits import MAX_BLOCK_SIZE, block_size_problem
from mlx_mtp.decoding.speculation import CLI_NAMES, SpeculationOptions
from mlx_mtp.draft_tree import TreeShape


@pytest.mark.parametrize("kw,msg", [
    (dict(block_size="big"), "block_size must be an integer or 'auto', got 'big'"),
    (dict(block_size=2.5), "block_size must be an integer, got 2.5"),
    (dict(block_size=True), "block_size must be an integer, got True"),
    (dict(block_size=0), "block_size must be between 1 and 16, got 0"),
    (dict(block_size=17), "block_size must be between 1 and 16, got 17"),
    (dict(max_block_size=17), "max_block_size must be between 1 and 16, got 17"),
    (dict(max_block_size=0), "max_block_size must be between 1 and 16, got 0"),
    (dict(max_block_size="6"), "max_block_size must be an integer, got '6'"),
    (dict(block_size=BlockChooser(16)),
     "the chooser's max block size must be between 1 and 16, got 17"),
    (dict(draft_topk=0), "draft_topk must be an integer from 1 to 8, got 0"),
    (dict(draft_topk=9), "draft_topk must be an integer from 1 to 8, got 9"),
    (dict(draft_topk=2.0), "draft_topk must be an integer from 1 to 8, got 2.0"),
    (dict(draft_topk=True), "draft_topk must be an integer from 1 to 8, got True"),
    (dict(block_size=3, draft_tokens=4),
     "draft_tokens with draft_topk 1 (a chain) is the block size less one, got 4"),
    (dict(block_size=1, draft_topk=2),
     "draft_topk above 1 drafts a tree: it needs a block_size of at least 2 (the tree's depth "
     "is the block size less one)"),
    (dict(block_size=3, draft_topk=2, draft_tokens=1),
     "draft_tokens must be an integer from the tree's depth (block_size less one: 2) to 15, "
     "got 1"),
    (dict(block_size=3, draft_topk=2, draft_tokens=16),
     "draft_tokens must be an integer from the tree's depth (block_size less one: 2) to 15, "
     "got 16"),
    (dict(block_size=3, draft_topk=2, draft_tokens=3.0),
     "draft_tokens must be an integer from the tree's depth (block_size less one: 2) to 15, "
     "got 3.0"),
    (dict(acceptance="bogus"),
     "acceptance must be one of auto, point-mass, speculative-sampling, got 'bogus'"),
])
def test_each_bad_value_is_one_line_naming_the_argument(kw, msg):
    with pytest.raises(MTPError) as e:
        SpeculationOptions(**kw)
    assert str(e.value) == msg


@pytest.mark.parametrize("kw,msg", [
    (dict(block_size="big"), "--block-size must be an integer or 'auto', got 'big'"),
    (dict(max_block_size=17), "--max-block-size must be between 1 and 16, got 17"),
    (dict(draft_topk=9), "--draft-topk must be an integer from 1 to 8, got 9"),
    (dict(draft_topk=2, draft_tokens=3),
     "--draft-tokens must be an integer from the tree's depth (--block-size less one: 5) to 15, "
     "got 3"),
    (dict(block_size=1, draft_topk=2),
     "--draft-topk above 1 drafts a tree: it needs a --block-size of at least 2 (the tree's "
     "depth is the block size less one)"),
    (dict(acceptance="bogus"),
     "--acceptance must be one of auto, point-mass, speculative-sampling, got 'bogus'"),
])
def test_with_cli_names_the_errors_name_the_flags(kw, msg):
    with pytest.raises(MTPError) as e:
        SpeculationOptions(**kw, names=CLI_NAMES)
    assert str(e.value) == msg


def test_a_fixed_block_size_ignores_max_block_size():
    """As ``generate_step`` always did: ``max_block_size`` bounds ``auto`` only."""
    assert SpeculationOptions(block_size=3, max_block_size=17).widest == 3


def test_what_it_derives():
    auto = SpeculationOptions()
    assert (auto.block_size, auto.max_block_size, auto.widest, auto.tree, auto.auto) == (
        "auto", 6, 6, None, True)
    fixed = SpeculationOptions(block_size=4)
    assert (fixed.widest, fixed.auto, fixed.make_chooser()) == (4, False, None)
    # a tree: draft_topk per depth by default, at most what the widest verify holds
    assert SpeculationOptions(block_size=3, draft_topk=2).tree == TreeShape(2, 4)
    assert SpeculationOptions(block_size=9, draft_topk=3).tree == TreeShape(3, MAX_BLOCK_SIZE - 1)
    assert SpeculationOptions(block_size=3, draft_topk=2, draft_tokens=5).tree == TreeShape(2, 5)
    # a chain's draft_tokens may repeat the block size less one
    assert SpeculationOptions(block_size=3, draft_tokens=2).tree is None


def test_auto_makes_a_fresh_chooser_per_generation_and_a_callers_is_kept():
    auto = SpeculationOptions(max_block_size=4)
    first, second = auto.make_chooser(), auto.make_chooser()
    assert first is not second and first.max_drafts == second.max_drafts == 3
    mine = BlockChooser(2)
    given = SpeculationOptions(block_size=mine, max_block_size=17)  # its own bound counts
    assert (given.widest, given.auto, given.make_chooser()) == (3, True, mine)


def test_frozen_and_replace_checks_again():
    opts = SpeculationOptions(block_size=3, names=CLI_NAMES)
    with pytest.raises(FrozenInstanceError):
        opts.block_size = 4
    assert replace(opts, seed=7).seed == 7 and replace(opts, seed=7).widest == 3
    with pytest.raises(MTPError, match=r"^--block-size must be between 1 and 16, got 0$"):
        replace(opts, block_size=0)  # the flags' names are kept
    assert opts == SpeculationOptions(block_size=3)  # the names are not part of the value


def test_as_kwargs_gives_the_same_options():
    opts = SpeculationOptions(block_size=3, draft_topk=2, draft_tokens=3,
                              acceptance="point-mass", seed=5)
    assert opts.as_kwargs() == {"block_size": 3, "max_block_size": 6, "draft_topk": 2,
                                "draft_tokens": 3, "acceptance": "point-mass", "seed": 5}
    assert SpeculationOptions(**opts.as_kwargs()) == opts


def test_trees_under_auto_draw_at_temperature_0_only():
    tree = SpeculationOptions(draft_topk=2)
    tree.check_sampling(False)
    with pytest.raises(MTPError) as e:
        tree.check_sampling(True)
    assert str(e.value) == ("draft_topk above 1 with block_size 'auto' runs at temperature 0 "
                            "only (auto's sampled draws are keyed per position); use a fixed "
                            "block_size to sample with trees")
    with pytest.raises(MTPError) as e:
        SpeculationOptions(block_size=BlockChooser(3), draft_topk=2).check_sampling(True)
    assert str(e.value).startswith("draft_topk above 1 with block_size 'auto' runs at")
    with pytest.raises(MTPError) as e:
        SpeculationOptions(draft_topk=2, names=CLI_NAMES).check_sampling(True)
    assert str(e.value) == ("--draft-topk above 1 with --block-size auto runs at --temp 0 only; "
                            "use a fixed --block-size to sample with trees")
    SpeculationOptions(block_size=3, draft_topk=2).check_sampling(True)  # fixed: sampled trees
    SpeculationOptions().check_sampling(True)  # chains


class ChainHead:
    """A drafter without ``draft_tree``."""


class TreeHead:
    def draft_tree(self, topk, nodes, depth):
        raise AssertionError("not drafted here")


def test_a_tree_needs_a_tree_drafter_and_an_unsplit_target():
    tree = SpeculationOptions(block_size=3, draft_topk=2)
    target = SimpleNamespace(keep_path=None)
    with pytest.raises(MTPError) as e:
        tree.check_model(SimpleNamespace(drafter=ChainHead(), target=target))
    assert str(e.value) == ("draft_topk above 1: this drafter (ChainHead) drafts chains only (a "
                            "drafter with draft_tree drafts trees)")
    with pytest.raises(MTPError) as e:
        tree.check_model(SimpleNamespace(drafter=TreeHead(), target=SimpleNamespace()))
    assert str(e.value).startswith("draft_topk above 1: this drafter (TreeHead) drafts chains")
    with pytest.raises(MTPError) as e:
        tree.check_model(SimpleNamespace(drafter=TreeHead(), target=target, split=object()))
    assert str(e.value) == "draft_topk above 1 (tree drafting) is not available on a split target"
    tree.check_model(SimpleNamespace(drafter=TreeHead(), target=target))
    SpeculationOptions(block_size=3).check_model(  # chains need nothing of the model
        SimpleNamespace(drafter=ChainHead(), target=SimpleNamespace(), split=object()))


def test_block_size_problem_is_the_one_bound():
    assert block_size_problem(1) is None and block_size_problem(MAX_BLOCK_SIZE) is None
    assert block_size_problem(MAX_BLOCK_SIZE + 1) == "must be between 1 and 16, got 17"
