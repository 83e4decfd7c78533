"""Prompt caches across turns, with mlx-lm's semantics: the cache holds every token processed (the
prompts and every token yielded), and the caller passes only the new tokens.

A round loop holds state that plain decode does not: the bonus token is yielded before the target
has seen it, a verify may keep drafts the caller never reads (it stopped at an EOS or a stop
string mid-round), and the MTP head pairs the target's hidden state at position p with the token
at p + 1. ``Turn.finish`` (run when a generation ends or is closed) brings the cache to exactly
what mlx-lm's cache would hold after the same yields: it rewinds kept-but-unread rows, or feeds
the last yielded token as the single-token decode step mlx-lm ran for it. The target's hidden
state at the last position stays in the cache (``hidden``) and the next turn pairs it with its
first token, so the head's context continues where the target's does. A caller may also ask
for copies of the cache at points inside the next prompt (``PromptCache.checkpoints``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import mlx.core as mx
from mlx_lm.models import cache as _mlx_cache

from mlx_mtp.errors import MTPError
from mlx_mtp.io.kv_settings import KVSettings, note_max_kv_size
from mlx_mtp.models import families

_META = "mlx_mtp_"  # our keys in a saved cache's metadata (stripped on load)


class PromptCache(list):
    """The target's per-layer caches (this list, in the order and classes the target uses) plus
    the drafter's: ``drafter_state`` (what the drafter carries between turns; None: it starts
    afresh at the next MTP turn) and ``hidden`` (``[1, 1, H]``, the target's hidden state at the
    last processed position, which the next turn pairs with its first token; None when empty or
    unknown, or in a checkpoint, whose drafter has already paired it).

    ``checkpoints``: positions in the next turn's prompt after which its prefill keeps a copy of
    the cache (each ends a prefill chunk); the copies land in ``kept``, by position. A copy at
    position s holds the target's state of the prompt's first s tokens and a drafter that has
    consumed the pair of token s too, so it continues a prompt whose first s + 1 tokens are
    these.

    ``abandoned``: the generation using it failed (set by its caller, such as a server whose
    other ranks are gone): closing the generation then finishes no turn, which may run a forward,
    and the cache holds whatever the failure left."""

    def __init__(self, layers, family: str, drafter_state=None, hidden: Optional[mx.array] = None):
        super().__init__(layers)
        self.family = family
        self.drafter_state = drafter_state
        self.hidden = hidden
        self.checkpoints: Tuple[int, ...] = ()
        self.kept: Dict[int, "PromptCache"] = {}
        self.abandoned = False

    @property
    def offset(self) -> int:
        """Tokens processed so far."""
        return next(c.offset for c in self if hasattr(c, "offset"))


def make_prompt_cache(model, max_kv_size: Optional[int] = None) -> PromptCache:
    """mlx-lm's ``make_prompt_cache`` for an ``MTPModel``: the target's and the drafter's state."""
    _check_model(model)
    note_max_kv_size(model, max_kv_size)
    return PromptCache(model.target.make_cache(), model.target.family)


def copy_prompt_cache(cache: PromptCache) -> PromptCache:
    """An independent copy (mlx-lm's caches write their buffers in place): what one cache holds,
    for a second generation to continue from while the first is kept."""
    mx.eval([a for a in _arrays(cache)])
    out = copy.deepcopy(cache)
    out.checkpoints, out.kept, out.abandoned = (), {}, False
    return out


def prompt_cache_nbytes(cache: PromptCache) -> int:
    """The bytes of every array the cache holds (its buffers as allocated, stashes included)."""
    return sum(a.nbytes for a in _arrays(cache))


def _arrays(cache: PromptCache) -> list:
    found: Dict[int, mx.array] = {}

    def walk(x, depth):
        if isinstance(x, mx.array):
            found[id(x)] = x
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y, depth)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y, depth)
        elif depth > 0 and hasattr(x, "__dict__"):  # a cache object's own attributes
            for y in vars(x).values():
                walk(y, depth - 1)

    walk(list(cache) + list(cache.drafter_state or []) + [cache.hidden], 2)
    return list(found.values())


