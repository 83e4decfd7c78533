"""The drafter's products through the row kernel (``mlx_mtp.models.qwen3_5.drafter_products``)."""

import mlx.core as mx
import pytest
from support.head_round_trip import draft_accept_draft
from support.reference import reference_greedy
from support.lm_heads import random_head

import mlx_mtp
from mlx_mtp import MTPError
from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.cpu import row_kernel
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.models.qwen3_5 import drafter_products
from mlx_mtp.models.qwen3_5.drafter import QwenMTPDrafter
from mlx_mtp.models.qwen3_5.lm_head import DraftLMHead
from mlx_mtp.models.options import DraftOptions

PROMPT = [5, 17, 3, 99, 42, 7, 250, 31, 64, 12]


def test_auto_takes_it_with_openblas_only(monkeypatch):
    monkeypatch.setattr(cpu_blas.STATE, "name", "OpenBLAS")
    assert drafter_products.problem() is None  # this machine builds the lazy row kernel
    assert drafter_products.resolve(None) is True
    assert drafter_products.resolve(False) is False
    monkeypatch.setattr(cpu_blas.STATE, "name", "BLIS")
    assert drafter_products.resolve(None) is False
    assert drafter_products.resolve(True) is True


def test_forced_on_where_it_cannot_run_is_an_error(monkeypatch):
    monkeypatch.setattr(cpu_blas.STATE, "name", "OpenBLAS")
    monkeypatch.setattr(row_kernel, "available", lambda: False)
    monkeypatch.setattr(row_kernel, "reason", lambda: "MLX_MTP_ROW_KERNEL=0")
    assert drafter_products.resolve(None) is False  # auto: quietly the BLAS
    with pytest.raises(MTPError) as e:
        drafter_products.resolve(True)
    assert str(e.value) == ("draft row kernel (DraftOptions(row_kernel=True)): the row kernel is "
                            "unavailable (MLX_MTP_ROW_KERNEL=0)")


def test_products_and_drafts_match_the_blas_ones(dense_dir):
    """The merged head's and the LM head's products through the kernel agree with the BLAS's to
    rounding, and on this checkpoint the drafts are the same ids."""
    model = mlx_mtp.load_model(dense_dir)
    head, target = model.drafter.head, model.target
    on = QwenMTPDrafter(head, target, DraftOptions(row_kernel=True))
    off = QwenMTPDrafter(head, target, DraftOptions(row_kernel=False))
    assert [d.describe()["row_kernel"] for d in (on, off)] == [True, False]
    assert on.lm.tensors.row_kernel and not off.lm.tensors.row_kernel
    for d, want in ((on, True), (off, False)):
        fast = d.compiled.fast
        mms = [fast.mm_fc] + [getattr(layer, f"mm_{n}") for layer in fast.layers
                              for n in ("qkvg", "o", "gu", "down")]
        assert [m.by_kernel for m in mms] == [want] * 5
    cache = target.make_cache()
    p = mx.array(PROMPT)
    h = target.hidden(p[None, :-1], cache)
    got = [draft_accept_draft(d, h, p) for d in (on, off)]
    assert got[0] == got[1]
    for d in (on, off):  # one compiled draft step from the same state
        d.reset()
        d.prefill(h, p[1:])
    steps = [d.compiled.step(d.first_draft[None], d.first_draft_hidden, d.cache) for d in (on, off)]
    (g1, t1, l1), (g2, t2, l2) = steps
    assert mx.allclose(g1, g2, rtol=1e-4, atol=1e-5).item()
    assert mx.allclose(l1, l2, rtol=1e-4, atol=1e-4).item()
    assert t1.tolist() == t2.tolist()


def test_reduced_rows_stay_rows_for_the_kernel():
    """With the kernel a reduced vocabulary keeps its rows ([N, H], as the kernel reads them);
    one whose size is not a whole number of 8-row groups, or a fused argmax, keeps the BLAS."""
    H = 64
    target, lin, x = random_head(H, 320)
    ids = mx.arange(0, 320, 5).astype(mx.uint32)  # 64 ids
    head = DraftLMHead(target, ids=ids, rows_by_kernel=True)
    t = head.tensors
    assert t.row_kernel and not t.transposed and t.weight.shape == (64, H)
    want = x @ lin.weight[ids].T
    assert mx.allclose(head.project(x), want, rtol=1e-5, atol=1e-5).item()
    assert mx.argmax(head.project(x), -1).tolist() == mx.argmax(want, -1).tolist()
    odd = DraftLMHead(target, ids=ids[:60], rows_by_kernel=True).tensors
    fused = DraftLMHead(target, ids=ids, fused=True, rows_by_kernel=True).tensors
    assert not odd.row_kernel and odd.transposed
    assert not fused.row_kernel and fused.transposed
    whole = DraftLMHead(target, rows_by_kernel=True).tensors  # 320 rows: 40 groups of 8
    assert whole.row_kernel and mx.allclose(whole.matmul(x), x @ lin.weight.T, rtol=1e-5,
                                            atol=1e-5).item()


def test_output_is_plain_decode_with_the_kernel(dense_dir):
    model = mlx_mtp.load_model(dense_dir, draft_options=DraftOptions(row_kernel=True))
    assert model.drafter.describe()["row_kernel"]
    ref = reference_greedy(dense_dir, PROMPT, 24)
    for bs in (2, 3, 5):
        out = [t for t, _ in mlx_mtp.generate_step(mx.array(PROMPT), model, max_tokens=24,
                                                   block_size=bs, stats=RunStats())]
        assert out == ref, bs


@pytest.mark.parametrize("kwargs,msg", [
    (dict(row_kernel=True, compiled=False),
     "row_kernel=True runs the compiled draft step's products: it needs compiled=True"),
    (dict(row_kernel="yes"), "row_kernel must be None, True or False, got 'yes'"),
])
def test_bad_options_are_errors(kwargs, msg):
    with pytest.raises(MTPError) as e:
        DraftOptions(**kwargs)
    assert str(e.value) == msg
    assert DraftOptions(row_kernel=False, compiled=False).row_kernel is False  # off: fine
