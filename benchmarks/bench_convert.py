"""Acceptance and speed of converted folders (``python -m mlx_mtp.convert``): the target at 4 and
8 bits, its MTP head unquantized or at the target's bits.

Each arm converts ``--model`` (default: the embedded demo pair) into a temporary folder and runs
``benchmarks.bench_mtp``'s protocol on it (paired, alternating with mlx-lm's plain decode of the
same converted target, T=0, EOS ignored): tok/s of both, their ratio, acceptance, tokens per round,
and whether the output was identical to mlx-lm's. Arms differ in their weights, so compare
acceptance across arms and tok/s only within an arm (MTP vs plain on the same folder).

On an x86 CPU MLX's quantized matmuls are scalar loops (much slower than its float32 BLAS path),
so tok/s there says little about a Mac; acceptance is the informative number.

    python -m benchmarks.bench_convert [--model PATH] [--block-size 3] [--pairs 3] [--max-tokens 128]
    python -m benchmarks.bench_convert --arms 4:none,4:4,8:none,8:8     # the default arms

Writes benchmark_results/<topic>-<host>-<date>.md and .json, inside the benchmarks' idle check
(``benchmarks.idle``: refused on a busy machine unless ``--allow-busy``, which labels the record
"contended: not a result"). Each arm's row carries the share of distinct 4-grams of its output
(median over prompts and pairs of the plain arm's: the converted target's own text).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

import mlx_mtp  # noqa: F401  (first: binds the system BLAS before mlx.core loads)

from benchmarks import bench_mtp, common
from mlx_mtp.convert import convert
from mlx_mtp.decoding.limits import DEFAULT_MAX_BLOCK_SIZE
from mlx_mtp.demo import demo_path


def parse_arms(text: str):
    arms = []
    for item in text.split(","):
        q, _, h = item.partition(":")
        arms.append((None if q == "none" else int(q), None if h in ("", "none") else int(h)))
    return arms


def arm_name(q, h) -> str:
    return f"target {'float' if q is None else f'{q}-bit'}, head {'float' if h is None else f'{h}-bit'}"


def run(args) -> dict:
    model = args.model or str(demo_path())
    rows = []
    work = Path(tempfile.mkdtemp(prefix="bench_convert-"))
    try:
        for q, h in args.arms:
            out = work / f"q{q}-h{h}"
            convert(model, out, quantize=q is not None, q_bits=q, head_bits=h,
                    q_group_size=args.group_size if q is not None else None,
                    head_group_size=args.group_size, quiet=True)
            ns = argparse.Namespace(
                model=str(out), drafter=None, draft_bf16=False, topic=args.topic,
                block_sizes=[args.block_size],
                pairs=args.pairs, max_tokens=args.max_tokens, prompts=common.DEFAULT_PROMPTS,
                temp=0.0, top_p=0.0, top_k=0, seed=0, acceptance="auto",
                max_block_size=DEFAULT_MAX_BLOCK_SIZE, repetition_penalty=None,
                repetition_context_size=20,
                synced_runs=0)  # acceptance and tok/s per arm: no round split needed
            print(f"== {arm_name(q, h)}", flush=True)
            r = bench_mtp.run(ns)
            row = r["rows"][0]
            shares = [p["distinct_4gram_share"] for p in r["per_prompt"]
                      if p.get("distinct_4gram_share") is not None]
            rows.append({"target_bits": q, "head_bits": h, "group_size": args.group_size,
                         **{k: row[k] for k in ("classic_tps", "mtp_tps", "ratio_median",
                                                "ratio_min", "ratio_max", "acceptance",
                                                "tokens_per_round", "per_position_acceptance",
                                                "identical_to_classic", "mtp_enabled",
                                                "gate_reason")},
                         "distinct_4gram_share": statistics.median(shares) if shares else None,
                         "target_dtype": r["target_dtype"]})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {**common.record_setup(args.topic), "model": model, "block_size": args.block_size,
            "pairs": args.pairs, "max_tokens": args.max_tokens,
            "prompts": common.DEFAULT_PROMPTS, "rows": rows}


def render(r: dict) -> str:
    lines = common.setup_lines(r, env=False) + [
        f"- Model: {r['model']}, converted per arm with `python -m mlx_mtp.convert` (group size "
        f"{r['rows'][0]['group_size'] if r['rows'] else '-'}); block size {r['block_size']}; "
        f"prompts {', '.join(r['prompts'])}, {r['max_tokens']} tokens each, EOS ignored, T=0, "
        f"{r['pairs']} alternating pairs per prompt",
        "- On an x86 CPU MLX's quantized matmuls are scalar loops: tok/s here is not what a Mac "
        "does; acceptance is the informative number. Compare tok/s within a row only.", "",
        "## Results (medians over pairs x prompts)", "",
        "| arm | distinct 4-grams | plain tok/s | MTP tok/s | ratio | ratio range | acceptance "
        "| tokens/round | per-position acceptance | identical to plain |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:  # T=0: identical_to_classic is always yes or NO
        gate = "" if row["mtp_enabled"] else f" (MTP declined: {row['gate_reason']})"
        share = row.get("distinct_4gram_share")  # (records from before the field: "-")
        lines.append(f"| {arm_name(row['target_bits'], row['head_bits'])}{gate} | "
                     f"{'-' if share is None else f'{share:.2f}'} | "
                     f"{bench_mtp.result_cells(row)} |")
    lines += common.what_it_says(r)
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description="Converted folders: acceptance and tok/s per quantization")
    p.add_argument("--model", help="checkpoint to convert (default: the embedded demo pair)")
    p.add_argument("--arms", type=parse_arms, default=parse_arms("4:none,4:4,8:none,8:8"),
                   help="comma-separated TARGET_BITS:HEAD_BITS (none = unquantized)")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--block-size", type=int, default=3)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--topic", default="convert-demo-pair")
    common.add_record_args(p)
    args = p.parse_args(argv)
    watch = common.watch(args)
    result = common.finish(args, run(args), watch, render)
    print(common.render_markdown(result, render))
    return result


if __name__ == "__main__":
    main()
