"""Draft trees against chains and plain decode, paired and alternating.

Protocol (docs/benchmarks.md): every arm in one process, each warmed up once, a fixed token
budget with EOS ignored, several prompts, temperature 0; per arm the median of the per-pair tok/s
and its ratio to plain decode, tokens per round, verified nodes per round, accepted nodes by
sibling rank, and each prompt's share of distinct 4-grams (a loop lifts acceptance far above what
the pair does on text). After the pairs, ``--synced-runs`` runs per prompt and arm with every
phase synced give the verify's own ms per round and per verified node. Writes
benchmark_results/<topic>-<host>-<date>.md and .json and the record's pictures.

    python -m benchmarks.bench_trees --model PATH --arms 3,4,3t2x4,4t2x6 --pairs 3
    python -m benchmarks.bench_trees --render RECORD.json    # redraw a record's pictures

An arm is a chain block size (``3``), a tree ``BtKxN`` (block size B, the depth plus one,
``--draft-topk`` K and ``--draft-tokens`` N), ``auto`` (chain widths chosen per round, up to 6),
or ``autotK`` (``auto`` with ``--draft-topk`` K: a chain or a tree per round).
"""

from __future__ import annotations

import argparse
import re
import statistics
from dataclasses import dataclass
from typing import Optional, Union

import mlx_mtp  # first: binds the system BLAS before mlx.core loads

from benchmarks import common
from benchmarks.common import PLAIN, mtp_decode, plain_decode
from mlx_mtp.decoding.responses import encode_prompt

AUTO = "auto"
MAX_WIDTH = 6  # the widest block of an auto arm (its --max-block-size)


@dataclass(frozen=True)
class Arm:
    block_size: Union[int, str]  # or "auto"
    topk: int = 1
    nodes: Optional[int] = None

    @property
    def name(self) -> str:
        if self.topk == 1:
            return str(self.block_size)
        return f"{self.block_size}t{self.topk}" + ("" if self.nodes is None else f"x{self.nodes}")

    @property
    def depth(self) -> int:
        return (MAX_WIDTH if self.block_size == AUTO else self.block_size) - 1

    @classmethod
    def parse(cls, text: str) -> "Arm":
        m = re.fullmatch(r"(\d+|auto)(?:t(\d+)(?:x(\d+))?)?", text.strip())
        if not m or (m.group(1) != AUTO and m.group(2) and not m.group(3)):
            raise ValueError(f"expected a block size (3), a tree BtKxN (4t2x6), auto or autotK "
                             f"(autot2), got {text!r}")
        b, k, n = m.groups()
        b = b if b == AUTO else int(b)
        return cls(b) if k is None else cls(b, int(k), None if n is None else int(n))

    def decode(self, model, prompt, n: int):
        return mtp_decode(model, prompt, n, self.block_size, draft_topk=self.topk,
                          draft_tokens=self.nodes, max_block_size=MAX_WIDTH)


def run(args, watch=None) -> dict:
    model, tokenizer = mlx_mtp.load(args.model, drafter=args.drafter)
    prompts = {k: encode_prompt(tokenizer, v) for k, v in args.prompts.items()}
    n = args.max_tokens
    warm = next(iter(prompts.values()))
    plain_decode(model.mlx_model, warm, 8)
    for arm in args.arms:
        arm.decode(model, warm, 8)
    unit = common.idle.Watch.runner(watch)
    arms = {arm.name: (lambda prompt, arm=arm: arm.decode(model, prompt, n)) for arm in args.arms}
    raw, exact, _ = common.paired_runs(prompts, arms, args.pairs, unit,
                                       lambda prompt: plain_decode(model.mlx_model, prompt, n))
    synced = common.synced_runs(prompts, arms, args.synced_runs, unit)
    return summarize(args, raw, exact, synced)


def _median(xs):
    return statistics.median(xs) if xs else 0.0


