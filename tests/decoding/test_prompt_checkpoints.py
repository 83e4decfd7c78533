"""Prompt caches a server keeps across requests: checkpoints inside a prompt
(``PromptCache.checkpoints``), prompt caches in batched rounds, and their copies. At T=0 a
generation that starts from any of them is mlx-lm's greedy decode from a cache holding the same
tokens, and the caches stay bitwise mlx-lm's."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step as mlx_generate_step
from mlx_lm.models import cache as mlx_cache
from support import tiny_checkpoints as tc
from support.token_streams import bitwise, take

import mlx_mtp
from mlx_mtp.decoding.batch_rounds import BatchRounds
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.decoding.prompt_cache import copy_prompt_cache, prompt_cache_nbytes

PROMPT = [(7 * i + 5) % 251 + 1 for i in range(40)]
OTHER = [(11 * i + 2) % 251 + 1 for i in range(9)]


@pytest.fixture(scope="module")
def agree(ckpt_root):
    """Ours and mlx-lm's load of a pair whose head agrees with its target (rounds keep drafts,
    so readers stop inside rounds)."""
    import mlx_lm

    path = tc.write_agreeing_checkpoint(ckpt_root / "checkpoints-agree", seed=4)
    return mlx_mtp.load(str(path))[0], mlx_lm.load(str(path))[0]


def mlx_lm_cache(ref, ids):
    """mlx-lm's cache after its model took ``ids`` in one call (a prefill chunk)."""
    cache = mlx_cache.make_prompt_cache(ref)
    mx.eval(ref(mx.array(ids)[None], cache=cache))
    return cache


def test_a_checkpoint_holds_the_prompts_prefix_and_continues_as_mlx_lm(agree):
    """A checkpoint at s ends a prefill chunk there: the copy holds the target's state of the
    first s tokens bitwise (mlx-lm's after those tokens), its head has paired token s; the
    generation itself is mlx-lm's decode of the prompt chunked at s; and a prompt that shares
    the first s + 1 tokens continues from the copy as mlx-lm from its own."""
    model, ref = agree
    s = 17
    cache = mlx_mtp.make_prompt_cache(model)
    cache.checkpoints = (s,)
    got = take(mlx_mtp.generate_step(mx.array(PROMPT), model, prompt_cache=cache,
                                     block_size=3), 11)
    ref_cache = mlx_lm_cache(ref, PROMPT[:s])
    want = take(mlx_generate_step(mx.array(PROMPT[s:]), ref, prompt_cache=ref_cache), 11)
    assert got == want

    kept = cache.kept[s]
    assert kept.offset == s and kept.hidden is None
    assert [c.offset for c in kept.drafter_state] == [s]  # pairs up to (h_{s-1}, token s)
    ref_at_s = mlx_lm_cache(ref, PROMPT[:s])
    assert bitwise(model.target.cache_state(kept), model.target.cache_state(ref_at_s))

    nxt = PROMPT[: s + 1] + OTHER  # shares the first s + 1 tokens, then differs
    got = take(mlx_mtp.generate_step(mx.array(nxt[s:]), model, prompt_cache=kept,
                                     block_size=3), 13)
    want = take(mlx_generate_step(mx.array(nxt[s:]), ref, prompt_cache=ref_at_s), 13)
    assert got == want
    assert kept.offset == ref_at_s[-1].offset == len(nxt) + 13
    assert bitwise(model.target.cache_state(kept), model.target.cache_state(ref_at_s))


def test_a_checkpoint_at_the_prompts_end_changes_nothing(agree):
    """At the last prompt token but one the prefill ends its chunks anyway: the tokens and the
    rounds are those of a run without it, and the same prompt again from the copy (one token to
    prefill) gives them once more."""
    model, ref = agree
    plain_stats, cached_stats, again_stats = RunStats(), RunStats(), RunStats()
    plain = take(mlx_mtp.generate_step(mx.array(PROMPT), model, block_size=3,
                                       stats=plain_stats), 20)
    cache = mlx_mtp.make_prompt_cache(model)
    cache.checkpoints = (len(PROMPT) - 1,)
    got = take(mlx_mtp.generate_step(mx.array(PROMPT), model, prompt_cache=cache, block_size=3,
                                     stats=cached_stats), 20)
    kept = cache.kept[len(PROMPT) - 1]
    again = take(mlx_mtp.generate_step(mx.array(PROMPT[-1:]), model, prompt_cache=kept,
                                       block_size=3, stats=again_stats), 20)
    assert got == plain == again
    rounds = [(s.rounds, s.accepted, s.per_position_acceptance)
              for s in (plain_stats, cached_stats, again_stats)]
    assert rounds[0] == rounds[1] == rounds[2] and plain_stats.accepted > 0
    assert again_stats.prompt_tokens == 1


