"""MTP against mlx-lm's plain decode as the prompt grows: prefill, decode and the verify's cost
per width at each prompt length.

    python -m benchmarks.bench_long_context --model PAIR [--drafter D] --lengths 1024,4096,16384
        [--temps 0,0.6] [--block-sizes 3] [--pairs 1] [--prompts-per-length 2,2,1]
        [--max-tokens 48] [--synced-runs 1]
    python -m benchmarks.bench_long_context --render RECORD.json    # redraw, no run

Prompts are text (the project's own docs, tokenized once and cut at seeded offsets to each
length), not one repeated token; ``--prompts-per-length`` may give each length its own count, as
a long prompt's prefill dominates the run. Per length and temperature, ``bench_mtp``'s paired,
alternating arms (plain decode is mlx-lm's own ``generate_step``; idle check, several prompts;
each arm warmed up on a prompt of ``WARM_TOKENS``): MTP over plain, per-position acceptance, and
the time from the call to the first token (prefill) of both. Then per length at T=0 a synced
pass (each phase waits for its device work): the plain step and each width's verify alone, once
through the attention kernel and once one SDPA per row (``MLX_MTP_ATTENTION_KERNEL=0``),
alternating, so a cost that grows with the context shows where it comes from; beside it the KV
bytes one decode step's attention reads.
"""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path
from typing import Dict, List

import mlx_mtp  # first: binds the system BLAS before mlx.core loads
import mlx.core as mx

from benchmarks import bench_mtp, common
from mlx_mtp.decoding.responses import encode_prompt
from mlx_mtp.decoding.rounds import SYNC_PHASES_ENV
from mlx_mtp.exactness import row_attention

KERNEL, BY_ROWS = "kernel", "by rows"
WARM_TOKENS = 256  # the warm-up prompt: compiles every width without a long prefill
TEXT_FILES = ("README.md", "docs/*.md")  # the prompts' text, under the project's root
KEEP = ("rows", "raw", "classic_step_ms", "bandwidth_gbs", "target_step_floor_ms",
        "target_step_bytes")  # what a bench_mtp run keeps in this record


def corpus_ids(tokenizer) -> List[int]:
    """The project's docs, tokenized without special tokens."""
    files = sorted(p for pattern in TEXT_FILES for p in common.ROOT.glob(pattern))
    text = "\n\n".join(p.read_text() for p in files)
    return list(tokenizer.encode(text, add_special_tokens=False))


