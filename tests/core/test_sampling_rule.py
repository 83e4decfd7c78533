"""The acceptance rules of ``mlx_mtp.sampling`` on known p and q, and the sampler / drafting pieces
that produce p and q. No model: everything here runs in a few seconds."""

import math

import mlx.core as mx
import numpy as np
import pytest
from chisquare import chi2_sf, goodness_of_fit, two_sample
from mlx_lm.sample_utils import greedy_sampler, make_logits_processors
from mlx_lm.sample_utils import make_sampler as mlx_make_sampler

from mlx_mtp import MTPError
from mlx_mtp import sampling as S


def f32(x):
    return mx.array(np.array(x, dtype=np.float32))


# ------------------------------------------------------------------------ the chi-square helper


def test_chi2_sf_matches_tabulated_quantiles():
    # 95th and 99.9th percentiles from standard tables.
    for stat, dof, sf in [(3.841458820694124, 1, 0.05), (10.827566170662733, 1, 0.001),
                          (18.307038053275146, 10, 0.05), (124.34211340400407, 100, 0.05),
                          (0.10258658877510106, 2, 0.95)]:
        assert chi2_sf(stat, dof) == pytest.approx(sf, rel=1e-9), (stat, dof)


def test_two_sample_statistic_on_known_counts():
    a = ["x"] * 30 + ["y"] * 70
    b = ["x"] * 50 + ["y"] * 50
    stat, dof, p = two_sample(a, b)
    # (30-50)^2/80 + (70-50)^2/120 with equal sizes.
    assert dof == 1 and stat == pytest.approx(400 / 80 + 400 / 120)
    assert p == pytest.approx(chi2_sf(stat, 1))


# ----------------------------------------------------------------------------- exact rule parts


def test_residual_is_normalized_positive_part_of_p_minus_q():
    p = f32([[0.5, 0.25, 0.25, 0.0]])
    q = f32([[0.25, 0.5, 0.0, 0.25]])
    assert S.residual(p, q).tolist() == [[0.5, 0.0, 0.5, 0.0]]


def test_residual_for_a_one_hot_q_is_p_without_the_draft():
    p = f32([[0.5, 0.25, 0.25, 0.0]])
    q = f32([[1.0, 0.0, 0.0, 0.0]])
    assert S.residual(p, q).tolist() == [[0.0, 0.5, 0.5, 0.0]]


def test_residual_falls_back_to_p_when_q_covers_p():
    p = f32([[0.5, 0.25, 0.25, 0.0], [0.0, 1.0, 0.0, 0.0]])
    assert S.residual(p, p).tolist() == p.tolist()


def test_accept_is_u_times_q_below_p():
    p_d = f32([0.25, 0.25, 0.25, 0.5, 0.0, 0.125])
    q_d = f32([0.5, 0.5, 0.5, 0.25, 0.5, 0.0])
    u = f32([0.49, 0.5, 0.51, 0.999, 0.0, 0.7])
    # ratio 0.5: u = 0.49 keeps, 0.5 and 0.51 do not; p >= q always keeps; p = 0 never does.
    assert S.accept_drafts(p_d, q_d, u).tolist() == [True, False, False, True, False, True]


def test_lift_q_places_subset_mass_on_target_ids():
    q = f32([[0.75, 0.25], [0.5, 0.5]])
    ids = mx.array([3, 1])
    assert S.lift_q(q, ids, 5).tolist() == [[0, 0.25, 0, 0.75, 0], [0, 0.5, 0, 0.5, 0]]
    assert S.lift_q(q, None, 5) is q


def test_verify_decides_degenerate_cases_exactly():
    # Row 0: p(d) = 0, so the draft is rejected and the residual (all on id 1) is emitted.
    # Row 1: p == q, always kept. Row 2 (bonus): p is one-hot on id 2.
    p = f32([[0, 1, 0, 0], [0.5, 0, 0.5, 0], [0, 0, 1, 0]])
    q = f32([[1, 0, 0, 0], [0.5, 0, 0.5, 0]])
    for seed in range(20):
        accepted, toks = S.rejection_sample(p, q, mx.array([0, 2]), mx.random.key(seed))
        assert accepted.tolist() == [False, True]
        assert toks.tolist()[0] == 1 and toks.tolist()[2] == 2


