"""The block-vs-chain exactness probe: equal on CPU f32 targets, a one-ulp verify perturbation
caught with its exact byte count, a probe that cannot run, and the per-process memo."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model as mlx_load_model
from support.perturbed import BrokenVerify, CountingTarget, PerturbedVerify, one_ulp

import mlx_mtp
from mlx_mtp.exactness import block_vs_chain as exactness
from mlx_mtp.exactness.block_vs_chain import (DIVERGES, EQUAL, NOT_RUN, PROBE_DRAWS, PROBE_PROMPT_LEN,
                               block_rows, chain_rows, first_difference, probe_exactness,
                               probe_tokens)


@pytest.fixture(autouse=True)
def fresh_memo():
    exactness.clear_memo()
    yield
    exactness.clear_memo()


@pytest.mark.parametrize("kind", ["dense", "moe", "tied", "q4", "next"])
def test_probe_reports_equal_on_cpu_f32_targets(kind, request):
    model = mlx_mtp.load_model(request.getfixturevalue(f"{kind}_dir"), require_head=False)
    assert model.target.dtype == mx.float32
    results = probe_exactness(model.target, [6, 2, 3, 4, 5])
    assert [r.width for r in results] == [2, 3, 4, 5, 6]
    for r in results:
        assert (r.verdict, r.position, r.differing_bytes, r.draw, r.reason, r.cached) == \
            (EQUAL, None, 0, None, "", False)
        assert r.total_bytes == model.target.vocab_size * 4  # one f32 logits row
        assert r.draws == PROBE_DRAWS == 3


def test_probe_tokens_are_deterministic_and_differ_per_draw():
    p0, b0 = probe_tokens(320, 4, 0)
    assert (p0, b0) == probe_tokens(320, 4, 0)
    assert len(p0) == PROBE_PROMPT_LEN == 8 and len(b0) == 4
    assert probe_tokens(320, 6, 0)[1][:4] == b0  # a wider block extends the narrower one
    assert probe_tokens(320, 4, 1) != (p0, b0) and probe_tokens(320, 4, 2) != probe_tokens(320, 4, 1)
    assert all(0 <= t < 7 for t in probe_tokens(7, 16, 2)[0] + probe_tokens(7, 16, 2)[1])


def _row_bytes(a: mx.array) -> np.ndarray:
    return np.array(a).view(np.uint8)


def _expected_differing_bytes(path, wrapped, width: int, position: int) -> int:
    """Independently of the probe: mlx-lm's own plain decode of the synthetic tokens (the chain)
    against the perturbed verify forward (the block), at ``position``."""
    prompt, block = probe_tokens(wrapped.vocab_size, width, 0)
    pristine, _ = mlx_load_model(Path(path))
    cache = pristine.make_cache()
    pristine(mx.array(prompt[:-1])[None], cache=cache)
    pristine(mx.array(prompt[-1:])[None], cache=cache)
    chain = [pristine(mx.array([[t]]), cache=cache)[0, -1] for t in block]
    vcache = wrapped.make_cache()
    wrapped.hidden(mx.array(prompt[:-1])[None], vcache)
    wrapped.hidden(mx.array(prompt[-1:])[None], vcache)
    verified = wrapped.logits(wrapped.verify(mx.array(block)[None], vcache)[0])
    for i in range(position):  # rows before the perturbed one are untouched and equal
        assert np.array_equal(_row_bytes(chain[i]), _row_bytes(verified[i]))
    return int((_row_bytes(chain[position]) != _row_bytes(verified[position])).sum())


@pytest.mark.parametrize("position", [0, 1])
def test_one_ulp_in_the_verify_path_is_caught_with_its_bytes(position, dense_dir):
    model = mlx_mtp.load_model(dense_dir, require_head=False)
    wrapped = PerturbedVerify(model.target, position=position)
    results = probe_exactness(wrapped, [2, 3, 4])
    for r in results:
        want = _expected_differing_bytes(dense_dir, PerturbedVerify(model.target, position),
                                         r.width, position)
        assert want > 0
        assert (r.verdict, r.position, r.draw, r.differing_bytes, r.total_bytes) == \
            (DIVERGES, position, 0, want, 320 * 4), r
        assert r.describe() == (f"width {r.width}: verify block position {position} differs from "
                                f"the single-token chain in {want} of 1280 logit bytes "
                                f"(draw 1 of 3)")
    assert wrapped.verify_calls == 3  # a width that diverged at draw 0 needs no further draws


def test_a_perturbation_past_a_width_is_not_reported_for_it(dense_dir):
    model = mlx_mtp.load_model(dense_dir, require_head=False)
    results = probe_exactness(PerturbedVerify(model.target, position=2), [2, 3])
    assert [(r.width, r.verdict, r.position) for r in results] == [(2, EQUAL, None),
                                                                 (3, DIVERGES, 2)]


def test_a_probe_that_cannot_run_is_not_run(dense_dir):
    model = mlx_mtp.load_model(dense_dir, require_head=False)
    results = probe_exactness(BrokenVerify(model.target), [2, 3])
    assert [(r.width, r.verdict, r.reason) for r in results] == [
        (2, NOT_RUN, "RuntimeError: verify is broken"),
        (3, NOT_RUN, "RuntimeError: verify is broken")]
    assert results[0].describe() == ("width 2: the probe could not run "
                                     "(RuntimeError: verify is broken)")

    class NoVocab:
        pass

    (r,) = probe_exactness(NoVocab(), [2])
    assert (r.verdict, r.reason) == (NOT_RUN, "the target adapter reports no vocab_size")
    assert exactness.aggregate_verdict(results + [probe_exactness(model.target, [2])[0]]) == NOT_RUN


def test_bad_widths_are_rejected(dense_dir):
    model = mlx_mtp.load_model(dense_dir, require_head=False)
    with pytest.raises(ValueError, match=r"probe widths must be integers >= 2, got \[1, 2\]"):
        probe_exactness(model.target, [2, 1])


def test_memo_per_target_width_and_precision(dense_dir):
    model = mlx_mtp.load_model(dense_dir, require_head=False)
    target = CountingTarget(model.target)
    first = probe_exactness(target, [2, 3])
    assert target.verify_calls == 2 * PROBE_DRAWS
    assert [r.cached for r in first] == [False, False]
    again = probe_exactness(target, [3, 2])
    assert target.verify_calls == 2 * PROBE_DRAWS  # no forward at all
    assert [r.cached for r in again] == [True, True]
    assert [(r.verdict, r.total_bytes, r.seconds) for r in again] == \
        [(r.verdict, r.total_bytes, r.seconds) for r in first]
    probe_exactness(target, [2, 3, 4])  # only the new width runs
    assert target.verify_calls == 3 * PROBE_DRAWS

    other = CountingTarget(model.target)  # another adapter is another identity
    probe_exactness(other, [2])
    assert other.verify_calls == PROBE_DRAWS

    # The same adapter after its model was cast in place: a new precision, probed again.
    target.model.set_dtype(mx.bfloat16)
    (r,) = probe_exactness(target, [2])
    assert not r.cached and target.verify_calls > 3 * PROBE_DRAWS

    calls = target.verify_calls
    probe_exactness(target, [2], memoize=False)
    assert target.verify_calls > calls


def test_memo_dies_with_its_target(dense_dir):
    import gc

    model = mlx_mtp.load_model(dense_dir, require_head=False)
    target = CountingTarget(model.target)
    probe_exactness(target, [2])
    assert len(exactness._MEMO) == 1
    del target
    gc.collect()
    assert len(exactness._MEMO) == 0


class ExactOncePrepared(CountingTarget):
    """A target whose verify rows are one ulp off until ``prepare`` configured it for the width
    (what row-exact layers do to a target with a row-variant kernel)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.prepared = 1
        self.prepare_calls = []

    def prepare(self, max_width):
        self.prepare_calls.append(max_width)
        self.prepared = max(self.prepared, max_width)
        inner = getattr(self.inner, "prepare", None)
        if inner is not None:  # an adapter that prepares itself too
            inner(max_width)

    def verify(self, ids, cache):
        h = super().verify(ids, cache)
        return h if ids.shape[1] <= self.prepared else one_ulp(h, 0)


