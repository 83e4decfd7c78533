"""The drafter's LM head: the target's borrowed projection, on all of the vocabulary or on a
reduced draft vocabulary (``DraftOptions.vocab``), with an optional fused projection + argmax
(``DraftOptions.fused_argmax``).

Draft numerics never reach the output (every draft is verified by the target), but the fused
path must still pick the ids the unfused one picks: it multiplies the same weight rows with the
same kernel, chunk by chunk, and keeps the first maximum like ``mx.argmax``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_mtp.cpu import row_kernel
from mlx_mtp.errors import MTPError
from mlx_mtp.models import bf16_weights
from mlx_mtp.models.qwen3_5 import drafter_products


@dataclass
class HeadTensors:
    """The weights of an LM head (``nn.Linear`` / ``QuantizedLinear``, or a tied
    ``Embedding`` / ``QuantizedEmbedding`` used as a linear), rows = vocabulary ids; with
    ``transposed`` (unquantized only) ``weight`` is stored ``[H, V]``, columns = vocabulary ids."""

    weight: mx.array
    scales: Optional[mx.array] = None
    biases: Optional[mx.array] = None
    bias: Optional[mx.array] = None
    group_size: int = 0
    bits: int = 0
    mode: str = "affine"
    transposed: bool = False
    row_kernel: bool = False  # whole-head products through the row kernel (``drafter_products``)
    bf16: bool = False  # ``weight`` is a bfloat16 copy, multiplied by the bf16 kernel
    threads: int = 1  # the bf16 kernel's

    @classmethod
    def of(cls, module: nn.Module) -> "HeadTensors":
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            return cls(module["weight"], module["scales"], module.get("biases"),
                       module.get("bias"), module.group_size, module.bits, module.mode)
        return cls(module["weight"], bias=module.get("bias") if isinstance(module, nn.Linear)
                   else None)

    @property
    def rows(self) -> int:
        return self.weight.shape[1 if self.transposed else 0]

    def take(self, ids: mx.array) -> "HeadTensors":
        """A contiguous copy of rows ``ids``. Unquantized rows are stored transposed: the one-row
        product ``x @ W`` (no transpose) is the faster BLAS path (with BLIS, clearly faster than
        ``x @ W.T``), and the copy costs no more memory either way; with ``row_kernel`` they stay
        rows, as the kernel reads them."""
        pick = (lambda a: None if a is None else mx.contiguous(a[ids]))
        if self.row_kernel:
            return HeadTensors(pick(self.weight), bias=pick(self.bias), row_kernel=True)
        if self.scales is None and not self.transposed:
            return HeadTensors(mx.contiguous(self.weight[ids].T), bias=pick(self.bias),
                               transposed=True)
        return HeadTensors(pick(self.weight), pick(self.scales), pick(self.biases),
                           pick(self.bias), self.group_size, self.bits, self.mode)

    def matmul(self, x: mx.array, start: int = 0, stop: Optional[int] = None) -> mx.array:
        """``x @ rows[start:stop].T`` (+ bias): the same op the module itself runs."""
        s = slice(start, stop)
        if self.bf16:
            out = bf16_weights.bf16_products(x, self.weight[s], self.threads)
        elif self.row_kernel and start == 0 and stop is None:
            out = row_kernel.products(x, self.weight, self.weight.shape[0])
        elif self.transposed:
            out = x @ self.weight[:, s]
        elif self.scales is not None:
            out = mx.quantized_matmul(
                x, self.weight[s], scales=self.scales[s],
                biases=None if self.biases is None else self.biases[s], transpose=True,
                group_size=self.group_size, bits=self.bits, mode=self.mode)
        else:
            out = x @ self.weight[s].T
        return out if self.bias is None else out + self.bias[s]

    def to_bf16(self, ids: Optional[mx.array] = None) -> "HeadTensors":
        """Rows ``ids`` (all rows: None) as a bfloat16 copy for the bf16 kernel (unquantized,
        untransposed rows only); only the rows taken are copied."""
        w = self.weight if ids is None else self.weight[ids]
        bias = self.bias if ids is None or self.bias is None else mx.contiguous(self.bias[ids])
        w = bf16_weights.bf16_weight(w)
        return HeadTensors(w, bias=bias, bf16=True, threads=bf16_weights.bf16_threads(w))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.weight, self.scales, self.biases, self.bias)
                   if a is not None)


def chunked_argmax(x: mx.array, head: HeadTensors, chunk: int) -> mx.array:
    """``argmax(x @ head.T, axis=-1)`` for ``x [B, H]`` without the full logits row: project
    ``chunk`` rows at a time, keep each chunk's max and first argmax, then take the first chunk
    holding the overall max (ties resolve to the lowest id, as ``mx.argmax`` does)."""
    maxes, args = [], []
    for start in range(0, head.rows, chunk):
        logits = head.matmul(x, start, start + chunk)
        maxes.append(mx.max(logits, axis=-1))
        args.append(mx.argmax(logits, axis=-1) + start)
    best = mx.argmax(mx.stack(maxes, axis=-1), axis=-1, keepdims=True)
    return mx.take_along_axis(mx.stack(args, axis=-1), best, axis=-1)[..., 0]


class DraftLMHead:
    """``project(x)``: the drafter's logits ``[B, Vd]`` (column c is target id ``ids[c]``, or c
    itself when ``ids`` is None); ``argmax(x)``: the target ids of their argmax ``[B]``.

    With neither a reduced vocabulary nor fusing, both are exactly the target's own LM head.
    """

    def __init__(self, target, ids: Optional[mx.array] = None, fused: bool = False,
                 chunk: int = 8192, rows_by_kernel: bool = False, bf16: bool = False):
        self.target = target
        self.ids = None if ids is None else ids.astype(mx.uint32)
        self.fused = fused
        self.chunk = chunk
        if (ids is not None or fused) and getattr(target, "head_group", None) is not None:
            raise MTPError("a reduced draft vocabulary (--draft-vocab) or the fused draft argmax "
                           "needs the whole LM head: not available with --split tensor on a "
                           "target whose LM head is not tied (mlx-lm splits it by vocabulary)")
        full = HeadTensors.of(target.lm_head_module)
        # ``rows_by_kernel``: the row kernel (``drafter_products``) for an unquantized head it takes
        # whole; not for the fused chunked argmax, which projects row chunks
        rows = full.rows if ids is None else ids.shape[0]
        full.row_kernel = (rows_by_kernel and not fused and full.scales is None
                           and full.bias is None and drafter_products.fits(rows, full.weight.dtype))
        if bf16 and full.scales is None and self.whole:  # ``drafter_products``: bfloat16 rows
            self.tensors = full.to_bf16(self.ids)
        else:
            self.tensors = full if ids is None else full.take(self.ids)
        if ids is not None:
            mx.eval(self.tensors.weight, self.tensors.scales, self.tensors.biases)

    @property
    def size(self) -> int:
        return self.target.vocab_size if self.ids is None else self.tensors.rows

    def project(self, x: mx.array) -> mx.array:
        if self.ids is None and not self.tensors.bf16:
            return self.target.logits(x)
        return self.tensors.matmul(x)

    @property
    def whole(self) -> bool:
        """Whether ``tensors`` hold the whole head (not one rank's vocabulary slice)."""
        return getattr(self.target, "head_group", None) is None

    def pick(self, x: mx.array):
        """``(target ids of the argmax [B], logits [B, Vd])`` from ``tensors`` alone (no profiler,
        no module call): what the drafter's compiled step traces. Needs ``whole``."""
        logits = self.tensors.matmul(x)
        return self.to_target(mx.argmax(logits, axis=-1)), logits

    def to_target(self, cols: mx.array) -> mx.array:
        return cols if self.ids is None else self.ids[cols]

    def argmax(self, x: mx.array, profiler, fused: Optional[bool] = None):
        """``(target ids of the argmax [B], logits [B, Vd] or None when fused)``; ``profiler``
        times the projection and the argmax (one stage when fused). ``fused`` False: the logits
        row even where the head fuses (a pick after logits processors needs it)."""
        logits = None
        if self.fused if fused is None else fused:
            cols = chunked_argmax(x, self.tensors, self.chunk)
            profiler.stage("lm_head", cols)
        else:
            logits = self.project(x)
            profiler.stage("lm_head", logits)
            cols = mx.argmax(logits, axis=-1)
        tok = self.to_target(cols)
        profiler.stage("sample", tok)
        return tok, logits
