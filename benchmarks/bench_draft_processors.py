"""Acceptance with the request's logits processors (a penalty) against without, in one run.

Protocol (docs/benchmarks.md): one process, each arm warmed up once, a fixed token budget with EOS
ignored, several prompts, temperature 0, the arms alternating pair by pair (the order reversed
every other pair). Per block size the arms are MTP with the processors (``penalty``: the drafts
apply them too, as mlx_mtp runs), MTP without any (``none``) and, with ``--unprocessed-drafts``,
MTP with the processors on the target's rows only (``target-only``: each processor marked
``draftable = False``, so the drafts are the head's unprocessed picks); plain decode (mlx-lm) runs
with the processors and without. Per arm: per-position acceptance pooled over the runs,
acceptance, tokens per round, median tok/s and its ratio to plain decode with the same processors
(pair by pair), identity with that plain decode, the distinct 4-gram share of the text and the
drafts' processor status; per block size, each position's acceptance with the processors over
without (the claim a record checks: at least ``BAR``). Writes
benchmark_results/<topic>-<host>-<date>.md and .json.

    python -m benchmarks.bench_draft_processors --model PAIR --block-sizes 3,4 \\
        --repetition-penalty 1.3 --repetition-context-size 48 [--presence-penalty 0.5] \\
        [--unprocessed-drafts]
"""

from __future__ import annotations

import argparse
import statistics

import mlx_mtp  # first: binds the system BLAS before mlx.core loads
from mlx_lm.sample_utils import make_logits_processors

from benchmarks import common
from benchmarks.common import mtp_decode, plain_decode
from mlx_mtp.decoding.responses import encode_prompt

BAR = 0.95  # per-position acceptance with the processors over without, at least
PENALTY, NONE, TARGET_ONLY = "penalty", "none", "target-only"


class TargetOnly:
    """A processor the drafts leave out (``draftable = False``): the target's rows only."""

    draftable = False

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, tokens, logits):
        return self.inner(tokens, logits)


def processors_of(args) -> list:
    return make_logits_processors(repetition_penalty=args.repetition_penalty,
                                  repetition_context_size=args.repetition_context_size,
                                  presence_penalty=args.presence_penalty,
                                  presence_context_size=args.presence_context_size)


def arm_processors(args) -> dict:
    """Arm kind -> the processors its runs get (plain decode: ``penalty`` and ``none``)."""
    procs = processors_of(args)
    arms = {PENALTY: procs, NONE: []}
    if args.unprocessed_drafts:
        arms[TARGET_ONLY] = [TargetOnly(p) for p in procs]
    return arms


def run(args, watch=None) -> dict:
    model, tokenizer = mlx_mtp.load(args.model, drafter=args.drafter)
    prompts = {k: encode_prompt(tokenizer, v) for k, v in args.prompts.items()}
    kinds = arm_processors(args)
    arms = [(bs, kind) for bs in args.block_sizes for kind in kinds]
    n = args.max_tokens
    warm = next(iter(prompts.values()))
    for kind in (PENALTY, NONE):
        plain_decode(model.mlx_model, warm, 8, None, kinds[kind])
    for bs, kind in arms:
        mtp_decode(model, warm, 8, bs, processors=kinds[kind])
    unit = common.idle.Watch.runner(watch)
    order = [("plain", kind) for kind in (PENALTY, NONE)] + arms
    raw = []
    for pair in range(args.pairs):
        for name, prompt in prompts.items():
            def measure():
                out = {}
                for bs, kind in (order if pair % 2 == 0 else order[::-1]):
                    if bs == "plain":
                        toks, _, gs = plain_decode(model.mlx_model, prompt, n, None, kinds[kind])
                        out[(bs, kind)] = {"tokens": toks, "gen_s": gs}
                    else:
                        toks, _, gs, st = mtp_decode(model, prompt, n, bs,
                                                     processors=kinds[kind])
                        out[(bs, kind)] = {"tokens": toks, "gen_s": gs, "stats": st.to_dict()}
                return out

            results = unit(f"pair {pair} {name}", measure)
            for (bs, kind), r in results.items():
                plain = results[("plain", NONE if kind == NONE else PENALTY)]
                raw.append({"pair": pair, "prompt": name, "block_size": bs, "kind": kind,
                            "tps": (len(r["tokens"]) - 1) / r["gen_s"],
                            "identical": r["tokens"] == plain["tokens"],
                            "distinct_4gram_share": common.distinct_ngram_share(r["tokens"]),
                            **({"stats": r["stats"]} if "stats" in r else {})})
            print(f"pair {pair} {name}: " + ", ".join(
                f"{r['block_size']}/{r['kind']} {r['tps']:.1f}" for r in raw[-len(order):]),
                flush=True)
    return summarize(args, model, arms, raw)


