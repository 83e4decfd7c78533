"""The compiled row kernel (mlx_mtp.cpu.row_kernel): T-row products in the order it documents
(checked against ``support.native_support.row_dot_reference``, on any host), bitwise equal to the
bound BLAS's one-row products where those reduce in that order (BLIS's AVX2 configurations; measured
here, not assumed from the library's name), how row_exact_layers.switch_to_row_exact picks it, and its fallbacks when
it cannot be built."""

import os
import stat

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_mtp import MTPError
from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.cpu import lazy_ops as lazy_kernels
from mlx_mtp.exactness import row_exact_layers
from mlx_mtp.cpu import row_kernel
from support.native_support import (one_row_products_in_kernel_order, require_kernel,
                                    row_dot_reference)


def bitwise(a, b):
    return a.shape == b.shape and bytes(memoryview(a)) == bytes(memoryview(b))


def verify_equals_rows(layer, T: int, K: int, seed: int) -> bool:
    """Whether the layer's T-row verify product is bitwise its T one-row calls."""
    x = mx.random.normal((1, T, K), key=mx.random.key(seed))
    with row_exact_layers.verifying():
        block = layer(x)
    rows = [layer(x[:, i : i + 1]) for i in range(T)]
    mx.eval(block, rows)
    return all(bitwise(block[:, i : i + 1], rows[i]) for i in range(T))


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """The kernel forgotten and its cache an empty folder; restored afterwards."""
    monkeypatch.setenv(row_kernel.CACHE_ENV, str(tmp_path / "cache"))
    row_kernel.reset()
    yield tmp_path / "cache"
    row_kernel.reset()


def needs_kernel():
    require_kernel(row_kernel._cpu_problem(), row_kernel.available, row_kernel.reason, "row kernel")


def test_the_kernel_builds_here_into_the_cache_folder(fresh):
    """CI and this machine are x86-64 Linux with AVX2, FMA and gcc: the kernel must build, into
    the cache folder, under a name keyed by source, compiler and flags, leaving no temp file."""
    needs_kernel()
    assert row_kernel.available(), row_kernel.reason()
    assert row_kernel.reason() == ""
    files = os.listdir(fresh)
    assert len(files) == 1 and files[0].startswith("row_dot-") and files[0].endswith(".so"), files


def test_a_cached_library_is_loaded_without_compiling(fresh, monkeypatch):
    needs_kernel()
    row_kernel.reset()
    import subprocess

    def no_compiler(*a, **kw):
        raise AssertionError("compiled again although the cache holds the library")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    assert row_kernel.available(), row_kernel.reason()


@pytest.mark.parametrize("K", [520, 1024, 3072, 1027])
@pytest.mark.parametrize("N", [8, 64, 1000, 1003])
def test_kernel_products_equal_one_row_products_bitwise(K, N):
    """x[T, K] @ W[N, K].T through the kernel, for T = 2..8 (K % 8 != 0 included): the columns
    in whole groups of 8 byte for byte the kernel's documented order, whatever the host; and
    where this BLAS's one-row products reduce in that order, every column (the last N % 8 from
    BLAS one-row products) equals T one-row matmuls byte for byte. Where they do not, install's
    own check says so and it must not pick the kernel."""
    needs_kernel()
    W = mx.random.normal((N, K), key=mx.random.key(K * 7 + N))
    x = mx.random.normal((1, 8, K), key=mx.random.key(N))
    layer = nn.Linear(K, N, bias=False)
    layer.weight = W
    rows = [x[:, i : i + 1] @ W.T for i in range(8)]
    mx.eval(rows)
    main = N - N % row_kernel.COLUMN_GROUP
    want = row_dot_reference(np.array(x[0]), np.array(W[:main]))
    same = []
    for T in (2, 3, 4, 6, 7, 8):
        got = row_exact_layers.kernel_products(layer, x[:, :T])
        mx.eval(got)
        assert got.shape == (1, T, N)
        assert np.array(got)[0, :, :main].tobytes() == want[:T].tobytes(), (K, N, T)
        same.append(all(bitwise(got[:, i : i + 1], rows[i]) for i in range(T)))
    if one_row_products_in_kernel_order():
        assert all(same), (K, N, same)
    assert row_exact_layers.kernel_equal_rows(layer, layer, 4) == all(same)


