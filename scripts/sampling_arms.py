"""The sampling work of one T>0 round, arm against arm in one process (ratios, not records).

Arms, each the draws of one round of ``--drafts`` k drafts over a ``--vocab`` V row, evaluated
once per round as the loop does (the drafter's and the target's forwards left out):
  keyed-before   ``auto`` as it was: each coupled draft log-normalizes its row and makes its
                 Gumbel noise; the verify log-normalizes its k + 1 rows and makes k + 1 noise rows.
  keyed          ``auto`` now (``mlx_mtp.decoding.keyed_sampling``): no log-normalization without a filter
                 (an argmax does not see a row's shift); the verify reuses the drafts' noise.
  speculative    a fixed block size: the drafter's compiled pick (one exp pass, an inverse-CDF
                 draw), the target's ``probs`` and the compiled block verification.
Rounds alternate between the arms; medians per arm are printed with their ratio to ``keyed``.

    python scripts/sampling_arms.py [--vocab 8192] [--drafts 3] [--rounds 300] [--temp 0.6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mlx_mtp  # noqa: E402  (first: binds the system BLAS before mlx.core loads)
import mlx.core as mx  # noqa: E402

from mlx_mtp.decoding import keyed_sampling
from mlx_mtp.decoding import sampling  # noqa: E402


def keyed_before(sampler, keys, z_draft, z_verify, first):
    drafts = []
    for j in range(z_draft.shape[0]):
        row = z_draft[j : j + 1]
        logprobs = row - mx.logsumexp(row, axis=-1, keepdims=True)
        noise = keys.noise(first + j, row.shape[-1])
        drafts.append(mx.argmax(sampler.logits(logprobs) + noise, axis=-1))
    logprobs = z_verify - mx.logsumexp(z_verify, axis=-1, keepdims=True)
    noise = mx.concatenate([keys.noise(first + i, z_verify.shape[-1])
                            for i in range(z_verify.shape[0])])
    toks = mx.argmax(sampler.logits(logprobs) + noise, axis=-1)
    return mx.concatenate([*drafts, toks])


def keyed(sampler, keys, z_draft, z_verify, first):
    ds = keyed_sampling.CoupledDraftSampler(sampler, keys, first, z_verify.shape[-1])
    drafts = [ds(z_draft[j : j + 1]) for j in range(z_draft.shape[0])]
    logprobs = z_verify - mx.logsumexp(z_verify, axis=-1, keepdims=True)  # yielded, lazy
    toks = keyed_sampling.draw(sampler, logprobs, keys, first, logits=z_verify, noise=ds.noise)
    return mx.concatenate([*drafts, toks])


def speculative(sampler, streams, z_draft, z_verify):
    ds = sampling.DraftSampler(sampler, streams.draft(), z_verify.shape[-1])
    for j in range(z_draft.shape[0]):
        ds(z_draft[j : j + 1])
    drafts, q, q_ids = ds.result()
    accepted, toks = sampling.rejection_sample(sampler.probs(z_verify), q, drafts,
                                               streams.target(), q_ids)
    return mx.concatenate([drafts, accepted.astype(mx.uint32), toks])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--drafts", type=int, default=3)
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--temp", type=float, default=0.6)
    args = p.parse_args(argv)
    if args.vocab < 2 or args.drafts < 1 or args.rounds < 1 or not args.temp > 0:
        p.error("--vocab >= 2, --drafts >= 1, --rounds >= 1 and --temp > 0 are required")
    sampler = mlx_mtp.make_sampler(temp=args.temp)
    keys, streams = keyed_sampling.PositionKeys(0), sampling.RandomStreams(0)
    z = mx.random.normal((2 * args.drafts + 1, args.vocab), key=mx.random.key(1)) * 3
    z_draft, z_verify = z[: args.drafts], z[args.drafts :]
    mx.eval(z_draft, z_verify)
    arms = {"keyed-before": lambda n: keyed_before(sampler, keys, z_draft, z_verify, n),
            "keyed": lambda n: keyed(sampler, keys, z_draft, z_verify, n),
            "speculative": lambda n: speculative(sampler, streams, z_draft, z_verify)}
    times = {a: [] for a in arms}
    for r in range(args.rounds + 10):  # the first 10 rounds warm up (compiles, allocations)
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        for a in order:
            t0 = time.perf_counter()
            mx.eval(arms[a](r * (args.drafts + 1)))
            if r >= 10:
                times[a].append(time.perf_counter() - t0)
    base = statistics.median(times["keyed"])
    print(f"V={args.vocab}, {args.drafts} drafts, T={args.temp}, {args.rounds} alternating rounds")
    for a, ts in times.items():
        m = statistics.median(ts)
        print(f"{a:13s} {m * 1e3:7.3f} ms a round  {m / base:5.2f}x keyed")


if __name__ == "__main__":
    main()
