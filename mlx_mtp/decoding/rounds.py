"""The speculative round loop, shared by every family: prefill, then rounds of
choose -> draft -> verify and walk -> commit -> emit.

One round, with the bonus ``b`` sampled but not yet fed to the target:
  choose  k drafts: the block size less one, or under ``auto`` the chooser's choice;
  draft   the drafter proposes d_1..d_k on device (no host sync);
  verify  one target forward over [b, d_1..d_k]; t_i = sample(p_i) for every row;
  walk    a = the longest prefix with d_{i+1} == t_i (the round's one host read);
  commit  roll the target caches back to the a + 1 kept tokens; the drafter consumes the
          verified pairs and prepares the next round;
  emit    d_1..d_a, t_a.
With a deterministic (argmax) drafter this keeps exactly the target's distribution: t_i is drawn
from the target's own p_i and a draft is kept only when it equals that draw. At temperature 0 the
emitted ids equal mlx-lm's plain greedy decode. With a sampler from ``mlx_mtp.make_sampler`` and
a drafter that can sample (``draft_sampled``), the walk is speculative sampling instead
(``mlx_mtp.decoding.sampling``): emit d_1..d_a and the residual or bonus draw.

The steps are in ``round_steps``, the session and its state in ``round_session``, and rounds
without drafts (block size 1, ``auto``'s undrafted stretches) in ``pipelined_steps``.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import time
from typing import Callable, Generator, Iterator, List, Optional, Tuple, Union

import mlx.core as mx
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START

from mlx_mtp import config as env
from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.decoding.acceptance import AcceptanceRule, choose_rule
from mlx_mtp.decoding.block_chooser import AUTO, DEFAULT_MAX_BLOCK_SIZE, BlockChooser
from mlx_mtp.decoding.pipelined_steps import pipelined_steps
from mlx_mtp.decoding import sampling
from mlx_mtp.decoding.plain import plain_generate_step
from mlx_mtp.decoding.round_session import (SYNC_PHASES_ENV, Progress, Request, Session,
                                            open_session, start_stats)
from mlx_mtp.decoding.round_steps import (Emitted, choose_ahead, commit, draft, emit, plan_round,
                                          prefill, record_round, verify_and_walk)
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.errors import MTPError
from mlx_mtp.exactness import gate
from mlx_mtp.io.kv_settings import KVSettings, note_max_kv_size
from mlx_mtp.io.prompt_cache import (PromptCache, Turn, check_prompt_cache, forget_drafter,
                                     make_prompt_cache)
from mlx_mtp.models import draft_profile
from mlx_mtp.models.draft_tree import TreeShape, tree_shape
from mlx_mtp.models.model import MTPModel
from mlx_mtp.models.protocols import Drafter

__all__ = ["MAX_BLOCK_SIZE", "SYNC_PHASES_ENV", "block_size_problem", "check_block_size",
           "resolve_block_size", "speculative_generate_step", "generate_step",
           "check_no_draft_model"]

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
    draft_topk: int = 1,
    draft_tokens: Optional[int] = None,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Yield ``(token, logprobs, from_draft)`` like mlx-lm's ``speculative_generate_step``
    (``generate_step`` is this without ``from_draft``, as mlx-lm's).

    mlx-lm's ``draft_model`` and ``num_draft_tokens`` are there for its call shape but must stay
    None: the drafter is the model's own MTP head and ``block_size`` sets the drafts per round.
    Otherwise takes mlx-lm ``generate_step``'s arguments with their meaning and defaults
    (``stream``, ``max_tokens`` (-1: no limit), ``sampler``, ``logits_processors``,
    ``max_kv_size``, ``prompt_cache`` (from ``mlx_mtp.make_prompt_cache``; updated in place to
    hold the prompt and every token yielded, as mlx-lm's), ``prefill_step_size``, ``kv_bits``,
    ``kv_group_size``, ``quantized_kv_start``, ``prompt_progress_callback``,
    ``input_embeddings``), plus ours: ``model`` is an ``MTPModel``. ``block_size`` is tokens
    verified per round (drafts + 1); 1 is plain decode through the same loop. ``"auto"`` (the
    default) chooses the drafts of every round, up to ``max_block_size - 1``, from the acceptance
    and round costs measured so far (``mlx_mtp.decoding.block_chooser``; pass a ``BlockChooser``
    to tune it); its sampled output is keyed per output position
    (``mlx_mtp.decoding.keyed_sampling``), so it does not depend on the choices. ``sampler`` and
    ``logits_processors`` have mlx-lm's meaning; ``logprobs`` are the processed ones, as mlx-lm
    yields them. ``acceptance``: ``auto``, ``point-mass`` or ``speculative-sampling`` (see
    ``mlx_mtp.decoding.acceptance``; temperature 0 is always ``greedy``). ``seed`` seeds the key
    streams of speculative sampling, or under ``auto`` the per-position keys (default: drawn
    from mlx's global random state). ``draft_topk`` above 1 drafts a tree per round instead of a
    chain (``mlx_mtp.models.draft_tree``): ``draft_topk`` children considered per node, at most
    ``draft_tokens`` draft nodes verified (default ``draft_topk`` per depth), its depth the block
    size less one; at temperature > 0 a tree is walked by the point-mass rule over siblings
    (``acceptance`` ``auto`` or ``point-mass``). Under ``block_size="auto"`` (temperature 0) each
    round drafts a chain or a tree, whichever measured faster
    (``mlx_mtp.decoding.shape_chooser``). On a split target
    (``mlx_mtp.models.distributed``) every step is bounded by the split's watchdog.
    """
    check_no_draft_model(draft_model, num_draft_tokens)
    max_tokens = checked_max_tokens(max_tokens)
    block_size, chooser = resolve_block_size(block_size, max_block_size)  # widest width
    tree = check_tree(model, draft_topk, draft_tokens, block_size, chooser, sampler)
    cpu_blas.verify_thread_count()  # a bad MLX_MTP_VERIFY_THREADS fails before any work
    env.flag(SYNC_PHASES_ENV)  # as a bad MLX_MTP_SYNC_PHASES does
    prompt = checked_prompt(prompt, input_embeddings)
    kv = KVSettings(kv_bits, kv_group_size, quantized_kv_start).check(model.target)
    cache = _session_cache(model, prompt_cache, max_kv_size)
    drafter = _drafter(model, block_size)
    # The caller's cache must end holding exactly the tokens yielded (``Turn.finish``).
    turn = Turn(model, cache, kv, drafter) if prompt_cache is not None else None
    request = Request(max_tokens, sampler, logits_processors, prefill_step_size,
                      prompt_progress_callback, input_embeddings, block_size, chooser, seed,
                      acceptance, stats, tree)
    context = mx.stream(stream) if stream is not None else contextlib.nullcontext()
    with context:
        tokens = _rounds(prompt, model, cache, kv, turn, drafter, request)
        if getattr(model, "split", None) is not None:
            tokens = model.split.guard(tokens)
        yield from _finish_turn(tokens, turn)


