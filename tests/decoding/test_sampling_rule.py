"""The acceptance rules of ``mlx_mtp.decoding.sampling`` on known p and q, and the sampler / drafting pieces
that produce p and q. No model: everything here runs in a few seconds."""

import itertools
import math

import mlx.core as mx
import numpy as np
import pytest
from support.chisquare import chi2_sf, goodness_of_fit, two_sample
from mlx_lm.sample_utils import greedy_sampler, make_logits_processors
from mlx_lm.sample_utils import make_sampler as mlx_make_sampler

from mlx_mtp import MTPError
from mlx_mtp.decoding import acceptance as A
from mlx_mtp.decoding import sampling as S


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


def test_draw_rows_is_the_inverse_cdf_of_unnormalized_weights():
    w = f32([[0.0, 1.0, 0.0, 3.0, 0.0], [0.0, 1.0, 0.0, 3.0, 0.0]])
    # running sums 0 1 1 4 4: u * 4 below 1 -> id 1, from 1 on -> id 3; zero weights never drawn
    for u, want in [(0.0, 1), (0.2499, 1), (0.25, 3), (0.9, 3)]:
        assert S.draw_rows(w, f32([u, u])).tolist() == [want, want], u
    assert S.draw_rows(8 * w, f32([0.2, 0.3])).tolist() == [1, 3]  # the scale does not matter
    # u * total rounding up to the total still draws the last id with mass, not one past it
    assert S.draw_rows(f32([[1.0, 1.0, 0.0]]), f32([1.0])).tolist() == [1]


def test_prefix_weights_carry_an_earlier_deficit_forward():
    # ratios 0.5, 2, 0.5: token-by-token keeps draft 2 only after a coin of 0.5; the weight makes
    # up for draft 1's deficit with draft 2's surplus. A draft the target cannot emit zeroes the
    # rest.
    w = S.prefix_weights(f32([0.25, 0.5, 0.25]), f32([0.5, 0.25, 0.5]))
    assert w.tolist() == [1.0, 0.5, 1.0, 0.5]
    assert S.prefix_weights(f32([0.0, 0.5]), f32([0.5, 0.25])).tolist() == [1.0, 0.0, 0.0]


def test_pass_probabilities_follow_the_block_rule():
    # prefix i < k: m_i / (m_i + 1 - w_i); the whole block: w_k; w_i = 1 with m_i = 0 passes.
    weights = f32([1.0, 0.5, 1.0, 0.25])
    got = S.pass_probabilities(weights, f32([0.3, 0.5, 0.0])).tolist()
    assert got == pytest.approx([0.5 / (0.5 + 0.5), 1.0, 0.25])
    assert S.pass_probabilities(f32([1.0, 0.4]), f32([0.2])).tolist() == pytest.approx([0.4])


def test_lift_q_places_subset_mass_on_target_ids():
    q = f32([[0.75, 0.25], [0.5, 0.5]])
    ids = mx.array([3, 1])
    assert S.lift_q(q, ids, 5).tolist() == [[0, 0.25, 0, 0.75, 0], [0, 0.5, 0, 0.5, 0]]
    assert S.lift_q(q, None, 5) is q


def test_verify_decides_degenerate_cases_exactly():
    # Row 0: p(d) = 0, so the draft is rejected and the residual (all on id 1) is emitted.
    # Row 1: p == q. Row 2 (bonus): p is one-hot on id 2.
    p = f32([[0, 1, 0, 0], [0.5, 0, 0.5, 0], [0, 0, 1, 0]])
    q = f32([[1, 0, 0, 0], [0.5, 0, 0.5, 0]])
    for seed in range(20):
        accepted, toks = S.rejection_sample(p, q, mx.array([0, 2]), mx.random.key(seed))
        assert accepted.tolist() == [False, False]  # draft 1's weight 0 sinks the whole block
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
    """N independent rounds of one draft each, vectorized (``mx.vmap``) over ``rule(p, q, drafts,
    coins, u, q_ids)`` with the signature of ``S.verdicts``: p is P at both rows."""
    kd, kc, ku = mx.random.split(mx.random.key(seed), 3)
    q_full = S.lift_q(q_rows, q_ids, V)
    drafts = mx.random.categorical(mx.log(q_full), key=kd).astype(mx.uint32)
    p_rows = mx.broadcast_to(f32([P]), (N, 2, V))
    coins = mx.random.uniform(shape=(N, 1), key=kc)
    u = mx.random.uniform(shape=(N, 2), key=ku)
    accepted, toks = mx.vmap(lambda p, q, d, c, u: rule(p, q, d, c, u, q_ids))(
        p_rows, q_rows[:, None], drafts[:, None], coins, u)
    emitted = mx.where(accepted[:, 0], drafts, toks[:, 0])
    return emitted.tolist(), accepted[:, 0].tolist()