def _check_model(model) -> None:
    if not hasattr(model, "target") or not hasattr(model, "mlx_model"):
        raise MTPError(f"expected a model from mlx_mtp.load, got {type(model).__name__}")


def check_prompt_cache(model, cache) -> PromptCache:
    """The caller's ``prompt_cache``: one made for this model's family and layer count."""
    if not isinstance(cache, PromptCache):
        raise MTPError("prompt_cache must come from mlx_mtp.make_prompt_cache(model) (or "
                       "mlx_mtp.load_prompt_cache): it holds the MTP head's state as well as the "
                       f"target's; got {type(cache).__name__}")
    family = model.target.family
    layers = len(model.target.make_cache())
    if cache.family != family or len(cache) != layers:
        raise MTPError(f"prompt_cache was made for a {cache.family} target with {len(cache)} "
                       f"cache layers; this target is {family} with {layers}")
    return cache


# ------------------------------------------------------------------------------- one generation


@dataclass
class _Round:
    start: int  # tokens yielded before this round's outputs
    hidden: mx.array  # target hidden states of the rows kept ([1, a + 1, H])
    accepted: int  # a: drafts kept; the round yields a + 1 tokens, the last one (bonus) unfed
    bonus: mx.array  # [1]
    replaced: list  # cache entries KV quantization replaced in this round (index, old cache)


class Turn:
    """One call of ``generate_step`` on a prompt cache: what the loop reports (``round_done``:
    the prefill's first token, then each round), and ``settle``, which makes the cache hold
    exactly the tokens yielded."""

    def __init__(self, model, cache: PromptCache, kv: KVSettings, drafter):
        self.target = model.target
        self.cache = cache
        self.kv = kv
        self.drafter = drafter
        self.last: Optional[_Round] = None
        cache.kept = {}
        for c in cache:  # a caller may stop mid-round: keep what ``target.rewind`` replays from
            if hasattr(c, "keep_stash"):
                c.keep_stash = True

    def start_drafter(self) -> None:
        """Before the prefill: resume the drafter from the cache (or start it afresh), and pair the
        previous turn's last hidden state with this prompt's first token."""
        d = self.drafter
        carried = self.cache.drafter_state
        if carried is not None:
            d.resume(carried)
        else:
            d.reset()
            self.cache.hidden = None  # a fresh head starts its context at this prompt
        d.bind_cache(self.cache)  # the Gemma 4 assistant reads the target's K/V

    def keep(self, position: int) -> None:
        """A checkpoint: the prefill has fed the target ``position`` prompt tokens and the
        drafter their pairs, the last one with token ``position``; keep a copy."""
        c = self.cache
        carried = self.drafter.carry() if self.drafter is not None else None
        c.kept[position] = copy_prompt_cache(PromptCache(list(c), c.family, carried, None))

    def pair_previous(self, first_id: mx.array) -> None:
        if self.drafter is not None and self.cache.hidden is not None:
            self.drafter.prefill(self.cache.hidden, first_id)

    def round_done(self, start: int, hidden: mx.array, accepted: int, bonus: mx.array,
                   replaced=()) -> None:
        self.last = _Round(start, hidden, accepted, bonus, list(replaced))

    def finish(self, yielded: int) -> None:
        """After ``yielded`` tokens in all: the cache holds the prompt and exactly those tokens,
        as mlx-lm's would; ``hidden`` is the target's state at the last of them."""
        r = self.last
        if r is None or self.cache.abandoned:  # the cache holds the prompt as far as it got
            return
        taken = yielded - r.start  # of this round's a + 1 outputs (>= 1)
        cache, target = self.cache, self.target
        if taken <= r.accepted:  # stopped inside the kept drafts: keep rows 0..taken only
            kept, keep = r.accepted + 1, taken + 1
            if r.replaced and cache.offset - (kept - keep) < self.kv.start:
                for i, old in r.replaced:  # mlx-lm would not have quantized yet
                    cache[i] = old
            target.rewind(cache, kept=kept, keep=keep)
            hidden = r.hidden[:, taken : taken + 1]
            if self.drafter is not None:
                self.drafter.rewind(kept - taken)  # pairs of rows taken..a
        else:  # every output read: feed the bonus as mlx-lm's decode step did
            hidden = target.hidden(r.bonus[None], cache)[:, -1:]
            self.kv.quantize(cache)
        arrays = [hidden] + target.cache_state(cache)
        if self.drafter is not None:
            arrays += self.drafter.state_arrays()
        mx.eval(arrays)
        for c in cache:  # the last verify's inputs: nothing rolls back past this point any more
            if hasattr(c, "stash"):
                c.stash = None
        cache.hidden = hidden
        cache.drafter_state = self.drafter.carry() if self.drafter is not None else None


