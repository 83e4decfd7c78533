"""Phase 2a: the fused (chunked) LM head + argmax picks exactly the ids the unfused path picks,
ties included, on untied, tied, quantized and reduced heads."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from support.lm_heads import LinearTarget

import mlx_mtp
from mlx_mtp.models.qwen3_5.lm_head import DraftLMHead, HeadTensors, chunked_argmax
from mlx_mtp.models.options import DraftOptions
from mlx_mtp.models.qwen3_5.drafter import QwenMTPDrafter
from mlx_mtp.models.draft_profile import DraftProfiler

H = 64


def weights_with_ties(V, seed=0):
    """Random rows, plus rows 3, 70 and V - 2 equal to each other and dominant for ``x``: three
    exact ties, in different chunks, at the maximum."""
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((V, H)).astype(np.float32)
    x = rng.standard_normal((4, H)).astype(np.float32)
    top = 10.0 * x[0] / np.linalg.norm(x[0])
    for r in (3, 70, V - 2):
        W[r] = top
    return mx.array(W), mx.array(x)


def layers(W):
    V = W.shape[0]
    lin = nn.Linear(H, V, bias=False)
    lin.weight = W
    emb = nn.Embedding(V, H)
    emb.weight = W
    return {
        "linear": (lin, lin),
        "embedding": (emb, emb.as_linear),
        "quantized": (q := nn.QuantizedLinear.from_linear(lin, group_size=64, bits=4), q),
        "quantized_embedding": (qe := nn.QuantizedEmbedding.from_embedding(emb, 64, 4),
                                qe.as_linear),
    }


@pytest.mark.parametrize("kind", ["linear", "embedding", "quantized", "quantized_embedding"])
@pytest.mark.parametrize("V", [320, 1003])
@pytest.mark.parametrize("chunk", [8, 64, 256, 4096])
def test_chunked_argmax_is_argmax(kind, V, chunk):
    W, x = weights_with_ties(V)
    module, call = layers(W)[kind]
    full = call(x)
    want = mx.argmax(full, axis=-1)
    got = chunked_argmax(x, HeadTensors.of(module), chunk)
    assert got.tolist() == want.tolist()
    assert want[0].item() == 3  # the planted tie resolves to the lowest id
    # Each chunk is the same product as the matching columns of the full row, bit for bit.
    t = HeadTensors.of(module)
    parts = mx.concatenate([t.matmul(x, s, s + chunk) for s in range(0, V, chunk)], axis=-1)
    assert bytes(memoryview(parts)) == bytes(memoryview(full))


def test_reduced_rows_keep_their_target_ids():
    W, x = weights_with_ties(320)
    lin = nn.Linear(H, 320, bias=False)
    lin.weight = W
    ids = mx.array([0, 3, 5, 70, 200, 318], dtype=mx.uint32)
    for fused in (False, True):
        head = DraftLMHead(LinearTarget(lin), ids=ids, fused=fused, chunk=8)
        tok, logits = head.argmax(x, DraftProfiler())
        sub = x @ W[ids].T
        assert tok.tolist() == ids[mx.argmax(sub, axis=-1)].tolist()
        assert tok[0].item() == 3
        assert (logits is None) is fused
        assert head.project(x).shape == (4, 6)


@pytest.mark.parametrize("kind", ["linear", "embedding", "quantized", "quantized_embedding"])
def test_reduced_rows_layout(kind):
    """Unquantized reduced rows are stored transposed ([H, N], the faster one-row product);
    quantized ones keep their rows. Either way the product is the reduced head's (ids, ties
    included), and a chunk is the matching columns of the whole product, bit for bit."""
    W, x = weights_with_ties(320)
    module, call = layers(W)[kind]
    ids = mx.array([0, 3, 5, 70, 200, 318], dtype=mx.uint32)
    t = HeadTensors.of(module).take(ids)
    quantized = kind.startswith("quantized")
    assert t.transposed is not quantized and t.rows == 6
    assert t.weight.shape[0] == (6 if quantized else H)
    got = t.matmul(x)
    want = call(x)[:, ids]
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item()
    assert mx.argmax(got, -1).tolist() == mx.argmax(want, -1).tolist()
    assert mx.argmax(got, -1)[0].item() == 1  # row 3 of the head: the planted tie's first id
    parts = mx.concatenate([t.matmul(x, s, s + 2) for s in range(0, 6, 2)], axis=-1)
    assert bytes(memoryview(parts)) == bytes(memoryview(got))
    assert chunked_argmax(x, t, 8).tolist() == mx.argmax(got, -1).tolist()


def prompts_hidden(model, prompt):
    cache = model.target.make_cache()
    p = mx.array(prompt)
    return model.target.hidden(p[None, :-1], cache), p[1:]


@pytest.mark.parametrize("kind", ["dense", "tied", "q4", "moe"])
def test_fused_drafter_drafts_what_the_unfused_one_drafts(kind, request, dense_dir):
    path = request.getfixturevalue(f"{kind}_dir")
    drafter = dense_dir if kind == "q4" else None
    model = mlx_mtp.load_model(path, drafter=drafter)
    plain = model.drafter
    fused = QwenMTPDrafter(plain.head, model.target, DraftOptions(fused_argmax=True, fused_chunk=64))
    for prompt in ([5, 17, 3, 99, 42, 7, 250, 31], [11, 12], list(range(40, 80))):
        h, nxt = prompts_hidden(model, prompt)
        runs = []
        for d in (plain, fused):
            d.reset()
            d.prefill(h, nxt)
            runs.append((d.first_draft.tolist(), d.draft(6).tolist()))
        assert runs[0] == runs[1], (kind, prompt)
    assert fused.first_draft_logits is None  # the fused path never built the logits row


def test_full_unfused_projection_is_the_targets_own(dense_dir, tied_dir):
    for path in (dense_dir, tied_dir):
        model = mlx_mtp.load_model(path)
        x = mx.random.normal((3, model.target.hidden_size), key=mx.random.key(4))
        own = model.target.logits(x)
        mine = HeadTensors.of(model.target.lm_head_module).matmul(x)
        assert bytes(memoryview(own)) == bytes(memoryview(mine))
        assert bytes(memoryview(model.drafter.lm.project(x))) == bytes(memoryview(own))
