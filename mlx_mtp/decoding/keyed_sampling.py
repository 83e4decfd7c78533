"""Sampling keyed by output position, so that sampled output does not depend on the drafts.

Under ``block_size="auto"`` the drafts per round follow wall-clock measurements, which differ
run to run; seeded sampled output must not. So there the token at output position n is always
    t_n = argmax(logits_n + G_n),   G_n = Gumbel noise from the key of (seed, n)
(the Gumbel-max form of sampling from softmax(logits_n), ``logits_n`` as
``mlx_mtp.decoding.sampling.Sampler.logits``). A draft is kept while it equals that draw; t_n
depends on the tokens before n and on G_n only, never on how the rounds were cut.

Drafts (``mlx_mtp.decoding.acceptance``): ``point-mass`` takes the drafter's greedy drafts;
``gumbel-coupled`` draws draft n with the same G_n from the drafter's own q_n
(``CoupledDraftSampler``), so a draft is kept exactly when the two Gumbel-max draws agree (always
when q_n == p_n; the "coupling without communication" of Daliri et al. 2024).
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx

from mlx_mtp.decoding import sampling


class PositionKeys:
    """One PRNG key per output position, from one seed: the same (seed, n) gives the same key."""

    def __init__(self, seed: int):
        self.seed = int(seed)
        self._word = (self.seed ^ (self.seed >> 32)) & 0xFFFFFFFF

    def key(self, n: int) -> mx.array:
        return mx.random.split(mx.array([self._word, n & 0xFFFFFFFF], dtype=mx.uint32))[0]

    def noise(self, n: int, vocab_size: int) -> mx.array:
        """G_n ``[1, V]``: the Gumbel noise of position n over the full vocabulary."""
        return mx.random.gumbel(shape=(1, vocab_size), key=self.key(n))


def draw(sampler, logprobs: mx.array, keys: PositionKeys, first: int, *,
         logits: Optional[mx.array] = None, noise: Sequence[mx.array] = ()) -> mx.array:
    """The target's draws for rows ``logprobs [w, V]`` at positions first .. first + w - 1
    (uint32 ``[w]``). ``sampler`` is an ``mlx_mtp.decoding.sampling.Sampler``; a bare sampler
    function (mlx-lm's) is called row by row with mlx's global seed set to each position's key.

    For a ``Sampler``: ``logits``, the same rows before log-normalization, saves the pass of exp
    that normalizing costs where no filter needs it (an argmax does not see a row's shift);
    ``noise`` are G_n rows ``[1, V]`` already made for the first positions (the coupled drafts'),
    reused instead of drawn again from the same keys."""
    w, vocab = logprobs.shape
    if isinstance(sampler, sampling.Sampler):
        rows = list(noise[:w]) + [keys.noise(first + i, vocab) for i in range(len(noise), w)]
        scaled = sampler.shifted_logits(logprobs if logits is None else logits)
        return mx.argmax(scaled + mx.concatenate(rows), axis=-1).astype(mx.uint32)
    rows = []
    for i in range(w):
        mx.random.seed(hash((keys.seed, first + i)) & 0xFFFFFFFFFFFFFFFF)  # no host read
        rows.append(sampler(logprobs[i : i + 1]).astype(mx.uint32).reshape(1))
    return mx.concatenate(rows)


class CoupledDraftSampler(sampling.DraftSampler):
    """A ``DraftSampler`` whose j-th draw (draft j, output position ``first + j - 1``) is
    argmax(q-logits + G_n) with the target's noise G_n for that position."""

    def __init__(self, sampler, keys: PositionKeys, first: int, vocab_size: int,
                 processors: Sequence = (), history: Optional[mx.array] = None):
        super().__init__(sampler, None, vocab_size, processors, history)
        self.keys, self.first = keys, first
        self.noise = []  # G_n of each draft's position, over the full vocabulary (``draw`` reuses)

    def __call__(self, logits: mx.array, ids: Optional[mx.array] = None) -> mx.array:
        noise = self.keys.noise(self.first + len(self.ids), self.vocab_size)
        self.noise.append(noise)
        if ids is not None:  # a reduced draft vocabulary: the noise of the ids it covers
            noise = noise[:, ids]
        col = mx.argmax(self.sampler.shifted_logits(self._process(logits, ids)) + noise, axis=-1)
        tok = (col if ids is None else ids[col]).astype(mx.uint32)
        self.ids.append(tok)
        return tok

    def drafts(self) -> mx.array:
        return mx.concatenate(self.ids)

