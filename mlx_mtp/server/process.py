"""Run ``python -m mlx_mtp.server`` as a child process on a free local port and wait until it
serves (for tests and ``scripts/bench_server.py``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *args: str, startup_timeout: float = 300.0, env: Optional[dict] = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["--port", str(self.port), *map(str, args)]
        self._log = tempfile.TemporaryFile()
        env = dict(os.environ if env is None else env)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen([sys.executable, "-m", "mlx_mtp.server", *self.args],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                out = self.output()
                self._log.close()
                raise RuntimeError(f"mlx_mtp.server exited with {self.proc.returncode}: {out}")
            try:
                if self.get("/health")["status"] == "ok":
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mlx_mtp.server did not come up in {startup_timeout:.0f} s")
            time.sleep(0.3)

    def output(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._log.closed:
            self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
