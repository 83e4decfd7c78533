"""Gemma 4 on the shared round loop: T=0 identity with mlx-lm's plain greedy decode, every
acceptance length, bitwise caches after every round, and mutations the suite must catch."""

import mlx.core as mx
import pytest
from support.reference import reference_greedy
from mlx_lm.models.cache import RotatingKVCache, trim_prompt_cache
from mlx_lm.utils import load_model as mlx_load_model
from support.commits import committed, drafter_fed
from support.oracle import ForcedHeadDrafter, OracleDrafter
from support.tiny_gemma4 import WINDOW, Checkpoints

import mlx_mtp
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.models.model import MTPModel
from mlx_mtp.models.gemma4.target import Gemma4Target

MAX_TOKENS = 32
PROMPTS = {"short": [(7 * i + 3) % 300 for i in range(5)],  # crosses the window while decoding
           "long": [(11 * i + 5) % 300 for i in range(40)]}  # longer than the window
assert len(PROMPTS["short"]) < WINDOW < len(PROMPTS["long"])


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return Checkpoints(tmp_path_factory)


def run(model, prompt, block_size, max_tokens=MAX_TOKENS, stats=None, **kw):
    return [t for t, _ in mlx_mtp.generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                                                block_size=block_size, stats=stats, **kw)]


class ForcedAssistant(ForcedHeadDrafter):
    """The real assistant drafts (and re-arms) every round; the oracle's ids are proposed."""

    def bind_cache(self, cache):
        self.inner.bind_cache(cache)


def pair_and_references(ckpts, kind, naming):
    """The loaded pair, and mlx-lm's greedy output for every prompt: (name, prompt, ref)."""
    path = ckpts.target(kind, naming)
    model = mlx_mtp.load_model(path, drafter=ckpts.assistant(kind))
    return model, [(name, prompt, reference_greedy(path, prompt, MAX_TOKENS))
                   for name, prompt in PROMPTS.items()]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["e2b", "31b"])
@pytest.mark.parametrize("naming", ["text", "gemma4"])
def test_greedy_identity_with_real_assistant(kind, naming, ckpts):
    model, cases = pair_and_references(ckpts, kind, naming)
    for name, prompt, ref in cases:
        assert len(set(ref)) > MAX_TOKENS // 2  # a context-sensitive target, not a loop
        for bs in range(1, 7):
            stats = RunStats()
            assert run(model, prompt, bs, stats=stats) == ref, (kind, naming, name, bs)
            assert stats.host_syncs == stats.rounds  # drafts stayed on the device


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["e2b", "31b"])
def test_identity_with_bonus_query_position_and_chunked_prefill(kind, ckpts):
    from mlx_lm.generate import generate_step as mlx_generate_step

    path = ckpts.target(kind)
    model = mlx_mtp.load_model(path, drafter=ckpts.assistant(kind))
    model.drafter.query_position = "bonus"
    prompt = PROMPTS["long"]
    assert run(model, prompt, 4) == reference_greedy(path, prompt, MAX_TOKENS)
    # prefill in chunks of 7: several concat updates, the last one of 4 tokens
    pristine, _ = mlx_load_model(path)
    ref = [t for t, _ in mlx_generate_step(mx.array(prompt), pristine, max_tokens=MAX_TOKENS,
                                           prefill_step_size=7)]
    assert run(model, prompt, 3, prefill_step_size=7) == ref


@pytest.mark.parametrize("kind, naming", [("e2b", "text")] + [  # e2b: the quick subset's Gemma
    pytest.param(*p, marks=pytest.mark.slow)
    for p in (("e2b", "gemma4"), ("31b", "text"), ("31b", "gemma4"), ("26b", "gemma4"))])
def test_every_acceptance_length_is_exact(kind, naming, ckpts):
    model, cases = pair_and_references(ckpts, kind, naming)
    for name, prompt, ref in cases:
        for bs in range(2, 7):
            K = bs - 1
            forced = ForcedAssistant(model.drafter, prompt + ref, schedule=list(range(K + 1)),
                                     vocab_size=model.target.vocab_size)
            stats = RunStats()
            out = run(MTPModel(model.mlx_model, model.target, forced), prompt, bs, stats=stats)
            assert out == ref, (kind, naming, name, bs)
            assert stats.accepted == sum(forced.planned) > 0
            assert set(range(K + 1)) <= set(forced.planned), forced.planned


def _bitwise(got, want):
    mx.eval(got, want)
    return len(got) == len(want) and all(
        g.shape == w.shape and g.dtype == w.dtype and bytes(memoryview(g)) == bytes(memoryview(w))
        for g, w in zip(got, want))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["e2b", "31b"])
