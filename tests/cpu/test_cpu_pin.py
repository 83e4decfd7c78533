"""cpu_pin: a drafted round's verify on the CPU runs with every thread of the process on one core
where it runs the eager row kernel (which syncs with MLX's stream thread many times); the
affinities come back after it, one-token steps, kernel-less verifies and verifies with several
threads are never pinned, and the tokens and caches do not change."""

import os
import threading
from pathlib import Path
import mlx.core as mx
import pytest
from support.reference import reference_greedy
from support.native_support import require_lazy

import mlx_mtp
from mlx_mtp import MTPError
from mlx_mtp.cpu import pin as cpu_pin
from mlx_mtp.cpu import lazy_ops as lazy_kernels
from mlx_mtp.exactness import row_exact_layers
from mlx_mtp.cpu import row_kernel


def calls_the_kernel(model) -> bool:
    """Whether a verify of ``model`` makes kernel calls: a layer computed by the row kernel with
    at least one group of 8 output columns (fewer go to BLAS one-row products entirely). Which
    layers those are depends on how this BLAS reduces (``row_exact_layers.switch_to_row_exact`` measures it)."""
    return any(row_exact_layers.row_method(m) == "kernel" and m.weight.shape[0] >= row_kernel.COLUMN_GROUP
               for _, m in model.mlx_model.named_modules())


PROMPT = [5, 17, 3, 99, 42, 7]
N = 20
CPUS = sorted(os.sched_getaffinity(0))
DEMO = str(Path(mlx_mtp.__file__).parent / "demo_pair")


def needs_two_cores():
    if len(CPUS) < 2:
        pytest.skip("pinning to one core is a no-op on a one-core process")


class _Masks(dict):
    """Each thread's CPU mask. Threads of the process may start or end between two readings
    (a BLAS's or a previous test's short-lived threads): two readings are equal where they
    share threads, and a thread that ended while it was read is left out."""

    def __eq__(self, other):
        common = self.keys() & other.keys()
        return bool(common) and all(self[t] == other[t] for t in common)

    def __ne__(self, other):
        return not self == other


def _masks():
    out = _Masks()
    for t in os.listdir("/proc/self/task"):
        try:
            out[int(t)] = os.sched_getaffinity(int(t))
        except ProcessLookupError:  # ended since the listing
            pass
    return out


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


