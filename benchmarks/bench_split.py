"""MTP on a target split over processes against plain decode of the same split.

Starts the ring backend's ranks once per split: ``mlx.launch`` over ``--hosts``, or (default) 2
processes on this machine started as mlx.launch starts them but without the launcher, whose
polling threads would share the cores being timed; every rank loads the target split by mlx-lm (``--split pipeline`` / ``tensor``), then
runs the two arms alternated in the same processes (each warmed up once, a fixed token budget with
EOS ignored, temperature 0, every prompt, ``--pairs`` times): MTP at ``--block-size`` and
mlx-lm's plain decode. Rank 0 reports tok/s (medians over the pairs) and the collectives and
payload bytes rank 0 exchanged per generated token (prefill included, the exactness probe not),
and whether both arms gave the same ids, and the share of distinct 4-grams of each prompt's
plain output. Writes benchmark_results/split-<host>-<date>.md / .json (refused when the machine
was not idle: ``benchmarks.idle``; ``--no-write`` skips both).

    python -m benchmarks.bench_split                                   # the demo pair, both splits
    python -m benchmarks.bench_split --model PATH --splits pipeline --pairs 5 --max-tokens 256
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks import common
from benchmarks.harness import launch as mlx_launch

ROOT = Path(__file__).resolve().parents[1]

PROMPTS = {
    "code": "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Parse the arguments and",
    "class": "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
}


def worker(args) -> None:
    """One rank: load split, alternate the arms, rank 0 writes the JSON result."""
    import mlx_mtp  # noqa: F401  (first: binds the system BLAS)
    from mlx_mtp.decoding.stats import RunStats
    from mlx_mtp.decoding.plain import plain_generate_step
    from mlx_mtp.decoding.responses import encode_prompt
    from mlx_mtp.generate import speculative_generate_step

    model, tokenizer = mlx_mtp.load(args.model, split=args.split)
    arms = {
        "mtp": lambda p, s: speculative_generate_step(p, model, max_tokens=args.max_tokens,
                                                      block_size=args.block_size, stats=s),
        "plain": lambda p, s: plain_generate_step(p, model, max_tokens=args.max_tokens,
                                                  sampler=None, prefill_step_size=2048, stats=s),
    }
    runs = {arm: [] for arm in arms}
    ids = {}
    for name, text in PROMPTS.items():
        prompt = encode_prompt(tokenizer, text)
        for pair in range(args.pairs + 1):  # pair 0 warms both arms up
            for arm, run in arms.items():
                stats = RunStats()
                toks = [t for t, _, _ in run(prompt, stats)]
                ids[(name, arm)] = toks
                if pair:
                    d = stats.to_dict()
                    runs[arm].append({k: d[k] for k in (
                        "generation_tps", "split_messages_per_token", "split_bytes_per_token",
                        "tokens_per_round", "mtp_enabled")})
    if model.split.rank != 0:
        return
    summary = {}
    for arm, rs in runs.items():
        summary[arm] = {k: statistics.median(r[k] for r in rs)
                        for k in ("generation_tps", "split_messages_per_token",
                                  "split_bytes_per_token", "tokens_per_round")}
        summary[arm]["mtp_enabled"] = all(r["mtp_enabled"] for r in rs)
    summary["identical"] = all(ids[(n, "mtp")] == ids[(n, "plain")] for n in PROMPTS)
    summary["distinct_4gram_share"] = {n: common.distinct_ngram_share(ids[(n, "plain")])
                                       for n in PROMPTS}
    summary["ranks"] = model.split.size
    Path(args.result).write_text(json.dumps(summary))


def launch(args, split: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "rank0.json"
        cmd = [sys.executable, "-m", "benchmarks.bench_split", "--worker",
               "--model", args.model, "--split", split, "--block-size", str(args.block_size),
               "--max-tokens", str(args.max_tokens), "--pairs", str(args.pairs),
               "--result", str(result)]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        if args.hosts:  # mlx.launch with an open stdin (on /dev/null its poll spins a core)
            proc = mlx_launch.start(cmd, hosts=args.hosts, starting_port=args.port, env=env)
            try:
                proc.wait(timeout=args.timeout)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        else:  # local ranks without the launcher, whose polling threads would share the cores
            rc = mlx_launch.LocalRanks(cmd, ranks=args.ranks, starting_port=args.port,
                                       env=env).wait(timeout=args.timeout)
            if rc:
                raise SystemExit(f"error: a rank of the {split} run exited with code {rc}")
        if not result.exists():  # mlx.launch exits 0 whatever its ranks do
            raise SystemExit(f"error: the {split} launch wrote no result (see its output above)")
        return json.loads(result.read_text())


def render(r: dict) -> str:
    lines = [*common.setup_lines(r),
             f"- Model: {r['model']}; {r['hosts']} ranks (ring), block size {r['block_size']}, "
             f"{r['max_tokens']} tokens, {len(r['prompts'])} prompts x {r['pairs']} pairs, T=0; "
             "medians. Collectives and bytes: rank 0, per generated token, prefill included.", "",
             "## Results", "",
             "| split | arm | tok/s | collectives/token | kB/token | tokens/round | MTP on | "
             "ids equal |", "|---|---|---|---|---|---|---|---|"]
    for split, rec in r["splits"].items():
        for arm in ("mtp", "plain"):
            x = rec[arm]
            mtp = arm == "mtp"  # the plain arm has no rounds and no gate
            per_round = f"{x['tokens_per_round']:.2f}" if mtp else "-"
            enabled = x["mtp_enabled"] if mtp else "-"
            lines.append(f"| {split} | {arm} | {x['generation_tps']:.1f} | "
                         f"{x['split_messages_per_token']:.2f} | "
                         f"{x['split_bytes_per_token'] / 1e3:.1f} | {per_round} | {enabled} | "
                         f"{rec['identical']} |")
    shares = {split: rec["distinct_4gram_share"] for split, rec in r["splits"].items()
              if "distinct_4gram_share" in rec}  # (records from before the field: none)
    if shares:
        lines += ["", "Distinct 4-grams of each prompt's plain output: " + "; ".join(
            f"{split} " + ", ".join(f"{n} {'-' if v is None else f'{v:.2f}'}"
                                    for n, v in per.items()) for split, per in shares.items())]
    return "\n".join(lines + common.what_it_says(r))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="target folder or repo id (default: demo pair)")
    p.add_argument("--splits", default="pipeline,tensor")
    p.add_argument("--block-size", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2, help="local processes (without --hosts)")
    p.add_argument("--hosts", default=None, help="mlx.launch --hosts (IPs) instead of local")
    p.add_argument("--port", type=int, default=42323, help="mlx.launch --starting-port")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per split launch")
    common.add_record_args(p)
    p.add_argument("--no-write", action="store_true",
                   help="print the table, write nothing (no idle check)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--split", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.model is None:
        from mlx_mtp.demo import demo_path

        args.model = str(demo_path())
    if args.worker:
        worker(args)
        return 0
    watch = None if args.no_write else common.watch(args)
    records = {s: launch(args, s) for s in args.splits.split(",")}
    result = {**common.record_setup("split"), "model": args.model,
              "block_size": args.block_size, "max_tokens": args.max_tokens, "pairs": args.pairs,
              "prompts": list(PROMPTS), "hosts": args.hosts or f"{args.ranks} local",
              "splits": records}
    if args.no_write:
        print(render(result))
        return 0
    common.finish(args, result, watch, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
