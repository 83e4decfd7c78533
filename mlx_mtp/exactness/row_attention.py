"""A verify's attention rows through the attention kernel, where a check says it gives decode's
bytes; else one SDPA per row, decode's own call.

Decode attends one query row at a time, so an exact verify must give each row what that row's
decode step computes. One SDPA per row does, but reads the KV cache once per row. ``attend``
computes the rows with ``mlx_mtp.cpu.attention_kernel`` (one pass over the cache) where
``applies`` says a bitwise check passed for the signature (query heads, KV heads, head dim,
scale, width) up to the rows' lengths. The check runs once per signature and length tier, on
seeded inputs: full-cache prefixes ending at every residue mod 8, near length 0 and near the
tier's top, and rows with overridden positions (a ring's evicted rows, a tree's paths), each
against MLX's one-query SDPA over that row's keys. The first tier is ``FIRST_TOP`` keys; a verify
with longer rows doubles it and checks again (a tier that fails ends the doubling: longer rows
take one SDPA each). ``MLX_MTP_ATTENTION_KERNEL=0`` switches the kernel off.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import mlx.core as mx

from mlx_mtp import config as env
from mlx_mtp.cpu import attention_kernel
from mlx_mtp.cpu.attention_kernel import KVRows
from mlx_mtp.exactness import row_exact_layers

ENV = "MLX_MTP_ATTENTION_KERNEL"
FIRST_TOP = 512  # keys per row of the first checked tier (a sliding window's, often)
SEED = 4271

_checked: Dict[Tuple, Tuple[int, bool]] = {}  # signature -> (longest rows checked equal, open)
_calls = {"kernel": 0, "rows": 0}  # verify attentions computed each way (``usage``)


def problem() -> Optional[str]:
    """Why a verify's attention cannot use the kernel here (None: it can)."""
    if not env.flag(ENV):
        return f"{ENV}=0"
    return attention_kernel.problem()


def applies(n_heads: int, kv_heads: int, head_dim: int, lengths: List[int], scale: float,
            dtype) -> bool:
    """Whether verify rows of ``lengths`` keys (``n_heads`` query heads over ``kv_heads`` KV
    heads of ``head_dim``) may go through the kernel: float32, the kernel available, and its
    check passed for this signature up to the longest row (checking the next tiers first where
    needed)."""
    if dtype != mx.float32 or head_dim % 8 or n_heads % kv_heads:
        return False
    if problem() is not None:
        return False
    sig = (n_heads, kv_heads, head_dim, float(scale), len(lengths))
    need = max(lengths)
    top, extendable = _checked.get(sig, (0, True))
    while need > top and extendable:
        tier = max(FIRST_TOP, 2 * top)
        while tier < need:
            tier *= 2
        if _check(sig, tier):
            top = tier
        else:
            extendable = False
        _checked[sig] = (top, extendable)
    return need <= top


def applies_to(n_heads: int, rows: KVRows, scale: float) -> bool:
    """``applies`` for the rows ``rows`` describes."""
    _, G, _, D = rows.keys.shape
    return rows.keys.dtype == mx.float32 and applies(n_heads, G, D, rows.lengths, scale,
                                                      rows.values.dtype)


def attend(queries: mx.array, rows: KVRows, scale: float) -> mx.array:
    """``[1, H, w, D]``: the rows through the kernel (call ``applies`` first)."""
    _calls["kernel"] += 1
    return attention_kernel.attend(queries, rows, scale, threads(queries.shape[1], rows))


def by_rows(queries: mx.array, rows: KVRows, scale: float) -> mx.array:
    """``[1, H, w, D]``: one SDPA per row over the keys it sees, as decode computes it."""
    _calls["rows"] += 1
    return _sdpa_rows(queries, rows, scale)


def count_by_rows() -> None:
    """Count a verify attention that a caller computed one SDPA per row itself (``usage``)."""
    _calls["rows"] += 1


def _sdpa_rows(queries: mx.array, rows: KVRows, scale: float) -> mx.array:
    return mx.concatenate([
        mx.fast.scaled_dot_product_attention(queries[:, :, i : i + 1], *rows.row(i), scale=scale)
        for i in range(rows.width)], axis=2)


