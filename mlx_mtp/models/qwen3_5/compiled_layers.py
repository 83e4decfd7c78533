"""The rest of a Qwen decoder layer's verify (``gdn_block`` compiles the GatedDeltaNet middle) as
compiled graphs per width, layer shape and dtype: the RMSNorms (``VerifyRMSNorm``), the layer's
tail after its mixer (``tail``: ``WHOLE``, the MLP's products inside, or ``SPLIT`` around them),
and the gated attention's parts before its cache update and after its attention. Inside
``compiling()`` (a verify and the loop's one-token steps) each runs compiled where a check of its
signature, on seeded inputs with the layer's own weights, finds it bitwise equal to mlx-lm's ops;
else the ops run. docs/cpu-backend.md, "The verify on the CPU"."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3_5 as _qwen3_5
from mlx_lm.models import qwen3_next as _qwen3_next
from mlx_lm.models.activations import swiglu

from mlx_mtp.exactness import row_exact_layers
from mlx_mtp.exactness.row_exact_layers import bitwise_equal
from mlx_mtp.scoped_switch import ScopedSwitch

# False: every piece runs as the ops, to compare the two paths in one process (tests,
# benchmarks/verify_arms.py's ``uncompiled_layers`` arm); nothing user-facing sets it.
enabled = True
_compiling = ScopedSwitch()  # on inside a verify (``mlx_mtp.scoped_switch``)
# Per process: keyed by the piece, its settings and its inputs' device, shapes and dtypes, so
# every layer (of every model) with that signature shares them.
_compiled: Dict[Tuple, Callable] = {}  # signature -> the compiled piece
_checked: Dict[Tuple, object] = {}  # signature -> the choice (or True / False)

WHOLE, SPLIT = "whole", "split"


def compiling():
    """Inside a verify: the pieces run compiled where their check passed."""
    return _compiling.open()


def active() -> bool:
    return enabled and bool(_compiling)


def _ops():
    """The uncompiled reference, inside ``compiling()`` (for the checks)."""
    return _compiling.suspended()


TRANSPOSED = "transposed"


def product_rows(linear, T: int):
    """How ``linear`` computes a T-row input here, as products that can sit inside a compiled
    graph: T (its own product ``x @ W.T``: an ``nn.Linear`` without bias, not switched to
    row-exact products at this width in this verify), fewer (a row-exact layer ``chunked`` at
    this width: ``x @ W.T`` on chunks of at most that many rows, ``row_exact_layers.chunks``),
    ``TRANSPOSED`` (``row_exact_layers.transposed_products``), or 0 (none of these: the layer's own
    call, outside the graph)."""
    if "bias" in linear:
        return 0
    if type(linear) is nn.Linear:
        return T
    if type(linear) is row_exact_layers.RowExactLinear:
        if not row_exact_layers.active() or T < linear.exact_from:
            return T
        if linear.use_kernel:
            return 0
        if linear.transposed:
            return TRANSPOSED
        if linear.chunk_rows:
            return linear.chunk_rows
    return 0


def _rows_of(linears, T: int) -> Optional[Tuple]:
    """``product_rows`` of each of ``linears``, or None where one cannot sit in a graph."""
    rows = tuple(product_rows(p, T) for p in linears)
    return rows if all(rows) else None


def _mm(x: mx.array, w: mx.array, most) -> mx.array:
    """``x @ w.T`` as ``product_rows`` says: whole, transposed, or on chunks of at most ``most``
    rows."""
    T = x.shape[-2]
    if most == TRANSPOSED:
        return row_exact_layers.transposed_products(x, w)
    if most >= T:
        return x @ w.T
    return mx.concatenate([x[..., a:b, :] @ w.T for a, b in row_exact_layers.chunks(T, most)],
                          axis=-2)


def _sig(*arrays) -> Tuple:
    return (str(mx.default_device()),) + tuple((tuple(x.shape), str(x.dtype)) for x in arrays)


def _arrays(module) -> List[mx.array]:
    """Every parameter array of ``module`` (a signature's weights: a projection may be wrapped,
    e.g. an adapter's ``LoRALinear`` holds its weight under ``linear``)."""
    return [a for _, a in tree_flatten(module.parameters())]


def _random_like(arrays: List[mx.array], seed: int) -> List[mx.array]:
    keys = mx.random.split(mx.random.key(seed), len(arrays))
    return [mx.random.normal(x.shape, key=k).astype(x.dtype) for x, k in zip(arrays, keys)]


def _all_equal(ref, new) -> bool:
    ref = ref if isinstance(ref, (tuple, list)) else (ref,)
    new = new if isinstance(new, (tuple, list)) else (new,)
    mx.eval(ref, new)
    return len(ref) == len(new) and all(bitwise_equal(a, b) for a, b in zip(ref, new))


def _memo(module, key: Tuple, choose: Callable[[], object]):
    """``choose()`` once per ``key`` on this module: the signature checks below build their keys
    from every weight's shape, too slow to do on every call (a verify makes ~50 of these calls)."""
    memo = module.__dict__.setdefault("_compiled_layers_memo", {})  # an attribute, no parameter
    key = key + (mx.default_device() == mx.cpu, row_exact_layers.active())
    if key not in memo:
        memo[key] = choose()
    return memo[key]


def _compile(key: Tuple, make: Callable[[], Callable]) -> Callable:
    fn = _compiled.get(key)
    if fn is None:
        fn = _compiled[key] = mx.compile(make())
    return fn


# --- RMSNorm ---------------------------------------------------------------------------------

def _norm_fn(eps: float) -> Callable:
    return _compile(("norm", eps), lambda: lambda x, w: mx.fast.rms_norm(x, w, eps))


def norm_equal(x: mx.array, weight: mx.array, eps: float) -> bool:
    """Whether the compiled norm equals ``mx.fast.rms_norm`` for this signature, checked once
    on seeded inputs with ``weight``."""
    key = ("norm", eps) + _sig(x, weight)
    if key not in _checked:
        (xr,) = _random_like([x], 2461)
        _checked[key] = _all_equal(mx.fast.rms_norm(xr, weight, eps), _norm_fn(eps)(xr, weight))
    return _checked[key]


class VerifyRMSNorm(nn.RMSNorm):
    """mlx's RMSNorm; inside a verify, compiled where ``norm_equal``."""

    def __call__(self, x):
        if active() and _memo(self, (x.shape, x.dtype),
                              lambda: norm_equal(x, self["weight"], self.eps)):
            return _norm_fn(self.eps)(x, self["weight"])
        return super().__call__(x)


# --- the decoder layer's tail: residual, norm, MLP, residual ----------------------------------

def reference_tail(layer, x: mx.array, r: mx.array) -> mx.array:
    """mlx-lm's ``DecoderLayer.__call__`` after its mixer, op for op."""
    h = x + r
    return h + layer.mlp(nn.RMSNorm.__call__(layer.post_attention_layernorm, h))


def _mlp_plain(layer, T: int) -> Optional[Tuple]:
    """The MLP's three ``product_rows`` where all can sit inside a graph, else None."""
    mlp = layer.mlp
    if type(mlp) is not _qwen3_next.Qwen3NextMLP:
        return None
    return _rows_of((mlp.gate_proj, mlp.up_proj, mlp.down_proj), T)


def _whole_fn(eps: float, rows: Tuple) -> Callable:
    g, u, d = rows

    def tail(x, r, norm_w, gate_w, up_w, down_w):
        h = x + r
        n = mx.fast.rms_norm(h, norm_w, eps)
        return h + _mm(swiglu(_mm(n, gate_w, g), _mm(n, up_w, u)), down_w, d)

    return _compile(("tail", WHOLE, eps, rows), lambda: tail)


def _residual_norm_fn(eps: float) -> Callable:
    def residual_norm(x, r, norm_w):
        h = x + r
        return h, mx.fast.rms_norm(h, norm_w, eps)

    return _compile(("tail", SPLIT, eps), lambda: residual_norm)


def _swiglu_fn() -> Callable:
    return _compile(("swiglu",), lambda: swiglu)


def compiled_tail(layer, x: mx.array, r: mx.array, choice: str) -> mx.array:
    """``reference_tail`` through the compiled graphs of ``choice`` (unchecked: see ``tail``)."""
    norm = layer.post_attention_layernorm
    mlp = layer.mlp
    if choice == WHOLE:
        whole = _whole_fn(norm.eps, _mlp_plain(layer, x.shape[-2]))
        return whole(x, r, norm["weight"], mlp.gate_proj["weight"],
                     mlp.up_proj["weight"], mlp.down_proj["weight"])
    h, n = _residual_norm_fn(norm.eps)(x, r, norm["weight"])
    if type(mlp) is _qwen3_next.Qwen3NextMLP:
        return h + mlp.down_proj(_swiglu_fn()(mlp.gate_proj(n), mlp.up_proj(n)))
    return h + mlp(n)  # another MLP (a mixture of experts): its own ops


def tail_choice(layer, x: mx.array, r: mx.array) -> Optional[str]:
    """``WHOLE`` (where the MLP's products are plain at this width) or ``SPLIT``, whichever
    first equals ``reference_tail`` bitwise for this signature on seeded inputs with the layer's
    own weights (and its row-exact state); else None (the ops). Checked once per signature."""
    T = x.shape[-2]
    whole = _mlp_plain(layer, T)  # the products' rows are in the key: they shape the graph
    weights = [layer.post_attention_layernorm["weight"], *_arrays(layer.mlp)]
    key = ("tail", whole, type(layer.mlp).__name__, layer.post_attention_layernorm.eps,
           row_exact_layers.active()) + _sig(x, r, *weights)
    if key not in _checked:
        xr, rr = _random_like([x, r], 1753)
        with _ops():
            ref = reference_tail(layer, xr, rr)
        _checked[key] = next((c for c in ((WHOLE, SPLIT) if whole else (SPLIT,))
                              if _all_equal(ref, compiled_tail(layer, xr, rr, c))), None)
    return _checked[key]


def tail(layer, x: mx.array, r: mx.array) -> mx.array:
    """``reference_tail``, through ``tail_choice``'s compiled graphs where there is one."""
    # whether the MLP's products are plain at this width is in the key: ``prepare`` (or a
    # test's switch) can move a projection to row-exact products after a choice was memoised
    choice = _memo(layer, (x.shape, x.dtype, r.shape, r.dtype, _mlp_plain(layer, x.shape[-2])),
                   lambda: tail_choice(layer, x, r))
    return reference_tail(layer, x, r) if choice is None else compiled_tail(layer, x, r, choice)


class VerifyDecoderLayer:
    """Mixin for mlx-lm's decoder layer: inside a verify, the input norm (``VerifyRMSNorm``)
    and the tail (``tail``) compiled; otherwise the parent's forward."""

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None):
        if not active():
            return super().__call__(x, mask, cache)
        mixer = self.linear_attn if self.is_linear else self.self_attn
        return tail(self, x, mixer(self.input_layernorm(x), mask, cache))