def summarize(args, raw: dict, exact: dict, synced: list) -> dict:
    plain = _median([r["tps"] for r in raw[PLAIN]])
    rows = []
    for arm in args.arms:
        runs = raw[arm.name]
        stats = [r["stats"] for r in runs]
        ratios = [r["tps"] / p["tps"] for r, p in zip(runs, raw[PLAIN])]
        mine = [s["stats"] for s in synced if s["arm"] == arm.name]
        verify = [(ms, n) for st in mine for w, ms in st["verify_ms_by_width"].items()
                  for n in [st["verify_rounds_by_width"][w]] if int(w) > 1]
        rounds = sum(n for _, n in verify)
        verify_ms = sum(ms * n for ms, n in verify) / rounds if rounds else 0.0
        nodes = _median([st["tree_nodes_per_round"] if arm.topk > 1
                         else (st["drafted"] / st["rounds"] if st["rounds"] else 0.0)
                         for st in stats])
        ranks = [sum(x) for x in zip(*[st["accepted_by_sibling_rank"] for st in stats
                                       if st["accepted_by_sibling_rank"]])]
        rows.append({
            "arm": arm.name, "block_size": arm.block_size, "topk": arm.topk,
            "draft_tokens": arm.nodes, "tps": _median([r["tps"] for r in runs]),
            "ratio_vs_plain": _median(ratios), "ratio_range": [min(ratios), max(ratios)],
            "tokens_per_round": _median([st["tokens_per_round"] for st in stats]),
            "nodes_per_round": nodes,
            "accepted_by_sibling_rank": ranks,
            "per_depth_acceptance": [
                _median([st["per_position_acceptance"][j] for st in stats
                         if len(st["per_position_acceptance"]) > j])
                for j in range(arm.depth)],
            "tree_rounds": _median([st["tree_rounds"] / st["rounds"] if st["rounds"] else 0.0
                                    for st in stats]),
            "verify_ms_synced": verify_ms,
            "verify_ms_per_node": verify_ms / (nodes + 1) if nodes else 0.0,
            "identical": exact[arm.name],
        })
    return {**common.record_setup(args.topic), "model": args.model, "drafter": args.drafter,
            "prompts": args.prompts, "max_tokens": args.max_tokens, "pairs": args.pairs,
            "synced_runs": args.synced_runs, "plain_tps": plain,
            "distinct_4gram_share": {name: _median([r["distinct_4gram_share"] or 0.0
                                                   for r in raw[PLAIN] if r["prompt"] == name])
                                     for name in args.prompts},
            "rows": rows, "raw": raw}


def render(r: dict) -> str:
    lines = common.setup_lines(r)
    lines += [f"- Model: `{r['model']}`" + (f", drafter `{r['drafter']}`" if r["drafter"] else ""),
              f"- Prompts: {', '.join(r['prompts'])}; {r['max_tokens']} tokens each, EOS "
              f"ignored, T=0; {r['pairs']} pairs of alternating arms; "
              f"{r['synced_runs']} synced run(s) per prompt and arm for the verify's own cost",
              "- Distinct 4-gram share of plain decode's output per prompt (1.0: no loop): "
              + ", ".join(f"{k} {v:.2f}" for k, v in r["distinct_4gram_share"].items()),
              "", "## Results", "",
              f"Plain decode: {r['plain_tps']:.1f} tok/s (median over pairs and prompts).", "",
              "| arm | tok/s | vs plain (min-max) | tokens/round | nodes/round | tree rounds | "
              "per-depth acceptance | accepted by sibling rank | verify ms (synced) | ms per node "
              "| identical |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        lo, hi = row["ratio_range"]
        lines.append(
            f"| {row['arm']} | {row['tps']:.1f} | {row['ratio_vs_plain']:.2f}x ({lo:.2f}-{hi:.2f}) "
            f"| {row['tokens_per_round']:.2f} | {row['nodes_per_round']:.2f} | "
            f"{row.get('tree_rounds', 0.0):.2f} | "
            + " / ".join(f"{a:.2f}" for a in row["per_depth_acceptance"])
            + f" | {', '.join(map(str, row['accepted_by_sibling_rank'])) or '-'} | "
            f"{row['verify_ms_synced']:.1f} | {row['verify_ms_per_node']:.1f} | "
            f"{'yes' if row['identical'] else 'NO'} |")
    lines += ["", "An arm `BtKxN` drafts trees of depth B - 1 with K children per expanded node "
              "and at most N nodes; an arm `B` drafts chains of B - 1; `auto` chooses chain "
              f"widths up to {MAX_WIDTH}, and `autotK` each round a chain or a tree with K "
              "children (tree rounds: the median share of its rounds that drafted a tree). Nodes "
              "per round: drafted nodes verified with the bonus (a tree arm's: per tree round). "
              "ms per node: the synced verify over its nodes and root."]
    return "\n".join(lines + common.what_it_says(r))


def main(argv=None):
    p = argparse.ArgumentParser(description="draft trees vs chains vs plain decode")
    p.add_argument("--model", help="the target (required unless --render)")
    p.add_argument("--drafter")
    p.add_argument("--topic", default="trees")
    p.add_argument("--arms", default="3,4,3t2x4,4t2x6",
                   help="comma-separated: chain block sizes, trees BtKxN, auto, autotK")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--synced-runs", type=int, default=1)
    common.add_prompt_args(p)
    common.add_render_arg(p)
    common.add_record_args(p, units=True)
    args = p.parse_args(argv)
    rendered = common.render_instead(args, p, render, "trees")
    if rendered is not None:
        return rendered
    try:
        args.arms = [Arm.parse(a) for a in args.arms.split(",")]
    except ValueError as e:
        p.error(f"--arms: {e}")
    args.prompts = common.prompts_of(args, p)
    if args.pairs < 1 or args.max_tokens < 2 or args.synced_runs < 0:
        p.error("--pairs >= 1, --max-tokens >= 2 and --synced-runs >= 0 are required")
    watch = common.watch(args)
    return common.finish(args, run(args, watch), watch, render, "trees")


if __name__ == "__main__":
    main()
