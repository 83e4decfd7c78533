"""The steps of the round loop (``mlx_mtp.decoding.rounds``): prefill, then per round
choose -> draft -> verify and walk -> commit -> emit.

Draft, verify and commit pass whole blocks (``Draft``, ``Verified``), so a tree of drafts
(parent indices into ``Draft.ids``) or a leading batch dimension can be added to these records
and steps without a second loop.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Generator, Iterator, List, Optional, Tuple

import mlx.core as mx

from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.cpu import pin as cpu_pin
from mlx_mtp.decoding import sampling
from mlx_mtp.decoding.acceptance import Draft
from mlx_mtp.exactness import row_exact_layers
from mlx_mtp.decoding.request import Request
from mlx_mtp.decoding.round_session import Progress, Session, logprobs_of
from mlx_mtp.decoding.prompt_cache import forget_drafter
from mlx_mtp import draft_tree
from mlx_mtp.draft_tree import DraftTree

Emitted = Tuple[int, mx.array, bool]  # (token, logprobs, from_draft)


# ------------------------------------------------------------------------------------ prefill


def prefill(session: Session, prompt: mx.array, request: Request, exact: bool
            ) -> Tuple[Progress, Emitted]:
    """Feed the prompt to the target (and drafter), draw the first token: ``(progress, first
    output)``. Chunked exactly as mlx-lm's generate_step: prompt[:-1] in chunks, then the last
    token; KV quantization (kv_bits) after each model call, as there. ``exact`` False (byte
    identity is not kept, e.g. an overridden gate): the exactness-only fallbacks buy nothing,
    so they are skipped."""
    steps = prefill_steps(session, prompt, request, exact)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def prefill_steps(session: Session, prompt: mx.array, request: Request, exact: bool
                  ) -> Generator[None, None, Tuple[Progress, Emitted]]:
    """``prefill`` a chunk at a time: yields between chunks (the prompt's last chunk and its
    first token are one step), returns ``(progress, first output)``. ``stats.prompt_s`` counts
    the steps' own time, not the pauses between them."""
    stats = session.stats
    report = request.progress or (lambda *_: None)
    started = time.perf_counter()
    _prepare(session, prompt, exact)
    report(0, session.prompt_len)
    spent = 0.0
    for _ in _prefill_chunks(session, prompt, request, report):
        spent += time.perf_counter() - started
        yield
        started = time.perf_counter()
    hidden, token, logprobs, history, replaced = _first_token(session, prompt, request)
    report(session.prompt_len, session.prompt_len)
    token_id = token.item()
    stats.prompt_tokens = session.prompt_len
    stats.prompt_s = spent + time.perf_counter() - started
    if session.turn is not None:  # the first token: like a round's bonus, yielded before it is fed
        session.turn.round_done(0, hidden[:, -1:], 0, token, replaced)
    return Progress(token, history), (token_id, logprobs[0], False)


def _prepare(session: Session, prompt: mx.array, exact: bool) -> None:
    """Ready the target for verify blocks, and the drafter (or the turn's carried one)."""
    target, drafter, turn = session.target, session.drafter, session.turn
    if exact:
        target.prepare(session.widest)
    else:
        target.prepare(session.widest, exact=False)
    # A drafted round's verify on the CPU runs with every thread on one core (``cpu_pin``) from
    # its first eager C kernel call on: each kernel syncs with MLX's stream thread. Not across
    # split ranks (two could pin to one core), nor with more than one verify or kernel thread
    # (they would share the core).
    session.pin = (cpu_pin.enabled() and mx.default_device() == mx.cpu and session.split is None
                   and cpu_blas.round_thread_count() == 1
                   and not (getattr(target, "exact", False)
                            and row_exact_layers.threaded(target.model, session.widest)))
    if turn is not None:
        if drafter is not None:
            turn.start_drafter()
            turn.pair_previous(prompt[:1])
        else:
            forget_drafter(session.cache)
    elif drafter is not None:
        drafter.reset()
        drafter.bind_cache(session.cache)  # the Gemma 4 assistant reads the target's K/V


