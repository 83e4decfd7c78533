"""A mixture of experts' verify that reads each routed expert once: mlx-lm's ``SwitchGLU`` with its
rows grouped by expert, every product bitwise the one-token decode's. Inside a verify
(``row_exact_layers.verifying()``, one-token ``Target.decode`` steps too) a switched layer
computes a block by the first method its check accepted for that width (``choose``): ``kernel``,
the expert kernel (``mlx_mtp.cpu.expert_kernel``); ``sorted``, mlx-lm's own one-row calls sorted
by expert; else ``gather``, mlx-lm's call. The check (``switch_to_grouped``, once per layer
signature, on the layer's own weights) compares a method's rows with the layer's one-row calls
bitwise. docs/exactness.md, "Grouped experts".
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchGLU, SwitchLinear

from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.cpu import expert_kernel
from mlx_mtp.exactness import row_exact_layers

KERNEL, SORTED, GATHER = "kernel", "sorted", "gather"
CHECK_TOP_K = 8  # experts per row in the check's routes (the kernel's order does not depend on it)
ALL_ROUTES_TO = 8  # widths up to which every kind of check route runs (beyond: the shared one)


class GroupedSwitchGLU(SwitchGLU):
    """mlx-lm's ``SwitchGLU``; inside a verify, a block of rows by the method ``switch_to_grouped``
    checked for its width (``expert_widths``: width -> ``KERNEL`` or ``SORTED``)."""

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if row_exact_layers.active():
            how = self.__dict__.get("expert_widths", {}).get(rows_of(indices))
            if how == KERNEL:
                return kernel_call(self, x, indices)
            if how == SORTED:
                return sorted_call(self, x, indices)
        return super().__call__(x, indices)


def rows_of(indices: mx.array) -> int:
    """The rows of a ``[..., k]`` route (the verify's width at batch 1)."""
    n = 1
    for d in indices.shape[:-1]:
        n *= d
    return n


def _threads(weight: mx.array, pairs: int) -> int:
    """The kernel's threads for ``pairs`` (row, expert) products with ``weight [E, N, K]``: a
    read of at most ``pairs`` of its experts, which the one-row kernel's rule prices
    (``row_exact_layers.one_row_threads``: every core from ``ONE_ROW_PARALLEL_BYTES`` on); the rows
    beside the read add little work."""
    return row_exact_layers.one_row_threads(weight.nbytes // weight.shape[0]
                                     * min(pairs, weight.shape[0]))


def kernel_call(glu: SwitchGLU, x: mx.array, indices: mx.array,
                stacks: Optional[Tuple[mx.array, mx.array, mx.array]] = None) -> mx.array:
    """``SwitchGLU.__call__`` with every product through the expert kernel: the same ops
    (up, gate, the layer's activation, down), the same output shape. ``stacks``: (up, gate,
    down) to read instead of the layer's own (the drafter's bfloat16 copies)."""
    *lead, k = indices.shape
    D = x.shape[-1]
    idx = indices.reshape(-1, k)
    n = idx.size
    up, gate, down = stacks or (glu.up_proj["weight"], glu.gate_proj["weight"],
                                glu.down_proj["weight"])
    width = up.shape[1]
    threads = _threads(up, n)
    x_up = expert_kernel.products(x.reshape(-1, D), idx, up, threads).reshape(*lead, k, 1, width)
    x_gate = expert_kernel.products(x.reshape(-1, D), idx, gate, threads).reshape(*lead, k, 1,
                                                                                    width)
    act = glu.activation(x_up, x_gate).reshape(n, width)
    out = expert_kernel.products(act, idx.reshape(n, 1), down, _threads(down, n))
    return out.reshape(*lead, k, D)


def sorted_call(glu: SwitchGLU, x: mx.array, indices: mx.array) -> mx.array:
    """``SwitchGLU.__call__`` with its pairs sorted by expert whatever their count (mlx-lm sorts
    from 64 on): the layers' own ``gather_mm`` / ``gather_qmm`` calls, one row each."""
    *lead, k = indices.shape
    x = mx.expand_dims(x, (-2, -3))
    flat = indices.flatten()
    order = mx.argsort(flat)
    back = mx.argsort(order)
    xs = x.flatten(0, -3)[order // k]
    idx = flat[order]
    x_up = glu.up_proj(xs, idx, sorted_indices=True)
    x_gate = glu.gate_proj(xs, idx, sorted_indices=True)
    y = glu.down_proj(glu.activation(x_up, x_gate), idx, sorted_indices=True)
    return mx.unflatten(y[back], 0, tuple(indices.shape)).squeeze(-2)


def routes(width: int, experts: int, k: int) -> List[mx.array]:
    """Routes ``[1, width, k]`` for the check: every row the same experts; rows sharing none
    (as far as the experts go round); seeded random routes."""
    same = mx.broadcast_to(mx.arange(k), (width, k))
    apart = (mx.arange(width)[:, None] * k + mx.arange(k)[None, :]) % experts
    keys = mx.random.uniform(shape=(width, experts), key=mx.random.key(5813))
    drawn = mx.argsort(keys, axis=-1)[:, :k]
    return [r.astype(mx.uint32)[None] for r in (same, apart, drawn)]


def passing_widths(glu: SwitchGLU, call: Callable, max_width: int, first: int = 1) -> List[int]:
    """The widths in ``first..max_width`` at which ``call`` gives, for every check route, bitwise
    the layer's own one-row calls (mlx-lm's ``SwitchGLU.__call__``, one row at a time, as a
    one-token decode step calls it)."""
    proj = glu.up_proj
    dtype = proj.scales.dtype if hasattr(proj, "scales") else proj.weight.dtype
    E = proj.num_experts
    x = mx.random.normal((1, max_width, proj.input_dims), key=mx.random.key(9127)).astype(dtype)
    ok = set(range(first, max_width + 1))
    for i, route in enumerate(routes(max_width, E, min(E, CHECK_TOP_K))):
        # past ``ALL_ROUTES_TO`` rows (a batch's packed widths) only the shared route, whose
        # experts take every row: the others would read most of the layer's experts per width
        last = max_width if i == 0 else min(max_width, ALL_ROUTES_TO)
        rows = [SwitchGLU.__call__(glu, x[:, t : t + 1], route[:, t : t + 1])
                for t in range(last)]
        mx.eval(rows)
        for T in sorted(w for w in ok if w <= last):
            with cpu_blas.verify_threads():  # as the round loop verifies
                block = call(glu, x[:, :T], route[:, :T])
                mx.eval(block)
            if not all(row_exact_layers.bitwise_equal(block[:, t : t + 1], rows[t])
                       for t in range(T)):
                ok.discard(T)
    return sorted(ok)


def kernel_fits(glu: SwitchGLU) -> bool:
    """Whether the expert kernel takes the layer's three stacks as they are (float, no bias)."""
    projections = (glu.up_proj, glu.gate_proj, glu.down_proj)
    return (all(type(p) is SwitchLinear and "bias" not in p for p in projections)
            and all(expert_kernel.fits(p["weight"]) for p in projections))


def choose(glu: SwitchGLU, max_width: int) -> Dict[int, str]:
    """Width -> method for widths 1..max_width, the first whose check passes: ``KERNEL`` (from
    one row: it reads a one-token step's experts on every core where BLIS's one-row call reads
    on one; by ``row_exact_layers``'s thread rule), then ``SORTED`` (from two rows: at one it is
    mlx-lm's call); widths missing keep mlx-lm's call. On the CPU only: benchmarks/bench_moe.py
    measured the grouping there; another device keeps mlx-lm's kernels."""
    chosen: Dict[int, str] = {}
    if mx.default_device() != mx.cpu:  # another device keeps mlx-lm's kernels (see above)
        return chosen
    if expert_kernel.problem() is None and kernel_fits(glu):
        chosen.update((w, KERNEL) for w in passing_widths(glu, kernel_call, max_width))
    if max_width >= 2 and any(w not in chosen for w in range(2, max_width + 1)):
        chosen.update((w, SORTED) for w in passing_widths(glu, sorted_call, max_width, 2)
                      if w not in chosen)
    return chosen


def _signature(glu: SwitchGLU, max_width: int) -> Tuple:
    arrays = tuple((k, tuple(v.shape), str(v.dtype))
                   for k, v in sorted(tree_flatten(glu.parameters())))
    return (type(glu.activation).__name__, type(glu.up_proj).__name__, kernel_fits(glu),
            max_width) + arrays


def switch_to_grouped(model: nn.Module, max_width: int) -> Dict[str, Dict[int, str]]:
    """Switch every mlx-lm ``SwitchGLU`` of ``model`` to ``GroupedSwitchGLU`` with the methods
    its check accepts for widths up to ``max_width`` (checked once per layer signature, on the
    first such layer's weights). Returns {module path: {width: method}} of the layers switched."""
    switched: Dict[str, Dict[int, str]] = {}
    measured: Dict[Tuple, Dict[int, str]] = {}
    for path, layer in model.named_modules():
        if type(layer) not in (SwitchGLU, GroupedSwitchGLU):
            continue
        layer.__class__ = SwitchGLU  # the checks call mlx-lm's own code
        sig = _signature(layer, max_width)
        if sig not in measured:
            measured[sig] = choose(layer, max_width)
        widths = measured[sig]
        layer.__dict__["expert_widths"] = dict(widths)  # a plain attribute, not a parameter
        if widths:
            layer.__class__ = GroupedSwitchGLU
            switched[path] = dict(widths)
    return switched


def expert_method(layer, width: int) -> str:
    """How ``layer`` computes a verify block of ``width`` rows."""
    if not isinstance(layer, GroupedSwitchGLU):
        return GATHER
    return layer.__dict__.get("expert_widths", {}).get(width, GATHER)


def experts_report(model: nn.Module) -> Dict[str, object]:
    """The mixture-of-experts layers by method at each width they were checked for, and why the
    kernel cannot run where it cannot: for the run's stats (empty without such layers)."""
    layers = [m for _, m in model.named_modules() if isinstance(m, SwitchGLU)]
    if not layers:
        return {}
    widths = sorted({w for m in layers for w in m.__dict__.get("expert_widths", {})})
    out: Dict[str, object] = {"layers": len(layers), "widths": {
        str(w): _counts(expert_method(m, w) for m in layers) for w in widths}}
    why = expert_kernel.problem()
    if why is not None:
        out["kernel"] = f"unavailable ({why})"
    return out


def experts_summary(info: Dict[str, object]) -> str:
    """One cell for the CLI's stats table from ``experts_report``: each method with the widths it
    ran (layers counted), e.g. ``40 layers: kernel at widths 1-6``."""
    spans: Dict[str, List[int]] = {}
    for w, counts in info["widths"].items():
        for name in counts:
            spans.setdefault(name, []).append(int(w))
    parts = [f"{name} at widths {_spans(sorted(ws))}" for name, ws in sorted(spans.items())]
    text = f"{info['layers']} layers: " + (", ".join(parts) if parts else GATHER)
    return text + (f"; expert kernel {info['kernel']}" if "kernel" in info else "")


def _spans(ws: List[int]) -> str:
    """1, 2, 3, 5 -> ``1-3, 5``."""
    out, start = [], ws[0]
    for a, b in zip(ws, ws[1:] + [None]):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out)


def _counts(names) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for n in names:
        out[n] = out.get(n, 0) + 1
    return out
