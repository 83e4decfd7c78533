"""mlx-lm's ``KVCache`` and ``RotatingKVCache`` in subclasses whose rollback always works and keeps
plain decode's bits: a verify block goes in as one single-token update per row, keeping the state
after each, and a rollback restores the state after the last kept row, bit for bit and in layout
(ring order, buffer capacity) what plain decode holds, also past the sliding window, where
mlx-lm's rotating cache cannot be trimmed. docs/architecture.md, "Rollback".

Where the block's rows neither grow nor trim the buffer, ``update_block`` writes them in one go
instead (in place, not copied once per row) and describes the keys each row's decode step sees
(``KVRows``: the attention kernel reads them in place); rolling back then writes back what the
dropped rows overwrote (zeros past a full cache's offset, as plain decode holds there; a ring's
evicted rows)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

from mlx_mtp.cpu.attention_kernel import KVRows


def _snapshot(state) -> tuple:
    return tuple(x[...] if isinstance(x, mx.array) else x for x in state)


@dataclass
class _Block:
    """A verify block written in one go (``update_block``): where its rows went, the state
    before it, and what its rows overwrote (None: zeros)."""

    slots: List[int]
    offset: int
    idx: Optional[int]
    old: Optional[Tuple[mx.array, mx.array]]
    kept: int


def _runs(slots: List[int]) -> List[Tuple[int, int, int]]:
    """``(first row, first slot, count)`` of each stretch of consecutive slots."""
    runs = []
    for i, s in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == s:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, s, 1))
    return runs


def _write(buffer: mx.array, rows: mx.array, slots: List[int]) -> None:
    """``buffer[..., slots[i], :] = rows[..., i, :]``, a stretch of slots at a time (in place)."""
    for i, s, n in _runs(slots):
        buffer[..., s : s + n, :] = rows[..., i : i + n, :]


class _RowRollback:
    """Mixin over an mlx-lm cache class: row-by-row verify updates and rollback by restore."""

    verifying = False  # set by the target's verify for the duration of the forward
    _states: Optional[List[tuple]] = None  # states before and after each row of the last verify
    _block: Optional[_Block] = None  # the last verify, written in one go (``update_block``)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self._states = self._block = None  # any other update ends what a trim may undo
        return super().update_and_fetch(keys, values)

    def plan(self, n: int) -> Optional[List[Tuple[int, int]]]:
        """Per row of ``n`` single-token updates from the current state, ``(slot it is written
        to, keys its decode step sees)``; None where one would grow or trim the buffer (or the
        slots repeat)."""
        raise NotImplementedError

    def update_block(self, keys: mx.array, values: mx.array) -> KVRows:
        """``update_rows``'s result, as one write of the block (``keys``/``values
        [1, n_kv, L, hd]``) where ``plan(L)`` allows it: every row's keys as ``KVRows`` over
        the buffer after the write (a ring's rows that a later row overwrote as overrides).
        ``trim`` rolls it back exactly."""
        plan = self.plan(keys.shape[2])
        if plan is None:
            raise ValueError("update_block: the block would grow or trim the buffer")
        slots, seen = [p[0] for p in plan], [p[1] for p in plan]
        old = self._overwritten(slots, seen)
        block = _Block(slots, self.offset, getattr(self, "_idx", None), old, len(slots))
        _write(self.keys, keys, slots)
        _write(self.values, values, slots)
        self._advance(len(slots), slots[-1])
        self._states, self._block = None, block
        if old is None:
            return KVRows(self.keys[..., : max(seen), :], self.values[..., : max(seen), :], seen)
        overrides = [sorted((slots[j], j) for j in range(i + 1, len(slots)) if slots[j] < seen[i])
                     for i in range(len(slots))]
        return KVRows(self.keys[..., : max(seen), :], self.values[..., : max(seen), :], seen,
                      overrides, *old)

    def tree_rows(self, keys: mx.array, values: mx.array, paths: List[List[int]]
                  ) -> Optional[KVRows]:
        """Before ``update_tree`` of the same rows: the keys each row's decode step sees (its
        path's rows over the current state), as ``KVRows``; None where the deepest path would
        grow or trim the buffer."""
        plan = self.plan(max(len(p) for p in paths))
        if plan is None:
            return None
        n = keys.shape[2]
        lengths, overrides = [0] * n, [[] for _ in range(n)]
        for path in paths:
            for t, i in enumerate(path):
                lengths[i] = plan[t][1]
                overrides[i] = sorted((plan[d][0], path[d]) for d in range(t + 1))
        base = self.keys[..., : self._held(), :], self.values[..., : self._held(), :]
        return KVRows(*base, lengths, overrides, keys, values)

    def _held(self) -> int:
        """Rows of the buffer that hold positions (the rest are zeros)."""
        return self.keys.shape[2]

    def _overwritten(self, slots: List[int], seen: List[int]):
        """What the block's rows overwrite that an earlier row of the block still sees (None:
        nothing, only zeros past the offset)."""
        return None

    def _advance(self, n: int, last_slot: int) -> None:
        self.offset += n

    def _restore(self, block: _Block, keep: int) -> None:
        """The state after the block's first ``keep`` rows."""
        drop = block.slots[keep : block.kept]
        if block.old is None:
            zeros = mx.zeros((*self.keys.shape[:2], len(drop), self.keys.shape[3]), self.keys.dtype)
            zv = mx.zeros((*self.values.shape[:2], len(drop), self.values.shape[3]),
                          self.values.dtype)
            _write(self.keys, zeros, drop)
            _write(self.values, zv, drop)
        else:
            _write(self.keys, block.old[0][..., keep : block.kept, :], drop)
            _write(self.values, block.old[1][..., keep : block.kept, :], drop)
        self.offset = block.offset + keep

    def update_rows(self, keys: mx.array, values: mx.array) -> List[Tuple[mx.array, mx.array]]:
        """Append ``keys``/``values [B, n_kv, L, hd]`` one position at a time, as plain decode
        does; return, per row, the K/V its decode step attends to."""
        self._block = None
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
        self._block = None
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
        if self._block is not None:
            held = self._block.kept
            if not 0 < n <= held:
                raise ValueError(f"cannot trim {n} positions: only the {held} rows of the last "
                                 "verify block can be rolled back")
            self._restore(self._block, held - n)
            self._block.kept = held - n
            return n
        held = -1 if self._states is None else len(self._states) - 1
        if not 0 < n <= held:
            raise ValueError(f"cannot trim {n} positions: only the {max(held, 0)} rows of the last "
                             "verify block can be rolled back")
        self._states = self._states[: held + 1 - n]
        self.state = self._states[-1]
        return n


