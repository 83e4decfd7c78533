"""A sliding-window KV cache that can always roll back, for speculative decoding (Gemma 4).

mlx-lm's ``RotatingKVCache`` refuses to trim once ``offset >= max_size`` (``is_trimmable()`` turns
False and ``trim_prompt_cache`` then silently trims nothing), so rejected drafts would stay in the
window and corrupt the output (spec ``gemma4-mtp.md`` §3.3). This cache keeps the window in
temporal order in a buffer bounded by ``window + slack`` entries and can always drop the last
update.

It is also built to reproduce mlx-lm's plain decode bit for bit. On MLX's CPU backend an
attention row's result depends on the ORDER of the keys it attends to (summation order), though
not on keys that its mask hides. Plain decode attends, for each new token, to the stock ring
buffer in slot order, which is a rotation of the window. So:
- prefill (multi-token calls before the first single-token one) returns exactly the tensor and
  mask the stock cache's concat path returns;
- from the first single-token call on ("decode"), every query row sees its window in the slot
  order the stock ring would hold for that position, also inside a multi-token verify block
  (the rows of a block are laid out so that each row's unmasked keys come in its own ring order).
Slot of position ``p`` in the stock ring during decode: ``(p - max(O, W)) % W``, where ``O`` is the
offset at the first single-token update (derived from ``RotatingKVCache._update_in_place`` with
``keep=0``; ``tests/test_sliding_cache.py`` checks it against the stock class).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache


@lru_cache(maxsize=64)
def _decode_layout(offset: int, n: int, window: int, ring_base: int):
    """Absolute key positions and the boolean mask [n, len] for query rows ``offset..offset+n-1``,
    each row's unmasked keys in the stock ring's slot order (newest segment first)."""
    rows = np.arange(offset, offset + n)
    base = rows - (rows - ring_base) % window  # position held by ring slot 0 for each row
    positions, masks = [], []
    for b in np.unique(base):
        group = rows[base == b]
        lo = max(0, int(group[0]) - window + 1)
        seg_a = np.arange(b, group[-1] + 1)  # slots 0..j: b .. q
        seg_b = np.arange(lo, b)  # slots j+1..W-1: q-W+1 .. b-1
        positions.append(np.concatenate([seg_a, seg_b]))
        m = np.zeros((n, seg_a.size + seg_b.size), dtype=bool)
        for r, q in enumerate(rows):
            if base[r] == b:
                m[r, : seg_a.size] = seg_a <= q
                m[r, seg_a.size :] = seg_b > q - window
        masks.append(m)
    positions = np.concatenate(positions)
    mask = np.concatenate(masks, axis=1)
    return positions, mask


class SlidingWindowCache(_BaseCache):
    """Drop-in for ``RotatingKVCache(max_size=window, keep=0)`` in a Gemma 4 target, with an
    always-valid ``trim`` of up to the whole last update."""

    step = 256

    def __init__(self, window: int):
        if window < 1:
            raise ValueError(f"window must be positive, got {window}")
        self.window = window
        self.keys = None  # [B, n_kv, capacity, hd], temporal order from position ``start``
        self.values = None
        self.start = 0  # absolute position of buffer index 0
        self.offset = 0  # committed positions (the next query's position)
        self.ring_base = None  # max(O, W) once decoding started; None while prefilling
        self.decode = False  # set by the target's verify: treat a multi-token call as decode

    # -- layout -------------------------------------------------------------------------------

    def _decoding(self, n: int) -> bool:
        return self.ring_base is not None or self.decode or n == 1

    def _ring_base(self) -> int:
        return self.ring_base if self.ring_base is not None else max(self.offset, self.window)

    def _layout(self, n: int) -> Tuple[Optional[np.ndarray], object]:
        """(key positions or None for a contiguous prefill slice, mask) for ``n`` new queries."""
        if not self._decoding(n):
            return None, None
        positions, mask = _decode_layout(self.offset, n, self.window, self._ring_base())
        return positions, (None if n == 1 else mask)

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        if self._decoding(N):
            mask = self._layout(N)[1]
            return None if mask is None else mx.array(mask)
        # Prefill: the stock concat path's mask (it keeps min(W - 1, offset) old entries).
        offset = min(self.window - 1, self.offset)
        if offset + N > self.window or return_array:
            return create_causal_mask(N, offset, window_size=self.window)
        return "causal"

    # -- storage ------------------------------------------------------------------------------

    def _append(self, keys: mx.array, values: mx.array) -> None:
        n = keys.shape[2]
        end = self.offset - self.start  # buffer index of the next position
        if self.keys is None or end + n > self.keys.shape[2]:
            # Keep the last ``window`` committed positions: enough for this call (it needs
            # offset - W + 1 on), for a rollback of all of it, and for the drafter's view.
            keep_from = max(self.start, self.offset - self.window)
            B, n_kv, _, k_dim = keys.shape
            kept = self.offset - keep_from
            cap = ((kept + n + self.step - 1) // self.step) * self.step
            new_k = mx.zeros((B, n_kv, cap, k_dim), keys.dtype)
            new_v = mx.zeros((B, n_kv, cap, values.shape[3]), values.dtype)
            if kept:
                i = keep_from - self.start
                new_k[..., :kept, :] = self.keys[..., i : i + kept, :]
                new_v[..., :kept, :] = self.values[..., i : i + kept, :]
            self.keys, self.values, self.start = new_k, new_v, keep_from
            end = kept
        self.keys[..., end : end + n, :] = keys
        self.values[..., end : end + n, :] = values

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        n = keys.shape[2]
        positions, _ = self._layout(n)
        if positions is None:
            lo = self.offset - min(self.window - 1, self.offset)
        elif self.ring_base is None:
            self.ring_base = self._ring_base()
        self._append(keys, values)
        self.offset += n
        if positions is None:  # prefill: old tail + new chunk, temporal order
            i, j = lo - self.start, self.offset - self.start
            return self.keys[..., i:j, :], self.values[..., i:j, :]
        idx = mx.array(positions - self.start, dtype=mx.int32)
        return mx.take(self.keys, idx, axis=2), mx.take(self.values, idx, axis=2)

    # -- views and rollback ---------------------------------------------------------------------

    def window_kv(self, lo: int, hi: int) -> Tuple[mx.array, mx.array]:
        """Keys and values of absolute positions ``lo..hi-1`` in temporal order."""
        if not self.start <= lo <= hi <= self.offset:
            raise ValueError(f"positions {lo}..{hi - 1} are not held (cache holds "
                             f"{self.start}..{self.offset - 1})")
        i, j = lo - self.start, hi - self.start
        return self.keys[..., i:j, :], self.values[..., i:j, :]

    def committed(self) -> Tuple[mx.array, mx.array]:
        """The window that future queries can see: the last ``min(offset, W)`` positions."""
        return self.window_kv(max(0, self.offset - self.window), self.offset)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` positions; raises instead of trimming less than asked. The whole
        last update can always be dropped (the buffer keeps ``window`` positions before it)."""
        if n < 0:
            raise ValueError(f"cannot trim {n} positions")
        need = max(0, self.offset - n - self.window)
        if need < self.start:
            raise ValueError(f"cannot trim {n} positions: the window would then need position "
                             f"{need}, the cache holds {self.start}..{self.offset - 1}")
        self.offset -= n
        return n

    def size(self) -> int:
        return min(self.offset, self.window)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes
