"""A GatedDeltaNet layer's verify of T tokens, between its projections, as one ``mx.compile``d
graph per T and layer shape (``capture_mixer``), or on large states with the recurrence in the C
kernel (``gdn_kernel``) between two compiled graphs (``kernel_mixer``, where ``kernel_pays``);
and a prompt's prefill with its recurrence in that kernel (``prefill_recurrence``). Each is used,
per signature, only where a check on seeded inputs with the layer's own weights finds it bitwise
equal to mlx-lm's ops (``reference_mixer``). docs/cpu-backend.md, "The verify on the CPU" and
"The prefill on the CPU"."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import precise_swiglu
# _gated_delta_step_ops: mlx-lm's compiled one-token step, which gated_delta_ops loops over and
# exports under no public name; the stash keeps each step's state, so it calls the step itself
from mlx_lm.models.gated_delta import (_gated_delta_step_ops, compute_g, gated_delta_ops,
                                       normalize_qk)
from mlx_lm.models.qwen3_next import Qwen3NextRMSNormGated

from mlx_mtp.cpu import lazy_ops as lazy_kernels
from mlx_mtp.exactness.row_exact_layers import bitwise_equal
from mlx_mtp.models.qwen3_5 import gdn_kernel

_compiled: Dict[object, Callable] = {}
_checked: Dict[Tuple, Optional[str]] = {}  # signature -> mixer_choice


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
            # The decayed state is computed twice (IEEE products commute bitwise): inside the
            # kernel that feeds the k-sum and inside the update, so it is never a kernel of its
            # own. Written as g * state the second time, or compile would merge the two.
            kv_mem = ((state * gs[t]) * ks[t]).sum(axis=-1, keepdims=True)
            delta = (vs[t] - kv_mem) * bs[t]
            state = (gs[t] * state) + ks[t] * delta
            ys.append((state * qs[t]).sum(axis=-1))
            states.append(state.squeeze(1))
        return (mx.concatenate(ys, axis=1), *states)

    fn = _compiled[T] = mx.compile(steps)
    return fn


def compiled_states(q, k, v, a, b, A_log, dt_bias, state):
    """``reference_states`` through the compiled block (unchecked; ``capture_mixer`` checks)."""
    if state is None:
        B, _, _, Dk = q.shape
        Hv, Dv = v.shape[-2:]
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    y, *states = _block(q.shape[1])(q, k, v, a, b, A_log, dt_bias, state)
    return y, states


Mixed = Tuple[mx.array, mx.array, mx.array, List[mx.array]]


def _window(conv_state, qkv, K: int):
    """The conv's input (the kept window, then the block) and the window to keep after it."""
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    return conv_input, mx.contiguous(conv_input[:, -(K - 1) :, :])


def _heads(conv_out, B: int, S: int, key_dim: int, Hk: int, Hv: int, Dk: int, Dv: int):
    """silu, the split into q, k, v heads and the q/k norms, as mlx-lm's layer does them."""
    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(mx.split(nn.silu(conv_out), [key_dim, 2 * key_dim], -1),
                           [Hk, Hk, Hv], [Dk, Dk, Dv])
    ]
    q, k = normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
    return q, k, v


def conv_qkv(layer, qkv, conv_state):
    """mlx-lm's ``GatedDeltaNet.__call__`` from the projected ``qkv`` to normalized q, k and v:
    ``(conv input [B,K-1+T,C], the conv window to keep [B,K-1,C], q, k, v)``."""
    B, S, _ = qkv.shape
    conv_input, keep = _window(conv_state, qkv, layer.conv_kernel_size)
    q, k, v = _heads(layer.conv1d(conv_input), B, S, layer.key_dim, layer.num_k_heads,
                     layer.num_v_heads, layer.head_k_dim, layer.head_v_dim)
    return conv_input, keep, q, k, v


def reference_mixer(layer, qkv, z, b, a, conv_state, state) -> Mixed:
    """What the capturing layer computes between its projections, as mlx-lm's
    ``GatedDeltaNet.__call__`` does (unmasked, ops recurrence): ``(gated-normed output [B,T,Hv,Dv],
    conv input [B,K-1+T,C], the conv window to keep [B,K-1,C], [state_1..state_T])``."""
    conv_input, keep, q, k, v = conv_qkv(layer, qkv, conv_state)
    y, states = reference_states(q, k, v, a, b, layer.A_log, layer.dt_bias, state)
    return layer.norm(y, z), conv_input, keep, states


