"""``TrunkTarget``: the part of a target adapter that does not depend on the family, an mlx-lm
model whose text trunk returns post-norm hidden states, and the row-exact verify set-up
(``mlx_mtp.exactness.row_exact_layers``). Family adapters add caches, logits, verify and
rollback (docs/architecture.md, "Adding a family")."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, List

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import gather_last_axis

from mlx_mtp import config as env
from mlx_mtp.exactness import grouped_experts, row_exact_layers

ROW_EXACT_ENV = "MLX_MTP_ROW_EXACT"  # 0: verify with the plain multi-row products


class TrunkTarget:
    def __init__(self, model: nn.Module):
        self.model = model
        # Multimodal / wrapper checkpoints hold the text model at ``.language_model``.
        self.lm = model.language_model if hasattr(model, "language_model") else model
        self.args = self.lm.args
        self.trunk = self.lm.model  # returns the post-final-norm hidden states
        self.exact_width = 1  # verify widths made row-exact so far (see ``prepare``)
        self.row_exact_layers = {}
        self.grouped_expert_layers = {}  # mixture-of-experts layers verified grouped by expert
        self.exact = True  # False: verify without the exactness-only fallbacks (``prepare``)

    @property
    def layers(self):
        """This process's layers (all of them unless mlx-lm's ``pipeline`` split the trunk)."""
        return getattr(self.trunk, "pipeline_layers", self.trunk.layers)

    @property
    def hidden_size(self) -> int:
        return self.args.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def dtype(self):
        return self.trunk.norm.weight.dtype

    def hidden(self, ids: mx.array, cache: List[Any], input_embeddings=None) -> mx.array:
        """Post-norm hidden states ``[1, T, H]`` for ``ids [1, T]`` (or ``input_embeddings
        [1, T, H]`` in their place, as mlx-lm's models take them); advances the cache by T."""
        if input_embeddings is not None:
            return self.trunk(ids, cache, input_embeddings=input_embeddings)
        return self.trunk(ids, cache)

    def prefill(self, ids: mx.array, cache: List[Any], input_embeddings=None) -> mx.array:
        """``hidden`` of a prompt's tokens: here ``hidden``; a family with a faster path bitwise
        equal to it overrides this."""
        return self.hidden(ids, cache, input_embeddings)

    def decode(self, ids: mx.array, cache: List[Any]) -> mx.array:
        """A one-token forward (``ids [1, 1]``) that need not be undone: ``hidden`` here; a
        family with a cheaper path bitwise equal to it overrides this."""
        return self.hidden(ids, cache)

    @property
    def tied_head(self) -> bool:
        return bool(getattr(self.lm, "tie_word_embeddings", self.args.tie_word_embeddings))

    @property
    def lm_head_module(self) -> nn.Module:
        """The module whose rows project onto the vocabulary (the embedding when tied)."""
        return self.trunk.embed_tokens if self.tied_head else self.lm.lm_head

    def prepare(self, max_width: int, exact: bool = True) -> None:
        """Before verifying blocks of up to ``max_width`` tokens: make the linear layers whose
        kernel is not row-invariant at those widths compute verify rows one at a time, and the
        mixture-of-experts layers read each routed expert once (``grouped_experts``).
        ``exact=False`` (sampling, whose promise is the distribution; or the gate overridden by
        MLX_MTP_ALLOW_INEXACT=1), or MLX_MTP_ROW_EXACT=0: verify with the plain multi-row
        kernels, no row-exact products, no per-row attention."""
        exact = exact and env.flag(ROW_EXACT_ENV)  # MLX_MTP_ROW_EXACT=0: the plain verify
        self.exact = exact
        if exact and max_width > self.exact_width:
            self.row_exact_layers = row_exact_layers.switch_to_row_exact(self.model, max_width,
                                                      tied_head=self.tied_head)
            self.grouped_expert_layers = grouped_experts.switch_to_grouped(self.model, max_width)
            self.exact_width = max_width

    def project(self, hidden: mx.array) -> mx.array:
        """The LM head (tied or own). Decode projects one row at a time, so several rows are
        the verify case: row-exact."""
        with self._verifying():
            if self.tied_head:
                return self.trunk.embed_tokens.as_linear(hidden)
            logits = self.lm.lm_head(hidden)
            if self.head_group is not None:  # tensor split: each rank holds a vocab slice
                logits = gather_last_axis(logits, self.head_group)
            return logits

    @property
    def head_group(self):
        """The group an untied LM head is split over by mlx-lm's ``shard`` (else None)."""
        return None if self.tied_head else getattr(self.lm, "sharding_group", None)

    def flagged_trunk(self, ids: mx.array, cache: List[Any], cache_type, flag: str) -> mx.array:
        """A verify: ``hidden`` with the row-exact layers on and ``flag`` set on the caches of
        ``cache_type`` for this one call (how it tells its caches to keep what a rollback needs)."""
        flagged = [c for c in cache if isinstance(c, cache_type)]
        for c in flagged:
            setattr(c, flag, True)
        try:
            with self._verifying():
                return self.trunk(ids, cache)
        finally:
            for c in flagged:
                setattr(c, flag, False)

    def _verifying(self):
        """The row-exact context of a verify, unless exactness was waived (``prepare``)."""
        return row_exact_layers.verifying() if self.exact else nullcontext()
