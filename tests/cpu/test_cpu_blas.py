"""The system BLAS is bound before mlx.core loads, on Linux, and reported; each case runs in a
fresh interpreter because the binding happens once per process."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import mlx_mtp
from mlx_mtp.cpu import blas as cpu_blas

ROOT = Path(__file__).resolve().parents[2]

ROW_CHECK = """
import mlx.core as mx
mx.random.seed(0)
W = mx.random.normal((384, 1024)); X = mx.random.normal((6, 1024))
full = X @ W.T
rows = [X[i:i + 1] @ W.T for i in range(6)]
mx.eval(full, rows)
differ = sum(bytes(memoryview(full[i:i + 1])) != bytes(memoryview(rows[i])) for i in range(6))
"""


LINUX = sys.platform.startswith("linux")


def run(code, **env):
    e = {k: v for k, v in os.environ.items()
         if k not in ("MLX_MTP_CPU_BLAS", "BLIS_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                      "LD_DEBUG", "LD_DEBUG_OUTPUT", *cpu_blas.BLIS_WAYS)}
    e.update(env, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def run_bound(code, **env):
    """``run`` with glibc's loader reporting its symbol bindings (``LD_DEBUG=bindings``):
    (the JSON, the library MLX's ``cblas_sgemm`` calls resolved to), whatever kernels that
    library picked for this CPU."""
    out, err = run(code, LD_DEBUG="bindings", **env)
    found = re.findall(r"binding file \S*libmlx\.so\S* \[\d+\] to (\S+) \[\d+\]: "
                       r"normal symbol `cblas_sgemm'", err)
    assert found, "MLX made no cblas_sgemm call in this process"
    assert len(set(found)) == 1, found
    return out, os.path.realpath(found[0])


def bundled_blas(path: str) -> bool:
    """Whether ``path`` is the reference BLAS the mlx wheel bundles (``mlx_cpu.libs``)."""
    return "mlx_cpu.libs" in path and os.path.basename(path).startswith("libblas")


STATE = """
import json, os, mlx_mtp
import mlx_mtp
from mlx_mtp.cpu import blas as cpu_blas
s = cpu_blas.STATE
""" + ROW_CHECK + """
ways = None
if s.name == "BLIS":  # what BLIS itself read from the environment
    import ctypes
    lib = ctypes.CDLL(s.path)
    lib.bli_thread_get_jc_nt.restype = lib.bli_thread_get_ic_nt.restype = ctypes.c_int64
    lib.bli_thread_get_num_threads.restype = ctypes.c_int64
    ways = [lib.bli_thread_get_num_threads(), lib.bli_thread_get_jc_nt(), lib.bli_thread_get_ic_nt()]
print(json.dumps({"name": s.name, "path": s.path, "threads": s.threads, "error": s.error,
                  "found": cpu_blas.find(), "differ": differ, "ways": ways, "described": s.describe(),
                  "blis_threads": os.environ.get("BLIS_NUM_THREADS"),
                  "blis_jc": os.environ.get("BLIS_JC_NT")}))
"""


@pytest.mark.subprocess
def test_auto_binds_the_fastest_library_found_and_it_is_the_one_mlx_uses():
    if not LINUX:
        out, _ = run(STATE)
        assert out["name"] == "not applicable" and out["path"] is None  # Accelerate / Metal
        return
    out, sgemm = run_bound(STATE)
    found = out["found"]
    if not found:
        assert out["name"] == "bundled" and out["path"] is None and bundled_blas(sgemm)
        return
    assert out["path"] == found[0][1] and out["name"] == found[0][0]
    # MLX's matmuls call the bound library (the loader resolved its cblas_sgemm there), not the
    # reference BLAS the wheel links
    assert sgemm == os.path.realpath(out["path"])
    cores = len(os.sched_getaffinity(0))
    assert out["threads"] == (max(1, cores - 1) if out["name"] == "BLIS" else cores)
    if out["name"] == "BLIS":
        # One core left to the Python thread, the rest split over output columns (see cpu_blas).
        n = max(1, cores - 1)
        assert out["blis_jc"] == str(n) and out["blis_threads"] is None
        assert out["ways"][1:] == [n, 1]  # jc, ic as BLIS read them
        assert out["described"].endswith(f", {n} thread{'s' if n > 1 else ''} over columns "
                                          "(BLIS_JC_NT))")


@pytest.mark.subprocess
def test_a_user_blis_split_is_kept():
    blis = [path for name, path in cpu_blas.find() if name == "BLIS"]
    if not blis:
        pytest.fail("BLIS not installed: .ci/run and the README install libblis4-pthread")
    out, _ = run(STATE, MLX_MTP_CPU_BLAS=blis[0], BLIS_IC_NT="2")
    assert out["name"] == "BLIS" and out["threads"] == 2 and out["blis_jc"] is None
    assert out["ways"][1:] == [1, 2]


@pytest.mark.subprocess
@pytest.mark.skipif(not LINUX, reason="the system BLAS is bound on Linux only")
def test_off_keeps_the_bundled_blas():
    out, sgemm = run_bound(STATE, MLX_MTP_CPU_BLAS="off")
    assert out["name"] == "bundled" and out["path"] is None and bundled_blas(sgemm), sgemm
    assert out["differ"] == 0  # the reference BLAS sums every row in the same order


@pytest.mark.subprocess
def test_user_thread_count_is_respected():
    if not cpu_blas.find():
        pytest.fail("no system BLAS installed: .ci/run and the README install libblis4-pthread")
    out, _ = run(STATE, BLIS_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    assert out["threads"] == 1 and out["blis_threads"] in ("1", None)


@pytest.mark.subprocess
@pytest.mark.skipif(not LINUX, reason="the system BLAS is bound on Linux only")
def test_mlx_imported_first_warns_and_keeps_the_bundled_blas():
    code = "import mlx.core\n" + STATE
    out, err = run(code)
    if out["found"]:
        assert "mlx.core was imported before mlx_mtp" in err
    assert out["name"] == "bundled" and out["differ"] == 0
    _, sgemm = run_bound(code)
    assert bundled_blas(sgemm), sgemm


@pytest.mark.subprocess
def test_a_named_library_that_cannot_load_is_a_clear_error():
    code = """
import json, mlx_mtp
try:
    mlx_mtp.load_model("/does/not/matter")
except mlx_mtp.MTPError as e:
    print(json.dumps({"error": str(e)}))
"""
    out, _ = run(code, MLX_MTP_CPU_BLAS="/no/such/libblas.so")
    assert out["error"].startswith("MLX_MTP_CPU_BLAS=/no/such/libblas.so: cannot load this library (")


THREADS = """
import json, os, mlx_mtp
import mlx_mtp
from mlx_mtp.cpu import blas as cpu_blas
api = cpu_blas._thread_api()
get = (lambda: api[0]()) if api else (lambda: None)
lib = __import__("ctypes").CDLL(cpu_blas.STATE.path) if cpu_blas.STATE.path else None
jc = (lambda: lib.bli_thread_get_jc_nt()) if cpu_blas.STATE.name == "BLIS" else (lambda: None)
before, jc_before = get(), jc()
with cpu_blas.verify_threads():
    inside = get()
print(json.dumps({"name": cpu_blas.STATE.name, "before": before, "inside": inside,
                  "after": get(), "jc_before": jc_before, "jc_after": jc()}))
"""


def openblas_max_threads(path: str) -> int:
    """The most threads this OpenBLAS build runs (``MAX_THREADS=`` of ``openblas_get_config``)."""
    import ctypes

    lib = ctypes.CDLL(path)
    lib.openblas_get_config.restype = ctypes.c_char_p
    m = re.search(r"MAX_THREADS=(\d+)", lib.openblas_get_config().decode())
    return int(m.group(1)) if m else 1 << 30


@pytest.mark.subprocess
@pytest.mark.parametrize("lib", ["BLIS", "OpenBLAS"])
def test_rounds_run_the_bound_library_with_the_verify_thread_count(lib):
    path = next((p for n, p in cpu_blas.find() if n == lib), None)
    if path is None:
        pytest.skip(f"{lib} is not installed here")
    out, _ = run(THREADS, MLX_MTP_CPU_BLAS=path)
    n = len(os.sched_getaffinity(0))
    if lib == "BLIS":  # split over columns by default: no thread count (-1), BLIS_JC_NT ways
        default = cpu_blas.blis_threads(n)
        assert (out["name"], out["before"], out["inside"]) == (lib, -1, 1)
        assert out["jc_before"] == out["jc_after"] == default  # the split is put back
    else:  # OpenBLAS: all cores by default (as many as its build allows), and rounds keep
        # them (one thread is slower)
        n = min(n, openblas_max_threads(path))
        assert (out["name"], out["before"], out["inside"], out["after"]) == (lib, n, n, n)
        out, _ = run(THREADS, MLX_MTP_CPU_BLAS=path, MLX_MTP_VERIFY_THREADS="1")
        assert (out["name"], out["before"], out["inside"], out["after"]) == (lib, n, 1, n)
    out, _ = run(THREADS, MLX_MTP_CPU_BLAS=path, MLX_MTP_VERIFY_THREADS="0")
    assert out["before"] == out["inside"] == out["after"]
    out, _ = run(THREADS, MLX_MTP_CPU_BLAS="off")
    assert (out["name"], out["inside"]) == ("bundled", None)  # nothing to set


PREFILL = """
import json, mlx_mtp
import mlx.core as mx
from mlx_mtp.cpu import blas as cpu_blas
lib = __import__("ctypes").CDLL(cpu_blas.STATE.path) if cpu_blas.STATE.path else None
jc = (lambda: lib.bli_thread_get_jc_nt()) if cpu_blas.STATE.name == "BLIS" else (lambda: None)
mx.random.seed(0)
W = mx.random.normal((1536, 1024)); X = mx.random.normal((96, 1024))
outside = X @ W.T
mx.eval(outside)
before = jc()
with cpu_blas.prefill_threads():
    inside_jc = jc()
    inside = X @ W.T
    mx.eval(inside)
print(json.dumps({"name": cpu_blas.STATE.name, "before": before, "inside": inside_jc,
                  "after": jc(), "same": bytes(memoryview(inside)) == bytes(memoryview(outside))}))
"""


@pytest.mark.subprocess
def test_a_prefill_runs_blis_on_every_core_and_its_products_keep_their_bits():
    """BLIS with the count chosen here: every usable core inside, split over columns, the split
    put back after, and a many-row product bitwise as on the default count. A count the user
    set, or another library, is left alone."""
    blis = next((p for n, p in cpu_blas.find() if n == "BLIS"), None)
    if blis is None:
        pytest.fail("BLIS not installed: .ci/run and the README install libblis4-pthread")
    n = len(os.sched_getaffinity(0))
    out, _ = run(PREFILL, MLX_MTP_CPU_BLAS=blis)
    assert out["name"] == "BLIS" and out["same"]
    assert (out["before"], out["inside"], out["after"]) == (
        cpu_blas.blis_threads(n), n, cpu_blas.blis_threads(n))
    out, _ = run(PREFILL, MLX_MTP_CPU_BLAS=blis, BLIS_JC_NT="1")
    assert (out["before"], out["inside"], out["after"], out["same"]) == (1, 1, 1, True)
    openblas = next((p for n, p in cpu_blas.find() if n == "OpenBLAS"), None)
    if openblas is not None:
        out, _ = run(PREFILL, MLX_MTP_CPU_BLAS=openblas)
        assert (out["name"], out["inside"], out["same"]) == ("OpenBLAS", None, True)


def test_the_rounds_thread_count_defaults_per_library(monkeypatch):
    for name, want in [("BLIS", 1), ("OpenBLAS", 0), ("custom", 1), ("bundled", 1)]:
        monkeypatch.setattr(cpu_blas.STATE, "name", name)
        assert cpu_blas.round_thread_count({}) == want
        assert cpu_blas.round_thread_count({"MLX_MTP_VERIFY_THREADS": "3"}) == 3
        assert cpu_blas.round_thread_count({"MLX_MTP_VERIFY_THREADS": "1"}) == 1
        assert cpu_blas.verify_thread_count({}) == 1  # the row kernel's: 1 whatever the library
    with pytest.raises(mlx_mtp.MTPError, match="MLX_MTP_VERIFY_THREADS must be a whole number"):
        cpu_blas.round_thread_count({"MLX_MTP_VERIFY_THREADS": "two"})


def test_a_bad_verify_thread_count_is_one_line_naming_the_variable():
    assert cpu_blas.verify_thread_count({}) == 1
    assert cpu_blas.verify_thread_count({"MLX_MTP_VERIFY_THREADS": "3"}) == 3
    with pytest.raises(mlx_mtp.MTPError) as e:
        cpu_blas.verify_thread_count({"MLX_MTP_VERIFY_THREADS": "two"})
    assert str(e.value) == ("environment variable MLX_MTP_VERIFY_THREADS must be a whole number "
                            "of threads (0 = leave the BLAS default), got 'two'")
