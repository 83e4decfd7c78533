"""Rounds for several sequences at once: every round drafts for each sequence, verifies all
their blocks in one target forward, then walks, rolls back and emits per sequence.

Each sequence is a generation of its own (``round_session``: its request, acceptance rule,
stats, caches, drafter and chooser); only the target forward and its LM head are shared, their
rows packed (``mlx_mtp.models.packed_batch``), and the drafter's head steps where the family
batches them (``Drafter.draft_batch``). A sequence joins between rounds (its prompt prefilled
alone) and leaves when its consumer stops reading. At temperature 0 each sequence's tokens are what it decodes
alone, byte for byte, where the batch-vs-alone probe (``mlx_mtp.exactness.batch_vs_alone``)
passes on this device; ``BatchRounds`` refuses to start where it does not. A sequence may start
from a prompt cache (``mlx_mtp.make_prompt_cache``), which ends holding the prompt and exactly the
tokens its reader read, as ``generate_step``'s does.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Deque, Iterator, List, Optional

import mlx.core as mx

from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.decoding.acceptance import Draft, choose_rule
from mlx_mtp.decoding.batch_chooser import BatchChooser
from mlx_mtp.decoding.api import checked_max_tokens, checked_prompt
from mlx_mtp.decoding.block_chooser import AUTO
from mlx_mtp.decoding.draft_processing import takes_keyword
from mlx_mtp.decoding.limits import DEFAULT_MAX_BLOCK_SIZE, DEFAULT_MAX_TOKENS
from mlx_mtp.decoding.request import Request
from mlx_mtp.decoding.round_session import Progress, Session, open_session, start_stats
from mlx_mtp.decoding.round_steps import (EarlyChoice, Emitted, commit, draft, draft_limit, emit,
                                          host_read, plan_round, prefill_steps, record_round,
                                          round_block, verify_rows, walk)
from mlx_mtp.decoding.rounds import run_round, start_generation
from mlx_mtp.decoding.speculation import SpeculationOptions
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.errors import MTPError
from mlx_mtp.exactness import gate
from mlx_mtp.exactness.batch_vs_alone import probe_batch
from mlx_mtp.io.kv_settings import KVSettings
from mlx_mtp.decoding.prompt_cache import PromptCache, Turn, check_prompt_cache, make_prompt_cache
from mlx_mtp.models.packed_batch import split_rows


ALONE_STRETCH = 8  # pipelined steps of a lone sequence's stretch per round() call


@dataclass
class BatchedSequence:
    """One generation in the batch: its session, where its output stands, and the tokens it
    emitted that its consumer has not read yet."""

    session: Session
    joining: Optional[Iterator[None]]  # its prompt's prefill steps, until its first token
    progress: Optional[Progress] = None  # once joined
    out: Deque[Emitted] = field(default_factory=deque)
    left: bool = False  # removed from the batch: no round emits for it any more

    @property
    def done(self) -> bool:
        """Every token of its budget emitted (its consumer may still be reading them)."""
        return self.progress is not None and self.progress.emitted >= self.session.max_tokens

    def join_step(self) -> None:
        """One prefill chunk; the last one also draws the first token, and it has joined."""
        try:
            next(self.joining)
        except StopIteration as finished:
            self.joining = None
            self.progress, first = finished.value
            gate.report_verify(self.session.model, self.stats)
            start_generation(self.session, first[0])
            self.out.append(first)

    @property
    def stats(self) -> RunStats:
        return self.session.stats


def batch_problem(model) -> Optional[str]:
    """Why ``model`` cannot decode sequences in batched rounds here, or None."""
    if getattr(model, "split", None) is not None:
        return "a split target decodes one sequence at a time"
    if not hasattr(model.target, "verify_batch"):
        return f"the {model.target.family} family has no batched verify"
    if model.drafter is None:
        return "the model has no MTP head"
    return None


class BatchRounds:
    """Up to ``max_batch`` sequences decoded together in rounds (``round``). ``block_size`` and
    ``max_block_size`` as ``generate_step``'s, for every sequence. Under ``auto`` each sequence
    has its own chooser, which chooses while it decodes alone; while several decode together the
    batch's ``BatchChooser`` picks one draft count for all of them by the batch's measured rate
    (their choosers count the judgments). Checks on creation that a packed verify equals each
    sequence's verify alone on this device (unless MLX_MTP_ALLOW_INEXACT=1), else raises
    ``MTPError``."""

    def __init__(self, model, max_batch: int, *, block_size=AUTO,
                 max_block_size: int = DEFAULT_MAX_BLOCK_SIZE):
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
            raise MTPError(f"max_batch must be a positive integer, got {max_batch!r}")
        problem = batch_problem(model)
        if problem is not None:
            raise MTPError(f"batched rounds: {problem}")
        self.model = model
        self.max_batch = max_batch
        # every sequence's (each with its own seed and acceptance rule: ``start``)
        self.speculation = SpeculationOptions(block_size=block_size, max_block_size=max_block_size)
        self.widest = self.speculation.widest
        if self.widest < 2:
            raise MTPError("batched rounds draft: block_size must be above 1")
        # Packed verifies are as wide as every sequence's widest block together: their products
        # must be row-exact at those widths too.
        model.target.prepare(max_batch * self.widest)
        if not gate.allow_inexact_from_env():
            reason = probe_batch(model.target, max_batch, self.widest)
            if reason is not None:
                raise MTPError(f"batched rounds declined: batch-vs-alone probe: {reason}")
        self.active: List[BatchedSequence] = []
        self.takes_picks = _takes_picks(model.drafter)
        self.chooser = BatchChooser(self.widest - 1) if block_size == AUTO else None

    # ------------------------------------------------------------------------ joining, leaving

    def start(self, prompt, *, max_tokens: int = DEFAULT_MAX_TOKENS, sampler=None,
              logits_processors=None, seed: Optional[int] = None, acceptance: str = "auto",
              stats: Optional[RunStats] = None, prefill_step_size: int = 2048,
              progress: Optional[Callable[[int, int], None]] = None,
              prompt_cache: Optional[PromptCache] = None) -> BatchedSequence:
        """A sequence joins: its prompt's first prefill chunk now (alone, as ``generate_step``
        chunks it), each further chunk before a round, so a long prompt does not stall the
        others; its first token is emitted with its last chunk. The arguments are
        ``generate_step``'s; a ``prompt_cache`` is settled when ``tokens`` ends (its
        ``Turn.finish``)."""
        if len(self.active) >= self.max_batch:
            raise MTPError(f"the batch is full ({self.max_batch} sequences)")
        model = self.model
        max_tokens = checked_max_tokens(max_tokens)
        prompt = checked_prompt(prompt, None)
        speculation = replace(self.speculation, seed=seed, acceptance=acceptance)
        request = Request(max_tokens=max_tokens, sampler=sampler,
                          logits_processors=logits_processors, prefill_step_size=prefill_step_size,
                          progress=progress, input_embeddings=None, block_size=speculation.widest,
                          chooser=speculation.make_chooser(), seed=speculation.seed,
                          acceptance=speculation.acceptance, stats=stats)
        drafter = copy.copy(model.drafter)  # its own head cache and drafts; the weights shared
        rule = choose_rule(request, drafter, model.target.vocab_size)
        stats = start_stats(request, rule)
        decision = gate.apply(model, request.widest, stats, sampling=rule.samples)
        if not decision.mtp_enabled:
            raise MTPError(f"batched rounds: the exactness gate declined MTP: "
                           f"{decision.reason}")
        cache = (make_prompt_cache(model) if prompt_cache is None
                 else check_prompt_cache(model, prompt_cache))
        turn = Turn(model, cache, KVSettings(), drafter) if prompt_cache is not None else None
        session = open_session(model, cache, KVSettings(), turn, drafter, rule, stats, request,
                               prompt.size)
        seq = BatchedSequence(session, prefill_steps(session, prompt, request, exact=True))
        seq.join_step()
        self.active.append(seq)
        return seq

    def remove(self, seq: BatchedSequence) -> None:
        """The sequence leaves the batch (its caches are freed with it)."""
        seq.left = True
        if seq in self.active:
            self.active.remove(seq)
            seq.session.note_generation_time()

    def tokens(self, seq: BatchedSequence) -> Iterator[Emitted]:
        """The sequence's ``(token, logprobs, from_draft)``, as ``generate_step`` yields them;
        runs a round for the whole batch whenever this sequence has none left to read. Closing
        it removes the sequence; its prompt cache then holds exactly the tokens read (not after
        an error, as ``generate_step``'s)."""
        read, settle = 0, True
        try:
            while True:
                while not seq.out:
                    if seq.done:
                        return
                    self.round()
                item = seq.out.popleft()
                read += 1
                yield item
        except BaseException as e:
            settle = isinstance(e, GeneratorExit)
            raise
        finally:
            self.remove(seq)
            turn = seq.session.turn
            if settle and turn is not None and seq.joining is None:
                turn.finish(read)

    # ------------------------------------------------------------------------------ a round

    def round(self) -> None:
        """One round for every sequence that still has tokens to emit; before it, one more
        prefill chunk of each sequence still joining. A sequence with no other in the batch
        decodes as it would alone (``run_round``: under ``auto`` its undrafted stretches run
        pipelined, at most ``ALONE_STRETCH`` steps a call so a sequence that starts meanwhile
        joins soon), its verify pinned as alone (``Session.pin``, which a batched verify does not
        read)."""
        for s in [s for s in self.active if s.joining is not None]:
            s.join_step()
        # A prompt cache can take back the unread tokens of its sequence's last round only: a
        # sequence with one holds back until its reader has read what it has.
        seqs = [s for s in self.active if s.joining is None and not s.done
                and not (s.session.turn is not None and s.out)]
        if not seqs:
            return
        if len(seqs) == 1 and all(s.joining is None for s in self.active):
            s = seqs[0]
            s.out.extend(run_round(s.session, s.progress, ALONE_STRETCH))
            return
        target = self.model.target
        with cpu_blas.verify_threads():
            started = time.perf_counter()
            plans = [plan_round(s.session, s.progress, a)
                     for s, a in zip(seqs, self._choose(seqs, started))]
            proposals = self._draft(seqs, plans)
            verify_start = time.perf_counter()
            with _phases(seqs, "verify"):
                blocks = [round_block(s.progress, p) for s, p in zip(seqs, proposals)]
                hidden = target.verify_batch(blocks, [s.session.cache for s in seqs])
                widths = [b.shape[0] for b in blocks]
                logits = split_rows(target.logits(mx.concatenate(hidden, axis=1)[0]), widths,
                                    axis=0)
                rows = [verify_rows(s.session, s.progress, p, b, l)
                        for s, p, b, l in zip(seqs, proposals, blocks, logits)]
                hosts = host_read(rows)
            done = []
            accepts = []  # (sequence, hidden rows, ids) its drafter accepts
            for s, plan, proposal, h, r, host in zip(seqs, plans, proposals, hidden, rows,
                                                      hosts):
                s.stats.host_syncs += 1
                verified = walk(s.session, plan, proposal, h, r, host, verify_start)
                pending = []
                commit(s.session, s.progress, plan, verified, pending_accepts=pending)
                accepts += [(s, *pair) for pair in pending]
                if plan.drafts == 0:  # nothing to roll back: drop what a rollback keeps
                    target.rollback(s.session.cache, fed=1, keep=1)
                done.append((s, plan, verified))
            self._accept(accepts)
            for s, plan, verified in done:
                record_round(s.session, plan, verified, timed=self.chooser is None)
                s.out.extend(emit(s.session, s.progress, verified))
            chosen = {p.drafts for p in plans}
            if self.chooser is not None and len(chosen) == 1:  # (all drafted alike: a count's)
                self.chooser.record_round(len(seqs), chosen.pop(),
                                          sum(v.accepted + 1 for _, _, v in done),
                                          time.perf_counter() - started)

    def _choose(self, seqs: List[BatchedSequence], started: float) -> list:
        """Per sequence, the batch chooser's drafts for the round, at most what its budget allows
        (None without a batch chooser: a fixed block size)."""
        if self.chooser is None:
            return [None] * len(seqs)
        k = self.chooser.choose(len(seqs))
        for s in seqs:
            s.session.chooser.batched_round()
        return [EarlyChoice(min(k, draft_limit(s.session, s.progress)), started, 0)
                for s in seqs]

    def _draft(self, seqs: List[BatchedSequence], plans) -> List[Draft]:
        """Every sequence's drafts: the argmax drafts' head steps batched, where the family
        batches them (``draft_batch``), each sequence's logits processors over its own rows
        (``draft_batch``'s ``picks``: the processed argmax with its history); a rule that
        samples its drafts drafts on its own."""
        proposals = [Draft() for _ in seqs]
        together = [i for i, (s, p) in enumerate(zip(seqs, plans))
                    if p.drafts > 0 and s.session.rule.drafts_argmax]
        picks = {i: seqs[i].session.rule.drafting.argmax(seqs[i].progress.history,
                                                         self.model.target.vocab_size)
                 for i in together}
        if not self.takes_picks:  # processed drafts: each sequence's own draft_sampled
            together = [i for i in together if picks[i] is None]
        batched = hasattr(self.model.drafter, "draft_batch") and len(together) > 1
        for i, (s, plan) in enumerate(zip(seqs, plans)):
            if not (batched and i in together):
                proposals[i] = draft(s.session, s.progress, plan)
        if batched:
            drafters = [seqs[i].session.drafter for i in together]
            drafts = [plans[i].drafts for i in together]
            with _phases([seqs[i] for i in together], "draft"):
                if any(picks[i] is not None for i in together):
                    ids = self.model.drafter.draft_batch(drafters, drafts,
                                                         picks=[picks[i] for i in together])
                else:
                    ids = self.model.drafter.draft_batch(drafters, drafts)
            for i, x in zip(together, ids):
                proposals[i].ids = x
                seqs[i].stats.draft_syncs += 1
                seqs[i].stats.draft_processors = seqs[i].session.rule.drafting.status
        return proposals

    def _accept(self, accepts) -> None:
        """The drafters' accept hooks for this round's kept pairs, batched where the family
        batches them (``accept_batch``)."""
        if not accepts:
            return
        seqs = [s for s, _, _ in accepts]
        with _phases(seqs, "accept"):
            if hasattr(self.model.drafter, "accept_batch") and len(accepts) > 1:
                self.model.drafter.accept_batch([s.session.drafter for s in seqs],
                                                [h for _, h, _ in accepts],
                                                [ids for _, _, ids in accepts])
            else:
                for s, h, ids in accepts:
                    s.session.drafter.accept(h, ids)
            mx.async_eval([a for s in seqs for a in s.session.drafter.state_arrays()])


def _takes_picks(drafter) -> bool:
    """Whether the family's ``draft_batch`` picks ids through per-sequence ``picks``."""
    batch = getattr(drafter, "draft_batch", None)
    return batch is not None and takes_keyword(batch, "picks")


@contextlib.contextmanager
def _phases(seqs: List[BatchedSequence], name: str):
    """A phase of a batched step, timed into every sequence's stats."""
    with contextlib.ExitStack() as stack:
        for s in seqs:
            stack.enter_context(s.stats.phase(name))
        yield
