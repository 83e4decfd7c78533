"""Block choosers that replay a script instead of choosing, so a test fixes what ``auto`` does."""

from mlx_mtp.decoding.batch_chooser import BatchChooser
from mlx_mtp.decoding.block_chooser import BlockChooser


class ScriptedChooser(BlockChooser):
    """Replays ``script`` (drafts per round, cut to the budget) instead of choosing: the loop
    must not care what was chosen. It still learns, as the real one does."""

    def __init__(self, max_drafts, script, **kw):
        super().__init__(max_drafts, **kw)
        self.script, self.asked, self.observed = list(script), 0, []

    def choose(self, limit=None):
        k = self.script[self.asked % len(self.script)]
        self.asked += 1
        return min(k, self.max_drafts if limit is None else limit)

    def record_round(self, drafts, accepted, wall_s):
        self.observed.append(drafts)
        super().record_round(drafts, accepted, wall_s)


class StretchChooser(ScriptedChooser):
    """Scripted, where ``("stretch", n)`` gives no drafts and commits to ``n`` rounds without
    (the loop runs them as pipelined one-token steps)."""

    def choose(self, limit=None):
        entry = self.script[self.asked % len(self.script)]
        self.asked += 1
        if isinstance(entry, tuple):
            self._stretch = entry[1]
            return 0
        self._stretch = 1
        return min(entry, self.max_drafts if limit is None else limit)


STRETCHES = [("stretch", 3), 2, ("stretch", 5), 0, 4, ("stretch", 2), 1]


class ScriptedBatchChooser(BatchChooser):
    """A batch's chooser that replays ``script`` (draft counts, in turn) and notes what it was
    told of each round: ``(size, drafts, tokens)``."""

    def __init__(self, max_drafts, script):
        super().__init__(max_drafts)
        self.script, self.asked, self.observed = list(script), 0, []

    def choose(self, size):
        k = self.script[self.asked % len(self.script)]
        self.asked += 1
        return k

    def record_round(self, size, drafts, tokens, wall_s):
        self.observed.append((size, drafts, tokens))
        super().record_round(size, drafts, tokens, wall_s)
