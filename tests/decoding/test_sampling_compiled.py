"""The compiled sampling pieces compute bitwise what their eager definitions compute, so a seed
draws the same tokens either way (the chi-square tests in test_sampling_loop.py check the
distribution itself)."""

import mlx.core as mx
import pytest

from mlx_mtp.decoding import sampling as S

SETTINGS = [dict(temp=0.6), dict(temp=1.0, top_k=5), dict(temp=0.8, top_p=0.9),
            dict(temp=0.7, min_p=0.05)]


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and bytes(memoryview(a)) == bytes(memoryview(b))


@pytest.mark.parametrize("cfg", SETTINGS)
def test_pick_and_probs_are_their_eager_definitions(cfg):
    sampler = S.make_sampler(**cfg)
    for seed in range(5):
        logits = 3 * mx.random.normal((1, 512), key=mx.random.key(seed))
        key = mx.random.key(100 + seed)
        got, want = sampler.pick(logits, key), sampler._eager_pick(logits, key)
        assert all(same(g, w) for g, w in zip(got, want)), (cfg, seed)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        assert same(sampler.probs(lp), sampler._eager_probs(lp))
        assert same(sampler.probs(logits), sampler._eager_probs(logits))
        # the draw is the inverse CDF of the q row with a uniform from split(key)[1]
        u = mx.random.uniform(shape=(1,), key=mx.random.split(key)[1])
        assert got[0].tolist() == S.draw_rows(got[1], u).tolist()


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("subset", [False, True])
def test_verify_graph_is_the_eager_rule(k, subset):
    V = 64
    sampler = S.make_sampler(temp=0.9)
    ids = mx.arange(0, V, 2, dtype=mx.uint32) if subset else None
    Vq = V // 2 if subset else V
    for seed in range(5):
        keys = mx.random.split(mx.random.key(seed), 4)
        p = sampler.probs(mx.random.normal((k + 1, V), key=keys[0]))
        q = sampler.probs(mx.random.normal((k, Vq), key=keys[1]))
        drafts = mx.random.randint(0, Vq, (k,), key=keys[2]).astype(mx.uint32)
        if subset:
            drafts = ids[drafts]
        got = S.rejection_sample(p, q, drafts, keys[3], ids)
        want = S._verify_rows(p, q, drafts, keys[3], ids)
        assert all(same(g, w) for g, w in zip(got, want)), (k, subset, seed)


def test_samplers_with_the_same_settings_share_their_graphs():
    a, b = S.make_sampler(temp=0.6, top_k=5), S.make_sampler(temp=0.6, top_k=5)
    c = S.make_sampler(temp=0.6, top_k=6)
    assert a._pick is b._pick and a._probs is b._probs
    assert c._pick is not a._pick
    logits = mx.random.normal((1, 64), key=mx.random.key(0))
    assert same(c.pick(logits, mx.random.key(1))[1], c._eager_pick(logits, mx.random.key(1))[1])
