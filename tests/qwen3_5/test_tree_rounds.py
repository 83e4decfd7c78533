"""Draft trees on the hybrid Qwen targets: every node's verify row is the chain's through its
ancestors, the committed path leaves the caches a sequential decode leaves, and T=0 output is
mlx-lm's greedy output for every tree shape."""

import mlx.core as mx
import numpy as np
import pytest
from support.reference import CODE_PROMPT, reference_greedy
from mlx_lm.models.cache import KVCache
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.utils import load_model as mlx_load_model
from support import tiny_checkpoints as tc
from support.commits import committed, drafter_fed
from support.oracle import OracleDrafter, OracleTreeDrafter

import mlx_mtp
from mlx_mtp import MTPError
from mlx_mtp.models.qwen3_5 import vocab_reduction
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.draft_tree import DraftTree
from mlx_mtp.models.model import MTPModel
from mlx_mtp.models.options import DraftOptions

N_TOKENS = 24
SLOW_KINDS = [pytest.param(k, marks=pytest.mark.slow) for k in ("moe", "tied", "next", "wide")]


def long_prompt(path):
    return load_tokenizer(path).encode(CODE_PROMPT)


def bitwise(a, b):
    mx.eval(a, b)
    return a.shape == b.shape and a.dtype == b.dtype and \
        bytes(memoryview(a)) == bytes(memoryview(b))


def run(model, prompt, block_size, topk, tokens=None, stats=None, n=N_TOKENS):
    return [t for t, _ in mlx_mtp.generate_step(
        mx.array(prompt), model, max_tokens=n, block_size=block_size, draft_topk=topk,
        draft_tokens=tokens, stats=stats)]


# A tree over 9 nodes, numbered breadth first: the root's three children, two grandchildren
# under the second child and one under the third, then a great-grandchild of each kind of path.
PARENTS = [-1, 0, 0, 0, 2, 2, 3, 4, 6]


@pytest.mark.parametrize("kind", ["dense"] + SLOW_KINDS)
def test_every_tree_row_equals_the_chain_through_its_ancestors(kind, request):
    """One tree verify against chain verifies of each root-to-leaf path from the same cache:
    every node's hidden state bitwise, and ``keep_path`` of a path that skips nodes leaves the
    caches bitwise as the chain verify and its rollback."""
    path = request.getfixturevalue(f"{kind}_dir")
    model = mlx_mtp.load_model(path, require_head=False)
    target = model.target
    target.prepare(len(PARENTS))
    prompt = long_prompt(path)[:12]
    tokens = [(37 * i + 11) % target.vocab_size for i in range(1, len(PARENTS))]
    tree = DraftTree(mx.array(tokens, dtype=mx.uint32), tokens, PARENTS, [0] * len(tokens))

    def prefilled():
        cache = target.make_cache()
        target.hidden(mx.array(prompt[:-1])[None], cache)
        return cache

    bonus = prompt[-1]
    cache = prefilled()
    rows = target.verify_tree(mx.array([[bonus] + tokens]), cache, tree)
    for leaf in tree.leaves():
        nodes = tree.path(leaf)
        chain_cache = prefilled()
        chain = target.verify(mx.array([[bonus] + [tokens[n - 1] for n in nodes[1:]]]),
                              chain_cache)
        for j, node in enumerate(nodes):
            assert bitwise(rows[:, node], chain[:, j]), (kind, leaf, node)
    kept = tree.path(8)  # [0, 3, 6, 8]: not consecutive nodes
    target.keep_path(cache, len(PARENTS), kept)
    chain_cache = prefilled()
    target.verify(mx.array([[bonus] + [tokens[n - 1] for n in kept[1:]]]), chain_cache)
    target.rollback(chain_cache, fed=len(kept), keep=len(kept))
    got, want = target.cache_state(cache), target.cache_state(chain_cache)
    assert len(got) == len(want)
    assert all(bitwise(g, w) for g, w in zip(got, want)), kind


def _snapshot(target, cache):
    arrays = target.cache_state(cache)
    mx.eval(arrays)
    return arrays


