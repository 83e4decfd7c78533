"""Environment switches (one prefix, ``MLX_MTP_``): a bad value is an error, never a guess."""

from __future__ import annotations

import os

from mlx_mtp.errors import MTPError


def flag(name: str, environ=None, default: bool = False) -> bool:
    """``name`` unset or empty: ``default``; ``0``: False; ``1``: True; anything else: one-line
    MTPError."""
    environ = os.environ if environ is None else environ
    value = environ.get(name, "").strip()
    if value == "":
        return default
    if value == "0":
        return False
    if value == "1":
        return True
    raise MTPError(f"environment variable {name} must be 0 or 1, got {value!r}")
