"""The speculative round loop shared by every family (``generate_rounds``): the gate, the prefill,
then rounds of choose -> draft -> verify and walk -> commit -> record -> emit, each a function in
``round_steps`` that calls the session's acceptance rule. The session and its state are in
``round_session``, rounds without drafts in ``pipelined_steps``, the public entry points in
``api``. docs/architecture.md, "One round", describes each step and why the output is exact."""

from __future__ import annotations

import time
from typing import Generator, Iterator, Optional

import mlx.core as mx

from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.decoding.acceptance import AcceptanceRule, choose_rule
from mlx_mtp.decoding.pipelined_steps import pipelined_steps
from mlx_mtp.decoding.plain import plain_generate_step
from mlx_mtp.decoding.request import Request
from mlx_mtp.decoding.round_session import (SYNC_PHASES_ENV, Progress, Session, open_session,
                                            start_stats)
from mlx_mtp.decoding.round_steps import (Emitted, choose_ahead, commit, draft, emit, plan_round,
                                          prefill, record_round, verify_and_walk)
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.exactness import gate, row_attention
from mlx_mtp.io.kv_settings import KVSettings
from mlx_mtp.decoding.prompt_cache import PromptCache, Turn, forget_drafter
from mlx_mtp.models import draft_profile
from mlx_mtp.models.model import MTPModel
from mlx_mtp.models.protocols import Drafter

__all__ = ["SYNC_PHASES_ENV", "generate_rounds", "run_round", "start_generation"]


def generate_rounds(prompt: mx.array, model: MTPModel, cache: PromptCache, kv: KVSettings,
                    turn: Optional[Turn], drafter: Optional[Drafter], request: Request
                    ) -> Generator[Emitted, None, None]:
    """One generation, its arguments checked (``mlx_mtp.decoding.api``): the exactness gate,
    the prefill, then rounds until ``max_tokens``."""
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
    attention = row_attention.usage()
    try:
        while progress.emitted < session.max_tokens:
            yield from run_round(session, progress)
    finally:  # also where the consumer stops early (a stop string)
        gate.report_attention(stats, attention)
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