@pytest.mark.parametrize("kind", ["dense", pytest.param("next", marks=pytest.mark.slow)])
def test_planted_trees_are_exact_and_caches_match_sequential_decode(kind, request):
    """Trees whose true path runs through first and second siblings alike, with the next true
    token planted under a wrong sibling, accept every depth 0..D: the output is mlx-lm's greedy
    output, the target's caches after every round are bitwise a sequential decode's, and the
    head's cache holds exactly the committed positions."""
    path = request.getfixturevalue(f"{kind}_dir")
    model = mlx_mtp.load_model(path)
    prompt = long_prompt(path)
    ref = reference_greedy(path, prompt, 30)
    full = prompt + ref

    pristine, _ = mlx_load_model(path)
    trunk = pristine.language_model.model if kind != "next" else pristine.model
    ref_cache = pristine.make_cache()
    trunk(mx.array(prompt[:-1])[None], ref_cache)
    states = {}
    for p in range(len(prompt) - 1, len(full) - 1):
        trunk(mx.array(full[p : p + 1])[None], ref_cache)
        states[p + 1] = _snapshot(model.target, ref_cache)

    for depth in (1, 3, 4):
        oracle = OracleTreeDrafter(full, schedule=[depth, 0, 1, depth - 1, 2],
                                   vocab_size=model.target.vocab_size, inner=model.drafter)
        forced = MTPModel(model.mlx_model, model.target, oracle)
        stats = RunStats()
        with committed(model.target, "keep_path") as captured:
            out, checked = [], 0
            for tok, _ in mlx_mtp.generate_step(mx.array(prompt), forced, max_tokens=30,
                                                block_size=depth + 1, draft_topk=2,
                                                draft_tokens=3 * depth - 1, stats=stats):
                out.append(tok)
                cache = captured.pop("cache", None)
                if cache is None:
                    continue
                offset = next(c.offset for c in cache if isinstance(c, KVCache))
                got = _snapshot(model.target, cache)
                assert all(bitwise(g, w) for g, w in zip(got, states[offset])), (depth, offset)
                assert len(got) == len(states[offset])
                if not drafter_fed(offset, len(prompt), 30):
                    assert model.drafter.offset < offset  # the last drafting round's pairs
                    continue
                assert model.drafter.offset == offset
                checked += 1
        assert out == ref, depth
        assert checked >= 5
        assert stats.accepted == sum(oracle.planned)
        assert set(oracle.planned) >= {0, min(1, depth), depth}
        if depth > 1:  # the true path ran through second siblings too
            assert len(stats.sibling_rank_hits) == 2 and min(stats.sibling_rank_hits) > 0


@pytest.mark.parametrize("kind", ["dense"] + SLOW_KINDS)
def test_real_head_trees_give_greedy_output(kind, request):
    path = request.getfixturevalue(f"{kind}_dir")
    model = mlx_mtp.load_model(path)
    prompt = long_prompt(path)
    ref = reference_greedy(path, prompt, N_TOKENS)
    for block_size, topk, tokens in ((2, 2, None), (3, 2, None), (4, 3, 7), (5, 2, 12)):
        stats = RunStats()
        assert run(model, prompt, block_size, topk, tokens, stats) == ref, \
            (kind, block_size, topk)
        d = stats.to_dict()
        assert d["draft_topk"] == topk
        assert d["draft_tokens"] == (tokens or topk * (block_size - 1))
        assert 0 < d["tree_nodes_per_round"] <= d["draft_tokens"]


def test_trees_with_a_repetition_penalty_give_mlx_lms_output(dense_dir):
    """Each tree row's logits processors see the history through that node's path."""
    from mlx_lm.generate import generate_step as mlx_generate_step
    from mlx_lm.sample_utils import make_logits_processors

    model = mlx_mtp.load_model(dense_dir)
    prompt = long_prompt(dense_dir)
    processors = make_logits_processors(repetition_penalty=1.5, repetition_context_size=16)
    pristine, _ = mlx_load_model(dense_dir)
    ref = [t for t, _ in mlx_generate_step(mx.array(prompt), pristine, max_tokens=N_TOKENS,
                                           logits_processors=processors)]
    plain = reference_greedy(dense_dir, prompt, N_TOKENS)
    assert ref != plain  # the penalty changes this output: the test sees it applied
    for block_size, topk in ((3, 2), (4, 3)):
        out = [t for t, _ in mlx_mtp.generate_step(
            mx.array(prompt), model, max_tokens=N_TOKENS, block_size=block_size,
            draft_topk=topk, logits_processors=processors)]
        assert out == ref, (block_size, topk)


@pytest.fixture(scope="module")
def agreeing_dir(ckpt_root):
    return tc.write_agreeing_checkpoint(ckpt_root / "agreeing-trees", seed=3)


def test_trees_of_an_agreeing_head_accept_at_every_depth(agreeing_dir):
    model = mlx_mtp.load_model(agreeing_dir)
    prompt = [5, 17, 42, 99, 7, 250, 3, 64]
    ref = reference_greedy(agreeing_dir, prompt, 40)
    stats = RunStats()
    assert run(model, prompt, 4, 2, 6, stats, n=40) == ref
    assert stats.per_position_acceptance == [1.0, 1.0, 1.0]
    assert stats.tokens_per_round > 3.5
    assert stats.tree_nodes / stats.rounds > 5  # six nodes verified while the budget allows


