"""The MTP head's forward over a few rows, and a whole drafter step around it (embedding lookup,
head, LM head + argmax: ``step``), as one ``mx.compile``d graph traced once per (rows, cache
capacity): at draft sizes a step is bound by per-op overhead, not by its weights. During the
trace the head's KV cache is a ``BufferKV`` (the whole buffer and an offset array), so shapes stay
fixed. docs/models.md, "How the compiled draft step works"."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache

# Rows per compiled call: draft steps (1) and accept hooks (a + 1 <= block size). Longer calls
# (the prompt's prefill) run eagerly.
MAX_ROWS = 16


class BufferKV:
    """A stand-in for mlx-lm's ``KVCache`` inside the traced head: whole buffers, array offset."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array):
        self.keys, self.values, self.offset = keys, values, offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        start = mx.stack([self.offset])
        self.keys = mx.slice_update(self.keys, keys.astype(self.keys.dtype), start, axes=(2,))
        self.values = mx.slice_update(self.values, values.astype(self.values.dtype), start,
                                      axes=(2,))
        return self.keys, self.values

    def make_mask(self, n: int, *args, **kwargs) -> mx.array:
        rows = self.offset + mx.arange(n)
        return mx.arange(self.keys.shape[2])[None, :] <= rows[:, None]


def ensure_capacity(cache: KVCache, rows: int) -> None:
    """Grow ``cache``'s buffers (as ``KVCache`` does, in steps of 256) to hold ``rows`` more."""
    need = cache.offset + rows
    if need <= cache.keys.shape[2]:
        return
    cap = (need + KVCache.step - 1) // KVCache.step * KVCache.step
    grown = []
    for buf in (cache.keys, cache.values):
        new = mx.zeros((*buf.shape[:2], cap, buf.shape[3]), buf.dtype)
        new[..., : cache.offset, :] = buf[..., : cache.offset, :]
        grown.append(new)
    cache.keys, cache.values = grown


class CompiledHead:
    """Calling it is ``head(embeds, hidden, caches)`` for ``S <= MAX_ROWS`` rows through one
    compiled call; the mlx-lm ``KVCache`` objects are updated in place (their
    buffers replaced, their int offset advanced), so eager and compiled calls can alternate.
    ``usable`` says whether a call can go this way (the caches must already hold a buffer: the
    first call, the prompt's prefill, runs eagerly and sets their shapes and dtype)."""

    def __init__(self, head, embed: Optional[Callable] = None, pick: Optional[Callable] = None,
                 fast=None):
        self.head = head
        # ``fast``: a module that computes what ``head`` computes with fewer ops (``fused_head``),
        # traced instead while ``head`` keeps the class it had when ``fast`` was built from it.
        self.fast, self.fast_for = fast, type(head)
        self.embed = embed  # ids [1, S] -> embeddings [1, S, H]
        self.pick = pick  # last row [1, H] -> (ids [1], logits [1, Vd])
        self._fns: Dict[tuple, Callable] = {}

    def _fn(self, whole_step: bool = False) -> Callable:
        key = (type(self.head), whole_step)  # a head whose class is swapped is traced anew
        fn = self._fns.get(key)
        if fn is None:
            head, embed, pick = self.head, self.embed, self.pick
            if self.fast is not None and type(head) is self.fast_for:
                head = self.fast

            def forward(embeds, hidden, offset, bufs):
                caches = [BufferKV(k, v, offset) for k, v in bufs]
                g = head(embeds, hidden, caches)
                return g, [(c.keys, c.values) for c in caches]

            def step(ids, hidden, offset, bufs):
                g, bufs = forward(embed(ids), hidden, offset, bufs)
                tok, logits = pick(g[:, -1])
                return g, tok, logits, bufs

            fn = self._fns[key] = mx.compile(step if whole_step else forward)
        return fn

    @staticmethod
    def usable(rows: int, caches: List[KVCache]) -> bool:
        return rows <= MAX_ROWS and all(c.keys is not None for c in caches)

    def _run(self, fn, first, hidden, caches):
        rows = first.shape[1]
        for c in caches:
            ensure_capacity(c, rows)
        out = fn(first, hidden, mx.array(caches[0].offset, dtype=mx.int32),
                 [(c.keys, c.values) for c in caches])
        for c, (k, v) in zip(caches, out[-1]):
            c.keys, c.values = k, v
            c.offset += rows
        return out[:-1]

    def __call__(self, embeds: mx.array, hidden: mx.array, caches: List[KVCache]) -> mx.array:
        return self._run(self._fn(), embeds, hidden, caches)[0]

    def step(self, ids: mx.array, hidden: mx.array, caches: List[KVCache]):
        """``(g, ids of the last row's argmax [1], its logits [1, Vd])`` for ``ids [1, S]``: the
        embedding lookup, the head and ``pick`` of the last row as one compiled call."""
        return self._run(self._fn(whole_step=True), ids, hidden, caches)