def _prefill_chunks(session: Session, prompt: mx.array, request: Request,
                    report: Callable[[int, int], None]) -> Iterator[None]:
    """Every prompt token but the last, ``prefill_step_size`` at a time; yields between
    chunks (not after the last). A prompt cache's checkpoint ends a chunk, and the turn keeps a
    copy there."""
    target, drafter, cache = session.target, session.drafter, session.cache
    prompt_len = session.prompt_len
    # Every core for the chunk's products, except across split ranks (two ranks on one machine
    # would run twice as many BLAS threads as cores).
    threads = cpu_blas.prefill_threads if session.split is None else contextlib.nullcontext
    checkpoints = cache.checkpoints if session.turn is not None else ()
    start = 0
    while prompt_len - start > 1:
        stop = min(start + request.prefill_step_size, prompt_len - 1)
        stop = min([p for p in checkpoints if start < p < stop], default=stop)
        with threads():
            hidden = target.prefill(prompt[None, start:stop], cache,
                                    request.embeddings(start, stop))
            if drafter is not None:
                drafter.prefill(hidden, prompt[start + 1 : stop + 1])
            session.kv.quantize(cache)
            mx.eval(target.cache_state(cache), drafter.state_arrays() if drafter else [])
        if stop in checkpoints:
            session.turn.keep(stop)
        start = stop
        report(start, prompt_len)
        if prompt_len - start > 1:
            yield


def _first_token(session: Session, prompt: mx.array, request: Request
                 ) -> Tuple[mx.array, mx.array, mx.array, Optional[mx.array], list]:
    """The prompt's last token through the target, and the first token drawn from it:
    ``(hidden, token [1], logprobs [1, V], history, cache entries KV quantization replaced)``."""
    target, drafter, cache, rule = session.target, session.drafter, session.cache, session.rule
    prompt_len = session.prompt_len
    last = prompt[None, prompt_len - 1 :]
    embeddings = request.embeddings(prompt_len - 1, prompt_len)
    # A one-token step, as mlx-lm's first decode step: the target's cheapest bitwise-equal path
    # for one token (``decode``) unless the step takes input embeddings.
    hidden = (target.decode(last, cache) if embeddings is None
              else target.prefill(last, cache, embeddings))
    history = prompt if rule.processors else None  # mlx-lm feeds processors the whole history
    logits = target.logits(hidden[:, -1])
    for processor in rule.processors:
        logits = processor(history, logits)
    logprobs = logprobs_of(logits)
    token = rule.draw_token(logits, logprobs, 0)
    history = sampling.append_history(history, token)
    if drafter is not None:
        drafter.prefill(hidden, token)
    replaced = session.kv.quantize(cache)
    mx.eval(token, logprobs, drafter.state_arrays() if drafter else [])
    return hidden, token, logprobs, history, replaced


# ------------------------------------------------------------------------------------ choose


@dataclass
class RoundPlan:
    """A round's drafts and the times its costs are measured from."""

    drafts: int  # k: the drafts to make (the verify block is k + 1 wide)
    started: float  # perf_counter at the round's start (RunStats.record_round)
    chosen_at: float  # perf_counter once chosen (the chooser's observed cost starts here)
    tree: bool = False  # the drafts are a tree (``Session.tree``'s shape, ``drafts`` deep)


@dataclass
class EarlyChoice:
    """``auto``'s choice made before the round, when undrafted stretches may run pipelined."""

    drafts: int
    started: float  # perf_counter before choosing: the round's start
    stretch: int  # undrafted rounds in a row it commits to, this one first (0 if it drafts)


def draft_limit(session: Session, progress: Progress) -> int:
    """The most drafts the next round may make: the widest block, never past the token budget
    nor (kv_bits) across the switch to a quantized cache."""
    drafts = min(session.max_drafts, session.max_tokens - progress.emitted - 1)
    return session.kv.max_drafts(session.cache, drafts)


def choose_ahead(session: Session, progress: Progress, max_stretch: Optional[int] = None
                 ) -> EarlyChoice:
    """The chooser's choice before the round, and how many undrafted rounds it commits to (at
    most ``max_stretch``: the chooser commits to the rest when asked again)."""
    started = time.perf_counter()
    remaining = session.max_tokens - progress.emitted
    drafts = session.chooser.choose(draft_limit(session, progress))
    stretch = min(session.chooser.undrafted_stretch(), remaining,
                  max_stretch or remaining) if drafts == 0 else 0
    return EarlyChoice(drafts, started, stretch)