def argmax_matching(p, q, drafts, coins, u, q_ids=None):
    """A known biased rule: keep a sampled draft when it equals the target's argmax, else emit a
    draw from p."""
    k = drafts.size
    return drafts == mx.argmax(p[:k], axis=-1), S.draw_rows(p, u)


def residual_from_p(p, q, drafts, coins, u, q_ids=None):
    """Another: the right coin, but a rejection redraws from p instead of max(p - q, 0)."""
    accepted, _ = S.verdicts(p, q, drafts, coins, u, q_ids)
    return accepted, S.draw_rows(p, u)


def p_dict():
    return {i: P[i] for i in range(V)}


def test_speculative_sampling_emits_p_and_accepts_sum_min_p_q():
    q = mx.broadcast_to(f32([Q]), (N, V))
    emitted, accepted = one_position_trials(S.verdicts, q)
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
    emitted, accepted = one_position_trials(S.verdicts, q, seed=1)
    assert goodness_of_fit(emitted, p_dict())[2] > ALPHA
    assert abs(np.mean(accepted) - P[d]) < 0.02  # a one-hot q is kept with probability p(d)


def test_q_on_a_draft_vocabulary_subset():
    ids = mx.array([1, 3, 5])
    q = mx.broadcast_to(f32([[0.5, 0.3, 0.2]]), (N, 3))
    emitted, accepted = one_position_trials(S.verdicts, q, q_ids=ids, seed=2)
    assert goodness_of_fit(emitted, p_dict())[2] > ALPHA
    assert abs(np.mean(accepted) - (0.25 + 0.1 + 0.0)) < 0.02


def test_draw_rows_follows_the_weights():
    n = 40000
    rows = mx.broadcast_to(f32([P]) * 3.0, (n, V))
    got = S.draw_rows(rows, mx.random.uniform(shape=(n,), key=mx.random.key(5))).tolist()
    assert goodness_of_fit(got, p_dict())[2] > ALPHA


# --------------------------------------- block verification keeps the joint distribution (k > 1)


def random_tree(V, k, seed):
    """Context-dependent p (target, rows for prefixes of length 0..k) and q (drafter, 0..k-1),
    with some exact zeros in both."""
    rng = np.random.default_rng(seed)
    P_, Q_ = {}, {}
    for n in range(k + 1):
        for prefix in itertools.product(range(V), repeat=n):
            for table in (P_, Q_) if n < k else (P_,):
                row = rng.dirichlet(np.full(V, 0.7))
                if rng.random() < 0.3:
                    row[rng.integers(V)] = 0.0
                table[prefix] = (row / row.sum()).astype(np.float32)
    return P_, Q_


def target_prob(P_, seq, start=()):
    prob, prefix = 1.0, tuple(start)
    for t in seq:
        prob *= float(P_[prefix][t])
        prefix += (t,)
    return prob


def exact_round(P_, Q_, V, k, pass_probabilities):
    """The exact probability of every emitted block ``drafts[:a] + (token,)``, from the rule's
    own weights and pass probabilities (the coins are independent, the longest pass is kept)."""
    emitted = {}
    for X in itertools.product(range(V), repeat=k):
        px = target_prob(Q_, X)
        if px == 0:
            continue
        p = f32([P_[X[:i]] for i in range(k + 1)])
        q = f32([Q_[X[:i]] for i in range(k)])
        d = mx.array(X)[:, None]
        weights = S.prefix_weights(mx.take_along_axis(p[:k], d, -1)[:, 0],
                                   mx.take_along_axis(q, d, -1)[:, 0])
        r = mx.maximum(weights[:k, None] * p[:k] - q, 0.0)
        h = np.array(pass_probabilities(weights, r.sum(axis=-1)), dtype=np.float64)
        rows = np.array(mx.concatenate([r, p[k:]]), dtype=np.float64)
        for a in range(k + 1):
            p_a = (h[a - 1] if a else 1.0) * np.prod(1 - h[a:])
            if p_a > 0:
                dist = rows[a] / rows[a].sum() if rows[a].sum() > 0 else rows[a]
                for y in np.flatnonzero(dist):
                    o = X[:a] + (int(y),)
                    emitted[o] = emitted.get(o, 0.0) + px * p_a * dist[y]
    return emitted


def joint_error(P_, V, k, emitted):
    """max over z in V^(k+1) of |P(the output starts with z) - p(z)|, the run going on with
    plain sampling after the round."""
    worst = 0.0
    for z in itertools.product(range(V), repeat=k + 1):
        got = sum(emitted.get(z[: j + 1], 0.0) * target_prob(P_, z[j + 1 :], z[: j + 1])
                  for j in range(k + 1))
        worst = max(worst, abs(got - target_prob(P_, z)))
    return worst