def pooled_acceptance(stats: list) -> list:
    """Per draft position: kept over drafted, summed over runs' ``RunStats.to_dict()``."""
    depth = max((len(s["per_position_rounds"]) for s in stats), default=0)
    out = []
    for j in range(depth):
        offered = sum(s["per_position_rounds"][j] for s in stats
                      if len(s["per_position_rounds"]) > j)
        kept = sum(s["per_position_acceptance"][j] * s["per_position_rounds"][j] for s in stats
                   if len(s["per_position_rounds"]) > j)
        out.append(kept / offered if offered else 0.0)
    return out


def summarize(args, model, arms, raw) -> dict:
    plain = {(r["pair"], r["prompt"], r["kind"]): r["tps"] for r in raw
             if r["block_size"] == "plain"}
    rows = []
    for bs, kind in arms:
        runs = [r for r in raw if r["block_size"] == bs and r["kind"] == kind]
        stats = [r["stats"] for r in runs]
        drafted = sum(s["drafted"] for s in stats)
        ratios = [r["tps"] / plain[(r["pair"], r["prompt"], NONE if kind == NONE else PENALTY)]
                  for r in runs]
        rows.append({
            "block_size": bs, "kind": kind,
            "per_position_acceptance": pooled_acceptance(stats),
            "acceptance": sum(s["accepted"] for s in stats) / drafted if drafted else 0.0,
            "tokens_per_round": sum(s["accepted"] + s["rounds"] for s in stats)
            / max(sum(s["rounds"] for s in stats), 1),
            "tps": statistics.median(r["tps"] for r in runs),
            "ratio_vs_plain": statistics.median(ratios),
            "ratio_range": [min(ratios), max(ratios)],
            "identical_to_plain": all(r["identical"] for r in runs),
            "distinct_4gram_share": statistics.median(r["distinct_4gram_share"] or 0.0
                                                      for r in runs),
            "draft_processors": sorted({str(s["draft_processors"]) for s in stats}),
        })
    by = {(row["block_size"], row["kind"]): row for row in rows}
    compared = []
    for bs in args.block_sizes:
        on, off = by[(bs, PENALTY)], by[(bs, NONE)]
        ratio = [a / b if b else None for a, b in zip(on["per_position_acceptance"],
                                                      off["per_position_acceptance"])]
        compared.append({"block_size": bs, "penalty_over_none": ratio,
                         "meets_bar": all(r is not None and r >= BAR for r in ratio)})
    return {**common.record_setup(args.topic), "model": str(args.model),
            "drafter": args.drafter, "target_dtype": str(model.target.dtype),
            "draft": model.drafter.describe() if model.drafter is not None else None,
            "prompts": args.prompts, "max_tokens": args.max_tokens, "pairs": args.pairs,
            "repetition_penalty": args.repetition_penalty,
            "repetition_context_size": args.repetition_context_size,
            "presence_penalty": args.presence_penalty,
            "presence_context_size": args.presence_context_size,
            "block_sizes": args.block_sizes, "bar": BAR, "rows": rows, "compared": compared,
            "plain_tps": {kind: statistics.median(r["tps"] for r in raw
                                                  if r["block_size"] == "plain"
                                                  and r["kind"] == kind)
                          for kind in (PENALTY, NONE)},
            "raw": raw}


