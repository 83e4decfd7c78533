"""What the T=0 identity tests compare against: mlx-lm's own plain greedy decode of a pristine copy
of the target, and the code prompt many of them decode."""

from __future__ import annotations

from pathlib import Path

import mlx_mtp  # (first: it binds MLX to the system BLAS before mlx.core loads)
import mlx.core as mx  # noqa: E402
import pytest
from mlx_lm.generate import generate_step as mlx_generate_step
from mlx_lm.utils import load_model as mlx_load_model

CODE_PROMPT = "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x"


def reference_greedy(path, prompt, max_tokens):
    """mlx-lm's own plain greedy decode of a pristine copy of the target."""
    model, _ = mlx_load_model(Path(path))
    return [t for t, _ in mlx_generate_step(mx.array(prompt), model, max_tokens=max_tokens)]


def assert_headless_model_decodes_plainly(path, prompt, n=12):
    """Loaded without a drafter, a target still decodes plainly (exactly mlx-lm's greedy output),
    and asking it for MTP is a clear error."""
    model = mlx_mtp.load_model(path, require_head=False)
    assert model.drafter is None

    def run(bs):
        return [t for t, _ in mlx_mtp.generate_step(mx.array(prompt), model, max_tokens=n,
                                                    block_size=bs)]

    assert run(1) == reference_greedy(path, prompt, n)
    with pytest.raises(mlx_mtp.MTPError,
                       match="this model has no MTP head: load one with drafter="):
        run(3)
