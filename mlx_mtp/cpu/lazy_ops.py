"""mlx_mtp's C kernels as lazy MLX graph ops: an MLX C++ extension
(``mlx_mtp/cpu/csrc/lazy_ops.cpp``) that wraps the same C functions as MLX primitives queued on
the CPU stream, so a verify stays one graph, read once. Built on first use with CMake into
``native``'s cache folder and loaded once per process; where that fails, or with
``MLX_MTP_LAZY_KERNELS=0``, the kernels run eagerly and ``reason()`` says why.
docs/cpu-backend.md, "Eager and lazy kernels"."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from mlx_mtp import config as env
from mlx_mtp.cpu import native

logger = logging.getLogger("mlx_mtp")
ENV = "MLX_MTP_LAZY_KERNELS"  # 0: the eager (ctypes) kernels even where the extension builds
ABI = 4  # the extension's abi()
MODULE = "_mlx_mtp_lazy"  # NB_MODULE name in lazy_ops.cpp
SOURCES = ("lazy_ops.cpp", "CMakeLists.txt", "row_dot.c", "gdn_steps.c", "attn_rows.c")
BUILD_TIMEOUT_S = 900


class _State:
    module = None
    why = ""  # why the extension is unavailable ("" while available or not yet tried)
    tried = False


_STATE = _State()


def reset() -> None:
    """Forget the loaded extension's state, so that the next use tries again (tests). A module
    once imported stays imported; its ops are used again when it loads."""
    _STATE.module, _STATE.why, _STATE.tried = None, "", False


def _c_flags():
    keep = lambda flags: [f for f in flags if f != "-shared"]  # noqa: E731 (CMake links)
    return keep(native.ROW_DOT_FLAGS), keep(native.GDN_STEPS_FLAGS)


def _cmake() -> str:
    found = shutil.which("cmake")
    if found:
        return found
    try:  # pip's cmake package, where its script is not on PATH
        import cmake as cmake_package

        return os.path.join(cmake_package.CMAKE_BIN_DIR, "cmake")
    except ImportError:
        raise RuntimeError("no cmake (pip install cmake, or the system's)") from None


def _nanobind_dir() -> tuple:
    try:
        import nanobind
    except ImportError:
        raise RuntimeError("nanobind is not installed (pip install 'mlx-mtp[lazy]')") from None
    return nanobind.cmake_dir(), nanobind.__version__


def _run(cmd, cwd, environ) -> None:
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=dict(environ),
                              timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{Path(cmd[0]).name} ran past {BUILD_TIMEOUT_S} s") from None
    if done.returncode:
        lines = (done.stderr.strip() or done.stdout.strip()).splitlines()
        error = next((ln for ln in lines if "error" in ln.lower()), lines[-1] if lines else "")
        raise RuntimeError(f"{Path(cmd[0]).name} failed ({done.returncode}): {error.strip()}")


def _build(environ) -> Path:
    """The extension's path in the cache, built there first if missing; raises RuntimeError."""
    import mlx.core as mx

    cmake = _cmake()
    nb_dir, nb_version = _nanobind_dir()
    row_flags, gdn_flags = _c_flags()
    compilers = (environ.get("CC") or "cc", environ.get("CXX") or "c++")
    text = b"".join((native.KERNELS / name).read_bytes() for name in SOURCES)
    key = hashlib.sha256(text + repr((row_flags, gdn_flags, compilers, mx.__version__,
                                      nb_version, sys.version)).encode()).hexdigest()[:16]
    folder = native.cache_dir(environ)
    path = folder / f"lazy_ops-{key}.so"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    # a warning, so the default logging shows it: the first run waits for the build
    logger.warning("mlx_mtp: building the C kernels' MLX extension into %s (once per version; "
                   "about a minute)", path)
    with tempfile.TemporaryDirectory(prefix=".lazy_ops-", dir=folder) as tmp:
        build = Path(tmp) / "build"
        import mlx

        # mlx is a namespace package: any folder named mlx on sys.path joins its __path__
        found = [Path(d) / "share" / "cmake" / "MLX" for d in mlx.__path__]
        mlx_cmake = next((d for d in found if d.is_dir()), found[0])
        _run([cmake, "-S", str(native.KERNELS), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
              f"-DPython_EXECUTABLE={sys.executable}", f"-Dnanobind_ROOT={nb_dir}",
              f"-DMLX_ROOT={mlx_cmake}", f"-DROW_DOT_FLAGS={';'.join(row_flags)}",
              f"-DGDN_STEPS_FLAGS={';'.join(gdn_flags)}"], tmp, environ)
        _run([cmake, "--build", str(build), "-j", str(min(os.cpu_count() or 1, 4))], tmp, environ)
        built = sorted(build.glob(f"{MODULE}*.so"))
        if not built:
            raise RuntimeError(f"the build made no {MODULE}*.so")
        os.replace(built[0], path)  # atomic: a concurrent loader sees no half-written module
    return path


