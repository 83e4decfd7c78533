"""Sampling at temperature > 0 without changing the target's distribution: the maths of the
acceptance rules (``mlx_mtp.decoding.acceptance``). Speculative sampling: the drafter samples
d_j ~ q_j (``DraftSampler``); the target verifies the block jointly (``rejection_sample``, block
verification, Sun et al. 2024), keeping the longest prefix that passes and emitting a draw from
its residual, or the bonus from p after a full accept: lossless like token-by-token verification
(Leviathan et al. 2023; Chen et al. 2023), never fewer drafts kept on average.

p is what mlx-lm's own sampler draws from (``Sampler``): the logits after the user's logits
processors (fed the history including the in-block drafted prefix, ``process_rows``), then
top-p, min-p, top-k, then temperature, in ``mlx_lm.sample_utils.make_sampler``'s order.

Cost: on a CPU a pass over the vocabulary with a transcendental (exp, log, random bits) is dear
next to the rest of a small round, so these pieces make one exp pass per row and draw by inverse
CDF (``draw_rows``: one uniform and one running sum per row), not Gumbel-max per column.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, greedy_sampler
from mlx_lm.sample_utils import make_sampler as mlx_make_sampler

from mlx_mtp.errors import MTPError



class Sampler:
    """mlx-lm's ``make_sampler(temp, top_p, min_p, min_tokens_to_keep, top_k)`` that can also say
    which distribution it samples from. Calling it *is* calling mlx-lm's sampler, so it works
    wherever one does (``mlx_lm.generate``, ``--no-mtp``)."""

    def __init__(self, temp: float = 0.0, top_p: float = 0.0, min_p: float = 0.0,
                 min_tokens_to_keep: int = 1, top_k: int = 0):
        if not temp >= 0:
            raise MTPError(f"temp must be >= 0, got {temp}")
        if not 0 <= top_p <= 1:
            raise MTPError(f"top_p must be between 0 and 1, got {top_p}")
        if not 0 <= min_p <= 1:
            raise MTPError(f"min_p must be between 0 and 1, got {min_p}")
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
            raise MTPError(f"top_k must be a non-negative integer, got {top_k!r}")
        if (not isinstance(min_tokens_to_keep, int) or isinstance(min_tokens_to_keep, bool)
                or min_tokens_to_keep < 1):
            raise MTPError("min_tokens_to_keep must be a positive integer, "
                           f"got {min_tokens_to_keep!r}")
        self.temp, self.top_p, self.min_p = float(temp), float(top_p), float(min_p)
        self.min_tokens_to_keep, self.top_k = min_tokens_to_keep, top_k
        self._mlx_sampler = mlx_make_sampler(temp=temp, top_p=top_p, min_p=min_p,
                                             min_tokens_to_keep=min_tokens_to_keep, top_k=top_k)
        # The same filters, in the same order and under the same conditions, as make_sampler.
        self._filters: List[Callable[[mx.array], mx.array]] = []
        if 0 < top_p < 1.0:
            self._filters.append(lambda x: apply_top_p(x, top_p))
        if min_p != 0.0:
            self._filters.append(lambda x: apply_min_p(x, min_p, min_tokens_to_keep))
        if top_k > 0:
            self._filters.append(lambda x: apply_top_k(x, top_k))
        # The per-round pieces as compiled graphs: at one row of a small vocabulary they are
        # bound by per-op overhead. Shared by samplers with the same settings (constants in the
        # graph), so a new sampler per request does not trace again.
        self._probs, self._pick = _compiled_pieces(self)

    @property
    def is_argmax(self) -> bool:
        return self.temp == 0

    def __call__(self, logprobs: mx.array) -> mx.array:
        return self._mlx_sampler(logprobs)

    def check_vocab(self, vocab_size: int) -> None:
        if self.top_k >= vocab_size and not self.is_argmax:
            raise MTPError(f"top_k (--top-k) must be below the vocabulary size {vocab_size}, "
                           f"got {self.top_k}")

    def logits(self, logprobs: mx.array) -> mx.array:
        """The logits mlx-lm's ``categorical_sampling`` draws from (filtered, then / temp)."""
        for f in self._filters:
            logprobs = f(logprobs)
        return logprobs * (1.0 / self.temp)

    def shifted_logits(self, logits: mx.array) -> mx.array:
        """``logits`` up to a per-row shift (all an argmax or a softmax sees): ``logits`` of raw
        (processed) logits, normalized first only when a filter reads probabilities (top-p,
        min-p), which saves a pass of exp over the vocabulary otherwise."""
        if self._filters:
            logits = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return self.logits(logits)

    def _eager_probs(self, logits: mx.array) -> mx.array:
        return mx.softmax(self.shifted_logits(logits).astype(mx.float32), axis=-1)

    def probs(self, logits: mx.array) -> mx.array:
        """The sampled distribution of rows of (processed) logits or logprobs, in float32 (exact
        zeros where a filter removed a token): one pass of exp per row."""
        return self._probs(logits)

    def _eager_pick(self, logits: mx.array, key: mx.array):
        key, sub = mx.random.split(key)
        q = self._eager_probs(logits)
        return draw_rows(q, mx.random.uniform(shape=(q.shape[0],), key=sub)), q, key

    def pick(self, logits: mx.array, key: mx.array):
        """One draft draw from raw (processed) logits: ``(column, q row, next key)``, where q is
        ``probs`` of the row and the column is drawn from q itself (``draw_rows`` with a uniform
        from ``split(key)[1]``)."""
        return self._pick(logits, key)

    def sample(self, logprobs: mx.array, key: mx.array) -> mx.array:
        return mx.random.categorical(self.logits(logprobs), key=key)

    def describe(self) -> dict:
        return {"temperature": self.temp, "top_p": self.top_p, "min_p": self.min_p,
                "top_k": self.top_k, "min_tokens_to_keep": self.min_tokens_to_keep}