def test_verify_without_drafts_samples_the_bonus_from_p():
    accepted, toks = S.rejection_sample(f32([[0, 0, 1.0]]), None, mx.array([], dtype=mx.uint32),
                                          mx.random.key(0))
    assert accepted.size == 0 and toks.tolist() == [2]


def test_accepted_length():
    assert S.accepted_length([]) == 0
    assert S.accepted_length([1, 1, 0, 1]) == 2
    assert S.accepted_length([True, True]) == 2


# ------------------------------------------------------- the rule is lossless (statistically)

V = 6
P = [0.35, 0.25, 0.2, 0.1, 0.1, 0.0]  # p has mass where q has none (id 2) ...
Q = [0.1, 0.45, 0.0, 0.2, 0.05, 0.2]  # ... and q has mass where p has none (id 5)
N = 20000
ALPHA = 1e-3


def one_position_trials(rule, q_rows, q_ids=None, seed=0):
    """N independent single-position trials of ``rule``, vectorized: every trial is one verify row
    (rows are independent inside the rule) and the first-rejection logic is per trial."""
    kd, kr = mx.random.split(mx.random.key(seed))
    q_full = S.lift_q(q_rows, q_ids, V)
    drafts = mx.random.categorical(mx.log(q_full), key=kd).astype(mx.uint32)
    p_rows = mx.broadcast_to(f32([P]), (N + 1, V))
    accepted, toks = rule(p_rows, q_rows, drafts, kr, q_ids)
    emitted = mx.where(accepted, drafts, toks[:N])
    return emitted.tolist(), accepted.tolist()


def argmax_matching(p, q, drafts, key, q_ids=None):
    """A known biased rule: keep a sampled draft when it equals the target's argmax, else emit a
    draw from p."""
    k = drafts.size
    return drafts == mx.argmax(p[:k], axis=-1), mx.random.categorical(mx.log(p), key=key)


def residual_from_p(p, q, drafts, key, q_ids=None):
    """Another: the right coin, but a rejection redraws from p instead of max(p - q, 0)."""
    accepted, _ = S.rejection_sample(p, q, drafts, key, q_ids)
    return accepted, mx.random.categorical(mx.log(p), key=mx.random.split(key)[1])


def p_dict():
    return {i: P[i] for i in range(V)}


def test_speculative_sampling_emits_p_and_accepts_sum_min_p_q():
    q = mx.broadcast_to(f32([Q]), (N, V))
    emitted, accepted = one_position_trials(S.rejection_sample, q)
    assert goodness_of_fit(emitted, p_dict())[2] > ALPHA
    # Acceptance is sum_x min(p, q) = 0.5; binomial sd at N = 20000 is 0.0035.
    assert abs(np.mean(accepted) - 0.5) < 0.02
    # Plain sampling from p agrees with it as a second sample too.
    plain = mx.random.categorical(mx.log(mx.broadcast_to(f32([P]), (N, V))),
                                  key=mx.random.key(99)).tolist()
    assert two_sample(emitted, plain)[2] > ALPHA


def test_point_mass_q_is_the_greedy_drafter_case():
    d = 1
    q = mx.broadcast_to(f32([[1.0 if i == d else 0.0 for i in range(V)]]), (N, V))
    emitted, accepted = one_position_trials(S.rejection_sample, q, seed=1)
    assert goodness_of_fit(emitted, p_dict())[2] > ALPHA
    assert abs(np.mean(accepted) - P[d]) < 0.02  # a one-hot q is kept with probability p(d)


def test_q_on_a_draft_vocabulary_subset():
    ids = mx.array([1, 3, 5])
    q = mx.broadcast_to(f32([[0.5, 0.3, 0.2]]), (N, 3))
    emitted, accepted = one_position_trials(S.rejection_sample, q, q_ids=ids, seed=2)
    assert goodness_of_fit(emitted, p_dict())[2] > ALPHA
    assert abs(np.mean(accepted) - (0.25 + 0.1 + 0.0)) < 0.02


@pytest.mark.parametrize("biased", [argmax_matching, residual_from_p],
                         ids=lambda f: f.__name__)
def test_the_same_test_rejects_biased_rules(biased):
    q = mx.broadcast_to(f32([Q]), (N, V))
    emitted, _ = one_position_trials(biased, q)
    assert goodness_of_fit(emitted, p_dict())[2] < ALPHA


# ------------------------------------------------------------------------------------ Sampler

