"""Give MLX's CPU backend a fast system BLAS on Linux: load BLIS or OpenBLAS with RTLD_GLOBAL
before ``mlx.core`` is first imported, so MLX binds to it (``MLX_MTP_CPU_BLAS``: unset = the first
library found, ``off`` = MLX's bundled BLAS, a path = that library); and the thread counts of
decode, of a round's multi-row products (``verify_threads``) and of a prefill
(``prefill_threads``). This module must not import mlx. docs/cpu-backend.md, "The BLAS binding"
and "Threads"."""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import List, Optional, Tuple

from mlx_mtp import config  # imports no mlx

ENV = "MLX_MTP_CPU_BLAS"
VERIFY_THREADS_ENV = "MLX_MTP_VERIFY_THREADS"

# Fastest first (BLIS's one-row products: benchmarks/bench_mtp.py's records with each library);
# BLIS runs one thread fewer than the cores, split over columns (see blis_threads).
_CANDIDATES: List[Tuple[str, str, str]] = [
    ("BLIS", "/usr/lib/*-linux-gnu/blis-pthread/libblis.so.4", "BLIS_NUM_THREADS"),
    ("BLIS", "/usr/lib/*-linux-gnu/libblis.so.4", "BLIS_NUM_THREADS"),
    ("OpenBLAS", "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0", "OPENBLAS_NUM_THREADS"),
    ("OpenBLAS", "/usr/lib/*-linux-gnu/libopenblas.so.0", "OPENBLAS_NUM_THREADS"),
]
_THREAD_VARS = {"BLIS": "BLIS_NUM_THREADS", "OpenBLAS": "OPENBLAS_NUM_THREADS"}


@dataclass
class BlasState:
    name: str = "bundled"  # "BLIS", "OpenBLAS", "custom", "bundled", "not applicable"
    path: Optional[str] = None
    threads: Optional[int] = None
    chosen: bool = False  # the thread count is ours (``blis_threads``), not the user's
    error: Optional[str] = None  # a library the user named could not be loaded

    def describe(self) -> str:
        if self.path is None:
            return {"bundled": "bundled (reference BLAS of the mlx wheel)"}.get(self.name, self.name)
        threads = f", {self.threads} thread{'s' if self.threads != 1 else ''}" if self.threads else ""
        if self.name == "BLIS" and os.environ.get("BLIS_JC_NT"):
            threads += " over columns (BLIS_JC_NT)"
        return f"{self.name} ({self.path}{threads})"


STATE = BlasState()  # module state: MLX binds one BLAS per process, once
_done = False  # ``load`` ran (it can run only before mlx.core is imported)


def _kind_of(path: str) -> str:
    base = os.path.basename(path).lower()
    if "blis" in base:
        return "BLIS"
    if "openblas" in base:
        return "OpenBLAS"
    return "custom"


def find() -> List[Tuple[str, str]]:
    """(name, path) of the system libraries found, fastest first."""
    out, seen = [], set()
    for name, pattern, _ in _CANDIDATES:
        for path in sorted(glob.glob(pattern)):
            real = os.path.realpath(path)
            if real not in seen:
                seen.add(real)
                out.append((name, path))
    return out


# BLIS's own split of the loops over threads (its environment variables; the product is the count).
BLIS_WAYS = ("BLIS_JC_NT", "BLIS_PC_NT", "BLIS_IC_NT", "BLIS_JR_NT", "BLIS_IR_NT")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask; where there is none, as on macOS,
    every core)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:
        return os.cpu_count() or 1


def blis_threads(cores: int) -> int:
    """BLIS's default thread count: all cores but one (at least one).

    BLIS 0.9 (pthreads) starts its threads on every call, and threads that share a packed block
    wait for each other at spin barriers (no yield) several times per call. A spinning thread
    whose partner is descheduled burns its whole time slice, and in a decode loop the partner
    is descheduled often: mlx-lm's Python thread builds the next step while MLX computes this
    one, so with as many BLIS threads as cores three threads want two cores, and BLIS's own
    2-D split makes the threads meet at more barriers than a split over columns (chosen by
    benchmarks/blas_spread.py, whose arms are these settings; docs/cpu-backend.md, "Threads")."""
    return max(1, cores - 1)


def _set_threads(name: str) -> Optional[int]:
    """The thread count the library will use, choosing it when the user set none: OpenBLAS all
    cores (its waits yield), BLIS ``blis_threads`` split over output columns only
    (``BLIS_JC_NT``), so that each thread packs and computes its own columns and threads meet
    at the fewest barriers."""
    var = _THREAD_VARS.get(name)
    if var is None:
        return None
    if name == "BLIS" and any(os.environ.get(v) for v in BLIS_WAYS):
        ways = [int(os.environ.get(v) or 1) for v in BLIS_WAYS]
        return max(1, ways[0] * ways[1] * ways[2] * ways[3] * ways[4])
    if var not in os.environ and "OMP_NUM_THREADS" not in os.environ:
        cores = usable_cores()
        if name == "BLIS":
            os.environ["BLIS_JC_NT"] = str(blis_threads(cores))
            STATE.chosen = True
            return blis_threads(cores)
        os.environ[var] = str(cores)
    return int(os.environ.get(var) or os.environ.get("OMP_NUM_THREADS") or 1)