def test_the_probe_prepares_the_target_for_its_widths_first(dense_dir):
    model = mlx_mtp.load_model(dense_dir, require_head=False)
    target = ExactOncePrepared(model.target)
    assert [r.verdict for r in probe_exactness(target, [3, 2])] == [EQUAL, EQUAL]
    assert target.prepare_calls == [3]
    unprepared = ExactOncePrepared(model.target)
    assert first_difference(chain_rows(unprepared, *probe_tokens(320, 2, 0)),
                            block_rows(unprepared, *probe_tokens(320, 2, 0)))[0] == 0


def test_swapping_a_layer_class_in_place_invalidates_the_memo(dense_dir):
    import mlx.nn as nn

    model = mlx_mtp.load_model(dense_dir, require_head=False)
    target = CountingTarget(model.target)
    probe_exactness(target, [2])

    class SameLinear(nn.Linear):
        pass

    model.mlx_model.language_model.lm_head.__class__ = SameLinear
    (r,) = probe_exactness(target, [2])
    assert not r.cached and target.verify_calls == 2 * PROBE_DRAWS


class CountingPrefills(CountingTarget):
    """Counts the probe's prefills (the synthetic prompt less its last token, in one call)."""

    def __init__(self, inner, uncopyable: bool = False):
        super().__init__(inner)
        self.prefills = 0
        self.uncopyable = uncopyable

    def hidden(self, ids, cache, *args):
        self.prefills += ids.shape[1] == PROBE_PROMPT_LEN - 1
        return self.inner.hidden(ids, cache, *args)

    def make_cache(self):
        cache = self.inner.make_cache()
        if self.uncopyable:  # a cache holding something deepcopy refuses
            import threading
            cache[0].lock = threading.Lock()
        return cache