class RollbackKVCache(_RowRollback, KVCache):
    """Full attention: mlx-lm's ``KVCache`` with an exact, layout-preserving rollback."""

    def plan(self, n: int) -> Optional[List[Tuple[int, int]]]:
        if self.keys is None or self.offset + n > self.keys.shape[2]:
            return None  # the buffer would grow
        return [(self.offset + i, self.offset + i + 1) for i in range(n)]

    def _held(self) -> int:
        return self.offset

    def window(self, lo: int, hi: int) -> Tuple[mx.array, mx.array]:
        """K/V of positions ``lo..hi-1`` (temporal order)."""
        return self.keys[..., lo:hi, :], self.values[..., lo:hi, :]


class RollbackRotatingKVCache(_RowRollback, RotatingKVCache):
    """Sliding attention: mlx-lm's ``RotatingKVCache`` (bounded ring) that can always roll back
    the last verify block, also past the window."""

    def __init__(self, max_size: int):
        super().__init__(max_size=max_size, keep=0)

    def plan(self, n: int) -> Optional[List[Tuple[int, int]]]:
        """As ``RotatingKVCache._update_in_place`` would place n single-token updates."""
        if self.keys is None:
            return None
        size, idx, offset, out = self.keys.shape[2], self._idx, self.offset, []
        for _ in range(n):
            if (offset >= size and size < self.max_size) or size > self.max_size:
                return None  # it would grow, or trim a prefill's longer buffer
            if idx == self.max_size:
                idx = self.keep
            out.append((idx, offset + 1 if offset + 1 < size else size))
            idx, offset = idx + 1, offset + 1
        return out if len({s for s, _ in out}) == n else None

    def _overwritten(self, slots: List[int], seen: List[int]):
        """The rows at the slots before the block (zeros where the ring is not yet full), which
        the block's earlier rows still see and a rollback writes back."""
        runs = [(self.keys[..., s : s + c, :], self.values[..., s : s + c, :])
                for _, s, c in _runs(slots)]
        return (mx.concatenate([k for k, _ in runs], axis=2),
                mx.concatenate([v for _, v in runs], axis=2))

    def _advance(self, n: int, last_slot: int) -> None:
        self.offset += n
        self._idx = last_slot + 1

    def _restore(self, block: _Block, keep: int) -> None:
        super()._restore(block, keep)
        self._idx = block.slots[keep - 1] + 1 if keep else block.idx

    def window(self, lo: int, hi: int) -> Tuple[mx.array, mx.array]:
        """K/V of positions ``lo..hi-1`` (temporal order); ``hi`` must be the offset and the
        positions still in the buffer."""
        keys, values = self._temporal_order(self.keys), self._temporal_order(self.values)
        n = keys.shape[2]  # positions offset - n .. offset - 1
        if hi != self.offset or not 0 <= hi - lo <= n:
            raise ValueError(f"positions {lo}..{hi - 1} are not held (cache holds "
                             f"{self.offset - n}..{self.offset - 1})")
        return keys[..., n - (hi - lo) :, :], values[..., n - (hi - lo) :, :]