def text_prompts(tokenizer, length: int, count: int, seed: int) -> Dict[str, List[int]]:
    """``count`` prompts of ``length`` ids: the corpus from seeded offsets (wrapping past its
    end), after the BOS token where the tokenizer has one."""
    ids = corpus_ids(tokenizer)
    bos = [tokenizer.bos_token_id] if getattr(tokenizer, "bos_token_id", None) is not None else []
    rng = random.Random(seed + length)
    out = {}
    for j in range(count):
        start = rng.randrange(len(ids))
        body = (ids[start:] + ids) * (1 + (length // len(ids)))
        out[f"docs {j + 1}"] = bos + body[: length - len(bos)]
    return out


def arms_args(args, prompts: dict, temp: float, warm: List[int]) -> argparse.Namespace:
    """What ``bench_mtp.run`` reads (no synced pass: this script runs its own)."""
    return argparse.Namespace(warm_prompt=warm,
        model=args.model, drafter=args.drafter, draft_bf16=False, topic=args.topic,
        block_sizes=args.block_sizes, max_block_size=max(args.block_sizes), pairs=args.pairs,
        max_tokens=args.max_tokens, prompts=prompts, temp=temp, top_p=0.0, top_k=0,
        repetition_penalty=None, repetition_context_size=20, seed=args.seed, synced_runs=0,
        acceptance="auto")


def kv_bytes_per_row(model, length: int) -> int:
    """Bytes of K/V one decode step's attention reads from the target's caches at ``length``
    positions (a sliding window's cache: its window; recurrent states left out)."""
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model.mlx_model)
    model.mlx_model(mx.array([[1, 2]]), cache=caches)
    total = 0
    for c in caches:
        keys = getattr(c, "keys", None)
        if isinstance(keys, mx.array):
            cap = getattr(c, "max_size", None) or length
            total += 2 * keys.shape[1] * keys.shape[3] * keys.dtype.size * min(length, cap)
    return total


def verify_pass(args, prompts: dict, warm: List[int], unit) -> dict:
    """The synced pass at T=0 (see the module's doc): per mode and width the verify's ms, the
    plain step's ms, and how many verify attentions ran through the kernel / by rows."""
    model, tokenizer = mlx_mtp.load(args.model, drafter=args.drafter)
    ids = {k: encode_prompt(tokenizer, v) for k, v in prompts.items()}
    modes = [KERNEL, BY_ROWS]
    flags = {KERNEL: "1", BY_ROWS: "0"}
    stats = {m: [] for m in modes}
    steps, usage = [], {m: {"kernel": 0, "rows": 0} for m in modes}
    for bs in args.block_sizes:  # the freshly loaded model's compilations and checks
        for mode in modes:
            with common.environment(row_attention.ENV, flags[mode]):
                common.mtp_decode(model, mx.array(warm), 8, bs)
    with common.environment(SYNC_PHASES_ENV, "1"):
        for rep in range(args.synced_runs):
            for p_index, (name, prompt) in enumerate(ids.items()):
                def measure():
                    toks, _, gs = common.plain_decode(model.mlx_model, prompt, args.max_tokens)
                    out = {"step_ms": 1e3 * gs / max(len(toks) - 1, 1), "runs": []}
                    flip = (rep + p_index) % 2
                    for bs in args.block_sizes:
                        for mode in (modes[::-1] if flip else modes):
                            before = row_attention.usage()
                            with common.environment(row_attention.ENV, flags[mode]):
                                st = common.mtp_decode(model, prompt, args.max_tokens, bs)[3]
                            used = {k: n - before[k] for k, n in row_attention.usage().items()}
                            out["runs"].append((mode, st.to_dict(), used))
                    return out

                got = unit(f"synced {rep} {name}", measure)
                steps.append(got["step_ms"])
                for mode, st, used in got["runs"]:
                    stats[mode].append(st)
                    for k in used:
                        usage[mode][k] += used[k]
    step_ms = statistics.median(steps)
    kv = kv_bytes_per_row(model, len(next(iter(prompts.values()))))
    del model
    mx.clear_cache()
    rows = []
    for mode in modes:
        for w, ms in bench_mtp.verify_ms_by_width(stats[mode]).items():
            if w < 2:
                continue  # a run's last rounds, narrowed by the token budget
            rows.append({"mode": mode, "width": w, "verify_ms": ms, "over_step": ms / step_ms})
    return {"step_ms": step_ms, "kv_bytes_per_row": kv, "widths": rows, "attention": usage}


def prefill_rates(raw: dict, length: int) -> dict:
    """Median prompt tokens per second from the call to the first token: plain's and MTP's."""
    plain = [length / r["prompt_s"] for r in raw["classic"]]
    mtp = [length / r["prompt_s"] for arm, runs in raw.items() if arm != "classic"
           for r in runs]
    return {"plain_prefill_tps": statistics.median(plain),
            "mtp_prefill_tps": statistics.median(mtp)}


def run(args, watch) -> dict:
    tokenizer = _tokenizer(args)
    unit = common.idle.Watch.runner(watch)
    result = {**common.record_setup(args.topic), "model": args.model, "drafter": args.drafter,
              "lengths": args.lengths, "temps": args.temps, "block_sizes": args.block_sizes,
              "pairs": args.pairs, "prompts_per_length": args.prompts_per_length,
              "max_tokens": args.max_tokens, "synced_runs": args.synced_runs,
              "pair_info": common.pair_info(args.model), "runs": {}, "verify": {}, "rows": []}
    warm = next(iter(text_prompts(tokenizer, WARM_TOKENS, 1, args.seed + 1).values()))
    for length, count in zip(args.lengths, args.prompts_per_length):
        prompts = text_prompts(tokenizer, length, count, args.seed)
        for temp in args.temps:
            got = bench_mtp.run(arms_args(args, prompts, temp, warm), watch)
            kept = {k: got[k] for k in KEEP if k in got}
            result["runs"][f"{length}@{temp:g}"] = kept
            rates = prefill_rates(got["raw"], length)
            for row in got["rows"]:
                result["rows"].append({
                    "prompt_tokens": length, "temperature": temp,
                    "block_size": row["block_size"], "classic_tps": row["classic_tps"],
                    "mtp_tps": row["mtp_tps"], "ratio_median": row["ratio_median"],
                    "ratio_min": row["ratio_min"], "ratio_max": row["ratio_max"],
                    "acceptance": row["acceptance"],
                    "per_position_acceptance": row["per_position_acceptance"],
                    "identical_to_classic": row["identical_to_classic"],
                    "mtp_enabled": row["mtp_enabled"], **rates})
        result["verify"][str(length)] = verify_pass(args, prompts, warm, unit)
    return result


def _tokenizer(args):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(Path(args.model))


# ------------------------------------------------------------------------------ the record


def render(r: dict) -> str:
    info = r.get("pair_info", {})
    lines = common.setup_lines(r) + [
        f"- Pair: `{r['model']}`" + (f" with `{r['drafter']}`" if r.get("drafter") else "")
        + (f", {info.get('family')}, residual scale {info.get('residual_scale')}, first-draft "
           f"acceptance {info.get('first_draft_acceptance')}" if info else ""),
        f"- Prompts: the project's docs cut at seeded offsets, "
        + ", ".join(f"{c} of {n} tokens" for n, c in zip(r["lengths"], r["prompts_per_length"]))
        + f"; {r['max_tokens']} tokens "
        f"decoded; {r['pairs']} pairs; temperatures {', '.join(f'{t:g}' for t in r['temps'])}",
        "", "## Results", "",
        "| prompt tokens | T | block | plain tok/s | MTP tok/s | MTP / plain (min-max) | "
        "acceptance | per-position acceptance | identical | prefill tok/s plain / MTP |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        ident = {True: "yes", False: "NO", None: "n/a"}[row["identical_to_classic"]]
        lines.append(
            f"| {row['prompt_tokens']} | {row['temperature']:g} | {row['block_size']} | "
            f"{row['classic_tps']:.1f} | {row['mtp_tps']:.1f} | {row['ratio_median']:.2f}x "
            f"({row['ratio_min']:.2f}-{row['ratio_max']:.2f}) | {row['acceptance']:.2f} | "
            + " / ".join(f"{a:.2f}" for a in row["per_position_acceptance"])
            + f" | {ident} | {row['plain_prefill_tps']:.0f} / {row['mtp_prefill_tps']:.0f} |")
    lines += ["", "## The verify's cost by width (T=0, synced)", "",
              "| prompt tokens | KV read per decode step | plain step ms | attention | width | "
              "verify ms | verify / step | verify attentions: kernel / by rows |",
              "|---|---|---|---|---|---|---|---|"]
    for length, v in r["verify"].items():
        for w in v["widths"]:
            used = v["attention"].get(w["mode"], {})
            lines.append(
                f"| {length} | {v['kv_bytes_per_row'] / 1e6:.2f} MB | {v['step_ms']:.1f} | "
                f"{w['mode']} | {w['width']} | {w['verify_ms']:.1f} | {w['over_step']:.2f} | "
                f"{used.get('kernel', 0)} / {used.get('rows', 0)} |")
    return "\n".join(lines + common.what_it_says(r))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_long_context",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", help="the pair (benchmarks.realistic_pair), or its target")
    p.add_argument("--drafter", help="the assistant, for a Gemma 4 pair")
    p.add_argument("--topic", default="long-context")
    p.add_argument("--lengths", default="1024,4096,16384", help="prompt tokens, comma separated")
    p.add_argument("--temps", default="0,0.6", help="comma-separated temperatures")
    p.add_argument("--block-sizes", default="3", help="fixed block sizes, comma separated")
    p.add_argument("--pairs", type=int, default=1)
    p.add_argument("--prompts-per-length", default="2,2,1",
                   help="prompts at each length: one count, or one per length")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--synced-runs", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    common.add_render_arg(p)
    common.add_record_args(p, units=True)
    args = p.parse_args(argv)
    rendered = common.render_instead(args, p, render, "long_context")
    if rendered is not None:
        return rendered
    try:
        args.lengths = [int(x) for x in args.lengths.split(",")]
        args.temps = [float(t) for t in args.temps.split(",")]
        args.block_sizes = [int(b) for b in args.block_sizes.split(",")]
        counts = [int(c) for c in args.prompts_per_length.split(",")]
    except ValueError:
        p.error(f"--lengths / --temps / --block-sizes / --prompts-per-length: expected "
                f"comma-separated numbers, got {args.lengths!r} / {args.temps!r} / "
                f"{args.block_sizes!r} / {args.prompts_per_length!r}")
    if min(args.lengths) < 8 or min(args.block_sizes) < 2 or min(args.temps) < 0:
        p.error("--lengths must be 8 tokens or more, --block-sizes 2 or more, --temps >= 0")
    if len(counts) not in (1, len(args.lengths)):
        p.error(f"--prompts-per-length: one count or one per length ({len(args.lengths)}), "
                f"got {len(counts)}")
    args.prompts_per_length = counts * len(args.lengths) if len(counts) == 1 else counts
    if min(args.pairs, *args.prompts_per_length, args.synced_runs) < 1 or args.max_tokens < 2:
        p.error("--pairs, --prompts-per-length and --synced-runs must be >= 1, --max-tokens >= 2")
    watch = common.watch(args)
    return common.finish(args, run(args, watch), watch, render, "long_context")


if __name__ == "__main__":
    main()