def _state_bytes(target, cache):
    return [_row_bytes(a).tobytes() for a in target.cache_state(cache)]


@pytest.mark.parametrize("kind", ["dense", "next", "q4"])
def test_arms_from_the_copied_prefill_equal_arms_that_prefill_themselves(kind, request):
    """Each arm copies the draw's prefilled caches: the same logits bytes as an arm that runs the
    prefill itself, and the prefilled caches are left as they were (the arms wrote copies)."""
    model = mlx_mtp.load_model(request.getfixturevalue(f"{kind}_dir"), require_head=False)
    target = model.target
    target.prepare(4)
    prompt, block = probe_tokens(target.vocab_size, 4, 1)
    prefilled = exactness.prefilled_caches(target, prompt)
    before = _state_bytes(target, prefilled)
    for arm in (chain_rows, block_rows):
        copied = arm(target, prompt, block, prefilled=prefilled)
        own = arm(target, prompt, block)
        assert [_row_bytes(r).tobytes() for r in copied] == [_row_bytes(r).tobytes() for r in own]
    assert _state_bytes(target, prefilled) == before


def test_the_probe_prefills_once_per_draw(dense_dir):
    model = mlx_mtp.load_model(dense_dir, require_head=False)
    target = CountingPrefills(model.target)
    results = probe_exactness(target, [2, 3, 4, 5, 6])
    assert [r.verdict for r in results] == [EQUAL] * 5
    assert target.prefills == PROBE_DRAWS and target.verify_calls == 5 * PROBE_DRAWS


def test_caches_that_cannot_be_copied_are_prefilled_per_arm(dense_dir):
    model = mlx_mtp.load_model(dense_dir, require_head=False)
    target = CountingPrefills(model.target, uncopyable=True)
    assert [r.verdict for r in probe_exactness(target, [2, 3])] == [EQUAL, EQUAL]
    assert target.prefills == PROBE_DRAWS * (1 + 1 + 2)  # the draw's own, the chain, 2 blocks


def test_a_copied_prefill_still_catches_a_one_ulp_verify(dense_dir):
    model = mlx_mtp.load_model(dense_dir, require_head=False)
    (r,) = probe_exactness(PerturbedVerify(model.target, position=1), [3])
    assert (r.verdict, r.position, r.draw) == (DIVERGES, 1, 0)
