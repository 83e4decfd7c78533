"""The README's Python example, run as a reader runs it: copied into a script, in a fresh
interpreter, from a directory outside the repository, with the Hugging Face Hub offline."""

import json
import os
import subprocess
import sys

import pytest
from support.doc_blocks import the_block
from support.processes import CHILD_PYTHONPATH

from benchmarks.common import distinct_ngram_share

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

# Runs the block as written, then reports what it left in its globals.
RUNNER = """import json, runpy, sys
ns = runpy.run_path(sys.argv[1])
ids = ns["tokenizer"].encode(ns["text"], add_special_tokens=False)
print("RESULT " + json.dumps({"text": ns["text"], "ids": ids,
                             "tokens_per_round": ns["r"].stats.tokens_per_round}))
"""


def test_the_readme_python_example_runs_offline_from_anywhere_and_writes_text(tmp_path):
    block = the_block("README.md", "python", "mlx_mtp.load(")
    (tmp_path / "example.py").write_text(block)
    (tmp_path / "runner.py").write_text(RUNNER)
    env = dict(os.environ, PYTHONPATH=CHILD_PYTHONPATH, HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "runner.py", "example.py"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    printed, result = r.stdout.rsplit("RESULT ", 1)
    out = json.loads(result)
    assert out["text"] and out["text"] in printed  # verbose=True printed it
    assert len(out["ids"]) >= 32, out["text"]
    share = distinct_ngram_share(out["ids"], 4)
    assert share >= 0.6, (share, out["text"])
    assert "MTP: " in printed  # generate's verbose line on MTP
    assert out["tokens_per_round"] >= 1.0