_PIECES = {}


def _compiled_pieces(sampler: Sampler):
    settings = tuple(sampler.describe().values())
    if settings not in _PIECES:
        _PIECES[settings] = (mx.compile(sampler._eager_probs), mx.compile(sampler._eager_pick))
    return _PIECES[settings]


def make_sampler(temp: float = 0.0, top_p: float = 0.0, min_p: float = 0.0,
                 min_tokens_to_keep: int = 1, top_k: int = 0) -> Sampler:
    """Like ``mlx_lm.sample_utils.make_sampler`` (same arguments, same draws); the MTP loop can
    also read the distribution from it, which lossless speculative sampling needs."""
    return Sampler(temp=temp, top_p=top_p, min_p=min_p, min_tokens_to_keep=min_tokens_to_keep,
                   top_k=top_k)


def is_argmax(sampler) -> bool:
    if isinstance(sampler, Sampler):
        return sampler.is_argmax
    return sampler is None or sampler is greedy_sampler


def accepted_length(accepted: Sequence) -> int:
    """Number of leading accepted drafts."""
    a = 0
    while a < len(accepted) and accepted[a]:
        a += 1
    return a


# --------------------------------------------------------------------------- logits processors


def process_rows(logits: mx.array, history: mx.array, block: mx.array,
                 processors: Sequence, paths: Optional[Sequence[Sequence[int]]] = None
                 ) -> mx.array:
    """Apply mlx-lm logits processors to verify rows: row i follows ``block[: i + 1]``, so it sees
    ``history + block[1 : i + 1]`` where ``history`` already ends with ``block[0]`` (the bonus).
    A draft tree's row i follows its path instead: ``paths[i]``, the block rows from the root."""
    rows = []
    for i in range(logits.shape[0]):
        after = list(range(1, i + 1)) if paths is None else list(paths[i][1:])
        tokens = history if not after else mx.concatenate(
            [history, block[mx.array(after, dtype=mx.uint32)]])
        row = logits[i : i + 1]
        for proc in processors:
            row = proc(tokens, row)
        rows.append(row)
    return mx.concatenate(rows, axis=0)


def append_history(history: Optional[mx.array], ids: mx.array) -> Optional[mx.array]:
    return None if history is None else mx.concatenate([history, ids.astype(history.dtype)])


# ------------------------------------------------------------------------------ random streams


class RandomStreams:
    """Two independent key streams from one seed: one for drafting, one for the target's draws
    (acceptance coins, residual and bonus tokens). One shared stream would correlate a draft with
    the draws that judge it."""

    def __init__(self, seed: int):
        self.seed = seed
        self._draft, self._target = mx.random.split(mx.random.key(seed))

    def draft(self) -> mx.array:
        self._draft, key = mx.random.split(self._draft)
        return key

    def target(self) -> mx.array:
        self._target, key = mx.random.split(self._target)
        return key


