"""The speculative round loop, shared by every family: draft -> verify -> walk -> rollback -> accept.

One round, with the bonus ``b`` sampled but not yet fed to the target:
  draft   the drafter proposes d_1..d_k on device (no host sync);
  verify  one target forward over [b, d_1..d_k]; t_i = sample(p_i) for every row;
  walk    a = the longest prefix with d_{i+1} == t_i; emit d_1..d_a, t_a (the one host read);
  finalize roll the target caches back to the a + 1 kept tokens;
  accept  the drafter consumes the verified pairs and prepares the next round.
With a deterministic (argmax) drafter this keeps exactly the target's distribution: t_i is drawn
from the target's own p_i and a draft is kept only when it equals that draw. At temperature 0 the
emitted ids equal mlx-lm's plain greedy decode. With a sampler from ``mlx_mtp.make_sampler`` and
a drafter that can sample (``draft_sampled``), the walk is speculative sampling instead
(``mlx_mtp.sampling``): emit d_1..d_a and the residual or bonus draw.
"""

from __future__ import annotations

import time
from typing import Callable, Generator, List, Optional, Tuple, Union

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

from . import draft_profile, gate, keyed_sampling, sampling
from .block_chooser import AUTO, DEFAULT_MAX_BLOCK_SIZE, BlockChooser
from .diagnostics import RunStats
from .errors import MTPError
from .model import MTPModel
from .plain import plain_generate_step

MAX_BLOCK_SIZE = 16


def block_size_problem(block_size: int) -> Optional[str]:
    """What is wrong with an integer ``block_size`` ("must be ..."), or None: the one place the
    bounds are checked (the API and the CLIs word their errors around it)."""
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        return f"must be between 1 and {MAX_BLOCK_SIZE}, got {block_size}"
    return None


def check_block_size(block_size, name: str = "block_size") -> int:
    if not isinstance(block_size, int) or isinstance(block_size, bool):
        raise MTPError(f"{name} must be an integer, got {block_size!r}")
    problem = block_size_problem(block_size)
    if problem:
        raise MTPError(f"{name} {problem}")
    return block_size


def resolve_block_size(block_size, max_block_size: int) -> Tuple[int, Optional[BlockChooser]]:
    """``(widest verify width the session may use, chooser or None)``: a fixed integer, ``"auto"``
    (a default ``BlockChooser`` up to ``max_block_size``) or a ``BlockChooser``."""
    if isinstance(block_size, BlockChooser):
        return check_block_size(block_size.max_block_size, "the chooser's max block size"), \
            block_size
    if block_size == AUTO:
        widest = check_block_size(max_block_size, "max_block_size")
        return widest, BlockChooser(widest - 1)
    if isinstance(block_size, str):
        raise MTPError(f"block_size must be an integer or 'auto', got {block_size!r}")
    return check_block_size(block_size), None