@pytest.mark.slow
def test_the_vocabulary_sized_product_is_exact():
    """A realistic LM head (32768 x 1024) with 3 rows, as a verify of 3 tokens multiplies it:
    column blocks at both ends and in the middle in the kernel's order, and every column the
    one-row products' bytes where those reduce in that order."""
    needs_kernel()
    W = mx.random.normal((32768, 1024), key=mx.random.key(11))
    x = mx.random.normal((1, 3, 1024), key=mx.random.key(12))
    got = row_kernel.products(x, row_kernel.weight_view(W), 32768)
    rows = [x[:, i : i + 1] @ W.T for i in range(3)]
    mx.eval(got, rows)
    for a in (0, 16384, 32768 - 512):
        want = row_dot_reference(np.array(x[0]), np.array(W[a : a + 512]))
        assert np.array(got)[0, :, a : a + 512].tobytes() == want.tobytes(), a
    if one_row_products_in_kernel_order():
        assert all(bitwise(got[:, i : i + 1], rows[i]) for i in range(3))


def test_weight_view_is_zero_copy_and_checked():
    w = mx.random.normal((16, 24), key=mx.random.key(3))
    a, b = row_kernel.weight_view(w), row_kernel.weight_view(w)
    assert a.ctypes.data == b.ctypes.data  # two views of one MLX buffer, not two copies
    assert a.tobytes() == bytes(memoryview(w))
    with pytest.raises(ValueError, match=r"row kernel: needs a contiguous float32 \[N, K\] weight"):
        row_kernel.weight_view(w.T)
    with pytest.raises(ValueError, match=r"row kernel: 12 columns of a \(16, 24\) weight"):
        row_kernel.products(mx.zeros((2, 24)), a, 12)


def test_install_picks_the_kernel_for_a_wide_layer(monkeypatch):
    needs_kernel()
    layer = nn.Linear(1024, 640, bias=False)
    mx.eval(layer.parameters())
    first = row_exact_layers.first_divergent_width(layer, 4, 1024, mx.float32)
    switched = row_exact_layers.switch_to_row_exact(layer, 4)
    assert switched == ({"": first} if first else {})
    if not (first and one_row_products_in_kernel_order()):
        # nothing to fix here, or this BLAS's one-row order is not the kernel's
        assert not switched or row_exact_layers.row_method(layer) != "kernel"
        assert not switched or verify_equals_rows(layer, 4, 1024, seed=9)
        return
    assert row_exact_layers.row_method(layer) == "kernel" and layer.use_kernel and layer.block_cols == 0
    calls = []
    original = row_kernel.products
    monkeypatch.setattr(row_kernel, "products", lambda *a: calls.append(a[2]) or original(*a))
    x = mx.random.normal((1, 4, 1024), key=mx.random.key(9))
    with row_exact_layers.verifying():
        block = layer(x)
    rows = [layer(x[:, i : i + 1]) for i in range(4)]
    mx.eval(block, rows)
    assert calls == [640]
    assert all(bitwise(block[:, i : i + 1], rows[i]) for i in range(4))
    assert row_exact_layers.row_exact_report(layer) == {"layers": {"kernel": 1},
                                       "kernel": f"available, {lazy_kernels.mode()}"}


def test_switched_off_by_the_environment(fresh, monkeypatch):
    monkeypatch.setenv(row_kernel.ENV, "0")
    assert not row_kernel.available()
    assert row_kernel.reason() == "MLX_MTP_ROW_KERNEL=0"
    layer = nn.Linear(1024, 640, bias=False)
    mx.eval(layer.parameters())
    if row_exact_layers.switch_to_row_exact(layer, 3):
        assert row_exact_layers.row_method(layer) == "blocked"
        assert row_exact_layers.row_exact_report(layer) == {
            "layers": {"blocked": 1}, "kernel": "unavailable (MLX_MTP_ROW_KERNEL=0)"}
    with pytest.raises(RuntimeError, match=r"row kernel unavailable: MLX_MTP_ROW_KERNEL=0"):
        row_kernel.products(mx.zeros((2, 8)), np.zeros((8, 8), np.float32), 8)


