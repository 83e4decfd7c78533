"""Where a hybrid Qwen target's verify time goes, by op, at each width, against its weights' read.

For widths 1 (the decode step, through the verify's own pieces) to ``--max-width``, every
repetition verifies the same tokens from copies of the same prefilled caches, twice per width:
  whole  the verify as the round loop runs it (one evaluation at the end): its wall time;
  split  the same verify with an evaluation barrier around every decoder layer, the
         GatedDeltaNet mixer (conv and recurrence, ``gdn_block.capture_mixer``), the
         attention over the cache (the attention kernel's one pass for all rows, or each row's
         SDPA) and the LM head, so each op's time is its own. The barriers cost time of
         their own: the split's sum is reported beside ``whole``.
Categories: ``gdn_layers`` (the GatedDeltaNet decoder layers without their mixer: projections,
MLP, norms), ``gdn_mixer``, ``attention_layers`` (the attention decoder layers without their
attention over the cache), ``sdpa`` (that attention), ``lm_head`` (final norm and LM head).
Each category's floor is the bytes of the weights it reads over the bandwidth measured in the
same run; its time over the floor says whether it is bound by reading its weights (near 1) or
by something that grows with the rows.
Medians over ``--reps`` repetitions. Writes a record and a picture (the split per width).

    python -m benchmarks.verify_ops --model PAIR [--max-width 6] [--reps 8]
    python -m benchmarks.verify_ops --render RECORD.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

import mlx_mtp  # first: binds the system BLAS before mlx.core loads
import mlx.core as mx
from mlx.utils import tree_flatten

from benchmarks import common
from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.exactness.block_vs_chain import arm_caches, prefilled_caches
from mlx_mtp.models.qwen3_5 import compiled_layers
from mlx_mtp.models.qwen3_5 import target as qwen_target

CATEGORIES = ("gdn_layers", "gdn_mixer", "attention_layers", "sdpa", "lm_head")


class Split:
    """Times ops with a barrier before and after each; an op's time excludes the ops timed
    inside it."""

    def __init__(self):
        self.ms = {c: 0.0 for c in CATEGORIES}
        self.inner = [0.0]

    def timed(self, category: str, fn, args, out_of):
        mx.eval([a for a in args if isinstance(a, mx.array)])
        self.inner.append(0.0)
        t0 = time.perf_counter()
        out = fn(*args)
        mx.eval(out_of(out))
        dt = time.perf_counter() - t0
        nested = self.inner.pop()
        self.ms[category] += 1e3 * (dt - nested)
        self.inner[-1] += dt
        return out


@contextmanager
def splitting(split: Split):
    """The verify's ops timed into ``split`` (class and module patches, undone after)."""
    classes = (compiled_layers.Qwen3_5VerifyDecoderLayer, compiled_layers.Qwen3NextVerifyDecoderLayer)
    mixer, sdpa = qwen_target.capture_mixer, qwen_target.scaled_dot_product_attention
    kernel = qwen_target.row_attention.attend

    def layer_call(orig):
        def call(self, x, mask=None, cache=None):
            kind = "gdn_layers" if self.is_linear else "attention_layers"
            return split.timed(kind, lambda *a: orig(self, *a), (x, mask, cache), lambda o: o)
        return call

    for c in classes:
        c.__call__ = layer_call(compiled_layers.VerifyDecoderLayer.__call__)
    qwen_target.capture_mixer = lambda *a: split.timed(
        "gdn_mixer", mixer, a, lambda o: [o[0], o[1], o[2], *o[3]])
    qwen_target.scaled_dot_product_attention = lambda *a, **k: split.timed(
        "sdpa", lambda *b: sdpa(*b, **k), a, lambda o: o)
    qwen_target.row_attention.attend = lambda q, rows, scale: split.timed(
        "sdpa", lambda *_: kernel(q, rows, scale), (q, rows.keys, rows.values), lambda o: o)
    try:
        yield
    finally:
        for c in classes:
            del c.__call__  # the mixin's again
        qwen_target.capture_mixer, qwen_target.scaled_dot_product_attention = mixer, sdpa
        qwen_target.row_attention.attend = kernel


def _weights(modules) -> int:
    return sum(v.nbytes for m in modules for _, v in tree_flatten(m.parameters()))


def floors_ms(target, bandwidth_gbs: float) -> dict:
    """Each category's weight bytes over the bandwidth, in ms."""
    layers = target.layers
    gdn = [l for l in layers if l.is_linear]
    attn = [l for l in layers if not l.is_linear]
    nbytes = {"gdn_layers": _weights(gdn), "attention_layers": _weights(attn),
              "lm_head": _weights([target.lm_head_module]), "gdn_mixer": 0, "sdpa": 0}
    return {c: 1e3 * b / (bandwidth_gbs * 1e9) for c, b in nbytes.items()}, nbytes