def plan_round(session: Session, progress: Progress, ahead: Optional[EarlyChoice],
               tree_round: bool = False) -> RoundPlan:
    """The round's drafts: at most ``draft_limit``; under ``auto`` the chooser's choice
    (``ahead`` when made before the round: the sequence's chooser's, or a batch's), or for a
    round the shape chooser gave a tree (``tree_round``) its depth. Catches the drafter up on
    deferred rounds before it drafts again."""
    drafts = draft_limit(session, progress)
    started = time.perf_counter() if ahead is None else ahead.started
    tree = session.tree is not None and (session.shapes is None or tree_round)
    if session.chooser is not None:
        if tree_round:
            drafts = min(drafts, session.shapes.depth)
        elif ahead is None:
            drafts = session.chooser.choose(drafts)
        else:
            drafts = min(drafts, ahead.drafts)
        if session.split is not None:  # timed choices differ per rank: all verify rank 0's width
            drafts = session.split.from_rank0(drafts)
        if drafts > 0 and progress.deferred:  # outside the round's measured cost
            _feed_deferred(session, progress)
    return RoundPlan(drafts, started, time.perf_counter(), tree and drafts > 0)


def _feed_deferred(session: Session, progress: Progress) -> None:
    """The (hidden, ids) pairs of the rounds without drafts since the drafter last drafted."""
    with session.stats.phase("accept"):
        session.drafter.accept(mx.concatenate([d[0] for d in progress.deferred], axis=1),
                               mx.concatenate([d[1] for d in progress.deferred]))
        session.queue(session.drafter.state_arrays())
    progress.deferred = []


# ------------------------------------------------------------------------------------ draft


def draft(session: Session, progress: Progress, plan: RoundPlan) -> Draft:
    """The drafter's ``plan.drafts`` proposals (a chain by the acceptance rule, or a tree),
    queued as the block's one evaluation."""
    if plan.drafts == 0:
        return Draft()
    drafter, stats = session.drafter, session.stats
    with stats.phase("draft"):
        syncs = drafter.syncs
        if plan.tree:  # (trees run with the rules that keep drafts equal to the target's draws)
            nodes = session.tree.nodes
            if session.shapes is not None:  # auto: the budget scales with the round's depth
                nodes = min(nodes, session.tree.topk * plan.drafts)
            # the logits processors over every node's row, with its path (draft_processing)
            rows = session.rule.drafting.tree_rows(progress.history, session.target.vocab_size)
            tree = (drafter.draft_tree(session.tree.topk, nodes, plan.drafts) if rows is None
                    else drafter.draft_tree(session.tree.topk, nodes, plan.drafts, process=rows))
            proposal = Draft(ids=tree.ids, tree=tree)
        else:
            proposal = session.rule.draft(drafter, plan.drafts, progress.history,
                                          progress.emitted, session.target.vocab_size)
        session.queue(proposal.ids, proposal.probs if proposal.probs is not None else [])
        stats.draft_syncs += 1 + drafter.syncs - syncs
        stats.draft_processors = session.rule.drafting.status
    return proposal


# ------------------------------------------------------------------------------------ verify


@dataclass
class Verified:
    """A verified block and its walk: ``accepted`` drafts kept, then the target's own token.
    For a tree the rows are those of the walked path (root first), ``path`` their nodes."""

    hidden: mx.array  # [1, k + 1, H]: the target's hidden states over [bonus, drafts]
    logprobs: mx.array  # [k + 1, V]: processed, as yielded
    target_ids: mx.array  # [k + 1]: the target's draw at every row
    accepted: int
    out_ids: List[int]  # the round's output: the kept drafts, then the target's token
    new_ids: mx.array  # the same ids on the device
    path: Optional[List[int]] = None  # a tree's walked nodes (root first)
    fed: int = 0  # a tree's nodes, root included (what its verify fed the target)