def token_wise_passes(weights, mass):
    """A known wrong rule for the block residual: each prefix passes with its weight."""
    return weights[1:]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_block_verification_keeps_the_joint_distribution_exactly(k):
    for seed in range(4):
        P_, Q_ = random_tree(3, k, seed)
        emitted = exact_round(P_, Q_, 3, k, S.pass_probabilities)
        assert abs(sum(emitted.values()) - 1) < 1e-5
        assert joint_error(P_, 3, k, emitted) < 2e-6, (k, seed)
        if k > 1:  # the negative control: prefixes passing with their weights are biased
            wrong = exact_round(P_, Q_, 3, k, token_wise_passes)
            assert joint_error(P_, 3, k, wrong) > 1e-3, (k, seed)


def test_block_verification_keeps_drafts_token_wise_would_not():
    """On the same trees block verification keeps more drafts on average than token-by-token
    verification (the first rejection ends the block), which it never undercuts."""
    k, gains = 3, []
    for seed in range(4):
        P_, Q_ = random_tree(3, k, seed)
        block = exact_round(P_, Q_, 3, k, S.pass_probabilities)
        kept_token = 0.0  # sum over i of P(drafts 1..i all pass their own coin min(1, p/q))
        for X in itertools.product(range(3), repeat=k):
            px, keep = target_prob(Q_, X), 1.0
            for i in range(k if px else 0):
                keep *= min(P_[X[:i]][X[i]] / Q_[X[:i]][X[i]], 1.0)
                kept_token += px * keep
        kept_block = sum(v * (len(o) - 1) for o, v in block.items())
        assert kept_block >= kept_token - 1e-6
        gains.append(kept_block - kept_token)
    assert max(gains) > 0.02


@pytest.mark.slow
def test_the_round_samples_the_joint_distribution():
    """The round's graph (``verdicts``, which the compiled round runs, with its uniforms), k = 2
    over V = 3:
    N rounds on drafts drawn from q, each continued by plain sampling to k + 1 tokens, against
    p's exact joint distribution; the token-wise pass rule as the negative control."""
    V_, k, n = 3, 2, 20000
    P_, Q_ = random_tree(V_, k, 11)
    rng = np.random.default_rng(0)
    drafts = []
    for _ in range(n):
        X = ()
        for _ in range(k):
            X += (int(rng.choice(V_, p=Q_[X] / Q_[X].sum())),)
        drafts.append(X)
    p = f32([[P_[X[:i]] for i in range(k + 1)] for X in drafts])
    q = f32([[Q_[X[:i]] for i in range(k)] for X in drafts])
    keys = mx.random.split(mx.random.key(3))
    coins = mx.random.uniform(shape=(n, k), key=keys[0])
    u = mx.random.uniform(shape=(n, k + 1), key=keys[1])
    exact = {z: target_prob(P_, z) for z in itertools.product(range(V_), repeat=k + 1)}

    def outputs(rule):
        accepted, toks = mx.vmap(rule)(p, q, mx.array(drafts, dtype=mx.uint32), coins, u)
        out = []
        for X, acc, t in zip(drafts, accepted.tolist(), toks.tolist()):
            a = S.accepted_length(acc)
            z = X[:a] + (t[a],)
            while len(z) < k + 1:
                z += (int(rng.choice(V_, p=P_[z] / P_[z].sum())),)
            out.append(z)
        return out

    assert goodness_of_fit(outputs(S.verdicts), exact)[2] > ALPHA
    real = S.pass_probabilities
    try:
        S.pass_probabilities = token_wise_passes
        assert goodness_of_fit(outputs(S.verdicts), exact)[2] < ALPHA
    finally:
        S.pass_probabilities = real


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
    # raw logits give the same distribution (the loop passes them: no log-normalizing pass)
    assert np.allclose(np.array(ours.probs(logits)), np.array(p), rtol=0, atol=1e-6)
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
    assert A.rule_name(None, CanSample()) == A.GREEDY
    assert A.rule_name(S.make_sampler(), CanSample()) == A.GREEDY
    assert A.rule_name(hot, CanSample()) == A.SPECULATIVE
    assert A.rule_name(hot, GreedyOnly()) == A.POINT_MASS
    assert A.rule_name(hot, None) == A.POINT_MASS
    assert A.rule_name(mlx_make_sampler(temp=0.8), CanSample()) == A.POINT_MASS
    assert A.rule_name(hot, CanSample(), "point-mass") == A.POINT_MASS
    assert A.rule_name(S.make_sampler(), CanSample(), "point-mass") == A.GREEDY


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
        A.rule_name(sampler, drafter, requested)
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
        k, sub = mx.random.split(k)
        assert q[j].tolist() == sampler.probs(lg)[0].tolist()
        # drawn from that q row itself, with a uniform from split(key)[1]
        u = mx.random.uniform(shape=(1,), key=sub)
        assert toks[j].tolist() == S.draw_rows(q[j : j + 1], u).tolist()
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
