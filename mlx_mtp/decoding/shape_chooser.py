"""Under ``block_size="auto"`` with ``draft_topk`` above 1: whether a round drafts a chain (its
width chosen by ``BlockChooser``) or a tree, from the tokens per second each shape measured.

Each shape's rate is the mean tokens of its last ``window`` rounds over their median time: the
tokens a round emits vary from one to the whole block, so a median of per-round rates would let
a few lucky rounds decide, while a median time keeps the first rounds of a new shape, which
compile graphs, from deciding. Chains and trees take
turns until each has ``explore`` rounds; then the faster shape runs, and the slower one runs once
when it has not run for ``gap`` rounds, so a change in text or cost is noticed. The gap starts
at ``reprobe``, doubles after each re-measure that leaves the faster shape as it was, up to
``max_gap``, and starts again when the faster shape changes: a shape that keeps losing costs
ever fewer rounds. The tree's depth is the chooser's last drafting choice (``depth``).
Deterministic: the same observations give the same choices.
"""

from __future__ import annotations

from collections import deque
from typing import Deque, Dict, Optional, Tuple

from mlx_mtp.decoding.block_chooser import measured_rate


class ShapeChooser:
    def __init__(self, depth: int, explore: int = 2, reprobe: int = 8, max_gap: int = 128,
                 window: int = 8):
        self.depth = depth  # drafts of the last chain round that drafted: a tree round's depth
        self.explore, self.reprobe, self.max_gap = explore, reprobe, max_gap
        self.gap = reprobe
        # per shape, its recent rounds' (tokens, seconds)
        self.recent: Dict[bool, Deque[Tuple[int, float]]] = {False: deque(maxlen=window),
                                                             True: deque(maxlen=window)}
        self.since: Dict[bool, int] = {False: 0, True: 0}  # rounds since each shape last ran
        self.rounds = {False: 0, True: 0}  # rounds per shape (stats)
        self.leader: Optional[bool] = None  # the faster shape when the last round was chosen
        self.probing = False  # the last choice re-measured the slower shape

    def rate(self, tree: bool) -> float:
        """Tokens per second of the shape's recent rounds: their mean tokens over their median
        time; 0 before any."""
        rate = measured_rate(self.recent[tree])
        return 0.0 if rate is None else rate

    def choose(self) -> bool:
        """True: this round drafts a tree."""
        seen = {s: len(self.recent[s]) for s in (False, True)}
        if min(seen.values()) < self.explore:
            return seen[True] < seen[False]  # take turns, a chain first
        best = self.rate(True) > self.rate(False)
        if self.leader is not None and best != self.leader:
            self.gap = self.reprobe  # the faster shape changed: watch closely again
        elif self.probing:
            self.gap = min(2 * self.gap, self.max_gap)  # re-measured, still behind: back off
        self.leader, self.probing = best, self.since[not best] >= self.gap
        return (not best) if self.probing else best

    def record_round(self, tree: bool, tokens: int, seconds: float, drafts: int = 0) -> None:
        """A drafting round of the shape emitted ``tokens`` in ``seconds``; a chain round's
        ``drafts`` become the next tree's depth."""
        if seconds > 0:
            self.recent[tree].append((tokens, seconds))
        self.since[tree] = 0
        self.since[not tree] += 1
        self.rounds[tree] += 1
        if not tree and drafts > 0:
            self.depth = drafts