def _shape_of(layer) -> Optional[Tuple]:
    """The layer's hyperparameters the compiled mixer bakes in, or None where it does not apply
    (a conv bias, another gated norm class)."""
    conv, norm = layer.conv1d, layer.norm
    if "bias" in conv or type(norm) is not Qwen3NextRMSNormGated:
        return None
    return (layer.conv_kernel_size, layer.key_dim, layer.num_k_heads, layer.num_v_heads,
            layer.head_k_dim, layer.head_v_dim, norm.eps, conv.stride, conv.padding,
            conv.dilation, conv.groups)


def _taps_apply(layer) -> bool:
    """Whether the layer's conv is depthwise, stride 1, no padding or dilation: one weight per
    channel and tap, so the conv is a sum of K shifted products per channel (``_mixer``)."""
    conv = layer.conv1d
    C, K, per_group = conv.weight.shape
    return ((conv.stride, conv.padding, conv.dilation) == (1, 0, 1) and per_group == 1
            and conv.groups == C == layer.conv_dim and K == layer.conv_kernel_size)


def taps_conv(x: mx.array, w: mx.array, T: int) -> mx.array:
    """A depthwise conv1d (``w`` [C, K, 1], stride 1, no padding) of ``x`` [B, K-1+T, C] as its K
    shifted products summed in tap order from zero: the order MLX's CPU conv sums them in with
    BLIS and the bundled BLAS (not with OpenBLAS). Adding 0.0 first is the sum from zero: a
    window of -0.0 gives +0.0, as the conv does."""
    C, K, _ = w.shape
    w = [t.reshape(C) for t in mx.split(w.reshape(C, K), K, axis=1)]  # views (no gathers)
    out = x[:, 0:T] * w[0] + 0.0
    for j in range(1, K):
        out = out + x[:, j : j + T] * w[j]
    return out


def _conv_heads(qkv, conv_state, conv_w, T: int, shape: Tuple, taps: bool):
    """The conv window, conv (``taps_conv`` or ``mx.conv1d``), silu, head split and q/k norms
    of the compiled mixers: ``(conv_input, keep, q, k, v)``."""
    K, key_dim, Hk, Hv, Dk, Dv, eps, stride, padding, dilation, groups = shape
    conv_input, keep = _window(conv_state, qkv, K)
    conv_out = (taps_conv(conv_input, conv_w, T) if taps else
                mx.conv1d(conv_input, conv_w, stride, padding, dilation, groups))
    q, k, v = _heads(conv_out, qkv.shape[0], T, key_dim, Hk, Hv, Dk, Dv)
    return conv_input, keep, q, k, v


def _gated_norm(y, z, norm_w, eps: float):
    return precise_swiglu(y, z, mx.fast.rms_norm(y, norm_w, eps))  # Qwen3NextRMSNormGated


def _mixer(T: int, shape: Tuple, taps: bool) -> Callable:
    """``reference_mixer`` of T tokens for layers of ``shape``, compiled, weights as inputs:
    ``(qkv, z, b, a, conv_state, state, conv_w, A_log, dt_bias, norm_w) -> (out, conv_input,
    keep, *states)``. ``taps``: the conv as ``taps_conv``, fused with silu; MLX's CPU conv runs
    a depthwise conv as one small product per channel."""
    key = (T, shape, taps)
    fn = _compiled.get(key)
    if fn is not None:
        return fn
    block = _block(T)

    def mixer(qkv, z, b, a, conv_state, state, conv_w, A_log, dt_bias, norm_w):
        conv_input, keep, q, k, v = _conv_heads(qkv, conv_state, conv_w, T, shape, taps)
        y, *states = block(q, k, v, a, b, A_log, dt_bias, state)
        return (_gated_norm(y, z, norm_w, shape[6]), conv_input, keep, *states)

    fn = _compiled[key] = mx.compile(mixer)
    return fn


