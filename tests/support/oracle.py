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


class OracleTreeDrafter(OracleDrafter):
    """Drafts planted trees over the known continuation: at every depth the true token and a
    wrong sibling (which of them is the drafter's first choice alternates with the depth), and
    under each wrong sibling a child holding the next true token, which the walk must not take.
    Round r plants a mistake at depth ``schedule[r] + 1``. With ``inner`` (the real MTP drafter)
    its ``draft_tree`` runs too, so the head's in-round state is exercised and rolled back."""

    def __init__(self, full, schedule, vocab_size, inner=None):
        self.inner = inner
        super().__init__(full, schedule, vocab_size)

    def reset(self) -> None:
        super().reset()
        if self.inner is not None:
            self.inner.reset()

    def prefill(self, hidden, next_ids) -> None:
        super().prefill(hidden, next_ids)
        if self.inner is not None:
            self.inner.prefill(hidden, next_ids)

    def accept(self, hidden, next_ids) -> None:
        super().accept(hidden, next_ids)
        if self.inner is not None:
            self.inner.accept(hidden, next_ids)

    def state_arrays(self) -> list:
        return [] if self.inner is None else self.inner.state_arrays()

    def draft_tree(self, topk: int, nodes: int, depth: int):
        from mlx_mtp.draft_tree import DraftTree

        if self.inner is not None:
            self.inner.draft_tree(topk, nodes, depth)
        true = self._ids(depth)  # the mistake planted at depth planned + 1
        wrong = lambda t: (t + 1) % self.vocab_size  # noqa: E731
        tokens, parents, ranks = [], [-1], [0]
        on_path, decoy = 0, None  # node numbers of the true-path node and the last wrong sibling
        for d in range(depth):
            level = [(true[d], on_path), (wrong(true[d]), on_path)]
            if d % 2:
                level.reverse()
            if decoy is not None:
                level.append((true[d], decoy))
            next_path = next_decoy = None
            for rank, (tok, parent) in enumerate(level):
                number = len(parents)
                tokens.append(tok)
                parents.append(parent)
                ranks.append(rank if parent == on_path else 0)
                if parent == on_path and tok == true[d]:
                    next_path = number
                elif parent == on_path:
                    next_decoy = number
            if next_path is None:  # the planted mistake: both siblings wrong
                next_path = next_decoy
            on_path, decoy = next_path, next_decoy
        return DraftTree(mx.array(tokens, dtype=mx.uint32), tokens, parents, ranks)
