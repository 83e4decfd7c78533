"""The tree-vs-chain probe: a tree verify equal to its chains lets trees run; one that is not
makes the session draft chains, say why, and keep mlx-lm's output."""

import mlx.core as mx
import pytest
from support.reference import reference_greedy
from support.perturbed import one_ulp

import mlx_mtp
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.exactness import tree_vs_chain
from mlx_mtp.exactness.block_vs_chain import DIVERGES, EQUAL
from mlx_mtp.exactness.tree_vs_chain import probe_parents, probe_tree_exactness

PROMPT = [5, 17, 42, 99, 7, 250, 3, 64]


@pytest.mark.parametrize("topk, nodes, depth, want", [
    (2, 4, 2, [-1, 0, 0, 1, 1]),
    (2, 6, 3, [-1, 0, 0, 1, 1, 2, 3]),
    (3, 4, 3, [-1, 0, 0, 1, 3]),  # the budget keeps a path to depth 3
    (4, 3, 1, [-1, 0, 0, 0]),
    (1, 3, 3, [-1, 0, 1, 2]),
])
def test_probe_trees_reach_their_depth_within_the_budget(topk, nodes, depth, want):
    assert probe_parents(topk, nodes, depth) == want


def test_an_exact_tree_verify_probes_equal(dense_dir):
    model = mlx_mtp.load_model(dense_dir)
    result = probe_tree_exactness(model.target, 2, 6, 3)
    assert result.verdict == EQUAL
    assert result.width == 7 and result.config == "tree: top 2, 6 nodes, depth 3"
    assert probe_tree_exactness(model.target, 2, 6, 3).cached


class SkewedTree:
    """A tree verify one ulp off at node 2 (a second sibling): chains stay exact."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, ids, cache, tree):
        return one_ulp(self.inner(ids, cache, tree), 2)


def test_a_tree_verify_that_differs_is_declined_to_chains(dense_dir, monkeypatch):
    model = mlx_mtp.load_model(dense_dir)
    monkeypatch.setattr(model.target, "verify_tree", SkewedTree(model.target.verify_tree))
    tree_vs_chain._MEMO.clear()
    result = probe_tree_exactness(model.target, 2, 4, 2)
    assert (result.verdict, result.position) == (DIVERGES, 2)
    stats = RunStats()
    out = [t for t, _ in mlx_mtp.generate_step(mx.array(PROMPT), model, max_tokens=16,
                                               block_size=3, draft_topk=2, stats=stats)]
    assert out == reference_greedy(dense_dir, PROMPT, 16)
    assert "draft tree declined, drafting chains: exactness probe on" in stats.gate_reason
    assert "position 2 differs" in stats.gate_reason
    d = stats.to_dict()
    assert (d["draft_topk"], d["tree_nodes_per_round"], d["exactness"]["tree"]["verdict"]) == \
        (1, 0.0, DIVERGES)
    assert stats.rounds > 0 and stats.mtp_enabled
