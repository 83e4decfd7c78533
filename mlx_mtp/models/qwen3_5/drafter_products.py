"""How the drafter's products run: the BLAS, the row kernel where the BLAS packs few-row products
(``DraftOptions.row_kernel``: None takes it with OpenBLAS only, as benchmarks/bench_drafter.py
measured), or the bf16 kernel on bfloat16 copies of the weights (``DraftOptions.bf16``,
``mlx_mtp.models.bf16_weights``); and an MoE head's experts through the expert kernel. Drafts
may differ from the BLAS's in a near tie, never the output. docs/models.md, "Drafter options"
and "A bfloat16 drafter on the CPU"."""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx

from mlx_lm.models.switch_layers import SwitchGLU

from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.cpu import expert_kernel
from mlx_mtp.cpu import row_kernel
from mlx_mtp.errors import MTPError
from mlx_mtp.exactness import grouped_experts
from mlx_mtp.models import bf16_weights

AUTO_BLAS = ("OpenBLAS",)  # the loaded BLAS libraries ``None`` turns it on for


def problem() -> Optional[str]:
    """Why the row kernel cannot run the drafter's products here (None: it can)."""
    if mx.default_device() == mx.cpu and not row_kernel.available():
        return f"the row kernel is unavailable ({row_kernel.reason()})"
    return bf16_weights.bf16_problem()


def resolve(option: Optional[bool]) -> bool:
    """``DraftOptions.row_kernel``: False off; True on (an error where it cannot run); None on
    where the loaded CPU BLAS is one that packs few-row products and the kernel can run."""
    if option is False:
        return False
    if option is None:
        return cpu_blas.STATE.name in AUTO_BLAS and problem() is None
    why = problem()
    if why is not None:
        raise MTPError(f"draft row kernel (DraftOptions(row_kernel=True)): {why}")
    return True


def fits(rows: int, dtype) -> bool:
    """The kernel takes a weight of ``rows`` outputs whole: float32, whole groups of 8."""
    return dtype == mx.float32 and rows % row_kernel.COLUMN_GROUP == 0


def matmul_for(weight: mx.array, on: bool, bf16: bool = False) -> Callable[[mx.array], mx.array]:
    """``x -> x @ weight.T``: with ``bf16`` through the bf16 kernel on a bfloat16 copy of the
    weight; else through the row kernel if ``on`` and the weight fits, else the BLAS. The weight
    is made row-contiguous once, here."""
    if bf16:
        w16 = bf16_weights.bf16_weight(weight)
        threads = bf16_weights.bf16_threads(w16)

        def by_bf16(x):
            return bf16_weights.bf16_products(x, w16, threads)
        by_bf16.by_kernel = "bf16"
        return by_bf16
    if on and fits(weight.shape[0], weight.dtype):
        w = mx.contiguous(weight)
        mx.eval(w)

        def by_kernel(x):
            return row_kernel.products(x, w, w.shape[0])
        by_kernel.by_kernel = True
        return by_kernel

    def by_blas(x):
        return x @ weight.T
    by_blas.by_kernel = False
    return by_blas


class KernelSwitchGLU(SwitchGLU):
    """mlx-lm's ``SwitchGLU`` in the drafter: every call through the expert kernel
    (``grouped_experts.kernel_call``: an accept hook's rows read each expert once, a draft step's
    experts on every core for large reads), on bfloat16 copies of the stacks where the drafter
    runs in bfloat16 (``kernel_stacks``)."""

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        stacks = self.__dict__.get("kernel_stacks")
        if stacks is None and not grouped_experts.kernel_fits(self):  # quantized since
            return super().__call__(x, indices)
        return grouped_experts.kernel_call(self, x, indices, stacks)


def experts_through_kernel(head, bf16: bool) -> int:
    """Switch the head's mixture-of-experts layers (mlx-lm's ``SwitchGLU``) to
    ``KernelSwitchGLU`` where the expert kernel runs and takes their stacks (with ``bf16``, on
    bfloat16 copies: half the bytes). The sums are BLIS's one-row order, so with BLIS the drafts
    are the BLAS's; with another BLAS a draft may differ in a near tie, never the output. Returns
    how many layers switched."""
    if expert_kernel.problem() is not None:
        return 0
    switched = 0
    for _, m in head.named_modules():
        if type(m) is not SwitchGLU or not grouped_experts.kernel_fits(m):
            continue
        if bf16:
            stacks = tuple(mx.contiguous(p["weight"].astype(mx.bfloat16))
                           for p in (m.up_proj, m.gate_proj, m.down_proj))
            mx.eval(stacks)
            m.__dict__["kernel_stacks"] = stacks  # a plain attribute, not a parameter
        m.__class__ = KernelSwitchGLU
        switched += 1
    return switched
