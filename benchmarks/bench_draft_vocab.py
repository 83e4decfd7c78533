"""Reduced draft vocabularies against the full LM head: acceptance lost against drafting saved.

Protocol (docs/benchmarks.md): plain decode and every arm in one process, each warmed up once, a
fixed token budget with EOS ignored, several prompts, temperature 0, arms alternating pair by
pair. An arm is a block size and a draft vocabulary: the full head (``full``) or one sidecar of
``--draft-vocabs``, all drafting with the pair's own head weights. Per arm: the median tok/s and
its ratio to plain decode and to the full head at the same block size, acceptance per position,
tokens per round, the share of plain decode's tokens that lie in the vocabulary (what a draft can
propose at all) and the sidecar's share of its calibration corpus, the bytes of LM-head rows one
draft step reads; after the pairs, ``--synced-runs`` runs per prompt and arm with every phase
synced give the draft phase's and the accept hook's own ms per round. Writes
benchmark_results/<topic>-<host>-<date>.md and .json and the record's pictures.

    python -m benchmarks.bench_draft_vocab --model PAIR --draft-vocabs V/8192 V/32768 \\
        --block-sizes 3,4
    python -m benchmarks.bench_draft_vocab --render RECORD.json    # redraw a record's pictures

A pair with real token statistics and its sidecars: ``benchmarks.realistic_pair --zipf 1`` and
``benchmarks.realistic_zipf``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import mlx_mtp  # first: binds the system BLAS before mlx.core loads

from benchmarks import common
from benchmarks.common import PLAIN, mtp_decode, plain_decode
from mlx_mtp.decoding.responses import encode_prompt
from mlx_mtp.models.model import MTPModel
from mlx_mtp.models.qwen3_5 import vocab_reduction
from mlx_mtp.models.qwen3_5.drafter import QwenMTPDrafter

FULL = "full"


def arm_name(block_size: int, vocab: str) -> str:
    return f"{block_size}/{vocab}"


def make_models(base, tokenizer, folders) -> dict:
    """vocabulary name -> (MTPModel drafting over it, its sidecar's metadata or None)."""
    drafter = base.drafter
    if not isinstance(drafter, QwenMTPDrafter):
        raise SystemExit("error: --model: draft vocabularies are for a Qwen MTP head; this pair "
                         f"drafts with {type(drafter).__name__}")
    models = {FULL: (MTPModel(base.mlx_model, base.target,
                              QwenMTPDrafter(drafter.head, base.target, drafter.options)), None)}
    for folder in folders:
        ids = vocab_reduction.load_ids(folder, tokenizer, base.target)
        if ids is None:
            raise SystemExit(f"error: --draft-vocabs: {folder} is not a draft vocabulary of this "
                             f"pair (see the warning above)")
        meta = json.loads((Path(folder) / vocab_reduction.META_FILE).read_text())
        name = str(meta["size"])
        if name in models:
            raise SystemExit(f"error: --draft-vocabs: two sidecars of {name} ids")
        models[name] = (MTPModel(base.mlx_model, base.target,
                                 QwenMTPDrafter(drafter.head, base.target, drafter.options, ids)),
                        {**meta, "folder": str(folder)})
    return models


def run(args, watch=None) -> dict:
    base, tokenizer = mlx_mtp.load(args.model)
    models = make_models(base, tokenizer, args.draft_vocabs)
    arms = [(b, v) for b in args.block_sizes for v in models]
    prompts = {k: encode_prompt(tokenizer, v) for k, v in args.prompts.items()}
    n = args.max_tokens
    warm = next(iter(prompts.values()))
    plain_decode(base.mlx_model, warm, 8)
    for b, v in arms:
        mtp_decode(models[v][0], warm, 8, b)
    unit = common.idle.Watch.runner(watch)
    decoders = {arm_name(b, v): (lambda prompt, b=b, v=v: mtp_decode(models[v][0], prompt, n, b))
                for b, v in arms}
    raw, exact, plain_tokens = common.paired_runs(
        prompts, decoders, args.pairs, unit, lambda prompt: plain_decode(base.mlx_model, prompt, n))
    synced = common.synced_runs(prompts, decoders, args.synced_runs, unit)
    return summarize(args, models, arms, raw, exact, synced, plain_tokens)


def _median(xs):
    xs = list(xs)
    return statistics.median(xs) if xs else 0.0


def summarize(args, models, arms, raw, exact, synced, plain_tokens) -> dict:
    plain = {(r["pair"], r["prompt"]): r["tps"] for r in raw[PLAIN]}
    text = [t for toks in plain_tokens.values() for t in toks]
    rows = []
    for b, v in arms:
        name = arm_name(b, v)
        runs = raw[name]
        stats = [r["stats"] for r in runs]
        full = {(r["pair"], r["prompt"]): r["tps"] for r in raw[arm_name(b, FULL)]}
        mine = [s["stats"] for s in synced if s["arm"] == name]
        rounds = sum(st["rounds"] for st in mine)
        split = ({p: sum(st["phase_ms"][p] for st in mine) / rounds for p in mine[0]["phase_ms"]}
                 if rounds else {})
        drafted = sum(st["drafted"] for st in stats)
        model, meta = models[v]
        lm = model.drafter.lm
        ids = None if lm.ids is None else set(int(i) for i in lm.ids.tolist())
        depth = b - 1
        rows.append({
            "arm": name, "block_size": b, "vocab": v,
            "vocab_size": len(ids) if ids is not None else model.target.vocab_size,
            "tps": _median(r["tps"] for r in runs),
            "ratio_vs_plain": _median(r["tps"] / plain[(r["pair"], r["prompt"])] for r in runs),
            "ratio_range": [min(r["tps"] / plain[(r["pair"], r["prompt"])] for r in runs),
                            max(r["tps"] / plain[(r["pair"], r["prompt"])] for r in runs)],
            "ratio_vs_full": _median(r["tps"] / full[(r["pair"], r["prompt"])] for r in runs),
            "acceptance": sum(st["accepted"] for st in stats) / drafted if drafted else 0.0,
            "per_position_acceptance": [
                _median(st["per_position_acceptance"][j] for st in stats
                        if len(st["per_position_acceptance"]) > j) for j in range(depth)],
            "tokens_per_round": _median(st["tokens_per_round"] for st in stats),
            # what a draft can propose at all: plain decode's tokens inside the vocabulary
            "text_coverage": (1.0 if ids is None else
                              sum(t in ids for t in text) / len(text) if text else 0.0),
            "corpus_coverage": None if meta is None else meta.get("coverage"),
            "lm_head_bytes": lm.tensors.nbytes,
            "draft_ms_per_round": split.get("draft", 0.0),
            "accept_ms_per_round": split.get("accept", 0.0),
            "round_ms": split,
            "identical": exact[name],
        })
    return {**common.record_setup(args.topic), "model": args.model,
            "draft_vocabs": {v: meta for v, (_, meta) in models.items() if meta is not None},
            "prompts": args.prompts, "max_tokens": args.max_tokens, "pairs": args.pairs,
            "synced_runs": args.synced_runs, "block_sizes": args.block_sizes,
            "plain_tps": _median(r["tps"] for r in raw[PLAIN]),
            "distinct_4gram_share": {name: _median(r["distinct_4gram_share"] or 0.0
                                                   for r in raw[PLAIN] if r["prompt"] == name)
                                     for name in args.prompts},
            "rows": rows, "raw": raw}


def render(r: dict) -> str:
    lines = common.setup_lines(r)
    lines += [f"- Model: `{r['model']}`",
              f"- Prompts: {', '.join(r['prompts'])}; {r['max_tokens']} tokens each, EOS "
              f"ignored, T=0; {r['pairs']} pairs of alternating arms; {r['synced_runs']} synced "
              f"run(s) per prompt and arm for the draft phase's and accept hook's own cost",
              "- Distinct 4-gram share of plain decode's output per prompt (1.0: no loop): "
              + ", ".join(f"{k} {v:.2f}" for k, v in r["distinct_4gram_share"].items())]
    for v, meta in r["draft_vocabs"].items():
        corpus = meta.get("corpus")
        lines.append(f"- Draft vocabulary {v}: `{meta['folder']}`, "
                     f"{100 * meta['coverage']:.1f}% of its {meta['corpus_tokens']}-token "
                     f"calibration corpus ({json.dumps(corpus)})")
    lines += ["", "## Results", "",
              f"Plain decode: {r['plain_tps']:.1f} tok/s (median over pairs and prompts).", "",
              "| arm | tok/s | vs plain (min-max) | vs full head | acceptance per position | "
              "tokens/round | plain text in vocabulary | LM-head rows MB | draft ms/round "
              "(synced) | accept ms/round (synced) | identical |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        lo, hi = row["ratio_range"]
        lines.append(
            f"| {row['arm']} | {row['tps']:.1f} | {row['ratio_vs_plain']:.2f}x "
            f"({lo:.2f}-{hi:.2f}) | {row['ratio_vs_full']:.2f}x | "
            + " / ".join(f"{a:.2f}" for a in row["per_position_acceptance"])
            + f" | {row['tokens_per_round']:.2f} | {100 * row['text_coverage']:.1f}% | "
            f"{row['lm_head_bytes'] / 1e6:.0f} | {row['draft_ms_per_round']:.1f} | "
            f"{row['accept_ms_per_round']:.1f} | {'yes' if row['identical'] else 'NO'} |")
    lines += ["", "An arm `B/V` drafts blocks of B (B - 1 drafts a round) over the vocabulary V "
              "(`full`: the whole LM head). Plain text in vocabulary: the share of plain "
              "decode's tokens (all prompts) that lie in V, the most a draft over V can match."]
    return "\n".join(lines + common.what_it_says(r))


def main(argv=None):
    p = argparse.ArgumentParser(description="reduced draft vocabularies vs the full LM head")
    p.add_argument("--model", help="a Qwen3.5 pair with its MTP head (required unless --render)")
    p.add_argument("--draft-vocabs", nargs="+", type=Path, default=[],
                   help="draft vocabulary sidecar folders (one arm per block size each)")
    p.add_argument("--topic", default="draft-vocab")
    p.add_argument("--block-sizes", default="4", help="comma-separated block sizes")
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--synced-runs", type=int, default=1)
    common.add_prompt_args(p)
    common.add_render_arg(p)
    common.add_record_args(p, units=True)
    args = p.parse_args(argv)
    rendered = common.render_instead(args, p, render, "draft_vocab")
    if rendered is not None:
        return rendered
    args.block_sizes = common.int_list(p, "--block-sizes", args.block_sizes)
    if any(b < 2 for b in args.block_sizes):
        p.error(f"--block-sizes: every block size must be >= 2 (one draft), got "
                f"{args.block_sizes}")
    if not args.draft_vocabs:
        p.error("--draft-vocabs: at least one sidecar folder is required")
    args.prompts = common.prompts_of(args, p)
    if args.pairs < 1 or args.max_tokens < 2 or args.synced_runs < 0:
        p.error("--pairs >= 1, --max-tokens >= 2 and --synced-runs >= 0 are required")
    watch = common.watch(args)
    return common.finish(args, run(args, watch), watch, render, "draft_vocab")


if __name__ == "__main__":
    main()
