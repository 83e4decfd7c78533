"""Batched rounds under ``auto`` against every fixed draft count, in one process.

    python -m benchmarks.bench_batch_counts --model PATH --sizes 4,8 --max-tokens 64 --pairs 2
    python -m benchmarks.bench_batch_counts --render RECORD.json --summary "..."   # no run

For each batch size C the arms are: ``auto`` (the batch's own chooser,
``mlx_mtp.decoding.batch_chooser``), ``own choosers`` (each sequence's chooser choosing as if the
round were its own: ``BatchRounds.chooser`` set to None), and ``k drafts`` for k = 0..K (every
sequence drafts k, through the same batch as ``auto`` with its choice fixed). Each arm keeps one
``BatchRounds`` across its runs, as the server keeps its batch, so ``auto``'s measurements carry
over. A run starts C sequences on different prompts (``bench_concurrency``'s) and decodes each
to its budget, T=0: tokens over the run's wall time, prefill included, and the rounds alone: the
tokens after the joins (each prompt prefilled, its first token drawn) over the time after them. The first pass warms every
arm and is not counted; then ``--pairs`` passes, the arms' order reversed every other pass.
Every arm's tokens are compared with the ``0 drafts`` arm's (plain batched decode). Writes
benchmark_results/<topic>-<host>-<date>.md and .json.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx_mtp  # noqa: F401  (first: binds the system BLAS before mlx.core loads)
import mlx.core as mx

from benchmarks import common
from benchmarks.bench_concurrency import prompts_for
from mlx_mtp.decoding.batch_chooser import BatchChooser
from mlx_mtp.decoding.batch_rounds import BatchRounds
from mlx_mtp.models.loader import load

AUTO, OWN = "auto", "own choosers"


class FixedCount(BatchChooser):
    """The batch's chooser with its choice fixed: every sequence drafts ``drafts``."""

    def __init__(self, max_drafts: int, drafts: int):
        super().__init__(max_drafts)
        self.drafts = drafts

    def choose(self, size: int) -> int:
        return self.drafts


def arm_name(k: int) -> str:
    return f"{k} draft" if k == 1 else f"{k} drafts"


def make_batch(model, size: int, arm: str, max_block_size: int) -> BatchRounds:
    batch = BatchRounds(model, size, block_size="auto", max_block_size=max_block_size)
    if arm == OWN:
        batch.chooser = None
    elif arm != AUTO:
        batch.chooser = FixedCount(max_block_size - 1, int(arm.split()[0]))
    return batch


def run(batch: BatchRounds, prompts, max_tokens: int):
    """Every prompt decoded to its budget in ``batch``: ``(tokens per sequence, seconds, seconds
    of the joins)``: the joins prefill each prompt and draw its first token."""
    t0 = time.perf_counter()
    seqs = [batch.start(p, max_tokens=max_tokens) for p in prompts]
    joined = time.perf_counter() - t0
    readers = [batch.tokens(s) for s in seqs]
    out = [[] for _ in seqs]
    live = list(range(len(seqs)))
    while live:
        for i in list(live):
            item = next(readers[i], None)
            if item is None:
                live.remove(i)
            else:
                out[i].append(item[0])
    return out, time.perf_counter() - t0, joined


def measure(model, tokenizer, sizes, max_tokens: int, pairs: int, max_block_size: int) -> dict:
    arms = [AUTO, OWN] + [arm_name(k) for k in range(max_block_size)]
    raw = {}
    for size in sizes:
        prompts = [mx.array(tokenizer.encode(p)) for p in prompts_for(size)]
        batches = {arm: make_batch(model, size, arm, max_block_size) for arm in arms}
        texts = {}
        for arm in arms:  # warm-up pass, not counted
            texts[arm], _, _ = run(batches[arm], prompts, max_tokens)
        runs = {arm: [] for arm in arms}
        rounds = {arm: [] for arm in arms}  # tokens after the joins over the rounds' time
        joins = {arm: [] for arm in arms}
        for i in range(pairs):
            for arm in (arms if i % 2 == 0 else arms[::-1]):
                out, seconds, joined = run(batches[arm], prompts, max_tokens)
                runs[arm].append(sum(map(len, out)) / seconds)
                rounds[arm].append((sum(map(len, out)) - len(out)) / (seconds - joined))
                joins[arm].append(joined / seconds)
                texts[arm] = texts[arm] if out == texts[arm] else None
        plain = texts[arm_name(0)]
        raw[str(size)] = {
            arm: {"tps": runs[arm], "rounds_tps": rounds[arm], "join_share": joins[arm],
                  "identical": texts[arm] is not None and texts[arm] == plain}
            for arm in arms}
        raw[str(size)]["auto_choice"] = batches[AUTO].chooser.best.get(size)
    return {"arms": arms, "raw": raw}