def test_trees_with_every_drafter_phase_on(agreeing_dir, tmp_path):
    """A reduced draft vocabulary (built from the target's own output, where its drafts live),
    the fused argmax and a 4-bit head: trees draft only vocabulary ids, are accepted, and the
    output is mlx-lm's."""
    prompt = [5, 17, 42, 99, 7, 250, 3, 64]
    ref = reference_greedy(agreeing_dir, prompt, 40)
    base = mlx_mtp.load_model(agreeing_dir)
    vocab = base.target.vocab_size
    counts = np.bincount(np.array(ref), minlength=vocab)
    ids = np.sort(np.argsort(-counts, kind="stable")[: vocab // 2])
    vocab_reduction.write_sidecar(tmp_path / "v", ids, {
        "size": vocab // 2, "vocab_size": vocab,
        "tokenizer_sha256": vocab_reduction.tokenizer_sha256(load_tokenizer(agreeing_dir)),
        "head_sha256": vocab_reduction.head_sha256(base.target)})
    model = mlx_mtp.load_model(agreeing_dir, draft_options=DraftOptions(
        fused_argmax=True, fused_chunk=16, vocab=tmp_path / "v", bits=4))
    d = model.drafter.describe()
    assert d["reduced_vocab"] and d["fused_argmax"] and d["bits"] == [4], d
    drafted = []
    draft = model.drafter.draft_tree

    def spy(*args):
        tree = draft(*args)
        drafted.extend(tree.tokens)
        return tree

    model.drafter.draft_tree = spy
    stats = RunStats()
    assert run(model, prompt, 4, 2, 6, stats, n=40) == ref
    assert drafted and set(drafted) <= set(ids.tolist())
    assert stats.per_position_acceptance[0] > 0.5


def test_tree_settings_are_checked(dense_dir):
    model = mlx_mtp.load_model(dense_dir)
    prompt = [5, 17, 42]
    cases = [
        (dict(block_size=3, draft_topk=0), "draft_topk must be an integer from 1 to 8, got 0"),
        (dict(block_size=3, draft_topk=2, draft_tokens=1),
         r"draft_tokens must be an integer from the tree's depth \(block_size less one: 2\) to "
         "15, got 1"),
        (dict(block_size=3, draft_topk=1, draft_tokens=4),
         r"draft_tokens with draft_topk 1 \(a chain\) is the block size less one, got 4"),
        (dict(block_size="auto", draft_topk=2, sampler=mlx_mtp.make_sampler(temp=0.7)),
         r"draft_topk above 1 with block_size 'auto' runs at temperature 0 only"),
        (dict(block_size=1, draft_topk=2), "it needs a block_size of at least 2"),
        (dict(block_size=3, draft_topk=2, sampler=mlx_mtp.make_sampler(temp=0.7),
              acceptance="speculative-sampling"),
         "acceptance speculative-sampling drafts chains: a draft tree"),
    ]
    for kwargs, message in cases:
        with pytest.raises(MTPError, match=message):
            next(mlx_mtp.generate_step(mx.array(prompt), model, max_tokens=4, **kwargs))


def test_a_drafter_without_trees_says_so(dense_dir):
    model = mlx_mtp.load_model(dense_dir, require_head=False)
    chains = MTPModel(model.mlx_model, model.target,
                      OracleDrafter([0] * 8, [1], model.target.vocab_size))
    with pytest.raises(MTPError, match=r"draft_topk above 1: this drafter \(OracleDrafter\) "
                                       "drafts chains only"):
        next(mlx_mtp.generate_step(mx.array([5, 17, 42]), chains, max_tokens=4, block_size=3,
                                   draft_topk=2))


def test_auto_runs_chains_and_trees_and_gives_greedy_output(dense_dir, agreeing_dir):
    """``block_size="auto"`` with a tree: rounds of both shapes, mlx-lm's output."""
    for path, prompt in ((dense_dir, long_prompt(dense_dir)),
                         (agreeing_dir, [5, 17, 42, 99, 7, 250, 3, 64])):
        model = mlx_mtp.load_model(path)
        ref = reference_greedy(path, prompt, 48)
        stats = RunStats()
        assert run(model, prompt, "auto", 2, None, stats, n=48) == ref
        d = stats.to_dict()
        assert d["block_size"] == "auto" and d["draft_topk"] == 2 and d["draft_tokens"] == 10
        drafting = stats.rounds - stats.block_sizes.get(1, 0)
        assert 2 <= d["tree_rounds"] < drafting  # explored, and chains ran too