def check_tree(model: MTPModel, draft_topk, draft_tokens, block_size: int,
               chooser: Optional[BlockChooser], sampler) -> Optional[TreeShape]:
    """The draft tree's shape (None: chains), or an error naming what a tree needs.
    ``block_size``: the widest chain (under ``auto``, ``max_block_size``)."""
    tree = tree_shape(draft_topk, draft_tokens, block_size, MAX_BLOCK_SIZE)
    if tree is None:
        return None
    if chooser is not None and not sampling.is_argmax(sampler):
        raise MTPError("draft_topk above 1 with block_size 'auto' runs at temperature 0 only "
                       "(auto's sampled draws are keyed per position); use a fixed block_size "
                       "to sample with trees")
    if model.drafter is not None and not (hasattr(model.drafter, "draft_tree")
                                          and hasattr(model.target, "keep_path")):
        raise MTPError(f"draft_topk above 1: this drafter ({type(model.drafter).__name__}) "
                       "drafts chains only (a drafter with draft_tree drafts trees)")
    if getattr(model, "split", None) is not None:
        raise MTPError("draft_topk above 1 (tree drafting) is not available on a split target")
    return tree


def checked_max_tokens(max_tokens) -> int:
    """A positive integer, or -1 for no limit (returned as ``sys.maxsize``)."""
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or \
            not (max_tokens >= 1 or max_tokens == -1):
        raise MTPError(f"max_tokens must be a positive integer or -1 (no limit), got "
                       f"{max_tokens!r}")
    return sys.maxsize if max_tokens == -1 else max_tokens


def checked_prompt(prompt, input_embeddings: Optional[mx.array]) -> mx.array:
    prompt = mx.array(prompt) if not isinstance(prompt, mx.array) else prompt
    if prompt.ndim != 1 or prompt.size == 0:
        raise MTPError("the prompt must be a non-empty 1-D array of token ids (with "
                       "input_embeddings too: the MTP head drafts from token ids)")
    if input_embeddings is not None and (input_embeddings.ndim != 2 or
                                         input_embeddings.shape[0] != prompt.size):
        raise MTPError(f"input_embeddings must be [prompt length, hidden size] = "
                       f"[{prompt.size}, ...], got shape {tuple(input_embeddings.shape)}")
    return prompt


def _session_cache(model: MTPModel, prompt_cache: Optional[PromptCache],
                   max_kv_size: Optional[int]) -> PromptCache:
    """The caller's prompt cache, checked, or a fresh one."""
    if prompt_cache is None:  # as in mlx-lm, max_kv_size only matters when making the cache
        note_max_kv_size(model, max_kv_size)
        return make_prompt_cache(model)
    return check_prompt_cache(model, prompt_cache)


def _drafter(model: MTPModel, block_size: int) -> Optional[Drafter]:
    """The model's MTP head when rounds draft (block size above 1), else None."""
    drafter = model.drafter if block_size > 1 else None
    if block_size > 1 and drafter is None:
        raise MTPError("this model has no MTP head: load one with drafter= (--drafter), "
                       "or use block_size=1")
    return drafter


