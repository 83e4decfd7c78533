"""The round queues its draft and accept hook (mx.async_eval) so the verify graph is built while
they compute; MLX_MTP_SYNC_PHASES=1 evaluates them in place (mx.eval) for a per-phase timing
split. Both give the same tokens and bitwise the same caches; only where the host waits moves."""

from contextlib import contextmanager

import mlx.core as mx
import pytest
from support.reference import reference_greedy

import mlx_mtp
from mlx_mtp import MTPError
from mlx_mtp.decoding.stats import RunStats

PROMPT = [5, 17, 3, 99, 42, 7]
N = 24


class PhaseCalls(RunStats):
    """Records which of mx.eval / mx.async_eval ran inside the draft and accept phases."""

    def __init__(self):
        super().__init__()
        self.where = None
        self.calls = []  # (phase, "eval" | "async_eval")

    @contextmanager
    def phase(self, name):
        self.where = name
        try:
            with super().phase(name):
                yield
        finally:
            self.where = None


@pytest.fixture
def calls(monkeypatch):
    box = {}
    for name in ("eval", "async_eval"):
        real = getattr(mx, name)

        def wrapped(*args, _real=real, _name=name, **kwargs):
            stats = box.get("stats")
            if stats is not None and stats.where in ("draft", "accept"):
                stats.calls.append((stats.where, _name))
            return _real(*args, **kwargs)

        monkeypatch.setattr(mx, name, wrapped)
    return box


def _run(model, calls, block_size):
    stats = PhaseCalls()
    calls["stats"] = stats
    cache = mlx_mtp.make_prompt_cache(model)
    out = [t for t, _ in mlx_mtp.generate_step(mx.array(PROMPT), model, max_tokens=N,
                                               block_size=block_size, stats=stats,
                                               prompt_cache=cache)]
    state = model.target.cache_state(cache)
    mx.eval(state)
    return out, stats, [bytes(memoryview(x)) for x in state]


@pytest.mark.parametrize("block_size", [3, "auto"])
def test_queued_and_synced_phases_agree(dense_dir, calls, monkeypatch, block_size):
    model = mlx_mtp.load_model(dense_dir)
    want = reference_greedy(dense_dir, PROMPT, N)

    monkeypatch.delenv("MLX_MTP_SYNC_PHASES", raising=False)
    queued, q_stats, q_cache = _run(model, calls, block_size)
    monkeypatch.setenv("MLX_MTP_SYNC_PHASES", "1")
    synced, s_stats, s_cache = _run(model, calls, block_size)

    assert queued == want and synced == want
    assert q_cache == s_cache  # the committed caches, bitwise
    assert not q_stats.phases_synced and s_stats.phases_synced
    assert q_stats.to_dict()["phases_synced"] is False
    # Queued: the draft and accept phases never wait; synced: they always do.
    assert {p for p, _ in q_stats.calls} == {"draft", "accept"}
    assert {f for _, f in q_stats.calls} == {"async_eval"}
    assert {f for _, f in s_stats.calls} == {"eval"}
    if block_size != "auto":  # auto's choices follow measured times, so its rounds may differ
        assert len(q_stats.calls) == len(s_stats.calls) == 2 * q_stats.rounds - 1
    # Still one host read per round either way.
    assert q_stats.host_syncs == q_stats.rounds == s_stats.host_syncs


def test_bad_sync_phases_value_is_a_clear_error(dense_dir, monkeypatch):
    model = mlx_mtp.load_model(dense_dir)
    monkeypatch.setenv("MLX_MTP_SYNC_PHASES", "yes")
    with pytest.raises(MTPError, match=r"^environment variable MLX_MTP_SYNC_PHASES must be 0 or "
                                       r"1, got 'yes'$"):
        next(mlx_mtp.generate_step(mx.array(PROMPT), model, max_tokens=4, block_size=3))
