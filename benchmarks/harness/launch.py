"""Start ``mlx.launch`` from a program (tests, benchmarks) rather than a terminal.

mlx.launch (MLX 0.32.4) polls its stdin with ``select`` to forward typed input to the ranks. On
``/dev/null`` or a closed stdin (a background job, CI, ``subprocess.run(capture_output=True)``,
``communicate()``) that poll returns at once, forever: the launcher spins a whole core beside the
ranks. ``start`` gives it an open pipe that nobody writes, and sends its output to files (not
pipes a caller must drain).
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path
from typing import IO, Dict, Optional, Sequence, Union


def free_port_pair() -> int:
    """A port p with p and p + 1 free (the ring backend listens on one port per local rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p >= 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no two adjacent free ports")


def start(command: Sequence[str], *, ranks: int = 2, hosts: Optional[str] = None,
          starting_port: Optional[int] = None, env: Optional[Dict[str, str]] = None,
          log: Union[str, Path, IO[bytes], None] = None) -> subprocess.Popen:
    """``mlx.launch --backend ring`` running ``command`` (an interpreter first: mlx.launch runs
    it as is) on ``ranks`` local processes, or on ``hosts`` (comma-separated IPs). stdout and
    stderr go to ``log`` (a path or an open binary file; else inherited). Wait with ``wait()``,
    never ``communicate()`` (which closes stdin). The launcher leads its own process group, with
    its local ranks: ``os.killpg(proc.pid, signal.SIGKILL)`` ends them all."""
    where = ["--hosts", hosts] if hosts else ["-n", str(ranks)]
    port = starting_port if starting_port is not None else free_port_pair()
    cmd = ["mlx.launch", "--backend", "ring", *where, "--starting-port", str(port), "--",
           *map(str, command)]
    out = open(log, "wb") if isinstance(log, (str, Path)) else log
    try:
        return subprocess.Popen(cmd, env=dict(os.environ if env is None else env),
                                stdin=subprocess.PIPE, stdout=out,
                                stderr=None if out is None else subprocess.STDOUT,
                                start_new_session=True)
    finally:
        if out is not log:
            out.close()  # the child holds its own copy


class LocalRanks:
    """``ranks`` local processes of ``command`` joined by the ring backend, started the way
    mlx.launch starts them (``MLX_RANK``, a ``MLX_HOSTFILE`` of ``127.0.0.1`` ports) but without
    the launcher, whose threads keep polling the ranks' pipes (about a quarter of a core here):
    for benchmarks, where nothing but the ranks may use the CPU. Output is inherited."""

    def __init__(self, command: Sequence[str], *, ranks: int = 2,
                 starting_port: Optional[int] = None, env: Optional[Dict[str, str]] = None):
        import json
        import tempfile

        port = starting_port if starting_port is not None else free_port_pair()
        hosts = [[f"127.0.0.1:{port + r}"] for r in range(ranks)]
        fd, self.hostfile = tempfile.mkstemp(prefix="mlx_mtp-hosts-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(hosts, f)
        base = dict(os.environ if env is None else env, MLX_HOSTFILE=self.hostfile)
        self.procs = [subprocess.Popen(list(map(str, command)), stdin=subprocess.DEVNULL,
                                       env={**base, "MLX_RANK": str(r)})
                      for r in range(ranks)]

    def wait(self, timeout: Optional[float] = None) -> int:
        """The first non-zero exit code of the ranks (0 when all succeed); on a timeout or an
        error every rank still running is killed."""
        try:
            codes = [p.wait(timeout=timeout) for p in self.procs]
        finally:
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            os.unlink(self.hostfile)
        return next((c for c in codes if c), 0)
