"""The acceptance rules: how a round drafts, how the target draws at every verify row, and how
many drafts the walk keeps. One rule object per generation, chosen when it opens
(``choose_rule``); the round steps call its methods and never ask which rule it is.

  greedy                temperature 0: drafts kept while they equal the target's argmax.
  point-mass            the drafter's argmax drafts, kept while they equal the target's own
                        sample; under ``auto`` the samples are keyed by output position.
  speculative-sampling  drafts sampled from q, the block verified jointly (block verification).
  gumbel-coupled        ``auto`` only: drafts and target draws share each position's noise G_n.

The maths is in ``sampling`` (speculative sampling, the sampler) and ``keyed_sampling`` (keys
and Gumbel noise per output position).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

from mlx_mtp.decoding import keyed_sampling, sampling
from mlx_mtp.decoding.draft_processing import DraftProcessors, drafter_problem
from mlx_mtp.decoding.keyed_sampling import PositionKeys
from mlx_mtp.decoding.request import Request
from mlx_mtp.decoding.sampling import RandomStreams, Sampler, is_argmax
from mlx_mtp.errors import MTPError
from mlx_mtp.draft_tree import DraftTree

GREEDY = "greedy"
POINT_MASS = "point-mass"
SPECULATIVE = "speculative-sampling"
COUPLED = "gumbel-coupled"
REQUESTABLE_RULES = ("auto", POINT_MASS, SPECULATIVE)


@dataclass
class Draft:
    """A round's drafts on the device, and what the acceptance rule needs of them."""

    ids: Optional[mx.array] = None  # [k] uint32; None without drafts
    probs: Optional[mx.array] = None  # speculative sampling: the drafter's q rows
    prob_ids: Optional[mx.array] = None  # the target ids of q's columns (a draft vocabulary)
    noise: tuple = ()  # coupled drafts' G_n, reused by the target's draws at those positions
    tree: Optional[DraftTree] = None  # a draft tree: ``ids`` are its nodes, breadth first


class AcceptanceRule:
    """What every rule gives the round steps. ``sampler`` and ``processors`` are the user's
    (mlx-lm's meaning); the logits processors are applied to the verify rows by the steps, and
    to the drafts through ``drafting`` (``draft_processing.DraftProcessors``), which ``draft``
    and a tree's drafting hand the history."""

    name: str  # stats.acceptance_rule, ``--json``, the server's ``mtp.acceptance_rule``
    samples = True  # draws at temperature > 0: the promise is the distribution, not the bytes
    keyed = False  # the target's draws are keyed by output position (``keyed_sampling``)
    # the drafts are ``Drafter.draft``'s: a family's ``draft_batch`` drafts several sequences'
    drafts_argmax = False

    def __init__(self, sampler, processors: Sequence):
        self.sampler = sampler
        self.processors = list(processors)
        self.drafting = DraftProcessors(self.processors)

    def draft(self, drafter, k: int, history: Optional[mx.array], position: int,
              vocab_size: int) -> Draft:
        """The round's ``k`` drafts after the bonus at output position ``position - 1``;
        ``history`` is every token so far (None without logits processors)."""
        raise NotImplementedError

    def draw_targets(self, logits: mx.array, logprobs: mx.array, proposal: Draft,
                     block: mx.array, position: int) -> Tuple[mx.array, List[mx.array]]:
        """The target's draw at every row of a verified ``block`` (row i at output position
        ``position + i``) from its processed ``logits`` and ``logprobs [w, V]``, and what else
        the walk reads (after the target's draws and the drafts)."""
        raise NotImplementedError

    def accepted(self, picks: list, drafted: list, verdicts: list) -> int:
        """How many drafts the walk keeps, from the host read: the target's ``picks`` at every
        row, the ``drafted`` ids and the rule's ``verdicts``."""
        raise NotImplementedError

    def draw_token(self, logits: mx.array, logprobs: mx.array, position: int) -> mx.array:
        """The token at output position ``position`` from one processed row (the first token,
        a one-token step): ``[1]``."""
        raise NotImplementedError


