"""Run ``python -m mlx_mtp.server`` as a child process on a free local port and wait until it
serves (for tests and ``benchmarks.bench_server``); with ``split``, under ``mlx.launch`` on
``ranks`` local processes."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Dict, Optional

from benchmarks.harness import launch

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *args: str, startup_timeout: float = 300.0, env: Optional[dict] = None,
                 split: Optional[str] = None, ranks: int = 2):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["--port", str(self.port), *map(str, args)]
        self.split = split
        self._log = tempfile.TemporaryFile()
        env = dict(os.environ if env is None else env)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        command = [sys.executable, "-m", "mlx_mtp.server", *self.args]
        if split is None:
            self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                         env=env)
        else:  # self.proc is mlx.launch; rank 0 serves once every rank follows
            env = {k: v for k, v in env.items() if k not in ("MLX_RANK", "MLX_HOSTFILE")}
            self.proc = launch.start([*command, "--split", split], ranks=ranks, env=env,
                                     log=self._log)
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                out = self.output()
                self.stop()
                raise RuntimeError(f"mlx_mtp.server exited with {self.proc.returncode}: {out}")
            try:
                if self.get("/health")["status"] == "ok" and (
                        split is None or len(self.rank_pids()) == ranks):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mlx_mtp.server did not come up in {startup_timeout:.0f} s")
            time.sleep(0.3)

    def output(self) -> str:
        """Everything it printed so far (after ``stop``: everything)."""
        if self._log.closed:
            return self._final_output
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def rank_pids(self) -> Dict[int, int]:
        """``{rank: pid}`` of a split server's ranks, from their startup lines."""
        text = self.output()
        pids = {0: int(m) for m in re.findall(r"\[rank 0 of \d+, \w+ split, pid (\d+)\]", text)}
        pids.update((int(r), int(p)) for r, p in re.findall(
            r"rank (\d+) of \d+ \(\w+ split, pid (\d+)\) follows rank 0", text))
        return pids

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return json.loads(r.read())

    def stop(self) -> Optional[int]:
        """Stop the server as a user would (SIGTERM; a split's rank 0, which tells the others);
        its exit code, or None where it had to be killed."""
        rc = self.proc.poll()
        if rc is None:
            pids = self.rank_pids() if self.split else {}
            if self.split is None:
                self.proc.terminate()
            elif 0 in pids:
                _signal(pids[0], signal.SIGTERM)
            try:
                rc = self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                if self.split is None:
                    self.proc.kill()
                else:  # the launcher's ranks would outlive it: its whole group
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if not self._log.closed:
            self._final_output = self.output()
            self._log.close()
        return rc

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
