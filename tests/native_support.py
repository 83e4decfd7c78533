"""What the tests of the C kernels and of each BLAS binding share."""

import os

import pytest

from mlx_mtp import cpu_blas, lazy_kernels, native


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
