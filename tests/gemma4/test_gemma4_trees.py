"""Draft trees on Gemma 4: every node's verify row is the decode step of the chain through its
path (sliding and full attention, KV-shared layers, past the window), the committed path leaves
the caches bitwise as plain decode does, and the assistant drafts trees that give mlx-lm's greedy
output."""

import mlx.core as mx
import pytest
from support.reference import reference_greedy
from mlx_lm.utils import load_model as mlx_load_model
from support.commits import committed
from support.oracle import OracleTreeDrafter
from support.tiny_gemma4 import WINDOW, Checkpoints

import mlx_mtp
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.exactness.block_vs_chain import EQUAL
from mlx_mtp.exactness.tree_vs_chain import probe_tree_exactness
from mlx_mtp.draft_tree import DraftTree
from mlx_mtp.models.model import MTPModel

PROMPTS = {"short": [(7 * i + 3) % 300 for i in range(5)],  # crosses the window while decoding
           "long": [(11 * i + 5) % 300 for i in range(40)]}  # longer than the window
assert len(PROMPTS["short"]) < WINDOW < len(PROMPTS["long"])
PARENTS = [-1, 0, 0, 0, 2, 2, 3, 4, 6]  # paths of lengths 2..4 that share prefixes
SLOW = [pytest.param(k, marks=pytest.mark.slow) for k in ("31b", "26b")]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return Checkpoints(tmp_path_factory)


def bitwise(a, b):
    mx.eval(a, b)
    return a.shape == b.shape and a.dtype == b.dtype and \
        bytes(memoryview(a)) == bytes(memoryview(b))


@pytest.mark.parametrize("kind", ["e2b"] + SLOW)
def test_every_tree_row_equals_the_chain_through_its_path(kind, ckpts):
    model = mlx_mtp.load_model(ckpts.target(kind), require_head=False)
    target = model.target
    target.prepare(len(PARENTS))
    for prompt in PROMPTS.values():
        tokens = [(37 * i + 11) % target.vocab_size for i in range(1, len(PARENTS))]
        tree = DraftTree(mx.array(tokens, dtype=mx.uint32), tokens, PARENTS,
                         [0] * len(tokens))

        def prefilled():
            cache = target.make_cache()
            target.hidden(mx.array(prompt[:-1])[None], cache)
            return cache

        cache = prefilled()
        rows = target.verify_tree(mx.array([[prompt[-1]] + tokens]), cache, tree)
        for leaf in tree.leaves():
            nodes = tree.path(leaf)
            chain = target.verify(mx.array([[prompt[-1]] + [tokens[n - 1] for n in nodes[1:]]]),
                                  chain_cache := prefilled())
            for j, node in enumerate(nodes):
                assert bitwise(rows[:, node], chain[:, j]), (kind, leaf, node)
        kept = tree.path(8)  # [0, 3, 6, 8]
        target.keep_path(cache, len(PARENTS), kept)
        target.verify(mx.array([[prompt[-1]] + [tokens[n - 1] for n in kept[1:]]]),
                      chain_cache := prefilled())
        target.rollback(chain_cache, fed=len(kept), keep=len(kept))
        got, want = target.cache_state(cache), target.cache_state(chain_cache)
        assert len(got) == len(want) and all(bitwise(g, w) for g, w in zip(got, want)), kind
        # and a later rewind rolls the kept path back like a chain's rows
        target.rewind(cache, kept=len(kept), keep=2)
        target.rewind(chain_cache, kept=len(kept), keep=2)
        assert all(bitwise(g, w) for g, w in zip(target.cache_state(cache),
                                                 target.cache_state(chain_cache)))


def test_the_tree_probe_finds_gemma_trees_exact(ckpts):
    model = mlx_mtp.load_model(ckpts.target("e2b"), require_head=False)
    assert probe_tree_exactness(model.target, 3, 7, 3).verdict == EQUAL


@pytest.mark.parametrize("kind", ["e2b", pytest.param("31b", marks=pytest.mark.slow)])
def test_planted_trees_keep_gemma_caches_as_plain_decode(kind, ckpts):
    """Trees whose true path runs through first and second siblings: the output is mlx-lm's, and
    after every round the caches are bitwise (layout included) what plain decode holds."""
    path = ckpts.target(kind)
    model = mlx_mtp.load_model(path, drafter=ckpts.assistant(kind))
    target = model.target
    prompt = PROMPTS["long"]
    n = 30
    ref = reference_greedy(path, prompt, n)
    full = prompt + ref
    pristine, _ = mlx_load_model(path)
    stock = pristine.make_cache()
    pristine.model(mx.array(prompt[:-1])[None], cache=stock)
    states = {}
    for p in range(len(prompt) - 1, len(full) - 1):
        pristine.model(mx.array(full[p : p + 1])[None], cache=stock)
        states[p + 1] = [a[...] for c in stock for a in (c.keys, c.values)]
        mx.eval(states[p + 1])
    for depth in (2, 4):
        oracle = OracleTreeDrafter(full, [depth, 0, 1, depth - 1], target.vocab_size,
                                   inner=model.drafter)
        oracle.bind_cache = model.drafter.bind_cache
        stats = RunStats()
        with committed(target, "keep_path") as seen:
            out, checked = [], 0
            for tok, _ in mlx_mtp.generate_step(
                    mx.array(prompt), MTPModel(model.mlx_model, target, oracle), max_tokens=n,
                    block_size=depth + 1, draft_topk=2, draft_tokens=3 * depth - 1,
                    stats=stats):
                out.append(tok)
                c = seen.pop("cache", None)
                if c is not None:
                    p = target.offset(c)
                    got = target.cache_state(c)
                    assert len(got) == len(states[p])
                    assert all(bitwise(g, w) for g, w in zip(got, states[p])), (kind, depth, p)
                    checked += 1
        assert out == ref, (kind, depth)
        assert checked >= 5 and stats.accepted == sum(oracle.planned)
        assert len(stats.sibling_rank_hits) == 2 and min(stats.sibling_rank_hits) > 0


@pytest.mark.parametrize("kind", ["e2b"] + SLOW)
def test_assistant_trees_give_greedy_output(kind, ckpts):
    path = ckpts.target(kind)
    model = mlx_mtp.load_model(path, drafter=ckpts.assistant(kind))
    for prompt in PROMPTS.values():
        ref = reference_greedy(path, prompt, 24)
        for block_size, topk, tokens in ((2, 3, None), (3, 2, None), (4, 2, 5)):
            stats = RunStats()
            out = [t for t, _ in mlx_mtp.generate_step(
                mx.array(prompt), model, max_tokens=24, block_size=block_size, draft_topk=topk,
                draft_tokens=tokens, stats=stats)]
            assert out == ref, (kind, block_size, topk)
            assert stats.to_dict()["tree_nodes_per_round"] > 0