class Qwen3_5VerifyDecoderLayer(VerifyDecoderLayer, _qwen3_5.DecoderLayer):
    pass


class Qwen3NextVerifyDecoderLayer(VerifyDecoderLayer, _qwen3_next.Qwen3NextDecoderLayer):
    pass


VERIFY_LAYER = {
    _qwen3_5.DecoderLayer: Qwen3_5VerifyDecoderLayer,
    _qwen3_next.Qwen3NextDecoderLayer: Qwen3NextVerifyDecoderLayer,
}


def switch_to_compiled(trunk, layers) -> int:
    """Swap the classes of ``layers`` (mlx-lm decoder layers) and of the RMSNorms they and the
    trunk's final norm hold (``VerifyRMSNorm``), where their class is exactly mlx-lm's. Returns
    how many decoder layers were swapped."""
    swapped = 0
    for layer in layers:
        cls = VERIFY_LAYER.get(type(layer))
        if cls is not None:
            layer.__class__ = cls
            swapped += 1
        for _, m in layer.named_modules():
            if type(m) is nn.RMSNorm:
                m.__class__ = VerifyRMSNorm
    if type(getattr(trunk, "norm", None)) is nn.RMSNorm:
        trunk.norm.__class__ = VerifyRMSNorm
    return swapped


