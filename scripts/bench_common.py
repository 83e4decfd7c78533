"""What every benchmark record shares, for the scripts that write one (bench_*.py, blas_spread.py,
probe_cost.py): the record flags (``--out``, ``--summary``, ``--allow-busy``, ``--idle-window``),
the idle check around the run (``scripts/idle_check.py``), the setup every record states
(shared/design/benchmarks.md), the '## Setup' and '## What it says' lines of its markdown, and
writing it: ``<topic>-<host>-<date>.json`` and ``.md`` (``-contended`` in the name when the machine
was not idle) with the record's pictures (``scripts/record_plots.py``).

MLX is imported only inside the functions that need it, so a launcher that runs no model itself
(``bench_split.py``) can use the flags and the idle check without it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import idle_check  # noqa: E402  (scripts/)
import record_plots  # noqa: E402  (matplotlib only inside, lazily)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmark_results"
SUMMARY_TODO = "(to be written by the person who ran it)"


# ------------------------------------------------------------------------------ flags and the run


def add_record_args(p: argparse.ArgumentParser, summary: bool = True, units: bool = False) -> None:
    """The flags of a script that writes a record: where, its summary, and the idle check's
    (``--retakes`` for a script that measures in units: ``idle_check.Watch.unit``)."""
    p.add_argument("--out", type=Path, default=RESULTS)
    if summary:
        p.add_argument("--summary", default=None, help="the record's 'What it says' paragraph")
    p.add_argument("--allow-busy", action="store_true", help=idle_check.ALLOW_BUSY_HELP)
    p.add_argument("--idle-window", type=float, default=2.0, help=idle_check.WINDOW_HELP)
    if units:
        p.add_argument("--retakes", type=int, default=24, help=idle_check.RETAKES_HELP)
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                   help=idle_check.WAIT_HELP)


def watch(args) -> idle_check.Watch:
    """Start the idle check before the run (refused on a busy machine, at once or after
    ``--wait-idle`` seconds, unless ``--allow-busy``)."""
    retakes = getattr(args, "retakes", 0)
    if retakes < 0 or args.wait_idle < 0:
        sys.exit(f"error: --retakes and --wait-idle must be >= 0, got {retakes} and "
                 f"{args.wait_idle:g}")
    return idle_check.Watch(args.idle_window, args.allow_busy, retakes=retakes,
                            wait_s=args.wait_idle)


def finish(args, result: dict, watch: idle_check.Watch, render_fn,
           kind: Optional[str] = None) -> dict:
    """After the run: finish the idle check (refuse, or label the record), add ``--summary`` and
    write the record (``write_record``)."""
    result = idle_check.attach(result, watch, args.allow_busy)
    if args.summary:
        result["summary"] = args.summary
    write_record(args.out, result, render_fn, kind)
    return result


# ------------------------------------------------------------------------------ the setup


def record_setup(topic: str) -> dict:
    """The setup every record states (shared/design/benchmarks.md): topic, date, host, versions,
    BLAS, commit, the exact command and the environment variables that steer MLX and the BLAS."""
    from mlx_mtp.cpu import blas as cpu_blas  # first: binds the system BLAS before mlx.core loads

    return {
        "topic": topic, "date": _dt.date.today().isoformat(), "host": host_facts(),
        "versions": versions(), "cpu_blas": cpu_blas.STATE.describe(),
        "git_commit": git_commit(), "command": " ".join(shlex.quote(a) for a in sys.argv),
        "env": {k: v for k, v in os.environ.items()
                if k.startswith(("MLX", "BLIS", "OPENBLAS", "OMP"))},
    }


def host_facts() -> dict:
    import mlx_mtp  # noqa: F401  (first: binds the system BLAS before mlx.core loads)
    import mlx.core as mx

    mem = None
    try:
        mem = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    return {"name": socket.gethostname(), "cpu": idle_check.cpu_model(),
            "cores": len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "memory_gib": mem, "os": platform.platform(), "device": str(mx.default_device())}


def versions() -> dict:
    from importlib.metadata import version

    import mlx_mtp

    return {p: version(p) for p in ("mlx", "mlx-lm")} | {"mlx_mtp": mlx_mtp.__version__,
                                                         "python": platform.python_version()}


def git_commit() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True,
                               text=True).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# ------------------------------------------------------------------------------ the markdown


def setup_lines(r: dict, *, memory: bool = False, device: bool = True, blas: bool = True,
                env: bool = True) -> List[str]:
    """The record's title and the start of its '## Setup': host, versions, BLAS, commit, command,
    environment. ``memory``: the host line gives the memory (and, where it is unknown, only the
    CPU and OS); ``device``, ``blas``, ``env``: whether those are stated (a record of several
    processes with their own BLAS states it per arm instead)."""
    h = r["host"]
    if memory and not h["memory_gib"]:
        host = f"- Host: {h['cpu']}, {h['os']}"
    else:
        host = (f"- Host: {h['cpu']}, {h['cores']} cores"
                + (f", {h['memory_gib']:.0f} GiB" if memory else "") + f", {h['os']}"
                + (f", device {h['device']}" if device else ""))
    lines = [f"# {r['topic']} on {h['name']}, {r['date']}", "", "## Setup", host,
             "- Versions: " + ", ".join(f"{k} {v}" for k, v in r["versions"].items())]
    if blas:
        lines.append(f"- BLAS: {r['cpu_blas']}")
    lines += [f"- Commit: {r['git_commit']}", f"- Command: `{r['command']}`"]
    if env:
        lines.append(f"- Environment: {r['env'] or 'none set'}")
    return lines


def what_it_says(r: dict) -> List[str]:
    """The record's last section: the summary of whoever ran it, or a placeholder."""
    summary = r.get("summary")
    return ["", "## What it says", "", SUMMARY_TODO if summary is None else summary, ""]


