"""scripts/blas_spread.py writes its control: one process that stays up and does the CLI's default
plain run once per round, beside the fresh processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_record_has_the_one_process_control(tmp_path):
    r = subprocess.run([sys.executable, "scripts/blas_spread.py", "--processes", "2", "--arms",
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
