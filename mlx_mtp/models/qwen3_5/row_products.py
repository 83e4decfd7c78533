"""The drafter's products through the row kernel (``mlx_mtp.cpu.row_kernel``) where the BLAS packs.

A draft step and an accept hook multiply 1-6 rows by each of the head's weights and by the draft LM
head. OpenBLAS runs such a product as a full GEMM that packs the weight first, every call; the row
kernel, as a lazy MLX op (``mlx_mtp.cpu.lazy_ops``: it runs inside the compiled step), reads each
weight row once. BLIS does not pack one-row products, so the kernel gains nothing there, and
``None`` (auto) takes it with OpenBLAS only (chosen by measurement on the CPU). The kernel sums in
another order than the BLAS: a draft may differ in a near tie, never the output (the target verifies
it).
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx

from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.cpu import lazy_ops as lazy_kernels
from mlx_mtp.cpu import row_kernel
from mlx_mtp.errors import MTPError

AUTO_BLAS = ("OpenBLAS",)  # the loaded BLAS libraries ``None`` turns it on for


def problem() -> Optional[str]:
    """Why the row kernel cannot run the drafter's products here (None: it can)."""
    if mx.default_device() != mx.cpu:
        return "the default device is not the CPU"
    if not row_kernel.available():
        return f"the row kernel is unavailable ({row_kernel.reason()})"
    if not lazy_kernels.available():
        return f"the lazy kernels are unavailable ({lazy_kernels.reason()})"
    return None


def resolve(option: Optional[bool]) -> bool:
    """``DraftOptions.row_kernel``: False off; True on (an error where it cannot run); None on
    where the loaded CPU BLAS is one that packs few-row products and the kernel can run."""
    if option is False:
        return False
    if option is None:
        return cpu_blas.STATE.name in AUTO_BLAS and problem() is None
    why = problem()
    if why is not None:
        raise MTPError(f"draft row kernel (DraftOptions(row_kernel=True)): {why}")
    return True


def fits(rows: int, dtype) -> bool:
    """The kernel takes a weight of ``rows`` outputs whole: float32, whole groups of 8."""
    return dtype == mx.float32 and rows % row_kernel.COLUMN_GROUP == 0


def matmul_for(weight: mx.array, on: bool) -> Callable[[mx.array], mx.array]:
    """``x -> x @ weight.T``: through the row kernel if ``on`` and the weight fits, else the
    BLAS. The weight is made row-contiguous once, here."""
    if on and fits(weight.shape[0], weight.dtype):
        w = mx.contiguous(weight)
        mx.eval(w)

        def by_kernel(x):
            return row_kernel.products(x, w, w.shape[0])
        by_kernel.by_kernel = True
        return by_kernel

    def by_blas(x):
        return x @ weight.T
    by_blas.by_kernel = False
    return by_blas