def render_markdown(result: dict, render_fn) -> str:
    """The record's markdown: ``render_fn``'s, with the idle check the run saw."""
    return idle_check.annotate(render_fn(result), result.get("idle_check"))


# ------------------------------------------------------------------------------ writing


def write_record(out: Path, result: dict, render_fn, kind: Optional[str] = "mtp") -> None:
    """``<topic>-<host>-<date>.json``, the ``.md`` that ``render_fn`` makes of it with the idle
    check in it (``-contended`` in the name when the machine was not idle), and the record's
    pictures (``record_plots``, ``kind`` "mtp", "drafter" or "server"; None: a record without
    pictures) linked from the ``.md``."""
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{result['topic']}-{result['host']['name']}-{result['date']}"
    stem += "-contended" if idle_check.is_contended(result) else ""
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    try:
        pictures = record_plots.draw(result, out / stem, kind) if kind else []
    except ImportError as e:  # matplotlib is an optional extra: the record stands without it
        print(e)
        pictures = []
    md = record_plots.embed(render_markdown(result, render_fn), pictures, out)
    (out / f"{stem}.md").write_text(md)
    print(f"wrote {out / stem}.md and .json"
          + (f" and {len(pictures)} pictures" if pictures else ""))


def rerender_record(path: Path, render_fn, kind: str = "mtp", summary: str = None) -> dict:
    """``--render RECORD.json``: draw the record's pictures again from its JSON (no run) and link
    them from its ``.md`` (which is otherwise kept; written from the JSON if absent). With
    ``summary``: also store it in the JSON and rewrite the whole ``.md`` from the JSON."""
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: --render {path}: expected a record's .json ({e})")
    problem = record_plots.check(result, kind)
    if problem:
        raise SystemExit(f"error: --render {path}: {problem}")
    if not record_plots.available():
        raise SystemExit(f"error: --render needs matplotlib: {record_plots.INSTALL}")
    path = Path(path)
    md_path = path.with_suffix(".md")
    pictures = record_plots.draw(result, path.with_suffix(""), kind)
    if summary is not None:
        result["summary"] = summary
        path.write_text(json.dumps(result, indent=1))
    md = (md_path.read_text() if summary is None and md_path.exists()
          else render_markdown(result, render_fn))
    md_path.write_text(record_plots.embed(md, pictures, md_path.parent))
    print(f"rewrote {md_path} and {len(pictures)} pictures")
    return result