# ------------------------------------------------------------------------------------ drafting


def process_draft_row(logits: mx.array, tokens: mx.array, processors: Sequence,
                      ids: Optional[mx.array] = None, vocab_size: int = 0) -> mx.array:
    """A drafter's logits row ``[1, Vd]`` after the user's ``processors`` with history
    ``tokens``. Processors index by target id: a row over a reduced vocabulary (``ids``, its
    column c being target id ``ids[c]``) is lifted to the full ``vocab_size`` with -inf
    elsewhere, processed, and taken back to its columns."""
    full = mx.array(logits)  # mlx-lm's processors assign into their input: keep the caller's
    if ids is not None:
        full = mx.full((1, vocab_size), -mx.inf, dtype=logits.dtype)
        full[:, ids] = logits
    for proc in processors:
        full = proc(tokens, full)
    return full if ids is None else full[:, ids]


class DraftSampler:
    """Handed to a drafter's ``draft_sampled``: turns one draft step's logits into a sampled id and
    records the distribution q it was drawn from (after the user's processing, so q sits close
    to p). Draft j's processors see the history through the bonus plus drafts 1..j-1.

    A drafter whose LM head covers only a subset of the vocabulary passes ``ids`` (its id table:
    column c of its logits is target id ``ids[c]``, the same table at every step); q then lives
    on that subset and the returned ids are target ids.
    """

    def __init__(self, sampler: Sampler, key: mx.array, vocab_size: int,
                 processors: Sequence = (), history: Optional[mx.array] = None):
        self.sampler = sampler
        self.key = key
        self.vocab_size = vocab_size
        self.processors = list(processors)
        self.history = history
        self.ids: List[mx.array] = []
        self.q: List[mx.array] = []
        self.q_ids: Optional[mx.array] = None

    def _process(self, logits: mx.array, ids: Optional[mx.array]) -> mx.array:
        if not self.processors:
            return logits
        tokens = self.history if not self.ids else mx.concatenate(
            [self.history, *[d.astype(self.history.dtype) for d in self.ids]])
        return process_draft_row(logits, tokens, self.processors, ids, self.vocab_size)

    def __call__(self, logits: mx.array, ids: Optional[mx.array] = None) -> mx.array:
        """``logits [1, Vd]`` -> the sampled target id ``[1]`` (uint32), on device."""
        col, q, self.key = self.sampler.pick(self._process(logits, ids), self.key)
        tok = (col if ids is None else ids[col]).astype(mx.uint32)
        self.q.append(q)
        self.ids.append(tok)
        self.q_ids = ids
        return tok

    def result(self) -> Tuple[mx.array, mx.array, Optional[mx.array]]:
        """``(drafts [k], q [k, Vd], q_ids [Vd] or None)``."""
        return mx.concatenate(self.ids), mx.concatenate(self.q, axis=0), self.q_ids


# ------------------------------------------------------------------------------- verification


def lift_q(q: mx.array, q_ids: Optional[mx.array], vocab_size: int) -> mx.array:
    """q on the drafter's id subset -> q over the full vocabulary (zero off the subset)."""
    if q_ids is None:
        return q
    return mx.zeros((q.shape[0], vocab_size), dtype=q.dtype).at[:, q_ids].add(q)


def draw_rows(weights: mx.array, u: mx.array) -> mx.array:
    """One id per row of non-negative ``weights [R, V]`` (any scale; each row needs some mass),
    drawn with ``u [R]`` ~ U[0, 1) by inverse CDF: the first column whose running sum exceeds
    ``u * total``. A zero-weight column is never drawn. One running sum per row, where Gumbel-max
    (mlx's ``categorical``) makes random bits and two logs per column. Both are exact up to
    float32 resolution: a column below ~1e-7 of the row's mass can be lost to rounding by either.
    """
    c = mx.cumsum(weights, axis=-1)
    total = c[:, -1:]
    # u * total can round up to the total, which no column exceeds: keep it an ulp or two below
    # (this moves only u above 1 - 2^-23, and only off a last column lighter than 2^-23 of the
    # row: the float32 resolution the docstring allows).
    x = mx.minimum(u[:, None] * total, total * (1.0 - 2.0**-23))
    return (c <= x).sum(axis=-1).astype(mx.uint32)


