"""Every ``MLX_MTP_*`` environment variable, in one table (``SETTINGS``), and the functions that
read them. A bad value is an error (``MTPError``, one line naming the variable and what it must
be), never a guess. Each variable is read when its reader is called, not at import (the BLAS
choice excepted: ``mlx_mtp.cpu.blas`` reads it once, at ``import mlx_mtp``), so a test's
``monkeypatch.setenv`` takes effect at the next call. The package reads these variables nowhere
else; a name missing from the table is a ``KeyError``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

from mlx_mtp.errors import MTPError

# How a value is read (``Setting.kind``).
FLAG = "flag"  # stripped; "" (or unset): the default; "0": False; "1": True
COUNT = "count"  # stripped; "": the default; decimal digits: that int
SECONDS = "seconds"  # as set; "": the default; a number > 0 (float), whitespace around it allowed
PATH = "path"  # as set; "": None
LIBRARY = "library"  # stripped text, checked where it is used ("off", a path, "": auto)


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str  # FLAG, COUNT, SECONDS, PATH or LIBRARY
    default: object  # the value when unset or empty
    accepts: str  # what a value must be (a bad value's error says so)
    help: str  # one line: what it changes


SETTINGS = (
    Setting("MLX_MTP_ALLOW_INEXACT", FLAG, False, "0 or 1",
            "1: run MTP even where the exactness probe finds a verify block unequal to plain "
            "decoding (a loud warning, recorded in the stats)"),
    Setting("MLX_MTP_ATTENTION_KERNEL", FLAG, True, "0 or 1",
            "0: a verify's attention computes each row with its own one-query SDPA (reading the "
            "KV cache once per row) instead of the attention kernel (CPU, float32)"),
    Setting("MLX_MTP_CACHE", PATH, None, "a folder",
            "where the compiled C kernels and the MLX extension are cached (unset: "
            "$XDG_CACHE_HOME/mlx_mtp, else ~/.cache/mlx_mtp)"),
    Setting("MLX_MTP_CPU_BLAS", LIBRARY, "", "off or a library path",
            "Linux: the BLAS MLX's CPU backend binds to at import mlx_mtp (unset: the fastest "
            "system BLAS found; off: MLX's bundled one; a path: that library)"),
    Setting("MLX_MTP_DIST_CACHE_LOG", PATH, None, "a file path",
            "test hook of a split: each rank appends its per-round cache hashes to "
            "<path>.rank<N>"),
    Setting("MLX_MTP_DIST_TIMEOUT", SECONDS, 120.0, "a positive number of seconds",
            "how long a split rank waits in a collective for the others before it fails"),
    Setting("MLX_MTP_DRAFT_PROFILE", FLAG, False, "0 or 1",
            "1: evaluate after each drafter stage, so the stats split a draft step's time (slower "
            "steps: for attribution only)"),
    Setting("MLX_MTP_GDN_KERNEL", FLAG, True, "0 or 1",
            "0: no compiled GatedDeltaNet verify kernel (Qwen targets); the ops path instead"),
    Setting("MLX_MTP_LAZY_KERNELS", FLAG, True, "0 or 1",
            "0: the C kernels run eagerly (ctypes), not as lazy MLX ops, even where the extension "
            "builds"),
    Setting("MLX_MTP_PIN_VERIFY", FLAG, True, "0 or 1",
            "0: never pin the process's threads to one core during a verify that calls an eager "
            "C kernel"),
    Setting("MLX_MTP_ROW_EXACT", FLAG, True, "0 or 1",
            "0: verify with the plain multi-row products on the CPU at every temperature (not "
            "row-exact; with the row kernel usually slower); the probe then decides T=0 on "
            "that verify"),
    Setting("MLX_MTP_ROW_KERNEL", FLAG, True, "0 or 1",
            "0: no compiled C kernel at all (row kernel, GatedDeltaNet kernel, lazy ops)"),
    Setting("MLX_MTP_SYNC_PHASES", FLAG, False, "0 or 1",
            "1: evaluate each round phase before the next, so the per-phase times are real "
            "(slower rounds)"),
    Setting("MLX_MTP_VERIFY_THREADS", COUNT, 1,
            "a whole number of threads (0 = leave the BLAS default)",
            "BLAS and row-kernel threads of a round's multi-row work and of the row kernel's "
            "one-row products in one-token steps (unset: the row kernel runs products of 16 MB of "
            "work or more on every usable core, smaller ones on 1, one-row products of weights of "
            "4 MiB or more on every usable core, and the drafter's bf16 kernel bfloat16 weights "
            "of 4 MiB or more; the BLAS: 1, with OpenBLAS its own count; 0: the library's count)"),
)

_BY_NAME = {s.name: s for s in SETTINGS}


def setting(name: str) -> Setting:
    """The table's entry for ``name``; KeyError if it has none."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not in mlx_mtp.config.SETTINGS") from None


