"""Drafters for tests: ones that force acceptance lengths (random tiny heads accept nothing on their
own), and a wrapper that drafts over a table of ids as a draft vocabulary does."""

from __future__ import annotations

from typing import List, Sequence

import mlx.core as mx

from mlx_mtp.models.protocols import DrafterDefaults


class OracleDrafter(DrafterDefaults):
    """Replays the known greedy continuation ``full`` (prompt + reference output), with a planted
    mistake so that round r accepts exactly ``schedule[r % len(schedule)]`` drafts (or all k if
    that is >= k)."""

    def __init__(self, full: Sequence[int], schedule: Sequence[int], vocab_size: int):
        self.full = list(full)
        self.schedule = list(schedule)
        self.vocab_size = vocab_size
        self.reset()

    def reset(self) -> None:
        self.consumed = 0  # pairs consumed == tokens committed to the target
        self.round = 0
        self.planned: List[int] = []

    def prefill(self, hidden, next_ids) -> None:
        self.consumed += next_ids.size

    def _ids(self, k: int) -> List[int]:
        n = self.consumed
        ids = [self.full[i] if i < len(self.full) else 0 for i in range(n + 1, n + 1 + k)]
        a = self.schedule[self.round % len(self.schedule)]
        if a < k:
            ids[a] = (ids[a] + 1) % self.vocab_size  # never the right token
        self.planned.append(min(a, k))
        self.round += 1
        return ids

    def draft(self, k: int) -> mx.array:
        return mx.array(self._ids(k), dtype=mx.uint32)

    def accept(self, hidden, next_ids) -> None:
        self.consumed += next_ids.size

    def state_arrays(self) -> list:
        return []


class ForcedHeadDrafter(OracleDrafter):
    """Runs the real MTP drafter (its cache bookkeeping, trims and accept hook) but proposes the
    oracle's ids, so every acceptance length exercises the real head's state handling."""

    def __init__(self, inner, full, schedule, vocab_size):
        self.inner = inner
        super().__init__(full, schedule, vocab_size)

    def reset(self) -> None:
        super().reset()
        self.inner.reset()

    def prefill(self, hidden, next_ids) -> None:
        super().prefill(hidden, next_ids)
        self.inner.prefill(hidden, next_ids)

    def draft(self, k: int) -> mx.array:
        self.inner.draft(k)
        return super().draft(k)

    def accept(self, hidden, next_ids) -> None:
        super().accept(hidden, next_ids)
        self.inner.accept(hidden, next_ids)

    def state_arrays(self) -> list:
        return self.inner.state_arrays()


class TableDrafter:
    """Wraps a drafter that has ``draft_sampled``: its LM head is presented as a reduced
    vocabulary, column c being target id ``table[c]`` (what a draft vocabulary does), and the
    ids it drafts are recorded in ``drafted``."""

    def __init__(self, inner, table: Sequence[int]):
        self.inner, self.table = inner, mx.array(list(table))
        self.drafted: List[int] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft_sampled(self, k, sample):
        def on_table(logits, ids=None):
            tok = sample(logits[:, self.table], ids=self.table)
            self.drafted.append(tok.item())
            return tok

        return self.inner.draft_sampled(k, on_table)
