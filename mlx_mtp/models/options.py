"""How the MTP drafter runs: each drafter optimization is a switch.

The defaults were chosen by measurement on the Linux CPU backend (see docs/configuration.md), and
no switch that can change acceptance is on by default (the kernels' sums may order a near tie
differently, as the row kernel's do):
  device_ids    drafted ids stay on the device and the block is evaluated once: the round loop's
                one-host-read-per-round design. Off: a host round trip per draft (kept so its cost
                can be measured).
  fused_argmax  at T=0 the LM head is projected in row chunks (``fused_chunk`` rows) with a
                running argmax, so the full logits row never exists. Off: on the CPU the logits
                row is tiny next to the weights it is computed from.
  vocab         a reduced draft vocabulary sidecar (``mlx_mtp.draft_vocab``). None: the sidecar
                the model folder ships in ``mtp/draft_vocab/``, if any, else the full head.
  compiled      a draft step and an accept hook run as one ``mx.compile``d graph each
                (``mlx_mtp.models.qwen3_5.compiled_head``): embedding lookup, head, LM head +
                argmax. On: at draft sizes the head is bound by per-op overhead, which compiling
                cuts; drafts stay deterministic (not always bitwise the eager head's), the output
                is unchanged.
  merged        the compiled step runs ``mlx_mtp.models.qwen3_5.fused_head``'s head: its
                q/k/v/gate and MLP gate/up products merged and its paired norms / RoPE calls as
                one, so a step has fewer graph nodes. On; acceptance unchanged.
  row_kernel    the compiled step's products (the merged head's and a whole unquantized LM
                head's) through the row kernel as a lazy op
                (``mlx_mtp.models.qwen3_5.drafter_products``), each weight row read once. None: on
                where the loaded CPU BLAS is OpenBLAS (which packs the weights for every few-row
                product) and the lazy row kernel runs. Drafts may differ in a near tie, never the
                output.
  bf16          the compiled step's products (the merged head's and the draft LM head's) with
                the weights kept as bfloat16 and multiplied by the bf16 kernel as a lazy op
                (``mlx_mtp.models.qwen3_5.drafter_products``): half the bytes a float32 product reads
                (a bfloat16 copy of the LM head rows it drafts over is made). None: on where the
                CPU kernels run and the copy rounds nothing (a bfloat16 checkpoint, cast to
                float32 on load); True also rounds a float32 head, whose drafts may then differ
                in a near tie (never the output). Measured faster on the CPU (docs/models.md).
  bits          quantize the head's projections at load (affine, ``group_size``; ``fc`` stays
                unquantized unless ``quantize_fc``). Off: MLX's quantized matmul is a scalar loop
                on x86, slower than the unquantized head there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from mlx_mtp.errors import MTPError

QUANT_BITS = (4, 8)
QUANT_GROUP_SIZES = (32, 64, 128)
DEFAULT_CHUNK = 8192  # rows per fused-argmax chunk; a multiple of 8 keeps BLIS rows bitwise equal


@dataclass(frozen=True)
class DraftOptions:
    device_ids: bool = True
    compiled: bool = True
    merged: bool = True
    fused_argmax: bool = False
    fused_chunk: int = DEFAULT_CHUNK
    vocab: Optional[Union[str, Path]] = None
    bits: Optional[int] = None
    group_size: int = 64
    quantize_fc: bool = False
    row_kernel: Optional[bool] = None
    bf16: Optional[bool] = None

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
        if self.row_kernel not in (None, True, False):
            raise MTPError(f"row_kernel must be None, True or False, got {self.row_kernel!r}")
        if self.bf16 not in (None, True, False):
            raise MTPError(f"bf16 must be None, True or False, got {self.bf16!r}")
        if self.bf16 and not self.compiled:
            raise MTPError("bf16=True (--draft-bf16) runs the compiled draft step's products: it "
                           "needs compiled=True")
        if self.bf16 and self.row_kernel:
            raise MTPError("bf16=True (--draft-bf16) and row_kernel=True both choose the draft "
                           "step's kernel: pick one")
        if self.bf16 and self.bits is not None:
            raise MTPError("bf16=True (--draft-bf16) and --draft-bits both set the head's weights: "
                           "pick one")
        if self.row_kernel and not self.compiled:
            raise MTPError("row_kernel=True runs the compiled draft step's products: it needs "
                           "compiled=True")
