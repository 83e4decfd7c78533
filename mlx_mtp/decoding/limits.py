"""The bounds and defaults of the speculation settings, shared by the API, the CLIs, the server
and the batch: one place to read and change them."""

from __future__ import annotations

from typing import Optional

MAX_BLOCK_SIZE = 16  # the widest verify block (tokens per round, drafts + 1) a generation may use
DEFAULT_MAX_BLOCK_SIZE = 6  # the widest block ``block_size="auto"`` chooses (docs/block-size.md)
MAX_TOPK = 8  # the most children a draft tree considers per node
DEFAULT_MAX_TOKENS = 256  # mlx-lm's default token budget
DEFAULT_MAX_BATCH = 8  # sequences decoded together in batched rounds (batch_generate, server)


def block_size_problem(block_size: int) -> Optional[str]:
    """What is wrong with an integer block size ("must be ..."), or None: the one place its
    bounds are checked (the API and the CLIs word their errors around it)."""
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        return f"must be between 1 and {MAX_BLOCK_SIZE}, got {block_size}"
    return None
