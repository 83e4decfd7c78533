"""The model families: what the shared code (loading, prompt cache files, conversion) needs of a
family, looked up by a config's ``model_type`` or by a target's ``family`` name, so that no shared
module imports a family.

A family is a package under ``mlx_mtp/models/`` whose ``__init__`` does
``FAMILY = families.register(Family(...))``; ``BUILTIN`` below is the one place that names the
built-in ones, imported at the first lookup (docs/architecture.md, "Adding a family").
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple

# The built-in families' packages: adding one is a new folder and a line here. The order is the
# order error lines list model types in.
BUILTIN = (
    "mlx_mtp.models.qwen3_5",
    "mlx_mtp.models.gemma4",
)


@dataclass
class Conversion:
    """One ``mlx_mtp.convert`` run, as its family's hooks see it."""

    src: Path  # the checkpoint folder
    config: dict  # its config.json, as read
    drafter: object = None  # ``--drafter``: a folder or repo id, or None
    head_bits: Optional[int] = None
    head_group_size: int = 64
    draft_vocab: Optional[int] = None
    corpus: Sequence[Path] = ()
    quiet: bool = False
    # Set before ``convert_drafter`` runs:
    out: Optional[Path] = None  # the folder being written (renamed into place when complete)
    model: object = None  # mlx-lm's model: lazily loaded, cast and quantized as asked
    dtype: object = None  # the float dtype of what is not quantized (an ``mx.Dtype``)
    drafter_config: Optional[dict] = None  # ``config`` without its FP8 quantization_config
    progress: Optional[Callable] = None  # (description, total) -> a progress bar (tqdm's calls)


def _nothing(conversion: Conversion) -> dict:
    return {}


def _accept(conversion: Conversion) -> None:
    return None


@dataclass(frozen=True)
class Family:
    name: str  # its targets' ``family``: what a saved prompt cache records
    model_types: Tuple[str, ...]  # the config.json ``model_type``s it loads
    # load(path, config, *, drafter, dtype, require_head, draft_options, target_args[, split])
    # -> MTPModel (target_args: ``load_target``'s keywords); ``split`` only for ``splits``' types
    load: Callable
    # model_type -> the splits mlx-lm has for it ("pipeline", "tensor"); absent: not splittable
    splits: Mapping[str, Tuple[str, ...]] = field(default_factory=dict)
    title: str = ""  # how error lines name its targets
    # mlx-lm cache class -> the subclass its target uses instead (a loaded prompt cache's layers)
    cache_classes: Mapping[type, type] = field(default_factory=dict)
    # ``mlx_mtp.convert``'s hooks, each given the ``Conversion``: ``check_conversion`` refuses
    # options that do not apply (before any work); ``convert_drafter`` writes the drafter into
    # ``out`` before the target is written, ``finish_conversion`` runs after; both return what
    # they add to the conversion's result.
    check_conversion: Callable[[Conversion], None] = _accept
    convert_drafter: Callable[[Conversion], dict] = _nothing
    finish_conversion: Callable[[Conversion], dict] = _nothing


# Module state: families register once per process, when their package is imported.
_REGISTERED: Dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add ``family`` (again: replace it); a model type another family loads is refused."""
    for other in _REGISTERED.values():
        clash = [t for t in family.model_types if t in other.model_types]
        if other.name != family.name and clash:
            raise ValueError(f"family {family.name}: model_type {clash[0]!r} is already "
                             f"{other.name}'s")
    _REGISTERED[family.name] = family
    return family


def all_families() -> Tuple[Family, ...]:
    """The built-in families (``BUILTIN`` order), then any other registered ones."""
    builtin = [importlib.import_module(m).FAMILY for m in BUILTIN]
    names = {f.name for f in builtin}
    return tuple(builtin) + tuple(f for f in _REGISTERED.values() if f.name not in names)


def model_types() -> Tuple[str, ...]:
    """Every model type a family loads, in ``all_families`` order."""
    return tuple(t for f in all_families() for t in f.model_types)


def for_model_type(model_type) -> Optional[Family]:
    """The family that loads ``model_type`` (a config's), or None."""
    return next((f for f in all_families() if model_type in f.model_types), None)


def by_name(name) -> Optional[Family]:
    """The family called ``name`` (a target's ``family``), or None."""
    return next((f for f in all_families() if f.name == name), None)
