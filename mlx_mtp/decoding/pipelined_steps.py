"""One-token steps pipelined like mlx-lm's ``generate_step``, for rounds without drafts: the
whole generation at block size 1, and under ``auto`` a stretch the chooser gives no drafts."""

from __future__ import annotations

import time
from typing import Generator, Optional, Tuple

import mlx.core as mx

from mlx_mtp.decoding import sampling
from mlx_mtp.decoding.round_session import Progress, Session, logprobs_of
from mlx_mtp.decoding.round_steps import Emitted


def pipelined_steps(session: Session, progress: Progress, count: int, *, stretch: bool
                    ) -> Generator[Emitted, None, None]:
    """``count`` one-token steps after ``progress.emitted`` tokens: step i + 1 is queued
    (``mx.async_eval``) before step i's token is read, so building the graph overlaps the
    compute. No capture, no rollback, one host read per token. Each step is what a round without
    drafts computes (``target.decode`` of the last token, the draw at its position: keyed under
    ``auto``). ``stretch``: an ``auto`` stretch, whose steps the chooser sees and records and
    whose (hidden, id) pairs the drafter gets later (``progress.deferred``). Leaves ``progress``
    at the last step's token.

    A pipelined step has no time of its own: on the CPU backend the call that queues a step
    returns once most of its work is done, so the time between two host reads is mostly the
    next step's, and the first step's is spent before the first read. Each step is recorded with
    the time since the previous read (the first since the stretch began: the sum is the
    stretch's time), and the chooser records every step of the stretch at the stretch's mean,
    once it ends: a step's own read-to-read time would leave the first step unrecorded and make
    the last one look nearly free."""
    if count < 1:
        return
    stats = session.stats
    chooser = session.chooser if stretch else None
    deferred = progress.deferred if stretch and session.drafter is not None else None
    first, token, history = progress.emitted, progress.bonus, progress.history
    stretch_start = last_read = time.perf_counter()
    queued = _step(session, token, history, first)
    mx.async_eval(queued[1], queued[2])
    for i in range(count):
        hidden, token, logprobs = queued
        history = sampling.append_history(history, token)
        if deferred is not None:
            deferred.append((hidden, token))
        if i + 1 < count:
            queued = _step(session, token, history, first + i + 1)
            mx.async_eval(queued[1], queued[2])
        token_id = token.item()
        stats.host_syncs += 1
        if (first + i) % 256 == 0:  # as mlx-lm does
            mx.clear_cache()
        now = time.perf_counter()
        stats.record_round(0, 0, now - last_read, own_time=False)
        last_read = now
        if chooser is not None:
            stats.undrafted_steps += 1
            chooser.see_tokens((token_id,))
        stats.generation_tokens = first + i + 1
        session.note_generation_time()
        yield token_id, logprobs[0], False
    if chooser is not None:  # every step of the stretch at its mean (docstring)
        for _ in range(count):
            chooser.record_round(0, 0, (last_read - stretch_start) / count)
    session.note_generation_time()
    progress.bonus, progress.history, progress.emitted = token, history, first + count


def _step(session: Session, token: mx.array, history: Optional[mx.array], position: int
          ) -> Tuple[mx.array, mx.array, mx.array]:
    """One decode step, lazy: ``(hidden, next token [1], logprobs [1, V])``."""
    target, rule = session.target, session.rule
    hidden = target.decode(token[None], session.cache)
    logits = target.logits(hidden[0])
    if rule.processors:
        logits = sampling.process_rows(logits, history, token, rule.processors)
    logprobs = logprobs_of(logits)
    return hidden, rule.draw_token(logits, logprobs, position), logprobs
