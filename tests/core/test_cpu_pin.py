"""cpu_pin: a drafted round's verify on the CPU runs with every thread of the process on one core
(its eager kernels sync with MLX's stream thread many times); the affinities come back after it,
block-1 rounds and split ranks are never pinned, and the tokens and caches do not change."""

import os
import threading
import mlx.core as mx
import pytest
from conftest import reference_greedy

import mlx_mtp
from mlx_mtp import MTPError, cpu_pin

PROMPT = [5, 17, 3, 99, 42, 7]
N = 20
CPUS = sorted(os.sched_getaffinity(0))


def needs_two_cores():
    if len(CPUS) < 2:
        pytest.skip("pinning to one core is a no-op on a one-core process")


def _masks():
    return {int(t): os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")}


def test_one_core_pins_every_thread_to_the_callers_core_and_restores_each_mask():
    needs_two_cores()
    mx.eval(mx.ones(3) + 1)  # MLX's stream thread exists
    started, stop = threading.Event(), threading.Event()
    box = {}

    def worker():  # a thread with a mask of its own (the first two cores)
        box["tid"] = threading.get_native_id()
        os.sched_setaffinity(0, set(CPUS[:2]))
        started.set()
        stop.wait()

    t = threading.Thread(target=worker)
    t.start()
    started.wait()
    try:
        before = _masks()
        assert before[box["tid"]] == set(CPUS[:2])
        with cpu_pin.one_core():
            inside = _masks()
            cpu = cpu_pin.current_cpu()
            assert len({frozenset(m) for m in inside.values()}) == 1  # all threads alike
            assert next(iter(inside.values())) == {cpu}
            new = threading.Thread(target=lambda: None)  # started inside: the caller's mask after
            new.start()
            new.join()
        assert _masks() == before
    finally:
        stop.set()
        t.join()


def test_switched_off_by_the_environment(monkeypatch):
    needs_two_cores()
    monkeypatch.setenv(cpu_pin.ENV, "0")
    before = _masks()
    with cpu_pin.one_core():
        assert _masks() == before
    assert not cpu_pin.enabled()


def test_a_bad_switch_value_is_a_one_line_error(dense_dir, monkeypatch):
    model = mlx_mtp.load_model(dense_dir)
    monkeypatch.setenv(cpu_pin.ENV, "yes")
    with pytest.raises(MTPError, match=r"^environment variable MLX_MTP_PIN_VERIFY must be 0 or 1, "
                                       r"got 'yes'$"):
        next(mlx_mtp.generate_step(mx.array(PROMPT), model, max_tokens=4, block_size=3))


def _run(model, block_size):
    """Tokens, caches and (forward, how many cores the thread may use) for every verify forward
    and every plain forward (prefill, one-token rounds)."""
    target, masks = model.target, []
    verify, hidden = type(target).verify, type(target).hidden

    def record(fn, kind):
        def wrapped(*args, **kwargs):
            masks.append((kind, len(os.sched_getaffinity(0))))
            return fn(target, *args, **kwargs)
        return wrapped

    target.verify, target.hidden = record(verify, "verify"), record(hidden, "step")
    try:
        cache = mlx_mtp.make_prompt_cache(model)
        out = [t for t, _ in mlx_mtp.generate_step(mx.array(PROMPT), model, max_tokens=N,
                                                   block_size=block_size, prompt_cache=cache)]
    finally:
        del target.verify, target.hidden
    state = target.cache_state(cache)
    mx.eval(state)
    return out, masks, [bytes(memoryview(x)) for x in state]


@pytest.mark.parametrize("block_size", [1, 3])
def test_the_loop_pins_drafted_verifies_only_and_changes_no_token_or_cache(
        dense_dir, monkeypatch, block_size):
    needs_two_cores()
    model = mlx_mtp.load_model(dense_dir)
    want = reference_greedy(dense_dir, PROMPT, N)
    before = os.sched_getaffinity(0)
    monkeypatch.setenv(cpu_pin.ENV, "0")
    _run(model, block_size)  # the first run also runs the exactness probe's forwards
    free, f_masks, f_cache = _run(model, block_size)
    monkeypatch.delenv(cpu_pin.ENV)
    pinned, p_masks, p_cache = _run(model, block_size)
    assert free == want and pinned == want
    assert f_cache == p_cache  # the committed caches, bitwise
    assert f_masks == [(kind, len(before)) for kind, _ in p_masks]
    assert {kind for kind, _ in p_masks} == ({"step"} if block_size == 1 else {"step", "verify"})
    assert p_masks == [(kind, 1 if kind == "verify" else len(before)) for kind, _ in p_masks]
    assert os.sched_getaffinity(0) == before  # given back after every round


def test_no_pinning_with_more_than_one_verify_thread(dense_dir, monkeypatch):
    needs_two_cores()
    model = mlx_mtp.load_model(dense_dir)
    monkeypatch.setenv("MLX_MTP_VERIFY_THREADS", "2")
    _, masks, _ = _run(model, 3)
    assert ("verify", len(CPUS)) in masks and {n for _, n in masks} == {len(CPUS)}
