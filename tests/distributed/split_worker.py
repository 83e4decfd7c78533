"""One rank of a split run, started by ``mlx.launch`` (or by hand) from tests/distributed.

``python split_worker.py MODEL SPLIT OUT MAX_TOKENS``: loads MODEL split SPLIT-wise over the
launched group (SPLIT ``none``: one process, unsplit, the MTP arm only), then runs three arms on the same split target: MTP (block 3), the MTP loop at
block 1 (the single-token chain), MTP sampled at T=1 from a seed rank 0 shares, and mlx-lm's
plain decode; then MTP and plain decode with a repetition penalty (the drafts apply it too).
Each loop arm logs a hash of this
rank's cache state after every round to ``OUT/<arm>.rank<r>``; the ids and stats go to
``OUT/result.rank<r>.json``. With MAX_TOKENS large it is the victim of the dead-rank test.
"""

import json
import sys

import mlx_mtp  # noqa: F401  (first: binds the system BLAS)
import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.errors import MTPError
from mlx_mtp.decoding.plain import plain_generate_step
from mlx_mtp.generate import generate_step

PROMPT = [3 + 7 * i % 290 for i in range(12)]


def main():
    model_dir, split_kind, out, max_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    alone = split_kind == "none"
    model, _ = mlx_mtp.load(model_dir, split=None if alone else split_kind)
    split = model.split
    result = {"rank": 0 if alone else split.rank}
    arms = (("mtp", 3),) if alone else (("mtp", 3), ("chain", 1), ("auto", "auto"))
    for arm, block in arms:
        if not alone:
            split.cache_log = f"{out}/{arm}"
        stats = RunStats()
        ids = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=max_tokens,
                                           block_size=block, max_block_size=4, stats=stats)]
        result[arm] = {"tokens": ids, **{k: v for k, v in stats.to_dict().items()
                                          if k != "draft_profile"}}
    if alone:
        return _write(out, result)
    # Sampled (T=1): the ranks' global random states differ on purpose; the shared seed makes
    # every rank draw the same tokens (else each rank would feed its own draw to its layers).
    mx.random.seed(1000 + split.rank)
    seed = split.shared_seed()
    mx.random.seed(seed)
    split.cache_log = f"{out}/sampled"
    stats = RunStats()
    ids = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=max_tokens,
                                       block_size=3, sampler=mlx_mtp.make_sampler(temp=1.0),
                                       seed=seed, stats=stats)]
    result["sampled"] = {"tokens": ids, "seed": seed, "rounds": stats.rounds}
    split.cache_log = None
    stats = RunStats()
    ids = [t for t, _, _ in plain_generate_step(mx.array(PROMPT), model, max_tokens=max_tokens,
                                                sampler=None, prefill_step_size=2048,
                                                stats=stats)]
    result["plain"] = {"tokens": ids, **{k: v for k, v in stats.to_dict().items()
                                         if k != "draft_profile"}}
    procs = make_logits_processors(repetition_penalty=2.0, repetition_context_size=12)
    stats = RunStats()
    ids = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=max_tokens,
                                       block_size=3, logits_processors=procs, stats=stats)]
    result["penalized"] = {"tokens": ids, "draft_processors": stats.draft_processors,
                           "rounds": stats.rounds, "accepted": stats.accepted}
    ids = [t for t, _, _ in plain_generate_step(mx.array(PROMPT), model, max_tokens=max_tokens,
                                                sampler=None, prefill_step_size=2048,
                                                stats=RunStats(), logits_processors=procs)]
    result["plain_penalized"] = {"tokens": ids}
    _write(out, result)


def _write(out, result):
    with open(f"{out}/result.rank{result['rank']}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    try:
        main()
    except MTPError as e:  # as the CLI: one line, exit 1
        sys.stderr.write(f"error: {e}\n")
        sys.exit(1)