def forget_drafter(cache: PromptCache) -> None:
    """A turn ran without the drafter (block size 1, or plain decode): its context restarts."""
    cache.drafter_state = None
    cache.hidden = None


# ------------------------------------------------------------------------------- files


class _Hidden(_mlx_cache.ArraysCache):
    """How ``hidden`` travels in a saved file: a one-slot ``ArraysCache``."""


def _adopt_classes(family: str) -> Dict[type, type]:
    """mlx-lm's cache classes -> the rollback-safe subclasses ``family``'s target uses."""
    found = families.by_name(family)
    if found is None:
        raise MTPError(f"unknown target family {family!r} in a saved prompt cache")
    return dict(found.cache_classes)


def _as_mlx_lm(c):
    """Our subclasses are saved under their mlx-lm class names, so mlx-lm can read the file."""
    base = next(b for b in type(c).__mro__ if b.__module__ == _mlx_cache.__name__)
    if type(c) is base:
        return c
    out = base.__new__(base)
    out.state = c.state
    return out


def save_prompt_cache(file_name: str, cache: PromptCache,
                      metadata: Optional[Dict[str, str]] = None) -> None:
    """mlx-lm's ``save_prompt_cache`` for a ``PromptCache``: the target's layers, then the
    drafter's carried caches, then ``hidden``, in mlx-lm's format (classes by mlx-lm name)."""
    if not isinstance(cache, PromptCache):
        raise MTPError("save_prompt_cache: expected a cache from mlx_mtp.make_prompt_cache, got "
                       f"{type(cache).__name__}")
    metadata = dict(metadata or {})
    bad = [k for k in metadata if k.startswith(_META)]
    if bad:
        raise MTPError(f"save_prompt_cache: metadata key {bad[0]!r} is reserved (prefix {_META})")
    drafter = cache.drafter_state
    hidden = _Hidden(1)
    hidden[0] = cache.hidden
    entries = [_as_mlx_lm(c) for c in cache] + list(drafter or []) + [hidden]
    metadata.update({_META + "family": cache.family, _META + "layers": str(len(cache)),
                     _META + "drafter": "none" if drafter is None else str(len(drafter))})
    _mlx_cache.save_prompt_cache(file_name, [_as_mlx_lm(c) for c in entries], metadata)


def load_prompt_cache(file_name: str, return_metadata: bool = False):
    """mlx-lm's ``load_prompt_cache`` for a file from ``mlx_mtp.save_prompt_cache``."""
    try:
        entries, metadata = _mlx_cache.load_prompt_cache(file_name, return_metadata=True)
    except Exception as e:
        raise MTPError(f"{file_name}: not a readable prompt cache file ({e})") from None
    if _META + "family" not in metadata:
        raise MTPError(f"{file_name}: not a prompt cache saved by mlx_mtp.save_prompt_cache "
                       "(it has no MTP head state)")
    family = metadata.pop(_META + "family")
    n = int(metadata.pop(_META + "layers"))
    drafter = metadata.pop(_META + "drafter")
    adopt = _adopt_classes(family)
    layers = []
    for c in entries[:n]:
        cls = adopt.get(type(c))
        if cls is not None:
            mine = cls.__new__(cls)
            mine.__dict__.update(vars(c))  # the subclasses add only class-level defaults
            c = mine
        layers.append(c)
    drafter_state = None if drafter == "none" else list(entries[n : n + int(drafter)])
    out = PromptCache(layers, family, drafter_state, entries[-1][0])
    return (out, metadata) if return_metadata else out