def test_a_copy_is_independent_and_its_bytes_are_counted(agree):
    model, _ = agree
    cache = mlx_mtp.make_prompt_cache(model)
    take(mlx_mtp.generate_step(mx.array(PROMPT), model, prompt_cache=cache, block_size=3), 6)
    copied = copy_prompt_cache(cache)
    before = [mx.array(a) for a in model.target.cache_state(copied)]
    take(mlx_mtp.generate_step(mx.array(OTHER), model, prompt_cache=cache, block_size=3), 6)
    assert copied.offset == len(PROMPT) + 6 and cache.offset == len(PROMPT + OTHER) + 12
    assert bitwise(before, model.target.cache_state(copied))
    assert [c.offset for c in copied.drafter_state] == [copied.offset - 1]
    layers = sum(a.nbytes for c in copied for a in _arrays_of(c))
    head = sum(c.keys.nbytes + c.values.nbytes for c in copied.drafter_state)
    assert prompt_cache_nbytes(copied) == layers + head + copied.hidden.nbytes


def test_an_abandoned_generation_finishes_no_turn(agree):
    """A caller whose generation failed (a server whose other ranks are gone) marks the cache
    abandoned: closing the generator then finishes no turn (which may run a forward); a normal
    close leaves the cache holding the prompt and exactly the tokens yielded."""
    model, _ = agree
    done, left = mlx_mtp.make_prompt_cache(model), mlx_mtp.make_prompt_cache(model)
    for cache in (done, left):
        steps = mlx_mtp.generate_step(mx.array(PROMPT), model, prompt_cache=cache, block_size=3)
        for _ in range(7):
            next(steps)
        cache.abandoned = cache is left
        steps.close()
    assert done.offset == len(PROMPT) + 7 and done.hidden is not None
    assert left.hidden is None and left.drafter_state is None
    assert not copy_prompt_cache(left).abandoned


def _arrays_of(c):
    out = []
    for v in vars(c).values():
        if isinstance(v, mx.array):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += [x for x in v if isinstance(x, mx.array)]
    return out


# ------------------------------------------------------------------------------ batched rounds


def test_batched_sequences_keep_their_prompt_caches_as_mlx_lm(agree):
    """Two sequences decode together from their own prompt caches (one with a checkpoint), their
    readers stop inside rounds; then each cache holds its prompt and exactly the tokens read,
    bitwise mlx-lm's, and a second turn from it is mlx-lm's. A reader that does not read holds
    its sequence back (at most one round of unread tokens, which the cache can take back)."""
    model, ref = agree
    batch = BatchRounds(model, 2, block_size=4)
    prompts = [PROMPT, OTHER + PROMPT[:5]]
    caches = [mlx_mtp.make_prompt_cache(model) for _ in prompts]
    caches[0].checkpoints = (9,)
    seqs = [batch.start(mx.array(p), max_tokens=64, prompt_cache=c)
            for p, c in zip(prompts, caches)]
    gens = [batch.tokens(s) for s in seqs]
    got = [[next(gens[0])[0]], []]
    for _ in range(15):  # the first reader waits: its sequence sits out once it has tokens
        got[1].append(next(gens[1])[0])
        assert len(seqs[0].out) <= 4
    got[0] += take(gens[0], 10)
    got[1] += take(gens[1], 3)
    # mlx-lm's caches: the first prompt's checkpoint chunk taken alone, as the prefill chunks it
    refs = [mlx_lm_cache(ref, prompts[0][:9]), mlx_cache.make_prompt_cache(ref)]
    want = [take(mlx_generate_step(mx.array(prompts[0][9:]), ref, prompt_cache=refs[0]), 11),
            take(mlx_generate_step(mx.array(prompts[1]), ref, prompt_cache=refs[1]), 18)]
    assert got == want
    for c, r, p, g in zip(caches, refs, prompts, got):
        assert c.offset == r[-1].offset == len(p) + len(g)
        assert bitwise(model.target.cache_state(c), model.target.cache_state(r))
    assert caches[0].kept[9].offset == 9

    turn = [OTHER[:4], PROMPT[:3]]
    seqs = [batch.start(mx.array(t), max_tokens=64, prompt_cache=c)
            for t, c in zip(turn, caches)]
    got = [take(batch.tokens(s), 12) for s in seqs]
    want = [take(mlx_generate_step(mx.array(t), ref, prompt_cache=r), 12)
            for t, r in zip(turn, refs)]
    assert got == want