def _around_kernel(T: int, shape: Tuple, taps: bool) -> Tuple[Callable, Callable]:
    """The compiled mixer split around the recurrence, for ``kernel_mixer``: ``before``
    ``(qkv, b, a, conv_state, conv_w, A_log, dt_bias) -> (conv_input, keep, q, k, v, g, beta)``
    and ``after`` ``(y, z, norm_w) -> out``."""
    key = ("kernel", T, shape, taps)
    fns = _compiled.get(key)
    if fns is not None:
        return fns

    def before(qkv, b, a, conv_state, conv_w, A_log, dt_bias):
        conv_input, keep, q, k, v = _conv_heads(qkv, conv_state, conv_w, T, shape, taps)
        return conv_input, keep, q, k, v, compute_g(A_log, a, dt_bias), mx.sigmoid(b)

    def after(y, z, norm_w):
        return _gated_norm(y, z, norm_w, shape[6])

    fns = _compiled[key] = (mx.compile(before), mx.compile(after))
    return fns


def compiled_mixer(layer, qkv, z, b, a, conv_state, state, taps: bool = False) -> Mixed:
    """``reference_mixer`` through the compiled graph (unchecked: see ``capture_mixer``)."""
    out, conv_input, keep, *states = _mixer(qkv.shape[1], _shape_of(layer), taps)(
        qkv, z, b, a, conv_state, _state_or_zeros(layer, qkv, state), layer.conv1d.weight,
        layer.A_log, layer.dt_bias, layer.norm.weight)
    return out, conv_input, keep, states


def kernel_mixer(layer, qkv, z, b, a, conv_state, state, taps: bool = False) -> Mixed:
    """``reference_mixer`` with the recurrence in the C kernel (``gdn_kernel``) between two
    compiled graphs (unchecked: see ``capture_mixer``). The kernel evaluates its inputs: one
    host sync per layer."""
    before, after = _around_kernel(qkv.shape[1], _shape_of(layer), taps)
    conv_input, keep, q, k, v, g, beta = before(qkv, b, a, conv_state, layer.conv1d.weight,
                                                layer.A_log, layer.dt_bias)
    y, states = gdn_kernel.states(q, k, v, g, beta, _state_or_zeros(layer, qkv, state))
    return after(y, z, layer.norm.weight), conv_input, keep, states


def _state_or_zeros(layer, qkv, state):
    if state is not None:
        return state
    return mx.zeros((qkv.shape[0], layer.num_v_heads, layer.head_v_dim, layer.head_k_dim),
                    dtype=mx.float32)


def _signature(layer, args) -> Tuple:
    arrays = [x for x in args if x is not None] + [layer.conv1d.weight, layer.A_log,
                                                   layer.dt_bias, layer.norm.weight]
    return (_shape_of(layer), args[-1] is None, str(mx.default_device()),
            tuple((x.shape, x.dtype) for x in arrays))


TAPS, CONV = "taps", "conv"  # the compiled mixer, its conv as taps_conv or mx.conv1d
KERNEL_TAPS, KERNEL_CONV = "kernel+taps", "kernel+conv"  # kernel_mixer, its conv likewise
# The eager kernel splits the compiled graph in two around a host sync, and saves time in
# proportion to the state it passes over: T tokens x the recurrent state (B * Hv * Dv * Dk
# floats). Below this many bytes the sync costs more than the kernel saves (chosen by
# measurement on the CPU with benchmarks/verify_arms.py).
KERNEL_MIN_BYTES = 384 * 1024
# As a lazy MLX op (``mlx_mtp.cpu.lazy_ops``) the kernel adds no host sync, so it pays from
# smaller states on (chosen with benchmarks/verify_arms.py too); smaller ones keep the graph.
LAZY_KERNEL_MIN_BYTES = 128 * 1024


def kernel_pays(layer, qkv) -> bool:
    """Whether a verify of these T tokens through this layer is faster with the recurrence in
    the C kernel: T x the recurrent state's bytes at least ``KERNEL_MIN_BYTES`` when it runs
    eagerly, ``LAZY_KERNEL_MIN_BYTES`` (or the former, if smaller) as a lazy op."""
    B, T, _ = qkv.shape
    least = KERNEL_MIN_BYTES
    if least > LAZY_KERNEL_MIN_BYTES and lazy_kernels.available():
        least = LAZY_KERNEL_MIN_BYTES
    return 4 * B * T * layer.num_v_heads * layer.head_v_dim * layer.head_k_dim >= least


