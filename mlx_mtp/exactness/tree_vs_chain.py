"""The tree-vs-chain exactness probe: a draft tree's verify against single-token decode chains.

A tree verify is exact at temperature 0 only if every node's logits row equals, byte for byte,
what decoding the tokens on its path one at a time gives. The probe builds a synthetic tree of the
session's shape (``probe_parents``: as wide as ``topk`` allows and as deep as the tree may go,
with paths of every length), verifies it in one ``Target.verify_tree`` forward from copies of the
block probe's prefilled caches, and compares each node's row with the single-token chain through
its path (``block_vs_chain.chain_rows``). Three draws of synthetic tokens, memoized per process as
the block probe's results are.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Dict, List

import mlx.core as mx

from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.exactness.block_vs_chain import (DIVERGES, EQUAL, NOT_RUN, PROBE_DRAWS, ProbeResult,
                                              arm_caches, chain_rows, error_line,
                                              first_difference, model_signature,
                                              prefilled_caches, probe_tokens)
from mlx_mtp.draft_tree import DraftTree


def probe_parents(topk: int, nodes: int, depth: int) -> List[int]:
    """Parents of a breadth-first tree of ``nodes`` draft nodes (root -1 first): at each depth
    the first node's first child comes first (so the tree reaches ``depth`` within the budget),
    then up to ``topk`` children per node of the level above while nodes remain."""
    parents, level, left = [-1], [0], nodes
    for d in range(1, depth + 1):
        below, reserve = [], depth - d  # spine nodes still owed to the deeper levels
        for p in level:
            for k in range(topk):
                spine = p == level[0] and k == 0
                if left == 0 or (left <= reserve and not spine):
                    break
                parents.append(p)
                below.append(len(parents) - 1)
                left -= 1
        level = below
        if not level:
            break
    return parents


def tree_rows(target, tree: DraftTree, root: int, prompt, prefilled, kv=None
              ) -> List[mx.array]:
    """Logits rows of one ``verify_tree`` over ``root`` and the tree's nodes."""
    cache = arm_caches(target, prompt, kv, prefilled)
    with cpu_blas.verify_threads():  # as the round loop verifies
        h = target.verify_tree(mx.array([[root] + tree.tokens]), cache, tree)
        logits = target.logits(h[0])
        mx.eval(logits)
    return [logits[i] for i in range(logits.shape[0])]


_MEMO: "weakref.WeakKeyDictionary[Any, Dict[tuple, ProbeResult]]" = weakref.WeakKeyDictionary()


def shape_text(topk: int, nodes: int, depth: int) -> str:
    return f"tree: top {topk}, {nodes} nodes, depth {depth}"


def probe_tree_exactness(target, topk: int, nodes: int, depth: int, *,
                         draws: int = PROBE_DRAWS, kv=None) -> ProbeResult:
    """The tree verify of the session's shape against the chains through its paths. The result's
    ``width`` is the verify's (nodes + 1), ``position`` the first differing node, ``config`` the
    shape (and the quantized KV cache probed, with ``kv``, a ``KVSettings``)."""
    parents = probe_parents(topk, nodes, depth)
    width = len(parents)
    config = shape_text(topk, width - 1, depth)
    if kv is not None:
        config += f"; {kv.describe_cache()}"
    target.prepare(width)  # as a session does; the key sees the layers it swaps
    key = (model_signature(target), str(mx.default_device()), draws, tuple(parents), config)
    try:
        memo = _MEMO.setdefault(target, {})
    except TypeError:
        memo = None
    if memo is not None and key in memo:
        return ProbeResult(**{**memo[key].to_dict(), "cached": True})
    t0 = time.perf_counter()
    result = _run(target, parents, draws, config, kv)
    result = ProbeResult(**{**result.to_dict(), "seconds": time.perf_counter() - t0})
    if memo is not None:
        memo[key] = result
    return result


def _run(target, parents: List[int], draws: int, config: str, kv) -> ProbeResult:
    width = len(parents)
    total = 0
    for draw in range(draws):
        prompt, block = probe_tokens(target.vocab_size, width, draw)
        tree = DraftTree(mx.array(block[1:], dtype=mx.uint32), block[1:], parents,
                         [0] * (width - 1))
        try:
            prefilled = prefilled_caches(target, prompt, kv)
            rows = tree_rows(target, tree, block[0], prompt, prefilled, kv)
            for leaf in tree.leaves():
                path = tree.path(leaf)
                chain = chain_rows(target, prompt, [block[n] for n in path], kv, prefilled)
                diff = first_difference(chain, [rows[n] for n in path])
                if diff is not None:
                    j, n, row_bytes = diff
                    return ProbeResult(width, DIVERGES, position=path[j], differing_bytes=n,
                                       total_bytes=row_bytes, draw=draw, draws=draws,
                                       config=config)
                total = chain[0].nbytes
        except Exception as e:
            return ProbeResult(width, NOT_RUN, draws=draws, reason=error_line(e), config=config)
    return ProbeResult(width, EQUAL, total_bytes=total, draws=draws, config=config)