def _logprobs(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def generate_step(prompt, model: MTPModel, **kwargs
                  ) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Yield ``(token, logprobs, from_draft)`` like mlx-lm's ``speculative_generate_step``.

    ``model`` is an ``MTPModel``. ``block_size`` is tokens verified per round (drafts + 1);
    1 is plain decode through the same loop. ``"auto"`` (the default) chooses the drafts of every
    round, up to ``max_block_size - 1``, from the acceptance and round costs measured so far
    (``mlx_mtp.block_chooser``; pass a ``BlockChooser`` to tune it); its sampled output is keyed
    per output position (``mlx_mtp.keyed_sampling``), so it does not depend on the choices.
    ``sampler`` and ``logits_processors`` have mlx-lm's meaning; ``logprobs`` are the processed
    ones, as mlx-lm yields them. ``acceptance``: ``auto``, ``point-mass`` or
    ``speculative-sampling`` (see ``mlx_mtp.sampling``; temperature 0 is always ``greedy``).
    ``seed`` seeds the key streams of speculative sampling, or under ``auto`` the per-position
    keys (default: drawn from mlx's global random state).
    On a split target (``mlx_mtp.distributed``) every step is bounded by the split's watchdog.
    """
    steps = _generate_step(prompt, model, **kwargs)
    if getattr(model, "split", None) is None:
        yield from steps
    else:
        yield from model.split.guard(steps)


def _generate_step(
    prompt: mx.array,
    model: MTPModel,
    *,
    max_tokens: int = 256,
    block_size: Union[int, str, BlockChooser] = AUTO,
    max_block_size: int = DEFAULT_MAX_BLOCK_SIZE,
    sampler: Optional[Callable[[mx.array], mx.array]] = None,
    logits_processors: Optional[List[Callable[[mx.array, mx.array], mx.array]]] = None,
    seed: Optional[int] = None,
    acceptance: str = "auto",
    prefill_step_size: int = 2048,
    stats: Optional[RunStats] = None,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    block_size, chooser = resolve_block_size(block_size, max_block_size)  # widest width
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
    rule = (sampling.choose_rule if chooser is None else keyed_sampling.choose_rule)(
        sampler, drafter, acceptance)
    if isinstance(sampler, sampling.Sampler):
        sampler.check_vocab(target.vocab_size)
    sampler = sampler or greedy_sampler  # argmax over the last axis
    processors = list(logits_processors or [])
    streams = keys = None
    if rule == sampling.SPECULATIVE or (chooser is not None and rule != sampling.GREEDY):
        if seed is None:
            seed = mx.random.randint(0, 2**31 - 1).item()
        if chooser is None:
            streams = sampling.RandomStreams(seed)
        else:  # auto: every output position draws with its own key (mlx_mtp.keyed_sampling)
            keys = keyed_sampling.PositionKeys(seed)
    stats = stats if stats is not None else RunStats()
    stats.block_size = block_size if chooser is None else AUTO
    stats.max_block_size = block_size
    stats.acceptance_rule = rule
    profiler = draft_profile.attach(drafter)  # MLX_MTP_DRAFT_PROFILE: checked before any work
    # Exact or not at all: where a verify block is not byte-identical to single-token decode on
    # this device, the exactness gate declines and the target decodes plainly (mlx_mtp.gate).
    if not gate.apply(model, block_size, stats).mtp_enabled:
        stats.acceptance_rule = None
        yield from plain_generate_step(prompt, model, max_tokens=max_tokens, sampler=sampler,
                                       logits_processors=processors,
                                       prefill_step_size=prefill_step_size, stats=stats)
        return
    stats.draft_profiler = profiler
    split = getattr(model, "split", None)
    crossings = stats.count_split(split)  # after the probe: counts this session's forwards
    K = block_size - 1
    L = prompt.size
    mx.reset_peak_memory()

    # Prefill, chunked exactly as mlx-lm's generate_step: prompt[:-1] in chunks, then the last token.
    t0 = time.perf_counter()
    target.prepare(block_size)
    cache = target.make_cache()
    if drafter is not None:
        drafter.reset()
        drafter.bind_cache(cache)  # the Gemma 4 assistant reads the target's K/V
    s = 0
    while L - s > 1:
        e = min(s + prefill_step_size, L - 1)
        h = target.hidden(prompt[None, s:e], cache)
        if drafter is not None:
            drafter.prefill(h, prompt[s + 1 : e + 1])
        mx.eval(target.cache_state(cache), drafter.state_arrays() if drafter else [])
        s = e
    h = target.hidden(prompt[None, L - 1 :], cache)
    history = prompt if processors else None  # mlx-lm feeds processors the whole token history
    logits = target.logits(h[:, -1])
    for proc in processors:
        logits = proc(history, logits)
    logprobs = _logprobs(logits)
    if keys is not None:
        bonus = keyed_sampling.draw(sampler, logprobs, keys, 0)
    else:
        bonus = sampler(logprobs) if streams is None else sampler.sample(logprobs, streams.target())
    history = sampling.append_history(history, bonus)
    if drafter is not None:
        drafter.prefill(h, bonus)
    mx.eval(bonus, logprobs, drafter.state_arrays() if drafter else [])
    token = bonus.item()
    stats.prompt_tokens = L
    stats.prompt_s = time.perf_counter() - t0

    if split is not None:
        crossings()
        split.log_cache(target, cache, L)
    t_gen = time.perf_counter()
    emitted = 1
    deferred = []  # auto: (hidden, ids) of rounds without drafts, fed to the drafter when it drafts
    stats.generation_tokens = 1
    yield token, logprobs[0], False

    while emitted < max_tokens:
        k = min(K, max_tokens - emitted - 1)  # never draft past the token budget
        t_round = time.perf_counter()
        if chooser is not None:
            k = chooser.choose(k)
            if split is not None:  # timed choices differ per rank: all verify rank 0's width
                k = split.from_rank0(k)
            if k > 0 and deferred:  # catch the drafter up, outside the round's measured cost
                with stats.phase("accept"):
                    drafter.accept(mx.concatenate([d[0] for d in deferred], axis=1),
                                   mx.concatenate([d[1] for d in deferred]))
                    mx.eval(drafter.state_arrays())
                deferred = []
        t_choice = time.perf_counter()
        drafts = q = q_ids = None
        if k > 0:
            with stats.phase("draft"):
                syncs = drafter.syncs
                if rule == keyed_sampling.COUPLED:
                    ds = keyed_sampling.CoupledDraftSampler(sampler, keys, emitted,
                                                            target.vocab_size, processors, history)
                    drafter.draft_sampled(k, ds)
                    drafts = ds.drafts()
                elif streams is None:
                    drafts = drafter.draft(k)
                else:
                    ds = sampling.DraftSampler(sampler, streams.draft(), target.vocab_size,
                                               processors, history)
                    drafter.draft_sampled(k, ds)
                    drafts, q, q_ids = ds.result()
                mx.eval(drafts, q if q is not None else [])  # the block's one sync
                stats.draft_syncs += 1 + drafter.syncs - syncs
        with stats.phase("verify"):
            block = bonus if drafts is None else mx.concatenate([bonus, drafts])
            h = target.verify(block[None], cache)
            logits = target.logits(h[0])
            if processors:
                logits = sampling.process_rows(logits, history, block, processors)
            logprobs = _logprobs(logits)
            parts = [] if drafts is None else [drafts]
            if keys is not None:
                toks = keyed_sampling.draw(sampler, logprobs, keys, emitted)
            elif streams is None:
                toks = sampler(logprobs)
            else:
                accepted, toks = sampling.rejection_sample(
                    sampler.probs(logprobs), q, block[1:], streams.target(), q_ids)
                parts.append(accepted.astype(mx.uint32))
            # The round's one host read: the target's picks, the drafts and any verdicts.
            host = mx.concatenate([toks, *parts]).tolist()
            stats.host_syncs += 1
        t_ids, d_ids = host[: k + 1], host[k + 1 : 2 * k + 1]
        if streams is None:  # greedy / point-mass: keep drafts while they equal the target's picks
            a = sampling.accepted_length([d == t for d, t in zip(d_ids, t_ids)])
        else:
            a = sampling.accepted_length(host[2 * k + 1 :])
        out_ids = d_ids[:a] + t_ids[a : a + 1]
        new_ids = toks[:1] if a == 0 else mx.concatenate([drafts[:a], toks[a : a + 1]])
        with stats.phase("finalize"):
            target.rollback(cache, fed=k + 1, keep=a + 1)  # on every rank: its own layers
            mx.eval(target.cache_state(cache))
        if split is not None:
            crossings()
            split.log_cache(target, cache, L + emitted + a)
        bonus = toks[a : a + 1]
        history = sampling.append_history(history, new_ids)
        if drafter is not None and chooser is not None and k == 0:
            deferred.append((h[:, :1], new_ids))  # no draft next round, maybe: feed it later
        elif drafter is not None:
            with stats.phase("accept"):
                drafter.accept(h[:, : a + 1], new_ids)
                mx.eval(drafter.state_arrays())
        t_end = time.perf_counter()
        stats.record_round(k, a, t_end - t_round)
        if chooser is not None:
            chooser.observe(k, a, t_end - t_choice)
        n_out = min(a + 1, max_tokens - emitted)
        emitted += n_out
        stats.generation_tokens = emitted
        stats.generation_s = time.perf_counter() - t_gen
        stats.peak_memory_gb = mx.get_peak_memory() / 1e9
        for i in range(n_out):
            yield out_ids[i], logprobs[i], i < a
    stats.generation_s = time.perf_counter() - t_gen
    stats.peak_memory_gb = mx.get_peak_memory() / 1e9
