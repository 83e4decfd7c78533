"""Gemma 4 attention that computes a verify block's rows exactly as decode would.

A multi-query SDPA is not reduced like a one-query SDPA under every BLAS or backend (on the CPU with
BLIS, even for 8 keys; see docs/exactness.md), so a verify row could differ from the decode step it
stands for in the last bits. Inside a verify (a cache that says ``verifying``), each query row
attends to exactly the K/V its decode step would see, as decode computes it:

- through the attention kernel (``mlx_mtp.exactness.row_attention``: one pass over the cache for
  all rows, each row decode's bytes, where its check passed), the block written to the cache in
  one go (``update_block``; a tree's rows over the cache as it was, ``tree_rows``);
- else one SDPA per row, no mask, over the K/V that the cache's single-token updates return
  (``update_rows``: plain decode's updates, one row at a time).

KV-shared layers get the same K/V description from their producer; the rest is mlx-lm's.
"""
from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
from mlx_lm.models import gemma4_text as _gemma4_text
from mlx_lm.models.base import scaled_dot_product_attention

from mlx_mtp import draft_tree
from mlx_mtp.cpu.attention_kernel import KVRows
from mlx_mtp.exactness import row_attention
from mlx_mtp.models.packed_batch import PackedCache


class RowKV(list):
    """Per verify row, the (keys, values) its decode step attends to; what a producer layer
    hands its KV-shared layers inside a verify. ``positions``: each row's position, where the
    rows are not one block from one offset (several sequences' packed rows)."""

    positions = None


class BlockKV(list):
    """Per segment of a verify's rows, ``(first row, width, KVRows)``: the K/V each row's decode
    step sees, read in place by the attention kernel; what a producer that wrote its block in
    one go hands its KV-shared layers. ``positions`` as ``RowKV``'s."""

    positions = None


class Gemma4VerifyAttention(_gemma4_text.Attention):
    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache: Optional[Any] = None,
                 shared_kv: Optional[tuple] = None, offset: Optional[Any] = None):
        if not (isinstance(shared_kv, (RowKV, BlockKV)) or getattr(cache, "verifying", False)
                or isinstance(cache, PackedCache)):
            return super().__call__(x, mask, cache, shared_kv=shared_kv, offset=offset)
        # As gemma4_text.Attention.__call__ (mlx-lm 0.32.2), except the cache update and SDPA.
        B, L, _ = x.shape
        tree = draft_tree.current()
        queries = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim))
        if isinstance(shared_kv, (RowKV, BlockKV)):
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
                rows = self._packed(keys, values, cache)
                rows.positions = positions
            elif tree is None:
                offset = mx.array(cache.offset)
                rows = self._block(self.rope(keys, offset=offset), values, cache)
            else:  # a draft tree's nodes: each at its depth's position, appended along paths
                rows = self._tree(self._rope_rows(keys, tree.positions), values, cache, tree)
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

    def _kernel_fits(self, cache, width: int, keys: mx.array) -> bool:
        """Whether a block of ``width`` rows goes through the attention kernel: the cache can
        take it in one write and the kernel's check passed for the keys its rows see."""
        plan = cache.plan(width)
        return plan is not None and row_attention.applies(
            self.n_heads, keys.shape[1], keys.shape[3], [n for _, n in plan], self.scale,
            keys.dtype)

    def _block(self, keys: mx.array, values: mx.array, cache) -> list:
        """One sequence's block: written in one go where the kernel reads it, else row by row."""
        if self._kernel_fits(cache, keys.shape[2], keys):
            return BlockKV([(0, keys.shape[2], cache.update_block(keys, values))])
        return RowKV(cache.update_rows(keys, values))

    def _packed(self, keys: mx.array, values: mx.array, cache: PackedCache) -> list:
        """Several sequences' blocks, each to its own cache (all written in one go, or all row
        by row)."""
        parts = [(first, w, part, keys[:, :, first : first + w], values[:, :, first : first + w])
                 for first, w, part in cache.segments]
        if all(self._kernel_fits(part, w, k) for _, w, part, k, _ in parts):
            return BlockKV([(first, w, part.update_block(k, v)) for first, w, part, k, v in parts])
        rows = RowKV()
        for _, _, part, k, v in parts:
            rows += part.update_rows(k, v)
        return rows

    def _tree(self, keys: mx.array, values: mx.array, cache, tree: draft_tree.Rows) -> list:
        """A draft tree's rows: the cache fed along every path (``update_tree``, for
        ``keep_path``); the rows read the cache as it was plus their paths' rows."""
        paths = tree.paths()
        seen = cache.tree_rows(keys, values, paths) if keys.dtype == mx.float32 else None
        fed = cache.update_tree(keys, values, paths)
        if seen is not None and row_attention.applies_to(self.n_heads, seen, self.scale):
            return BlockKV([(0, keys.shape[2], seen)])
        return RowKV(fed)

    def attend_rows(self, queries: mx.array, rows: list) -> mx.array:
        """Query row i against row i's K/V alone, unmasked: the SDPA of its decode step (the
        kernel's rows, or one SDPA per row)."""
        if isinstance(rows, BlockKV):
            return mx.concatenate([self._attend(queries[:, :, first : first + w], seen)
                                   for first, w, seen in rows], axis=2)
        row_attention.count_by_rows()
        return mx.concatenate([
            scaled_dot_product_attention(queries[:, :, i : i + 1], k, v, cache=None,
                                         scale=self.scale, mask=None)
            for i, (k, v) in enumerate(rows)], axis=2)

    def _attend(self, queries: mx.array, seen: KVRows) -> mx.array:
        if queries.dtype == mx.float32 and row_attention.applies_to(self.n_heads, seen, self.scale):
            return row_attention.attend(queries, seen, self.scale)
        return row_attention.by_rows(queries, seen, self.scale)  # a KV-shared layer's own check
