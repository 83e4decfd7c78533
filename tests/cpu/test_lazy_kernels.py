"""The C kernels as lazy MLX ops (mlx_mtp.cpu.lazy_ops): built here, the same bytes as the eager
ctypes path and as the references (the row kernel's documented order and, where the BLAS reduces
one row in that order, its one-row products; mlx-lm's recurrence), no host sync
while the graph is built, usable inside mx.compile, and every way the build or load can fail
reported, with the eager path kept."""

import os
import shutil
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.gated_delta import compute_g

from mlx_mtp import MTPError
from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.cpu import lazy_ops as lazy_kernels
from mlx_mtp.cpu import native
from mlx_mtp.cpu import row_kernel
from mlx_mtp.models.qwen3_5 import gdn_block, gdn_kernel
from support.native_support import gdn_inputs as gdn_recurrence_inputs, require_lazy
from support.native_support import one_row_products_in_kernel_order, row_dot_reference


def bitwise(a, b):
    return (a.shape == b.shape and a.dtype == b.dtype
            and bytes(memoryview(a)) == bytes(memoryview(b)))


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """The extension's state forgotten and its cache an empty folder; restored afterwards."""
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(lazy_kernels.ENV, raising=False)
    monkeypatch.delenv(native.ALL_ENV, raising=False)
    lazy_kernels.reset()
    yield tmp_path / "cache"
    lazy_kernels.reset()


def gdn_inputs(T, Hk, Hv, Dk, Dv, seed):
    """The kernel's q, k, v, g, beta, state (g and beta as mlx-lm computes them)."""
    q, k, v, a, b, A_log, dt_bias, state = gdn_recurrence_inputs(T, Hk, Hv, Dk, Dv, seed)
    out = q, k, v, compute_g(A_log, a, dt_bias), mx.sigmoid(b), state
    mx.eval(out)
    return out


def test_it_builds_here_and_is_used():
    """CI and this machine (x86-64 Linux, cmake, a C++ compiler, nanobind 3.x) build it: the
    kernels run lazily and the reports say so."""
    require_lazy()
    assert lazy_kernels.mode() == "lazy" and lazy_kernels.reason() == ""


@pytest.mark.parametrize("K", [520, 1024, 1027])
@pytest.mark.parametrize("N", [8, 1000])
def test_row_products_lazy_equal_eager_and_one_row_products(K, N):
    require_lazy()
    W = mx.random.normal((N, K), key=mx.random.key(K + N))
    x = mx.random.normal((1, 6, K), key=mx.random.key(N))
    view = row_kernel.weight_view(W)
    rows = [x[:, i : i + 1] @ W.T for i in range(6)]
    mx.eval(rows)
    want = row_dot_reference(np.array(x[0]), np.array(W))
    for T in (1, 2, 3, 6):
        lazy = row_kernel.products(x[:, :T], W, N)
        eager = row_kernel.products(x[:, :T], view, N)
        mx.eval(lazy, eager)
        assert bitwise(lazy, eager), (K, N, T)
        assert np.array(lazy)[0].tobytes() == want[:T].tobytes(), (K, N, T)  # the kernel's order
        if one_row_products_in_kernel_order():  # this BLAS's one-row order (BLIS on AVX2)
            assert all(bitwise(lazy[:, i : i + 1], rows[i]) for i in range(T)), (K, N, T)


def test_row_products_of_a_strided_input_and_with_threads():
    """A transposed (non-contiguous) input is made contiguous in the graph; threads split the
    columns and change no byte."""
    require_lazy()
    W = mx.random.normal((4096, 1024), key=mx.random.key(1))
    xt = mx.random.normal((1024, 3), key=mx.random.key(2))
    view = row_kernel.weight_view(W)
    eager = row_kernel.products(xt.T, view, 4096)
    mx.eval(eager)
    for threads in (1, 2, 3):
        lazy = row_kernel.products(xt.T, W, 4096, threads)
        mx.eval(lazy)
        assert bitwise(lazy, eager), threads


