"""The speculative round loop, shared by every family: draft -> verify -> walk -> rollback -> accept.

One round, with the bonus ``b`` sampled but not yet fed to the target:
  draft   the drafter proposes d_1..d_k on device (no host sync);
  verify  one target forward over [b, d_1..d_k]; t_i = sample(p_i) for every row;
  walk    a = the longest prefix with d_{i+1} == t_i; emit d_1..d_a, t_a (the one host read);
  finalize roll the target caches back to the a + 1 kept tokens;
  accept  the drafter consumes the verified pairs and prepares the next round.
With a deterministic (greedy) drafter this keeps exactly the target's distribution: t_i is drawn
from the target's own p_i and a draft is kept only when it equals that draw. At temperature 0 the
emitted ids equal mlx-lm's plain greedy decode.
"""

from __future__ import annotations

import time
from typing import Callable, Generator, Optional, Tuple

import mlx.core as mx

from .diagnostics import RunStats
from .errors import MTPError

MAX_BLOCK_SIZE = 16


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def check_block_size(block_size, name: str = "block_size") -> int:
    if not isinstance(block_size, int) or isinstance(block_size, bool):
        raise MTPError(f"{name} must be an integer, got {block_size!r}")
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise MTPError(f"{name} must be between 1 and {MAX_BLOCK_SIZE}, got {block_size}")
    return block_size


def _logprobs(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def generate_step(
    prompt: mx.array,
    model,
    *,
    max_tokens: int = 256,
    block_size: int = 3,
    sampler: Optional[Callable[[mx.array], mx.array]] = None,
    prefill_step_size: int = 2048,
    stats: Optional[RunStats] = None,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Yield ``(token, logprobs, from_draft)`` like mlx-lm's ``speculative_generate_step``.

    ``model`` is an ``MTPModel``. ``block_size`` is tokens verified per round (drafts + 1);
    1 is plain decode through the same loop.
    """
    block_size = check_block_size(block_size)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise MTPError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    prompt = mx.array(prompt) if not isinstance(prompt, mx.array) else prompt
    if prompt.ndim != 1 or prompt.size == 0:
        raise MTPError("the prompt must be a non-empty 1-D array of token ids")
    target = model.target
    drafter = model.drafter if block_size > 1 else None
    if block_size > 1 and drafter is None:
        raise MTPError("this model has no MTP head: load one with drafter= (--drafter), "
                       "or use block_size=1")
    sampler = sampler or greedy
    stats = stats if stats is not None else RunStats()
    stats.block_size = block_size
    K = block_size - 1
    L = prompt.size
    mx.reset_peak_memory()

    # Prefill, chunked exactly as mlx-lm's generate_step: prompt[:-1] in chunks, then the last token.
    t0 = time.perf_counter()
    cache = target.make_cache()
    if drafter is not None:
        drafter.reset()
        if hasattr(drafter, "bind_cache"):  # drafters that read the target's K/V (Gemma 4)
            drafter.bind_cache(cache)
    s = 0
    while L - s > 1:
        e = min(s + prefill_step_size, L - 1)
        h = target.hidden(prompt[None, s:e], cache)
        if drafter is not None:
            drafter.prefill(h, prompt[s + 1 : e + 1])
        mx.eval(target.cache_state(cache), drafter.state_arrays() if drafter else [])
        s = e
    h = target.hidden(prompt[None, L - 1 :], cache)
    logprobs = _logprobs(target.logits(h[:, -1]))
    bonus = sampler(logprobs)  # [1]
    if drafter is not None:
        drafter.prefill(h, bonus)
    mx.eval(bonus, logprobs, drafter.state_arrays() if drafter else [])
    token = bonus.item()
    stats.prompt_tokens = L
    stats.prompt_s = time.perf_counter() - t0

    t_gen = time.perf_counter()
    emitted = 1
    stats.generation_tokens = 1
    yield token, logprobs[0], False

    while emitted < max_tokens:
        t_round = time.perf_counter()
        k = min(K, max_tokens - emitted - 1)  # never draft past the token budget
        drafts = None
        if k > 0:
            with stats.phase("draft"):
                drafts = drafter.draft(k)
                mx.eval(drafts)
        with stats.phase("verify"):
            block = bonus if drafts is None else mx.concatenate([bonus, drafts])
            h = target.verify(block[None], cache)
            logprobs = _logprobs(target.logits(h[0]))
            toks = sampler(logprobs)
            # The round's one host read: the target's picks and the drafts together.
            host = (toks if drafts is None else mx.concatenate([toks, drafts])).tolist()
            stats.host_syncs += 1
        t_ids, d_ids = host[: k + 1], host[k + 1 :]
        a = 0
        while a < k and d_ids[a] == t_ids[a]:
            a += 1
        with stats.phase("finalize"):
            target.rollback(cache, fed=k + 1, keep=a + 1)
            mx.eval(target.cache_state(cache))
        bonus = toks[a : a + 1]
        if drafter is not None:
            with stats.phase("accept"):
                drafter.accept(h[:, : a + 1], toks[: a + 1])
                mx.eval(drafter.state_arrays())
        stats.record_round(k, a, time.perf_counter() - t_round)
        n_out = min(a + 1, max_tokens - emitted)
        emitted += n_out
        stats.generation_tokens = emitted
        stats.generation_s = time.perf_counter() - t_gen
        stats.peak_memory_gb = mx.get_peak_memory() / 1e9
        for i in range(n_out):
            yield t_ids[i], logprobs[i], i < a
    stats.generation_s = time.perf_counter() - t_gen
    stats.peak_memory_gb = mx.get_peak_memory() / 1e9
