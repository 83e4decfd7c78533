"""How the MTP drafter runs: the optimization phases of issue 4, each a switch.

Defaults are what measured fastest on the device it was measured on, and no phase that can change
acceptance is on by default (``benchmark_results/drafter-phases-*``):
  device_ids    phase 1: drafted ids stay on the device, the block is read once. On.
  fused_argmax  phase 2a: at T=0 the LM head is projected in row chunks with a running argmax,
                so the full logits row never exists. Off: on the CPU backend it did not beat
                one BLAS matvec plus argmax (the logits row is a rounding error next to the
                weights); not measured on a GPU.
  vocab         phase 2b: a reduced draft vocabulary sidecar (``mlx_mtp.draft_vocab``). Off
                until an acceptance A/B on a trained pair says what it costs.
  bits          phase 3: quantize the head's projections at load (affine, ``group_size``; ``fc``
                stays unquantized unless ``quantize_fc``). Off: MLX's quantized matmul is a scalar
                loop on x86, ~10x slower than the f32 BLAS matvec; acceptance A/B pending.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from ..errors import MTPError

QUANT_BITS = (4, 8)
QUANT_GROUP_SIZES = (32, 64, 128)
DEFAULT_CHUNK = 8192  # rows per fused-argmax chunk; a multiple of 8 keeps BLIS rows bitwise equal


@dataclass(frozen=True)
class DraftOptions:
    device_ids: bool = True
    fused_argmax: bool = False
    fused_chunk: int = DEFAULT_CHUNK
    vocab: Optional[Union[str, Path]] = None
    bits: Optional[int] = None
    group_size: int = 64
    quantize_fc: bool = False

    def __post_init__(self):
        if self.bits is not None and self.bits not in QUANT_BITS:
            raise MTPError(f"draft bits (--draft-bits) must be one of "
                           f"{', '.join(map(str, QUANT_BITS))}, got {self.bits!r}")
        if self.group_size not in QUANT_GROUP_SIZES:
            raise MTPError(f"draft group size (--draft-group-size) must be one of "
                           f"{', '.join(map(str, QUANT_GROUP_SIZES))}, got {self.group_size!r}")
        if (not isinstance(self.fused_chunk, int) or self.fused_chunk < 8
                or self.fused_chunk % 8):
            raise MTPError(f"fused_chunk must be a positive multiple of 8, got {self.fused_chunk!r}")
