"""``Request``: the caller's arguments the round loop needs, already checked
(``mlx_mtp.decoding.api``, ``BatchRounds.start``); docs/architecture.md, "One round"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

import mlx.core as mx

from mlx_mtp.decoding.block_chooser import BlockChooser
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.draft_tree import TreeShape

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


@dataclass(kw_only=True)
class Request:
    """The caller's arguments the loop needs, already checked (``speculative_generate_step``,
    ``BatchRounds.start``)."""

    max_tokens: int
    sampler: Optional[Sampler]
    logits_processors: Optional[List[LogitsProcessor]]
    prefill_step_size: int
    progress: Optional[Callable[[int, int], None]]
    input_embeddings: Optional[mx.array]
    block_size: int  # the widest verify width the session may use
    chooser: Optional[BlockChooser]
    seed: Optional[int]
    acceptance: str
    stats: Optional[RunStats]
    tree: Optional[TreeShape] = None  # draft trees instead of chains (mlx_mtp.draft_tree)

    @property
    def widest(self) -> int:
        """The widest verify the session may run: the block size, or a tree's nodes and root."""
        return self.block_size if self.tree is None else max(self.block_size, self.tree.width)

    def embeddings(self, start: int, stop: int) -> Optional[mx.array]:
        """The input embeddings of prompt positions ``start:stop`` as a batch of one, or None."""
        if self.input_embeddings is None:
            return None
        return self.input_embeddings[None, start:stop]
