"""The drafter's products with bfloat16 weights through the bf16 kernel (``DraftOptions.bf16``,
``mlx_mtp.models.bf16_weights``, ``mlx_mtp.models.qwen3_5.drafter_products``)."""

import importlib
import json

import mlx.core as mx
import pytest
from mlx.utils import tree_map
from support.head_round_trip import draft_accept_draft
from support.reference import reference_greedy
from support import tiny_checkpoints as tc
from support.lm_heads import random_head

import mlx_mtp
from mlx_mtp import MTPError
from mlx_mtp.cpu import lazy_ops as lazy_kernels
from mlx_mtp.cpu import row_kernel
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.exactness.row_exact_layers import bitwise_equal
from mlx_mtp.models.options import DraftOptions
from mlx_mtp.models import bf16_weights
from mlx_mtp.models.qwen3_5.drafter import QwenMTPDrafter
from mlx_mtp.models.qwen3_5.lm_head import DraftLMHead

PROMPT = [5, 17, 3, 99, 42, 7, 250, 31, 64, 12]


def _rounded(w: mx.array) -> mx.array:
    """The float32 values of ``w`` rounded to bfloat16."""
    return w.astype(mx.bfloat16).astype(mx.float32)


@pytest.mark.parametrize("K", [64, 1027])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_products_are_the_row_kernels_on_the_rounded_weights(K, threads):
    """The bf16 kernel sums in the row kernel's order: its products equal, bit for bit, the row
    kernel's on the same weights widened to float32, for 1-13 rows (row groups past 6) and for a
    last partial group of columns (compared on the weight padded to whole groups of 8)."""
    N = 8 * 70 + 5
    w = mx.random.normal((N, K), key=mx.random.key(1))
    w16 = bf16_weights.bf16_weight(w)
    assert w16.dtype == mx.bfloat16
    padded = mx.concatenate([_rounded(w), mx.zeros((3, K))])
    mx.eval(padded)
    for T in (1, 2, 3, 5, 6, 7, 13):
        x = mx.random.normal((1, T, K), key=mx.random.key(T))
        got = bf16_weights.bf16_products(x, w16, threads)
        want = row_kernel.products(x, padded, N + 3)[..., :N]
        assert got.shape == (1, T, N) and got.dtype == mx.float32
        assert bitwise_equal(got, mx.contiguous(want)), T


def test_bf16_kernel_rejects_a_float32_weight():
    with pytest.raises(ValueError, match="needs x \\[R, K\\], w \\[N, K\\] bfloat16"):
        lazy_kernels.load().bf16_dot(mx.ones((1, 8)), mx.ones((8, 8)), 1)


def test_the_drafters_products_run_on_bfloat16_copies(dense_dir):
    """With bf16 every merged product and the LM head run through the bf16 kernel; the drafts
    are those of the same drafter on the bf16-rounded weights through the BLAS (to rounding: the
    sums' order differs), here the same ids."""
    model = mlx_mtp.load_model(dense_dir)
    head, target = model.drafter.head, model.target
    on = QwenMTPDrafter(head, target, DraftOptions(bf16=True))
    off = QwenMTPDrafter(head, target, DraftOptions())
    assert on.describe()["bf16"] and not off.describe()["bf16"]
    assert not on.row_kernel
    fast = on.compiled.fast
    mms = [fast.mm_fc] + [getattr(layer, f"mm_{n}") for layer in fast.layers
                          for n in ("qkvg", "o", "gu", "down")]
    assert [m.by_kernel for m in mms] == ["bf16"] * 5
    # the merged float32 matrices are not kept beside their bfloat16 copies
    assert all("w_qkvg" not in layer and "w_gu" not in layer for layer in fast.layers)
    assert all("w_qkvg" in layer for layer in off.compiled.fast.layers)
    lm = on.lm.tensors
    assert lm.bf16 and lm.weight.dtype == mx.bfloat16
    assert bitwise_equal(lm.weight.astype(mx.float32), _rounded(target.lm_head_module.weight))
    cache = target.make_cache()
    p = mx.array(PROMPT)
    h = target.hidden(p[None, :-1], cache)
    assert draft_accept_draft(on, h, p) == draft_accept_draft(off, h, p)
    x = mx.random.normal((2, head.fc.weight.shape[0]), key=mx.random.key(5))
    want = x @ _rounded(target.lm_head_module.weight).T
    assert mx.allclose(on.lm.project(x), want, rtol=1e-5, atol=1e-5).item()


