"""``block_size="auto"``: ``BlockChooser`` chooses each round's number of drafts k from what the
session measured, the k that maximises E(k) / c(k + 1): the tokens a round of k drafts emits on
average (from each draft's acceptance) over the wall time of a round k + 1 tokens wide.
docs/block-size.md says how acceptance and cost are estimated, how it explores, what each
``ChooserSettings`` field does, and how the defaults were chosen (``tools/simulate_chooser.py``)."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, Iterable, List, Optional, Sequence, Tuple

from mlx_mtp.errors import MTPError

AUTO = "auto"
PROBE_FIRST = 4  # rounds without drafts before the first probe
# How fast the exploration bonus of a deep draft fades with its judgments: a slower fade keeps
# the block wide where deep drafts are rarely kept, a faster one lets an early rejection narrow
# it for good (chosen by simulation; see docs/block-size.md)
BONUS_POWER = 0.75


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j: tokens a round of ``k`` drafts emits on average."""
    total, run = 1.0, 1.0
    for a in acceptance[:k]:
        run *= a
        total += run
    return total


def _shrunk(hits: Sequence[float], tests: Sequence[float], towards: Sequence[float],
            weight: float) -> List[float]:
    """Per position: a table's counts shrunk towards ``towards`` worth ``weight`` rounds."""
    return [(h + weight * a) / (t + weight) for h, t, a in zip(hits, tests, towards)]


def measured_rate(rounds: Iterable[Tuple[int, float]]) -> Optional[float]:
    """Tokens per second of recent rounds ``(tokens, seconds)``: their mean tokens over their
    median time (None: no rounds). A round emits anywhere from one token to its whole block, so
    a median of per-round rates would let a few rounds decide; a median time keeps the first
    rounds of a new shape, which compile graphs, from deciding. The shape and batch choosers'
    estimate."""
    rounds = list(rounds)
    if not rounds:
        return None
    return statistics.fmean(t for t, _ in rounds) / statistics.median(s for _, s in rounds)


def best_drafts(acceptance: Sequence[float], costs: Sequence[Optional[float]],
                least: int = 0) -> int:
    """The k in least..min(len(acceptance), len(costs) - 1) maximising E(k) / costs[k];
    ``costs[k]`` is the cost of a round of width k + 1 (None: not a candidate). Ties go to the
    fewer drafts; 0 when no k from ``least`` on is a candidate. Pure."""
    if not costs or costs[0] is None:
        raise ValueError("costs must hold at least the cost of width 1")
    best, best_rate = 0, None
    for k in range(least, min(len(acceptance), len(costs) - 1) + 1):
        if costs[k] is None:
            continue
        rate = expected_tokens(acceptance, k) / costs[k]
        if best_rate is None or rate > best_rate:
            best, best_rate = k, rate
    return best


class RoundCosts:
    """Round times per verify width, shared by the choosers of a session's generations (pass
    one as ``BlockChooser(..., round_costs=)``): the last ``window`` samples of each width, whatever
    generation timed them. Use one per model, device and decoding setup (sampling, KV
    quantization): the times are theirs."""

    def __init__(self, window: int = 32):
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise MTPError(f"RoundCosts needs a window >= 1, got {window!r}")
        self.window = window
        self.samples: Dict[int, Deque[float]] = {}
        self.rounds = 0  # rounds its choosers observed, all generations
        self.measured_at: Dict[int, int] = {}  # width -> ``rounds`` at its latest sample

    def of(self, width: int) -> Deque[float]:
        """The samples of ``width`` (the deque choosers append to)."""
        return self.samples.setdefault(width, deque(maxlen=self.window))


