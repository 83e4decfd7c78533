"""Fresh interpreters, started as a user starts them: the CLIs as ``python -m module`` and scripts
that import ``support``. ``CHILD_PYTHONPATH`` gives a child what pytest's ``pythonpath`` setting
(pyproject.toml) gives the tests: the repository and ``tests/``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHILD_PYTHONPATH = os.pathsep.join([str(ROOT), str(ROOT / "tests")])


def run_module(module, *args, check=True):
    """``python -m module args`` in a fresh interpreter (how a user runs the CLIs)."""
    env = dict(os.environ, PYTHONPATH=CHILD_PYTHONPATH)
    r = subprocess.run([sys.executable, "-m", module, *map(str, args)],
                       capture_output=True, text=True, env=env, timeout=300)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def cli(*args, check=True):
    """``python -m mlx_mtp.generate args`` in a fresh interpreter."""
    return run_module("mlx_mtp.generate", *args, check=check)
