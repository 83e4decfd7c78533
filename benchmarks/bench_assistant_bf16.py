"""The Gemma 4 assistant on bfloat16 copies (the bf16 kernel) against float32, in one run.

Protocol (docs/benchmarks.md): one process and one target with two drafters, the assistant loaded
twice (float32 products, and bfloat16 copies through the bf16 kernel: ``DraftOptions(bf16=True)``),
each arm warmed up once, a fixed token budget with EOS ignored, several prompts, T=0, plain decode
and the arms alternating pair by pair. Per block size and drafter: median tok/s, its ratio to
plain decode and bf16 over float32 pair by pair, per-position acceptance, identity with plain
decode. Then the assistant's drafting alone: ``--draft-steps`` drafts from one prefilled prompt,
synced, the two drafters alternating, ms per draft. The record says whether the copy rounds
anything (off by default where it would). Writes benchmark_results/<topic>-<host>-<date>.md and
.json.

    python -m benchmarks.bench_assistant_bf16 --model TARGET --drafter ASSISTANT --block-sizes 3,4
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import mlx_mtp  # first: binds the system BLAS before mlx.core loads
import mlx.core as mx

from benchmarks import common
from benchmarks.bench_draft_processors import pooled_acceptance
from mlx_mtp.decoding.responses import encode_prompt
from mlx_mtp.models.gemma4 import bf16_assistant
from mlx_mtp.models.gemma4.drafter import Gemma4AssistantDrafter
from mlx_mtp.models.gemma4.loading import load_assistant
from mlx_mtp.models.options import DraftOptions

FLOAT32, BF16 = "float32", "bf16"
DRAFTERS = (FLOAT32, BF16)


def load_pair(args):
    """(bf16 model, float32 model, tokenizer): one target, the assistant loaded twice."""
    try:
        model, tokenizer = mlx_mtp.load(args.model, drafter=args.drafter,
                                        draft_options=DraftOptions(bf16=True))
    except mlx_mtp.MTPError as e:  # e.g. no bf16 kernel here, or a quantized assistant
        raise SystemExit(f"error: {e}") from None
    if not isinstance(model.drafter, Gemma4AssistantDrafter):
        raise SystemExit(f"error: --model {args.model} with --drafter {args.drafter} is not a "
                         "Gemma 4 target and assistant")
    plain = load_assistant(args.drafter, model.target)
    rounds_nothing = bf16_assistant.resolve(None, plain, f"drafter {args.drafter}")
    f32 = dataclasses.replace(model, drafter=Gemma4AssistantDrafter(plain, model.target))
    return model, f32, tokenizer, rounds_nothing


def draft_step_ms(models: dict, prompt: mx.array, k: int, reps: int) -> dict:
    """ms per draft of ``k`` drafts after ``prompt``, synced, the drafters alternating."""
    target = models[BF16].target
    cache = target.make_cache()
    h = target.prefill(prompt[None], cache)
    first = mx.argmax(target.logits(h[:, -1:]), axis=-1).reshape(1)
    for m in models.values():
        m.drafter.bind_cache(cache)
        m.drafter.prefill(h, first)
        mx.eval(m.drafter.draft(k))  # warm
    times = {name: [] for name in models}
    for i in range(reps):
        for name in (DRAFTERS if i % 2 == 0 else DRAFTERS[::-1]):
            t0 = time.perf_counter()
            mx.eval(models[name].drafter.draft(k))
            times[name].append((time.perf_counter() - t0) / k)
    out = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}
    out["bf16_over_float32"] = out[BF16] / out[FLOAT32]
    return out


def run(args, watch=None) -> dict:
    bf16_model, f32_model, tokenizer, rounds_nothing = load_pair(args)
    models = {FLOAT32: f32_model, BF16: bf16_model}
    prompts = {k: mx.array(encode_prompt(tokenizer, v)) for k, v in args.prompts.items()}
    n = args.max_tokens
    arms = {f"{bs}/{d}": (lambda p, bs=bs, d=d: common.mtp_decode(models[d], p, n, bs))
            for bs in args.block_sizes for d in DRAFTERS}
    warm = next(iter(prompts.values()))
    common.plain_decode(bf16_model.mlx_model, warm, 8)
    for decode in arms.values():
        decode(warm)
    unit = common.idle.Watch.runner(watch)
    raw, exact, _ = common.paired_runs(
        prompts, arms, args.pairs, unit,
        lambda p: common.plain_decode(bf16_model.mlx_model, p, n))
    steps = unit("draft steps", lambda: draft_step_ms(models, warm, args.draft_steps, args.reps))
    return summarize(args, bf16_model, raw, exact, steps, rounds_nothing)


def summarize(args, model, raw, exact, steps, rounds_nothing) -> dict:
    plain = {(r["pair"], r["prompt"]): r["tps"] for r in raw[common.PLAIN]}
    rows = []
    for bs in args.block_sizes:
        for d in DRAFTERS:
            runs = raw[f"{bs}/{d}"]
            stats = [r["stats"] for r in runs]
            ratios = [r["tps"] / plain[(r["pair"], r["prompt"])] for r in runs]
            rows.append({"block_size": bs, "drafter": d,
                         "tps": statistics.median(r["tps"] for r in runs),
                         "ratio_vs_plain": statistics.median(ratios),
                         "ratio_range": [min(ratios), max(ratios)],
                         "per_position_acceptance": pooled_acceptance(stats),
                         "tokens_per_round": sum(s["accepted"] + s["rounds"] for s in stats)
                         / max(sum(s["rounds"] for s in stats), 1),
                         "identical_to_plain": exact[f"{bs}/{d}"]})
    compared = []
    for bs in args.block_sizes:
        f32 = {(r["pair"], r["prompt"]): r["tps"] for r in raw[f"{bs}/{FLOAT32}"]}
        ratios = [r["tps"] / f32[(r["pair"], r["prompt"])] for r in raw[f"{bs}/{BF16}"]]
        compared.append({"block_size": bs, "bf16_over_float32": statistics.median(ratios),
                         "range": [min(ratios), max(ratios)]})
    return {**common.record_setup(args.topic), "model": str(args.model),
            "drafter": str(args.drafter), "pair_info": common.pair_info(args.model),
            "draft": model.drafter.describe(), "rounds_nothing": rounds_nothing,
            "prompts": args.prompts, "max_tokens": args.max_tokens, "pairs": args.pairs,
            "block_sizes": args.block_sizes,
            "plain_tps": statistics.median(r["tps"] for r in raw[common.PLAIN]),
            "rows": rows, "compared": compared, "draft_steps": args.draft_steps,
            "reps": args.reps, "draft_step_ms": steps,
            "raw": {k: [{x: v for x, v in r.items() if x != "stats"} for r in rs]
                    for k, rs in raw.items()}}


def render(r: dict) -> str:
    s = r["draft_step_ms"]
    lines = common.setup_lines(r, memory=True) + [
        f"- Target: {r['model']}; assistant: {r['drafter']}",
        f"- Prompts: {', '.join(r['prompts'])}; {r['max_tokens']} tokens each, EOS ignored, T=0; "
        f"{r['pairs']} alternating pairs per prompt",
        f"- The bfloat16 copy {'rounds nothing (the default would take it)' if r['rounds_nothing'] else 'rounds the weights (the default would not take it; drafts may differ in a near tie)'}",
        f"- Plain decode (mlx-lm): {r['plain_tps']:.1f} tok/s", "",
        "## bf16 over float32, tok/s pair by pair", "",
        "| block | bf16 / float32 (median) | range |", "|---|---|---|"]
    for c in r["compared"]:
        lines.append(f"| {c['block_size']} | {c['bf16_over_float32']:.3f}x | "
                     f"{c['range'][0]:.3f}-{c['range'][1]:.3f} |")
    lines += ["", "## Arms (medians; ratio: per pair, over plain decode)", "",
              "| block | assistant | tok/s | ratio (range) | tokens/round | per-position "
              "acceptance | identical to plain |", "|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        pp = " / ".join(f"{a:.2f}" for a in row["per_position_acceptance"]) or "-"
        lines.append(f"| {row['block_size']} | {row['drafter']} | {row['tps']:.1f} | "
                     f"{row['ratio_vs_plain']:.2f}x ({row['ratio_range'][0]:.2f}-"
                     f"{row['ratio_range'][1]:.2f}) | {row['tokens_per_round']:.2f} | {pp} | "
                     f"{'yes' if row['identical_to_plain'] else 'NO'} |")
    lines += ["", "## Drafting alone", "",
              f"{r['draft_steps']} drafts from the first prompt, synced, {r['reps']} runs each, "
              f"the assistants alternating: float32 {s[FLOAT32]:.2f} ms a draft, bf16 "
              f"{s[BF16]:.2f} ms ({s['bf16_over_float32']:.2f}x)."]
    lines += common.what_it_says(r)
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="the Gemma 4 target (required unless --render)")
    p.add_argument("--drafter", help="its assistant's folder")
    p.add_argument("--topic", default="assistant-bf16")
    p.add_argument("--block-sizes", default="3,4", help="comma-separated fixed block sizes")
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--draft-steps", type=int, default=3, help="drafts per timed drafting run")
    p.add_argument("--reps", type=int, default=20, help="timed drafting runs per assistant")
    common.add_prompt_args(p)
    common.add_render_arg(p)
    common.add_record_args(p, units=True)
    args = p.parse_args(argv)
    rendered = common.render_instead(args, p, render, None)
    if rendered is not None:
        return rendered
    if not args.drafter:
        p.error("--drafter: the assistant's folder is required")
    args.block_sizes = common.int_list(p, "--block-sizes", args.block_sizes)
    if (any(b < 2 for b in args.block_sizes) or args.pairs < 1 or args.max_tokens < 2
            or args.draft_steps < 1 or args.reps < 1):
        p.error("--block-sizes: each at least 2; --pairs, --draft-steps and --reps >= 1; "
                "--max-tokens >= 2")
    args.prompts = common.prompts_of(args, p)
    watch = common.watch(args)
    return common.finish(args, run(args, watch), watch, render, kind=None)


if __name__ == "__main__":
    main()
