"""Prompt caches kept across generations, found by the tokens they hold, as mlx-lm's
``LRUPromptCache`` finds them: the entry that holds the longest prefix of a new prompt, least
recently used evicted once the entries' bytes pass a bound.

Only whole entries are reused, never trimmed: a GatedDeltaNet layer keeps one recurrent state, and
a rotating cache past its window has overwritten what a trim would need. So an entry helps a
prompt only if its tokens are a prefix of it. ``fetch`` hands out a copy: an entry is never
shared by two generations.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from mlx_mtp.errors import MTPError
from mlx_mtp.decoding.prompt_cache import PromptCache, copy_prompt_cache, prompt_cache_nbytes


@dataclass
class _Entry:
    cache: PromptCache
    nbytes: int


class LRUPromptCache:
    """Entries by key: the tokens an entry has seen. Its target holds all of them (a finished
    generation: ``PromptCache.hidden`` pairs the last with the next prompt's first token) or all
    but the last (a checkpoint, whose drafter has paired the last one already); either way the
    next prompt must start with the key and prefill from the entry's ``offset``."""

    def __init__(self, max_bytes: int):
        if max_bytes < 1:
            raise MTPError(f"max_bytes must be at least 1, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: "OrderedDict[Tuple[int, ...], _Entry]" = OrderedDict()  # oldest first
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Sequence[int]) -> bool:
        return tuple(key) in self._entries

    def fetch(self, ids: Sequence[int]) -> Tuple[Optional[PromptCache], int]:
        """``(a copy of the entry holding the longest prefix of ids, the tokens it holds)``, or
        ``(None, 0)``. At least the last token of ``ids`` is left to prefill."""
        ids = tuple(ids)
        best, held = None, 0
        for key, entry in self._entries.items():
            offset = entry.cache.offset
            if held < offset < len(ids) and len(key) <= len(ids) and ids[: len(key)] == key:
                best, held = key, offset
        if best is None:
            return None, 0
        self._entries.move_to_end(best)
        return copy_prompt_cache(self._entries[best].cache), held

    def insert(self, key: Sequence[int], cache: PromptCache) -> bool:
        """Keep ``cache`` (taken over: the caller must not use it again) under ``key``, then
        evict the least recently used entries past ``max_bytes``. False when it alone is larger
        than ``max_bytes`` (not kept, nothing evicted)."""
        key = tuple(key)
        if cache.offset not in (len(key), len(key) - 1):
            raise MTPError(f"a prompt cache holding {cache.offset} tokens cannot be kept under "
                           f"{len(key)} tokens")
        nbytes = prompt_cache_nbytes(cache)
        if nbytes > self.max_bytes:
            return False
        self._remove(key)
        self._entries[key] = _Entry(cache, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            self._remove(next(iter(self._entries)))
        return True

    def _remove(self, key: Tuple[int, ...]) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry.nbytes

    def digests(self) -> List[List[int]]:
        """Each entry's key as ``[length, hash]``, least recently used first: the same on every
        process for the same tokens (an int tuple's hash does not depend on the hash seed)."""
        return [[len(key), hash(key)] for key in self._entries]

    def mirror(self, digests: Sequence[Sequence[int]]) -> None:
        """Keep exactly the entries ``digests`` names, in its order (another store's
        ``digests``, which kept a subset of what this one kept through the same requests)."""
        by_digest = {(len(key), hash(key)): key for key in self._entries}
        missing = [d for d in digests if tuple(d) not in by_digest]
        if missing:
            raise MTPError(f"prompt cache: {len(missing)} entries to mirror are not kept here "
                           f"(first: {missing[0][0]} tokens)")
        keep = [by_digest[tuple(d)] for d in digests]
        for key in set(self._entries) - set(keep):
            self._remove(key)
        for key in keep:
            self._entries.move_to_end(key)

    def entries(self) -> List[dict]:
        """Each entry's tokens (held by its target) and bytes, least recently used first."""
        return [{"tokens": e.cache.offset, "bytes": e.nbytes} for e in self._entries.values()]