def _processors_text(r: dict) -> str:
    parts = []
    if r.get("repetition_penalty"):
        parts.append(f"repetition penalty {r['repetition_penalty']} over "
                     f"{r['repetition_context_size']} tokens")
    if r.get("presence_penalty"):
        parts.append(f"presence penalty {r['presence_penalty']} over "
                     f"{r['presence_context_size']} tokens")
    return ", ".join(parts) or "none"


def render(r: dict) -> str:
    lines = common.setup_lines(r, memory=True) + [
        f"- Target: {r['model']} ({r['target_dtype']}); drafter: "
        f"{r['drafter'] or 'embedded mtp.* head'}",
        f"- Prompts: {', '.join(r['prompts'])}; {r['max_tokens']} tokens each, EOS ignored, "
        f"T=0; {r['pairs']} alternating pairs per prompt",
        f"- Logits processors of the `{PENALTY}` arms: {_processors_text(r)}. `{NONE}`: none. "
        f"`{TARGET_ONLY}`: the same processors on the target's rows only (the drafts "
        "unprocessed)",
        f"- Plain decode (mlx-lm): {r['plain_tps'][PENALTY]:.1f} tok/s with the processors, "
        f"{r['plain_tps'][NONE]:.1f} without", "",
        "## Acceptance with the processors over without, per draft position", "",
        "| block | penalty / none per position | all positions >= "
        f"{r['bar']} |", "|---|---|---|"]
    for c in r["compared"]:
        cells = " / ".join("-" if x is None else f"{x:.3f}" for x in c["penalty_over_none"])
        lines.append(f"| {c['block_size']} | {cells} | {'yes' if c['meets_bar'] else 'NO'} |")
    lines += ["", "## Arms (pooled over pairs x prompts; tok/s: medians; ratio: per-pair, over "
              "plain decode with the same processors)", "",
              "| block | arm | per-position acceptance | acceptance | tokens/round | tok/s | "
              "ratio (range) | identical to plain | distinct 4-grams | drafts' processors |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        pp = " / ".join(f"{a:.3f}" for a in row["per_position_acceptance"]) or "-"
        lines.append(
            f"| {row['block_size']} | {row['kind']} | {pp} | {row['acceptance']:.3f} | "
            f"{row['tokens_per_round']:.2f} | {row['tps']:.1f} | {row['ratio_vs_plain']:.2f}x "
            f"({row['ratio_range'][0]:.2f}-{row['ratio_range'][1]:.2f}) | "
            f"{'yes' if row['identical_to_plain'] else 'NO'} | "
            f"{row['distinct_4gram_share']:.2f} | {'; '.join(row['draft_processors'])} |")
    lines += common.what_it_says(r)
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="the target (required unless --render)")
    p.add_argument("--drafter")
    p.add_argument("--topic", default="draft-processors")
    p.add_argument("--block-sizes", default="3,4", help="comma-separated fixed block sizes")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    common.add_prompt_args(p)
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="mlx-lm's repetition penalty of the penalty arms")
    p.add_argument("--repetition-context-size", type=int, default=20)
    p.add_argument("--presence-penalty", type=float, default=None,
                   help="mlx-lm's presence penalty of the penalty arms")
    p.add_argument("--presence-context-size", type=int, default=20)
    p.add_argument("--unprocessed-drafts", action="store_true",
                   help=f"add the {TARGET_ONLY} arms: the processors on the target's rows only")
    common.add_render_arg(p)
    common.add_record_args(p, units=True)
    args = p.parse_args(argv)
    rendered = common.render_instead(args, p, render, None)
    if rendered is not None:
        return rendered
    args.block_sizes = common.int_list(p, "--block-sizes", args.block_sizes)
    if any(b < 2 for b in args.block_sizes) or args.pairs < 1 or args.max_tokens < 2:
        p.error("--block-sizes: each at least 2 (a draft to accept); --pairs >= 1 and "
                "--max-tokens >= 2")
    if not args.repetition_penalty and not args.presence_penalty:
        p.error("--repetition-penalty or --presence-penalty: the penalty arms need one")
    args.prompts = common.prompts_of(args, p)
    watch = common.watch(args)
    return common.finish(args, run(args, watch), watch, render, kind=None)


if __name__ == "__main__":
    main()