class PointMass(AcceptanceRule):
    """The drafter's argmax drafts (``Drafter.draft``; with logits processors the argmax of the
    processed logits, through ``draft_sampled``); the target draws each row with the user's
    sampler; a draft is kept while it equals the target's draw at its row (speculative sampling
    for a one-hot q). The draws of a draft tree's rows are made the same way, and its walk keeps
    a child equal to its parent's draw (``draft_tree.accepted_path``)."""

    name = POINT_MASS
    drafts_argmax = True

    def draft(self, drafter, k, history, position, vocab_size):
        pick = self.drafting.argmax(history, vocab_size)
        if pick is None:
            return Draft(ids=drafter.draft(k))
        drafter.draft_sampled(k, pick)
        return Draft(ids=pick.drafts())

    def draw_targets(self, logits, logprobs, proposal, block, position):
        return self.sampler(logprobs), []

    def accepted(self, picks, drafted, verdicts):
        return sampling.accepted_length([d == t for d, t in zip(drafted, picks)])

    def draw_token(self, logits, logprobs, position):
        return self.sampler(logprobs)


class Greedy(PointMass):
    """Temperature 0: the point-mass rule with an argmax sampler. A draft is kept while it equals
    the target's argmax; the output is byte for byte mlx-lm's greedy decode (the exactness gate
    probes the verify)."""

    name = GREEDY
    samples = False


class KeyedPointMass(PointMass):
    """The point-mass rule under ``auto``: the target's draw at output position n is keyed by
    (seed, n) (``keyed_sampling.draw``), so sampled output does not depend on the widths."""

    keyed = True

    def __init__(self, sampler, processors: Sequence, keys: PositionKeys):
        super().__init__(sampler, processors)
        self.keys = keys

    def draw_targets(self, logits, logprobs, proposal, block, position):
        return keyed_sampling.draw(self.sampler, logprobs, self.keys, position, logits=logits,
                                   noise=proposal.noise), []

    def draw_token(self, logits, logprobs, position):
        return keyed_sampling.draw(self.sampler, logprobs, self.keys, position, logits=logits)


class GumbelCoupled(KeyedPointMass):
    """Under ``auto`` with a drafter that samples: draft n is argmax(q-logits + G_n) with the
    target's noise G_n of its position, so it is kept exactly when the two Gumbel-max draws agree
    (``keyed_sampling.CoupledDraftSampler``)."""

    name = COUPLED
    drafts_argmax = False

    def draft(self, drafter, k, history, position, vocab_size):
        sampler = keyed_sampling.CoupledDraftSampler(self.sampler, self.keys, position,
                                                     vocab_size, self.drafting.for_sampler(),
                                                     history)
        drafter.draft_sampled(k, sampler)
        return Draft(ids=sampler.drafts(), noise=sampler.noise)


class SpeculativeSampling(AcceptanceRule):
    """Drafts sampled from q (``sampling.DraftSampler``), the block verified jointly
    (``sampling.rejection_sample``): the walk reads its verdicts, and the target's draw after
    ``a`` kept drafts is the residual draw (or the bonus). Two key streams from one seed
    (``sampling.RandomStreams``): one for the drafts, one for the target's draws."""

    name = SPECULATIVE

    def __init__(self, sampler: Sampler, processors: Sequence, streams: RandomStreams):
        super().__init__(sampler, processors)
        self.streams = streams

    def draft(self, drafter, k, history, position, vocab_size):
        sampler = sampling.DraftSampler(self.sampler, self.streams.draft(), vocab_size,
                                        self.drafting.for_sampler(), history)
        drafter.draft_sampled(k, sampler)
        ids, probs, prob_ids = sampler.result()
        return Draft(ids=ids, probs=probs, prob_ids=prob_ids)

    def draw_targets(self, logits, logprobs, proposal, block, position):
        # p from the logits: the logprobs stay lazy (computed if read)
        verdicts, target_ids = sampling.rejection_sample(
            self.sampler.probs(logits), proposal.probs, block[1:], self.streams.target(),
            proposal.prob_ids)
        return target_ids, [verdicts.astype(mx.uint32)]

    def accepted(self, picks, drafted, verdicts):
        return sampling.accepted_length(verdicts)

    def draw_token(self, logits, logprobs, position):
        return self.sampler.sample(logprobs, self.streams.target())