def test_caches_and_drafter_state_after_every_round_equal_sequential_decode(kind, ckpts):
    path = ckpts.target(kind)
    model = mlx_mtp.load_model(path, drafter=ckpts.assistant(kind))
    target, drafter = model.target, model.drafter
    prompt = PROMPTS["long"]
    n = 30
    ref = reference_greedy(path, prompt, n)
    full = prompt + ref

    # Sequential reference: mlx-lm's own plain decode (its model, its KVCache/RotatingKVCache),
    # the cache buffers after each token; and the post-norm hidden states h_p.
    pristine, _ = mlx_load_model(path)
    stock = pristine.make_cache()
    hiddens = [pristine.model(mx.array(prompt[:-1])[None], cache=stock)]
    states = {}
    for p in range(len(prompt) - 1, len(full) - 1):
        hiddens.append(pristine.model(mx.array(full[p : p + 1])[None], cache=stock))
        states[p + 1] = [a[...] for c in stock for a in (c.keys, c.values)]
        mx.eval(states[p + 1])
    hidden_all = mx.concatenate(hiddens, axis=1)  # p = 0 .. len(full) - 2

    for bs in (2, 4, 6):
        K = bs - 1
        forced = ForcedAssistant(drafter, full, schedule=[K, 0, 1, K - 1, 2],
                                 vocab_size=target.vocab_size)
        checked = 0
        with committed(target) as seen:
            out = []
            for tok, _ in mlx_mtp.generate_step(mx.array(prompt), MTPModel(
                    model.mlx_model, target, forced), max_tokens=n, block_size=bs):
                out.append(tok)
                c = seen.get("cache")
                if c is None:
                    continue
                p = target.offset(c)
                assert _bitwise(target.cache_state(c), states[p]), (kind, bs, p)
                if not drafter_fed(p, len(prompt), n):
                    assert drafter.position < p - 1  # the last drafting round: not re-armed
                    continue
                # the assistant re-armed on the committed state (after the accept hook)
                assert drafter.position == p - 1
                assert drafter.bonus.tolist() == [full[p]]
                assert _bitwise([drafter.hidden], [hidden_all[:, p - 1 : p]]), (kind, bs, p)
                k_s, v_s = drafter.shared_kv["sliding_attention"]
                k_f, _ = drafter.shared_kv["full_attention"]
                assert k_s.shape[2] == min(p, WINDOW) and k_f.shape[2] == p
                checked += 1
        assert out == ref
        assert checked >= n // 3
        assert {0, 1, K} <= set(forced.planned)


def _oracle_model(model, prompt, ref, K):
    oracle = OracleDrafter(prompt + ref, schedule=list(range(K + 1)), vocab_size=model.target.vocab_size)
    return MTPModel(model.mlx_model, model.target, oracle)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["e2b", "31b"])
def test_mutation_rollback_disabled_is_caught(kind, ckpts):
    """With the rollback disabled, rejected drafts stay in the caches: the output must differ."""
    path = ckpts.target(kind)
    model = mlx_mtp.load_model(path, require_head=False)
    for prompt in PROMPTS.values():
        ref = reference_greedy(path, prompt, MAX_TOKENS)
        assert run(_oracle_model(model, prompt, ref, 3), prompt, 4) == ref
        model.target.rollback = lambda cache, fed, keep: None
        try:
            assert run(_oracle_model(model, prompt, ref, 3), prompt, 4) != ref
        finally:
            del model.target.rollback


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["e2b", "31b"])
def test_mutation_rollback_as_mlx_lm_trims_is_caught(kind, ckpts):
    """mlx-lm's own rollback (``trim_prompt_cache``): once a sliding cache passes its window it is
    not trimmable, and then nothing is trimmed in any layer. With that rollback the output
    differs from plain decode."""
    path = ckpts.target(kind)
    model = mlx_mtp.load_model(path, require_head=False)
    target = model.target
    prompt = PROMPTS["long"]
    ref = reference_greedy(path, prompt, MAX_TOKENS)
    stock = RotatingKVCache(max_size=WINDOW, keep=0)
    stock.update_and_fetch(mx.zeros((1, 1, WINDOW, 1)), mx.zeros((1, 1, WINDOW, 1)))
    assert trim_prompt_cache([stock], 1) == 0  # the behaviour modelled below

    def mlx_lm_rollback(cache, fed, keep):
        if all(c.offset < c.max_size for c in cache if isinstance(c, RotatingKVCache)):
            Gemma4Target.rollback(target, cache, fed, keep)

    target.rollback = mlx_lm_rollback
    assert run(_oracle_model(model, prompt, ref, 3), prompt, 4) != ref