def test_a_bad_switch_value_is_a_one_line_error(fresh, monkeypatch):
    monkeypatch.setenv(row_kernel.ENV, "yes")
    with pytest.raises(MTPError, match=r"^environment variable MLX_MTP_ROW_KERNEL must be 0 or 1, "
                                       r"got 'yes'$"):
        row_kernel.load()


def test_a_missing_compiler_leaves_the_fallbacks(fresh, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert not row_kernel.available()
    assert row_kernel.reason() == ("cannot build row_dot.c: no C compiler '/nonexistent/cc' "
                                   "(set CC)")
    layer = nn.Linear(1024, 640, bias=False)
    mx.eval(layer.parameters())
    if row_exact_layers.switch_to_row_exact(layer, 3):
        assert row_exact_layers.row_method(layer) == "blocked"
        assert verify_equals_rows(layer, 3, 1024, seed=2)
    assert not [f for f in os.listdir(fresh)], "a failed build leaves nothing in the cache"


def test_a_failing_compiler_is_reported_not_raised(fresh, monkeypatch, tmp_path):
    cc = tmp_path / "badcc"
    cc.write_text("#!/bin/sh\necho 'row_dot.c:1: error: no such thing' >&2\nexit 3\n")
    cc.chmod(cc.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(cc))
    assert row_kernel.load() is None
    assert row_kernel.reason() == (f"cannot build row_dot.c: {cc} failed (3): "
                                   "row_dot.c:1: error: no such thing")
    assert not os.listdir(fresh)


def test_the_cli_row_names_the_layers_by_method_and_the_kernel():
    from mlx_mtp.exactness.gate import row_exact_summary

    ex = {"row_exact": {"layers": {"kernel": 27, "blocked": 2}, "kernel": "available"}}
    assert row_exact_summary(ex) == "29 (blocked 2, kernel 27); row kernel available"
    ex = {"row_exact": {"layers": {}, "kernel": "unavailable (MLX_MTP_ROW_KERNEL=0)"}}
    assert row_exact_summary(ex) == "none; row kernel unavailable (MLX_MTP_ROW_KERNEL=0)"
    assert row_exact_summary({"verdict": "equal"}) is None


def test_threads_split_columns_and_change_no_byte(monkeypatch):
    """MLX_MTP_VERIFY_THREADS threads split the output columns; every output is reduced by one
    thread in the same order, so the bytes are those of one thread."""
    needs_kernel()
    W = mx.random.normal((4096, 1024), key=mx.random.key(21))  # large enough to be split
    x = mx.random.normal((1, 3, 1024), key=mx.random.key(22))
    view = row_kernel.weight_view(W)
    one = row_kernel.products(x, view, 4096, 1)
    mx.eval(one)
    for threads in (2, 3, 7):
        got = row_kernel.products(x, view, 4096, threads)
        mx.eval(got)
        assert bitwise(got, one), threads
    big = row_exact_layers.PARALLEL_WORK_BYTES
    monkeypatch.setenv(cpu_blas.VERIFY_THREADS_ENV, "3")
    assert row_exact_layers.kernel_threads() == 3 and row_exact_layers.kernel_threads(big) == 3
    monkeypatch.setenv(cpu_blas.VERIFY_THREADS_ENV, "1")
    assert row_exact_layers.kernel_threads(big) == 1
    monkeypatch.delenv(cpu_blas.VERIFY_THREADS_ENV)
    # unset: one thread for a small product, every usable core from the threshold on
    assert row_exact_layers.kernel_threads(big - 1) == 1
    assert row_exact_layers.kernel_threads(big) == cpu_blas.usable_cores()


def test_a_tied_lm_head_runs_its_as_linear_through_the_kernel(monkeypatch):
    """The tied head's product is ``embed_tokens.as_linear``: switched like a Linear."""
    needs_kernel()

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(1003, 1024)  # 1000 columns by kernel, 3 by BLAS

    model = Tied()
    mx.eval(model.parameters())
    emb = model.embed_tokens
    first = row_exact_layers.first_divergent_width(emb.as_linear, 3, 1024, mx.float32)
    switched = row_exact_layers.switch_to_row_exact(model, 3, tied_head=True)
    assert switched == ({"embed_tokens": first} if first else {})
    if not (first and one_row_products_in_kernel_order()):
        assert not switched or row_exact_layers.row_method(emb) != "kernel"
        return
    assert row_exact_layers.row_method(emb) == "kernel"
    calls = []
    original = row_kernel.products
    monkeypatch.setattr(row_kernel, "products", lambda *a: calls.append(a[2]) or original(*a))
    x = mx.random.normal((1, 3, 1024), key=mx.random.key(31))
    with row_exact_layers.verifying():
        block = emb.as_linear(x)
    rows = [emb.as_linear(x[:, i : i + 1]) for i in range(3)]
    mx.eval(block, rows)
    assert calls == [1000]
    assert all(bitwise(block[:, i : i + 1], rows[i]) for i in range(3))


def test_a_strided_weight_is_declined_not_a_crash():
    """A weight that is a transposed view is not row-major in memory: install keeps the
    blocked products for it instead of failing."""
    needs_kernel()
    layer = nn.Linear(1024, 640, bias=False)
    layer.weight = mx.random.normal((1024, 640), key=mx.random.key(41)).T
    mx.eval(layer.parameters())
    assert not row_exact_layers.kernel_equal_rows(layer, layer, 3)
    if row_exact_layers.switch_to_row_exact(layer, 3):
        assert row_exact_layers.row_method(layer) != "kernel"
        assert verify_equals_rows(layer, 3, 1024, seed=42)


@pytest.mark.parametrize("T", [1, 2, 3, 6])
def test_weights_that_end_at_an_unmapped_page_are_read_without_a_fault(T):
    """The kernel's multi-row calls prefetch the next columns' weights, past the last column at
    the end: a prefetch must never fault (the weights end where an inaccessible page begins),
    and the products equal the same kernel's on an ordinary copy, byte for byte."""
    import ctypes
    import mmap

    needs_kernel()
    N, K = 16, 1024  # 64 KiB: whole pages, so the weights end exactly at the guard page
    size = N * K * 4
    buf = mmap.mmap(-1, size + mmap.PAGESIZE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(base + size, mmap.PAGESIZE, 0) == 0  # PROT_NONE
    try:
        w = np.frombuffer(buf, np.float32, N * K).reshape(N, K)
        w[:] = np.random.default_rng(5).standard_normal((N, K), dtype=np.float32)
        x = mx.random.normal((1, T, K), key=mx.random.key(T))
        got = row_kernel.products(x, w, N)
        want = row_kernel.products(x, np.array(w), N)
        mx.eval(got, want)
        assert bitwise(got, want)
        del w
    finally:
        libc.mprotect(base + size, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE)


def test_a_verify_whose_kernel_products_run_on_every_core_equals_plain_decode(wide_dir,
                                                                              monkeypatch):
    """Products past the size threshold run on every usable core (here forced for all, on 2
    threads): T=0 output is still mlx-lm's greedy decode, and the round does not pin."""
    import mlx_mtp
    from mlx_lm.generate import generate_step as mlx_generate_step

    needs_kernel()
    monkeypatch.setattr(row_exact_layers, "PARALLEL_WORK_BYTES", 0)
    monkeypatch.setattr(cpu_blas, "usable_cores", lambda: 2)
    model = mlx_mtp.load_model(wide_dir)
    prompt = mx.array([5, 6, 7, 8])
    out = [t for t, _ in mlx_mtp.generate_step(prompt, model, max_tokens=12, block_size=4)]
    assert out == [t for t, _ in mlx_generate_step(prompt, model.mlx_model, max_tokens=12)]
    if row_exact_layers.row_exact_report(model.mlx_model)["layers"].get("kernel"):
        assert row_exact_layers.threaded(model.mlx_model, 4)
    monkeypatch.setattr(row_exact_layers, "PARALLEL_WORK_BYTES", 1 << 62)
    assert not row_exact_layers.threaded(model.mlx_model, 4)