def mixer_choice(layer, qkv, z, b, a, conv_state, state) -> Optional[str]:
    """The first of ``KERNEL_TAPS``, ``KERNEL_CONV`` (on the CPU, where the kernel is available
    and pays, ``kernel_pays``), ``TAPS`` (where ``taps_conv`` applies), ``CONV`` (T > 1 only: at one
    token the compiled graph saves nothing) whose mixer equals ``reference_mixer`` for these
    shapes and dtypes on the default device, every output bitwise, on seeded inputs with the
    layer's own weights; else None (the reference). Measured once per signature."""
    shape = _shape_of(layer)
    if shape is None:
        return None
    # The full signature (every input's and weight's shape) costs more to build than the rest
    # of a layer's verify call: looked up per layer by the inputs' shapes first.
    memo = layer.__dict__.setdefault("_mixer_choice_memo", {})  # a plain attribute
    fast = (shape, qkv.shape, qkv.dtype, conv_state.shape, conv_state.dtype,
            None if state is None else (state.shape, state.dtype), z.shape, b.shape, a.shape,
            layer.A_log.dtype, layer.dt_bias.dtype, str(mx.default_device()),
            kernel_pays(layer, qkv), gdn_kernel.available(), id(_checked))
    if fast in memo:
        return memo[fast]
    memo[fast] = choice = _mixer_choice(layer, qkv, z, b, a, conv_state, state)
    return choice


def _mixer_choice(layer, qkv, z, b, a, conv_state, state) -> Optional[str]:
    # A float32 CPU kernel: on a GPU its host copies would cost more than the GPU's own
    # recurrence; in another dtype mlx-lm's ops round where the kernel does not.
    floats = [x for x in (qkv, z, b, a, conv_state, state, layer.A_log, layer.dt_bias)
              if x is not None]
    kernel = (mx.default_device() == mx.cpu and all(x.dtype == mx.float32 for x in floats)
              and kernel_pays(layer, qkv) and gdn_kernel.available())
    key = _signature(layer, (qkv, z, b, a, conv_state, state)) + (kernel,)
    if key not in _checked:
        args = (layer, qkv, z, b, a, conv_state, state)
        taps = _taps_apply(layer)
        _checked[key] = (
            KERNEL_TAPS if kernel and taps and _equal_on_random(*args, taps=True, kernel=True)
            else KERNEL_CONV if kernel and _equal_on_random(*args, taps=False, kernel=True)
            else None if qkv.shape[1] == 1
            else TAPS if taps and _equal_on_random(*args, taps=True)
            else CONV if _equal_on_random(*args, taps=False) else None)
    return _checked[key]


def _equal_on_random(layer, qkv, z, b, a, conv_state, state, taps: bool,
                     kernel: bool = False) -> bool:
    keys = mx.random.split(mx.random.key(1357), 6)

    def like(x, key, scale=1.0):
        return None if x is None else (scale * mx.random.normal(x.shape, key=key)).astype(x.dtype)

    qkv_r, conv_r = like(qkv, keys[0]), like(conv_state, keys[4])
    qkv_r[..., :4] = -0.0  # channels with a window of -0.0 (see taps_conv)
    conv_r[..., :4] = -0.0
    state_r = like(state, keys[5], 0.1)
    if state_r is not None:  # rows of -0.0 (the sums' start, +0.0, shows) and large values
        state_r[..., :2, :] = -0.0
        state_r[..., 2, :] = 1e3 * state_r[..., 2, :]
    args = (qkv_r, like(z, keys[1]), like(b, keys[2]), like(a, keys[3]), conv_r, state_r)
    ref = reference_mixer(layer, *args)
    new = (kernel_mixer if kernel else compiled_mixer)(layer, *args, taps=taps)
    mx.eval(ref, new)
    return (len(ref[3]) == len(new[3])
            and all(bitwise_equal(x, y) for x, y in zip([*ref[:3], *ref[3]], [*new[:3], *new[3]])))


def capture_mixer(layer, qkv, z, b, a, conv_state, state) -> Mixed:
    """``reference_mixer``'s outputs: through the kernel or the compiled graph where
    ``mixer_choice`` found one equal to the reference here, else the reference."""
    choice = mixer_choice(layer, qkv, z, b, a, conv_state, state)
    if choice is None:
        return reference_mixer(layer, qkv, z, b, a, conv_state, state)
    if choice in (KERNEL_TAPS, KERNEL_CONV):
        return kernel_mixer(layer, qkv, z, b, a, conv_state, state, taps=choice == KERNEL_TAPS)
    return compiled_mixer(layer, qkv, z, b, a, conv_state, state, taps=choice == TAPS)


