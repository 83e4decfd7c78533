"""Tiny Qwen3.5 / Qwen3-Next checkpoints with the real file layouts, written on the fly: the
builders live in ``benchmarks.random_checkpoints`` (the benchmarks build their random pairs with
the same code; tests may import benchmarks, never the reverse)."""

from benchmarks.random_checkpoints import *  # noqa: F401,F403
