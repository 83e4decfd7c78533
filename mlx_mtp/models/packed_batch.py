"""Several sequences' rows in one forward: a batch packed along the row axis.

A batched verify (or a batched drafter step) feeds one ``[1, L, ...]`` input whose rows are the
sequences' blocks one after another, ``widths[s]`` rows for sequence s. Every row-wise piece of
the forward (products, norms, MLPs) runs once over all L rows, reading each weight once; the
pieces that read a sequence's own state take a ``PackedCache`` per layer instead of a cache, and
handle each sequence's rows against its own cache (``parts[s]``): attention at the sequence's own
positions against its own keys, a GatedDeltaNet layer from its own recurrent state.
"""

from __future__ import annotations

from typing import Any, List

import mlx.core as mx


class PackedCache:
    """One layer's caches of the packed sequences, and how many rows each has in this forward."""

    def __init__(self, parts: List[Any], widths: List[int]):
        if len(parts) != len(widths) or not parts or min(widths) < 1:
            raise ValueError(f"a packed forward needs one cache and a width >= 1 per sequence, "
                             f"got {len(parts)} caches and widths {widths}")
        self.parts = parts
        self.widths = widths

    def make_mask(self, *args, **kwargs):
        """No mask: each layer that reads a cache attends per sequence (mlx-lm asks the cache)."""
        return None

    @property
    def segments(self):
        """``(first row, width, cache)`` per sequence."""
        first = 0
        for part, w in zip(self.parts, self.widths):
            yield first, w, part
            first += w


def packed_caches(caches: List[List[Any]], widths: List[int]) -> List[PackedCache]:
    """Per layer, the ``PackedCache`` of the sequences' caches (``caches[s]``: sequence s's
    per-layer list)."""
    return [PackedCache(list(parts), widths) for parts in zip(*caches)]


def split_rows(x: mx.array, widths: List[int], axis: int = 1) -> List[mx.array]:
    """``x``'s packed rows along ``axis`` as one array per sequence."""
    out, first = [], 0
    for w in widths:
        idx = [slice(None)] * x.ndim
        idx[axis] = slice(first, first + w)
        out.append(x[tuple(idx)])
        first += w
    return out