def prefix_weights(p_d: mx.array, q_d: mx.array) -> mx.array:
    """Block verification's prefix weights ``[k+1]`` for drafts with target and draft
    probabilities ``p_d``, ``q_d [k]``: w_0 = 1, w_i = min(w_{i-1} * p_d[i-1] / q_d[i-1], 1), the
    share of the target's mass the prefix of i drafts carries (a later ratio above 1 makes up for
    an earlier one below, which token-by-token verification throws away)."""
    ratio = mx.where(q_d > 0, p_d / mx.where(q_d > 0, q_d, 1.0), 0.0)
    weights = [mx.ones((), dtype=mx.float32)]
    for i in range(p_d.size):
        weights.append(mx.minimum(weights[-1] * ratio[i], 1.0))
    return mx.stack(weights)


def pass_probabilities(weights: mx.array, residual_mass: mx.array) -> mx.array:
    """``[k]``: the probability that the prefix of i + 1 drafts passes (Sun et al. 2024, block
    verification, Algorithm 2): m_i / (m_i + 1 - w_i) for a prefix i < k, where m_i is the mass
    of the residual max(w_i * p_i - q_i, 0) at row i (``residual_mass [k]``), and w_k for the
    whole block. 1 where the denominator is 0 (w_i = 1 and no residual: p_i == q_i)."""
    k = residual_mass.size
    mass, w = residual_mass[1:], weights[1:k]
    den = mass + 1.0 - w
    return mx.concatenate([mx.where(den > 0, mass / mx.where(den > 0, den, 1.0), 1.0),
                           weights[k:]])


def rejection_sample(p: mx.array, q: mx.array, drafts: mx.array, key: mx.array,
                     q_ids: Optional[mx.array] = None) -> Tuple[mx.array, mx.array]:
    """One chain round of speculative sampling with block verification, all on device.

    ``p [k+1, V]`` the target's float32 distributions at the verify rows, ``q [k, Vq]`` the
    drafter's (``q_ids`` maps its columns to target ids when it covers a subset), ``drafts [k]``
    target ids. Returns ``accepted [k]`` (bool, a prefix: drafts kept) and ``toks [k+1]``:
    ``toks[a]`` is the token to emit after ``a`` kept drafts (a residual draw, or for a = k the
    bonus drawn from ``p[k]``). Pre-sampling every row keeps the round at one host read.
    """
    if drafts.size == 0:
        key_t = mx.random.split(key)[1]
        return mx.zeros((0,), dtype=mx.bool_), draw_rows(p, mx.random.uniform(shape=(1,),
                                                                              key=key_t))
    if q_ids is None:
        return _verify_full(p, q, drafts, key)
    return _verify_subset(p, q, drafts, key, q_ids)


def verdicts(p, q, drafts, coins, u, q_ids=None):
    """The round's decisions from its uniforms: ``coins [k]`` test the prefixes, ``u [k+1]`` draw
    each row's token (``rejection_sample`` makes them from its key)."""
    k = drafts.size
    q = lift_q(q.astype(mx.float32), q_ids, p.shape[-1])
    d = drafts.astype(mx.uint32)[:, None]
    p_d = mx.take_along_axis(p[:k], d, axis=-1)[:, 0]
    q_d = mx.take_along_axis(q, d, axis=-1)[:, 0]
    weights = prefix_weights(p_d, q_d)
    r = mx.maximum(weights[:k, None] * p[:k] - q, 0.0)  # row i: the residual after i drafts
    mass = r.sum(axis=-1)
    passed = coins < pass_probabilities(weights, mass)
    kept = mx.max(mx.where(passed, mx.arange(1, k + 1), 0))  # the longest passing prefix
    # A residual without mass (q covers w * p: only rounding can pick it) draws from p instead.
    rows = mx.concatenate([mx.where(mass[:, None] > 0, r, p[:k]), p[k:]], axis=0)
    return mx.arange(k) < kept, draw_rows(rows, u)


def _verify_rows(p, q, drafts, key, q_ids):
    key_u, key_t = mx.random.split(key)
    k = drafts.size
    return verdicts(p, q, drafts, mx.random.uniform(shape=(k,), key=key_u),
                    mx.random.uniform(shape=(k + 1,), key=key_t), q_ids)


# One compiled graph per round (traced once per block width and vocabulary): the coins, the
# residual rows and the k + 1 draws are ~30 small ops that cost more in dispatch than in math.
_verify_full = mx.compile(lambda p, q, drafts, key: _verify_rows(p, q, drafts, key, None))
_verify_subset = mx.compile(_verify_rows)
