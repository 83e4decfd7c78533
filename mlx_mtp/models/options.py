"""``DraftOptions``: how the MTP drafter runs, each drafter optimization a switch. No default can
change the output; docs/models.md, "Drafter options", says what each does and which records
chose the defaults."""

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
    # Drafted ids stay on the device, the block evaluated once per round (the loop's one host
    # read). False: a host round trip per draft, kept so its cost can be measured.
    device_ids: bool = True
    # A draft step and an accept hook each run as one ``mx.compile``d graph (``compiled_head``):
    # embedding lookup, head, LM head + argmax. Drafts stay deterministic, not always bitwise
    # the eager head's; the output is unchanged.
    compiled: bool = True
    # The compiled step runs ``fused_head``'s merged head: q/k/v/gate and the MLP's gate/up as
    # one product each, paired norms and RoPE calls as one. Acceptance unchanged.
    merged: bool = True
    # At T=0 the LM head projected in chunks of ``fused_chunk`` rows with a running argmax, so
    # the full logits row never exists. Off: on the CPU that row is small next to its weights.
    fused_argmax: bool = False
    fused_chunk: int = DEFAULT_CHUNK
    # A reduced draft vocabulary sidecar (``mlx_mtp.draft_vocab``). None: the one the model
    # folder ships in ``mtp/draft_vocab/``, if any, else the full head.
    vocab: Optional[Union[str, Path]] = None
    # Quantize the head's projections at load (affine, ``group_size``); ``fc`` stays unquantized
    # unless ``quantize_fc``. Off: MLX's CPU quantized matmul is slower than the float head.
    bits: Optional[int] = None
    group_size: int = 64
    quantize_fc: bool = False
    # The compiled step's products (the merged head's, a whole unquantized LM head's) through
    # the row kernel as a lazy op (``drafter_products``), each weight row read once. None: on
    # where the loaded CPU BLAS is OpenBLAS and the lazy kernel runs. Drafts may differ in a
    # near tie, never the output.
    row_kernel: Optional[bool] = None
    # The compiled step's products on bfloat16 copies of the weights through the bf16 kernel
    # (``drafter_products``): half the bytes. None: on where the CPU kernels run and the copy
    # rounds nothing (a bfloat16 checkpoint cast to float32); True also rounds a float32 head,
    # whose drafts may then differ in a near tie (never the output).
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