# --- the gated attention before and after its KV-cache update ----------------------------------

def _heads(qp, kp, vp, q_w, k_w, shape: Tuple):
    """mlx-lm's ``Qwen3NextAttention.__call__`` from the projections to the pre-rope heads
    (``shape``: heads, KV heads, the q and k norms' eps)."""
    H, KVH, q_eps, k_eps = shape
    B, L, _ = qp.shape
    queries, gate = mx.split(qp.reshape(B, L, H, -1), 2, axis=-1)
    gate = gate.reshape(B, L, -1)
    queries = mx.fast.rms_norm(queries, q_w, q_eps).transpose(0, 2, 1, 3)
    keys = mx.fast.rms_norm(kp.reshape(B, L, KVH, -1), k_w, k_eps).transpose(0, 2, 1, 3)
    values = vp.reshape(B, L, KVH, -1).transpose(0, 2, 1, 3)
    return queries, gate, keys, values


def _attn_shape(layer) -> Tuple:
    return (layer.num_attention_heads, layer.num_key_value_heads, layer.q_norm.eps,
            layer.k_norm.eps)


def rope_inside(layer) -> bool:
    """Whether the layer's rope is ``nn.RoPE`` (``mx.fast.rope``), which the compiled part can
    run with the offset as an input array: MLX's rope turns an int offset into an array itself,
    and computes the same ops (``test_compiled_layers`` checks offsets 0..4099 and beyond)."""
    return type(layer.rope) is nn.RoPE


