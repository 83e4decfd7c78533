"""The part of a target adapter that does not depend on the family: an mlx-lm model whose text
trunk returns post-norm hidden states. Family adapters add caches, logits, verify and rollback.
(``Gemma4Target`` inherits it; ``Qwen3_5Target`` still spells the same lines out.)"""

from __future__ import annotations

from typing import Any, List

import mlx.core as mx
import mlx.nn as nn


class TrunkTarget:
    def __init__(self, model: nn.Module):
        self.model = model
        # Multimodal / wrapper checkpoints hold the text model at ``.language_model``.
        self.lm = model.language_model if hasattr(model, "language_model") else model
        self.args = self.lm.args
        self.trunk = self.lm.model  # returns the post-final-norm hidden states

    @property
    def layers(self):
        return self.trunk.layers

    @property
    def hidden_size(self) -> int:
        return self.args.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def dtype(self):
        return self.trunk.norm.weight.dtype

    def hidden(self, ids: mx.array, cache: List[Any]) -> mx.array:
        """Post-norm hidden states ``[1, T, H]`` for ``ids [1, T]``; advances the cache by T."""
        return self.trunk(ids, cache)

    def flagged_trunk(self, ids: mx.array, cache: List[Any], cache_type, flag: str) -> mx.array:
        """``hidden`` with ``flag`` set on the caches of ``cache_type`` for this one call (how a
        verify tells its caches to keep what a rollback needs)."""
        flagged = [c for c in cache if isinstance(c, cache_type)]
        for c in flagged:
            setattr(c, flag, True)
        try:
            return self.trunk(ids, cache)
        finally:
            for c in flagged:
                setattr(c, flag, False)
