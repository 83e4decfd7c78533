"""Which draft distribution q pays best under speculative sampling: acceptance without timing.

The question it answers: for this pair at this temperature, which q (the head at another
temperature, truncated by top-k / top-p, or greedy) would keep the most drafts? Ask it again when
the head, the pair or the sampling defaults change.

Speculative sampling is lossless for any q the drafts are drawn from, as long as the test uses
that q (``mlx_mtp.decoding.sampling``); how many drafts it keeps depends on q. For each prompt this samples
one continuation from the target (mlx-lm's plain decode at ``--temp``, seeded), feeds prompt and
continuation to the target and the MTP head as the loop's accept hook does (the head sees the
target's true hidden states), and computes at every continuation position, exactly from the
distributions:
  one-draft acceptance  sum_x min(p(x), q(x)), p the target's sampled distribution (``--temp``,
                        no top-p / top-k), q each variant of the head's distribution:
                        ``T=t`` softmax(head logits / t) (the loop's q today is T = the target's
                        temperature), ``T=t,top-k=n`` / ``T=t,top-p=x`` its truncations (mlx-lm's
                        filters), ``greedy`` a point mass on the head's argmax (acceptance
                        p(argmax)).
With ``--chains N`` it also estimates the expected number of drafts kept per round for blocks of
1..``--drafts`` drafts under block verification (what the loop runs): at every ``--stride``-th
position, N draft chains drawn recurrently from each q as the drafter drafts, the target's p at
the chain's rows, and E[kept | chain] exactly from block verification's pass probabilities
(independent coins: P(kept >= j) = 1 - prod_{i >= j} (1 - pass_i)), averaged over the chains.
Both average over positions, where a run averages over its rounds (an easy stretch takes fewer
rounds), so they rank variants; they are not a run's per-round means.

    python -m tools.draft_acceptance [--model mlx_mtp/demo_pair] [--temp 0.6] \
        [--max-tokens 128] [--chains 4 --stride 4 --drafts 5] [--out FILE.json]

Prompts: the demo pair's held-out openings and the benchmarks' four
(``benchmarks.common.HELD_OUT_OPENINGS`` and ``DEFAULT_PROMPTS``), or ``--prompts-json``
({name: prompt}). Deterministic (seeded) and timing-free: fine on a busy machine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx_mtp  # first: binds the system BLAS before mlx.core loads
import mlx.core as mx
from mlx_lm.models.cache import KVCache

from benchmarks import common
from mlx_mtp.decoding import sampling
from mlx_mtp.decoding.responses import encode_prompt

GREEDY = "greedy"


def default_variants(temp: float) -> list:
    out = [f"T={t:g}" for t in sorted({0.3, 0.45, 0.5, temp, 0.8, 1.0})]
    out += [f"T={temp:g},top-k=5", f"T={temp:g},top-k=20", f"T={temp:g},top-p=0.9",
            f"T={temp:g},top-p=0.95", GREEDY]
    return out


def parse_variant(name: str):
    """``q(logits [R, V]) -> [R, V]`` for a variant name (see the module docstring)."""
    if name == GREEDY:
        return lambda z: (mx.arange(z.shape[-1])[None] ==
                          mx.argmax(z, axis=-1)[:, None]).astype(mx.float32)
    opts = dict(part.split("=") for part in name.split(","))
    if set(opts) - {"T", "top-k", "top-p"} or "T" not in opts:
        raise SystemExit(f"--variants: {name!r} is not T=t[,top-k=n][,top-p=x] or greedy")
    s = sampling.make_sampler(temp=float(opts["T"]), top_k=int(opts.get("top-k", 0)),
                              top_p=float(opts.get("top-p", 0.0)))
    return s.probs


def continuation(model, prompt: mx.array, n: int, temp: float, seed: int) -> list:
    """``n`` tokens of mlx-lm's plain sampling at ``temp`` (the text a run emits, in law)."""
    from mlx_lm.generate import generate_step
    mx.random.seed(seed)
    sampler = sampling.make_sampler(temp=temp)
    return [t for t, _ in generate_step(prompt, model.mlx_model, max_tokens=n, sampler=sampler)]