def load() -> BlasState:
    """Load the library once, on Linux, if ``mlx.core`` has not been imported yet."""
    global _done
    if _done:
        return STATE
    _done = True
    if not sys.platform.startswith("linux"):
        STATE.name = "not applicable"  # macOS: MLX uses Accelerate / Metal
        return STATE
    choice = config.text(ENV)
    if choice.lower() == "off":
        return STATE
    if choice:
        candidates = [(_kind_of(choice), choice)]
    else:
        candidates = find()
    if not candidates:
        return STATE
    if "mlx.core" in sys.modules:
        warnings.warn(
            "mlx_mtp: mlx.core was imported before mlx_mtp, so the system BLAS "
            f"({candidates[0][1]}) cannot replace MLX's slow bundled BLAS; import mlx_mtp first",
            RuntimeWarning, stacklevel=3)
        return STATE
    for name, path in candidates:
        threads = _set_threads(name)
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            if choice:  # reported by mlx_mtp.load (an MTPError), not silently dropped
                STATE.error = f"{ENV}={choice}: cannot load this library ({e})"
                return STATE
            continue
        STATE.name, STATE.path, STATE.threads = name, path, threads
        return STATE
    return STATE


# ------------------------------------------------------------------------------ thread count

_THREAD_API = {"BLIS": ("bli_thread_get_num_threads", "bli_thread_set_num_threads"),
               "OpenBLAS": ("openblas_get_num_threads", "openblas_set_num_threads")}
_api = None  # module state: the bound library's thread calls, looked up once per process


def _thread_api():
    """(get, set) of the bound library's thread count, or None (bundled BLAS, unknown library)."""
    global _api
    if _api is None:
        _api = ()
        if STATE.path is not None:
            lib = ctypes.CDLL(STATE.path, mode=ctypes.RTLD_GLOBAL)
            for get_name, set_name in _THREAD_API.values():
                if hasattr(lib, get_name) and hasattr(lib, set_name):
                    get, set_ = getattr(lib, get_name), getattr(lib, set_name)
                    get.restype, get.argtypes = ctypes.c_long, []
                    set_.restype = None
                    set_.argtypes = [ctypes.c_long if get_name.startswith("bli") else ctypes.c_int]
                    _api = (get, set_)
                    break
    return _api or None


def verify_threads_set(environ=None) -> bool:
    return config.is_set(VERIFY_THREADS_ENV, environ)


def verify_thread_count(environ=None) -> int:
    """``MLX_MTP_VERIFY_THREADS``: unset = 1; 0 = leave the BLAS thread count alone; n >= 1."""
    return config.count(VERIFY_THREADS_ENV, environ)


# A round's BLAS threads where MLX_MTP_VERIFY_THREADS is unset, per library (else 1). OpenBLAS
# keeps its own count: unlike BLIS, its few-row products run markedly slower on one thread than
# on its default count (the accept hook's time in benchmarks/bench_drafter.py shows it).
ROUND_THREADS_DEFAULT = {"OpenBLAS": 0}


def round_thread_count(environ=None) -> int:
    """The BLAS thread count a round runs with (``verify_threads``): ``MLX_MTP_VERIFY_THREADS``
    if set, else the bound library's default (``ROUND_THREADS_DEFAULT``, else 1); 0 = the
    library's own count."""
    if not config.is_set(VERIFY_THREADS_ENV, environ):
        return ROUND_THREADS_DEFAULT.get(STATE.name, 1)
    return verify_thread_count(environ)


@contextmanager
def verify_threads():
    """Run the body with the BLAS thread count for a round's work (``round_thread_count``)."""
    n = round_thread_count()
    api = _thread_api() if n else None
    if api is None:
        yield
        return
    get, set_ = api
    before = get()
    if before == n:
        yield
        return
    ways = _blis_ways() if before < 1 else None  # BLIS split by ways (BLIS_JC_NT...): get() = -1
    set_(n)
    try:
        yield
    finally:
        if ways is not None:  # put the per-loop split back, not a thread count of -1
            _set_ways(*ways)
        else:
            set_(before)


@contextmanager
def prefill_threads():
    """Run the body (a prompt's prefill, evaluated while the Python thread waits) with BLIS on
    every usable core, split over output columns, where the thread count is ours: a prefill's
    products are many rows against each weight, so a second thread nearly halves them, and a
    split over columns leaves every product bitwise as on one thread (each thread sums its own
    columns in the same order). Elsewhere (another library, a count the user set) it does
    nothing."""
    cores = usable_cores()
    if STATE.name != "BLIS" or not STATE.chosen or cores <= blis_threads(cores):
        yield
        return
    ways = _blis_ways()
    _set_ways(cores, 1, 1, 1, 1)
    try:
        yield
    finally:
        _set_ways(*ways)


def _blis_ways():
    """BLIS's per-loop split as its environment sets it (``BLIS_WAYS`` order), or None."""
    if STATE.name != "BLIS":
        return None
    return tuple(int(os.environ.get(v) or 1) for v in BLIS_WAYS)


def _set_ways(jc, pc, ic, jr, ir) -> None:
    lib = ctypes.CDLL(STATE.path, mode=ctypes.RTLD_GLOBAL)
    lib.bli_thread_set_ways.restype = None
    lib.bli_thread_set_ways.argtypes = [ctypes.c_long] * 5
    lib.bli_thread_set_ways(jc, pc, ic, jr, ir)