CONFIGS = [
    dict(temp=1.0),
    dict(temp=0.7, top_p=0.9),
    dict(temp=1.3, min_p=0.1),
    dict(temp=0.8, min_p=0.05, min_tokens_to_keep=3),
    dict(temp=1.0, top_k=5),
    dict(temp=0.6, top_p=0.8, min_p=0.05, top_k=10, min_tokens_to_keep=2),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_sampler_distribution_is_what_mlx_lm_samples_from(cfg):
    """Same global seed: mlx-lm's sampler and a categorical draw from ``Sampler.logits`` pick the
    same ids on 2000 rows, so the logits are mlx-lm's (Gumbel-max with the same noise)."""
    logits = mx.random.normal((2000, 64), key=mx.random.key(5)) * 2.0
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ours = S.make_sampler(**cfg)
    mx.random.seed(11)
    theirs = mlx_make_sampler(**cfg)(logprobs).tolist()
    mx.random.seed(11)
    assert mx.random.categorical(ours.logits(logprobs)).tolist() == theirs
    mx.random.seed(11)
    assert ours(logprobs).tolist() == theirs
    p = ours.probs(logprobs)
    assert p.dtype == mx.float32
    assert np.allclose(np.array(p.sum(axis=-1)), 1.0, atol=1e-5)
    if cfg.get("top_k"):
        assert int((p > 0).sum(axis=-1).max().item()) <= cfg["top_k"]


def test_greedy_samplers_are_recognized():
    assert S.is_argmax(None) and S.is_argmax(greedy_sampler) and S.is_argmax(S.make_sampler())
    assert not S.is_argmax(S.make_sampler(temp=0.5))
    assert not S.is_argmax(mlx_make_sampler(temp=0.5))


@pytest.mark.parametrize("kwargs,message", [
    (dict(temp=-1.0), "temp must be >= 0, got -1.0"),
    (dict(top_p=1.5), "top_p must be between 0 and 1, got 1.5"),
    (dict(min_p=-0.1), "min_p must be between 0 and 1, got -0.1"),
    (dict(top_k=-2), "top_k must be a non-negative integer, got -2"),
    (dict(top_k=2.5), "top_k must be a non-negative integer, got 2.5"),
    (dict(min_tokens_to_keep=0), "min_tokens_to_keep must be a positive integer, got 0"),
])
def test_sampler_rejects_bad_parameters(kwargs, message):
    with pytest.raises(MTPError) as e:
        S.make_sampler(**kwargs)
    assert str(e.value) == message


def test_top_k_must_be_below_the_vocabulary():
    with pytest.raises(MTPError) as e:
        S.make_sampler(temp=1.0, top_k=320).check_vocab(320)
    assert str(e.value) == "top_k (--top-k) must be below the vocabulary size 320, got 320"
    S.make_sampler(temp=1.0, top_k=319).check_vocab(320)
    S.make_sampler(temp=0.0, top_k=999).check_vocab(320)  # greedy ignores top-k, like mlx-lm


# ------------------------------------------------------------------------------- rule choice


class GreedyOnly:
    def draft(self, k):
        raise AssertionError


class CanSample(GreedyOnly):
    def draft_sampled(self, k, sample):
        raise AssertionError


def test_rule_choice():
    hot = S.make_sampler(temp=0.8)
    assert S.choose_rule(None, CanSample()) == S.GREEDY
    assert S.choose_rule(S.make_sampler(), CanSample()) == S.GREEDY
    assert S.choose_rule(hot, CanSample()) == S.SPECULATIVE
    assert S.choose_rule(hot, GreedyOnly()) == S.POINT_MASS
    assert S.choose_rule(hot, None) == S.POINT_MASS
    assert S.choose_rule(mlx_make_sampler(temp=0.8), CanSample()) == S.POINT_MASS
    assert S.choose_rule(hot, CanSample(), "point-mass") == S.POINT_MASS
    assert S.choose_rule(S.make_sampler(), CanSample(), "point-mass") == S.GREEDY


@pytest.mark.parametrize("sampler,drafter,requested,message", [
    (S.make_sampler(temp=0.8), CanSample(), "bogus",
     "acceptance must be one of auto, point-mass, speculative-sampling, got 'bogus'"),
    (S.make_sampler(), CanSample(), "speculative-sampling",
     "acceptance speculative-sampling needs a temperature above 0"),
    (mlx_make_sampler(temp=0.8), CanSample(), "speculative-sampling",
     "acceptance speculative-sampling needs a sampler from mlx_mtp.make_sampler: a plain sampler "
     "function does not say which distribution it samples from"),
    (S.make_sampler(temp=0.8), GreedyOnly(), "speculative-sampling",
     "acceptance speculative-sampling needs a drafter with draft_sampled; GreedyOnly only drafts "
     "greedily"),
])
def test_rule_choice_errors(sampler, drafter, requested, message):
    with pytest.raises(MTPError) as e:
        S.choose_rule(sampler, drafter, requested)
    assert str(e.value) == message


# --------------------------------------------------------------------- processors and drafting


def test_process_rows_feeds_each_row_its_drafted_prefix():
    procs = make_logits_processors(repetition_penalty=2.0)
    logits = mx.random.normal((3, 16), key=mx.random.key(1)) + 3.0
    history = mx.array([4, 5, 9])  # ends with the bonus 9
    block = mx.array([9, 7, 11])
    got = S.process_rows(logits, history, block, procs)
    for i, toks in enumerate([[4, 5, 9], [4, 5, 9, 7], [4, 5, 9, 7, 11]]):
        want = procs[0](mx.array(toks), logits[i : i + 1])
        assert got[i : i + 1].tolist() == want.tolist(), i
    assert got[2, 11].item() != logits[2, 11].item() and got[1, 11].item() == logits[1, 11].item()


def test_draft_sampler_records_the_q_it_draws_from():
    sampler = S.make_sampler(temp=0.9, top_k=4)
    key = mx.random.key(3)
    ds = S.DraftSampler(sampler, key, vocab_size=16)
    logits = [mx.random.normal((1, 16), key=mx.random.key(10 + j)) for j in range(3)]
    toks = [ds(lg) for lg in logits]
    drafts, q, q_ids = ds.result()
    assert q_ids is None and drafts.dtype == mx.uint32 and q.shape == (3, 16)
    k = key
    for j, lg in enumerate(logits):
        lp = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
        k, sub = mx.random.split(k)
        assert q[j].tolist() == sampler.probs(lp)[0].tolist()
        assert toks[j].tolist() == mx.random.categorical(sampler.logits(lp), key=sub).tolist()
    assert drafts.tolist() == [t.item() for t in toks]


def test_draft_sampler_applies_processors_with_the_drafted_prefix():
    sampler = S.make_sampler(temp=1.0)
    procs = make_logits_processors(repetition_penalty=3.0)
    history = mx.array([2, 6])
    ds = S.DraftSampler(sampler, mx.random.key(4), 8, procs, history)
    logits = [mx.full((1, 8), 2.0) + mx.arange(8) * 0.01 for _ in range(3)]
    before = [lg.tolist() for lg in logits]
    toks = [ds(lg).item() for lg in logits]
    assert [lg.tolist() for lg in logits] == before  # the caller's logits are left alone
    _, q, _ = ds.result()
    seen = [2, 6]
    for j, lg in enumerate(logits):
        processed = procs[0](mx.array(seen), lg)
        want = sampler.probs(processed - mx.logsumexp(processed, axis=-1, keepdims=True))
        assert np.allclose(np.array(q[j]), np.array(want[0]), rtol=0, atol=1e-7), j
        seen.append(toks[j])
    # the first draft is penalized at the next step (the prefix reached the processor)
    assert toks[0] not in (2, 6)
    assert q[1, toks[0]].item() < q[0, toks[0]].item() / 2


def test_draft_sampler_on_a_subset_returns_target_ids():
    sampler = S.make_sampler(temp=1.0)
    table = mx.array([7, 3, 12])
    procs = make_logits_processors(repetition_penalty=4.0)
    ds = S.DraftSampler(sampler, mx.random.key(8), 16, procs, mx.array([3]))
    for j in range(40):
        assert ds(mx.array([[1.0, 1.0, 1.0]]), ids=table).item() in (7, 3, 12)
    drafts, q, q_ids = ds.result()
    assert q_ids.tolist() == [7, 3, 12] and q.shape == (40, 3)
    # id 3 is in the history: penalized (logit 1 / 4) against 1 for the other two.
    e = math.exp(0.25)
    want = [math.e / (2 * math.e + e), e / (2 * math.e + e), math.e / (2 * math.e + e)]
    assert np.allclose(np.array(q[0]), want, atol=1e-6)