@dataclass(frozen=True)
class ChooserSettings:
    """``BlockChooser``'s tuning (docs/block-size.md, "Settings", says how each takes part),
    checked on creation."""

    prior: float = 0.7  # prior acceptance of draft 1
    prior_weight: float = 3.0  # rounds the prior is worth
    decay: float = 0.98  # how much each drafting round fades the counts
    optimism: float = 0.4  # scale of the exploration bonus for drafts 2 and deeper
    pooling: float = 2.0  # samples the neighbours' line is worth in a width's cost
    cost_window: int = 5  # round times per width whose median is its cost
    stale_rounds: int = 64  # age in rounds after which width 1 and neighbours are re-measured
    probe_every: int = 32  # the longest stretch without drafts between probes
    context_weight: Optional[float] = 2.0  # rounds a context's table is shrunk with (None: off)
    min_evidence: int = 3  # drafting rounds timed before a choice of no drafts is accepted
    explore_reach: int = 2  # the most drafts the bonus can add beyond the measured choice
    token_weight: Optional[float] = 1.0  # rounds a key's table is shrunk with (None: off)
    token_context: int = 2  # ids that form a key

    def __post_init__(self):
        if not 0.0 <= self.prior <= 1.0 or self.prior_weight <= 0 or not 0.0 < self.decay <= 1.0:
            raise MTPError("BlockChooser needs 0 <= prior <= 1, prior_weight > 0, 0 < decay <= 1")
        if self.optimism < 0 or self.pooling < 0:
            raise MTPError("BlockChooser needs optimism >= 0, pooling >= 0")
        if self.cost_window < 1 or self.stale_rounds < 1 or self.probe_every < 1:
            raise MTPError("BlockChooser needs cost_window, stale_rounds, probe_every >= 1")
        if self.context_weight is not None and not self.context_weight > 0:
            raise MTPError(f"BlockChooser needs context_weight > 0 or None, got "
                           f"{self.context_weight!r}")
        if self.token_weight is not None and not self.token_weight > 0:
            raise MTPError(f"BlockChooser needs token_weight > 0 or None, got "
                           f"{self.token_weight!r}")
        if not _whole(self.token_context) or self.token_context < 1:
            raise MTPError(f"BlockChooser needs an integer token_context >= 1, got "
                           f"{self.token_context!r}")
        if self.min_evidence < 0:
            raise MTPError(f"BlockChooser needs min_evidence >= 0, got {self.min_evidence!r}")
        if not _whole(self.explore_reach) or self.explore_reach < 0:
            raise MTPError(f"BlockChooser needs an integer explore_reach >= 0, got "
                           f"{self.explore_reach!r}")


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class BlockChooser:
    """Chooses the drafts of each round (``choose``) and learns from its outcome
    (``record_round``).

    Pass one as ``block_size`` to ``generate_step`` to tune it (``settings``); ``"auto"`` makes
    a default one with ``max_drafts = max_block_size - 1``. ``round_costs``: round times shared
    with earlier generations (``RoundCosts``).
    """

    def __init__(self, max_drafts: int, *, settings: ChooserSettings = ChooserSettings(),
                 round_costs: Optional[RoundCosts] = None):
        if not _whole(max_drafts) or max_drafts < 0:
            raise MTPError(f"max_drafts must be a non-negative integer, got {max_drafts!r}")
        if not isinstance(settings, ChooserSettings):
            raise MTPError(f"BlockChooser needs settings to be a ChooserSettings, got "
                           f"{settings!r}")
        self.settings = settings
        self.max_drafts = max_drafts
        self.hits = [0.0] * max_drafts  # decayed: rounds that kept draft j + 1
        self.tests = [0.0] * max_drafts  # decayed: rounds that judged draft j + 1
        self.judged = [0] * max_drafts  # not decayed: rounds that judged draft j + 1 (the bonus)
        self.context: Optional[int] = None  # drafts the last round kept (None: it drafted none)
        self.context_hits: Dict[int, List[float]] = {}  # per context: as hits, its rounds only
        self.context_tests: Dict[int, List[float]] = {}  # per context: as tests, its rounds only
        # the last ids the run emitted
        self.recent: Deque[int] = deque(maxlen=settings.token_context)
        self.key: Optional[Tuple[int, ...]] = None  # the ids the round being chosen starts from
        self.token_hits: Dict[Tuple[int, ...], List[float]] = {}  # per key: as context_hits
        self.token_tests: Dict[Tuple[int, ...], List[float]] = {}  # per key: as context_tests
        if round_costs is not None and not isinstance(round_costs, RoundCosts):
            raise MTPError(f"BlockChooser needs round_costs to be a RoundCosts or None, got "
                           f"{round_costs!r}")
        # per width: its samples (``round_costs``'s, which earlier generations filled, if given)
        self.samples: Dict[int, Deque[float]] = {
            w: deque(maxlen=settings.cost_window) if round_costs is None else round_costs.of(w)
            for w in range(1, max_drafts + 2)}
        self.median: Dict[int, float] = {w: statistics.median(d)  # kept current
                                         for w, d in self.samples.items() if d}
        self.round_costs = round_costs
        # width -> round of its latest sample; an earlier generation's as many rounds before this
        # one's first as were observed since (so a width's measurement ages across generations)
        self.measured_at: Dict[int, int] = (
            {} if round_costs is None else
            {w: at - round_costs.rounds for w, at in round_costs.measured_at.items()})
        self.round = 0  # rounds observed
        self.undrafted = 0  # consecutive rounds without drafts
        self.probe_gap = min(PROBE_FIRST, settings.probe_every)  # undrafted rounds before a probe
        self._probing = False  # the last choice was a probe
        self._probed = False  # the last round observed was a probe
        self._stretch = 1  # rounds without drafts the last choice commits to (undrafted_stretch)

    @property
    def max_block_size(self) -> int:
        return self.max_drafts + 1

    # ------------------------------------------------------------------ estimates

    def acceptance(self) -> List[float]:
        """Conditional acceptance estimates a_1..a_K."""
        out, prior = [], self.settings.prior
        for h, t in zip(self.hits, self.tests):
            prior = (h + self.settings.prior_weight * prior) / (t + self.settings.prior_weight)
            out.append(prior)
        return out

    def context_acceptance(self, pooled: Optional[List[float]] = None) -> List[float]:
        """The estimates in the current context: the table of the drafts the last round kept
        shrunk towards ``acceptance()`` (``pooled``, if the caller has it) with
        ``context_weight`` rounds, then the table of the ids the round starts from (``key``)
        shrunk towards that with ``token_weight`` rounds. A layer whose table has no counts
        yet (the last round drafted none, a key not met before) or that is off is skipped."""
        out = self.acceptance() if pooled is None else pooled
        if self.settings.context_weight is not None and self.context in self.context_tests:
            out = _shrunk(self.context_hits[self.context], self.context_tests[self.context],
                          out, self.settings.context_weight)
        if self.key in self.token_tests:  # (key is None while the tokens are off)
            out = _shrunk(self.token_hits[self.key], self.token_tests[self.key], out,
                          self.settings.token_weight)
        return out

    def optimistic_acceptance(self) -> List[float]:
        """What the choice uses: a_1, then a_j + optimism / (n_j + 1) ** BONUS_POWER, at most 1
        (a_j in the current context, n_j the rounds that judged draft j, all contexts, not
        decayed)."""
        return self._with_bonus(self.context_acceptance())

    def _with_bonus(self, a: List[float]) -> List[float]:
        return a[:1] + [min(1.0, x + self.settings.optimism / (n + 1.0) ** BONUS_POWER)
                        for x, n in zip(a[1:], self.judged[1:])]

    def _fresh(self, w: int) -> bool:
        at = self.measured_at.get(w)
        return at is not None and self.round - at < self.settings.stale_rounds

    def pooled(self) -> Dict[int, float]:
        """Per measured width: its median, or, where cheaper, that median pooled with the line
        through the medians of the measured drafting widths on either side (for the widest
        measured width: the two below it, the line never below the nearer one's median), the
        line worth ``pooling`` samples. Only ever lower: a width that one slow round made look
        dear gets tried again, while one that looks cheap is chosen and so measured (an error
        that way corrects itself). Width 1 is no point on the line: its round is the plain
        one-token step, without drafts or accept hook, and can cost more than a width-2 round
        (a cold first round, say), which would tilt the line down and make wide rounds look
        cheaper than they are."""
        widths = sorted(w for w in self.median if w > 1)
        out = dict(self.median)
        for i, w in enumerate(widths):
            if 0 < i < len(widths) - 1:
                lo, hi = widths[i - 1], widths[i + 1]
            elif i == len(widths) - 1 and i >= 2:
                lo, hi = widths[i - 2], widths[i - 1]
            else:
                continue
            line = self.median[lo] + (self.median[hi] - self.median[lo]) * (w - lo) / (hi - lo)
            if w > hi:  # extrapolated: a wider round does not cost less than a narrower one
                line = max(line, self.median[hi])
            n, pooling = len(self.samples[w]), self.settings.pooling
            out[w] = min(self.median[w], (n * self.median[w] + pooling * line) / (n + pooling))
        return out

    @staticmethod
    def line(w: int, pooled: Dict[int, float]) -> Optional[float]:
        """Cost of unmeasured width ``w`` from the measured ones (``pooled``): between two
        measured widths, the straight line through them; above the widest, the line through the
        two widest, never below the widest's cost; with width 1 alone measured, width 2 at width
        1's cost and wider ones None (no estimate: not a candidate). Pure."""
        below = sorted(v for v in pooled if v < w)
        above = [v for v in pooled if v > w]
        if not below:
            return None
        if above:
            lo, hi = below[-1], min(above)
        elif len(below) >= 2:
            lo, hi = below[-2:]
        else:
            return pooled[below[0]] if w == below[0] + 1 else None
        at_w = pooled[lo] + (pooled[hi] - pooled[lo]) * (w - lo) / (hi - lo)
        return at_w if above else max(pooled[hi], at_w)

    def costs(self, refresh: Sequence[int] = ()) -> List[Optional[float]]:
        """Cost per width 1..K+1 (index w - 1) as the choice uses it: the pooled median of the
        recent samples; for an unmeasured width, the line through the measured ones (``line``);
        for a stale or unmeasured width in ``refresh``, at most the cost of the dearest measured
        narrower width (None: not a candidate)."""
        out: List[Optional[float]] = []
        bound: Optional[float] = None  # the dearest measured narrower width's cost
        pooled = self.pooled()
        for w in range(1, self.max_drafts + 2):
            own = pooled.get(w)
            guess = self.line(w, pooled) if own is None else own
            if guess is not None and bound is not None and w in refresh and not self._fresh(w):
                guess = min(guess, bound)
            out.append(guess)
            if own is not None:
                bound = own if bound is None else max(bound, own)
        return out

    # ------------------------------------------------------------------ the choice

    def choose(self, limit: Optional[int] = None) -> int:
        """Drafts for the next round, at most ``limit`` (the token budget's bound)."""
        limit = self.max_drafts if limit is None else max(0, min(limit, self.max_drafts))
        self._stretch, self._probing = 1, False
        self._set_key()
        if limit == 0 or not self._fresh(1):
            return 0  # width 1 is the baseline every other width is judged against
        costs = self.costs()[: limit + 1]
        # the bonus may widen the block by at most explore_reach drafts beyond what the measured
        # acceptance alone picks (a wide round is dear where the verify and drafting are)
        pooled = self.acceptance()
        measured = self.context_acceptance(pooled)
        reach = self.settings.explore_reach
        limit = min(limit, max(1, best_drafts(measured[:limit], costs) + reach))
        acceptance = self._with_bonus(measured)[:limit]
        costs = costs[: limit + 1]
        k = best_drafts(acceptance, costs)
        neighbours = self._neighbours(k, limit)
        if neighbours:
            costs = self.costs(neighbours)[: limit + 1]
            k = best_drafts(acceptance, costs)
        if k == 0:
            k = self._unless_weak_evidence(acceptance, costs, pooled[0])
        if k == 0:
            return self._undrafted()
        if self._probed:  # the round after a probe brought drafting back
            self._probed = False
            self.probe_gap = min(PROBE_FIRST, self.settings.probe_every)
        return k

    def _set_key(self) -> None:
        """The key this round's judgments count under: the last ``token_context`` ids emitted."""
        full = self.settings.token_weight is not None and len(self.recent) == self.recent.maxlen
        self.key = tuple(self.recent) if full else None

    def batched_round(self) -> None:
        """A round whose drafts a batch's chooser picks (``mlx_mtp.decoding.batch_chooser``) in
        place of ``choose``: sets the key the round's judgments count under, as ``choose``
        does."""
        self._stretch, self._probing = 1, False
        self._set_key()

    def _unless_weak_evidence(self, acceptance: List[float], costs: List[Optional[float]],
                              pooled_first: float) -> int:
        """The arithmetic gave no drafts: keep it only on enough evidence, else the best drafting
        choice. With contexts on, draft 1 is valued at least at the pooled estimate
        (``pooled_first``, ``acceptance()[0]`` as ``choose`` computed it; a context's
        own table, one rejection or an opening's, does not stop drafting); and while the session
        holds fewer than ``min_evidence`` round times of drafting widths, the arithmetic's no
        drafts is overruled (one stalled round does not price drafting out: the median of one
        sample is that sample)."""
        if self.settings.context_weight is not None:
            acceptance = [max(acceptance[0], pooled_first)] + acceptance[1:]
            k = best_drafts(acceptance, costs)
            if k:
                return k
        drafting = sum(len(self.samples[w]) for w in range(2, self.max_drafts + 2))
        if drafting >= self.settings.min_evidence:
            return 0
        return best_drafts(acceptance, costs, least=1)

    def _neighbours(self, k: int, limit: int) -> List[int]:
        """Widths next to the choice (width k + 1) to value optimistically (hill-climbing): a
        stale one on either side, and the unmeasured one just above where a wider width was
        measured (the line between two measured widths can hide a cheap one: a verify that
        turns dear past width 3)."""
        out = []
        for w in (k, k + 2):
            if not 1 < w <= limit + 1 or self._fresh(w):
                continue
            if w in self.median or (w == k + 2 and any(v > w for v in self.median)):
                out.append(w)
        return out

    def _undrafted(self) -> int:
        """The choice is no drafts: a probe if the run without drafts is long enough, else no
        drafts up to the next probe."""
        if self._probed:  # the round after a probe did not bring drafting back: back off
            self._probed = False
            self.probe_gap = min(2 * self.probe_gap, self.settings.probe_every)
        self._probing = self.undrafted >= self.probe_gap
        if self._probing:
            return 1
        self._stretch = self.probe_gap - self.undrafted
        return 0

    def undrafted_stretch(self) -> int:
        """After ``choose`` gave no drafts: the rounds in a row, this one first, that it commits
        to drafting nothing, up to the next probe (1 where the choice only re-measured width 1 or
        met the token budget). The loop runs them as pipelined one-token steps and records each
        at the stretch's mean when it ends."""
        return max(1, self._stretch)

    def see_tokens(self, ids: Sequence[int]) -> None:
        """The ids the run just emitted, in order: the loop passes the prompt's first token and
        every round's (and step's) tokens. The last ``token_context`` of them, when the next
        round is chosen, are its key (``context_acceptance``)."""
        self.recent.extend(int(i) for i in ids)

    def count(self, drafts: int, accepted: int) -> None:
        """Counts a drafting round's judgments (``drafts`` > 0 made, the first ``accepted`` kept;
        those past the first rejection unjudged): every position's counts fade by ``decay``,
        then the round's count, in the pooled table, the undecayed ``judged`` and the tables of
        the context and the key the round was chosen in (those tables alone fade).
        ``record_round`` calls it; ``tools/simulate_chooser.py --judge-all`` overrides it to
        count every draft."""
        judged = range(min(accepted + 1, drafts))
        tables = [(self.hits, self.tests)]
        if self.context is not None and self.settings.context_weight is not None:
            tables.append((self.context_hits.setdefault(self.context, [0.0] * self.max_drafts),
                           self.context_tests.setdefault(self.context, [0.0] * self.max_drafts)))
        if self.key is not None:
            tables.append((self.token_hits.setdefault(self.key, [0.0] * self.max_drafts),
                           self.token_tests.setdefault(self.key, [0.0] * self.max_drafts)))
        for hits, tests in tables:
            hits[:] = [h * self.settings.decay for h in hits]
            tests[:] = [t * self.settings.decay for t in tests]
            for j in judged:
                tests[j] += 1.0
                hits[j] += j < accepted
        for j in judged:
            self.judged[j] += 1

    def record_round(self, drafts: int, accepted: int, wall_s: Optional[float]) -> None:
        """A round of ``drafts`` drafts kept ``accepted`` of them and took ``wall_s`` seconds
        (None: a batched round, whose time is the batch's, not this width's: only the
        judgments count, and the widths' measurements age)."""
        self.round += 1
        if drafts:  # a drafting round: all evidence fades, then its own judgments count
            self.count(drafts, accepted)
        self.context = accepted if drafts else None
        self.undrafted = self.undrafted + 1 if drafts == 0 else 0
        if wall_s is None:
            return
        w = drafts + 1
        self.samples[w].append(wall_s)
        self.median[w] = statistics.median(self.samples[w])
        self.measured_at[w] = self.round
        if self.round_costs is not None:
            self.round_costs.rounds += 1
            self.round_costs.measured_at[w] = self.round_costs.rounds
        if drafts and self._probing:  # the next choice says whether to back off
            self._probed = True
        elif drafts:  # a drafting round the arithmetic chose: start again from the shortest run
            self.probe_gap = min(PROBE_FIRST, self.settings.probe_every)
        self._probing = False

