"""One-token decode steps on the CPU: mlx-lm's plain decode against the target's own one-token
step (``Target.decode``, as the round loop runs it where it drafts nothing and for the first token)
with its one-row products through BLAS and through the row kernel, in one process.

    python -m benchmarks.bench_decode_step --model PATH --steps 48 --pairs 3
    python -m benchmarks.bench_decode_step --render RECORD.json --summary "..."   # no run

A unit decodes ``--steps`` greedy tokens after a fixed prompt (its prefill not timed), each step
queued before the previous token is read, as both loops do: ms per step over the run. A pass runs
every arm once, the arms' order reversed every other pass, after a warm-up pass that is not
counted; ratios are paired within a pass. Every arm's tokens are compared with mlx-lm's. Writes
benchmark_results/<topic>-<host>-<date>.md and .json.
"""

from __future__ import annotations

import argparse
import operator
import random
import sys
import time

import mlx_mtp  # noqa: F401  (first: binds the system BLAS before mlx.core loads)
import mlx.core as mx
from mlx_lm.generate import generate_step as mlx_generate_step

from benchmarks import common
from mlx_mtp.models.loader import load_model

MLX_LM, BLAS, KERNEL = "mlx-lm decode", "target step, BLAS one-row", "target step, one-row kernel"
ARMS = (MLX_LM, BLAS, KERNEL)


def mlx_lm_steps(model, prompt: mx.array, steps: int):
    """``(seconds per step, tokens)`` of mlx-lm's greedy decode, from its first token on."""
    tokens, started = [], None
    for token, _ in mlx_generate_step(prompt, model.mlx_model, max_tokens=steps + 1):
        if started is None:
            started = time.perf_counter()
        tokens.append(token)
    return (time.perf_counter() - started) / steps, tokens


def target_steps(model, prompt: mx.array, steps: int, one_row: list, kernel: bool):
    """``(seconds per step, tokens)`` of greedy one-token steps through ``Target.decode``, the
    layers ``one_row`` computing their one-row products through the kernel or not."""
    target = model.target
    for m in one_row:
        m.one_row_kernel = kernel
    cache = target.make_cache()
    mx.eval(target.prefill(prompt[None, :-1], cache), target.cache_state(cache))

    def step(token):
        return mx.argmax(target.logits(target.decode(token.reshape(1, 1), cache)[:, -1]), -1)

    nxt = step(prompt[-1:])
    tokens = [nxt.item()]
    started = time.perf_counter()
    for _ in range(steps):
        queued = step(nxt)
        mx.async_eval(queued)
        nxt = queued
        tokens.append(nxt.item())
    return (time.perf_counter() - started) / steps, tokens


def measure(model, prompt: mx.array, steps: int, pairs: int) -> dict:
    model.target.prepare(6)  # the row-exact layers a session of auto's widths installs
    layers = [m for _, m in model.mlx_model.named_modules() if getattr(m, "use_kernel", False)]
    one_row = [m for m in layers if m.one_row_kernel]  # what the install chose

    def run(_, arm):
        return (mlx_lm_steps(model, prompt, steps) if arm == MLX_LM
                else target_steps(model, prompt, steps, one_row, arm == KERNEL))

    by_unit, same = common.alternating_passes([None], ARMS, run, pairs, operator.eq)
    seconds, identical = by_unit[None], same[None]  # (one unit: the prompt)
    for m in one_row:  # the install's choice back in place
        m.one_row_kernel = True
    rows = [{"arm": arm, **common.paired_timing(seconds[arm], seconds[MLX_LM]),
             "identical": identical[arm]} for arm in ARMS]
    return {"rows": rows, "kernel_layers": len(layers), "one_row_layers": len(one_row)}


def render(r: dict) -> str:
    lines = common.setup_lines(r) + [
        f"- Model: {r['model']}; a fixed prompt of {r['prompt_tokens']} random ids, then "
        f"{r['steps']} greedy one-token steps per unit, each queued before the previous token is "
        f"read; {r['pairs']} counted passes after a warm-up pass, the arms' order reversed every "
        "other pass",
        f"- Arms: `{MLX_LM}` (mlx-lm's `generate_step`, what every record's plain decode is); "
        f"`{BLAS}` (`Target.decode` with every one-row product through the BLAS); `{KERNEL}` "
        f"(the same with the one-row products of the {r['one_row_layers']} of "
        f"{r['kernel_layers']} kernel layers the install chose through the row kernel: the "
        "default)", "", "## Results", "",
        "| arm | ms per step (median) | min-max | vs mlx-lm (paired, min-max) | tokens equal "
        "mlx-lm's |", "|---|---|---|---|---|"]
    for row in r["rows"]:
        lines.append(f"| {row['arm']} | {row['ms']:.1f} | {row['ms_min']:.1f}-{row['ms_max']:.1f}"
                     f" | {row['speedup']:.2f}x ({row['speedup_min']:.2f}-"
                     f"{row['speedup_max']:.2f}) | {'yes' if row['identical'] else 'NO'} |")
    lines += common.what_it_says(r)
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a target folder (required unless --render)")
    p.add_argument("--steps", type=int, default=48, help="one-token steps per unit")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--pairs", type=int, default=3, help="counted passes")
    p.add_argument("--topic", default="decode-step-realistic-pair")
    common.add_render_arg(p)
    common.add_record_args(p)
    args = p.parse_args(argv)
    rendered = common.render_instead(args, p, render, None)
    if rendered is not None:
        return rendered
    if args.steps < 1 or args.pairs < 1 or args.prompt_tokens < 2:
        sys.exit("error: --steps and --pairs must be at least 1, --prompt-tokens at least 2")
    model = load_model(args.model, require_head=False)
    rng = random.Random(0)
    prompt = mx.array([rng.randrange(model.target.vocab_size) for _ in range(args.prompt_tokens)])
    watch = common.watch(args)
    measured = measure(model, prompt, args.steps, args.pairs)
    result = common.record_setup(args.topic)
    result.update(model=args.model, steps=args.steps, prompt_tokens=args.prompt_tokens,
                  pairs=args.pairs, **measured)
    return common.finish(args, result, watch, render, None)


if __name__ == "__main__":
    main()
