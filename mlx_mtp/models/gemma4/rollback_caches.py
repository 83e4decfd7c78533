"""mlx-lm's ``KVCache`` and ``RotatingKVCache`` in subclasses whose rollback always works and keeps
plain decode's bits: a verify block goes in as one single-token update per row, keeping the state
after each, and a rollback restores the state after the last kept row, bit for bit and in layout
(ring order, buffer capacity) what plain decode holds, also past the sliding window, where
mlx-lm's rotating cache cannot be trimmed. docs/architecture.md, "Rollback"."""

from __future__ import annotations

from typing import List, Optional, Tuple

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache


def _snapshot(state) -> tuple:
    return tuple(x[...] if isinstance(x, mx.array) else x for x in state)


class _RowRollback:
    """Mixin over an mlx-lm cache class: row-by-row verify updates and rollback by restore."""

    verifying = False  # set by the target's verify for the duration of the forward
    _states: Optional[List[tuple]] = None  # states before and after each row of the last verify

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self._states = None  # any other update ends what a trim may undo
        return super().update_and_fetch(keys, values)

    def update_rows(self, keys: mx.array, values: mx.array) -> List[Tuple[mx.array, mx.array]]:
        """Append ``keys``/``values [B, n_kv, L, hd]`` one position at a time, as plain decode
        does; return, per row, the K/V its decode step attends to."""
        rows, states = [], [_snapshot(self.state)]
        for i in range(keys.shape[2]):
            # the parent's single-token update (the in-place ring path for RotatingKVCache); it
            # may return its own buffer objects, which the next row's update overwrites
            rows.append(_snapshot(super().update_and_fetch(keys[..., i : i + 1, :],
                                                           values[..., i : i + 1, :])))
            states.append(_snapshot(self.state))
        self._states = states
        return rows

    def update_tree(self, keys: mx.array, values: mx.array, paths: List[List[int]]
                    ) -> List[Tuple[mx.array, mx.array]]:
        """A draft tree's rows (``keys``/``values [B, n_kv, L, hd]``, row 0 the root): each
        root-to-leaf path of row indices is appended one row at a time from the cache's state,
        as ``update_rows`` appends a chain. Returns, per row, the K/V its decode step would
        attend to; ``keep_path`` then keeps one path."""
        base = _snapshot(self.state)
        rows: List[Optional[Tuple[mx.array, mx.array]]] = [None] * keys.shape[2]
        self._tree = []
        for path in paths:
            self.state = _snapshot(base)  # fresh objects: the updates below write in place
            states = [base]
            for i in path:
                kv = _snapshot(super().update_and_fetch(keys[..., i : i + 1, :],
                                                        values[..., i : i + 1, :]))
                if rows[i] is None:
                    rows[i] = kv
                states.append(_snapshot(self.state))
            self._tree.append((path, states))
        self._states = None
        return rows

    def keep_path(self, path: List[int]) -> None:
        """After ``update_tree``: the state after the rows ``path`` (root first), which ``trim``
        can then roll back like a chain's rows."""
        states = next(s for p, s in self._tree if p[: len(path)] == path)
        self._tree = None
        self._states = states[: len(path) + 1]
        self.state = self._states[-1]

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` rows of the last verify block. Raises instead of trimming less."""
        if n == 0:
            return 0
        held = -1 if self._states is None else len(self._states) - 1
        if not 0 < n <= held:
            raise ValueError(f"cannot trim {n} positions: only the {max(held, 0)} rows of the last "
                             "verify block can be rolled back")
        self._states = self._states[: held + 1 - n]
        self.state = self._states[-1]
        return n


class RollbackKVCache(_RowRollback, KVCache):
    """Full attention: mlx-lm's ``KVCache`` with an exact, layout-preserving rollback."""

    def window(self, lo: int, hi: int) -> Tuple[mx.array, mx.array]:
        """K/V of positions ``lo..hi-1`` (temporal order)."""
        return self.keys[..., lo:hi, :], self.values[..., lo:hi, :]


class RollbackRotatingKVCache(_RowRollback, RotatingKVCache):
    """Sliding attention: mlx-lm's ``RotatingKVCache`` (bounded ring) that can always roll back
    the last verify block, also past the window."""

    def __init__(self, max_size: int):
        super().__init__(max_size=max_size, keep=0)

    def window(self, lo: int, hi: int) -> Tuple[mx.array, mx.array]:
        """K/V of positions ``lo..hi-1`` (temporal order); ``hi`` must be the offset and the
        positions still in the buffer."""
        keys, values = self._temporal_order(self.keys), self._temporal_order(self.values)
        n = keys.shape[2]  # positions offset - n .. offset - 1
        if hi != self.offset or not 0 <= hi - lo <= n:
            raise ValueError(f"positions {lo}..{hi - 1} are not held (cache holds "
                             f"{self.offset - n}..{self.offset - 1})")
        return keys[..., n - (hi - lo) :, :], values[..., n - (hi - lo) :, :]
