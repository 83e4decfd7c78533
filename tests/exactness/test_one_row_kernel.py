"""One-row products through the row kernel (``row_exact_layers``): where a layer verifies through the
lazy kernel and a check finds the kernel's one-row product equal to the layer's own, a decode
step's one-row products inside ``verifying()`` run through it too, on every core for large
weights, with the same bytes; a layer whose check fails, or eager kernels, keep the BLAS call;
T=0 generation stays mlx-lm's greedy output."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import generate_step as mlx_generate_step

import mlx_mtp
from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.cpu import lazy_ops as lazy_kernels
from mlx_mtp.cpu import row_kernel
from mlx_mtp.exactness import row_exact_layers
from support.native_support import one_row_products_in_kernel_order, require_lazy


def bitwise(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and bytes(memoryview(a)) == bytes(memoryview(b))


@pytest.fixture
def kernel_calls(monkeypatch):
    """(rows, threads) of every row-kernel product; the kernel must run lazily here."""
    require_lazy()
    calls = []
    products = row_kernel.products
    monkeypatch.setattr(row_kernel, "products",
                        lambda x, w, n, threads=1: calls.append((x.shape[-2], threads))
                        or products(x, w, n, threads))
    return calls


def wide_layer(out_dims: int = 4096) -> nn.Linear:
    """A layer BLIS reduces differently at several rows (inputs wider than 512), 16 MB at 4096
    outputs: past ``ONE_ROW_PARALLEL_BYTES``."""
    layer = nn.Linear(1024, out_dims, bias=False)
    mx.eval(layer.parameters())
    return layer


def test_a_one_row_product_runs_through_the_kernel_with_the_same_bytes(kernel_calls):
    layer = wide_layer()
    row_exact_layers.switch_to_row_exact(layer, 4)
    if not (layer.use_kernel and one_row_products_in_kernel_order()):
        pytest.skip("this BLAS's one-row order is not the kernel's: the layer does not use it")
    assert layer.one_row_kernel
    kernel_calls.clear()  # (the install's checks)
    x = mx.random.normal((1, 1, 1024), key=mx.random.key(5))
    plain = layer(x)  # outside verifying(): the BLAS's one-row call
    mx.eval(plain)
    assert kernel_calls == []
    with row_exact_layers.verifying():
        got = layer(x)
    mx.eval(got)
    assert bitwise(got, plain)
    assert kernel_calls == [(1, row_exact_layers.one_row_threads(layer.weight.nbytes))]
    assert row_exact_layers.one_row_threads(layer.weight.nbytes) == cpu_blas.usable_cores()


def test_one_row_threads_by_weight_size_unless_set(monkeypatch):
    big = row_exact_layers.ONE_ROW_PARALLEL_BYTES
    monkeypatch.delenv(cpu_blas.VERIFY_THREADS_ENV, raising=False)
    assert row_exact_layers.one_row_threads(big - 1) == 1
    assert row_exact_layers.one_row_threads(big) == cpu_blas.usable_cores()
    monkeypatch.setenv(cpu_blas.VERIFY_THREADS_ENV, "3")
    assert row_exact_layers.one_row_threads(0) == row_exact_layers.one_row_threads(big) == 3
    monkeypatch.setenv(cpu_blas.VERIFY_THREADS_ENV, "1")
    assert row_exact_layers.one_row_threads(big) == 1


def test_a_kernel_that_differs_at_one_row_is_kept_for_verify_rows_only(kernel_calls,
                                                                      monkeypatch):
    """A kernel whose one-row product is off by one ulp in one output passes the 2..4-row check
    but not the one-row one: verify blocks still run through it, one-row products do not."""
    products = row_kernel.products

    def off_at_one_row(x, w, n, threads=1):
        out = products(x, w, n, threads)
        if x.shape[-2] == 1:
            out = out.reshape(-1).at[0].add(out.reshape(-1)[0] * 2**-20).reshape(out.shape)
        return out

    monkeypatch.setattr(row_kernel, "products", off_at_one_row)
    layer = wide_layer(1024)
    row_exact_layers.switch_to_row_exact(layer, 4)
    if not (layer.use_kernel and one_row_products_in_kernel_order()):
        pytest.skip("this BLAS's one-row order is not the kernel's: the layer does not use it")
    assert not layer.one_row_kernel
    x = mx.random.normal((1, 1, 1024), key=mx.random.key(6))
    with row_exact_layers.verifying():
        got = layer(x)
    plain = layer(x)
    mx.eval(got, plain)
    assert bitwise(got, plain)


def test_eager_kernels_leave_one_row_products_to_the_blas(kernel_calls):
    """The eager kernel syncs with the host per call: a decode step keeps the BLAS call."""
    layer = wide_layer()
    with lazy_kernels.eager():
        row_exact_layers.switch_to_row_exact(layer, 4)
        assert not layer.one_row_kernel
        with row_exact_layers.verifying():
            mx.eval(layer(mx.random.normal((1, 1, 1024), key=mx.random.key(7))))
    assert [rows for rows, _ in kernel_calls if rows == 1] == []


@pytest.mark.parametrize("block_size", [3, "auto"])
def test_generation_with_one_row_kernel_products_is_plain_decode(block_size, wide_dir,
                                                                monkeypatch):
    """T=0 on a checkpoint whose projections verify through the kernel: the first token's
    step (and under auto every one-token step) runs its products through it, and the output is
    mlx-lm's greedy decode."""
    require_lazy()
    in_steps = []  # one-row kernel products inside verifying() (not the install's checks)
    products = row_exact_layers.kernel_products
    monkeypatch.setattr(row_exact_layers, "kernel_products", lambda layer, x: in_steps.append(
        x.shape[-2] == 1 and row_exact_layers.active()) or products(layer, x))
    model = mlx_mtp.load_model(wide_dir)
    prompt = mx.array([5, 6, 7, 8, 9, 10])
    out = [t for t, _ in mlx_mtp.generate_step(prompt, model, max_tokens=16,
                                               block_size=block_size)]
    assert out == [t for t, _ in mlx_generate_step(prompt, model.mlx_model, max_tokens=16)]
    if row_exact_layers.row_exact_report(model.mlx_model)["layers"].get("kernel"):
        assert any(m.one_row_kernel for _, m in model.mlx_model.named_modules()
                   if getattr(m, "use_kernel", False))
        assert any(in_steps)  # the first token's step at least
