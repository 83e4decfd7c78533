"""What the exactness probe costs, in wall time and in plain decode steps of the same target.

    python -m benchmarks.probe_cost [--model PATH] [--synthetic] [--repeats 5] [--json] [--record]

Targets: ``--model`` (default: the embedded demo pair) loaded through ``mlx_mtp.load_model``;
with ``--synthetic`` also a tiny raw-HF checkpoint (H=64, 4 layers, V=320, the tests' own) and a
larger random Qwen3.5 (H=1024, 8 layers, V=32768) built in memory
(``benchmarks.random_checkpoints``), to show how the cost scales.
For each session block size B the probe runs widths 2..B cold (a fresh adapter: nothing memoized)
and then from the memo. Medians of ``--repeats`` runs. Prints a table (or JSON); ``--record``
also writes ``benchmark_results/probe-cost-<host>-<date>.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx_mtp  # noqa: F401  (first: binds the system BLAS before mlx.core loads)
import mlx.core as mx

from benchmarks import common
from benchmarks import random_checkpoints as tc
from mlx_mtp.demo import demo_path
from mlx_mtp.exactness import block_vs_chain as exactness
from mlx_mtp.exactness.gate import session_widths
from mlx_mtp.models.qwen3_5.target import Qwen3_5Target
from mlx_mtp.models.loader import load_model


def decode_step_s(mlx_model, repeats: int) -> float:
    """Median wall time of one plain decode step (mlx-lm's model, 9 tokens of context)."""
    times = []
    for _ in range(repeats):
        cache = mlx_model.make_cache()
        mx.eval(mlx_model(mx.array([list(range(1, 9))]), cache=cache))
        t0 = time.perf_counter()
        mx.eval(mlx_model(mx.array([[9]]), cache=cache))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def probe_s(make_target, widths, repeats: int):
    cold, warm = [], []
    for _ in range(repeats):
        exactness.clear_memo()
        target = make_target()
        t0 = time.perf_counter()
        results = exactness.probe_exactness(target, widths)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        exactness.probe_exactness(target, widths)
        warm.append(time.perf_counter() - t0)
    return statistics.median(cold), statistics.median(warm), exactness.aggregate_verdict(results)


def measure(name, mlx_model, make_target, repeats):
    mx.eval(mlx_model.parameters())
    decode_step_s(mlx_model, 2)  # warm-up
    step = decode_step_s(mlx_model, repeats)
    rows = []
    for block_size in (2, 3, 4, 6):
        cold, warm, verdict = probe_s(make_target, session_widths(block_size), repeats)
        rows.append({"target": name, "block_size": block_size, "verdict": verdict,
                     "probe_cold_ms": 1e3 * cold, "probe_memo_ms": 1e3 * warm,
                     "decode_step_ms": 1e3 * step, "cold_in_decode_steps": cold / step})
    return rows


def synthetic_rows(repeats: int):
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = tc.write_raw_hf(Path(tmp) / "tiny", seed=0)
        model = load_model(path, require_head=False)
        rows += measure("tiny checkpoint H=64 L=4 V=320", model.mlx_model,
                        lambda: Qwen3_5Target(model.mlx_model), repeats)
    mx.random.seed(0)
    larger = tc.build_target(tc.qwen3_5_config(hidden=1024, layers=8, vocab=32768))
    larger.eval()
    rows += measure("random H=1024 L=8 V=32768", larger, lambda: Qwen3_5Target(larger), repeats)
    return rows


def record(args, rows) -> dict:
    return {**common.record_setup("probe-cost"), "repeats": args.repeats, "rows": rows,
            "summary": args.summary or common.SUMMARY_TODO}


def render(r: dict) -> str:
    lines = common.setup_lines(r) + [
             f"- Medians of {r['repeats']} runs; cold = fresh adapter (nothing memoized), "
             "probing widths 2..B as a session of block size B does", "",
             "## Results", "",
             "| target | block size | verdict | probe ms (cold) | probe ms (memo) "
             "| decode step ms | cold probe in decode steps |", "|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        lines.append(f"| {x['target']} | {x['block_size']} | {x['verdict']} | "
                     f"{x['probe_cold_ms']:.1f} | {x['probe_memo_ms']:.3f} | "
                     f"{x['decode_step_ms']:.2f} | {x['cold_in_decode_steps']:.1f} |")
    lines += common.what_it_says(r)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    p.add_argument("--model", help="target to probe (default: the embedded demo pair)")
    p.add_argument("--synthetic", action="store_true",
                   help="also the tiny test checkpoint and a random H=1024 target")
    p.add_argument("--record", action="store_true", help="write a benchmark_results/ record")
    common.add_record_args(p)
    args = p.parse_args(argv)
    watch = common.watch(args) if args.record else None
    path = args.model or demo_path()
    model = load_model(path, require_head=False)
    rows = measure(f"{'demo pair' if args.model is None else path}", model.mlx_model,
                   lambda: type(model.target)(model.mlx_model), args.repeats)
    if args.synthetic:
        rows += synthetic_rows(args.repeats)
    if args.record:
        common.finish(args, record(args, rows), watch, render)
    if args.json:
        print(json.dumps({"mlx_version": mx.__version__, "device": str(mx.default_device()),
                          "rows": rows}))
        return 0
    from tabulate import tabulate

    print(f"MLX {mx.__version__} on {mx.default_device()}, medians of {args.repeats} runs")
    print(tabulate([(r["target"], r["block_size"], r["verdict"], f"{r['probe_cold_ms']:.1f}",
                     f"{r['probe_memo_ms']:.3f}", f"{r['decode_step_ms']:.2f}",
                     f"{r['cold_in_decode_steps']:.1f}") for r in rows],
                   headers=["target", "block size", "verdict", "probe ms (cold)",
                            "probe ms (memo)", "decode step ms", "probe / decode step"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
