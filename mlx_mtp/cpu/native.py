"""Small C kernels (``mlx_mtp/cpu/csrc/*.c``) compiled on first use and loaded with ctypes.

Each ``NativeKernel`` is one C file. It is compiled with the system C compiler (``$CC``, else
``cc``) into a per-user cache (``$MLX_MTP_CACHE``, else ``$XDG_CACHE_HOME/mlx_mtp``, else
``~/.cache/mlx_mtp``), named by a hash of the source, compiler and flags, and loaded with ctypes;
the library's ``<prefix>_abi()`` must return the ABI its Python side calls. No compiler, a
machine that is not x86-64 Linux with AVX2 and FMA, a failed compile or one of the kernel's
switches set to 0 (``MLX_MTP_ROW_KERNEL=0`` switches off every kernel): the kernel is
unavailable, ``reason()`` says why, and its callers keep their other paths.

Loaded this way the kernels run eagerly (they evaluate their inputs, a host sync), so none can
run inside an ``mx.compile``d function; ``mlx_mtp.cpu.lazy_ops`` builds the same C files into an MLX
extension that runs them as lazy graph ops, and the callers prefer it where it loads.
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
from typing import Callable, Optional, Sequence

from mlx_mtp import config as env

# Each C file's compiler flags, shared by its ctypes build (``NativeKernel``) and the MLX
# extension that ``mlx_mtp.cpu.lazy_ops`` builds from the same file, so both compute the same bytes.
ROW_DOT_FLAGS = ("-O2", "-mavx2", "-mfma", "-ffp-contract=off", "-fPIC", "-shared", "-pthread")
GDN_STEPS_FLAGS = ("-O3", "-mavx2", "-ffp-contract=off", "-fPIC", "-shared")

CACHE_ENV = "MLX_MTP_CACHE"
ALL_ENV = "MLX_MTP_ROW_KERNEL"  # 0: no compiled kernel at all (the first kernel's switch)
KERNELS = Path(__file__).parent / "csrc"
COMPILE_TIMEOUT_S = 120


def cache_dir(environ=None) -> Path:
    environ = os.environ if environ is None else environ
    chosen = env.path(CACHE_ENV, environ)
    if chosen:
        return Path(chosen)
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlx_mtp"


def cpu_problem() -> Optional[str]:
    """Why this machine cannot run the kernels (x86-64 Linux, AVX2 and FMA), or None."""
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


class NativeKernel:
    """One C file: built or found in the cache on first use, loaded once per process."""

    def __init__(self, source: str, prefix: str, abi: int, flags: Sequence[str],
                 bind: Callable[[ctypes.CDLL], None], switches: Sequence[str]):
        self.source = KERNELS / source  # mlx_mtp/cpu/csrc/<source>
        self.prefix = prefix  # the library exports <prefix>_abi()
        self.abi = abi
        self.flags = tuple(flags)
        self.bind = bind  # sets the argtypes / restype of the library's functions
        self.switches = tuple(switches)  # environment flags; any set to 0 switches it off
        self.reset()

    def reset(self) -> None:
        """Forget the loaded library, so that the next use builds or loads it again (tests)."""
        self.lib = None
        self.why = ""  # why the kernel is unavailable ("" while available or not yet tried)
        self.tried = False

    def _build(self, environ) -> ctypes.CDLL:
        """Compile (or find in the cache) and load the library; raises OSError / RuntimeError."""
        compiler = shlex.split(environ.get("CC") or "cc")
        text = self.source.read_bytes()
        key = hashlib.sha256(text + repr((compiler, self.flags)).encode()).hexdigest()[:16]
        folder = cache_dir(environ)
        stem = self.source.stem
        path = folder / f"{stem}-{key}.so"
        if not path.exists():
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{stem}-", suffix=".so", dir=folder)
            os.close(fd)
            try:
                cmd = compiler + list(self.flags) + [str(self.source), "-o", tmp]
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
        abi_fn = getattr(lib, f"{self.prefix}_abi")
        abi_fn.restype = ctypes.c_int
        if abi_fn() != self.abi:
            raise RuntimeError(f"{path} has ABI {abi_fn()}, expected {self.abi}")
        self.bind(lib)
        return lib

    def load(self, environ=None):
        """The loaded library, or None (``reason()`` says why). Tried once per process."""
        if self.tried:
            return self.lib
        environ = os.environ if environ is None else environ
        self.tried = True
        off = [name for name in self.switches if not env.flag(name, environ)]
        if off:
            self.why = f"{off[0]}=0"
            return None
        problem = cpu_problem()
        if problem:
            self.why = problem
            return None
        try:
            self.lib = self._build(environ)
        except (OSError, RuntimeError) as e:
            self.why = f"cannot build {self.source.name}: {e}"
        return self.lib

    def available(self) -> bool:
        return self.load() is not None

    def reason(self) -> str:
        """Why the kernel is unavailable ("" when it is available)."""
        self.load()
        return self.why
