"""``block_size="auto"`` in a batch: each round's widths chosen for the batch as a whole.

One batched round verifies every sequence's block in one forward, so its time follows the rows
of all the blocks together. A sequence's own chooser (``block_chooser``) sees the round's time
barely move with its own width and keeps its block wide, though every row it adds costs the
whole batch. ``BatchWidths`` models the round's time as a line in its total rows,
T(R) = a + b R, fitted to the batch's recent rounds, and caps each sequence's drafts where the
batch's expected tokens per second, sum_s E_s(k_s) / T(R), stop growing: drafts are added one
at a time, the one of highest marginal gain first (the chance that it is kept, from that
sequence's chooser), which is the optimum as each sequence's gains fall with depth. Each chooser
still makes its own choice (its exploration, its stretches without drafts); the batch only
lowers it, and only once the line is measured.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict, deque
from typing import Deque, List, Optional, Sequence, Tuple


class BatchWidths:
    """The batch's round-time line and the caps it puts on each sequence's drafts.

    ``window``: the recent rounds the line is fitted to; ``min_samples``: rounds a row count
    needs before its median is a point of the line (at least two such row counts make a line)."""

    def __init__(self, window: int = 64, min_samples: int = 2):
        self.samples: Deque[Tuple[int, float]] = deque(maxlen=window)
        self.min_samples = min_samples

    def observe(self, rows: int, seconds: float) -> None:
        """A round that verified ``rows`` rows (every block together) took ``seconds``."""
        self.samples.append((rows, seconds))

    def line(self) -> Optional[Tuple[float, float]]:
        """``(a, b)`` of T(R) = a + b R: least squares through the median time of each row count
        with at least ``min_samples`` recent rounds; None with fewer than two such counts or a
        line that does not rise (rows look free: nothing to cap)."""
        by_rows = defaultdict(list)
        for rows, seconds in self.samples:
            by_rows[rows].append(seconds)
        points = [(r, statistics.median(t)) for r, t in by_rows.items()
                  if len(t) >= self.min_samples]
        if len(points) < 2:
            return None
        mean_r = sum(r for r, _ in points) / len(points)
        mean_t = sum(t for _, t in points) / len(points)
        b = (sum((r - mean_r) * (t - mean_t) for r, t in points)
             / sum((r - mean_r) ** 2 for r, _ in points))
        if b <= 0:
            return None
        return mean_t - b * mean_r, b

    def caps(self, acceptances: Sequence[Sequence[float]], limits: Sequence[int],
             fixed_rows: int = 0, fixed_blocks: int = 0) -> Optional[List[int]]:
        """Drafts per sequence (at most ``limits[s]``) that maximise the batch's expected tokens
        per second on the fitted line, ``acceptances[s]`` the conditional estimates a_1..a_K of
        sequence s; ``fixed_rows``: the rows of ``fixed_blocks`` blocks not allocated here (a
        tree round's), each counted as one token. None while the line is not measured."""
        line = self.line()
        if line is None:
            return None
        a, b = line
        drafts = [0] * len(limits)
        kept = [1.0] * len(limits)  # chance that every draft so far is kept, per sequence
        rows = len(limits) + fixed_rows
        tokens = float(len(limits) + fixed_blocks)  # every block emits at least its bonus token
        while True:
            best, gain = None, 0.0
            for s, (acc, limit) in enumerate(zip(acceptances, limits)):
                k = drafts[s]
                if k < min(limit, len(acc)) and kept[s] * acc[k] > gain:
                    best, gain = s, kept[s] * acc[k]
            if best is None or (tokens + gain) * (a + b * rows) <= tokens * (a + b * (rows + 1)):
                return drafts
            kept[best] *= acceptances[best][drafts[best]]
            drafts[best] += 1
            tokens += gain
            rows += 1

    def cap(self, choosers: Sequence, plans: List) -> List:
        """``plans`` (``round_steps.RoundPlan``) with each chain's drafts lowered to the batch's
        cap; a sequence without a chooser (a fixed block size) or drafting a tree keeps its
        plan, its rows counted as fixed."""
        free = [i for i, (c, p) in enumerate(zip(choosers, plans)) if c is not None and not p.tree]
        if len(plans) < 2 or not free:
            return plans
        fixed = [p for i, p in enumerate(plans) if i not in free]
        caps = self.caps([choosers[i].optimistic_acceptance() for i in free],
                         [plans[i].drafts for i in free],
                         fixed_rows=sum(p.drafts + 1 for p in fixed), fixed_blocks=len(fixed))
        if caps is None:
            return plans
        out = list(plans)
        for i, k in zip(free, caps):
            if k < plans[i].drafts:
                out[i] = dataclasses.replace(plans[i], drafts=k)
        return out
