"""The server's prompt cache across requests (``--prompt-cache-bytes``): each request starts from a
copy of the kept cache that holds the longest prefix of its prompt and prefills only the rest.

What is kept, per request (``LRUPromptCache``: whole entries, never trimmed):
- the cache where its generation ended: the prompt and every token it generated, which the next
  turn's prompt starts with when the chat template renders the answer as generated;
- checkpoints inside the prompt, where a conversation can go on: for a chat, the end of the part
  the next turn renders alike (the template's re-render of this conversation with an answer and a
  new message, ``continuation_points``), and the end of the system messages; for a text
  completion, the whole prompt.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx

from mlx_mtp.decoding.lru_prompt_cache import LRUPromptCache
from mlx_mtp.decoding.prompt_cache import PromptCache, make_prompt_cache

logger = logging.getLogger("mlx_mtp.server")

# Stands in for the content of messages that do not exist yet (a probe of the chat template).
PLACEHOLDER = "x"


@dataclass
class Reused:
    """One request's prompt cache: what it starts from and what it will keep."""

    ids: List[int]  # the whole prompt
    cache: PromptCache
    cached: int  # prompt tokens the cache holds when the request starts
    checkpoints: Dict[int, int] = field(default_factory=dict)  # position in the rest -> in ids

    @property
    def rest(self) -> List[int]:
        """The prompt tokens left to prefill."""
        return self.ids[self.cached:]


class PromptReuse:
    def __init__(self, model, max_bytes: int):
        self.model = model
        self.store = LRUPromptCache(max_bytes)

    def open(self, ids: List[int], points: Sequence[int]) -> Reused:
        """The request's cache, and the checkpoints it keeps: at each of ``points`` (prompt
        lengths a later prompt may share), one holding all but that length's last token,
        unless the cache starts past it or one is kept already."""
        cache, cached = self.store.fetch(ids)
        if cache is None:
            cache = make_prompt_cache(self.model)
        reused = Reused(ids, cache, cached)
        for n in points:
            n = min(n, len(ids))
            if n - 1 > cached and ids[:n] not in self.store:
                reused.checkpoints[n - 1 - cached] = n - 1
        cache.checkpoints = tuple(sorted(reused.checkpoints))
        logger.debug("prompt cache: %d of %d prompt tokens cached, checkpoints at %s",
                     cached, len(ids), sorted(reused.checkpoints.values()))
        return reused

    def keep_checkpoints(self, reused: Reused) -> None:
        """After the prefill: keep the copies it made."""
        for position, at in sorted(reused.checkpoints.items()):
            kept = reused.cache.kept.pop(position, None)
            if kept is not None:  # (none where the exactness gate sent it to plain decode)
                self._insert(reused.ids[: at + 1], kept)

    def keep_finished(self, reused: Reused, tokens: List[int]) -> None:
        """After the generation: keep its cache, which holds the prompt and ``tokens``."""
        self._insert(reused.ids + tokens, reused.cache)

    def _insert(self, key: List[int], cache: PromptCache) -> None:
        if not self.store.insert(key, cache):
            logger.info("prompt cache: %d tokens not kept, larger than --prompt-cache-bytes %d",
                        cache.offset, self.store.max_bytes)

    def summary(self) -> dict:
        """The ``prompt_cache`` object of ``/health``."""
        return {"enabled": True, "max_bytes": self.store.max_bytes, "bytes": self.store.nbytes,
                "entries": self.store.entries()}


def continuation_points(ids: List[int], render: Callable[[List[dict]], List[int]],
                        messages: List[dict]) -> List[int]:
    """Prompt lengths a chat's later prompts share with ``ids`` (its rendering of ``messages``):
    the part the next turn renders alike (``render`` of the conversation with an answer and a
    new user message: a template may render an earlier answer's header differently from the
    generation prompt, e.g. without the opening of a thinking block) and, with system messages,
    what a conversation with the same ones and another user message renders alike. A template
    that refuses either probe gives no point for it."""
    points = []
    system = 0
    while system < len(messages) and messages[system].get("role") == "system":
        system += 1
    probes = [list(messages) + [{"role": "assistant", "content": PLACEHOLDER},
                                {"role": "user", "content": PLACEHOLDER}]]
    if 0 < system < len(messages):
        probes.append(list(messages[:system]) + [{"role": "user", "content": PLACEHOLDER}])
    for probe in probes:
        try:
            other = render(probe)
        except Exception:  # a template's own refusal (roles, content types, ...)
            continue
        points.append(shared_length(ids, other))
    return [n for n in points if n > 0]


def shared_length(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def with_history(processors: list, earlier: Sequence[int]) -> list:
    """mlx-lm logits processors that also see the ``earlier`` tokens (the cached prompt's),
    before the token history the round loop gives them (the rest of the prompt onward), so a
    repetition penalty weighs what it weighs on the whole prompt."""
    if not earlier or not processors:
        return processors
    before = mx.array(list(earlier))

    def wrap(processor):
        return lambda tokens, logits: processor(
            mx.concatenate([before.astype(tokens.dtype), tokens]), logits)

    return [wrap(p) for p in processors]
