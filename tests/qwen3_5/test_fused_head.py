"""Issue 12 part 4: the merged head (``fused_head``) the compiled draft step runs."""

import mlx.core as mx
import pytest
from support.head_round_trip import draft_accept_draft
from support.reference import reference_greedy
from mlx_lm.models.cache import KVCache

import mlx_mtp
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.models.qwen3_5.compiled_head import CompiledHead
from mlx_mtp.models.qwen3_5.drafter import MTPHead, QwenMTPDrafter
from mlx_mtp.models.qwen3_5.fused_head import FusedHead, fusable
from mlx_mtp.models.options import DraftOptions

PROMPT = [5, 17, 3, 99, 42, 7, 250, 31, 64, 12]


def kv_bytes(caches):
    return [bytes(memoryview(a[..., : c.offset, :])) for c in caches for a in (c.keys, c.values)]


def load(kind, request, dense_dir):
    return mlx_mtp.load_model(request.getfixturevalue(f"{kind}_dir"),
                              drafter=dense_dir if kind == "q4" else None)


@pytest.mark.parametrize("kind", ["dense", "tied", "wide", "q4"])
def test_merged_head_computes_the_head(kind, request, dense_dir):
    """Eager and compiled, through calls of 1-4 rows with trims between them: the merged head
    picks the head's ids, its output agrees to rounding and its K/V entries to rounding."""
    model = load(kind, request, dense_dir)
    head, target = model.drafter.head, model.target
    assert fusable(head) and model.drafter.describe()["merged"]
    fused = FusedHead(head)
    H = target.hidden_size
    hidden = mx.random.normal((1, 40, H), key=mx.random.key(1)).astype(target.dtype)
    ids = mx.random.randint(0, target.vocab_size, (40,), key=mx.random.key(2)).astype(mx.uint32)
    ref, eager, comp = ([KVCache() for _ in head.layers] for _ in range(3))
    for caches in (ref, eager, comp):
        head(target.embed(ids[None, :20]), hidden[:, :20], caches)
    compiled = CompiledHead(head, fast=fused)
    pos = 20
    for rows, trim in [(1, 0), (3, 1), (2, 2), (1, 0), (4, 1), (1, 1)]:
        e, h = target.embed(ids[None, pos : pos + rows]), hidden[:, pos : pos + rows]
        want, got, got_c = head(e, h, ref), fused(e, h, eager), compiled(e, h, comp)
        mx.eval(want, got, got_c)
        assert [c.offset for c in eager] == [c.offset for c in comp] == [pos + rows]
        for out in (got, got_c):
            assert mx.allclose(out, want, rtol=1e-4, atol=1e-5).item(), (kind, pos, rows)
            assert (mx.argmax(target.logits(out), -1).tolist()
                    == mx.argmax(target.logits(want), -1).tolist())
        for caches in (eager, comp):
            for a, b in zip(caches, ref):
                assert mx.allclose(a.keys[..., : a.offset, :], b.keys[..., : b.offset, :],
                                   rtol=1e-4, atol=1e-5).item()
                assert mx.allclose(a.values[..., : a.offset, :], b.values[..., : b.offset, :],
                                   rtol=1e-4, atol=1e-5).item()
        for c in ref + eager + comp:
            c.trim(trim)
        pos += rows - trim


@pytest.mark.parametrize("kind", ["quantized", "moe", "next"])
def test_heads_it_cannot_merge_run_as_they_are(kind, request, dense_dir):
    """A quantized head or a mixture-of-experts MLP is not rearranged: the head itself runs."""
    model = (mlx_mtp.load_model(dense_dir, draft_options=DraftOptions(bits=4))
             if kind == "quantized" else load(kind, request, dense_dir))
    assert not fusable(model.drafter.head)
    assert not model.drafter.describe()["merged"] and model.drafter.describe()["compiled"]
    assert model.drafter.compiled.fast is None


def test_merged_is_a_switch(dense_dir):
    model = mlx_mtp.load_model(dense_dir)
    head, target = model.drafter.head, model.target
    on = QwenMTPDrafter(head, target, DraftOptions())
    off = QwenMTPDrafter(head, target, DraftOptions(merged=False))
    eager = QwenMTPDrafter(head, target, DraftOptions(compiled=False))
    assert isinstance(on.compiled.fast, FusedHead)
    assert off.compiled.fast is None and eager.compiled is None
    assert [d.describe()["merged"] for d in (on, off, eager)] == [True, False, False]


def test_drafts_are_deterministic_and_the_output_is_plain_decode(dense_dir):
    """Two merged drafters draft the same ids; on this checkpoint they are the unmerged
    drafter's ids; the output is mlx-lm's greedy decode at every block size."""
    model = mlx_mtp.load_model(dense_dir)
    target = model.target
    cache = target.make_cache()
    p = mx.array(PROMPT)
    h = target.hidden(p[None, :-1], cache)
    drafts = []
    for opts in (DraftOptions(), DraftOptions(), DraftOptions(merged=False)):
        drafts.append(draft_accept_draft(QwenMTPDrafter(model.drafter.head, target, opts), h, p))
    assert drafts[0] == drafts[1] == drafts[2]
    ref = reference_greedy(dense_dir, PROMPT, 24)
    assert model.drafter.describe()["merged"]
    for bs in (2, 3, 5):
        out = [t for t, _ in mlx_mtp.generate_step(p, model, max_tokens=24, block_size=bs,
                                                   stats=RunStats())]
        assert out == ref, bs


def test_a_head_whose_class_is_swapped_runs_its_own_forward(dense_dir):
    """The merged head stands for the class it was built from; a head given another class
    afterwards (as tests of wiring mistakes do) is traced as it is."""
    model = mlx_mtp.load_model(dense_dir)
    d = model.drafter
    seen = []

    class Recording(MTPHead):
        def __call__(self, embeds, hidden, cache):
            seen.append(embeds.shape[1])
            return MTPHead.__call__(self, embeds, hidden, cache)

    d.head.__class__ = Recording
    target = model.target
    p = mx.array(PROMPT)
    h = target.hidden(p[None, :-1], target.make_cache())
    d.reset()
    d.prefill(h, p[1:])  # eager: the head's own call
    mx.eval(d.draft(3))  # one compiled draft step, traced from Recording's call
    assert seen == [len(PROMPT) - 1, 1]
