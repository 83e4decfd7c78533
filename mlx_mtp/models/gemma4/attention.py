"""Gemma 4 attention that computes a verify block row by row, exactly as decode would.

A multi-query SDPA is not reduced like a one-query SDPA under every BLAS or backend (on the CPU with
BLIS, even for 8 keys; see docs/exactness.md), so a verify row could differ from the decode step it
stands for in the last bits. Inside a verify (a cache that says ``verifying``), this subclass feeds
the block's K/V to its cache one row at a time (``update_rows``: the single-token updates of plain
decode) and gives each query row its own SDPA over exactly the K/V that update returned, with no
mask, as decode does. The KV-shared layers get the same per-row K/V from their producer. Everything
else is mlx-lm's ``gemma4_text.Attention``.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
from mlx_lm.models import gemma4_text as _gemma4_text
from mlx_lm.models.base import scaled_dot_product_attention

from mlx_mtp import draft_tree
from mlx_mtp.models.packed_batch import PackedCache


class RowKV(list):
    """Per verify row, the (keys, values) its decode step attends to; what a producer layer
    hands its KV-shared layers inside a verify. ``positions``: each row's position, where the
    rows are not one block from one offset (several sequences' packed rows)."""

    positions = None


class Gemma4VerifyAttention(_gemma4_text.Attention):
    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache: Optional[Any] = None,
                 shared_kv: Optional[tuple] = None, offset: Optional[Any] = None):
        if not (isinstance(shared_kv, RowKV) or getattr(cache, "verifying", False)
                or isinstance(cache, PackedCache)):
            return super().__call__(x, mask, cache, shared_kv=shared_kv, offset=offset)
        # As gemma4_text.Attention.__call__ (mlx-lm 0.32.2), except the cache update and SDPA.
        B, L, _ = x.shape
        tree = draft_tree.current()
        queries = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim))
        if isinstance(shared_kv, RowKV):
            rows = shared_kv
        else:
            keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
            values = keys
            if not self.use_k_eq_v:
                values = self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
            keys = self.k_norm(keys).transpose(0, 2, 1, 3)
            values = self.v_norm(values).transpose(0, 2, 1, 3)
            if isinstance(cache, PackedCache):  # several sequences, each at its own positions
                positions = [part.offset + j for _, w, part in cache.segments for j in range(w)]
                keys = self._rope_rows(keys, positions)
                rows = RowKV()
                for first, w, part in cache.segments:
                    rows += part.update_rows(keys[:, :, first : first + w],
                                             values[:, :, first : first + w])
                rows.positions = positions
            elif tree is None:
                offset = mx.array(cache.offset)
                rows = RowKV(cache.update_rows(self.rope(keys, offset=offset), values))
            else:  # a draft tree's nodes: each at its depth's position, appended along paths
                rows = RowKV(cache.update_tree(self._rope_rows(keys, tree.positions), values,
                                               tree.paths()))
        queries = queries.transpose(0, 2, 1, 3)
        if rows.positions is not None:
            queries = self._rope_rows(queries, rows.positions)
        elif tree is None:
            queries = self.rope(queries, offset=offset)
        else:
            queries = self._rope_rows(queries, tree.positions)
        output = self.attend_rows(queries, rows).transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(output), rows, offset

    def _rope_rows(self, x: mx.array, positions) -> mx.array:
        """Row i of ``x [B, H, L, D]`` roped at ``positions[i]``, one row at a time, as decode
        ropes its one row."""
        return mx.concatenate([self.rope(x[:, :, i : i + 1], offset=mx.array(p))
                               for i, p in enumerate(positions)], axis=2)

    def attend_rows(self, queries: mx.array, rows: RowKV) -> mx.array:
        """Query row i against row i's K/V alone, unmasked: the SDPA of its decode step."""
        return mx.concatenate([
            scaled_dot_product_attention(queries[:, :, i : i + 1], k, v, cache=None,
                                         scale=self.scale, mask=None)
            for i, (k, v) in enumerate(rows)], axis=2)
