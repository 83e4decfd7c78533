"""The GatedDeltaNet recurrence of a T-token verify as one compiled graph per T (issue 12).

mlx-lm's ops path (``gated_delta_ops``) runs its compiled one-step op ``_gated_delta_step_ops``
T times from Python: per step 5 slices and squeezes of the inputs, expand-dims inside the op,
three fused kernels and two sums, ~27 graph nodes a step in a verify whose cost at small sizes
is per-node overhead. ``block_states`` computes the same float operations in the same order
with about a third of the nodes: the per-token inputs are split once (``mx.split``, one node),
expanded once for all steps, the sums keep their reduced axis instead of expanding it again,
and the whole block (with ``sigmoid``, ``compute_g`` and the head repeat) is one ``mx.compile``d
function per T, which also fuses each step's elementwise ops.

Equal values are not guaranteed by construction on every backend (fusion and the reduction's
shape are the backend's), so each shape signature is checked once against the per-step
reference (``reference_states``) on seeded random inputs, y and every state bitwise; where it
differs, that signature keeps the per-step path.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import mlx.core as mx
from mlx_lm.models.gated_delta import _gated_delta_step_ops, compute_g

_compiled: Dict[int, Callable] = {}
_checked: Dict[Tuple, bool] = {}


def reference_states(q, k, v, a, b, A_log, dt_bias, state):
    """mlx-lm's ops recurrence (``gated_delta_update`` -> ``gated_delta_ops``, unmasked), op for
    op, except that it returns the state after every token: ``(y [B,T,Hv,Dv], [state_1..state_T])``."""
    beta = mx.sigmoid(b)
    g = compute_g(A_log, a, dt_bias)
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if (repeat := Hv // Hk) > 1:
        q = mx.repeat(q, repeat, -2)
        k = mx.repeat(k, repeat, -2)
    ys, states = [], []
    for t in range(T):
        y, state = _gated_delta_step_ops(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, None)
        ys.append(y)
        states.append(state)
    return mx.stack(ys, axis=1), states


def _block(T: int) -> Callable:
    """The compiled T-step recurrence: ``(q, k, v, a, b, A_log, dt_bias, state) -> (y, *states)``."""
    fn = _compiled.get(T)
    if fn is not None:
        return fn

    def steps(q, k, v, a, b, A_log, dt_bias, state):
        beta = mx.sigmoid(b)
        g = compute_g(A_log, a, dt_bias)
        if (repeat := v.shape[-2] // q.shape[-2]) > 1:
            q = mx.repeat(q, repeat, -2)
            k = mx.repeat(k, repeat, -2)
        # Per step, as _gated_delta_step_ops with scalar gating: shapes [B, 1, Hv, Dv, Dk].
        qs = mx.split(mx.expand_dims(q, -2), T, axis=1)
        ks = mx.split(mx.expand_dims(k, -2), T, axis=1)
        vs = mx.split(mx.expand_dims(v, -1), T, axis=1)
        gs = mx.split(g[..., None, None], T, axis=1)
        bs = mx.split(beta[..., None, None], T, axis=1)
        state = mx.expand_dims(state, 1)
        ys, states = [], []
        for t in range(T):
            state = state * gs[t]
            kv_mem = (state * ks[t]).sum(axis=-1, keepdims=True)
            delta = (vs[t] - kv_mem) * bs[t]
            state = state + ks[t] * delta
            ys.append((state * qs[t]).sum(axis=-1))
            states.append(state.squeeze(1))
        return (mx.concatenate(ys, axis=1), *states)

    fn = _compiled[T] = mx.compile(steps)
    return fn


def compiled_states(q, k, v, a, b, A_log, dt_bias, state):
    """``reference_states`` through the compiled block (unchecked: see ``block_states``)."""
    if state is None:
        B, _, _, Dk = q.shape
        Hv, Dv = v.shape[-2:]
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    y, *states = _block(q.shape[1])(q, k, v, a, b, A_log, dt_bias, state)
    return y, states


def _signature(q, v, a, A_log, dt_bias, state) -> Tuple:
    return (q.shape, q.dtype, v.shape, v.dtype, a.dtype, A_log.dtype, dt_bias.dtype,
            None if state is None else state.dtype, str(mx.default_device()))


def block_equal(q, v, a, A_log, dt_bias, state) -> bool:
    """Whether the compiled block equals the per-step reference, y and every state bitwise, at
    these shapes and dtypes on the default device (seeded random inputs; measured once)."""
    key = _signature(q, v, a, A_log, dt_bias, state)
    found = _checked.get(key)
    if found is None:
        found = _checked[key] = _equal_on_random(q, v, a, A_log, dt_bias, state)
    return found


def _equal_on_random(q, v, a, A_log, dt_bias, state) -> bool:
    rng = mx.random.key(1357)
    keys = mx.random.split(rng, 8)

    def like(x, key, scale=1.0):
        return (scale * mx.random.normal(x.shape, key=key)).astype(x.dtype)

    args = (like(q, keys[0], 0.125), like(q, keys[1], 0.125), like(v, keys[2]), like(a, keys[3]),
            like(a, keys[4]), like(A_log, keys[5]), like(dt_bias, keys[6]),
            None if state is None else like(state, keys[7]))
    y0, s0 = reference_states(*args)
    y1, s1 = compiled_states(*args)
    mx.eval(y0, s0, y1, s1)
    return (_same(y0, y1) and len(s0) == len(s1)
            and all(_same(x, y) for x, y in zip(s0, s1)))


_BITS = {2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def _same(x: mx.array, y: mx.array) -> bool:
    """Bitwise equal (NaNs and signed zeros included)."""
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    bits = _BITS.get(x.dtype.size)
    return bool(mx.array_equal(x.view(bits), y.view(bits)).item()) if bits else \
        bool(mx.array_equal(x, y).item())


def block_states(q, k, v, a, b, A_log, dt_bias, state) -> Tuple[mx.array, List[mx.array]]:
    """``(y, [state_1..state_T])`` of the unmasked recurrence over the T tokens: the compiled
    block where ``block_equal`` says it equals the per-step path here, else the per-step path."""
    if q.shape[1] > 1 and block_equal(q, v, a, A_log, dt_bias, state):
        return compiled_states(q, k, v, a, b, A_log, dt_bias, state)
    return reference_states(q, k, v, a, b, A_log, dt_bias, state)
