"""The two interfaces the shared round loop (``mlx_mtp.decoding.rounds``) runs on: a ``Target``,
one per family over mlx-lm's own model, and a ``Drafter`` (``SamplingDrafter`` where it can sample
its drafts; ``DrafterDefaults`` for the methods most drafters leave as they are). Shapes are for
batch 1: ids ``[1, T]``, hidden states ``[1, T, H]``, logits ``[T, V]``. docs/architecture.md,
"The protocols", gives each method's contract and the drafter's state convention."""

from __future__ import annotations

from typing import Any, List, Optional, Protocol

import mlx.core as mx


class Target(Protocol):
    family: str  # "qwen3_5" or "gemma4": what a saved prompt cache and kv_bits check against
    vocab_size: int
    hidden_size: int
    dtype: Any

    def prepare(self, max_width: int, exact: bool = True) -> None:
        """Before verifying blocks of up to ``max_width`` tokens (row-exact set-up);
        ``exact=False`` (gate overridden): verify without exactness-only fallbacks."""

    def make_cache(self) -> List[Any]:
        """A fresh cache, one entry per cached layer, that ``rollback`` can undo."""

    def hidden(self, ids: mx.array, cache: List[Any], input_embeddings=None) -> mx.array:
        """Post-norm hidden states ``[1, T, H]`` for ``ids [1, T]`` (or ``input_embeddings``
        in their place); advances the cache by T."""

    def prefill(self, ids: mx.array, cache: List[Any], input_embeddings=None) -> mx.array:
        """``hidden`` of a prompt's tokens, bitwise, by the fastest path the target has."""

    def decode(self, ids: mx.array, cache: List[Any]) -> mx.array:
        """``hidden`` of one token ``ids [1, 1]``, bitwise, by the cheapest path the target has
        (not undoable): plain decode steps and rounds without drafts."""

    def embed(self, ids: mx.array) -> mx.array:
        """The input embedding of ``ids`` as the first layer sees it."""

    def logits(self, hidden: mx.array) -> mx.array:
        """The LM head (and any final softcap) over hidden states."""

    def verify(self, ids: mx.array, cache: List[Any]) -> mx.array:
        """Like ``hidden``, every row bitwise what single-token decode gives, and undoable."""

    def rollback(self, cache: List[Any], fed: int, keep: int) -> None:
        """Keep the first ``keep`` of the ``fed`` tokens of the last verify (graph work only:
        the loop does not evaluate it; the next round does)."""

    def rewind(self, cache: List[Any], kept: int, keep: int) -> None:
        """After ``rollback`` kept ``kept`` tokens of the last verify, keep only its first
        ``keep`` (a caller stopped reading mid-round; ``mlx_mtp.decoding.prompt_cache``)."""

    def cache_state(self, cache: List[Any]) -> List[mx.array]:
        """The arrays that hold the committed state (for eval and bitwise comparisons)."""


class Drafter(Protocol):
    syncs: int  # host reads made while drafting so far (the loop counts them per round)
    profiler: Any  # a ``mlx_mtp.models.draft_profile.DraftProfiler``, or None: cannot be profiled

    def reset(self) -> None:
        """Forget everything: a new generation starts."""

    def bind_cache(self, cache: List[Any]) -> None:
        """The target's live cache for this generation (a drafter that reads its K/V keeps it)."""

    def prefill(self, hidden: mx.array, next_ids: mx.array) -> None:
        """Consume pairs (``hidden [1, S, H]`` at positions p, ``next_ids [S]`` at p + 1)."""

    def draft(self, k: int) -> mx.array:
        """Propose ``k >= 1`` ids ``[k]`` after the bonus; no host sync."""

    def accept(self, hidden: mx.array, next_ids: mx.array) -> None:
        """After a verify: undo this round's drafting state, then consume the ``a + 1`` verified
        pairs (the target's true hidden states and the emitted tokens)."""

    def state_arrays(self) -> list:
        """Arrays to evaluate so the drafter's pending work is done (used for timing)."""

    def describe(self) -> Optional[dict]:
        """What this drafter runs with (for ``--json`` and benchmark records), or None."""

    # Prompt caches across turns (``mlx_mtp.decoding.prompt_cache``):
    def carry(self) -> Optional[list]:
        """What a prompt cache keeps of this drafter between turns (None: nothing; it starts
        afresh at the next turn)."""

    def resume(self, carried: list) -> None:
        """Start a turn from what ``carry`` returned after the previous one."""

    def rewind(self, n: int) -> None:
        """Forget the last ``n`` pairs consumed (verified rows the caller never read)."""


class SamplingDrafter(Drafter, Protocol):
    def draft_sampled(self, k: int, sample) -> mx.array:
        """Like ``draft``, but pick each of the ``k`` ids with ``sample(logits [1, Vd], ids=None)``
        from the step's logits row (a ``mlx_mtp.decoding.sampling.DraftSampler``: it applies the
        user's processing, samples on the drafting stream and records q; or a
        ``mlx_mtp.decoding.draft_processing.DraftArgmax``: the argmax after the logits
        processors). ``ids`` is the drafter's id table when its LM head covers only part of the
        vocabulary. Returns the picked ids ``[k]``; no host sync."""


class DrafterDefaults:
    """What most drafters leave as is: no cache to bind, no host syncs, not profiled, nothing to
    describe, nothing carried across turns. A drafter subclasses this and implements the rest of
    ``Drafter``."""

    syncs = 0
    profiler = None

    def bind_cache(self, cache: List[Any]) -> None:
        pass

    def describe(self) -> Optional[dict]:
        return None

    def carry(self) -> Optional[list]:
        return None

    def resume(self, carried: list) -> None:
        self.reset()

    def rewind(self, n: int) -> None:
        pass
