"""The expert kernel: a mixture of experts' products grouped by expert, as a lazy MLX op.

mlx-lm's ``SwitchGLU`` multiplies each (row, expert) pair with its own one-row BLAS call
(``gather_mm``): a verify of w rows reads an expert once for every row routed to it.
``row_dot.c``'s ``expert_dot`` sorts the pairs by expert and computes each expert's rows in one
pass over its weight, every output in the order of BLIS's one-row product (the row kernel's,
``mlx_mtp.cpu.row_kernel``), so a verify reads each routed expert about once. Weights are an
``[E, N, K]`` stack of float32 (N a multiple of 8) or bfloat16, each expert's rows contiguous at
any expert stride (the gate and up halves of a fused stack are views). It runs as a lazy op only
(``mlx_mtp.cpu.lazy_ops``); ``mlx_mtp.exactness.grouped_experts`` uses it where a bitwise check
on a layer's own weights says it equals the layer's one-row products.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from mlx_mtp.cpu import lazy_ops as lazy_kernels
from mlx_mtp.cpu import row_kernel


def problem() -> Optional[str]:
    """Why the expert kernel cannot run here (None: it can)."""
    if mx.default_device() != mx.cpu:
        return "the default device is not the CPU"
    if not row_kernel.available():
        return f"the row kernel is unavailable ({row_kernel.reason()})"
    if not lazy_kernels.available():
        return f"the lazy kernels are unavailable ({lazy_kernels.reason()})"
    return None


def fits(weight: mx.array) -> bool:
    """Whether the kernel takes ``weight`` as it is: ``[E, N, K]`` float32 with N a multiple of
    8 (BLIS reduces the last N % 8 columns another way) or bfloat16, each expert's ``[N, K]``
    rows contiguous."""
    if weight.ndim != 3 or weight.dtype not in (mx.float32, mx.bfloat16):
        return False
    if weight.dtype == mx.float32 and weight.shape[1] % row_kernel.COLUMN_GROUP:
        return False
    mx.eval(weight)
    strides = _strides(weight)
    return strides[2] == 1 and strides[1] == weight.shape[2]


def _strides(a: mx.array):
    """Element strides of an evaluated array (memoryview's are in bytes)."""
    return tuple(s // a.dtype.size for s in memoryview(a).strides)


def products(x: mx.array, indices: mx.array, weight: mx.array, threads: int = 1) -> mx.array:
    """``[X * k, N]``: row ``i // k`` of ``x [X, K]`` times the transpose of expert
    ``indices.flat[i]``'s weight (``weight [E, N, K]``; ``indices [X, k]``), each output in
    BLIS's one-row order, each expert's weight read once for all its rows."""
    ops = lazy_kernels.load()
    if ops is None:
        raise RuntimeError(f"expert kernel unavailable: {lazy_kernels.reason()}")
    return ops.expert_dot(x, indices, weight, threads)
