"""Target adapters whose verify path misbehaves on purpose, to make the exactness probe's failure
modes testable without a GPU."""

from __future__ import annotations

import mlx.core as mx

_BITS = {mx.float32: mx.uint32, mx.float16: mx.uint16, mx.bfloat16: mx.uint16}


def one_ulp(h: mx.array, position: int) -> mx.array:
    """``h [1, T, H]`` with every element of row ``position`` moved one ulp away from zero."""
    if position >= h.shape[1]:
        return h
    bits = h.view(_BITS[h.dtype])
    row = (mx.arange(h.shape[1]) == position)[None, :, None]
    return mx.where(row, bits + 1, bits).view(h.dtype)


class CountingTarget:
    """Delegates everything to ``inner``; counts verify forwards."""

    def __init__(self, inner):
        self.inner = inner
        self.verify_calls = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def verify(self, ids, cache):
        self.verify_calls += 1
        return self.inner.verify(ids, cache)


class PerturbedVerify(CountingTarget):
    """A verify forward whose row ``position`` is one ulp off: what a multi-row kernel that
    rounds differently from the one-row kernel looks like."""

    def __init__(self, inner, position: int = 0):
        super().__init__(inner)
        self.position = position

    def verify(self, ids, cache):
        return one_ulp(super().verify(ids, cache), self.position)


class BrokenVerify(CountingTarget):
    def verify(self, ids, cache):
        super().verify(ids, cache)
        raise RuntimeError("verify is broken\nsecond line")
