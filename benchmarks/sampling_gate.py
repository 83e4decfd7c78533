"""What sampling saves by promising the distribution instead of the bytes.

    python -m benchmarks.sampling_gate --model PATH [--temp 0.6 --block-size 3 --pairs 3
        --max-tokens 128] [--repetition-penalty R] [record flags]
    python -m benchmarks.sampling_gate --render RECORD.json --summary "..."  # no run

At temperature > 0 the gate runs no probe, and the verify takes the kernels its device kind
measured faster (``mlx_mtp.exactness.gate``). This measures that choice on one target, idle and
alternating:
- ``byte-gate``: a sampled session gated like a T=0 one: the probe (its one-off cost, timed on
  the loaded target before anything is memoized) and the verify with the row-exact products;
- ``distribution``: the default: no probe, the device kind's verify (on the CPU the row-exact
  products);
- ``plain-verify``: no probe, the plain multi-row products (``MLX_MTP_ROW_EXACT=0``; what a GPU
  kind's sampled verify runs).
Arms alternate per prompt and pair; each is seeded alike (speculative sampling at a fixed block
size). The record gives tok/s per arm, the default's per-pair ratio to each other arm, and the
verify's ms per round.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import mlx_mtp  # noqa: F401  (first: binds the system BLAS before mlx.core loads)
import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from benchmarks import common
from mlx_mtp.decoding.sampling import make_sampler
from mlx_mtp.exactness import gate
from mlx_mtp.exactness.block_vs_chain import probe_exactness
from mlx_mtp.decoding.responses import encode_prompt

ARMS = ("byte-gate", "distribution", "plain-verify")


def arm_context(arm: str):
    if arm == "byte-gate":
        return gated_like_t0()
    if arm == "plain-verify":  # the session's verify without row-exact products
        return common.environment(gate.ROW_EXACT_ENV, "0")
    return contextlib.nullcontext()


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
        with arm_context(arm):
            toks, _, gen_s, stats = common.mtp_decode(model, prompt, args.max_tokens,
                                                      args.block_size, sampler,
                                                      "speculative-sampling", seed,
                                                      processors=processors)
        verify_ms = 1e3 * stats.phase_s.get("verify", 0.0) / max(stats.rounds, 1)
        return {"tps": (len(toks) - 1) / gen_s, "verify_ms": verify_ms,
                "tokens_per_round": stats.tokens_per_round,
                "promise": stats.exactness.get("promise"),
                "row_exact_verify": model.target.exact,
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
    ratios = {other: [r["distribution"]["tps"] / r[other]["tps"] for r in raw]
              for other in ("byte-gate", "plain-verify")}
    arms = {a: {"tps": statistics.median(r[a]["tps"] for r in raw),
                "verify_ms": statistics.median(r[a]["verify_ms"] for r in raw),
                "tokens_per_round": statistics.median(r[a]["tokens_per_round"] for r in raw),
                "promise": raw[0][a]["promise"],
                "row_exact_verify": raw[0][a]["row_exact_verify"]} for a in ARMS}
    return {**common.record_setup(args.topic), "model": str(args.model),
            "target_dtype": str(model.target.dtype), "temperature": args.temp,
            "top_p": args.top_p, "block_size": args.block_size, "pairs": args.pairs,
            "max_tokens": args.max_tokens, "seed": args.seed, "prompts": list(args.prompts),
            "repetition_penalty": args.repetition_penalty,
            "repetition_context_size": args.repetition_context_size,
            "probe_s": probe_s, "probe_verdicts": [p.verdict for p in probes],
            "arms": arms,
            "ratios": {other: {"median": statistics.median(v), "range": [min(v), max(v)]}
                       for other, v in ratios.items()},
            "distinct_4gram_share": statistics.median(
                r["distribution"]["distinct_4gram_share"] for r in raw), "raw": raw}


ARM_TITLES = {"byte-gate": "byte-gate (probe + row-exact verify)",
              "distribution": "distribution (the default: no probe, this device's verify)",
              "plain-verify": "plain-verify (no probe, plain multi-row verify)"}


def render(r: dict) -> str:
    lines = common.setup_lines(r, memory=True) + [
        f"- Target: {r['model']} ({r['target_dtype']}), its MTP head",
        f"- Sampling: T={r['temperature']}, top-p {r['top_p']}, speculative sampling at block "
        f"size {r['block_size']}, seed {r['seed']} (+ pair); {r['max_tokens']} tokens per run, "
        f"EOS ignored; prompts: {', '.join(r['prompts'])}; {r['pairs']} alternating pairs",
        "- Logits processors (all arms): " + (
            f"repetition penalty {r['repetition_penalty']} over "
            f"{r['repetition_context_size']} tokens" if r.get("repetition_penalty") else "none"),
        f"- Outputs' share of distinct 4-grams (median): {r['distinct_4gram_share']:.2f}",
        "", "## Results", "",
        "| arm | probe (one-off, s) | tok/s | verify ms/round | tokens/round | promise | "
        "row-exact products |",
        "|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        a = r["arms"][arm]
        probe = (f"{r['probe_s']:.2f} ({', '.join(r['probe_verdicts'])})" if arm == "byte-gate"
                 else "0")
        lines.append(f"| {ARM_TITLES[arm]} | {probe} | {a['tps']:.1f} | {a['verify_ms']:.1f} | "
                     f"{a['tokens_per_round']:.2f} | {a['promise']} | "
                     f"{'yes' if a['row_exact_verify'] else 'no'} |")
    lines.append("")
    for other, q in r["ratios"].items():
        lines.append(f"- distribution / {other} tok/s, per pair: median {q['median']:.3f}x "
                     f"(range {q['range'][0]:.3f}-{q['range'][1]:.3f})")
    lines += ["", "The probe's time is paid once per loaded target (a CLI run, a server start), "
              "not per request."]
    return "\n".join(lines + common.what_it_says(r))


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.sampling_gate",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", help="the target (required unless --render)")
    p.add_argument("--render", type=Path, metavar="RECORD.json",
                   help="no run: rewrite this record's .md from its JSON (with --summary: "
                        "store that first)")
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
    if args.render is None and not args.model:
        p.error("--model is required (or --render RECORD.json)")
    if args.temp <= 0 or args.block_size < 2 or args.pairs < 1:
        p.error("needs --temp > 0, --block-size >= 2 and --pairs >= 1")
    args.prompts = common.prompts_of(args, p)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.render is not None:
        return common.rerender_record(args.render, render, None, args.summary)
    watch = common.watch(args)
    result = run(args, watch)
    return common.finish(args, result, watch, render, kind=None)


if __name__ == "__main__":
    main()
    sys.exit(0)