def _environ(environ: Optional[Mapping[str, str]]) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def raw(name: str, environ: Optional[Mapping[str, str]] = None) -> str:
    """``name``'s value as set ("" when unset)."""
    setting(name)
    return _environ(environ).get(name, "")


def is_set(name: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    """``name`` is set to something other than blanks."""
    return raw(name, environ).strip() != ""


def _bad(s: Setting, value: str) -> MTPError:
    if s.kind == SECONDS:  # the split's error lines name it bare
        return MTPError(f"{s.name} must be {s.accepts}, got {value!r}")
    return MTPError(f"environment variable {s.name} must be {s.accepts}, got {value!r}")


def flag(name: str, environ: Optional[Mapping[str, str]] = None,
         default: Optional[bool] = None) -> bool:
    """A FLAG: unset or empty: ``default`` (None: the table's); ``0``: False; ``1``: True;
    anything else: one-line MTPError."""
    s = setting(name)
    value = raw(name, environ).strip()
    if value == "":
        return s.default if default is None else default
    if value == "0":
        return False
    if value == "1":
        return True
    raise _bad(s, value)


def count(name: str, environ: Optional[Mapping[str, str]] = None) -> int:
    """A COUNT: unset or empty: the table's default; decimal digits: that number; anything else:
    one-line MTPError."""
    s = setting(name)
    value = raw(name, environ).strip()
    if value == "":
        return s.default
    if not value.isdigit():
        raise _bad(s, value)
    return int(value)


def seconds(name: str, environ: Optional[Mapping[str, str]] = None) -> float:
    """SECONDS: unset or empty: the table's default; a number > 0; anything else: one-line
    MTPError."""
    s = setting(name)
    value = raw(name, environ)
    if value == "":
        return s.default
    try:
        v = float(value)
    except ValueError:
        v = -1.0
    if not v > 0:
        raise _bad(s, value)
    return v


def path(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """A PATH: the value as set, or None when unset or empty."""
    return raw(name, environ) or None


def text(name: str, environ: Optional[Mapping[str, str]] = None) -> str:
    """A LIBRARY choice: the value without surrounding blanks ("" when unset)."""
    return raw(name, environ).strip()


_READERS = {FLAG: flag, COUNT: count, SECONDS: seconds, PATH: path, LIBRARY: text}


def value(name: str, environ: Optional[Mapping[str, str]] = None):
    """``name`` read as its kind says (a bad value: one-line MTPError)."""
    return _READERS[setting(name).kind](name, environ)


def _shown(default) -> str:
    if default is None or default == "":
        return "unset"
    if isinstance(default, bool):
        return f"`{int(default)}`"
    if isinstance(default, float) and default.is_integer():
        default = int(default)
    return f"`{default}`"


def _escaped(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def markdown_table() -> str:
    """``SETTINGS`` as the Markdown table in docs/configuration.md."""
    rows = ["| variable | default | accepts | what it changes |", "|---|---|---|---|"]
    rows += [f"| `{s.name}` | {_shown(s.default)} | {_escaped(s.accepts)} | {_escaped(s.help)} |"
             for s in SETTINGS]
    return "\n".join(rows) + "\n"