def test_a_reduced_vocabulary_keeps_its_rows_as_bfloat16():
    H = 64
    target, lin, x = random_head(H, 320)
    ids = mx.arange(0, 300, 5).astype(mx.uint32)  # 60 ids: not whole groups of 8
    head = DraftLMHead(target, ids=ids, bf16=True)
    t = head.tensors
    assert t.bf16 and not t.transposed and t.weight.shape == (60, H)
    assert t.weight.dtype == mx.bfloat16
    want = x @ _rounded(lin.weight[ids]).T
    assert mx.allclose(head.project(x), want, rtol=1e-5, atol=1e-5).item()
    tok, logits = head.pick(x)
    assert tok.tolist() == ids[mx.argmax(want, -1)].tolist()
    fused = DraftLMHead(target, ids=ids, fused=True, chunk=16, bf16=True)
    assert fused.argmax(x, _NoProfiler())[0].tolist() == tok.tolist()


class _NoProfiler:
    def stage(self, *_):
        pass


def test_output_is_plain_decode_and_an_agreeing_head_is_accepted(tmp_path):
    path = tc.write_agreeing_checkpoint(tmp_path / "pair", seed=3)
    ref = reference_greedy(path, PROMPT, 24)
    model = mlx_mtp.load_model(path, draft_options=DraftOptions(bf16=True))
    assert model.drafter.describe()["bf16"]
    for bs in (2, 3, 5):
        stats = RunStats()
        out = [t for t, _ in mlx_mtp.generate_step(mx.array(PROMPT), model, max_tokens=24,
                                                   block_size=bs, stats=stats)]
        assert out == ref, bs
        assert stats.acceptance_rate > 0.5, (bs, stats.acceptance_rate)


def _bf16_valued(model) -> None:
    """Round the head's matrices and the LM head to bfloat16 values in place (float32 still), as
    a bfloat16 checkpoint cast to float32 on load holds."""
    head = model.drafter.head
    head.update(tree_map(lambda a: _rounded(a) if a.ndim == 2 else a, head.parameters()))
    lm = model.target.lm_head_module
    lm.weight = _rounded(lm.weight)
    mx.eval(head.parameters(), lm.weight)


def test_by_default_it_runs_where_the_copy_rounds_nothing(dense_dir, monkeypatch):
    """``bf16=None``: on for a head whose weights are bfloat16 values (a bfloat16 checkpoint), off
    for a float32 head it would round; off where the kernels cannot run; never with a quantized
    head or the row kernel asked for."""
    model = mlx_mtp.load_model(dense_dir)
    head, target = model.drafter.head, model.target
    assert model.drafter.describe()["bf16"] is False  # random float32 weights
    assert QwenMTPDrafter(head, target, DraftOptions(bf16=True)).bf16  # asked: rounds them
    _bf16_valued(model)
    assert QwenMTPDrafter(head, target, DraftOptions()).bf16
    assert not QwenMTPDrafter(head, target, DraftOptions(bf16=False)).bf16
    assert not QwenMTPDrafter(head, target, DraftOptions(row_kernel=True)).bf16
    assert not QwenMTPDrafter(head, target, DraftOptions(compiled=False)).bf16
    # one head matrix off the bfloat16 grid: off
    fc = head.fc.weight
    head.fc.weight = fc + mx.where(mx.arange(fc.size).reshape(fc.shape) == 7, 1e-6, 0.0)
    assert not QwenMTPDrafter(head, target, DraftOptions()).bf16
    head.fc.weight = fc
    assert QwenMTPDrafter(head, target, DraftOptions()).bf16
    # a draft vocabulary: only its rows are copied, so only they are checked
    lm = target.lm_head_module
    ids = mx.arange(0, 320, 2).astype(mx.uint32)
    lm.weight = mx.where((mx.arange(lm.weight.shape[0]) % 2 == 1)[:, None], lm.weight + 1e-6,
                         lm.weight)
    assert QwenMTPDrafter(head, target, DraftOptions(), ids).bf16
    assert not QwenMTPDrafter(head, target, DraftOptions()).bf16
    monkeypatch.setattr(lazy_kernels, "available", lambda: False)
    monkeypatch.setattr(lazy_kernels, "reason", lambda: "MLX_MTP_LAZY_KERNELS=0")
    assert not QwenMTPDrafter(head, target, DraftOptions(), ids).bf16


