"""The GatedDeltaNet recurrence of T tokens (every step's state returned) as one C kernel
(``mlx_mtp/cpu/csrc/gdn_steps.c``) in the float operations of mlx-lm's one-token step, one pass
over the state per token; ``gdn_block`` uses it for a layer only where a check says it equals
mlx-lm's ops bitwise. Built by ``mlx_mtp.cpu.native``; a lazy op where ``mlx_mtp.cpu.lazy_ops``
builds, else eager (a host sync). ``MLX_MTP_GDN_KERNEL=0`` (or ``MLX_MTP_ROW_KERNEL=0``) turns it
off. docs/cpu-backend.md, "The verify on the CPU"."""

from __future__ import annotations

import ctypes
from typing import List, Tuple

import mlx.core as mx
import numpy as np

from mlx_mtp.cpu import pin as cpu_pin
from mlx_mtp.cpu import lazy_ops as lazy_kernels
from mlx_mtp.cpu import native

ENV = "MLX_MTP_GDN_KERNEL"
FLAGS = native.GDN_STEPS_FLAGS
ABI = 1  # gdn_steps_abi() of the source this module calls


def _bind(lib) -> None:
    ptr, ssize = ctypes.c_void_p, ctypes.c_ssize_t
    lib.gdn_steps_f32.restype = ctypes.c_int
    lib.gdn_steps_f32.argtypes = [ptr] * 8 + [ssize] * 6


KERNEL = native.NativeKernel("gdn_steps.c", "gdn_steps", ABI, FLAGS, _bind,
                             switches=(native.ALL_ENV, ENV))


def available() -> bool:
    return KERNEL.available()


def reason() -> str:
    """Why the kernel is unavailable ("" when it is available)."""
    return KERNEL.reason()


def _host(x: mx.array) -> np.ndarray:
    """A C-contiguous float32 numpy array of evaluated ``x`` (zero-copy where it is one)."""
    view = np.asarray(memoryview(x))
    if view.dtype != np.float32:
        raise ValueError(f"gdn kernel: needs float32 inputs, got {view.dtype}")
    return np.ascontiguousarray(view)


def states(q, k, v, g, beta, state) -> Tuple[mx.array, List[mx.array]]:
    """``gdn_block.reference_states`` from its recurrence's inputs (q, k [B,T,Hk,Dk] not
    repeated to the value heads, v [B,T,Hv,Dv], g and beta [B,T,Hv], state [B,Hv,Dv,Dk]):
    ``(y [B,T,Hv,Dv], [state_1..state_T])``: lazy where ``mlx_mtp.cpu.lazy_ops`` is available, else
    computed eagerly (the inputs evaluated, a host sync)."""
    lib = KERNEL.load()
    if lib is None:
        raise RuntimeError(f"gdn kernel unavailable: {KERNEL.why}")
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if (k.shape != q.shape or v.shape[:2] != (B, T) or g.shape != (B, T, Hv)
            or beta.shape != (B, T, Hv) or state.shape != (B, Hv, Dv, Dk) or Hv % Hk):
        raise ValueError(f"gdn kernel: shapes q {q.shape} k {k.shape} v {v.shape} g {g.shape} "
                         f"beta {beta.shape} state {state.shape} do not fit")
    odd = next((x.dtype for x in (q, k, v, g, beta, state) if x.dtype != mx.float32), None)
    if odd is not None:
        raise ValueError(f"gdn kernel: needs float32 inputs, got {odd}")
    ops = lazy_kernels.load()
    if ops is not None:
        y, *steps = ops.gdn_steps(q, k, v, g, beta, state)
        return y, steps
    cpu_pin.hold()  # inside a verify: the threads onto one core before the sync (mlx_mtp.cpu.pin)
    mx.eval(q, k, v, g, beta, state)
    inputs = [_host(x) for x in (q, k, v, g, beta, state)]
    y = np.empty((B, T, Hv, Dv), np.float32)
    out = np.empty((T, B, Hv, Dv, Dk), np.float32)
    rc = lib.gdn_steps_f32(*(x.ctypes.data for x in inputs), y.ctypes.data, out.ctypes.data,
                           B, T, Hk, Hv, Dk, Dv)
    if rc:
        raise RuntimeError(f"gdn kernel failed ({rc}) for q {q.shape} v {v.shape}")
    # One array per step (copies): MLX slices of one [T, ...] array cost several times more to
    # evaluate here than a copy of each step.
    return mx.array(y), [mx.array(out[t]) for t in range(T)]