def _import(path: Path):
    module = sys.modules.get(MODULE)
    if module is None:
        spec = importlib.util.spec_from_file_location(MODULE, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[MODULE] = module
    return module


def _check(module) -> None:
    """The module's ABI, and that it takes and returns ``mx.array``s (a nanobind built with
    another ABI than mlx.core's builds and imports, then refuses them with a TypeError)."""
    import mlx.core as mx

    if module.abi() != ABI:
        raise RuntimeError(f"the extension has ABI {module.abi()}, expected {ABI}")
    try:
        y = module.row_dot(mx.ones((1, 8)), mx.ones((8, 8)), 8, 1)
        mx.eval(y)
    except TypeError as e:
        import nanobind

        raise RuntimeError(f"its nanobind {nanobind.__version__} cannot pass mlx.core.array "
                           f"(mlx {mx.__version__}: another nanobind ABI): "
                           f"{str(e).splitlines()[0]}") from None
    if y.tolist() != [[8.0] * 8]:
        raise RuntimeError(f"its self-check computed {y.tolist()}")


def load(environ=None):
    """The extension module, or None (``reason()`` says why). Tried once per process."""
    if _STATE.tried:
        return _STATE.module
    environ = os.environ if environ is None else environ
    _STATE.tried = True
    for name in (native.ALL_ENV, ENV):
        if not env.flag(name, environ):
            _STATE.why = f"{name}=0"
            return None
    problem = native.cpu_problem()
    if problem:
        _STATE.why = problem
        return None
    try:
        _STATE.module = _import(_build(environ))
        _check(_STATE.module)
    except (OSError, RuntimeError, ImportError) as e:
        _STATE.module = None
        _STATE.why = f"cannot build or load {SOURCES[0]}: {e}"
        # One line, once a process: the eager kernels give the same bytes, only slower.
        logger.warning("mlx_mtp: the C kernels run eagerly, slower: %s. The lazy kernels need "
                       "cmake, a C++ compiler and nanobind 3.1.0 (pip install 'mlx-mtp[lazy]')",
                       _STATE.why)
    return _STATE.module


def available() -> bool:
    return load() is not None


def reason() -> str:
    """Why the lazy ops are unavailable ("" when they are available)."""
    load()
    return _STATE.why


def mode() -> str:
    """How the kernels run: ``lazy`` or ``eager (<why not lazy>)``, for reports."""
    return "lazy" if available() else f"eager ({reason()})"


@contextmanager
def eager():
    """The kernels run eagerly in the body, as with ``MLX_MTP_LAZY_KERNELS=0`` (comparisons of
    the two paths in one process: tests, ``benchmarks/verify_arms.py``)."""
    saved = (_STATE.module, _STATE.why, _STATE.tried)
    _STATE.module, _STATE.why, _STATE.tried = None, f"{ENV}=0", True
    try:
        yield
    finally:
        _STATE.module, _STATE.why, _STATE.tried = saved