def render(r: dict) -> str:
    lines = common.setup_lines(r) + [
        f"- Model: {r['model']}; T=0; {r['max_tokens']} tokens per sequence; sizes "
        f"{', '.join(map(str, r['sizes']))}; {r['pairs']} counted passes per arm after a warm-up "
        "pass, the arms' order reversed every other pass; each arm one BatchRounds across its "
        "runs", "", "## Tokens per second (medians over the passes)", "",
        "Rounds only: the tokens after the joins over the time after them (the joins prefill "
        "every prompt and draw its first token; their share of the run's time is given).", "",
        "| size | arm | tok/s | vs auto | rounds only tok/s | rounds only vs 0 drafts "
        "| joins' share of the time | identical to plain batched decode |",
        "|---|---|---|---|---|---|---|---|"]
    for size in r["sizes"]:
        got = r["raw"][str(size)]
        auto = statistics.median(got[AUTO]["tps"])
        plain = got.get(arm_name(0), {}).get("rounds_tps")
        for arm in r["arms"]:
            tps = statistics.median(got[arm]["tps"])
            if "rounds_tps" in got[arm]:  # (records taken before rounds were timed apart)
                rounds = statistics.median(got[arm]["rounds_tps"])
                extra = (f"{rounds:.2f} | {rounds / statistics.median(plain):.3f} | "
                         f"{statistics.median(got[arm]['join_share']):.2f}")
            else:
                extra = "- | - | -"
            lines.append(f"| {size} | {arm} | {tps:.2f} | {tps / auto:.3f} | {extra} | "
                         f"{'yes' if got[arm]['identical'] else 'NO'} |")
    lines += ["", "## Auto against the best fixed count", "",
              "| size | auto's choice | best fixed count | auto / best fixed | auto / own choosers |",
              "|---|---|---|---|---|"]
    for size in r["sizes"]:
        got = r["raw"][str(size)]
        med = {arm: statistics.median(got[arm]["tps"]) for arm in r["arms"]}
        fixed = [a for a in r["arms"] if a not in (AUTO, OWN)]
        best = max(fixed, key=med.get)
        lines.append(f"| {size} | {got['auto_choice']} drafts | {best} | "
                     f"{med[AUTO] / med[best]:.3f} | {med[AUTO] / med[OWN]:.3f} |")
    lines += common.what_it_says(r)
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="target folder with its MTP head (required unless --render)")
    p.add_argument("--sizes", default="4,8", help="batch sizes, comma separated")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--pairs", type=int, default=2, help="counted passes per arm")
    p.add_argument("--max-block-size", type=int, default=6)
    p.add_argument("--topic", default="batch-counts-realistic-pair")
    common.add_render_arg(p)
    common.add_record_args(p)
    args = p.parse_args(argv)
    rendered = common.render_instead(args, p, render, None)
    if rendered is not None:
        return rendered
    sizes = [int(x) for x in args.sizes.split(",")]
    if min(sizes) < 2 or args.pairs < 1:
        p.error("--sizes must be 2 or more sequences, --pairs at least 1")
    model, tokenizer = load(args.model)
    watch = common.watch(args)
    measured = measure(model, tokenizer, sizes, args.max_tokens, args.pairs,
                       args.max_block_size)
    result = common.record_setup(args.topic)
    result.update(model=args.model, sizes=sizes, max_tokens=args.max_tokens, pairs=args.pairs,
                  max_block_size=args.max_block_size, **measured)
    return common.finish(args, result, watch, render, None)


if __name__ == "__main__":
    main()
