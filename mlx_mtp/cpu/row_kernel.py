"""The row kernel: T-row products equal to BLIS's one-row products bitwise, computed by
``mlx_mtp/cpu/csrc/row_dot.c`` in BLIS's one-row reduction order while it streams each weight row
once, for the first N - N % 8 output columns. ``products`` runs it as a lazy MLX op where
``mlx_mtp.cpu.lazy_ops`` builds, else eagerly (a host sync). Built and loaded by
``mlx_mtp.cpu.native``; ``MLX_MTP_ROW_KERNEL=0`` turns it off. docs/cpu-backend.md, "The row
kernel"."""

from __future__ import annotations

import ctypes

import mlx.core as mx
import numpy as np

from mlx_mtp.cpu import pin as cpu_pin
from mlx_mtp.cpu import lazy_ops as lazy_kernels
from mlx_mtp.cpu import native
CACHE_ENV = native.CACHE_ENV  # the kernels share one cache folder
ENV = native.ALL_ENV
FLAGS = native.ROW_DOT_FLAGS
ABI = 2  # row_dot_abi() of the source this module calls
COLUMN_GROUP = 8  # the kernel covers whole groups of 8 output columns (BLIS's dot kernel width)


def _bind(lib) -> None:
    ssize = ctypes.c_ssize_t
    ptr = ctypes.c_void_p
    lib.row_dot_f32.restype = ctypes.c_int
    lib.row_dot_f32.argtypes = [ptr, ssize, ssize, ssize, ptr, ssize, ptr, ssize, ctypes.c_int]


KERNEL = native.NativeKernel("row_dot.c", "row_dot", ABI, FLAGS, _bind, switches=(ENV,))
SOURCE = KERNEL.source
_cpu_problem = native.cpu_problem


def reset() -> None:
    """Forget the loaded kernel, so that the next use builds or loads it again (tests)."""
    KERNEL.reset()


def load(environ=None):
    """The loaded kernel library, or None (``reason()`` says why). Tried once per process
    (``reset`` to try again)."""
    return KERNEL.load(environ)


def available() -> bool:
    return KERNEL.available()


def reason() -> str:
    """Why the kernel is unavailable ("" when it is available)."""
    return KERNEL.reason()


def weight_view(weight: mx.array) -> np.ndarray:
    """A zero-copy float32 numpy view of an evaluated, row-contiguous [N, K] weight."""
    mx.eval(weight)
    view = np.asarray(memoryview(weight))
    if view.dtype != np.float32 or view.ndim != 2 or not view.flags.c_contiguous:
        raise ValueError(f"row kernel: needs a contiguous float32 [N, K] weight, got "
                         f"{view.dtype} {view.shape} strides {view.strides}")
    return view


def products(x: mx.array, w, columns: int, threads: int = 1) -> mx.array:
    """``x @ w[:columns].T`` ([..., T, K] -> [..., T, columns]) in BLIS's one-row order, for
    ``columns`` a multiple of 8. ``w``: the weight (a row-contiguous float32 ``mx.array``), run
    as a lazy op where ``mlx_mtp.cpu.lazy_ops`` is available, or its ``weight_view``, run eagerly
    (evaluates ``x``, a host sync)."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"row kernel unavailable: {KERNEL.why}")
    *lead, T, K = x.shape
    if columns % COLUMN_GROUP or columns > w.shape[0] or w.shape[1] != K:
        raise ValueError(f"row kernel: {columns} columns of a {tuple(w.shape)} weight for "
                         f"width {K}")
    if isinstance(w, mx.array):
        ops = lazy_kernels.load()
        if ops is not None:
            return ops.row_dot(x.reshape(-1, K), w, columns, threads).reshape(*lead, T, columns)
        w = weight_view(w)
    cpu_pin.hold()  # inside a verify: the threads onto one core before the syncs (mlx_mtp.cpu.pin)
    mx.eval(x)  # the host sync: the kernel runs on the evaluated input
    xv = np.asarray(memoryview(x)).reshape(-1, K)  # zero-copy unless x is a strided view
    if not xv.flags.c_contiguous or xv.dtype != np.float32:
        xv = np.ascontiguousarray(xv, dtype=np.float32)
    out = np.empty((xv.shape[0], columns), np.float32)
    rc = lib.row_dot_f32(xv.ctypes.data, xv.shape[0], K, K, w.ctypes.data, columns,
                         out.ctypes.data, columns, threads)
    if rc:
        raise RuntimeError(f"row kernel failed ({rc}) for {columns} columns")
    return mx.array(out).reshape(*lead, T, columns)
