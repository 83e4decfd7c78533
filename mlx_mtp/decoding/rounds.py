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
(``mlx_mtp.decoding.sampling``): emit d_1..d_a and the residual or bonus draw.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import time
from typing import Callable, Generator, List, Optional, Tuple, Union

import mlx.core as mx
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START
from mlx_lm.sample_utils import greedy_sampler

from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.cpu import pin as cpu_pin
from mlx_mtp.models import draft_profile
from mlx_mtp import config as env
from mlx_mtp.exactness import gate
from mlx_mtp.decoding import keyed_sampling
from mlx_mtp.decoding import sampling
from mlx_mtp.decoding.block_chooser import AUTO, DEFAULT_MAX_BLOCK_SIZE, BlockChooser
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.errors import MTPError
from mlx_mtp.io.kv_settings import KVSettings, note_max_kv_size
from mlx_mtp.models.model import MTPModel
from mlx_mtp.decoding.plain import plain_generate_step
from mlx_mtp.io.prompt_cache import PromptCache, Turn, check_prompt_cache, forget_drafter, make_prompt_cache

MAX_BLOCK_SIZE = 16
# 1: evaluate the draft and the accept hook before the next phase starts, so that the round
# split (RunStats.phase_ms) times each phase's device work; slower (see ``_rounds``).
SYNC_PHASES_ENV = "MLX_MTP_SYNC_PHASES"


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


