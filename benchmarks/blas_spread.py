"""How much one process's speed depends on luck: N fresh processes per BLAS choice.

Each round starts, for every BLAS arm (in alternating order), fresh processes of the CLI's default
run on the demo pair, ``python -m mlx_mtp.generate --no-mtp --json`` and the same with MTP, and
one that times a 512x512 f32 matmul (median of 50 after a warm-up). Per arm the record gives the
plain and MTP tok/s of every process, their max/min (the spread), the worst process, and the matmul
medians; the machine's idle check (``benchmarks.idle``) runs around the whole thing and judges
each round on its own (a round that was not quiet is run again).

    python -m benchmarks.blas_spread [--processes 5] [--arms default,blis,openblas,...]

Each round also starts the host probe first: a fresh process that imports numpy only (no MLX, no
mlx_mtp) and times matrix-vector products over a cache-sized and a memory-sized matrix. It says
what the machine itself gave at that moment: if it spreads as the CLI's runs do, the spread is the
host's (a VM shares its caches and memory with other guests), not a process's luck.

Arms: ``default`` (what mlx_mtp binds with nothing set: BLIS, one thread fewer than the cores,
over columns), ``blis`` (BLIS's own 2-D split over all cores),
``blis-jc`` (all cores, over columns only: BLIS_JC_NT), ``blis-1`` (one thread), ``openblas`` (all
cores), ``bundled`` (MLX's reference BLAS). Writes ``benchmark_results/blas-spread-<host>-
<date>.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks import common
from mlx_mtp.cpu import blas as cpu_blas

ROOT = Path(__file__).resolve().parents[1]
WITHIN = 1.15  # the bar: fresh processes of one BLAS choice within 15% of each other
BLAS_VARS = ("MLX_MTP_CPU_BLAS", "BLIS_NUM_THREADS", "BLIS_JC_NT", "BLIS_PC_NT", "BLIS_IC_NT",
             "BLIS_JR_NT", "BLIS_IR_NT", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")
MATMUL = """
import statistics, time
import mlx_mtp
from mlx_mtp.cpu import blas as cpu_blas
import mlx.core as mx
a = mx.random.normal((512, 512), key=mx.random.key(0)); b = mx.random.normal((512, 512), key=mx.random.key(1))
mx.eval(a, b); mx.eval(a @ b)
ts = []
for _ in range(50):
    t0 = time.perf_counter(); mx.eval(a @ b); ts.append(time.perf_counter() - t0)