def verify_and_walk(session: Session, progress: Progress, plan: RoundPlan, proposal: Draft
                    ) -> Verified:
    """One target forward over [bonus, drafts], a draw at every row, the round's one host
    read, and the walk: the longest run of drafts the acceptance rule keeps."""
    verify_start = time.perf_counter()
    target, stats = session.target, session.stats
    with stats.phase("verify"), _pinned(session, plan):
        block = round_block(progress, proposal)
        # One token (no drafts) needs no rollback: a plain step.
        if proposal.tree is not None:
            hidden = target.verify_tree(block[None], session.cache, proposal.tree)
        elif plan.drafts > 0:
            hidden = target.verify(block[None], session.cache)
        else:
            hidden = target.decode(block[None], session.cache)
        rows = verify_rows(session, progress, proposal, block, target.logits(hidden[0]))
        host = host_read([rows])[0]
        stats.host_syncs += 1
    return walk(session, plan, proposal, hidden, rows, host, verify_start)


def round_block(progress: Progress, proposal: Draft) -> mx.array:
    """The ids a round verifies: ``[bonus, drafts]``."""
    bonus = progress.bonus
    return bonus if proposal.ids is None else mx.concatenate([bonus, proposal.ids])


@dataclass
class VerifyRows:
    """A verified block's rows and the target's draws from them, on the device (nothing read
    yet)."""

    logprobs: mx.array  # [w, V]: processed, as yielded
    target_ids: mx.array  # [w]: the target's draw at every row
    host: mx.array  # what the walk reads: the target's picks, the drafts, any verdicts


def verify_rows(session: Session, progress: Progress, proposal: Draft, block: mx.array,
                logits: mx.array) -> VerifyRows:
    """The target's draw at every row of a verified block from its ``logits [w, V]`` (by the
    acceptance rule), and what the walk will read of it."""
    rule = session.rule
    if rule.processors:
        paths = (None if proposal.tree is None
                 else [proposal.tree.path(i) for i in range(len(proposal.tree.parents))])
        logits = sampling.process_rows(logits, progress.history, block, rule.processors,
                                       paths)
    logprobs = logprobs_of(logits)
    drafts = [] if proposal.ids is None else [proposal.ids]
    target_ids, verdicts = rule.draw_targets(logits, logprobs, proposal, block,
                                             progress.emitted)
    return VerifyRows(logprobs, target_ids, mx.concatenate([target_ids, *drafts, *verdicts]))


def host_read(rows: List[VerifyRows]) -> List[list]:
    """What the walks of one or more verified blocks read, in one read."""
    sizes = [r.host.shape[0] for r in rows]
    flat = mx.concatenate([r.host.astype(mx.uint32) for r in rows]).tolist()
    out, first = [], 0
    for n in sizes:
        out.append(flat[first : first + n])
        first += n
    return out


def walk(session: Session, plan: RoundPlan, proposal: Draft, hidden: mx.array,
         rows: VerifyRows, host: list, verify_start: float) -> Verified:
    """The walk over a verified block (its verify timed from ``verify_start``): the drafts the
    acceptance rule keeps, or a tree's accepted path."""
    drafts = plan.drafts
    logprobs, target_ids = rows.logprobs, rows.target_ids
    width = 1 if proposal.ids is None else proposal.ids.shape[0] + 1
    session.stats.record_verify(width, time.perf_counter() - verify_start)
    if proposal.tree is not None:
        return _walk_tree(session, proposal.tree, hidden, logprobs, target_ids, host)
    picks, drafted = host[: drafts + 1], host[drafts + 1 : 2 * drafts + 1]
    accepted = session.rule.accepted(picks, drafted, host[2 * drafts + 1 :])
    out_ids = drafted[:accepted] + picks[accepted : accepted + 1]
    new_ids = (target_ids[:1] if accepted == 0
               else mx.concatenate([proposal.ids[:accepted], target_ids[accepted : accepted + 1]]))
    return Verified(hidden, logprobs, target_ids, accepted, out_ids, new_ids)


def _walk_tree(session: Session, tree: DraftTree, hidden: mx.array, logprobs: mx.array,
               target_ids: mx.array, host: list) -> Verified:
    """The walk down a verified tree (a child kept while it equals its parent's draw); the rows
    of the walked path, root first."""
    path = draft_tree.accepted_path(tree, host[: len(tree.parents)])
    session.stats.record_tree(tree, path)
    out_ids = [tree.tokens[n - 1] for n in path[1:]] + [host[path[-1]]]
    rows = mx.array(path, dtype=mx.uint32)
    return Verified(hidden[:, rows], logprobs[rows], target_ids[rows], len(path) - 1, out_ids,
                    mx.array(out_ids, dtype=target_ids.dtype), path, len(tree.parents))


