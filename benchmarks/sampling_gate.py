"""What sampling saves by promising the distribution instead of the bytes.

    python -m benchmarks.sampling_gate --model PATH [--temp 0.6 --block-size 3 --pairs 3
        --max-tokens 128] [--repetition-penalty R] [record flags]

At temperature > 0 the gate runs no probe and the verify takes its fastest path
(``mlx_mtp.exactness.gate``). This measures both sides of that choice on one target, idle and
alternating:
- ``byte-gate``: what a sampled session did when it was gated like a T=0 one: the probe (its one-off
  cost, timed on the loaded target before anything is memoized) and a verify with the
  exactness-only fallbacks (row-exact products, per-row attention);
- ``distribution``: the default now: no probe, the plain multi-row verify.
Arms alternate per prompt and pair; each is seeded alike (speculative sampling at a fixed block
size). The record gives tok/s per arm, their per-pair ratio, and the verify's ms per round.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import mlx_mtp  # noqa: F401  (first: binds the system BLAS before mlx.core loads)
import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from benchmarks import common
from mlx_mtp.decoding.sampling import make_sampler
from mlx_mtp.exactness import gate
from mlx_mtp.exactness.block_vs_chain import probe_exactness
from mlx_mtp.generate import encode_prompt

ARMS = ("byte-gate", "distribution")


@contextlib.contextmanager
def gated_like_t0():
    """The ``byte-gate`` arm: every session is decided as at T=0 (probe, exact verify)."""
    check = gate.check

    def as_t0(model, block_size, device=None, kv=None, sampling=False):
        return check(model, block_size, device, kv, sampling=False)

    gate.check = as_t0
    try:
        yield
    finally:
        gate.check = check


def run(args, watch) -> dict:
    model, tokenizer = mlx_mtp.load(args.model)
    prompts = {k: encode_prompt(tokenizer, v) for k, v in args.prompts.items()}
    sampler = make_sampler(temp=args.temp, top_p=args.top_p)
    processors = make_logits_processors(repetition_penalty=args.repetition_penalty,
                                        repetition_context_size=args.repetition_context_size)
    t0 = time.perf_counter()
    probes = probe_exactness(model.target, gate.session_widths(args.block_size))
    probe_s = time.perf_counter() - t0
    unit = common.idle.Watch.runner(watch)

    def decode(arm, prompt, seed):
        with gated_like_t0() if arm == "byte-gate" else contextlib.nullcontext():
            toks, _, gen_s, stats = common.mtp_decode(model, prompt, args.max_tokens,
                                                      args.block_size, sampler,
                                                      "speculative-sampling", seed,
                                                      processors=processors)
        verify_ms = 1e3 * stats.phase_s.get("verify", 0.0) / max(stats.rounds, 1)
        return {"tps": (len(toks) - 1) / gen_s, "verify_ms": verify_ms,
                "tokens_per_round": stats.tokens_per_round,
                "promise": stats.exactness.get("promise"),
                "distinct_4gram_share": common.distinct_ngram_share(toks)}

    for arm in ARMS:  # warm-up: first-call compilation and allocation stay out
        decode(arm, next(iter(prompts.values())), 0)
    raw = []
    for pair in range(args.pairs):
        for name, prompt in prompts.items():
            order = ARMS if pair % 2 == 0 else tuple(reversed(ARMS))
            seed = args.seed + pair

            def measure():
                return {arm: decode(arm, prompt, seed) for arm in order}

            results = unit(f"pair {pair} {name}", measure)
            raw.append({"pair": pair, "prompt": name, **results})
            print(f"pair {pair} {name}: " + ", ".join(
                f"{a} {results[a]['tps']:.1f} tok/s" for a in ARMS), flush=True)
    return summarize(args, model, raw, probe_s, probes)


def summarize(args, model, raw, probe_s, probes) -> dict:
    ratios = [r["distribution"]["tps"] / r["byte-gate"]["tps"] for r in raw]
    arms = {a: {"tps": statistics.median(r[a]["tps"] for r in raw),
                "verify_ms": statistics.median(r[a]["verify_ms"] for r in raw),
                "tokens_per_round": statistics.median(r[a]["tokens_per_round"] for r in raw),
                "promise": raw[0][a]["promise"]} for a in ARMS}
    return {**common.record_setup(args.topic), "model": str(args.model),
            "target_dtype": str(model.target.dtype), "temperature": args.temp,
            "top_p": args.top_p, "block_size": args.block_size, "pairs": args.pairs,
            "max_tokens": args.max_tokens, "seed": args.seed, "prompts": list(args.prompts),
            "repetition_penalty": args.repetition_penalty,
            "repetition_context_size": args.repetition_context_size,
            "probe_s": probe_s, "probe_verdicts": [p.verdict for p in probes],
            "arms": arms, "ratio": statistics.median(ratios),
            "ratio_range": [min(ratios), max(ratios)],
            "distinct_4gram_share": statistics.median(
                r["distribution"]["distinct_4gram_share"] for r in raw), "raw": raw}


def render(r: dict) -> str:
    a, b = r["arms"]["byte-gate"], r["arms"]["distribution"]
    lines = common.setup_lines(r, memory=True) + [
        f"- Target: {r['model']} ({r['target_dtype']}), its MTP head",
        f"- Sampling: T={r['temperature']}, top-p {r['top_p']}, speculative sampling at block "
        f"size {r['block_size']}, seed {r['seed']} (+ pair); {r['max_tokens']} tokens per run, "
        f"EOS ignored; prompts: {', '.join(r['prompts'])}; {r['pairs']} alternating pairs",
        "- Logits processors (both arms): " + (
            f"repetition penalty {r['repetition_penalty']} over "
            f"{r['repetition_context_size']} tokens" if r.get("repetition_penalty") else "none"),
        f"- Outputs' share of distinct 4-grams (median): {r['distinct_4gram_share']:.2f}",
        "", "## Results", "",
        "| arm | probe (one-off, s) | tok/s | verify ms/round | tokens/round | promise |",
        "|---|---|---|---|---|---|",
        f"| byte-gate (probe + exact verify) | {r['probe_s']:.2f} "
        f"({', '.join(r['probe_verdicts'])}) | {a['tps']:.1f} | {a['verify_ms']:.1f} | "
        f"{a['tokens_per_round']:.2f} | {a['promise']} |",
        f"| distribution (no probe, fast verify) | 0 | {b['tps']:.1f} | {b['verify_ms']:.1f} | "
        f"{b['tokens_per_round']:.2f} | {b['promise']} |",
        "",
        f"distribution / byte-gate tok/s, per pair: median {r['ratio']:.3f}x "
        f"(range {r['ratio_range'][0]:.3f}-{r['ratio_range'][1]:.3f}). The probe's time is paid "
        f"once per loaded target (a CLI run, a server start), not per request.",
    ]
    return "\n".join(lines + common.what_it_says(r))


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.sampling_gate",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--topic", default="sampling-gate")
    p.add_argument("--temp", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--block-size", type=int, default=3)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--repetition-context-size", type=int, default=20)
    common.add_prompt_args(p)
    common.add_record_args(p, units=True)
    args = p.parse_args(argv)
    if args.temp <= 0 or args.block_size < 2 or args.pairs < 1:
        p.error("needs --temp > 0, --block-size >= 2 and --pairs >= 1")
    args.prompts = common.prompts_of(args, p)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    watch = common.watch(args)
    result = run(args, watch)
    return common.finish(args, result, watch, render, kind=None)


if __name__ == "__main__":
    main()
    sys.exit(0)
