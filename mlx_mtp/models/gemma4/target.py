"""Target adapter for Gemma 4 (``gemma4_text``, and the multimodal ``gemma4`` / ``gemma4_unified``
wrappers, which hold a ``gemma4_text.Model`` at ``.language_model``).

The target is mlx-lm's own model and mlx-lm's own cache classes, in subclasses
(``rollback_caches``) that can always roll back a verify block, also past the sliding window where
``RotatingKVCache`` refuses to trim. The attention modules become ``Gemma4VerifyAttention``:
mlx-lm's class, except that a verify block is fed and attended row by row, as decode does. So a
verify row's logits, and the caches after a rollback, are bitwise what plain decode computes.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma4_text as _gemma4_text

from mlx_mtp import draft_tree
from mlx_mtp.models.packed_batch import packed_caches, split_rows
from mlx_mtp.models.gemma4.rollback_caches import RollbackKVCache, RollbackRotatingKVCache
from mlx_mtp.models.target_base import TrunkTarget
from mlx_mtp.models.gemma4.attention import Gemma4VerifyAttention

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
        for layer in self.layers:
            if type(layer.self_attn) is _gemma4_text.Attention:
                layer.self_attn.__class__ = Gemma4VerifyAttention

    @property
    def window(self) -> int:
        return self.args.sliding_window

    def make_cache(self) -> List[Any]:
        """What ``gemma4_text.Model.make_cache`` makes, in the rollback-safe subclasses."""
        return [RollbackKVCache() if self.args.layer_types[i] == FULL
                else RollbackRotatingKVCache(self.window) for i in range(self.num_cached)]

    def embed(self, ids: mx.array) -> mx.array:
        """The input embedding as the first layer sees it: ``embed_tokens(ids) * sqrt(H)``,
        multiplied in the table's dtype like ``Gemma4TextModel`` does."""
        return self.trunk.embed_tokens(ids) * self.trunk.embed_scale

    def logits(self, hidden: mx.array) -> mx.array:
        """The same ops as ``gemma4_text.Model.__call__``: tied or own head, then the softcap."""
        out = self.project(hidden)
        if self.lm.final_logit_softcapping is not None:
            out = _gemma4_text.logit_softcap(self.lm.final_logit_softcapping, out)
        return out

    def verify(self, ids: mx.array, cache: List[Any]) -> mx.array:
        """Like ``hidden``, with every row computed as the single-token decode step it stands
        for (fed to the caches one by one, attending on its own); ``rollback`` can undo it."""
        return self.flagged_trunk(ids, cache, (RollbackKVCache, RollbackRotatingKVCache),
                                  "verifying")

    def verify_tree(self, ids: mx.array, cache: List[Any], tree: draft_tree.DraftTree
                    ) -> mx.array:
        """``verify`` of a draft tree's nodes (``ids [1, n]``: the root, then ``tree``'s nodes
        breadth first): each row at its depth's position, the caches fed along every
        root-to-leaf path, so every row is the decode step of the chain through its ancestors;
        ``keep_path`` commits one path."""
        with draft_tree.laid_out(draft_tree.node_rows(tree, self.offset(cache))):
            return self.verify(ids, cache)

    def verify_batch(self, blocks: List[mx.array], caches: List[List[Any]]) -> List[mx.array]:
        """``verify`` of several sequences' blocks in one forward, their rows packed
        (``mlx_mtp.models.packed_batch``): each row is fed to its own sequence's caches and
        attends on its own, so each sequence's hidden states ``[1, w_s, H]`` and caches are what
        ``verify`` of its block alone gives."""
        widths = [b.shape[0] for b in blocks]
        with self._verifying():
            hidden = self.trunk(mx.concatenate(blocks)[None], packed_caches(caches, widths))
        return split_rows(hidden, widths)

    def keep_path(self, cache: List[Any], fed: int, path: List[int]) -> None:
        """After ``verify_tree``: the caches as after the nodes ``path`` (root first) fed one by
        one, which a later ``rewind`` can roll back as a chain's rows."""
        for c in cache:
            c.keep_path(path)

    def rollback(self, cache: List[Any], fed: int, keep: int) -> None:
        """Keep the first ``keep`` of the ``fed`` tokens of the last verify (the caches restore
        their state after row ``keep``; they raise rather than trim less)."""
        for c in cache:
            c.trim(fed - keep)

    def rewind(self, cache: List[Any], kept: int, keep: int) -> None:
        """After ``rollback`` kept ``kept`` tokens of the last verify, keep only its first
        ``keep`` (the caller stopped reading mid-round): the caches still hold those rows' states."""
        for c in cache:
            c.trim(kept - keep)

    def cache_state(self, cache: List[Any]) -> List[mx.array]:
        """The caches' buffers as they are now (for eval, and for bitwise comparison with the
        caches of mlx-lm's own plain decode, layout included). ``[...]``: later in-place updates
        of a cache do not reach the arrays returned here."""
        return [a[...] for c in cache if c.keys is not None for a in (c.keys, c.values)]

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
                out[layer_type] = c.window(max(0, query_position - self.window + 1), p)
            else:
                out[layer_type] = c.window(0, p)
        return out
