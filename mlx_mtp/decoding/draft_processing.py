"""The request's logits processors applied to the drafts, so that a draft is what the target
picks after the same processing: at T=0 the processed argmax (``DraftArgmax``), at T > 0 a draw
from the processed q (``sampling.DraftSampler``), in a tree every node's row processed with its
path (``TreeRows``). Each sees the history the target's row at that position sees.

Which processors a drafter applies (``DraftProcessors``): mlx-lm's own (``make_logits_processors``:
logit bias, repetition, presence and frequency penalties) always; a callable whose ``draftable``
attribute is False never; any other callable is tried on the first draft row and kept if it
returns an array of the row's shape. Where one cannot be applied, or the drafter cannot take
processed picks, every draft is the drafter's own unprocessed pick, as without processors: the
target still applies them, so the output is unchanged and only acceptance differs.
``DraftProcessors.status`` says which (``RunStats.draft_processors``).
"""

from __future__ import annotations

import inspect
import logging
from typing import List, Optional, Sequence

import mlx.core as mx

from mlx_mtp.decoding import sampling

APPLIED = "applied"
# mlx-lm's processors (mlx_lm.sample_utils): MLX ops on the logits at the history's ids.
MLX_LM_PROCESSORS = frozenset({
    "make_logits_processors.<locals>.logit_bias_processor",
    "make_repetition_penalty.<locals>.repetition_penalty_processor",
    "make_presence_penalty.<locals>.presence_penalty_processor",
    "make_frequency_penalty.<locals>.frequency_penalty_processor",
})

logger = logging.getLogger("mlx_mtp")


def known_draftable(processor) -> bool:
    """One of mlx-lm's own processors (``mlx_lm.sample_utils.make_logits_processors``)."""
    return (getattr(processor, "__module__", None) == "mlx_lm.sample_utils"
            and getattr(processor, "__qualname__", None) in MLX_LM_PROCESSORS)


def processor_name(processor) -> str:
    return getattr(processor, "__qualname__", None) or type(processor).__name__


def takes_keyword(fn, name: str) -> bool:
    """Whether ``fn`` accepts the keyword argument ``name`` (by name, or through ``**kwargs``)."""
    params = inspect.signature(fn).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def drafter_problem(drafter, trees: bool) -> Optional[str]:
    """Why ``drafter`` cannot draft processed picks (``trees``: draft trees too), or None. A chain
    takes them through ``draft_sampled``, a tree through ``draft_tree``'s ``process``."""
    name = type(drafter).__name__
    if not callable(getattr(drafter, "draft_sampled", None)):
        return f"the drafter ({name}) has no draft_sampled to pick processed drafts"
    tree = getattr(drafter, "draft_tree", None)
    if trees and (tree is None or not takes_keyword(tree, "process")):
        return f"the drafter ({name}) drafts trees without logits processors (its draft_tree " \
               "takes no process)"
    return None


