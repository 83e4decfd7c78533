"""The bf16 kernel on bfloat16 copies of a drafter's weights (``DraftOptions.bf16``): the copy,
the product as a lazy op, its threads, and whether a drafter takes it. The Qwen head's step
(``qwen3_5.drafter_products``) and the Gemma 4 assistant (``gemma4.bf16_assistant``) run their
products through it. docs/models.md, "A bfloat16 drafter on the CPU"."""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx

from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.cpu import lazy_ops as lazy_kernels
from mlx_mtp.errors import MTPError


def bf16_products(x: mx.array, w: mx.array, threads: int = 1) -> mx.array:
    """``x @ w.T`` ([..., T, K] float32 by a bfloat16 [N, K] weight) summed in float32, as a lazy
    op (the bf16 kernel of ``mlx_mtp/cpu/csrc/row_dot.c``)."""
    ops = lazy_kernels.load()
    if ops is None:
        raise RuntimeError(f"bf16 kernel unavailable: {lazy_kernels.reason()}")
    *lead, T, K = x.shape
    return ops.bf16_dot(x.reshape(-1, K), w, threads).reshape(*lead, T, w.shape[0])


def bf16_weight(weight: mx.array) -> mx.array:
    """A row-contiguous bfloat16 copy of ``weight``, evaluated."""
    w = mx.contiguous(weight.astype(mx.bfloat16))
    mx.eval(w)
    return w


# A bfloat16 weight of at least this many bytes is read by every core this process may use: a
# draft step's one-row product is bound by the read, which a second thread speeds up from about
# this size (chosen by benchmarks/bench_drafter.py; its drafter-phases record holds the numbers).
BF16_PARALLEL_BYTES = 4 * 1024 * 1024


def bf16_threads(weight: mx.array) -> int:
    """The bf16 kernel's threads for one product with ``weight``: ``MLX_MTP_VERIFY_THREADS`` if
    set, as for the row kernel; else every usable core from ``BF16_PARALLEL_BYTES`` on. Each
    output is computed by one thread, so the bytes do not depend on it."""
    from mlx_mtp.exactness.row_exact_layers import kernel_threads

    if cpu_blas.verify_threads_set():
        return kernel_threads()
    return cpu_blas.usable_cores() if weight.nbytes >= BF16_PARALLEL_BYTES else 1


def bf16_problem() -> Optional[str]:
    """Why the bf16 kernel cannot run the drafter's products here (None: it can): the lazy
    CPU kernels, which the row kernel's drafter products need too
    (``qwen3_5.drafter_products.problem``)."""
    if mx.default_device() != mx.cpu:
        return "the default device is not the CPU"
    if not lazy_kernels.available():
        return f"the lazy kernels are unavailable ({lazy_kernels.reason()})"
    return None


def resolve_bf16(option: Optional[bool], weights: Callable[[], list]) -> bool:
    """``DraftOptions.bf16``: False off; True on (an error where the kernel cannot run); None
    on where it can and it rounds nothing: every float32 matrix ``weights()`` lists (those the
    step would copy) holds bfloat16 values, as a checkpoint shipped in bfloat16 and cast to float32
    on load does, and no matrix is quantized."""
    if option is False:
        return False
    why = bf16_problem()
    if option is None:
        if why is not None:
            return False
        matrices = weights()
        return bool(matrices) and all(w.dtype == mx.float32 and holds_bf16(w) for w in matrices)
    if why is not None:
        raise MTPError(f"--draft-bf16 (DraftOptions(bf16=True)): {why}")
    return True


def holds_bf16(w: mx.array, rows: int = 8192) -> bool:
    """Whether every value of ``w`` is a bfloat16 value (rounding it to bfloat16 changes
    nothing), checked ``rows`` rows at a time (no full-size temporary)."""
    w = w.reshape(-1, w.shape[-1])
    for start in range(0, w.shape[0], rows):
        part = w[start:start + rows]
        if not mx.array_equal(part, part.astype(mx.bfloat16).astype(part.dtype)).item():
            return False
    return True
