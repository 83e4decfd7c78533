"""The protocol every drafter implements for the shared round loop (``mlx_mtp.speculative``).

State convention (B = 1): after ``prefill`` / ``accept`` the drafter has consumed one pair per
committed position, i.e. (hidden of the target at position p, token at position p + 1). The last
pair's token is the bonus: sampled but not yet fed to the target. ``draft(k)`` proposes the k
tokens that follow the bonus, as a device array, without reading anything back to the host.

Optional, for lossless sampling at temperature > 0 (``mlx_mtp.sampling``): a drafter that can
sample implements ``draft_sampled`` too (``SamplingDrafter``). One that cannot is still exact at
any temperature: the loop then uses the point-mass rule with its greedy drafts.
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx


class Drafter(Protocol):
    def reset(self) -> None:
        """Forget everything: a new generation starts."""

    def prefill(self, hidden: mx.array, next_ids: mx.array) -> None:
        """Consume pairs (``hidden [1, S, H]`` at positions p, ``next_ids [S]`` at p + 1)."""

    def draft(self, k: int) -> mx.array:
        """Propose ``k >= 1`` ids ``[k]`` after the bonus; no host sync."""

    def accept(self, hidden: mx.array, next_ids: mx.array) -> None:
        """After a verify: undo this round's drafting state, then consume the ``a + 1`` verified
        pairs (the target's true hidden states and the emitted tokens)."""

    def state_arrays(self) -> list:
        """Arrays to evaluate so the drafter's pending work is done (used for timing)."""


class SamplingDrafter(Drafter, Protocol):
    def draft_sampled(self, k: int, sample) -> mx.array:
        """Like ``draft``, but draw each of the ``k`` ids with ``sample(logits [1, Vd], ids=None)``
        (a ``mlx_mtp.sampling.DraftSampler``: it applies the user's processing, samples on the
        drafting stream and records q). ``ids`` is the drafter's id table when its LM head covers
        only part of the vocabulary. Returns the sampled ids ``[k]``; no host sync."""