class DraftProcessors:
    """The request's logits processors as the drafts apply them: called like one processor,
    ``(tokens, logits [1, V]) -> logits``, on a copy of a drafter's row (the processors may
    assign into it). ``status``: None (no processors, or no draft made yet), ``"applied"``, or
    ``"not applied: <why>"``; ``active`` while drafts are processed (or the first try is due)."""

    def __init__(self, processors: Sequence, problem: Optional[str] = None):
        self.processors = list(processors)
        opted_out = [p for p in self.processors if getattr(p, "draftable", None) is False]
        if problem is None and opted_out:
            problem = f"logits processor {processor_name(opted_out[0])} has draftable=False"
        self.problem = problem
        # any callable not known to be draftable is tried on the first draft row
        self.untried = [p for p in self.processors if not known_draftable(p)]
        self.drafted = False

    @property
    def active(self) -> bool:
        return bool(self.processors) and self.problem is None

    @property
    def status(self) -> Optional[str]:
        if not self.processors or not self.drafted:
            return None
        return APPLIED if self.problem is None else f"not applied: {self.problem}"

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if not self.active:
            return logits
        if self.untried:
            return self._first_try(tokens, logits)
        for proc in self.processors:
            logits = proc(tokens, logits)
        return logits

    def _first_try(self, tokens: mx.array, logits: mx.array) -> mx.array:
        """Every processor on the first draft row: kept if none raises and each returns an array
        of the row's shape; else the row unprocessed, and no draft is processed from then on."""
        out = mx.array(logits)
        for proc in self.processors:
            try:
                got = proc(tokens, out)
            except Exception as e:  # a user's callable: whatever it raises, drafts go without
                return self._refuse(f"logits processor {processor_name(proc)} raised "
                                    f"{type(e).__name__} on a draft's logits: {e}", logits)
            if not isinstance(got, mx.array) or got.shape != out.shape:
                what = (f"shape {tuple(got.shape)}" if isinstance(got, mx.array)
                        else f"a {type(got).__name__}")
                return self._refuse(f"logits processor {processor_name(proc)} returned {what} "
                                    f"for a draft's logits of shape {tuple(out.shape)}", logits)
            out = got
        self.untried = []
        return out

    def _refuse(self, problem: str, logits: mx.array) -> mx.array:
        self.problem = problem
        logger.warning("mlx_mtp: drafts without logits processors (the output is unchanged): %s",
                       problem)
        return logits

    # -- what a round's drafting is handed -------------------------------------------------------

    def argmax(self, history: Optional[mx.array], vocab_size: int) -> Optional["DraftArgmax"]:
        """A chain's picker for ``draft_sampled`` (the processed argmax), or None: the drafter's
        own ``draft`` (no processors, or they cannot be applied)."""
        self.drafted = True
        return DraftArgmax(vocab_size, [self], history) if self.active else None

    def for_sampler(self) -> List["DraftProcessors"]:
        """The processors a ``DraftSampler`` applies: this object, or none."""
        self.drafted = True
        return [self] if self.active else []

    def tree_rows(self, history: Optional[mx.array], vocab_size: int) -> Optional["TreeRows"]:
        """What ``draft_tree`` processes its rows with (``TreeRows``), or None."""
        self.drafted = True
        return TreeRows(self, history, vocab_size) if self.active else None


class DraftArgmax(sampling.DraftSampler):
    """Handed to ``draft_sampled`` where drafts are argmax picks: draft j is the argmax of the
    processed logits, its processors seeing the history through the bonus plus drafts 1..j-1;
    the ids stay on the device."""

    def __init__(self, vocab_size: int, processors: Sequence, history: Optional[mx.array]):
        super().__init__(None, None, vocab_size, processors, history)

    def __call__(self, logits: mx.array, ids: Optional[mx.array] = None) -> mx.array:
        col = mx.argmax(self._process(logits, ids), axis=-1)
        tok = (col if ids is None else ids[col]).astype(mx.uint32)
        self.ids.append(tok)
        return tok

    def drafts(self) -> mx.array:
        return mx.concatenate(self.ids)


class TreeRows:
    """Handed to ``draft_tree``: ``(logits [R, Vd], paths, ids=None) -> processed [R, Vd]``, row r
    being the drafter's logits after the nodes ``paths[r]`` (target ids from the first depth on;
    empty for the bonus), so its processors see the history plus that path."""

    def __init__(self, processors: DraftProcessors, history: mx.array, vocab_size: int):
        self.processors, self.history, self.vocab_size = processors, history, vocab_size

    def __call__(self, logits: mx.array, paths: Sequence[Sequence[int]],
                 ids: Optional[mx.array] = None) -> mx.array:
        rows = []
        for r, path in enumerate(paths):
            tokens = self.history if not path else mx.concatenate(
                [self.history, mx.array(list(path), dtype=self.history.dtype)])
            rows.append(sampling.process_draft_row(logits[r : r + 1], tokens, [self.processors],
                                                   ids, self.vocab_size))
        return mx.concatenate(rows, axis=0)