@pytest.mark.parametrize("shape", [(2, 8, 64, 32), (2, 4, 128, 128), (3, 3, 36, 40)])
@pytest.mark.parametrize("T", [1, 2, 3, 5])
def test_gdn_steps_lazy_equal_eager_and_the_reference(T, shape):
    """y and every step's state: lazy, eager (the ctypes path) and mlx-lm's per-token ops."""
    require_lazy()
    args = gdn_recurrence_inputs(T, *shape, seed=T)
    q, k, v, a, b, A_log, dt_bias, state = args
    g, beta = compute_g(A_log, a, dt_bias), mx.sigmoid(b)
    y, states = gdn_kernel.states(q, k, v, g, beta, state)
    with lazy_kernels.eager():
        y_eager, states_eager = gdn_kernel.states(q, k, v, g, beta, state)
    y_ref, states_ref = gdn_block.reference_states(*args)
    mx.eval(y, states, y_eager, states_eager, y_ref, states_ref)
    assert len(states) == len(states_eager) == len(states_ref) == T
    assert bitwise(y, y_eager) and bitwise(y, y_ref)
    for t in range(T):
        assert bitwise(states[t], states_eager[t]) and bitwise(states[t], states_ref[t]), t


def test_a_verify_graph_makes_no_host_sync_and_compiles(monkeypatch):
    """Building the ops evaluates nothing (mx.eval is not called), and they run inside an
    mx.compile'd function with the same bytes."""
    require_lazy()
    W = mx.random.normal((64, 1024), key=mx.random.key(3))
    x = mx.random.normal((1, 3, 1024), key=mx.random.key(4))
    q, k, v, g, beta, state = gdn_inputs(3, 2, 4, 64, 32, seed=9)
    mx.eval(W, x, q, k, v, g, beta, state)
    want = row_kernel.products(x, W, 64)
    want_y, want_states = gdn_kernel.states(q, k, v, g, beta, state)
    mx.eval(want, want_y, want_states)

    def graph(x, q, k, v, g, beta, state):
        y, states = gdn_kernel.states(q * 1.0, k, v, g, beta, state)
        return [row_kernel.products(x + 0.0, W, 64), y, *states]

    def no_sync(*a, **kw):
        raise AssertionError("a host sync while the graph is built")

    monkeypatch.setattr(mx, "eval", no_sync)
    lazy = graph(x, q, k, v, g, beta, state)
    compiled = mx.compile(graph)(x, q, k, v, g, beta, state)
    monkeypatch.undo()
    mx.eval(lazy, compiled)
    for got in (lazy, compiled):
        assert bitwise(got[0], want) and bitwise(got[1], want_y)
        assert all(bitwise(a, b) for a, b in zip(got[2:], want_states))


def test_bad_inputs_are_clear_errors():
    require_lazy()
    q, k, v, g, beta, state = gdn_inputs(2, 2, 4, 64, 32, seed=1)
    with pytest.raises(ValueError, match=r"^gdn kernel: needs float32 inputs, got "
                                         r"mlx.core.float16$"):
        gdn_kernel.states(q.astype(mx.float16), k, v, g, beta, state)
    with pytest.raises(ValueError, match=r"^row kernel: 12 columns of a \(16, 24\) weight"):
        row_kernel.products(mx.zeros((2, 24)), mx.zeros((16, 24)), 12)
    ops = lazy_kernels.load()
    with pytest.raises(ValueError, match=r"mlx_mtp row kernel: needs x \[R, K\]"):
        ops.row_dot(mx.zeros((2, 24)), mx.zeros((16, 24)), 20, 1)


def test_switched_off_by_the_environment(fresh, monkeypatch):
    monkeypatch.setenv(lazy_kernels.ENV, "0")
    assert lazy_kernels.load() is None
    assert lazy_kernels.mode() == "eager (MLX_MTP_LAZY_KERNELS=0)"
    assert not os.path.exists(fresh), "switched off: nothing built"
    W = mx.random.normal((16, 520), key=mx.random.key(5))
    x = mx.random.normal((2, 520), key=mx.random.key(6))
    if row_kernel.available():  # the eager kernel still serves a mx.array weight
        got = row_kernel.products(x, W, 16)
        want = row_kernel.products(x, row_kernel.weight_view(W), 16)
        mx.eval(got, want)
        assert bitwise(got, want)


