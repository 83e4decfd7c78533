"""A compiled CPU kernel for multi-row products that equal BLIS's one-row products, bitwise.

Plain decode multiplies one row (MLX's CPU backend calls ``cblas_sgemm`` with M = 1), and BLIS
(0.9, AVX2) reduces each output of that product in a fixed order: 8 lanes (input index mod 8),
each a sequential fused multiply-add, the lanes added pairwise ((0+1)+(2+3))+((4+5)+(6+7)), then
the last K % 8 products added one by one. Its multi-row products take another order for inputs
wider than 512, so an exact verify used to compute each row on its own, reading the weights once
per row. ``kernels/row_dot.c`` computes T rows in the one-row order while it streams each weight
row once, so an exact verify reads the weights about once, like a decode step. It covers the
first N - N % 8 output columns: BLIS reduces the last N % 8 another way, which ``row_exact``
computes with BLAS one-row products. ``row_exact.install`` uses the kernel for a layer only where
a bitwise check on the layer's own weights says it equals the layer's own one-row call.

The C source is compiled on first use with the system C compiler (``$CC``, else ``cc``) into a
per-user cache (``$MLX_MTP_CACHE``, else ``$XDG_CACHE_HOME/mlx_mtp``, else ``~/.cache/mlx_mtp``),
named by a hash of the source, compiler and flags, and loaded with ctypes. No compiler, a machine
that is not x86-64 Linux with AVX2 and FMA, a failed compile or ``MLX_MTP_ROW_KERNEL=0``: the
kernel is unavailable, ``reason()`` says why, and ``row_exact`` keeps its other paths.

The kernel runs eagerly (it evaluates its input, a host sync), so it cannot run inside an
``mx.compile``d function; the verify forward that calls it is not compiled.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from . import env

ENV = "MLX_MTP_ROW_KERNEL"
CACHE_ENV = "MLX_MTP_CACHE"
SOURCE = Path(__file__).parent / "kernels" / "row_dot.c"
FLAGS = ("-O2", "-mavx2", "-mfma", "-ffp-contract=off", "-fPIC", "-shared", "-pthread")
ABI = 2  # row_dot_abi() of the source this module calls
COMPILE_TIMEOUT_S = 120
COLUMN_GROUP = 8  # the kernel covers whole groups of 8 output columns (BLIS's dot kernel width)


class _State:
    lib = None  # the loaded library, or None
    reason = ""  # why the kernel is unavailable ("" while it is available or not yet tried)
    tried = False


_state = _State()


def reset() -> None:
    """Forget the loaded kernel, so that the next use builds or loads it again (tests)."""
    global _state
    _state = _State()


def cache_dir(environ=None) -> Path:
    environ = os.environ if environ is None else environ
    if environ.get(CACHE_ENV):
        return Path(environ[CACHE_ENV])
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlx_mtp"


def _cpu_problem() -> Optional[str]:
    """Why this machine cannot run the kernel, or None."""
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        return f"needs x86-64 Linux, this is {platform.machine()} {sys.platform}"
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f
                          if line.startswith("flags")), [])
    except OSError as e:
        return f"cannot read /proc/cpuinfo ({e})"
    missing = [f for f in ("avx2", "fma") if f not in flags]
    return f"the CPU lacks {' and '.join(missing)}" if missing else None


def _build(environ) -> ctypes.CDLL:
    """Compile (or find in the cache) and load the library; raises OSError / RuntimeError."""
    compiler = shlex.split(environ.get("CC") or "cc")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + repr((compiler, FLAGS)).encode()).hexdigest()[:16]
    folder = cache_dir(environ)
    path = folder / f"row_dot-{key}.so"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".row_dot-", suffix=".so", dir=folder)
        os.close(fd)
        try:
            cmd = compiler + list(FLAGS) + [str(SOURCE), "-o", tmp]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True,
                                      timeout=COMPILE_TIMEOUT_S)
            except FileNotFoundError:
                raise RuntimeError(f"no C compiler {compiler[0]!r} (set CC)") from None
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{compiler[0]} ran past {COMPILE_TIMEOUT_S} s") from None
            if done.returncode:
                last = (done.stderr.strip().splitlines() or ["no message"])[-1]
                raise RuntimeError(f"{compiler[0]} failed ({done.returncode}): {last}")
            os.replace(tmp, path)  # atomic: a concurrent loader sees no half-written library
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(path))
    lib.row_dot_abi.restype = ctypes.c_int
    if lib.row_dot_abi() != ABI:
        raise RuntimeError(f"{path} has ABI {lib.row_dot_abi()}, expected {ABI}")
    ssize = ctypes.c_ssize_t
    ptr = ctypes.c_void_p
    lib.row_dot_f32.restype = ctypes.c_int
    lib.row_dot_f32.argtypes = [ptr, ssize, ssize, ssize, ptr, ssize, ptr, ssize, ctypes.c_int]
    return lib


def load(environ=None):
    """The loaded kernel library, or None (``reason()`` says why). Tried once per process
    (``reset`` to try again)."""
    if _state.tried:
        return _state.lib
    environ = os.environ if environ is None else environ
    _state.tried = True
    if not env.flag(ENV, environ, default=True):
        _state.reason = f"{ENV}=0"
        return None
    problem = _cpu_problem()
    if problem:
        _state.reason = problem
        return None
    try:
        _state.lib = _build(environ)
    except (OSError, RuntimeError) as e:
        _state.reason = f"cannot build {SOURCE.name}: {e}"
    return _state.lib


def available() -> bool:
    return load() is not None


def reason() -> str:
    """Why the kernel is unavailable ("" when it is available)."""
    load()
    return _state.reason


def weight_view(weight: mx.array) -> np.ndarray:
    """A zero-copy float32 numpy view of an evaluated, row-contiguous [N, K] weight."""
    mx.eval(weight)
    view = np.asarray(memoryview(weight))
    if view.dtype != np.float32 or view.ndim != 2 or not view.flags.c_contiguous:
        raise ValueError(f"row kernel: needs a contiguous float32 [N, K] weight, got "
                         f"{view.dtype} {view.shape} strides {view.strides}")
    return view


def products(x: mx.array, w: np.ndarray, columns: int, threads: int = 1) -> mx.array:
    """``x @ w[:columns].T`` ([..., T, K] -> [..., T, columns]) in BLIS's one-row order, for
    ``columns`` a multiple of 8. Evaluates ``x`` (a host sync) and runs the kernel eagerly."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"row kernel unavailable: {_state.reason}")
    *lead, T, K = x.shape
    if columns % COLUMN_GROUP or columns > w.shape[0] or w.shape[1] != K:
        raise ValueError(f"row kernel: {columns} columns of a {w.shape} weight for width {K}")
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
