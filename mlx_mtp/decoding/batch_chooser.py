"""``auto`` in batched rounds: ``BatchChooser`` picks one draft count for the whole batch by the
batch's measured rate (tokens emitted over the round's wall time) per draft count and batch size,
climbing to a neighbour count where it was not measured lately. Deterministic: the same
observations give the same choices. docs/block-size.md, "In a batch", says why a sequence's own
chooser cannot do it."""

from __future__ import annotations

from collections import deque
from typing import Deque, Dict, Optional, Tuple

from mlx_mtp.decoding.block_chooser import measured_rate
from mlx_mtp.errors import MTPError


class BatchChooser:
    """Chooses each batched round's draft count (``choose``) and learns from its outcome
    (``record_round``). ``max_drafts``: the most drafts of any sequence (K)."""

    def __init__(self, max_drafts: int, *, first_drafts: int = 1, window: int = 4,
                 stale_rounds: int = 24):
        if not isinstance(max_drafts, int) or isinstance(max_drafts, bool) or max_drafts < 1:
            raise MTPError(f"BatchChooser needs max_drafts >= 1, got {max_drafts!r}")
        if not 0 <= first_drafts <= max_drafts:
            raise MTPError(f"BatchChooser needs 0 <= first_drafts <= {max_drafts}, got "
                           f"{first_drafts!r}")
        if window < 1 or stale_rounds < 1:
            raise MTPError("BatchChooser needs window >= 1 and stale_rounds >= 1")
        self.max_drafts, self.first_drafts = max_drafts, first_drafts
        self.window, self.stale_rounds = window, stale_rounds
        self.samples: Dict[Tuple[int, int], Deque[Tuple[int, float]]] = {}  # (size, k) -> rounds
        self.measured_at: Dict[Tuple[int, int], int] = {}  # (size, k) -> round of its last sample
        self.best: Dict[int, int] = {}  # size -> its best measured count
        self.round = 0  # rounds observed

    def rate(self, size: int, drafts: int) -> Optional[float]:
        """Tokens per second of rounds of ``size`` sequences drafting ``drafts`` each (None: not
        measured)."""
        return measured_rate(self.samples.get((size, drafts), ()))

    def _fresh(self, size: int, drafts: int) -> bool:
        at = self.measured_at.get((size, drafts))
        return at is not None and self.round - at < self.stale_rounds

    def choose(self, size: int) -> int:
        """The draft count for a round of ``size`` sequences."""
        k = self.best.get(size)
        if k is None:
            met = sorted(self.best, key=lambda s: (abs(s - size), -s))
            k = self.best[met[0]] if met else self.first_drafts
            if not self._fresh(size, k):
                return k
        for j in (k + 1, k - 1):
            if 0 <= j <= self.max_drafts and not self._fresh(size, j):
                return j
        return k

    def record_round(self, size: int, drafts: int, tokens: int, wall_s: float) -> None:
        """A round of ``size`` sequences, each drafting ``drafts`` (fewer where its budget ended
        sooner), emitted ``tokens`` in ``wall_s`` seconds."""
        self.round += 1
        key = (size, drafts)
        self.samples.setdefault(key, deque(maxlen=self.window)).append((tokens, wall_s))
        self.measured_at[key] = self.round
        rates = {k: self.rate(size, k) for k in range(self.max_drafts + 1)}
        self.best[size] = max((k for k, r in rates.items() if r is not None),
                              key=lambda k: (rates[k], -k))
