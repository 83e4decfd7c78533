"""Draft trees: the shape a round may draft, the tree it drafted, and the walk over it.

A tree's nodes are numbered breadth first: node 0 is the round's bonus token (the root), the draft
nodes follow by depth, siblings best first. ``parents[i]`` is node i's parent (-1 for the root).
The verify feeds the nodes as one block; every node's row must equal what a chain through its
ancestors gives (``Rows``: which block rows each row sees, and at which position).

Shape (``TreeShape``): ``topk`` children are considered per expanded node and the ``topk`` best
of them by path probability are expanded at the next depth (EAGLE-2's expansion, as SGLang's
``--speculative-eagle-topk``); of everything considered, the ``nodes`` of highest path probability
are verified (``--speculative-num-draft-tokens`` less the root); ``depth`` bounds the paths.
``topk`` 1 is the chain.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import List, Optional, Sequence

import mlx.core as mx


@dataclass(frozen=True)
class TreeShape:
    """A round's tree shape, checked by ``mlx_mtp.decoding.speculation.tree_shape``."""

    topk: int
    nodes: int  # draft nodes verified per round (the verify is nodes + 1 wide)

    @property
    def width(self) -> int:
        return self.nodes + 1


@dataclass
class DraftTree:
    """A drafted tree: ``ids`` [nodes] on the device (draft nodes 1..n), the host's copy, and
    the structure. ``ranks[i]``: node i's rank among its siblings (0: the drafter's best)."""

    ids: mx.array  # [n] uint32
    tokens: List[int]
    parents: List[int]  # over nodes 0..n, root first (-1)
    ranks: List[int]

    @property
    def depths(self) -> List[int]:
        out = [0]
        for p in self.parents[1:]:
            out.append(out[p] + 1)
        return out

    def path(self, node: int) -> List[int]:
        """Nodes from the root to ``node``, both included."""
        out = [node]
        while self.parents[out[-1]] >= 0:
            out.append(self.parents[out[-1]])
        return out[::-1]

    def leaves(self) -> List[int]:
        has_child = set(self.parents[1:])
        return [i for i in range(len(self.parents)) if i not in has_child]


class TreeSearch:
    """A drafter's tree search (EAGLE-2's expansion): ``expand`` adds the ``topk`` best children
    of each expanded node from its logits row and returns the ``topk`` new candidates of highest
    path score, the next depth's expansions; ``select`` keeps the best ``nodes``. Scores are
    summed log-probabilities of the drafter's logits. Each ``expand`` reads its scores on the
    host once (the tree's shape depends on them). ``process(logits, paths)``: the request's
    logits processors over the rows first, row r after the target ids ``paths[r]`` (a drafter
    binds its id table: ``mlx_mtp.decoding.draft_processing.TreeRows``)."""

    ROOT = -1

    def __init__(self, topk: int, to_target=lambda cols: cols, process=None):
        self.topk = topk
        self.to_target = to_target  # drafter columns -> target ids (a reduced vocabulary)
        self.process = process
        self.cands: List[list] = []  # [token, score, parent candidate (ROOT), depth, rank]
        self.reads = 0

    def expand(self, logits, parents: List[int], depth: int) -> List[int]:
        """``logits [len(parents), V]``: row r holds the drafter's logits after candidate
        ``parents[r]`` (``ROOT``: the bonus); the new candidates sit at ``depth``."""
        if self.process is not None:
            logits = self.process(logits, [self.path_tokens(p) for p in parents])
        k = self.topk
        cols = mx.argpartition(-logits, k - 1, axis=-1)[:, :k]
        best = mx.take_along_axis(logits, cols, axis=-1)
        order = mx.argsort(-best, axis=-1)
        cols = mx.take_along_axis(cols, order, axis=-1)
        best = mx.take_along_axis(best, order, axis=-1) - mx.logsumexp(logits, axis=-1,
                                                                       keepdims=True)
        tokens, best = self.to_target(cols).tolist(), best.tolist()
        self.reads += 1
        new = []
        for r, p in enumerate(parents):
            base = 0.0 if p == self.ROOT else self.cands[p][1]
            for rank in range(k):
                new.append(len(self.cands))
                self.cands.append([tokens[r][rank], base + best[r][rank], p, depth, rank])
        new.sort(key=lambda c: -self.cands[c][1])
        return new[:k]

    def token(self, c: int) -> int:
        return self.cands[c][0]

    def path_tokens(self, c: int) -> List[int]:
        """The target ids from the first depth down to candidate ``c`` (none for ``ROOT``)."""
        out = []
        while c != self.ROOT:
            out.append(self.cands[c][0])
            c = self.cands[c][2]
        return out[::-1]

    def parent(self, c: int) -> int:
        return self.cands[c][2]

    def select(self, nodes: int) -> DraftTree:
        """The ``nodes`` candidates of highest path score (a child never scores above its
        parent, and ties go to the shallower, so they form a tree), numbered breadth first,
        siblings best first."""
        cands = self.cands
        order = sorted(range(len(cands)), key=lambda c: (-cands[c][1], cands[c][3], c))[:nodes]
        number = {self.ROOT: 0}
        tokens, parents, ranks = [], [-1], [0]
        for d in range(1, max(cands[c][3] for c in order) + 1):
            level = sorted((c for c in order if cands[c][3] == d),
                           key=lambda c: (number[cands[c][2]], -cands[c][1], c))
            for c in level:
                number[c] = len(parents)
                tokens.append(cands[c][0])
                parents.append(number[cands[c][2]])
                ranks.append(cands[c][4])
        return DraftTree(mx.array(tokens, dtype=mx.uint32), tokens, parents, ranks)


def accepted_path(tree: DraftTree, picks: Sequence[int]) -> List[int]:
    """The walk down a verified tree: from the root, go to the child whose token is the target's
    pick at the current node, while there is one. Returns the path of kept nodes (root first)."""
    children = {}
    for i in range(1, len(tree.parents)):
        children.setdefault(tree.parents[i], []).append(i)
    path = [0]
    while True:
        node = path[-1]
        nxt = [c for c in children.get(node, ()) if tree.tokens[c - 1] == picks[node]]
        if not nxt:
            return path
        path.append(nxt[0])


@dataclass
class Rows:
    """How a forward's new rows attend when they are tree nodes: the cache's first ``base``
    entries, then the entries ``base + j`` for j in ``visible[i]`` (the row's ancestors' entries
    and its own, in path order); row i sits at position ``positions[i]``."""

    base: int
    positions: List[int]
    visible: List[List[int]]

    def paths(self) -> List[List[int]]:
        """Row paths (``visible`` lists) that are no other row's prefix: the chains whose
        recurrences cover every row."""
        prefixes = {tuple(v[:-1]) for v in self.visible}
        return [v for v in self.visible if tuple(v) not in prefixes]


_rows: List[Rows] = []  # the open ``laid_out`` bodies, innermost last


@contextmanager
def laid_out(rows: Rows):
    """Inside this body the layers read ``rows`` (``current``) for the forward's new rows."""
    _rows.append(rows)
    try:
        yield
    finally:
        _rows.pop()


def current() -> Optional[Rows]:
    return _rows[-1] if _rows else None


def node_rows(tree: DraftTree, start: int) -> Rows:
    """A target verify of the tree's nodes appended at cache offset ``start``."""
    return Rows(start, [start + d for d in tree.depths],
                [tree.path(i) for i in range(len(tree.parents))])