def run(args, watch=None) -> dict:
    model, tokenizer = mlx_mtp.load(args.model, require_head=False)
    target = model.target
    if target.family != "qwen3_5":
        raise SystemExit(f"error: --model {args.model}: verify_ops splits the hybrid Qwen "
                         f"targets' verify, got the {target.family} family")
    target.prepare(args.max_width)
    prompt = tokenizer.encode(args.prompt)
    block = [(37 * i + 11) % target.vocab_size for i in range(args.max_width)]
    prefilled = prefilled_caches(target, prompt)
    unit = common.idle.Watch.runner(watch)

    def verify(width, split=None):
        cache = arm_caches(target, prompt, None, prefilled)
        mx.eval(target.cache_state(cache))
        t0 = time.perf_counter()
        with cpu_blas.verify_threads(), (splitting(split) if split else _nothing()):
            ids = mx.array([block[:width]])
            h = target.verify(ids, cache)
            logits = (split.timed("lm_head", target.logits, (h[0],), lambda o: o) if split
                      else target.logits(h[0]))
            mx.eval(logits, target.cache_state(cache))
        return 1e3 * (time.perf_counter() - t0)

    for w in range(1, args.max_width + 1):  # warm-up: compile each width's graphs
        verify(w)
        verify(w, Split())
    whole = {w: [] for w in range(1, args.max_width + 1)}
    splits = {w: [] for w in whole}
    for rep in range(args.reps):
        def measure():
            out = {}
            for w in whole:
                s = Split()
                out[w] = (verify(w), verify(w, s), s.ms)
            return out
        for w, (ms, split_ms, parts) in unit(f"rep {rep}", measure).items():
            whole[w].append(ms)
            splits[w].append(dict(parts, total=split_ms))
    bw = common.bandwidth_gbs()
    floors, nbytes = floors_ms(target, bw)
    rows = []
    for w in whole:
        parts = {c: statistics.median(s[c] for s in splits[w]) for c in (*CATEGORIES, "total")}
        rows.append({"width": w, "whole_ms": statistics.median(whole[w]),
                     "split_total_ms": parts.pop("total"), "split_ms": parts})
    return {**common.record_setup(args.topic), "model": args.model, "prompt": args.prompt,
            "reps": args.reps, "bandwidth_gbs": bw, "floor_ms": floors, "weight_bytes": nbytes,
            "row_exact": target.exact, "rows": rows}


@contextmanager
def _nothing():
    yield


def render(r: dict) -> str:
    one = r["rows"][0]
    lines = common.setup_lines(r)
    lines += [f"- Model: `{r['model']}`; prompt {r['prompt']!r}; median of {r['reps']} "
              f"repetitions per width",
              f"- Measured streaming-read bandwidth: {r['bandwidth_gbs']:.1f} GB/s; weight "
              "floors (ms): " + ", ".join(f"{c} {r['floor_ms'][c]:.1f}" for c in CATEGORIES
                                          if r["floor_ms"][c]),
              "", "## Results", "",
              "| width | whole ms | x width 1 | split sum ms | "
              + " | ".join(f"{c} ms (x floor)" for c in CATEGORIES) + " |",
              "|---|---|---|---|" + "---|" * len(CATEGORIES)]
    for row in r["rows"]:
        cells = []
        for c in CATEGORIES:
            ms, floor = row["split_ms"][c], r["floor_ms"][c]
            cells.append(f"{ms:.1f}" + (f" ({ms / floor:.2f})" if floor else ""))
        lines.append(f"| {row['width']} | {row['whole_ms']:.1f} | "
                     f"{row['whole_ms'] / one['whole_ms']:.2f} | {row['split_total_ms']:.1f} | "
                     + " | ".join(cells) + " |")
    lines += ["", "whole: the verify as the round loop runs it (width 1: the decode step). split: "
              "the same with a barrier around each op; each category's time excludes the ops "
              "timed inside it. x floor: the category's time over its weights' bytes read at "
              "the measured bandwidth."]
    return "\n".join(lines + common.what_it_says(r))


def main(argv=None):
    p = argparse.ArgumentParser(description="a verify's time split by op, per width")
    p.add_argument("--model", help="a hybrid Qwen target (required unless --render)")
    p.add_argument("--topic", default="verify-ops")
    p.add_argument("--max-width", type=int, default=6)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--prompt", default="The river rose in the night and the people of the valley")
    common.add_render_arg(p)
    common.add_record_args(p, units=True)
    args = p.parse_args(argv)
    rendered = common.render_instead(args, p, render, "verify_ops")
    if rendered is not None:
        return rendered
    if args.max_width < 1 or args.reps < 1:
        p.error("--max-width >= 1 and --reps >= 1 are required")
    watch = common.watch(args)
    return common.finish(args, run(args, watch), watch, render, "verify_ops")


if __name__ == "__main__":
    main()
