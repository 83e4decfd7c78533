"""How a generation speculates, checked in one place: ``SpeculationOptions``.

The public functions (``generate_step``, ``stream_generate``, ``batch_generate``, ``BatchRounds``)
keep mlx-lm's flat keyword arguments and turn ours into one ``SpeculationOptions`` where they
are called; the CLIs build one from their flags (``mlx_mtp.cli.speculation_options``), its errors
naming the flags (``CLI_NAMES``). What a draft tree needs of the sampler and of the loaded model
is checked by ``check_sampling`` and ``check_model``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from mlx_mtp.decoding.acceptance import REQUESTABLE_RULES
from mlx_mtp.decoding.block_chooser import AUTO, BlockChooser
from mlx_mtp.decoding.limits import (DEFAULT_MAX_BLOCK_SIZE, MAX_BLOCK_SIZE, MAX_TOPK,
                                     block_size_problem)
from mlx_mtp.errors import MTPError
from mlx_mtp.draft_tree import TreeShape


@dataclass(frozen=True)
class Names:
    """How errors name the settings: the API's keywords or the CLIs' flags."""

    block: str
    max_block: str
    topk: str
    tokens: str
    acceptance: str
    sampled_trees: str  # the refusal of draft trees under ``auto`` at temperature > 0


API_NAMES = Names("block_size", "max_block_size", "draft_topk", "draft_tokens", "acceptance",
                  "draft_topk above 1 with block_size 'auto' runs at temperature 0 only (auto's "
                  "sampled draws are keyed per position); use a fixed block_size to sample with "
                  "trees")
CLI_NAMES = Names("--block-size", "--max-block-size", "--draft-topk", "--draft-tokens",
                  "--acceptance", "--draft-topk above 1 with --block-size auto runs at --temp 0 "
                  "only; use a fixed --block-size to sample with trees")


@dataclass(frozen=True)
class SpeculationOptions:
    """What a generation speculates with, checked on creation (``MTPError``: one line naming the
    setting and what was expected). ``widest`` and ``tree`` follow from the rest."""

    # tokens verified per round, drafts + 1 (1: plain decode through the round loop); "auto":
    # each round's drafts chosen by a fresh BlockChooser; or a caller's BlockChooser
    block_size: Union[int, str, BlockChooser] = AUTO
    max_block_size: int = DEFAULT_MAX_BLOCK_SIZE  # the widest block "auto" may choose
    draft_topk: int = 1  # children drafted per tree node; 1: chains
    draft_tokens: Optional[int] = None  # most draft nodes a tree verifies (None: topk per depth)
    acceptance: str = "auto"  # the acceptance rule asked for at temperature > 0 (acceptance.py)
    seed: Optional[int] = None  # speculative sampling's key streams, or auto's per-position keys
    names: Names = field(default=API_NAMES, compare=False, repr=False)  # how errors name them
    widest: int = field(init=False)  # the widest chain's verify width (under auto: its bound)
    tree: Optional[TreeShape] = field(init=False)  # the draft tree's shape (None: chains)

    def __post_init__(self):
        object.__setattr__(self, "widest", self._widest())
        object.__setattr__(self, "tree", tree_shape(self.draft_topk, self.draft_tokens,
                                                    self.widest, self.names))
        if self.acceptance not in REQUESTABLE_RULES:
            raise MTPError(f"{self.names.acceptance} must be one of "
                           f"{', '.join(REQUESTABLE_RULES)}, got {self.acceptance!r}")

    def _widest(self) -> int:
        if isinstance(self.block_size, BlockChooser):
            return checked_block_size(self.block_size.max_block_size,
                                      "the chooser's max block size")
        if self.block_size == AUTO:
            return checked_block_size(self.max_block_size, self.names.max_block)
        if isinstance(self.block_size, str):
            raise MTPError(f"{self.names.block} must be an integer or 'auto', got "
                           f"{self.block_size!r}")
        return checked_block_size(self.block_size, self.names.block)

    @property
    def auto(self) -> bool:
        """Each round's drafts are chosen (``"auto"`` or a caller's ``BlockChooser``)."""
        return self.block_size == AUTO or isinstance(self.block_size, BlockChooser)

    def make_chooser(self) -> Optional[BlockChooser]:
        """A generation's chooser: the caller's, a fresh default one under ``"auto"`` (up to
        ``max_block_size``), or None for a fixed block size."""
        if isinstance(self.block_size, BlockChooser):
            return self.block_size
        return BlockChooser(self.widest - 1) if self.block_size == AUTO else None

    def check_sampling(self, sampled: bool) -> None:
        """A draft tree under ``auto`` runs at temperature 0 only: auto's sampled draws are keyed
        per position. ``sampled``: the run draws at a temperature above 0."""
        if self.tree is not None and self.auto and sampled:
            raise MTPError(self.names.sampled_trees)

    def check_model(self, model) -> None:
        """A draft tree needs a drafter that drafts trees and a target that is not split."""
        if self.tree is None:
            return
        topk = self.names.topk
        if model.drafter is not None and not (hasattr(model.drafter, "draft_tree")
                                              and hasattr(model.target, "keep_path")):
            raise MTPError(f"{topk} above 1: this drafter ({type(model.drafter).__name__}) "
                           "drafts chains only (a drafter with draft_tree drafts trees)")
        if getattr(model, "split", None) is not None:
            raise MTPError(f"{topk} above 1 (tree drafting) is not available on a split target")

    def as_kwargs(self) -> dict:
        """The flat keyword arguments of ``generate_step`` (and ``stream_generate``) that give
        these options."""
        return {"block_size": self.block_size, "max_block_size": self.max_block_size,
                "draft_topk": self.draft_topk, "draft_tokens": self.draft_tokens,
                "acceptance": self.acceptance, "seed": self.seed}


def checked_block_size(block_size, name: str) -> int:
    """``block_size`` if it is an integer within the bounds, else an error naming ``name``."""
    if not isinstance(block_size, int) or isinstance(block_size, bool):
        raise MTPError(f"{name} must be an integer, got {block_size!r}")
    problem = block_size_problem(block_size)
    if problem:
        raise MTPError(f"{name} {problem}")
    return block_size


def tree_shape(draft_topk: int, draft_tokens: Optional[int], block_size: int,
               names: Names = API_NAMES) -> Optional[TreeShape]:
    """The checked shape for ``draft_topk`` / ``draft_tokens`` (None: the chain). ``block_size``:
    the widest chain (a fixed block size, or under ``auto`` the max block size), whose drafts
    bound the tree's depth; ``draft_tokens`` defaults to ``draft_topk`` per depth, at most what
    the widest verify (``MAX_BLOCK_SIZE``) holds."""
    topk, tokens, block = names.topk, names.tokens, names.block
    if not isinstance(draft_topk, int) or isinstance(draft_topk, bool) or \
            not 1 <= draft_topk <= MAX_TOPK:
        raise MTPError(f"{topk} must be an integer from 1 to {MAX_TOPK}, got {draft_topk!r}")
    if draft_topk == 1:
        if draft_tokens is not None and draft_tokens != block_size - 1:
            raise MTPError(f"{tokens} with {topk} 1 (a chain) is the block size less one, got "
                           f"{draft_tokens!r}")
        return None
    if block_size < 2:
        raise MTPError(f"{topk} above 1 drafts a tree: it needs a {block} of at least 2 (the "
                       f"tree's depth is the block size less one)")
    depth = block_size - 1
    if draft_tokens is None:
        draft_tokens = min(draft_topk * depth, MAX_BLOCK_SIZE - 1)
    if not isinstance(draft_tokens, int) or isinstance(draft_tokens, bool) or \
            not depth <= draft_tokens <= MAX_BLOCK_SIZE - 1:
        raise MTPError(f"{tokens} must be an integer from the tree's depth ({block} less one: "
                       f"{depth}) to {MAX_BLOCK_SIZE - 1}, got {draft_tokens!r}")
    return TreeShape(draft_topk, draft_tokens)