# ------------------------------------------------------------------------------------ prefill
#
# A prompt's prefill runs mlx-lm's layer op for op except its recurrence: mlx-lm's ops loop makes
# 5 passes of elementwise kernels over the state per token, which on a realistic-size layer takes
# about as long as the layer's products. ``prefill_recurrence`` runs those steps in the C kernel
# instead, where ``prefill_kernel_applies`` says so.

# Tokens per kernel call in a prefill: the kernel returns every step's state, so a long prompt is
# fed a block at a time (each block's last state starts the next), keeping the transient states
# to this many times the recurrent state.
PREFILL_BLOCK = 64
_recurrence_checked: Dict[Tuple, bool] = {}  # (head counts and sizes, device) -> equal to the ops


def prefill_kernel_applies(layer, inputs: mx.array) -> bool:
    """Whether a prefill of ``inputs`` ``[B, S, H]`` through this layer runs its recurrence in
    the C kernel (``prefill_recurrence``): on the CPU where mlx-lm runs its ops recurrence, in
    float32, where the kernel pays for these many tokens (``kernel_pays``) and where the kernel's
    steps equal mlx-lm's ops bitwise for this layer's shapes on seeded random inputs (checked
    once per shape and device)."""
    if (mx.default_device() != mx.cpu or layer.training or not gdn_kernel.available()
            or any(x.dtype != mx.float32 for x in (inputs, layer.A_log, layer.dt_bias))
            or not kernel_pays(layer, inputs)):  # (inputs: the same B and T as its qkv)
        return False
    key = (layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim,
           str(mx.default_device()))
    if key not in _recurrence_checked:
        _recurrence_checked[key] = _kernel_equals_ops(layer)
    return _recurrence_checked[key]


def prefill_recurrence(layer, q, k, v, a, b, state, block: Optional[int] = None):
    """mlx-lm's ``gated_delta_update`` (unmasked, ops recurrence) with its steps in the C kernel,
    ``block`` tokens a call (default ``PREFILL_BLOCK``): ``(y [B,T,Hv,Dv], the state after the
    last token)``."""
    block = block or PREFILL_BLOCK
    beta = mx.sigmoid(b)
    g = compute_g(layer.A_log, a, layer.dt_bias)
    if state is None:
        state = mx.zeros((q.shape[0], layer.num_v_heads, layer.head_v_dim, layer.head_k_dim),
                         dtype=mx.float32)
    ys = []
    for t in range(0, q.shape[1], block):
        part = slice(t, t + block)
        y, steps = gdn_kernel.states(q[:, part], k[:, part], v[:, part], g[:, part],
                                     beta[:, part], state)
        ys.append(y)
        state = steps[-1]
    return (ys[0] if len(ys) == 1 else mx.concatenate(ys, axis=1)), state


def _kernel_equals_ops(layer) -> bool:
    """``prefill_recurrence`` (in blocks of 2, so a block's last state starting the next is
    covered) equals mlx-lm's ``gated_delta_ops`` bitwise, output and last state, on seeded
    inputs of this layer's shapes: normalized q and k, a state with rows of -0.0 and of large
    values."""
    Hk, Hv, Dk, Dv, T = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, 5
    keys = mx.random.split(mx.random.key(2468), 6)
    q, k = normalize_qk(mx.random.normal((1, T, Hk, Dk), key=keys[0]),
                        mx.random.normal((1, T, Hk, Dk), key=keys[1]),
                        inv_scale=Dk**-0.5, eps=1e-6)
    v = mx.random.normal((1, T, Hv, Dv), key=keys[2])
    a, b = (mx.random.normal((1, T, Hv), key=key) for key in keys[3:5])
    state = 0.1 * mx.random.normal((1, Hv, Dv, Dk), key=keys[5])
    state[..., :2, :] = -0.0
    state[..., 2, :] = 1e3 * state[..., 2, :]
    y_ref, state_ref = gated_delta_ops(q, k, v, compute_g(layer.A_log, a, layer.dt_bias),
                                       mx.sigmoid(b), state)
    y, state_end = prefill_recurrence(layer, q, k, v, a, b, state, block=2)
    mx.eval(y_ref, state_ref, y, state_end)
    return bitwise_equal(y, y_ref) and bitwise_equal(state_end, state_ref)