def _rope(rope: Tuple, x, offset):
    dims, traditional, base, scale = rope
    return mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset)


def reference_pre(layer, x: mx.array, offset: int):
    """``(queries, gate, keys, values)`` as mlx-lm computes them before the cache update (the
    rope at ``offset``)."""
    queries, gate, keys, values = _heads(layer.q_proj(x), layer.k_proj(x), layer.v_proj(x),
                                         layer.q_norm["weight"], layer.k_norm["weight"],
                                         _attn_shape(layer))
    return layer.rope(queries, offset=offset), gate, layer.rope(keys, offset=offset), values


def tree_pre(layer, x: mx.array, positions: List[int]):
    """``reference_pre`` for rows at their own ``positions`` (a draft tree's nodes): each run of
    rows at consecutive positions gets one rope call at its first position, as a chain does."""
    queries, gate, keys, values = _heads(layer.q_proj(x), layer.k_proj(x), layer.v_proj(x),
                                         layer.q_norm["weight"], layer.k_norm["weight"],
                                         _attn_shape(layer))
    runs, start = [], 0
    for i in range(1, len(positions) + 1):
        if i == len(positions) or positions[i] != positions[i - 1] + 1:
            runs.append((start, i))
            start = i
    if len(runs) == 1:
        at = positions[0]
        return layer.rope(queries, offset=at), gate, layer.rope(keys, offset=at), values
    q = mx.concatenate([layer.rope(queries[:, :, a:b], offset=positions[a]) for a, b in runs],
                       axis=2)
    k = mx.concatenate([layer.rope(keys[:, :, a:b], offset=positions[a]) for a, b in runs],
                       axis=2)
    return q, gate, k, values


def _attn_plain(layer, T: int, projections) -> Optional[Tuple]:
    return _rows_of([getattr(layer, p) for p in projections], T)


def compiled_pre(layer, x: mx.array, inside: bool, offset: int):
    """``reference_pre`` compiled; ``inside``: with the q/k/v products in the graph; the rope
    too where ``rope_inside`` (else after the graph, as mlx-lm's ops)."""
    shape = _attn_shape(layer)
    rope = ((layer.rope.dims, layer.rope.traditional, layer.rope.base, layer.rope.scale)
            if rope_inside(layer) else None)

    def heads(qp, kp, vp, qn, kn, offset):
        queries, gate, keys, values = _heads(qp, kp, vp, qn, kn, shape)
        if rope is not None:
            queries, keys = _rope(rope, queries, offset), _rope(rope, keys, offset)
        return queries, gate, keys, values

    q_w, k_w = layer.q_norm["weight"], layer.k_norm["weight"]
    at = mx.array(offset, dtype=mx.int32)
    if inside:
        q, k, v = _attn_plain(layer, x.shape[-2], ("q_proj", "k_proj", "v_proj"))
        fn = _compile(("attn_pre", True, shape, rope, q, k, v),
                      lambda: lambda x, wq, wk, wv, qn, kn, o:
                      heads(_mm(x, wq, q), _mm(x, wk, k), _mm(x, wv, v), qn, kn, o))
        out = fn(x, layer.q_proj["weight"], layer.k_proj["weight"], layer.v_proj["weight"],
                 q_w, k_w, at)
    else:
        fn = _compile(("attn_pre", False, shape, rope), lambda: heads)
        out = fn(layer.q_proj(x), layer.k_proj(x), layer.v_proj(x), q_w, k_w, at)
    if rope is not None:
        return out
    queries, gate, keys, values = out
    return layer.rope(queries, offset=offset), gate, layer.rope(keys, offset=offset), values