def test_every_kernel_switched_off_switches_it_off_too(fresh, monkeypatch):
    monkeypatch.setenv(native.ALL_ENV, "0")
    assert lazy_kernels.reason() == "MLX_MTP_ROW_KERNEL=0"


def test_a_bad_switch_value_is_a_one_line_error(fresh, monkeypatch):
    monkeypatch.setenv(lazy_kernels.ENV, "on")
    with pytest.raises(MTPError, match=r"^environment variable MLX_MTP_LAZY_KERNELS must be 0 "
                                       r"or 1, got 'on'$"):
        lazy_kernels.load()


def test_no_nanobind_is_reported_and_leaves_the_eager_path(fresh, monkeypatch):
    monkeypatch.setitem(sys.modules, "nanobind", None)  # import nanobind raises ImportError
    assert lazy_kernels.load() is None
    assert lazy_kernels.reason() == ("cannot build or load lazy_ops.cpp: nanobind is not "
                                     "installed (pip install 'mlx-mtp[lazy]')")
    assert lazy_kernels.mode().startswith("eager (cannot build or load lazy_ops.cpp: nanobind")


def test_no_cmake_is_reported(fresh, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setitem(sys.modules, "cmake", None)
    assert lazy_kernels.load() is None
    assert lazy_kernels.reason() == ("cannot build or load lazy_ops.cpp: no cmake (pip install "
                                     "cmake, or the system's)")


def test_a_failing_build_is_reported_and_leaves_nothing_in_the_cache(fresh, monkeypatch):
    """No C++ compiler: CMake's configure step fails; the reason names it, the cache holds no
    module and no temporary folder."""
    if not shutil.which("cmake"):
        pytest.skip("no cmake here")
    pytest.importorskip("nanobind")
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert lazy_kernels.load() is None
    assert lazy_kernels.reason().startswith("cannot build or load lazy_ops.cpp: cmake failed (1)")
    assert os.listdir(fresh) == []


def test_a_module_with_another_nanobind_abi_is_refused():
    """A nanobind whose ABI differs from mlx.core's builds and imports but refuses mx.array
    arguments with a TypeError: the check turns that into the reason."""
    class Refuses:
        @staticmethod
        def abi():
            return lazy_kernels.ABI

        @staticmethod
        def row_dot(*args):
            raise TypeError("row_dot(): incompatible function arguments.\nInvoked with types: "
                            "mlx.core.array")

    pytest.importorskip("nanobind")
    with pytest.raises(RuntimeError, match=r"^its nanobind \S+ cannot pass mlx.core.array \(mlx "
                                           r"\S+: another nanobind ABI\): row_dot\(\): "
                                           r"incompatible function arguments.$"):
        lazy_kernels._check(Refuses())


def test_a_module_of_another_abi_is_refused():
    class Old:
        @staticmethod
        def abi():
            return lazy_kernels.ABI + 1

    with pytest.raises(RuntimeError, match=rf"^the extension has ABI {lazy_kernels.ABI + 1}, "
                                           rf"expected {lazy_kernels.ABI}$"):
        lazy_kernels._check(Old())


def test_a_cached_module_is_loaded_without_building(monkeypatch):
    require_lazy()
    lazy_kernels.reset()
    import subprocess

    def no_build(*a, **kw):
        raise AssertionError("built again although the cache holds the module")

    monkeypatch.setattr(subprocess, "run", no_build)
    try:
        assert lazy_kernels.available(), lazy_kernels.reason()
    finally:
        lazy_kernels.reset()


def test_the_reports_name_the_path():
    from mlx_mtp.exactness.gate import row_exact_summary

    ex = {"row_exact": {"layers": {"kernel": 2}, "kernel": "available, lazy"}}
    assert row_exact_summary(ex) == "2 (kernel 2); row kernel available, lazy"
