"""A bare target for the draft LM head's tests: an ``nn.Linear`` LM head behind the attributes
``DraftLMHead`` reads."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class LinearTarget:
    """A target whose LM head is ``lin``: ``lm_head_module`` and ``logits`` as a target's."""

    def __init__(self, lin: nn.Linear):
        self.lm_head_module = lin

    def logits(self, h: mx.array) -> mx.array:
        return self.lm_head_module(h)


def random_head(H: int = 64, V: int = 320):
    """``(target, its head nn.Linear [V, H] without bias, hidden rows x [3, H])``, seeded."""
    lin = nn.Linear(H, V, bias=False)
    lin.weight = mx.random.normal((V, H), key=mx.random.key(3))
    x = mx.random.normal((3, H), key=mx.random.key(4))
    return LinearTarget(lin), lin, x
