"""Row-exact verify matmuls: buy back block-vs-chain exactness where the matmul kernel needs it.

A verify forward multiplies T rows at once; plain decode multiplies one. Some kernels reduce a
multi-row product differently from a one-row one (measured on the CPU backend: BLIS for input dims
> 512 and for output dims that are not a multiple of 8; OpenBLAS for mid-sized output dims from 4
rows; see ``shared/design/cpu-backend.md``). Then the verify logits are not byte-identical to
decode and T=0 output can drift.

``install`` measures, once per layer shape, whether each linear layer of the target is row-invariant
for every verify width the session may use, on the layer's own weights and kernel. Layers that are
not get a subclass that, only inside ``verifying()``, computes a T-row input one row at a time, which
is exactly what decode does. Everything else keeps the fast multi-row path. The price is one extra
pass over those layers' weights per extra row, so it is cheap for the small projections it usually
hits (GatedDeltaNet's ``in_proj_a`` / ``in_proj_b``) and expensive for big ones; the exactness
probe still has the last word.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

_active = 0


@contextmanager
def verifying():
    global _active
    _active += 1
    try:
        yield
    finally:
        _active -= 1


def active() -> bool:
    return _active > 0


class _RowExact:
    exact_from: int = 2  # widths >= this run row by row inside ``verifying()``

    def __call__(self, x):
        call = super().__call__
        if _active and x.ndim >= 2 and x.shape[-2] >= self.exact_from:
            return _by_rows(call, x)
        return call(x)


class _RowExactEmbedding:
    """A tied LM head (``embed_tokens.as_linear``) is the same product in another method."""

    exact_from: int = 2

    def as_linear(self, x):
        call = super().as_linear
        if _active and x.ndim >= 2 and x.shape[-2] >= self.exact_from:
            return _by_rows(call, x)
        return call(x)


def _by_rows(call, x):
    return mx.concatenate([call(x[..., i : i + 1, :]) for i in range(x.shape[-2])], axis=-2)


class RowExactLinear(_RowExact, nn.Linear):
    pass


class RowExactQuantizedLinear(_RowExact, nn.QuantizedLinear):
    pass


class RowExactEmbedding(_RowExactEmbedding, nn.Embedding):
    pass


class RowExactQuantizedEmbedding(_RowExactEmbedding, nn.QuantizedEmbedding):
    pass


_SWAP = {
    nn.Linear: RowExactLinear,
    nn.QuantizedLinear: RowExactQuantizedLinear,
    nn.Embedding: RowExactEmbedding,
    nn.QuantizedEmbedding: RowExactQuantizedEmbedding,
}
_QUANTIZED = (nn.QuantizedLinear, nn.QuantizedEmbedding)


def _adapter_classes() -> Tuple[type, ...]:
    """mlx-lm's LoRA / DoRA linear wrappers (``mlx_lm.load(adapter_path=...)``): their
    ``x @ lora_a @ lora_b`` is a multi-row product of its own, beside the wrapped layer's."""
    from mlx_lm.tuner.dora import DoRALinear
    from mlx_lm.tuner.lora import LoRALinear

    return (LoRALinear, DoRALinear)


_ROW_EXACT_ADAPTERS: Dict[type, type] = {}


def _row_exact_adapter(cls: type) -> type:
    if cls not in _ROW_EXACT_ADAPTERS:
        _ROW_EXACT_ADAPTERS[cls] = type(f"RowExact{cls.__name__}", (_RowExact, cls), {})
    return _ROW_EXACT_ADAPTERS[cls]


def _signature(base, layer) -> Tuple:
    return (base.__name__,) + tuple(
        (k, tuple(v.shape), str(v.dtype)) for k, v in sorted(tree_flatten(layer.parameters())))


def _install_adapter(layer, base, max_width: int, measured: Dict[Tuple, int]) -> int:
    """An adapter layer: the same measurement, its input the wrapped layer's."""
    sig = _signature(base, layer) + (max_width,)
    if sig not in measured:
        inner = layer.linear
        dtype = inner.scales.dtype if hasattr(inner, "scales") else inner.weight.dtype
        measured[sig] = first_divergent_width(layer, max_width, layer.lora_a.shape[0], dtype)
    width = measured[sig]
    if width:
        layer.__class__ = _row_exact_adapter(base)
        layer.exact_from = width
    elif type(layer) is not base:
        layer.__class__ = base
    return width


def first_divergent_width(fn, max_width: int, in_dims: int, dtype) -> int:
    """Smallest T in 2..max_width at which ``fn`` of a T-row input differs from T one-row calls
    (0 if none)."""
    x = mx.random.normal((1, max_width, in_dims), key=mx.random.key(1234)).astype(dtype)
    rows = [fn(x[:, i : i + 1, :]) for i in range(max_width)]
    mx.eval(rows)
    for T in range(2, max_width + 1):
        block = fn(x[:, :T, :])
        mx.eval(block)
        for i in range(T):
            if bytes(memoryview(block[:, i : i + 1, :])) != bytes(memoryview(rows[i])):
                return T
    return 0


def install(model: nn.Module, max_width: int, tied_head: bool = False) -> Dict[str, int]:
    """Make the target's linear layers (and its embedding, when it is the tied LM head)
    row-exact where they need it, for verify widths up to ``max_width``. Returns
    {module path: first divergent width} for the layers switched."""
    switched: Dict[str, int] = {}
    if max_width < 2:
        return switched
    measured: Dict[Tuple, int] = {}
    adapters = _adapter_classes()
    for path, layer in model.named_modules():
        adapter = next((b for b in type(layer).__mro__ if b in adapters), None)
        if adapter is not None:
            width = _install_adapter(layer, adapter, max_width, measured)
            if width:
                switched[path] = width
            continue
        base = next((b for b in type(layer).__mro__ if b in _SWAP), None)
        if base is None:
            continue
        embedding = issubclass(base, (nn.Embedding, nn.QuantizedEmbedding))
        if embedding and not tied_head:
            continue
        sig = _signature(base, layer) + (max_width,)
        if sig not in measured:  # outside verifying(): the layer's ordinary multi-row path
            quantized = base in _QUANTIZED
            in_dims = layer.weight.shape[1] * (32 // layer.bits if quantized else 1)
            dtype = layer.scales.dtype if quantized else layer.weight.dtype
            fn = layer.as_linear if embedding else layer
            measured[sig] = first_divergent_width(fn, max_width, in_dims, dtype)
        width = measured[sig]
        if width:
            layer.__class__ = _SWAP[base]
            layer.exact_from = width
            switched[path] = width
        elif type(layer) is not base:
            layer.__class__ = base
    return switched