def rows(model, ids: list):
    """Teacher-forced ``(target logits [S, V], head logits [S - 1, Vd])`` over ``ids``: target row
    i predicts ids[i + 1]; head row i (hidden i, id i + 1) predicts ids[i + 2]."""
    target, drafter = model.target, model.drafter
    seq = mx.array(ids)[None]
    h = target.hidden(seq, target.make_cache())
    logits = target.logits(h[0])
    cache = [KVCache() for _ in drafter.head.layers]
    g = drafter.head(target.embed(seq[:, 1:]), h[:, :-1], cache)
    return logits.astype(mx.float32), drafter.lm.project(g[0]).astype(mx.float32)


def lift(q: mx.array, model) -> mx.array:
    return sampling.lift_q(q, model.drafter.lm.ids, model.target.vocab_size)


def one_draft(p: mx.array, z: mx.array, variants: dict, model) -> dict:
    """Per variant, the exact one-draft acceptance per position ``[R]``."""
    return {name: mx.minimum(p, lift(q(z), model)).sum(axis=-1).tolist()
            for name, q in variants.items()}


# ------------------------------------------------------------------------ multi-draft chains


def _snapshot(cache):
    return [list(c.cache) if not isinstance(c, KVCache) else c.offset for c in cache]


def _restore(cache, snap):
    for c, s in zip(cache, snap):
        if isinstance(c, KVCache):
            c.trim(c.offset - s)
        else:
            c.cache = list(s)


def expected_kept(p_rows, q_rows, drafts) -> list:
    """E[kept | chain] for blocks of the chain's first 1..k drafts (block verification)."""
    d = drafts[:, None]
    p_d = mx.take_along_axis(p_rows[:-1], d, axis=-1)[:, 0]
    q_d = mx.take_along_axis(q_rows, d, axis=-1)[:, 0]
    out = []
    for k in range(1, drafts.size + 1):
        w = sampling.prefix_weights(p_d[:k], q_d[:k])
        mass = mx.maximum(w[:k, None] * p_rows[:k] - q_rows[:k], 0.0).sum(axis=-1)
        fail = 1.0 - sampling.pass_probabilities(w, mass)
        # P(kept >= j) = 1 - P(no prefix of j..k drafts passes)
        tail = mx.cumprod(fail[::-1])[::-1]
        out.append((1.0 - tail).sum())
    return mx.stack(out).tolist()


def chains(model, ids: list, start: int, p_sampler, variants: dict, n_chains: int, k: int,
           stride: int, seed: int) -> dict:
    """Per variant, ``[positions][k]`` E[kept] averaged over ``n_chains`` chains per position.
    Position N (the round's bonus is ids[N]) runs for N = start, start + stride, ..."""
    target, drafter = model.target, model.drafter
    out = {name: [] for name in variants}
    key = mx.random.key(seed)
    for N in range(start, len(ids) - 1, stride):
        cache = target.make_cache()
        h = target.hidden(mx.array(ids[:N])[None], cache)  # through ids[N - 1]
        head_cache = [KVCache() for _ in drafter.head.layers]
        g0 = drafter.head(target.embed(mx.array(ids[1 : N + 1])[None]), h, head_cache)[:, -1:]
        snap, head_snap = _snapshot(cache), _snapshot(head_cache)
        for name, q_of in variants.items():
            acc = []
            for _ in range(n_chains):
                g, drafts, qs = g0, [], []
                for j in range(k):
                    if j:
                        g = drafter.head(target.embed(drafts[-1][None]), g, head_cache)
                    q = lift(q_of(drafter.lm.project(g[:, -1]).astype(mx.float32)), model)
                    key, sub = mx.random.split(key)
                    drafts.append(sampling.draw_rows(q, mx.random.uniform(shape=(1,), key=sub)))
                    qs.append(q)
                drafts = mx.concatenate(drafts)
                block = mx.concatenate([mx.array(ids[N : N + 1], dtype=mx.uint32), drafts])
                hv = target.hidden(block[None], cache)
                p_rows = p_sampler.probs(target.logits(hv[0]).astype(mx.float32))
                acc.append(expected_kept(p_rows, mx.concatenate(qs), drafts))
                _restore(cache, snap)
                _restore(head_cache, head_snap)
            out[name].append([sum(a[j] for a in acc) / n_chains for j in range(k)])
    return out


