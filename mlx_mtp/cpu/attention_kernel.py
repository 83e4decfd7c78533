"""The attention kernel: a verify's attention rows in one pass over the KV cache, each row in the
order of the one-query attention that decode computes.

Decode attends one query row with MLX's SDPA, which on the CPU is a one-row BLAS product for the
scores, MLX's softmax and a one-row product for the values, per query head: a verify that does
the same row by row reads the cache once per row (and once per query head of a KV head).
``cpu/csrc/attn_rows.c`` computes every row's scores and values in one pass over each KV head's
keys and values, each output summed in the order BLIS's one-row product sums it; the softmax
between stays MLX's own op, one per row. ``KVRows`` says which keys each row sees: a full
cache's prefixes, a sliding window's ring with the rows a later row overwrote, a draft tree's
paths. It runs as lazy ops only (``mlx_mtp.cpu.lazy_ops``); ``mlx_mtp.exactness.row_attention``
uses it where a bitwise check says it equals decode's SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import mlx.core as mx

from mlx_mtp.cpu import lazy_ops as lazy_kernels
from mlx_mtp.cpu import row_kernel


@dataclass
class KVRows:
    """The keys and values each of a verify's rows attends to, as decode's step at that row sees
    them: row i sees ``lengths[i]`` positions, position s being ``keys[..., s, :]`` unless
    ``overrides[i]`` maps s to a row of ``extra_keys`` (sorted ``(position, extra row)`` pairs).
    ``keys`` / ``values``: ``[1, G, S, D]`` (a cache's buffer or a view of it, read in place);
    ``extra_*``: ``[1, G, E, D]``."""

    keys: mx.array
    values: mx.array
    lengths: List[int]
    overrides: List[List[Tuple[int, int]]] = field(default_factory=list)
    extra_keys: Optional[mx.array] = None
    extra_values: Optional[mx.array] = None

    def __post_init__(self):
        if not self.overrides:
            self.overrides = [[] for _ in self.lengths]

    @property
    def width(self) -> int:
        return len(self.lengths)

    def row(self, i: int) -> Tuple[mx.array, mx.array]:
        """Row i's keys and values ``[1, G, lengths[i], D]`` in the order it sees them (a view of
        ``keys`` where nothing is overridden: a full cache's prefix, as decode slices it)."""
        n = self.lengths[i]
        if not self.overrides[i]:
            return self.keys[..., :n, :], self.values[..., :n, :]
        ks, vs, s = [], [], 0
        for p, e in self.overrides[i]:
            if p > s:
                ks.append(self.keys[..., s:p, :])
                vs.append(self.values[..., s:p, :])
            ks.append(self.extra_keys[..., e : e + 1, :])
            vs.append(self.extra_values[..., e : e + 1, :])
            s = p + 1
        if s < n:
            ks.append(self.keys[..., s:n, :])
            vs.append(self.values[..., s:n, :])
        return mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2)

    def flat_overrides(self):
        """The overrides as the kernel takes them: per-row starts, positions, extra rows."""
        start, pos, src = [0], [], []
        for row in self.overrides:
            for p, e in row:
                pos.append(p)
                src.append(e)
            start.append(len(pos))
        return start, pos, src


def problem() -> Optional[str]:
    """Why the attention kernel cannot run here (None: it can)."""
    if mx.default_device() != mx.cpu:
        return "the default device is not the CPU"
    if not row_kernel.available():
        return f"the C kernels are unavailable ({row_kernel.reason()})"
    if not lazy_kernels.available():
        return f"the lazy kernels are unavailable ({lazy_kernels.reason()})"
    return None


def attend(queries: mx.array, rows: KVRows, scale: float, threads: int = 1) -> mx.array:
    """``[1, H, w, D]``: query row i of ``queries [1, H, w, D]`` (H a multiple of the G KV heads)
    against the keys and values ``rows`` says it sees, each row in the order of decode's
    one-query SDPA: the queries scaled as MLX's SDPA scales them, the scores and values in one
    pass over the cache (lazy ops), MLX's softmax per row between."""
    ops = lazy_kernels.load()
    if ops is None:
        raise RuntimeError(f"attention kernel unavailable: {lazy_kernels.reason()}")
    _, H, w, D = queries.shape
    if w != rows.width:
        raise ValueError(f"attention kernel: {w} query rows for a layout of {rows.width}")
    G = rows.keys.shape[1]
    q = (mx.array(scale, dtype=queries.dtype) * queries)[0]  # SDPA's scaling, elementwise
    extra_k, extra_v = rows.extra_keys, rows.extra_values
    if extra_k is None:  # the kernel takes one row at least
        extra_k = extra_v = mx.zeros((1, G, 1, D), dtype=mx.float32)
    start, pos, src = rows.flat_overrides()
    n = list(rows.lengths)
    scores = ops.attn_scores(q, rows.keys, extra_k, n, start, pos, src, threads)
    probs = [mx.softmax(scores[:, i, : n[i]], axis=-1, precise=True) for i in range(w)]
    return ops.attn_values(probs, rows.values, extra_v, n, start, pos, src, threads)[None]
