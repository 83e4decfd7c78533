"""The Gemma 4 assistant's products on bfloat16 copies of its weights (``DraftOptions.bf16``).

On the CPU the assistant is cast to float32 on load, so a draft step reads 4 bytes per weight.
Here every bias-free projection and the tied head (``embed_tokens.as_linear``) read a bfloat16
copy through the bf16 kernel that also runs the Qwen head's products
(``mlx_mtp.models.bf16_weights``): half the bytes, each sum in float32. Drafts may
differ from the float32 products' in a near tie, never the output. docs/models.md, "A bfloat16
drafter on the CPU".
"""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_mtp.errors import MTPError
from mlx_mtp.models import bf16_weights


class Bf16Linear(nn.Module):
    """A bias-free ``nn.Linear`` whose ``weight`` is a bfloat16 copy, multiplied by the bf16
    kernel (float32 in, float32 out)."""

    def __init__(self, weight: mx.array):
        super().__init__()
        self.weight = bf16_weights.bf16_weight(weight)
        self.threads = bf16_weights.bf16_threads(self.weight)

    def __call__(self, x: mx.array) -> mx.array:
        return bf16_weights.bf16_products(x, self.weight, self.threads)


class Bf16TiedHead(nn.Module):
    """The assistant's tied embedding where it only serves as the head (the dense head: the
    draft's input embedding is the target's): ``as_linear`` on a bfloat16 copy."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.product = Bf16Linear(embedding.weight)

    def as_linear(self, x: mx.array) -> mx.array:
        return self.product(x)


def _linears(assistant: nn.Module) -> List[tuple]:
    """(parent, attribute, module) of every plain bias-free ``nn.Linear`` in ``assistant``."""
    found = []
    for _, parent in assistant.named_modules():
        for name, child in parent.children().items():
            if type(child) is nn.Linear and "bias" not in child:
                found.append((parent, name, child))
    return found


def _quantized(assistant: nn.Module) -> bool:
    return any(hasattr(m, "bits") for _, m in assistant.named_modules())


def candidates(assistant) -> list:
    """The float32 matrices ``use_bf16`` copies: every bias-free projection's weight, and the
    tied embedding where the head is dense."""
    weights = [m.weight for _, _, m in _linears(assistant)]
    if "masked_embedding" not in assistant:
        weights.append(assistant.model.embed_tokens.weight)
    return weights


def resolve(option: Optional[bool], assistant, source: str) -> bool:
    """``DraftOptions.bf16`` for ``assistant``: as for the Qwen head
    (``bf16_weights.resolve_bf16``); a quantized assistant never (an error if asked for)."""
    if _quantized(assistant):
        if option:
            raise MTPError(f"--draft-bf16 (DraftOptions(bf16=True)): {source} is quantized; "
                           "the bf16 kernel copies float weights")
        return False
    return bf16_weights.resolve_bf16(option, lambda: candidates(assistant))


def use_bf16(assistant) -> None:
    """Swap the assistant's projections (and its dense tied head) for bfloat16 copies run by
    the bf16 kernel; the float32 weights they replace are dropped."""
    for parent, name, linear in _linears(assistant):
        setattr(parent, name, Bf16Linear(linear.weight))
    if "masked_embedding" not in assistant:
        # The centroid head gathers embedding rows, so it keeps the float32 table.
        assistant.model.embed_tokens = Bf16TiedHead(assistant.model.embed_tokens)
