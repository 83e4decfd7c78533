"""mlx-lm's KV-cache arguments in the round loop: ``kv_bits`` / ``kv_group_size`` /
``quantized_kv_start`` (quantized KV cache) and ``max_kv_size``, with mlx-lm's exact semantics.

Quantized KV: mlx-lm's ``generate_step`` turns every ``KVCache`` into a ``QuantizedKVCache``
after the first model call that leaves its offset at ``quantized_kv_start`` or beyond. So the
decode step that feeds position p attends a quantized cache exactly when p >= start. A verify
block stands for several decode steps, so a round before the switch drafts only up to position
start - 1 (``max_drafts``); the switch then happens after the same step as in mlx-lm, and every
verify row attends the cache its decode step would. ``QuantizedKVCache.trim`` is exact (an offset
move), so rollback stays exact; the exactness probe covers the quantized configuration.

``max_kv_size``: mlx-lm's ``make_prompt_cache`` only builds rotating caches for models without a
``make_cache`` method, and every family mlx_mtp supports has one; mlx-lm runs them unbounded (Gemma
4's sliding layers at the model's own window). mlx_mtp does the same and says so once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List, Optional, Tuple

from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START, maybe_quantize_kv_cache

from mlx_mtp.errors import MTPError

KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize accepts (affine)
KV_GROUP_SIZES = (32, 64, 128)

logger = logging.getLogger("mlx_mtp")
_warned_max_kv_size = set()


def offset(cache) -> int:
    """Tokens the target cache holds (the offset of its first attention cache)."""
    return next(c.offset for c in cache if hasattr(c, "offset"))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class KVSettings:
    bits: Optional[int] = None
    group_size: int = 64
    start: int = DEFAULT_QUANTIZED_KV_START

    def check(self, target) -> "KVSettings":
        """Refuse what cannot run (one line naming the argument); returns self."""
        if self.bits is None:
            return self
        if not _is_int(self.bits) or self.bits not in KV_BITS:
            raise MTPError(f"kv_bits must be one of {', '.join(map(str, KV_BITS))}, "
                           f"got {self.bits!r}")
        if not _is_int(self.group_size) or self.group_size not in KV_GROUP_SIZES:
            raise MTPError(f"kv_group_size must be one of "
                           f"{', '.join(map(str, KV_GROUP_SIZES))}, got {self.group_size!r}")
        if not _is_int(self.start) or self.start < 0:
            raise MTPError(f"quantized_kv_start must be an integer >= 0, got {self.start!r}")
        if target.family == "gemma4":
            raise MTPError("kv_bits is not supported for Gemma 4: its sliding-window layers use "
                           "mlx-lm's RotatingKVCache, which mlx-lm cannot quantize "
                           "(RotatingKVCache.to_quantized is not implemented)")
        head_dim = getattr(target.args, "head_dim", None)
        if head_dim is not None and head_dim % self.group_size:
            raise MTPError(f"kv_group_size {self.group_size} does not divide the target's "
                           f"head_dim {head_dim}")
        return self

    @property
    def enabled(self) -> bool:
        return self.bits is not None

    def describe_cache(self) -> str:
        """The quantized cache itself (what the exactness probe runs against)."""
        return f"kv {self.bits}-bit, group {self.group_size}"

    def quantize_now(self, cache) -> None:
        """Quantize every quantizable layer now, whatever its offset (the exactness probe)."""
        maybe_quantize_kv_cache(cache, 0, self.group_size, self.bits)

    def quantize(self, cache) -> List[Tuple[int, object]]:
        """mlx-lm's ``maybe_quantize_kv_cache`` (in place); returns the (index, cache) entries it
        replaced, so that a rewind below ``start`` can put them back."""
        if self.bits is None:
            return []
        replaced = [(i, c) for i, c in enumerate(cache)
                    if hasattr(c, "to_quantized") and c.offset >= self.start]
        maybe_quantize_kv_cache(cache, self.start, self.group_size, self.bits)
        return replaced

    def max_drafts(self, cache, k: int) -> int:
        """Drafts a round may verify so that no verify row straddles the switch to quantized."""
        if self.bits is None or k == 0 or not any(hasattr(c, "to_quantized") for c in cache):
            return k
        q = offset(cache)  # the position of the round's first row (the bonus)
        return k if q >= self.start else min(k, self.start - 1 - q)


def note_max_kv_size(model, max_kv_size) -> None:
    """mlx-lm's ``max_kv_size`` for a family whose model makes its own cache: no effect, as in
    mlx-lm; checked, and said once per family."""
    if max_kv_size is None:
        return
    if not _is_int(max_kv_size) or max_kv_size < 1:
        raise MTPError(f"max_kv_size must be a positive integer, got {max_kv_size!r}")
    family = model.target.family
    if family not in _warned_max_kv_size:
        _warned_max_kv_size.add(family)
        logger.warning("max_kv_size=%d has no effect on %s targets, as in mlx-lm: their model "
                       "makes its own cache (mlx-lm's make_prompt_cache uses it), which keeps "
                       "the whole context%s", max_kv_size, family,
                       " (sliding layers: the model's own window)" if family == "gemma4" else "")