def _finish_turn(tokens: Generator[Emitted, None, None], turn: Optional[Turn]
                 ) -> Generator[Emitted, None, None]:
    """``tokens``, then a prompt cache's turn finished at exactly the tokens yielded: when they
    ran out or the caller closed the generator; an error leaves the cache as mlx-lm would."""
    yielded = 0
    finish = turn is not None
    try:
        for item in tokens:
            yielded += 1
            yield item
    except BaseException as e:
        finish = finish and isinstance(e, GeneratorExit)
        raise
    finally:
        tokens.close()
        if finish:
            turn.finish(yielded)


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
        steps.close()  # a prompt cache ends at exactly the tokens yielded (GeneratorExit)


generate_step.__signature__ = inspect.signature(speculative_generate_step).replace(
    parameters=[p for p in inspect.signature(speculative_generate_step).parameters.values()
                if p.name not in ("draft_model", "num_draft_tokens")],
    return_annotation=Generator[Tuple[int, mx.array], None, None])


def _rounds(prompt: mx.array, model: MTPModel, cache: PromptCache, kv: KVSettings,
            turn: Optional[Turn], drafter: Optional[Drafter], request: Request
            ) -> Generator[Emitted, None, None]:
    """The generation: the exactness gate, the prefill, then rounds until ``max_tokens``."""
    rule = choose_rule(request, drafter, model.target.vocab_size)
    stats = start_stats(request, rule)
    profiler = draft_profile.attach(drafter)  # MLX_MTP_DRAFT_PROFILE: checked before any work
    # At T=0 exact or not at all: where a verify block is not byte-identical to single-token
    # decode on this device, the gate declines and the target decodes plainly. A rule that
    # samples promises the distribution: no probe (mlx_mtp.exactness.gate).
    decision = gate.apply(model, request.widest, stats, kv=kv if kv.enabled else None,
                          sampling=rule.samples)
    if not decision.mtp_enabled:
        yield from _decode_plainly(prompt, model, cache, kv, turn, rule, stats, request)
        return
    if (request.tree is not None and not rule.samples
            and not gate.apply_tree(model, request.tree.topk, request.tree.nodes,
                                    request.block_size - 1, stats,
                                    kv=kv if kv.enabled else None)):
        request.tree = None  # the tree probe declined: chains, as the stats say
        stats.draft_topk, stats.draft_tokens = 1, None
    stats.draft_profiler = profiler
    session = open_session(model, cache, kv, turn, drafter, rule, stats, request, prompt.size)
    progress, first = prefill(session, prompt, request, exact=decision.exact_verify)
    gate.report_verify(model, stats)
    start_generation(session, first[0])
    yield first
    if session.plain_decode:  # block size 1: no verify block: decode as mlx-lm does
        yield from pipelined_steps(session, progress, session.max_tokens - 1, stretch=False)
        return
    while progress.emitted < session.max_tokens:
        yield from run_round(session, progress)
    session.note_generation_time()


def run_round(session: Session, progress: Progress, max_stretch: Optional[int] = None
              ) -> Generator[Emitted, None, None]:
    """One round of a sequence decoded alone: choose, draft, verify and walk, commit, emit; or,
    under ``auto``, a stretch of undrafted rounds (at most ``max_stretch``) as pipelined
    one-token steps."""
    tree_round = session.shapes.choose() if session.shapes is not None else False
    ahead = (choose_ahead(session, progress, max_stretch)
             if session.stretches and not tree_round else None)
    if ahead is not None and ahead.stretch > 1:
        yield from pipelined_steps(session, progress, ahead.stretch, stretch=True)
        return
    with cpu_blas.verify_threads():  # the round's multi-row products (see cpu_blas)
        plan = plan_round(session, progress, ahead, tree_round)
        proposal = draft(session, progress, plan)
        verified = verify_and_walk(session, progress, plan, proposal)
        commit(session, progress, plan, verified)
        record_round(session, plan, verified)
    yield from emit(session, progress, verified)


def start_generation(session: Session, first_token: int) -> None:
    """After the prefill: the split's counts, the generation clock, the chooser's first id
    (the ids a round starts from key its acceptance: block_chooser)."""
    if session.split is not None:
        session.crossings()
        session.split.log_cache(session.target, session.cache, session.prompt_len)
    session.generation_start = time.perf_counter()
    session.stats.generation_tokens = 1
    if session.chooser is not None:
        session.chooser.see_tokens((first_token,))


def _decode_plainly(prompt: mx.array, model: MTPModel, cache: PromptCache, kv: KVSettings,
                    turn: Optional[Turn], rule: AcceptanceRule, stats: RunStats,
                    request: Request
                    ) -> Iterator[Emitted]:
    """The gate declined: mlx-lm's own decode (``plain_generate_step``), no drafter."""
    stats.acceptance_rule = None
    if turn is not None:
        forget_drafter(cache)
        turn.last = None  # mlx-lm's own generate_step keeps the cache as mlx-lm does
    yield from plain_generate_step(prompt, model, max_tokens=request.max_tokens,
                                   sampler=rule.sampler, logits_processors=rule.processors,
                                   prefill_step_size=request.prefill_step_size, stats=stats,
                                   prompt_cache=cache, kv=kv, progress=request.progress,
                                   input_embeddings=request.input_embeddings)
