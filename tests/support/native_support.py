"""What the tests of the C kernels and of each BLAS binding share."""

import os

import mlx.core as mx
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
