"""What the tests of the C kernels and of each BLAS binding share."""

import functools
import os

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.gated_delta import normalize_qk

from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.cpu import lazy_ops as lazy_kernels
from mlx_mtp.cpu import native


def require_kernel(problem: str, available, reason, name: str) -> None:
    """Skip where no such kernel can exist (``problem``: not x86-64 Linux with AVX2 + FMA);
    fail where it should exist and is unavailable."""
    if problem:
        pytest.skip(problem)
    if not available():
        pytest.fail(f"{name} unavailable on this x86-64 box: {reason()}")


def require_lazy() -> None:
    """The C kernels' MLX extension (``lazy_kernels``): skipped in a run of the suite on the eager
    path (``MLX_MTP_LAZY_KERNELS=0``) and where no kernel can exist; else it must load."""
    if os.environ.get(lazy_kernels.ENV) == "0":
        pytest.skip(f"{lazy_kernels.ENV}=0")
    require_kernel(native.cpu_problem(), lazy_kernels.available, lazy_kernels.reason,
                   "lazy kernels")


def blas_bindings():
    """(name, MLX_MTP_CPU_BLAS value) of the bundled BLAS and of the first library of each kind."""
    found = {name: path for name, path in reversed(cpu_blas.find())}
    return [("bundled", "off")] + sorted(found.items())


def gdn_inputs(T, Hk, Hv, Dk, Dv, seed, state="random"):
    """A GatedDeltaNet recurrence's inputs (``gdn_block.reference_states``' arguments) as the layer
    makes them (normalized q and k); ``state``: "random", "zeros" or "none"."""
    keys = mx.random.split(mx.random.key(seed), 8)
    q, k = normalize_qk(mx.random.normal((1, T, Hk, Dk), key=keys[0]),
                        mx.random.normal((1, T, Hk, Dk), key=keys[1]), inv_scale=Dk**-0.5,
                        eps=1e-6)
    v = mx.random.normal((1, T, Hv, Dv), key=keys[2])
    a, b = mx.random.normal((1, T, Hv), key=keys[3]), mx.random.normal((1, T, Hv), key=keys[4])
    A_log, dt_bias = mx.random.normal((Hv,), key=keys[5]), mx.random.normal((Hv,), key=keys[6])
    s = {"none": None, "zeros": mx.zeros((1, Hv, Dv, Dk)),
         "random": 0.1 * mx.random.normal((1, Hv, Dv, Dk), key=keys[7])}[state]
    args = [q, k, v, a, b, A_log, dt_bias, s]
    mx.eval([x for x in args if x is not None])
    return args


def row_dot_reference(x, w):
    """``x [T, K] @ w [N, K].T`` (numpy float32) in the order the row kernel documents
    (``mlx_mtp/cpu/csrc/row_dot.c``), computed without it: 8 lanes, lane j a sequential fused
    multiply-add over k = j mod 8 of the first K - K % 8 inputs; the lanes added
    ((0+1)+(2+3))+((4+5)+(6+7)); then the last K % 8 products added one by one, each rounded.
    A fused multiply-add is the float32 rounding of the product and sum held in extended
    precision (exact for the product of two float32s; x86's long double)."""
    x = np.asarray(x, np.float32)
    w = np.asarray(w, np.float32)
    T, K = x.shape
    K8 = K - K % 8
    xl, wl = x[:, None, :K8].astype(np.longdouble), w[None, :, :K8].astype(np.longdouble)
    acc = np.zeros((T, w.shape[0], 8), np.float32)
    for k in range(0, K8, 8):
        acc = (xl[..., k : k + 8] * wl[..., k : k + 8] + acc).astype(np.float32)
    a = [acc[..., j] for j in range(8)]
    s = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]))
    for k in range(K8, K):
        s = s + x[:, None, k] * w[None, :, k]
    return s


@functools.lru_cache(maxsize=None)
def one_row_products_in_kernel_order() -> bool:
    """Whether the bound BLAS's one-row products reduce in the row kernel's order (BLIS's AVX2
    configurations do; BLIS's generic one, OpenBLAS and MLX's bundled BLAS do not): measured on
    a few shapes, K % 8 != 0 included, against ``row_dot_reference``. Where they do, the kernel's
    multi-row products must equal them bitwise and ``row_exact_layers.switch_to_row_exact`` may pick it."""
    out = []
    for N, K in ((64, 1024), (16, 520), (8, 1027)):
        w = mx.random.normal((N, K), key=mx.random.key(N + K))
        x = mx.random.normal((2, K), key=mx.random.key(K))
        rows = [x[i : i + 1] @ w.T for i in range(2)]
        mx.eval(rows)
        want = row_dot_reference(np.array(x), np.array(w))
        out.append(all(np.array(rows[i])[0].tobytes() == want[i].tobytes() for i in range(2)))
    assert len(set(out)) == 1, f"the one-row order is the kernel's for some shapes only: {out}"
    return out[0]


@functools.lru_cache(maxsize=None)
def conv_sums_taps_in_order(channels: int, K: int = 4, T: int = 6) -> bool:
    """Whether MLX's depthwise conv1d sums a window's K products in tap order from zero, each
    product and sum rounded (what ``gdn_block.taps_conv`` computes), with this BLAS on this
    CPU: measured against numpy for ``channels`` channels. BLIS's AVX2 kernels and MLX's bundled
    BLAS do; OpenBLAS and BLIS's generic kernels need not. Where it does, the GatedDeltaNet
    mixer's check must pick the taps form."""
    x = mx.random.normal((1, K - 1 + T, channels), key=mx.random.key(channels))
    w = mx.random.normal((channels, K, 1), key=mx.random.key(K))
    conv = mx.conv1d(x, w, 1, 0, 1, channels)
    xn, wn = np.array(x), np.array(w)[:, :, 0]
    want = np.zeros((1, T, channels), np.float32)
    for j in range(K):
        want = want + xn[:, j : j + T] * wn[:, j]
    return np.array(conv).tobytes() == want.tobytes()
