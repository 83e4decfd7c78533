"""The batch-vs-alone exactness probe: a packed verify of several sequences against each
sequence's verify alone.

A batched round (``mlx_mtp.decoding.batch_rounds``) is exact at temperature 0 only if every
sequence's rows, and the caches its rollback leaves, do not depend on what else is in the batch.
The probe prefills sequences of different lengths, verifies their blocks of different widths
(one of them a single row) in one ``Target.verify_batch`` forward, and compares each sequence's
logits rows with ``Target.verify`` of its block alone from the same prefill, byte for byte, then
its caches after a partial rollback. Memoized per target and batch shape.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx

from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.exactness.block_vs_chain import arm_caches, prefilled_caches
from mlx_mtp.exactness.row_exact_layers import bitwise_equal

_MEMO: "weakref.WeakKeyDictionary[Any, Dict[Tuple[int, ...], Optional[str]]]" = \
    weakref.WeakKeyDictionary()


def probe_widths(max_batch: int, widest: int) -> List[int]:
    """The blocks' widths: the widest, a single row, then widths in between, ``max_batch`` in
    all (at least two)."""
    widths = [widest, 1]
    while len(widths) < max(2, max_batch):
        widths.append(1 + len(widths) % widest)
    return widths


def _tokens(vocab_size: int, s: int, width: int) -> Tuple[List[int], List[int]]:
    """Sequence ``s``'s synthetic prompt (its length differs per sequence) and block."""
    prompt = [(7 * i + 13 * s + 1) % vocab_size for i in range(9 + 5 * s)]
    block = [(11 * i + 3 * s + 2) % vocab_size for i in range(width)]
    return prompt, block


def probe_batch(target, max_batch: int, widest: int) -> Optional[str]:
    """None where every sequence of a packed verify equals its verify alone, byte for byte
    (logits rows, and the caches after keeping the first row); else where it first differs."""
    widths = tuple(probe_widths(max_batch, widest))
    memo = _MEMO.setdefault(target, {})
    if widths not in memo:
        memo[widths] = _run(target, list(widths))
    return memo[widths]


def _run(target, widths: List[int]) -> Optional[str]:
    seqs = [_tokens(target.vocab_size, s, w) for s, w in enumerate(widths)]
    prefilled = [prefilled_caches(target, prompt) for prompt, _ in seqs]
    alone = []
    with cpu_blas.verify_threads():
        for (prompt, block), pre in zip(seqs, prefilled):
            cache = arm_caches(target, prompt, None, pre)
            logits = target.logits(target.verify(mx.array(block)[None], cache)[0])
            target.rollback(cache, fed=len(block), keep=1)
            alone.append((logits, target.cache_state(cache)))
            mx.eval(alone[-1])
        caches = [arm_caches(target, prompt, None, pre)
                  for (prompt, _), pre in zip(seqs, prefilled)]
        hidden = target.verify_batch([mx.array(block) for _, block in seqs], caches)
        logits = target.logits(mx.concatenate(hidden, axis=1)[0])
        mx.eval(logits)
    shape = f"{len(widths)} (widths {', '.join(map(str, widths))})"
    first = 0
    for s, ((_, block), (ref, ref_state), cache) in enumerate(zip(seqs, alone, caches)):
        w = len(block)
        for i in range(w):
            if not bitwise_equal(logits[first + i], ref[i]):
                return (f"sequence {s + 1} of {shape}: logits row "
                        f"{i} of a packed verify differs from its verify alone")
        first += w
        target.rollback(cache, fed=w, keep=1)
        state = target.cache_state(cache)
        if len(state) != len(ref_state) or not all(
                bitwise_equal(a, b) for a, b in zip(state, ref_state)):
            return (f"sequence {s + 1} of {shape}: its caches after a "
                    f"packed verify and rollback differ from those after its verify alone")
    return None
