"""How the MTP drafter runs: the optimization phases of issue 4, each a switch.

Defaults are what measured best on the device it was measured on (the Linux CPU backend; record
``benchmark_results/drafter-phases-*``), and no phase that can change acceptance is on by default:
  device_ids    phase 1: drafted ids stay on the device and the block is evaluated once. On: the
                round loop's one-read-per-round design; off (a host round trip per draft, kept to
                measure it) was no faster or slower here, where a sync costs microseconds.
  fused_argmax  phase 2a: at T=0 the LM head is projected in row chunks with a running argmax,
                so the full logits row never exists. Off: no measurable gain on the CPU (the
                logits row is tiny next to the weights it is computed from); no GPU measured.
  vocab         phase 2b: a reduced draft vocabulary sidecar (``mlx_mtp.draft_vocab``). None: the
                sidecar the model folder ships in ``mtp/draft_vocab/``, if any (the demo pair's
                4096 ids: its acceptance A/B lost no draft, draft step and accept hook ~0.7x),
                else the full head.
  compiled      phase 5: a draft step and an accept hook run as one ``mx.compile``d graph each
                (``mlx_mtp.models.qwen3_5.compiled_head``): embedding lookup, head, LM head + argmax. On:
                at draft sizes the head is bound by per-op overhead, which compiling cuts
                (~0.75-0.8x here); drafts stay deterministic (not always bitwise the eager
                head's), the output is unchanged.
  merged        issue 12 part 4: the compiled step runs ``mlx_mtp.models.qwen3_5.fused_head``'s head, its
                q/k/v/gate and MLP gate/up products merged and its paired norms / RoPE calls as
                one (~95 graph nodes a step instead of ~123). On: draft step ~0.8x, accept hook
                ~0.8-0.9x on the demo pair, no slower on a 280M pair; acceptance unchanged.
  row_kernel    issue 12 part 4: the compiled step's products (the merged head's and a whole
                unquantized LM head's) through the row kernel as a lazy op
                (``mlx_mtp.models.qwen3_5.row_products``), each weight row read once. None: on where
                the loaded CPU BLAS is OpenBLAS (which packs the weights for every few-row
                product: draft 0.79 -> 0.70 ms, accept hook 1.17 -> 1.09 ms a block-3 round on
                the demo pair) and the lazy row kernel runs; BLIS measured no change. Drafts may
                differ in a near tie, never the output.
  bits          phase 3: quantize the head's projections at load (affine, ``group_size``; ``fc``
                stays unquantized unless ``quantize_fc``). Off: MLX's quantized matmul is a scalar
                loop on x86 and made the drafter step ~1.4x slower; acceptance A/B pending.
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
        if self.row_kernel and not self.compiled:
            raise MTPError("row_kernel=True runs the compiled draft step's products: it needs "
                           "compiled=True")