def test_holds_bf16_checks_every_row_block():
    w = _rounded(mx.random.normal((50, 16), key=mx.random.key(8)))
    assert bf16_weights.holds_bf16(w, rows=8)
    bumped = w + mx.where(mx.arange(w.size).reshape(w.shape) == 49 * 16 + 3, 1e-5, 0.0)
    assert not bf16_weights.holds_bf16(bumped, rows=8)  # in the last, partial block


def test_cli_draft_bf16_flag(capsys, dense_dir):
    generate = importlib.import_module("mlx_mtp.generate")  # the CLI module
    assert generate.main(["--model", str(dense_dir), "--max-tokens", "8", "--json",
                          "--ignore-chat-template", "--draft-bf16"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["draft"]["bf16"] is True and out["draft"]["row_kernel"] is False


def test_where_the_kernels_cannot_run_it_is_an_error(monkeypatch, dense_dir):
    monkeypatch.setattr(lazy_kernels, "available", lambda: False)
    monkeypatch.setattr(lazy_kernels, "reason", lambda: "MLX_MTP_LAZY_KERNELS=0")
    with pytest.raises(MTPError) as e:
        mlx_mtp.load_model(dense_dir, draft_options=DraftOptions(bf16=True))
    assert str(e.value) == ("--draft-bf16 (DraftOptions(bf16=True)): the lazy kernels are "
                            "unavailable (MLX_MTP_LAZY_KERNELS=0)")


@pytest.mark.parametrize("kwargs,msg", [
    (dict(bf16=True, compiled=False),
     "bf16=True (--draft-bf16) runs the compiled draft step's products: it needs compiled=True"),
    (dict(bf16=True, row_kernel=True),
     "bf16=True (--draft-bf16) and row_kernel=True both choose the draft step's kernel: pick one"),
    (dict(bf16=True, bits=4),
     "bf16=True (--draft-bf16) and --draft-bits both set the head's weights: pick one"),
    (dict(bf16="yes"), "bf16 must be None, True or False, got 'yes'"),
])
def test_bad_options_are_errors(kwargs, msg):
    with pytest.raises(MTPError) as e:
        DraftOptions(**kwargs)
    assert str(e.value) == msg


def test_bf16_threads_every_core_from_four_mebibytes_unless_the_variable_says(monkeypatch):
    from mlx_mtp.cpu import blas as cpu_blas

    monkeypatch.delenv("MLX_MTP_VERIFY_THREADS", raising=False)
    monkeypatch.setattr(cpu_blas, "usable_cores", lambda: 3)
    small = mx.zeros((1024, 2047), mx.bfloat16)  # just under 4 MiB
    large = mx.zeros((1024, 2048), mx.bfloat16)
    assert bf16_weights.bf16_threads(small) == 1 and bf16_weights.bf16_threads(large) == 3
    monkeypatch.setenv("MLX_MTP_VERIFY_THREADS", "1")
    assert bf16_weights.bf16_threads(large) == 1
