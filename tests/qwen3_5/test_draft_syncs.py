"""Phase 1: drafted ids stay on the device. Every evaluation and host read MLX offers is counted
here (test-side wrappers around mx.eval / mx.async_eval and the mx.array conversions)."""

from contextlib import contextmanager

import mlx.core as mx
import pytest
from support.reference import reference_greedy

import mlx_mtp
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.models.options import DraftOptions

PROMPT = [5, 17, 3, 99, 42]
READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")


class Counter:
    def __init__(self):
        self.where = None
        self.counts = {}

    def hit(self):
        self.counts[self.where] = self.counts.get(self.where, 0) + 1


@pytest.fixture
def syncs(monkeypatch):
    counter = Counter()
    for name in ("eval", "async_eval"):
        real = getattr(mx, name)

        def wrapped(*args, _real=real, **kwargs):
            counter.hit()
            return _real(*args, **kwargs)

        monkeypatch.setattr(mx, name, wrapped)
    for name in READS:
        real = getattr(mx.array, name)

        def wrapped(self, *args, _real=real, **kwargs):
            counter.hit()
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(mx.array, name, wrapped)
    return counter


class PerRound(RunStats):
    """Tags every sync with the phase it happened in; one draft-phase count per round."""

    def __init__(self, counter):
        super().__init__()
        self.counter = counter
        self.draft_counts = []
        self.ks = []  # drafts made in each round

    def record_round(self, drafted, accepted, wall_s):
        super().record_round(drafted, accepted, wall_s)
        self.ks.append(drafted)

    @contextmanager
    def phase(self, name):
        before = self.counter.counts.get("draft", 0)
        self.counter.where = name
        try:
            with super().phase(name):
                yield
        finally:
            self.counter.where = None
            if name == "draft":
                self.draft_counts.append(self.counter.counts.get("draft", 0) - before)


@pytest.mark.slow
@pytest.mark.parametrize("device_ids", [True, False])
def test_drafting_a_block_adds_at_most_one_sync(dense_dir, syncs, device_ids):
    model = mlx_mtp.load_model(dense_dir, draft_options=DraftOptions(device_ids=device_ids))
    for bs in range(2, 7):
        stats = PerRound(syncs)
        out = [t for t, _ in mlx_mtp.generate_step(mx.array(PROMPT), model, max_tokens=20,
                                                   block_size=bs, stats=stats)]
        assert out == reference_greedy(dense_dir, PROMPT, 20)
        # With ids on device the block's ids are evaluated once; off, each draft after the first
        # makes a host round trip on top of that.
        want = [1 if device_ids else k for k in stats.ks if k > 0]
        assert stats.draft_counts == want, (bs, stats.draft_counts)
        # The diagnostics count exactly what happened.
        assert stats.draft_syncs == sum(want)
        assert stats.to_dict()["draft_syncs_per_round"] == sum(want) / stats.rounds


def test_draft_itself_neither_evaluates_nor_reads(dense_dir, syncs):
    """The drafter's draft(k) only builds the graph: nothing is evaluated or read inside it."""
    model = mlx_mtp.load_model(dense_dir)
    target, drafter = model.target, model.drafter
    cache = target.make_cache()
    prompt = mx.array(PROMPT)
    h = target.hidden(prompt[None, :-1], cache)
    drafter.reset()
    drafter.prefill(h, prompt[1:])
    mx.eval(drafter.state_arrays())
    syncs.where = "draft"
    for k in range(1, 7):
        drafts = drafter.draft(k)
        assert syncs.counts.get("draft", 0) == 0, k
        assert drafts.shape == (k,)
        for c in drafter.cache:
            c.trim(drafter.in_round)
        drafter.in_round = 0
