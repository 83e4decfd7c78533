"""benchmarks.bench_split writes a record like every other benchmark: setup, results, idle check,
'What it says'."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_split_record_states_its_setup_and_results(tmp_path):
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench_split", "--splits", "pipeline",
                        "--pairs", "1", "--max-tokens", "4", "--allow-busy", "--out", str(tmp_path),
                        "--summary", "what it says"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr[-2000:]
    (record,) = tmp_path.glob("split-*.json")
    result = json.loads(record.read_text())
    assert result["topic"] == "split" and result["git_commit"] and result["cpu_blas"]
    assert result["splits"]["pipeline"]["identical"] is True
    assert result["summary"] == "what it says"
    md = record.with_suffix(".md").read_text()
    for section in ("## Setup", "## Results", "## Idle check", "## What it says"):
        assert section in md
    assert "| pipeline | mtp |" in md and "| pipeline | plain |" in md
    shares = result["splits"]["pipeline"]["distinct_4gram_share"]  # each prompt's plain output
    assert set(shares) == {"code", "class"} and all(0 < v <= 1 for v in shares.values())
    assert f"code {shares['code']:.2f}" in md
