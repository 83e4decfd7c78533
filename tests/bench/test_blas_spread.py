"""benchmarks.blas_spread writes its controls: one process that stays up and does the CLI's default
plain run once per round, beside the fresh processes, and a numpy-only host probe per round."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_record_has_the_one_process_control(tmp_path):
    r = subprocess.run([sys.executable, "-m", "benchmarks.blas_spread", "--processes", "2", "--arms",
                        "default", "--max-tokens", "4", "--allow-busy", "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr[-2000:]
    (record,) = tmp_path.glob("blas-spread-*.json")
    o = json.loads(record.read_text())["one_process"]
    assert len(o["plain_tps"]) == 2 and o["same_tokens"] is True
    assert o["spread"] == max(o["plain_tps"]) / min(o["plain_tps"])
    md = record.with_suffix(".md").read_text()
    assert "## Control: one process, one plain run per round" in md
    assert r.stdout.count("one process: plain") == 2
    # the host probe: one numpy-only process per round, its spread and correlation in the record
    data = json.loads(record.read_text())
    host = data["host_probe_runs"]
    assert len(host) == 2 and all(h["cache_gbs"] > 0 and h["memory_gbs"] > 0 for h in host)
    cache = [h["cache_gbs"] for h in host]
    assert data["host_probe"]["cache_gbs"]["spread"] == max(cache) / min(cache)
    assert set(data["host_probe"]["plain_vs_cache_r"]) == {"default"}
    assert "## The host probe: what the machine gave, round by round" in md
    assert r.stdout.count("host probe: cache") == 2


def test_correlation_is_pearsons_r():
    from benchmarks import blas_spread
    assert abs(blas_spread.correlation([1, 2, 3], [2, 4, 6]) - 1.0) < 1e-12
    assert abs(blas_spread.correlation([1, 2, 3], [3, 2, 1]) + 1.0) < 1e-12
    assert blas_spread.correlation([1, 1, 1], [1, 2, 3]) == 0.0
