"""Phase 5: the compiled head forward (draft steps and accept hooks) against the eager one."""

import mlx.core as mx
import pytest
from support.head_round_trip import draft_accept_draft
from support.reference import reference_greedy
from mlx_lm.models.cache import KVCache

import mlx_mtp
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.models.qwen3_5 import compiled_head
from mlx_mtp.models.qwen3_5.compiled_head import CompiledHead
from mlx_mtp.models.qwen3_5.drafter import QwenMTPDrafter
from mlx_mtp.models.options import DraftOptions

PROMPT = [5, 17, 3, 99, 42, 7, 250, 31, 64, 12]


def kv_bytes(caches):
    return [bytes(memoryview(a[..., : c.offset, :])) for c in caches for a in (c.keys, c.values)]


@pytest.mark.parametrize("kind", ["dense", "tied", "q4", "moe", "next"])
def test_compiled_head_writes_the_eager_caches(kind, request, dense_dir):
    """Through calls of 1-4 rows with trims between them (as drafting and accepting do), and
    across a buffer growth at 256 entries: the K/V entries are bitwise the eager head's, the
    outputs agree to rounding and pick the same ids."""
    path = request.getfixturevalue(f"{kind}_dir")
    model = mlx_mtp.load_model(path, drafter=dense_dir if kind == "q4" else None)
    head, target = model.drafter.head, model.target
    H = target.hidden_size
    hidden = mx.random.normal((1, 300, H), key=mx.random.key(1)).astype(target.dtype)
    ids = mx.random.randint(0, target.vocab_size, (300,), key=mx.random.key(2)).astype(mx.uint32)
    eager = [KVCache() for _ in head.layers]
    comp = [KVCache() for _ in head.layers]
    start = 250
    for caches in (eager, comp):  # the prompt: eager in both (a long call)
        head(target.embed(ids[None, :start]), hidden[:, :start], caches)
    compiled = CompiledHead(head)
    pos = start
    for rows, trim in [(1, 0), (3, 1), (2, 2), (1, 0), (4, 1), (3, 0), (1, 1)]:
        e, h = target.embed(ids[None, pos : pos + rows]), hidden[:, pos : pos + rows]
        assert CompiledHead.usable(rows, comp)
        want, got = head(e, h, eager), compiled(e, h, comp)
        mx.eval(want, got)
        assert [c.offset for c in comp] == [c.offset for c in eager] == [pos + rows] * len(comp)
        assert kv_bytes(comp) == kv_bytes(eager), (kind, pos, rows)
        assert mx.allclose(got, want, rtol=1e-4, atol=1e-5).item(), (kind, pos, rows)
        assert mx.argmax(target.logits(got), -1).tolist() == mx.argmax(target.logits(want), -1).tolist()
        for c in eager + comp:
            c.trim(trim)
        pos += rows - trim
    assert comp[0].keys.shape[2] == 512  # grew past 256 in steps of 256, as KVCache does


def test_first_and_long_calls_stay_eager(dense_dir):
    model = mlx_mtp.load_model(dense_dir)
    caches = [KVCache() for _ in model.drafter.head.layers]
    assert not CompiledHead.usable(1, caches)  # nothing to take shapes and dtype from yet
    caches[0].update_and_fetch(mx.zeros((1, 2, 1, 8)), mx.zeros((1, 2, 1, 8)))
    assert CompiledHead.usable(compiled_head.MAX_ROWS, caches)
    assert not CompiledHead.usable(compiled_head.MAX_ROWS + 1, caches)


def test_drafts_and_output_with_and_without_compiling(dense_dir, monkeypatch):
    """Draft steps and accept hooks go through the compiled head; the greedy drafts are the
    eager drafter's and the output is mlx-lm's greedy decode either way."""
    model = mlx_mtp.load_model(dense_dir)
    target = model.target
    calls = []
    real = CompiledHead._run
    monkeypatch.setattr(CompiledHead, "_run",
                        lambda self, f, x, h, c: calls.append(x.shape[1]) or real(self, f, x, h, c))
    on = QwenMTPDrafter(model.drafter.head, target, DraftOptions(compiled=True))
    off = QwenMTPDrafter(model.drafter.head, target, DraftOptions(compiled=False))
    assert on.describe()["compiled"] and not off.describe()["compiled"]
    cache = target.make_cache()
    p = mx.array(PROMPT)
    h = target.hidden(p[None, :-1], cache)
    drafts = []
    for d in (on, off):
        d.reset()
        drafts.append(draft_accept_draft(d, h, p))
    assert drafts[0] == drafts[1]
    assert calls == [1] * 5 + [3] + [1] * 5  # prefill eager; five steps, the hook, five steps
    ref = reference_greedy(dense_dir, PROMPT, 24)
    for d in (on, off):
        model.drafter = d
        for bs in (2, 3, 5):
            stats = RunStats()
            out = [t for t, _ in mlx_mtp.generate_step(p, model, max_tokens=24, block_size=bs,
                                                       stats=stats)]
            assert out == ref, (d.describe()["compiled"], bs)


@pytest.mark.parametrize("reduced", [False, True])
@pytest.mark.parametrize("kind", ["dense", "tied", "q4", "moe", "next"])
def test_whole_step_is_the_split_step(kind, reduced, request, dense_dir):
    """The embedding lookup, head and LM head + argmax as one compiled call compute what the
    compiled head between an eager lookup and an eager LM head computes: the same drafts, the
    same logits and the same K/V entries, bit for bit (full and reduced draft vocabulary)."""
    path = request.getfixturevalue(f"{kind}_dir")
    model = mlx_mtp.load_model(path, drafter=dense_dir if kind == "q4" else None)
    target = model.target
    vocab = (mx.array(sorted({int(i) for i in mx.random.randint(
        0, target.vocab_size, (200,), key=mx.random.key(3)).tolist()} | set(PROMPT)))
        if reduced else None)
    cache = target.make_cache()
    p = mx.array(PROMPT)
    h = target.hidden(p[None, :-1], cache)
    seen = []
    for whole in (True, False):
        d = QwenMTPDrafter(model.drafter.head, target, DraftOptions(), vocab)
        assert d.whole_step
        d.whole_step = whole
        d.prefill(h[:, :6], p[1:7])
        first = d.draft(5)
        for c in d.cache:
            c.trim(d.in_round)
        d.in_round = 0
        d.accept(h[:, 6:9], p[7:10])  # an accept hook of three rows
        logits = d.first_draft_logits
        second = d.draft(4)
        mx.eval(second, logits)
        seen.append((first.tolist(), second.tolist(), bytes(memoryview(logits)),
                     kv_bytes(d.cache)))
    assert seen[0] == seen[1], kind


def test_whole_step_is_off_with_the_fused_argmax(dense_dir):
    model = mlx_mtp.load_model(dense_dir)
    on = QwenMTPDrafter(model.drafter.head, model.target, DraftOptions(fused_argmax=True))
    off = QwenMTPDrafter(model.drafter.head, model.target, DraftOptions(compiled=False))
    assert not on.whole_step and not off.whole_step