def _pinned(session: Session, plan: RoundPlan):
    """A drafted round's verify pinned to one core from its first eager kernel call (cpu_pin)."""
    return cpu_pin.on_first_sync() if session.pin and plan.drafts > 0 \
        else contextlib.nullcontext()


# ------------------------------------------------------------------------------------ commit


def commit(session: Session, progress: Progress, plan: RoundPlan, verified: Verified,
           pending_accepts: Optional[list] = None) -> None:
    """Keep the ``accepted + 1`` verified rows: roll the target's caches back, quantize, feed
    the drafter (or defer it), and report the round to a prompt cache's turn. With
    ``pending_accepts`` (a batched round, whose drafters accept together) the drafter's pairs
    are appended to it instead of fed. The drafter is not fed when no later round drafts (at
    most one token of the budget left after this round) and no prompt cache keeps it."""
    target, drafter, cache, stats = session.target, session.drafter, session.cache, session.stats
    accepted, hidden = verified.accepted, verified.hidden
    if plan.drafts > 0:  # selecting the kept states is graph work: evaluated with the next round
        with stats.phase("finalize"):
            if verified.path is not None:
                target.keep_path(cache, verified.fed, verified.path)
            else:
                target.rollback(cache, fed=plan.drafts + 1, keep=accepted + 1)
    replaced = session.kv.quantize(cache)
    if session.split is not None:  # rollback ran on every rank, on its own layers
        session.crossings()
        session.split.log_cache(target, cache, session.prompt_len + progress.emitted + accepted)
    progress.bonus = verified.target_ids[accepted : accepted + 1]
    progress.history = sampling.append_history(progress.history, verified.new_ids)
    # Once at most one plain step is left nothing reads the drafter, unless a prompt cache keeps it.
    drafts_again = session.max_tokens - (progress.emitted + accepted + 1) > 1
    drafter_current = drafter is not None and (drafts_again or session.turn is not None)
    if (drafter_current and session.chooser is not None and plan.drafts == 0
            and session.turn is None):
        # (a prompt cache's turn needs the drafter current at every round: no deferral)
        progress.deferred.append((hidden[:, :1], verified.new_ids))  # fed if it drafts again
    elif drafter_current and pending_accepts is not None:
        pending_accepts.append((hidden[:, : accepted + 1], verified.new_ids))
    elif drafter_current:
        with stats.phase("accept"):
            drafter.accept(hidden[:, : accepted + 1], verified.new_ids)
            session.queue(drafter.state_arrays())
    if session.turn is not None:
        session.turn.round_done(progress.emitted, hidden[:, : accepted + 1], accepted,
                                progress.bonus, replaced)


def record_round(session: Session, plan: RoundPlan, verified: Verified,
                 timed: bool = True) -> None:
    """The round's wall time into the stats; the time since the choice to the chooser (not
    ``timed``: a batched round whose drafts a batch's chooser picked, which times it itself;
    the sequence's chooser counts its judgments only)."""
    ended = time.perf_counter()
    session.stats.record_round(plan.drafts, verified.accepted, ended - plan.started)
    if session.chooser is not None and not plan.tree:  # its widths are chains'
        session.chooser.record_round(plan.drafts, verified.accepted,
                                     ended - plan.chosen_at if timed else None)
    if session.shapes is not None and plan.drafts > 0:
        session.shapes.record_round(plan.tree, verified.accepted + 1, ended - plan.chosen_at,
                                    plan.drafts)


# ------------------------------------------------------------------------------------ emit


def emit(session: Session, progress: Progress, verified: Verified) -> Iterator[Emitted]:
    """The round's tokens, up to the token budget."""
    count = min(verified.accepted + 1, session.max_tokens - progress.emitted)
    if session.chooser is not None:
        session.chooser.see_tokens(verified.out_ids[:count])
    progress.emitted += count
    session.stats.generation_tokens = progress.emitted
    session.note_generation_time()
    for i in range(count):
        yield verified.out_ids[i], verified.logprobs[i], i < verified.accepted