def threads(n_heads: int, rows: KVRows) -> int:
    """The kernel's threads: the row kernel's rule (``row_exact_layers.kernel_threads``) for
    the keys and values read times the query rows of a KV head."""
    G, D = rows.keys.shape[1], rows.keys.shape[3]
    read = 2 * G * max(rows.lengths) * D * rows.keys.dtype.size
    return row_exact_layers.kernel_threads(read * (n_heads // G) * rows.width)


def usage() -> Dict[str, int]:
    """How many verify attentions ran through the kernel and by rows in this process."""
    return dict(_calls)


def report() -> Dict[str, object]:
    """Whether the kernel can run, and each checked signature's tier: for the run's stats."""
    why = problem()
    out: Dict[str, object] = {"kernel": "available" if why is None else f"unavailable ({why})"}
    if _checked:
        out["checked"] = {f"heads {h} kv {g} dim {d} width {w}":
                          (f"equal up to {top} keys" if top else "diverges")
                          + ("" if extendable else " (longer rows: by rows)")
                          for (h, g, d, _, w), (top, extendable) in sorted(_checked.items())}
    return out


def reset() -> None:
    """Forget the checks and the counts (tests)."""
    _checked.clear()
    _calls.update(kernel=0, rows=0)


# ---- the check ------------------------------------------------------------------------------


def _check(sig: Tuple, top: int) -> bool:
    """Whether the kernel equals one-query SDPA bitwise on every case of ``_cases``."""
    n_heads, G, D, scale, w = sig
    for queries, rows in _cases(n_heads, G, D, w, top):
        mine = attention_kernel.attend(queries, rows, scale, threads(n_heads, rows))
        theirs = _sdpa_rows(queries, rows, scale)
        mx.eval(mine, theirs)
        if not row_exact_layers.bitwise_equal(mine, theirs):
            return False
    return True


def _cases(n_heads: int, G: int, D: int, w: int, top: int) -> List[Tuple[mx.array, KVRows]]:
    """Seeded queries and row layouts: full-cache prefixes (views of a buffer with room to
    spare, as a cache holds them) whose rows end at every residue mod 8 near 0 (first tier
    only) and near ``top``; on the first tier also a ring's layout (every row the whole buffer,
    later rows' slots overridden by the rows they evicted) and a tree's (each row its path's
    rows past a shared prefix)."""
    key = mx.random.key(SEED + top + w)
    k = iter(mx.random.split(key, 16))
    cap = top + w + 256
    keys = mx.random.normal((1, G, cap, D), key=next(k))
    values = mx.random.normal((1, G, cap, D), key=next(k))
    queries = mx.random.normal((1, n_heads, w, D), key=next(k))
    starts = [top - w - j * w for j in range(-(-8 // w))]
    if top == FIRST_TOP:
        starts += list(range(8))
    cases = [(queries, KVRows(keys[..., : s + w, :], values[..., : s + w, :],
                              [s + i + 1 for i in range(w)])) for s in starts if s >= 0]
    if top == FIRST_TOP:
        extra_k = mx.random.normal((1, G, w, D), key=next(k))
        extra_v = mx.random.normal((1, G, w, D), key=next(k))
        n = 61  # a ring of 61 (every residue reached by the tail), the rows' slots wrapping
        slots = [(n - 2 + j) % n for j in range(w)]
        ring = [sorted((slots[j], j) for j in range(i + 1, w)) for i in range(w)]
        cases.append((queries, KVRows(keys[..., :n, :], values[..., :n, :], [n] * w, ring,
                                      extra_k, extra_v)))
        depth = [min(i, 3) for i in range(w)]  # a tree's rows: paths of up to 4 nodes
        base = 21
        tree = [[(base + t, (i + t) % w) for t in range(depth[i] + 1)] for i in range(w)]
        cases.append((queries, KVRows(keys[..., :base, :], values[..., :base, :],
                                      [base + d + 1 for d in depth], tree, extra_k, extra_v)))
    return cases
