"""What the tests of the C kernels and of each BLAS binding share."""

import pytest

from mlx_mtp import cpu_blas


def require_kernel(problem: str, available, reason, name: str) -> None:
    """Skip where no such kernel can exist (``problem``: not x86-64 Linux with AVX2 + FMA);
    fail where it should exist and is unavailable."""
    if problem:
        pytest.skip(problem)
    if not available():
        pytest.fail(f"{name} unavailable on this x86-64 box: {reason()}")


def blas_bindings():
    """(name, MLX_MTP_CPU_BLAS value) of the bundled BLAS and of the first library of each kind."""
    found = {name: path for name, path in reversed(cpu_blas.find())}
    return [("bundled", "off")] + sorted(found.items())
