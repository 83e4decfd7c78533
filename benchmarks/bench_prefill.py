"""A prompt's prefill through the target on the CPU: mlx-lm's forward against the target's
``prefill`` (the GatedDeltaNet recurrence in the C kernel), on the BLAS's default thread count and
on every core (``mlx_mtp.cpu.blas.prefill_threads``, as the round loop prefills), in one process.

    python -m benchmarks.bench_prefill --model PATH --lengths 32,128,512 --pairs 3
    python -m benchmarks.bench_prefill --render RECORD.json --summary "..."   # no run

A unit prefills a prompt of fixed random ids of one length into a fresh cache and evaluates its
hidden states and caches. A pass runs every arm once per length, the arms' order reversed every
other pass, after a warm-up pass that is not counted. Ratios are paired within a pass. Every arm's
hidden states and caches are compared with mlx-lm's forward bit for bit. Writes
benchmark_results/<topic>-<host>-<date>.md and .json.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import time

import mlx_mtp  # noqa: F401  (first: binds the system BLAS before mlx.core loads)
import mlx.core as mx

from benchmarks import common
from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.exactness.row_exact_layers import bitwise_equal
from mlx_mtp.models.loader import load_model
from mlx_mtp.models.target_base import TrunkTarget

MLX_LM, KERNEL, EVERY_CORE = "mlx-lm forward", "kernel recurrence", "kernel, every core"
ARMS = (MLX_LM, KERNEL, EVERY_CORE)


def prompt_ids(n: int, vocab: int, seed: int = 0) -> mx.array:
    rng = random.Random(seed)
    return mx.array([[rng.randrange(vocab) for _ in range(n)]])


def prefill(target, arm: str, ids: mx.array):
    """``(seconds, hidden states and cache arrays)`` of one arm's prefill into a fresh cache."""
    threads = cpu_blas.prefill_threads() if arm == EVERY_CORE else contextlib.nullcontext()
    forward = target.hidden if arm == MLX_LM else target.prefill
    cache = target.make_cache()
    started = time.perf_counter()
    with threads:
        hidden = forward(ids, cache)
        out = [hidden, *target.cache_state(cache)]
        mx.eval(out)
    return time.perf_counter() - started, out


def same_bits(a, b) -> bool:
    return len(a) == len(b) and all(bitwise_equal(x, y) for x, y in zip(a, b))


def measure(target, lengths, pairs: int) -> dict:
    prompts = {n: prompt_ids(n, target.vocab_size, seed=n) for n in lengths}
    seconds, identical = common.alternating_passes(  # (the warm-up pass compiles and checks)
        lengths, ARMS, lambda n, arm: prefill(target, arm, prompts[n]), pairs, same_bits)
    rows = [{"prompt_tokens": n, "arm": arm, **common.paired_timing(got, seconds[n][MLX_LM]),
             "tokens_per_s": n / statistics.median(got), "identical": identical[n][arm]}
            for n in lengths for arm, got in seconds[n].items()]
    return {"rows": rows}


def render(r: dict) -> str:
    lines = common.setup_lines(r) + [
        f"- Model: {r['model']}; prompts of fixed random ids, {', '.join(map(str, r['lengths']))}"
        f" tokens, each into a fresh cache; {r['pairs']} counted passes after a warm-up pass, the "
        "arms' order reversed every other pass",
        f"- Arms: `{MLX_LM}` (mlx-lm's model as it is, the BLAS's default threads); "
        f"`{KERNEL}` (the target's prefill: the GatedDeltaNet recurrence in the C kernel); "
        f"`{EVERY_CORE}` (that, with the BLAS on every core: what the round loop runs)",
        "", "## Results", "",
        "| prompt tokens | arm | ms (median) | min-max | tok/s | vs mlx-lm (paired, min-max) "
        "| identical to mlx-lm |", "|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        lines.append(
            f"| {row['prompt_tokens']} | {row['arm']} | {row['ms']:.0f} | "
            f"{row['ms_min']:.0f}-{row['ms_max']:.0f} | {row['tokens_per_s']:.1f} | "
            f"{row['speedup']:.2f}x ({row['speedup_min']:.2f}-{row['speedup_max']:.2f}) | "
            f"{'yes' if row['identical'] else 'NO'} |")
    lines += common.what_it_says(r)
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a Qwen3.5 target folder (required unless --render)")
    p.add_argument("--lengths", default="32,128,512", help="prompt lengths, comma separated")
    p.add_argument("--pairs", type=int, default=3, help="counted passes")
    p.add_argument("--topic", default="prefill-realistic-pair")
    common.add_render_arg(p)
    common.add_record_args(p)
    args = p.parse_args(argv)
    rendered = common.render_instead(args, p, render, "prefill")
    if rendered is not None:
        return rendered
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        p.error(f"--lengths must be whole numbers separated by commas, got {args.lengths!r}")
    if min(lengths) < 1 or args.pairs < 1:
        p.error("--lengths must be 1 or more tokens, --pairs at least 1")
    target = load_model(args.model, require_head=False).target
    if type(target).prefill is TrunkTarget.prefill:
        sys.exit(f"error: --model {args.model}: bench_prefill compares the hybrid Qwen targets' "
                 f"prefill, got the {target.family} family")
    watch = common.watch(args)
    measured = measure(target, lengths, args.pairs)
    result = common.record_setup(args.topic)
    result.update(model=args.model, lengths=lengths, pairs=args.pairs, **measured)
    return common.finish(args, result, watch, render, "prefill")


if __name__ == "__main__":
    main()