# ----------------------------------------------------------------------------------- run


def run(args) -> dict:
    model, tokenizer = mlx_mtp.load(args.model)
    prompts = (common.read_prompts(args.prompts_json) if args.prompts_json else
               {**common.HELD_OUT_OPENINGS, **common.DEFAULT_PROMPTS})
    names = args.variants.split(";") if args.variants else default_variants(args.temp)
    variants = {n: parse_variant(n) for n in names}
    p_sampler = sampling.make_sampler(temp=args.temp)
    result = {"model": args.model, "temperature": args.temp, "max_tokens": args.max_tokens,
              "seed": args.seed, "variants": names, "prompts": {}}
    for i, (name, text) in enumerate(prompts.items()):
        prompt = encode_prompt(tokenizer, text)
        cont = continuation(model, prompt, args.max_tokens, args.temp, args.seed + i)
        ids = prompt.tolist() + cont
        L = prompt.size
        logits, z = rows(model, ids)
        # The first draft of the round whose bonus is ids[N] predicts ids[N + 1]: target row N,
        # head row N - 1. N runs over the continuation (N >= L).
        p = p_sampler.probs(logits[L:-1])
        entry = {"positions": p.shape[0], "one_draft": one_draft(p, z[L - 1 : -1], variants,
                                                                  model)}
        if args.chains:
            entry["kept"] = chains(model, ids, L, p_sampler, variants, args.chains, args.drafts,
                                   args.stride, args.seed + 1000 + i)
        result["prompts"][name] = entry
        print(name, " ".join(f"{v} {sum(a) / len(a):.3f}"
                             for v, a in entry["one_draft"].items()), flush=True)
    result["summary"] = summarize(result)
    return result


def summarize(result) -> dict:
    """Per variant: mean one-draft acceptance over all positions, and mean E[kept] per block."""
    out = {}
    for v in result["variants"]:
        acc = [a for e in result["prompts"].values() for a in e["one_draft"][v]]
        row = {"one_draft": sum(acc) / len(acc)}
        kept = [r for e in result["prompts"].values() for r in e.get("kept", {}).get(v, [])]
        if kept:
            row["kept"] = [sum(r[j] for r in kept) / len(kept) for j in range(len(kept[0]))]
        out[v] = row
    return out


def render(result) -> str:
    vs = result["variants"]
    lines = [f"T={result['temperature']}, {result['max_tokens']} tokens per prompt, seed "
             f"{result['seed']}", "",
             "| prompt | " + " | ".join(vs) + " |", "|---" * (len(vs) + 1) + "|"]
    for name, e in result["prompts"].items():
        lines.append(f"| {name} | " + " | ".join(
            f"{sum(e['one_draft'][v]) / len(e['one_draft'][v]):.3f}" for v in vs) + " |")
    s = result["summary"]
    lines.append("| **all** | " + " | ".join(f"**{s[v]['one_draft']:.3f}**" for v in vs) + " |")
    if any("kept" in s[v] for v in vs):
        k = len(next(s[v]["kept"] for v in vs if "kept" in s[v]))
        lines += ["", "E[drafts kept per round] by drafts per round (block verification):", "",
                  "| q | " + " | ".join(str(j + 1) for j in range(k)) + " |",
                  "|---" * (k + 1) + "|"]
        lines += [f"| {v} | " + " | ".join(f"{x:.3f}" for x in s[v]["kept"]) + " |"
                  for v in vs if "kept" in s[v]]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mlx_mtp/demo_pair")
    p.add_argument("--temp", type=float, default=0.6, help="the target's temperature")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", help="';'-separated q variants (default: a sweep)")
    p.add_argument("--prompts-json")
    p.add_argument("--chains", type=int, default=0, help="draft chains per position (0: none)")
    p.add_argument("--stride", type=int, default=4)
    p.add_argument("--drafts", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args(argv)
    if not args.temp > 0 or args.max_tokens < 2 or args.chains < 0 or args.stride < 1 or \
            args.drafts < 1:
        p.error("--temp > 0, --max-tokens >= 2, --chains >= 0, --stride >= 1 and --drafts >= 1 "
                "are required")
    result = run(args)
    text = render(result)
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