def speculative_generate_step(
    prompt: mx.array,
    model: MTPModel,
    draft_model=None,
    stream=None,
    *,
    num_draft_tokens: Optional[int] = None,
    max_tokens: int = 256,
    sampler: Optional[Callable[[mx.array], mx.array]] = None,
    logits_processors: Optional[List[Callable[[mx.array, mx.array], mx.array]]] = None,
    max_kv_size: Optional[int] = None,
    prompt_cache: Optional[PromptCache] = None,
    prefill_step_size: int = 2048,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    input_embeddings: Optional[mx.array] = None,
    block_size: Union[int, str, BlockChooser] = AUTO,
    max_block_size: int = DEFAULT_MAX_BLOCK_SIZE,
    seed: Optional[int] = None,
    acceptance: str = "auto",
    stats: Optional[RunStats] = None,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Yield ``(token, logprobs, from_draft)`` like mlx-lm's ``speculative_generate_step``
    (``generate_step`` is this without ``from_draft``, as mlx-lm's).

    mlx-lm's ``draft_model`` and ``num_draft_tokens`` are there for its call shape but must stay
    None: the drafter is the model's own MTP head and ``block_size`` sets the drafts per round.
    Otherwise takes mlx-lm ``generate_step``'s arguments with their meaning and defaults (``stream``,
    ``max_tokens`` (-1: no limit), ``sampler``, ``logits_processors``, ``max_kv_size``,
    ``prompt_cache`` (from ``mlx_mtp.make_prompt_cache``; updated in place to hold the prompt and
    every token yielded, as mlx-lm's), ``prefill_step_size``, ``kv_bits``, ``kv_group_size``,
    ``quantized_kv_start``, ``prompt_progress_callback``, ``input_embeddings``), plus ours:
    ``model`` is an ``MTPModel``. ``block_size`` is tokens verified per round (drafts + 1);
    1 is plain decode through the same loop. ``"auto"`` (the default) chooses the drafts of every
    round, up to ``max_block_size - 1``, from the acceptance and round costs measured so far
    (``mlx_mtp.decoding.block_chooser``; pass a ``BlockChooser`` to tune it); its sampled output is keyed
    per output position (``mlx_mtp.decoding.keyed_sampling``), so it does not depend on the choices.
    ``sampler`` and ``logits_processors`` have mlx-lm's meaning; ``logprobs`` are the processed
    ones, as mlx-lm yields them. ``acceptance``: ``auto``, ``point-mass`` or
    ``speculative-sampling`` (see ``mlx_mtp.decoding.sampling``; temperature 0 is always ``greedy``).
    ``seed`` seeds the key streams of speculative sampling, or under ``auto`` the per-position
    keys (default: drawn from mlx's global random state). On a split target
    (``mlx_mtp.models.distributed``) every step is bounded by the split's watchdog.
    """
    check_no_draft_model(draft_model, num_draft_tokens)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or \
            not (max_tokens >= 1 or max_tokens == -1):
        raise MTPError(f"max_tokens must be a positive integer or -1 (no limit), got "
                       f"{max_tokens!r}")
    max_tokens = sys.maxsize if max_tokens == -1 else max_tokens
    block_size, chooser = resolve_block_size(block_size, max_block_size)  # widest width
    cpu_blas.verify_thread_count()  # a bad MLX_MTP_VERIFY_THREADS fails before any work
    env.flag(SYNC_PHASES_ENV)  # as a bad MLX_MTP_SYNC_PHASES does
    prompt = mx.array(prompt) if not isinstance(prompt, mx.array) else prompt
    if prompt.ndim != 1 or prompt.size == 0:
        raise MTPError("the prompt must be a non-empty 1-D array of token ids (with "
                       "input_embeddings too: the MTP head drafts from token ids)")
    if input_embeddings is not None and (input_embeddings.ndim != 2 or
                                         input_embeddings.shape[0] != prompt.size):
        raise MTPError(f"input_embeddings must be [prompt length, hidden size] = "
                       f"[{prompt.size}, ...], got shape {tuple(input_embeddings.shape)}")
    kv = KVSettings(kv_bits, kv_group_size, quantized_kv_start).check(model.target)
    if prompt_cache is None:  # as in mlx-lm, max_kv_size only matters when making the cache
        note_max_kv_size(model, max_kv_size)
        cache = make_prompt_cache(model)
    else:
        cache = check_prompt_cache(model, prompt_cache)
    drafter = model.drafter if block_size > 1 else None
    if block_size > 1 and drafter is None:
        raise MTPError("this model has no MTP head: load one with drafter= (--drafter), "
                       "or use block_size=1")
    # The caller's cache must end holding exactly the tokens yielded (``Turn.settle``).
    turn = Turn(model, cache, kv, drafter) if prompt_cache is not None else None
    args = dict(max_tokens=max_tokens, sampler=sampler, logits_processors=logits_processors,
                prefill_step_size=prefill_step_size, progress=prompt_progress_callback,
                input_embeddings=input_embeddings, block_size=block_size, chooser=chooser, seed=seed,
                acceptance=acceptance, stats=stats)
    context = mx.stream(stream) if stream is not None else contextlib.nullcontext()
    with context:
        tokens = _rounds(prompt, model, cache, kv, turn, drafter, **args)
        if getattr(model, "split", None) is not None:
            tokens = model.split.guard(tokens)
        yielded = 0
        settle = turn is not None
        try:
            for item in tokens:
                yielded += 1
                yield item
        except BaseException as e:
            settle = settle and isinstance(e, GeneratorExit)  # an error leaves it as mlx-lm would
            raise
        finally:
            tokens.close()
            if settle:
                turn.settle(yielded)


def check_no_draft_model(draft_model, num_draft_tokens) -> None:
    """mlx-lm's separate-draft-model arguments: one clear error each (MTP drafts with the
    target's own head)."""
    if draft_model is not None:
        raise MTPError("draft_model is not supported: mlx_mtp drafts with the target's own MTP "
                       "head (load it with mlx_mtp.load(..., drafter=...)); for a separate "
                       "draft model use mlx-lm's own functions")
    if num_draft_tokens is not None:
        raise MTPError("num_draft_tokens is mlx-lm's setting for a separate draft model: "
                       "use block_size (tokens verified per round = drafts + 1)")


def generate_step(prompt: mx.array, model: MTPModel, stream=None, **kwargs
                  ) -> Generator[Tuple[int, mx.array], None, None]:
    """Yield ``(token, logprobs)`` like mlx-lm's ``generate_step``: ``speculative_generate_step``
    without ``from_draft``. Takes its arguments (shown by ``inspect.signature``) except
    ``draft_model`` and ``num_draft_tokens``."""
    steps = speculative_generate_step(prompt, model, stream=stream, **kwargs)
    try:
        for token, logprobs, _ in steps:
            yield token, logprobs
    finally:
        steps.close()  # a prompt cache settles to exactly the tokens yielded (GeneratorExit)


generate_step.__signature__ = inspect.signature(speculative_generate_step).replace(
    parameters=[p for p in inspect.signature(speculative_generate_step).parameters.values()
                if p.name not in ("draft_model", "num_draft_tokens")],
    return_annotation=Generator[Tuple[int, mx.array], None, None])


def _rounds(prompt, model, cache, kv, turn, drafter, *, max_tokens, sampler, logits_processors,
            prefill_step_size, progress, input_embeddings, block_size, chooser, seed, acceptance,
            stats):
    target = model.target
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
        else:  # auto: every output position draws with its own key (mlx_mtp.decoding.keyed_sampling)
            keys = keyed_sampling.PositionKeys(seed)
    stats = stats if stats is not None else RunStats()
    stats.block_size = block_size if chooser is None else AUTO
    stats.max_block_size = block_size
    stats.acceptance_rule = rule
    profiler = draft_profile.attach(drafter)  # MLX_MTP_DRAFT_PROFILE: checked before any work
    # Exact or not at all: where a verify block is not byte-identical to single-token decode on
    # this device, the exactness gate declines and the target decodes plainly (mlx_mtp.exactness.gate).
    decision = gate.apply(model, block_size, stats, kv=kv if kv.enabled else None)
    if not decision.mtp_enabled:
        stats.acceptance_rule = None
        if turn is not None:
            forget_drafter(cache)
            turn.last = None  # mlx-lm's own generate_step keeps the cache as mlx-lm does
        yield from plain_generate_step(prompt, model, max_tokens=max_tokens, sampler=sampler,
                                       logits_processors=processors,
                                       prefill_step_size=prefill_step_size, stats=stats,
                                       prompt_cache=cache, kv=kv, progress=progress,
                                       input_embeddings=input_embeddings)
        return
    stats.draft_profiler = profiler
    # The draft and the accept hook are queued (async_eval), not waited for: the verify graph is
    # built in Python while they compute, as mlx-lm's generate_step builds step n + 1 while step n
    # computes. The round's one host read waits for all of it; only the timing split changes.
    stats.phases_synced = env.flag(SYNC_PHASES_ENV)
    settle = mx.eval if stats.phases_synced else mx.async_eval
    split = getattr(model, "split", None)
    crossings = stats.count_split(split)  # after the probe: counts this session's forwards
    K = block_size - 1
    L = prompt.size
    mx.reset_peak_memory()
    progress = progress or (lambda *_: None)

    def embeddings(lo, hi):
        return None if input_embeddings is None else input_embeddings[None, lo:hi]

    # Prefill, chunked exactly as mlx-lm's generate_step: prompt[:-1] in chunks, then the last
    # token; KV quantization (kv_bits) after each model call, as there.
    t0 = time.perf_counter()
    # Overridden gate: the exactness-only fallbacks buy nothing, so they are skipped.
    if decision.override:
        target.prepare(block_size, exact=False)
    else:
        target.prepare(block_size)
    # A drafted round's verify on the CPU runs with every thread on one core (``cpu_pin``) from
    # its first eager C kernel call on: each kernel syncs with MLX's stream thread (~60 times a
    # verify of the realistic-size pair). Not across split ranks (two could pin to one core),
    # nor with more than one verify thread (they would share the core).
    pin = (cpu_pin.enabled() and mx.default_device() == mx.cpu and split is None
           and cpu_blas.round_thread_count() == 1)
    if turn is not None:
        if drafter is not None:
            turn.start_drafter()
            turn.pair_previous(prompt[:1])
        else:
            forget_drafter(cache)
    elif drafter is not None:
        drafter.reset()
        drafter.bind_cache(cache)  # the Gemma 4 assistant reads the target's K/V
    progress(0, L)
    s = 0
    while L - s > 1:
        e = min(s + prefill_step_size, L - 1)
        h = target.hidden(prompt[None, s:e], cache, embeddings(s, e))
        if drafter is not None:
            drafter.prefill(h, prompt[s + 1 : e + 1])
        kv.quantize(cache)
        mx.eval(target.cache_state(cache), drafter.state_arrays() if drafter else [])
        s = e
        progress(s, L)
    h = target.hidden(prompt[None, L - 1 :], cache, embeddings(L - 1, L))
    history = prompt if processors else None  # mlx-lm feeds processors the whole token history
    logits = target.logits(h[:, -1])
    for proc in processors:
        logits = proc(history, logits)
    logprobs = _logprobs(logits)
    if keys is not None:
        bonus = keyed_sampling.draw(sampler, logprobs, keys, 0, logits=logits)
    else:
        bonus = sampler(logprobs) if streams is None else sampler.sample(logprobs, streams.target())
    history = sampling.append_history(history, bonus)
    if drafter is not None:
        drafter.prefill(h, bonus)
    replaced = kv.quantize(cache)
    mx.eval(bonus, logprobs, drafter.state_arrays() if drafter else [])
    progress(L, L)
    token = bonus.item()
    stats.prompt_tokens = L
    stats.prompt_s = time.perf_counter() - t0
    if turn is not None:  # the first token: like a round's bonus, yielded before it is fed
        turn.round_done(0, h[:, -1:], 0, bonus, replaced)

    if split is not None:
        crossings()
        split.log_cache(target, cache, L)
    t_gen = time.perf_counter()
    emitted = 1
    deferred = []  # auto: (hidden, ids) of rounds without drafts, fed to the drafter when it drafts
    stats.generation_tokens = 1
    if chooser is not None:  # the ids a round starts from key its acceptance (block_chooser)
        chooser.see((token,))
    yield token, logprobs[0], False
    if drafter is None and keys is None and turn is None and not kv.enabled and split is None:
        # block size 1: no verify block: decode as mlx-lm does
        yield from _pipelined_steps(target, cache, bonus, history, max_tokens - 1, 1, sampler,
                                    None, processors, stats, t_gen)
        return

    # auto: a stretch of rounds the chooser gives no drafts runs as pipelined one-token steps
    # (a round without drafts waits for its token before building the next forward).
    stretches = chooser is not None and turn is None and not kv.enabled and split is None
    while emitted < max_tokens:
        chosen = None
        if stretches:
            t_round = time.perf_counter()
            chosen = chooser.choose(min(K, max_tokens - emitted - 1))
            n = min(chooser.undrafted_stretch(), max_tokens - emitted) if chosen == 0 else 0
            if n > 1:
                bonus, history = yield from _pipelined_steps(
                    target, cache, bonus, history, n, emitted, sampler, keys, processors, stats,
                    t_gen, deferred=deferred if drafter is not None else None, chooser=chooser)
                emitted += n
                continue
        with cpu_blas.verify_threads():  # the round's multi-row products (see cpu_blas)
            k = min(K, max_tokens - emitted - 1)  # never draft past the token budget
            k = kv.max_drafts(cache, k)  # kv_bits: no verify row across the switch to quantized
            if chosen is None:
                t_round = time.perf_counter()
            if chooser is not None:
                k = chooser.choose(k) if chosen is None else chosen
                if split is not None:  # timed choices differ per rank: all verify rank 0's width
                    k = split.from_rank0(k)
                if k > 0 and deferred:  # catch the drafter up, outside the round's measured cost
                    with stats.phase("accept"):
                        drafter.accept(mx.concatenate([d[0] for d in deferred], axis=1),
                                       mx.concatenate([d[1] for d in deferred]))
                        settle(drafter.state_arrays())
                    deferred = []
            t_choice = time.perf_counter()
            drafts = q = q_ids = None
            noise = ()  # coupled drafts' G_n, reused by the target's draws at those positions
            if k > 0:
                with stats.phase("draft"):
                    syncs = drafter.syncs
                    if rule == keyed_sampling.COUPLED:
                        ds = keyed_sampling.CoupledDraftSampler(sampler, keys, emitted,
                                                                target.vocab_size, processors, history)
                        drafter.draft_sampled(k, ds)
                        drafts, noise = ds.drafts(), ds.noise
                    elif streams is None:
                        drafts = drafter.draft(k)
                    else:
                        ds = sampling.DraftSampler(sampler, streams.draft(), target.vocab_size,
                                                   processors, history)
                        drafter.draft_sampled(k, ds)
                        drafts, q, q_ids = ds.result()
                    settle(drafts, q if q is not None else [])  # the block's one evaluation
                    stats.draft_syncs += 1 + drafter.syncs - syncs
            t_verify = time.perf_counter()
            with stats.phase("verify"), (cpu_pin.on_first_sync() if pin and k > 0
                                         else contextlib.nullcontext()):
                block = bonus if drafts is None else mx.concatenate([bonus, drafts])
                # One token (no drafts) needs no rollback: a plain step.
                h = target.verify(block[None], cache) if k > 0 else target.decode(block[None], cache)
                logits = target.logits(h[0])
                if processors:
                    logits = sampling.process_rows(logits, history, block, processors)
                logprobs = _logprobs(logits)
                parts = [] if drafts is None else [drafts]
                if keys is not None:
                    toks = keyed_sampling.draw(sampler, logprobs, keys, emitted, logits=logits,
                                               noise=noise)
                elif streams is None:
                    toks = sampler(logprobs)
                else:  # p from the logits: the logprobs stay lazy (computed if read)
                    accepted, toks = sampling.rejection_sample(
                        sampler.probs(logits), q, block[1:], streams.target(), q_ids)
                    parts.append(accepted.astype(mx.uint32))
                # The round's one host read: the target's picks, the drafts and any verdicts.
                host = mx.concatenate([toks, *parts]).tolist()
                stats.host_syncs += 1
            stats.record_verify(k + 1, time.perf_counter() - t_verify)
            t_ids, d_ids = host[: k + 1], host[k + 1 : 2 * k + 1]
            if streams is None:  # greedy / point-mass: keep drafts while they equal the target's picks
                a = sampling.accepted_length([d == t for d, t in zip(d_ids, t_ids)])
            else:
                a = sampling.accepted_length(host[2 * k + 1 :])
            out_ids = d_ids[:a] + t_ids[a : a + 1]
            new_ids = toks[:1] if a == 0 else mx.concatenate([drafts[:a], toks[a : a + 1]])
            if k > 0:  # selecting the kept states is graph work: evaluated with the next round
                with stats.phase("finalize"):
                    target.rollback(cache, fed=k + 1, keep=a + 1)
            replaced = kv.quantize(cache)
            if split is not None:  # rollback ran on every rank, on its own layers
                crossings()
                split.log_cache(target, cache, L + emitted + a)
            bonus = toks[a : a + 1]
            history = sampling.append_history(history, new_ids)
            if drafter is not None and chooser is not None and k == 0 and turn is None:
                # (a prompt cache's turn needs the drafter current at every round: no deferral)
                deferred.append((h[:, :1], new_ids))  # no draft next round, maybe: feed it later
            elif drafter is not None:
                with stats.phase("accept"):
                    drafter.accept(h[:, : a + 1], new_ids)
                    settle(drafter.state_arrays())
            if turn is not None:
                turn.round_done(emitted, h[:, : a + 1], a, bonus, replaced)
            t_end = time.perf_counter()
            stats.record_round(k, a, t_end - t_round)
            if chooser is not None:
                chooser.observe(k, a, t_end - t_choice)
        n_out = min(a + 1, max_tokens - emitted)
        if chooser is not None:
            chooser.see(out_ids[:n_out])
        emitted += n_out
        stats.generation_tokens = emitted
        stats.generation_s = time.perf_counter() - t_gen
        stats.peak_memory_gb = mx.get_peak_memory() / 1e9
        for i in range(n_out):
            yield out_ids[i], logprobs[i], i < a
    stats.generation_s = time.perf_counter() - t_gen
    stats.peak_memory_gb = mx.get_peak_memory() / 1e9


def _pipelined_steps(target, cache, y, history, n, emitted, sampler, keys, processors, stats,
                     t_gen, *, deferred=None, chooser=None):
    """``n`` one-token steps after ``emitted`` tokens, pipelined like mlx-lm's ``generate_step``:
    step i + 1 is queued (``mx.async_eval``) before step i's token is read, so building the graph
    overlaps the compute. No capture, no rollback, one host read per token. Each step is what a
    round without drafts computes (``target.decode`` of the last token, the draw at its
    position: keyed under ``auto``). Block size 1 runs the whole generation this way; under
    ``auto`` a stretch the chooser gave no drafts does, the chooser observing its steps and the
    drafter getting the (hidden, id) pairs later (``deferred``). Yields the tokens; returns
    ``(y, history)`` for the next round.

    A pipelined step has no time of its own: on the CPU backend the call that queues a step
    (``mx.async_eval``) returns once most of its work is done (about 18 of a 21 ms step, one
    run), so the time between two host reads is mostly the next step's, the first step's is
    spent before the first read, and the last read comes about 1 ms after the one before. Each
    step is recorded with the time since the previous read (the first since the stretch
    began: the sum is the stretch's time), and the chooser observes every step of the stretch
    at the stretch's mean, once it ends (it observed each step's own read-to-read time before:
    the stretch's first step went unobserved and its last looked like a 1 ms round, which
    after short stretches could make the median of width 1's samples a millisecond)."""

    def step(y, history, pos):
        h = target.decode(y[None], cache)
        logits = target.logits(h[0])
        if processors:
            logits = sampling.process_rows(logits, history, y, processors)
        logprobs = _logprobs(logits)
        tok = (keyed_sampling.draw(sampler, logprobs, keys, pos, logits=logits)
               if keys is not None else sampler(logprobs))
        return h, tok, logprobs

    if n < 1:
        return y, history
    t_start = t_read = time.perf_counter()
    nxt = step(y, history, emitted)
    mx.async_eval(nxt[1], nxt[2])
    for i in range(n):
        h, y, logprobs = nxt
        history = sampling.append_history(history, y)
        if deferred is not None:
            deferred.append((h, y))
        if i + 1 < n:
            nxt = step(y, history, emitted + i + 1)
            mx.async_eval(nxt[1], nxt[2])
        token = y.item()
        stats.host_syncs += 1
        if (emitted + i) % 256 == 0:  # as mlx-lm does
            mx.clear_cache()
        now = time.perf_counter()
        stats.record_round(0, 0, now - t_read, own_time=False)
        t_read = now
        if chooser is not None:  # an auto stretch
            stats.undrafted_steps += 1
            chooser.see((token,))
        stats.generation_tokens = emitted + i + 1
        stats.generation_s = time.perf_counter() - t_gen
        stats.peak_memory_gb = mx.get_peak_memory() / 1e9
        yield token, logprobs[0], False
    if chooser is not None:  # every step of the stretch at its mean (docstring)
        for _ in range(n):
            chooser.observe(0, 0, (t_read - t_start) / n)
    stats.generation_s = time.perf_counter() - t_gen
    stats.peak_memory_gb = mx.get_peak_memory() / 1e9
    return y, history