def _merge(rows, gate):
    B, L, _ = gate.shape
    return mx.concatenate(rows, axis=2).transpose(0, 2, 1, 3).reshape(B, L, -1) * mx.sigmoid(gate)


def reference_post(layer, rows: List[mx.array], gate: mx.array) -> mx.array:
    """mlx-lm's attention after the SDPA: merge the heads, the sigmoid gate, the out product."""
    B, L, _ = gate.shape
    output = mx.concatenate(rows, axis=2).transpose(0, 2, 1, 3).reshape(B, L, -1)
    return layer.o_proj(output * mx.sigmoid(gate))


def compiled_post(layer, rows: List[mx.array], gate: mx.array, inside: bool) -> mx.array:
    """``reference_post`` compiled; ``inside``: with the out product in the graph."""
    if inside:
        (o,) = _attn_plain(layer, gate.shape[-2], ("o_proj",))
        fn = _compile(("attn_post", True, o),
                      lambda: lambda rows, gate, wo: _mm(_merge(rows, gate), wo, o))
        return fn(rows, gate, layer.o_proj["weight"])
    return layer.o_proj(_compile(("attn_post", False), lambda: _merge)(rows, gate))


def attention_choice(layer, x: mx.array, rows: int) -> Tuple[Optional[bool], Optional[bool]]:
    """For the pre and post parts: True (compiled, products inside), False (compiled, products
    outside) or None (the ops), each the first that equals the reference bitwise for this
    signature (``rows``: how many SDPA outputs the post part merges), on seeded inputs with the
    layer's own weights. Checked once per signature."""
    B, L, _ = x.shape
    weights = [a for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
               for a in _arrays(layer[n])]
    plain_pre = _attn_plain(layer, L, ("q_proj", "k_proj", "v_proj"))
    plain_post = _attn_plain(layer, L, ("o_proj",))
    key = ("attn", rows, row_exact_layers.active(), plain_pre, plain_post,
           layer.num_attention_heads, layer.num_key_value_heads, layer.q_norm.eps,
           layer.k_norm.eps,
           *("bias" in layer[n] for n in ("q_proj", "k_proj", "v_proj", "o_proj"))) + _sig(x, *weights)
    if key not in _checked:
        (xr,) = _random_like([x], 3167)
        offsets = (0, 4103)  # the rope at two positions (one past float16's exact integers)
        with _ops():
            ref = [y for o in offsets for y in reference_pre(layer, xr, o)]
        pre = _first_equal(ref, lambda inside: [y for o in offsets
                                                for y in compiled_pre(layer, xr, inside, o)],
                           plain_pre)
        q, gate = ref[0], ref[1]
        H, D = q.shape[1], q.shape[-1]  # the SDPA's output has the queries' shape
        widths = [L // rows + (i < L % rows) for i in range(rows)]
        outs = _random_like([mx.zeros((B, H, w, D), dtype=q.dtype) for w in widths], 3169)
        with _ops():
            ref_post = reference_post(layer, outs, gate)
        post = _first_equal(ref_post, lambda inside: compiled_post(layer, outs, gate, inside),
                            plain_post)
        _checked[key] = (pre, post)
    return _checked[key]


def attention_choices(layer, x: mx.array, rows: int) -> Tuple[Optional[bool], Optional[bool]]:
    """``attention_choice``, looked up once per layer and input shape."""
    L = x.shape[-2]
    plain = (_attn_plain(layer, L, ("q_proj", "k_proj", "v_proj")), _attn_plain(layer, L, ("o_proj",)))
    return _memo(layer, (x.shape, x.dtype, rows, plain), lambda: attention_choice(layer, x, rows))


def _first_equal(ref, fn, plain) -> Optional[bool]:
    return next((inside for inside in ((True, False) if plain else (False,))
                 if _all_equal(ref, fn(inside))), None)