def rule_name(sampler, drafter, requested: str = "auto", *, auto: bool = False,
              tree: bool = False) -> str:
    """Which acceptance rule a run uses. ``requested`` is ``auto``, ``point-mass`` or
    ``speculative-sampling``; ``auto``: the block size is ``auto``, whose widths follow timings
    (speculative sampling's draws would depend on them: ``gumbel-coupled`` instead); ``tree``:
    draft trees, walked by the point-mass rule over siblings."""
    if requested not in REQUESTABLE_RULES:
        raise MTPError(f"acceptance must be one of {', '.join(REQUESTABLE_RULES)}, "
                       f"got {requested!r}")
    if is_argmax(sampler):
        if requested == SPECULATIVE:
            raise MTPError("acceptance speculative-sampling needs a temperature above 0")
        return GREEDY
    if requested == POINT_MASS:
        return POINT_MASS
    knows_p = isinstance(sampler, Sampler)
    drafts_q = drafter is not None and callable(getattr(drafter, "draft_sampled", None))
    if requested == SPECULATIVE:
        if not knows_p:
            raise MTPError("acceptance speculative-sampling needs a sampler from "
                           "mlx_mtp.make_sampler: a plain sampler function does not say which "
                           "distribution it samples from")
        if not drafts_q:
            raise MTPError(f"acceptance speculative-sampling needs a drafter with draft_sampled; "
                           f"{type(drafter).__name__} only drafts greedily")
    if not (knows_p and drafts_q):
        return POINT_MASS
    if auto:
        if requested == SPECULATIVE:
            raise MTPError(
                "acceptance speculative-sampling cannot be reproduced with block size auto (its "
                "draws depend on the drafts per round, which auto picks from timings): use a "
                "fixed block size, or acceptance auto (gumbel-coupled) or point-mass")
        return COUPLED
    if tree:
        # A tree's siblings are the head's top-k, not draws from q: each node's target draw is
        # kept when it equals one of them (the point-mass rule, over siblings).
        if requested == SPECULATIVE:
            raise MTPError("acceptance speculative-sampling drafts chains: a draft tree "
                           "(draft_topk above 1) is walked by the point-mass rule")
        return POINT_MASS
    return SPECULATIVE


def choose_rule(request: Request, drafter, vocab_size: int) -> AcceptanceRule:
    """The request's acceptance rule (``rule_name``) with its sampler, logits processors and the
    randomness it needs: key streams for speculative sampling, keys per output position for a
    sampling rule under ``auto`` (the seed drawn from mlx's global random state when the request
    has none). Its drafts apply the logits processors where the drafter can take processed
    picks (``draft_processing.drafter_problem``)."""
    rule = _rule(request, drafter, vocab_size)
    if drafter is not None and rule.processors:
        rule.drafting = DraftProcessors(rule.processors,
                                        drafter_problem(drafter, request.tree is not None))
    return rule


def _rule(request: "Request", drafter, vocab_size: int) -> AcceptanceRule:
    auto = request.chooser is not None
    name = rule_name(request.sampler, drafter, request.acceptance, auto=auto,
                     tree=request.tree is not None)
    if isinstance(request.sampler, Sampler):
        request.sampler.check_vocab(vocab_size)
    sampler = request.sampler or greedy_sampler  # argmax over the last axis
    processors = list(request.logits_processors or [])
    if name == GREEDY:
        return Greedy(sampler, processors)
    if name == SPECULATIVE:
        return SpeculativeSampling(sampler, processors, RandomStreams(_seed(request.seed)))
    if not auto:
        return PointMass(sampler, processors)
    rule = GumbelCoupled if name == COUPLED else KeyedPointMass
    return rule(sampler, processors, PositionKeys(_seed(request.seed)))


def _seed(seed: Optional[int]) -> int:
    return mx.random.randint(0, 2**31 - 1).item() if seed is None else seed