def test_on_first_sync_pins_at_the_first_hold_only():
    needs_two_cores()
    before = _masks()
    cpu_pin.hold()  # no open body: nothing happens
    assert _masks() == before
    with cpu_pin.on_first_sync():
        assert _masks() == before  # armed, not pinned
        cpu_pin.hold()
        assert {len(m) for m in _masks().values()} == {1}
        cpu_pin.hold()  # once pinned, again is nothing
    assert _masks() == before
    with cpu_pin.on_first_sync():
        pass  # no kernel call: nothing to undo
    assert _masks() == before


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
    """Tokens, caches and, for every forward of the target (verify, or a plain one: prefill and
    one-token steps), (kind, cores the thread may use when it starts, when it returns)."""
    target, seen = model.target, []
    verify, hidden, decode = type(target).verify, type(target).hidden, type(target).decode

    def record(fn, kind):
        def wrapped(*args, **kwargs):
            start = len(os.sched_getaffinity(0))
            out = fn(target, *args, **kwargs)
            seen.append((kind, start, len(os.sched_getaffinity(0))))
            return out
        return wrapped

    target.verify, target.hidden = record(verify, "verify"), record(hidden, "step")
    target.decode = record(decode, "step")
    try:
        cache = mlx_mtp.make_prompt_cache(model)
        out = [t for t, _ in mlx_mtp.generate_step(mx.array(PROMPT), model, max_tokens=N,
                                                   block_size=block_size, prompt_cache=cache)]
    finally:
        del target.verify, target.hidden, target.decode
    state = target.cache_state(cache)
    mx.eval(state)
    return out, seen, [bytes(memoryview(x)) for x in state]


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [1, 3])
def test_the_loop_pins_a_kernel_verify_from_its_first_kernel_call_and_changes_nothing(
        wide_dir, monkeypatch, block_size):
    """The wide pair's verify runs its projections through the row kernel (with BLIS): each
    drafted round's verify is pinned once its first kernel call is made (not when it starts:
    the queued draft keeps its core while Python builds the first layer), never a one-token
    step (prefill, block 1); the affinity is back after every round. The kernel runs eagerly
    here (a lazy op makes no host sync to pin for: the next test)."""
    needs_two_cores()
    monkeypatch.setattr(lazy_kernels, "load", lambda environ=None: None)
    model = mlx_mtp.load_model(wide_dir)
    want = reference_greedy(wide_dir, PROMPT, N)
    full = len(os.sched_getaffinity(0))
    monkeypatch.setenv(cpu_pin.ENV, "0")
    _run(model, block_size)  # the first run also runs the exactness probe's forwards
    kernel = calls_the_kernel(model)  # BLIS on AVX2: the wide layers, from 2 rows
    free, f_seen, f_cache = _run(model, block_size)
    monkeypatch.delenv(cpu_pin.ENV)
    pinned, p_seen, p_cache = _run(model, block_size)
    assert free == want and pinned == want
    assert f_cache == p_cache  # the committed caches, bitwise
    assert f_seen == [(kind, full, full) for kind, _, _ in p_seen]
    assert {kind for kind, _, _ in p_seen} == ({"step"} if block_size == 1 else {"step", "verify"})
    assert p_seen == [(kind, full, 1 if kind == "verify" and kernel else full)
                      for kind, _, _ in p_seen]
    assert len(os.sched_getaffinity(0)) == full


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [3])
def test_a_verify_through_the_lazy_kernel_is_not_pinned(wide_dir, block_size):
    """The row kernel as a lazy MLX op: the verify makes no eager kernel call, so nothing is
    pinned, and the output and committed caches are those of the eager, pinned run."""
    needs_two_cores()
    require_lazy()
    model = mlx_mtp.load_model(wide_dir)
    want = reference_greedy(wide_dir, PROMPT, N)
    full = len(os.sched_getaffinity(0))
    _run(model, block_size)
    out, seen, cache = _run(model, block_size)
    with lazy_kernels.eager():
        eager, e_seen, e_cache = _run(model, block_size)
    assert out == want and eager == want and cache == e_cache
    kernel = calls_the_kernel(model)
    assert ("verify", full, full) in seen and {(a, b) for _, a, b in seen} == {(full, full)}
    assert ("verify", full, 1 if kernel else full) in e_seen


def test_no_pinning_where_the_verify_makes_no_kernel_call(monkeypatch):
    """The demo pair's verify makes no eager kernel call (64 KB recurrent states; its layers
    either need no row kernel, as with BLIS on an AVX2 host, or run it as a lazy op, as its down
    projections do with BLIS on an AVX-512 host): nothing is pinned, so the queued draft and
    accept hook keep their overlap with Python."""
    needs_two_cores()
    model = mlx_mtp.load_model(DEMO)
    full = len(os.sched_getaffinity(0))
    _, seen, _ = _run(model, 3)
    kernel = any(row_exact_layers.row_method(m) == "kernel" for _, m in model.mlx_model.named_modules())
    assert not kernel or lazy_kernels.available()
    assert ("verify", full, full) in seen and {(a, b) for _, a, b in seen} == {(full, full)}


def test_no_pinning_with_more_than_one_verify_thread(wide_dir, monkeypatch):
    needs_two_cores()
    model = mlx_mtp.load_model(wide_dir)
    monkeypatch.setenv("MLX_MTP_VERIFY_THREADS", "2")
    _, seen, _ = _run(model, 3)
    assert ("verify", len(CPUS), len(CPUS)) in seen
    assert {(a, b) for _, a, b in seen} == {(len(CPUS), len(CPUS))}
