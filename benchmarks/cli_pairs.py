"""The CLI's default run against ``--no-mtp``, over alternating pairs of fresh processes.

Each pair starts two fresh processes, ``python -m mlx_mtp.generate --json`` (the CLI's default:
the embedded demo pair, its default prompt, ``--block-size auto``, 256 tokens, T=0) and the same
with ``--no-mtp`` (mlx-lm's own plain decode), MTP first in even pairs and plain first in odd ones,
and takes the ratio of their ``generation_tps``. What a user who types the command sees, process
luck included (``benchmarks.blas_spread`` measures that luck on its own). ``--cli-args`` adds flags
to both commands (e.g. ``"--max-tokens 128"``). The idle check (``benchmarks.idle``) runs around
the whole thing and judges each pair on its own. Each run carries the share of distinct 4-grams
of its output (``distinct_4gram_share``), the record the median over the plain runs.

    python -m benchmarks.cli_pairs [--pairs 5] [--cli-args="--max-tokens 128"] [--topic cli-default]

Writes ``benchmark_results/<topic>-<host>-<date>.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import common

ROOT = Path(__file__).resolve().parents[1]
BAR = 1.7  # the CLI's default run should be >= 1.7x --no-mtp (median over alternating pairs)
ARMS = ("mtp", "plain")
# What each arm's generation_tps covers (mlx_mtp.decoding.plain, mlx_mtp.decoding.rounds): stated in the record.
COVERS = ("Both arms' `generation_tps` is generated tokens (the first one, which the prompt's "
          "forward yields, included) over the seconds from that first token to the last, as "
          "mlx-lm's own `generation_tps`: MTP's every round (drafts, verify, rollback, accept hook, "
          "the chooser, the head's one-time graph traces) against plain decode's steps; the "
          "consumer's detokenizing is inside both. Outside both: loading, the prompt's forward "
          "(`prompt_tps`) and, for MTP, the exactness probe before it. The process wall column "
          "is everything a user waits for, Python's start and the probe included.")


def cli_command(cli_args: list, arm: str) -> list:
    cmd = [sys.executable, "-m", "mlx_mtp.generate", "--json", *cli_args]
    return cmd + ["--no-mtp"] if arm == "plain" else cmd


def run_process(cmd: list, timeout: float) -> dict:
    """One fresh process of the CLI: its JSON result plus its wall seconds."""
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd[1:])} failed ({r.returncode}): "
                         f"{(r.stderr.strip().splitlines() or ['no output'])[-1]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    keep = ("generation_tps", "prompt_tps", "generation_tokens", "prompt_tokens", "tokens",
            "cpu_blas", "mtp_enabled", "acceptance_rate", "tokens_per_round", "block_sizes",
            "per_position_acceptance", "undrafted_steps", "gate_reason")
    return {**{k: out.get(k) for k in keep}, "process_wall_s": wall,
            "distinct_4gram_share": common.distinct_ngram_share(out.get("tokens") or [])}


def measure(args, watch=None) -> list:
    """``args.pairs`` pairs, alternating which arm starts first; each pair one unit of the idle
    check (retaken when the machine was not quiet during it)."""
    cli_args = shlex.split(args.cli_args)
    unit = common.idle.Watch.runner(watch)
    pairs = []
    for i in range(args.pairs):
        order = ARMS if i % 2 == 0 else ARMS[::-1]
        runs = unit(f"pair {i}", lambda: {arm: run_process(cli_command(cli_args, arm),
                                                           args.timeout) for arm in order})
        m, p = runs["mtp"], runs["plain"]
        pair = {"pair": i, "first": order[0], "mtp": m, "plain": p,
                "ratio": m["generation_tps"] / p["generation_tps"],
                "identical": m["tokens"] == p["tokens"]}
        pairs.append(pair)
        print(f"pair {i} ({order[0]} first): plain {p['generation_tps']:.1f} tok/s, MTP "
              f"{m['generation_tps']:.1f} tok/s, {pair['ratio']:.2f}x, acceptance "
              f"{m['acceptance_rate']:.2f}, {m['tokens_per_round']:.2f} tokens/round", flush=True)
    return pairs


def spread(xs: list) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def summarize(pairs: list) -> dict:
    widths = {}
    for p in pairs:
        for w, n in (p["mtp"]["block_sizes"] or {}).items():
            widths[w] = widths.get(w, 0) + n
    shares = [p["plain"]["distinct_4gram_share"] for p in pairs
              if p["plain"].get("distinct_4gram_share") is not None]
    return {
        "distinct_4gram_share": statistics.median(shares) if shares else None,
        "ratio": spread([p["ratio"] for p in pairs]),
        "plain_tps": spread([p["plain"]["generation_tps"] for p in pairs]),
        "mtp_tps": spread([p["mtp"]["generation_tps"] for p in pairs]),
        "acceptance_rate": spread([p["mtp"]["acceptance_rate"] for p in pairs]),
        "tokens_per_round": spread([p["mtp"]["tokens_per_round"] for p in pairs]),
        "plain_wall_s": spread([p["plain"]["process_wall_s"] for p in pairs]),
        "mtp_wall_s": spread([p["mtp"]["process_wall_s"] for p in pairs]),
        "widths": dict(sorted(widths.items(), key=lambda kv: int(kv[0]))),
        "identical": all(p["identical"] for p in pairs),
        "mtp_enabled": all(p["mtp"]["mtp_enabled"] for p in pairs),
        "meets_bar": statistics.median(p["ratio"] for p in pairs) >= BAR,
        "cpu_blas": sorted({p[a]["cpu_blas"] for p in pairs for a in ARMS}),
        "generation_tokens": sorted({p[a]["generation_tokens"] for p in pairs for a in ARMS}),
    }


def _share(run: dict) -> str:
    v = run.get("distinct_4gram_share")
    return "-" if v is None else f"{v:.2f}"


def _cell(s: dict, fmt: str = ".1f") -> str:
    return f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"


def render(r: dict) -> str:
    s = r["results"]
    cmd = " ".join(["python -m mlx_mtp.generate --json", r["cli_args"]]).strip()
    share = s.get("distinct_4gram_share")  # (records from before the field: "-")
    lines = common.setup_lines(r) + [
        f"- {r['pairs']} pairs of fresh processes, `{cmd}` (MTP) and the same with `--no-mtp` "
        "(mlx-lm plain decode), MTP first in even pairs, plain first in odd ones; "
        f"{', '.join(str(n) for n in s['generation_tokens'])} tokens per run; BLAS in the runs: "
        f"{'; '.join(s['cpu_blas'])}",
        f"- What the tok/s cover: {COVERS}", "",
        "## Results (median, min-max over pairs)", "",
        "| MTP / plain | distinct 4-grams | plain tok/s | MTP tok/s | acceptance | tokens/round "
        "| plain process s | MTP process s | widths auto chose (width: rounds, all pairs) "
        "| MTP = plain tokens |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| {_cell(s['ratio'], '.2f')} | {'-' if share is None else f'{share:.2f}'} | "
        f"{_cell(s['plain_tps'])} | {_cell(s['mtp_tps'])} | "
        f"{_cell(s['acceptance_rate'], '.2f')} | {_cell(s['tokens_per_round'], '.2f')} | "
        f"{_cell(s['plain_wall_s'], '.2f')} | {_cell(s['mtp_wall_s'], '.2f')} | "
        + ", ".join(f"{w}: {n}" for w, n in s["widths"].items())
        + f" | {'yes' if s['identical'] else 'NO'} |", "",
        f"Median MTP / plain >= {BAR}x: {'yes' if s['meets_bar'] else 'NO'}."
        + ("" if s["mtp_enabled"] else " MTP was declined in some run (see the JSON's "
                                        "gate_reason): those runs decoded plainly."), "",
        "## Pairs", "",
        "| pair | first | plain tok/s | MTP tok/s | MTP / plain | acceptance | tokens/round "
        "| distinct 4-grams plain / MTP |",
        "|---|---|---|---|---|---|---|---|"]
    for p in r["runs"]:
        lines.append(f"| {p['pair']} | {p['first']} | {p['plain']['generation_tps']:.1f} | "
                     f"{p['mtp']['generation_tps']:.1f} | {p['ratio']:.2f} | "
                     f"{p['mtp']['acceptance_rate']:.2f} | {p['mtp']['tokens_per_round']:.2f} | "
                     f"{_share(p['plain'])} / {_share(p['mtp'])} |")
    lines += common.what_it_says(r)
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=5, help="alternating pairs (default 5)")
    p.add_argument("--cli-args", default="",
                   help="flags added to both commands, one string, given as --cli-args=\"...\" "
                        "(default: none, the CLI's default run)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per process")
    p.add_argument("--topic", default="cli-default")
    common.add_record_args(p, units=True)
    args = p.parse_args(argv)
    if args.pairs < 1:
        p.error(f"--pairs: expected at least 1, got {args.pairs}")
    bad = {"--json", "--no-mtp"}.intersection(shlex.split(args.cli_args))
    if bad:
        p.error(f"--cli-args: {', '.join(sorted(bad))} is set by the script itself")
    watch = common.watch(args)
    pairs = measure(args, watch)
    result = {**common.record_setup(args.topic), "pairs": args.pairs,
              "cli_args": args.cli_args, "bar": BAR, "results": summarize(pairs),
              "covers": COVERS, "runs": pairs}
    return common.finish(args, result, watch, render, kind=None)


if __name__ == "__main__":
    main()
