"""Target adapter for Gemma 4 (``gemma4_text``, and the multimodal ``gemma4`` / ``gemma4_unified``
wrappers, which hold a ``gemma4_text.Model`` at ``.language_model``). Spec ``gemma4-mtp.md`` §3.

The target is mlx-lm's own model, unchanged. Only the cache differs: sliding layers get a
``SlidingWindowCache`` (always trimmable, bit-identical to mlx-lm's plain decode) instead of
``RotatingKVCache``, which cannot be rolled back once the context passes the window.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma4_text as _gemma4_text
from mlx_lm.models.cache import KVCache

from ..sliding_cache import SlidingWindowCache
from .base import TrunkTarget

GEMMA4_MODEL_TYPES = ("gemma4_text", "gemma4", "gemma4_unified")
SLIDING, FULL = "sliding_attention", "full_attention"


class Gemma4Target(TrunkTarget):
    """What the round loop, the exactness probe and the assistant drafter need from a Gemma 4
    target. Same interface as ``Qwen3_5Target``."""

    family = "gemma4"

    def __init__(self, model: nn.Module):
        super().__init__(model)
        if not isinstance(self.lm, _gemma4_text.Model):
            raise TypeError(f"not a Gemma 4 text model: {type(self.lm).__name__}")
        # Layers that own a cache; the KV-shared ones read the last own layer of their type.
        self.num_cached = self.args.num_hidden_layers - self.args.num_kv_shared_layers
        self.producers: Dict[str, int] = {}
        for i in range(self.num_cached):
            self.producers[self.args.layer_types[i]] = i

    @property
    def window(self) -> int:
        return self.args.sliding_window

    def make_cache(self) -> List[Any]:
        return [KVCache() if self.args.layer_types[i] == FULL else SlidingWindowCache(self.window)
                for i in range(self.num_cached)]

    def embed(self, ids: mx.array) -> mx.array:
        """The input embedding as the first layer sees it: ``embed_tokens(ids) * sqrt(H)``,
        multiplied in the table's dtype like ``Gemma4TextModel`` does."""
        return self.trunk.embed_tokens(ids) * self.trunk.embed_scale

    def logits(self, hidden: mx.array) -> mx.array:
        """The same ops as ``gemma4_text.Model.__call__``: tied or own head, then the softcap."""
        if self.lm.tie_word_embeddings:
            out = self.trunk.embed_tokens.as_linear(hidden)
        else:
            out = self.lm.lm_head(hidden)
        if self.lm.final_logit_softcapping is not None:
            out = _gemma4_text.logit_softcap(self.lm.final_logit_softcapping, out)
        return out

    def verify(self, ids: mx.array, cache: List[Any]) -> mx.array:
        """Like ``hidden``, with every row computed as the single-token decode step it stands
        for (the sliding caches lay each row's window out in plain decode's ring order)."""
        return self.flagged_trunk(ids, cache, SlidingWindowCache, "decode")

    def rollback(self, cache: List[Any], fed: int, keep: int) -> None:
        """Keep the first ``keep`` of the ``fed`` tokens of the last verify."""
        if keep < fed:
            for c in cache:
                if c.trim(fed - keep) != fed - keep:
                    raise RuntimeError(f"cache {type(c).__name__} refused to trim {fed - keep}")

    def cache_state(self, cache: List[Any]) -> List[mx.array]:
        """The arrays that hold the committed state (for eval and for bitwise comparisons):
        everything for full layers, the visible window for sliding ones."""
        out = []
        for c in cache:
            if isinstance(c, SlidingWindowCache):
                if c.keys is not None:
                    out += list(c.committed())
            elif c.keys is not None:
                out += [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
        return out

    # -- what the assistant drafter reads ---------------------------------------------------------

    def offset(self, cache: List[Any]) -> int:
        """Committed positions (the position of the next token fed)."""
        return cache[0].offset

    def shared_kv(self, cache: List[Any], query_position: int) -> Dict[str, Tuple[mx.array, mx.array]]:
        """Per layer type, the K/V of the target's last own layer of that type that a query at
        ``query_position`` may attend to: committed positions only (``< offset``), and for
        sliding layers only those inside the query's window. Slices, no copy."""
        p = self.offset(cache)
        out = {}
        for layer_type, i in self.producers.items():
            c = cache[i]
            if layer_type == SLIDING:
                out[layer_type] = c.window_kv(max(0, query_position - self.window + 1), p)
            else:
                out[layer_type] = (c.keys[..., :p, :], c.values[..., :p, :])
        return out