print(json.dumps({"matmul_ms": 1e3 * statistics.median(ts), "cpu_blas": cpu_blas.STATE.describe()}))
"""


# The host probe: numpy only, one thread, so nothing of MLX, mlx_mtp or their BLAS choice is in
# it. A 12 MB matrix stays in this machine's last-level cache (the demo pair's 27 MB of weights is
# read mostly from there), a 192 MB one streams from memory. Median GB/s of 9 timings each.
HOST_PROBE = """
import json, os, statistics, time
os.environ["OPENBLAS_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = "1"
import numpy as np
rng = np.random.default_rng(0)
x = rng.random(1000, dtype=np.float32)
out = {}
for name, rows, reps in (("cache_gbs", 3000, 40), ("memory_gbs", 48000, 3)):
    a = rng.random((rows, 1000), dtype=np.float32)
    a @ x
    ts = []
    for _ in range(9):
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ x
        ts.append(time.perf_counter() - t0)
    out[name] = a.nbytes * reps / statistics.median(ts) / 1e9
print(json.dumps(out))
"""
HOST_KEYS = ("cache_gbs", "memory_gbs")


def arms() -> dict:
    """{arm: the environment that selects it}; arms whose library is missing are left out."""
    cores = str(len(os.sched_getaffinity(0)))
    found = {name: path for name, path in reversed(cpu_blas.find())}  # first of each kind wins
    out = {"default": {}}
    if "BLIS" in found:
        blis = found["BLIS"]
        out["blis"] = {"MLX_MTP_CPU_BLAS": blis, "BLIS_NUM_THREADS": cores}
        out["blis-jc"] = {"MLX_MTP_CPU_BLAS": blis, "BLIS_JC_NT": cores}
        out["blis-1"] = {"MLX_MTP_CPU_BLAS": blis, "BLIS_NUM_THREADS": "1"}
    if "OpenBLAS" in found:
        out["openblas"] = {"MLX_MTP_CPU_BLAS": found["OpenBLAS"], "OPENBLAS_NUM_THREADS": cores}
    out["bundled"] = {"MLX_MTP_CPU_BLAS": "off"}
    return out


def process_env(env: dict) -> dict:
    """This process's environment without its BLAS choices, plus the arm's."""
    base = {k: v for k, v in os.environ.items() if k not in BLAS_VARS}
    return {**base, "PYTHONPATH": str(ROOT), **env}


def run_one(cmd, env: dict, timeout: float) -> dict:
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                       env=process_env(env))
    if r.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd[1:])} failed ({r.returncode}): "
                         f"{(r.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# The control: one process that stays up for the whole record and does the CLI's default plain
# run (the same args, its own run function) once per round, alongside the fresh processes. If its
# spread is as wide as theirs, what varies is the machine over time, not a process's luck.
STAYING = """
import json, sys
from mlx_mtp.generate import build_parser, run
args = sys.argv[1:]
for line in sys.stdin:
    r = run(build_parser().parse_args(args))
    print(json.dumps({"plain_tps": r["generation_tps"], "tokens": r["tokens"]}), flush=True)
"""


class StayingProcess:
    """A process kept up across rounds: each ``measure`` asks it for one plain run."""

    def __init__(self, args):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", STAYING, "--json", "--no-mtp", "--max-tokens",
             str(args.max_tokens)], cwd=ROOT, env=process_env({}),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def measure(self) -> dict:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"error: the staying process ended ({self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def measure(args, env: dict) -> dict:
    py = sys.executable
    cli = [py, "-m", "mlx_mtp.generate", "--json", "--max-tokens", str(args.max_tokens)]
    plain = run_one(cli + ["--no-mtp"], env, args.timeout)
    mtp = run_one(cli, env, args.timeout)
    mm = run_one([py, "-c", "import json\n" + MATMUL], env, args.timeout)
    return {"plain_tps": plain["generation_tps"], "mtp_tps": mtp["generation_tps"],
            "matmul_ms": mm["matmul_ms"], "cpu_blas": plain["cpu_blas"],
            "identical": plain["tokens"] == mtp["tokens"]}


def spread(xs: list) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs),
            "spread": max(xs) / min(xs) if min(xs) > 0 else float("inf")}


def correlation(xs: list, ys: list) -> float:
    """Pearson's r (0 where either side does not vary)."""
    if len(set(xs)) < 2 or len(set(ys)) < 2:
        return 0.0
    return statistics.correlation(xs, ys)


def host_summary(host: list, runs: dict) -> dict:
    """The host probe's spread over the record, and how each arm's plain tok/s went with the
    cache probe of its round."""
    out = {k: spread([h[k] for h in host]) for k in HOST_KEYS}
    out["plain_vs_cache_r"] = {arm: correlation([r["plain_tps"] for r in rs],
                                                [h["cache_gbs"] for h in host])
                               for arm, rs in runs.items()}
    out["host_within_15pct"] = all(out[k]["spread"] <= WITHIN for k in HOST_KEYS)
    return out


def summarize(runs: list) -> dict:
    out = {}
    for key in ("plain_tps", "mtp_tps", "matmul_ms"):
        out[key] = spread([r[key] for r in runs])
    out["plain_within_15pct"] = out["plain_tps"]["spread"] <= WITHIN
    out["identical"] = all(r["identical"] for r in runs)
    out["cpu_blas"] = sorted({r["cpu_blas"] for r in runs})
    return out


def one_process(stayed: list) -> dict:
    xs = [r["plain_tps"] for r in stayed]
    s = spread(xs)
    return {"plain_tps": xs, **s, "plain_within_15pct": s["spread"] <= WITHIN,
            "same_tokens": all(r["tokens"] == stayed[0]["tokens"] for r in stayed)}


def render(r: dict) -> str:
    # BLAS and environment are per arm (fresh processes), stated with the results
    lines = common.setup_lines(r, device=False, blas=False, env=False) + [
             f"- {r['processes']} rounds; each round, per arm in alternating order, fresh processes "
             f"of `python -m mlx_mtp.generate --json --max-tokens {r['max_tokens']}` (demo pair, "
             "default prompt, T=0) with `--no-mtp` and without, and a 512x512 f32 matmul "
             "(median of 50 calls); first in each round, the host probe (numpy only, no MLX: "
             "matrix-vector products over a 12 MB and a 192 MB f32 matrix)", "",
             "## Results (per arm: median, min-max over processes; spread = max/min)", "",
             "| arm | BLAS | plain tok/s | plain spread | MTP tok/s | MTP spread | matmul 512 ms "
             "| matmul spread | plain within 15% | MTP = plain tokens |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for arm, s in r["arms"].items():
        p, m, mm = s["plain_tps"], s["mtp_tps"], s["matmul_ms"]
        lines.append(
            f"| {arm} | {'; '.join(s['cpu_blas'])} | {p['median']:.1f} ({p['min']:.1f}-{p['max']:.1f}) "
            f"| {p['spread']:.2f} | {m['median']:.1f} ({m['min']:.1f}-{m['max']:.1f}) | "
            f"{m['spread']:.2f} | {mm['median']:.2f} ({mm['min']:.2f}-{mm['max']:.2f}) | "
            f"{mm['spread']:.2f} | {'yes' if s['plain_within_15pct'] else 'NO'} | "
            f"{'yes' if s['identical'] else 'NO'} |")
    lines += ["", "Environment per arm: " + "; ".join(
        f"{a}: {e or 'nothing set'}" for a, e in r["arm_env"].items())]
    if "one_process" in r:  # records before the control have none
        o = r["one_process"]
        lines += ["", "## Control: one process, one plain run per round", "",
                  "The CLI's default plain run (default BLAS), done once per round by a process "
                  "that stays up for the whole record (after one warm-up run): "
                  f"{o['median']:.1f} tok/s ({o['min']:.1f}-{o['max']:.1f}), spread "
                  f"{o['spread']:.2f}, within 15%: {'yes' if o['plain_within_15pct'] else 'NO'}; "
                  f"the same tokens every run: {'yes' if o['same_tokens'] else 'NO'}. Runs: "
                  + ", ".join(f"{x:.1f}" for x in o["plain_tps"]) + "."]
    if "host_probe" in r:  # records before the host probe have none
        h = r["host_probe"]
        c, m = h["cache_gbs"], h["memory_gbs"]
        lines += ["", "## The host probe: what the machine gave, round by round", "",
                  "A fresh process with numpy only (one thread; no MLX, no mlx_mtp), first in "
                  "every round: matrix-vector products over a 12 MB f32 matrix (held in the "
                  "last-level cache) and a 192 MB one (read from memory).", "",
                  "| probe | median GB/s | min-max | spread | within 15% |", "|---|---|---|---|---|",
                  f"| cache (12 MB) | {c['median']:.1f} | {c['min']:.1f}-{c['max']:.1f} | "
                  f"{c['spread']:.2f} | {'yes' if c['spread'] <= WITHIN else 'NO'} |",
                  f"| memory (192 MB) | {m['median']:.1f} | {m['min']:.1f}-{m['max']:.1f} | "
                  f"{m['spread']:.2f} | {'yes' if m['spread'] <= WITHIN else 'NO'} |", "",
                  "Per round: " + "; ".join(f"{x['cache_gbs']:.1f} / {x['memory_gbs']:.1f}"
                                            for x in r["host_probe_runs"]) + " GB/s (cache / memory).",
                  "", "Pearson's r of each arm's plain tok/s with its round's cache probe: "
                  + ", ".join(f"{a} {v:+.2f}" for a, v in h["plain_vs_cache_r"].items()) + "."]
    lines += common.what_it_says(r)
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--processes", type=int, default=5, help="fresh processes per arm (default 5)")
    p.add_argument("--arms", default=None, help="comma-separated (default: every arm available)")
    p.add_argument("--max-tokens", type=int, default=256, help="the CLI's default is 256")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per process")
    p.add_argument("--topic", default="blas-spread")
    common.add_record_args(p, units=True)
    args = p.parse_args(argv)
    available = arms()
    names = args.arms.split(",") if args.arms else list(available)
    unknown = [a for a in names if a not in available]
    if unknown:
        p.error(f"--arms: {', '.join(unknown)} not available here (choose from "
                f"{', '.join(available)})")
    if args.processes < 2 or args.max_tokens < 2:
        p.error("--processes >= 2 and --max-tokens >= 2 are required")
    watch = common.watch(args)
    runs = {a: [] for a in names}
    staying, stayed = StayingProcess(args), []
    staying.measure()  # its first run pays the process's one-time costs, as a fresh one does
    host = []

    def one_round(i):
        probe = run_one([sys.executable, "-c", HOST_PROBE], {}, args.timeout)
        print(f"round {i} host probe: cache {probe['cache_gbs']:.1f} GB/s, memory "
              f"{probe['memory_gbs']:.1f} GB/s", flush=True)
        got = {}
        for arm in (names if i % 2 == 0 else list(reversed(names))):
            r = got[arm] = measure(args, available[arm])
            print(f"round {i} {arm}: plain {r['plain_tps']:.1f} tok/s, MTP {r['mtp_tps']:.1f}, "
                  f"matmul {r['matmul_ms']:.2f} ms", flush=True)
        kept = staying.measure()
        print(f"round {i} one process: plain {kept['plain_tps']:.1f} tok/s", flush=True)
        return probe, got, kept

    for i in range(args.processes):  # each round one unit of the idle check (retaken if not quiet)
        probe, got, kept = watch.unit(f"round {i}", lambda: one_round(i))
        host.append(probe)
        for arm in names:
            runs[arm].append(got[arm])
        stayed.append(kept)
    staying.close()
    result = {**common.record_setup(args.topic), "processes": args.processes,
              "max_tokens": args.max_tokens, "arm_env": {a: available[a] for a in names},
              "arms": {a: summarize(runs[a]) for a in names}, "runs": runs,
              "one_process": one_process(stayed), "host_probe_runs": host,
              "host_probe": host_summary(host, runs)}
    return common.finish(args, result, watch, render)


if __name__ == "__main__":
    main()
