"""Row-exact verify products: a target's linear layers (and a tied LM head's embedding) switched,
where a multi-row product would reduce differently from a one-row one, to compute a verify's
rows as decode's one-row products do. ``switch_to_row_exact`` checks each layer shape once on the
layer's own weights and picks the first method a bitwise check accepts: the row kernel
(``kernel_products``), ``transposed_products``, ``chunked``, ``one_row_products``, else separate
one-row calls. The switched layers compute so only inside ``verifying()``.
docs/exactness.md, "Row-exact products"."""

from __future__ import annotations

from typing import Dict, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.cpu import lazy_ops as lazy_kernels
from mlx_mtp.cpu import row_kernel
from mlx_mtp.scoped_switch import ScopedSwitch

_verifying = ScopedSwitch()  # on inside a verify (``mlx_mtp.scoped_switch``)
verifying = _verifying.open


def active() -> bool:
    return bool(_verifying)


BLOCK_BYTES = 1024 * 1024  # most bytes of weights one column block keeps in cache (an L2)


class _ExactRows:
    """What ``switch_to_row_exact`` sets on a switched layer, and how the layer computes a
    verify block."""

    exact_from: int = 2  # widths >= this run row by row inside ``verifying()``
    one_row_kernel: bool = False  # one-row products too through the kernel (``one_row_threads``)
    block_cols: int = 0  # > 0: one_row_products with blocks of this many output columns
    use_kernel: bool = False  # the compiled one-row-order kernel (``row_kernel``)
    chunk_rows: int = 0  # > 1: the layer's own product on chunks of at most this many rows
    transposed: bool = False  # ``transposed_products``

    def _exact(self, call, x):
        """``call(x)`` (the layer's own product), its rows computed as one-row products would."""
        rows = x.shape[-2] if x.ndim >= 2 else 0
        if _verifying and rows == 1 and self.one_row_kernel and x.dtype == mx.float32:
            return kernel_products(self, x)  # the same bytes as the one-row call, read faster
        if _verifying and rows >= self.exact_from:
            if self.use_kernel and x.dtype == mx.float32:
                return kernel_products(self, x)
            if self.transposed:
                return transposed_products(x, self.weight)
            if self.chunk_rows:
                return chunked(call, x, self.chunk_rows)
            if self.block_cols:
                return one_row_products(x, self.weight, self.block_cols)
            return _by_rows(call, x)
        return call(x)


class _RowExact(_ExactRows):
    def __call__(self, x):
        return self._exact(super().__call__, x)


class _RowExactEmbedding(_ExactRows):
    """A tied LM head (``embed_tokens.as_linear``) is the same product in another method."""

    def as_linear(self, x):
        return self._exact(super().as_linear, x)


def _by_rows(call, x):
    return mx.concatenate([call(x[..., i : i + 1, :]) for i in range(x.shape[-2])], axis=-2)


def transposed_products(x: mx.array, weight: mx.array) -> mx.array:
    """``x @ weight.T`` as ``(weight @ x.T).T``: the same sums, with the verify's T rows on the
    BLAS's other operand side. A BLAS may reduce this form's T columns like a one-row
    ``x @ weight.T`` for more rows than it does ``x @ weight.T`` (OpenBLAS on one thread:
    docs/exactness.md), so a verify reads the weights once in one BLAS call.
    ``switch_to_row_exact`` checks it per layer."""
    return mx.swapaxes(weight @ mx.swapaxes(x, -1, -2), -1, -2)


def chunks(T: int, most: int):
    """[start, stop) of T rows cut into the fewest chunks of at most ``most`` rows, as even as
    can be (larger first): 4 rows by 3 -> 2 + 2, 5 -> 3 + 2, 7 -> 3 + 2 + 2."""
    n = -(-T // most)
    size, extra = divmod(T, n)
    out, start = [], 0
    for i in range(n):
        stop = start + size + (i < extra)
        out.append((start, stop))
        start = stop
    return out


def chunked(call, x: mx.array, most: int) -> mx.array:
    """``call`` (the layer's own product) on the rows of ``x`` in chunks of at most ``most``
    rows (``chunks``). Where a BLAS reduces a product of up to ``most`` rows as it reduces one
    row but a wider one otherwise (OpenBLAS on one thread: docs/exactness.md), each chunk is
    exact and reads the weights once: a verify of T rows reads them ceil(T / most) times in as
    many BLAS calls, where ``one_row_products`` makes T calls per column block."""
    parts = [call(x[..., a:b, :]) for a, b in chunks(x.shape[-2], most)]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-2)


def one_row_products(x: mx.array, weight: mx.array, block_cols: int) -> mx.array:
    """``x @ weight.T`` ([..., T, K] @ [N, K].T) computed as one-row products, ``block_cols``
    output columns at a time, in one batched matmul: batch entry (block b, row t) multiplies
    row t by block b, with t varying fastest, so each block of weights is multiplied by all T rows
    while it is in cache. MLX runs a batched matmul as one BLAS call per batch entry, each here
    with M = 1: the call decode makes. A ragged last block is a second batched matmul."""
    *lead, T, K = x.shape
    rows = x.reshape(-1, K)
    n, N = rows.shape[0], weight.shape[0]
    nb = N // block_cols
    main = nb * block_cols
    parts = []
    if nb:
        w = weight[:main].reshape(nb, block_cols, K).swapaxes(-1, -2)[:, None]  # [nb, 1, K, c]
        out = mx.broadcast_to(rows[None, :, None, :], (nb, n, 1, K)) @ \
            mx.broadcast_to(w, (nb, n, K, block_cols))  # [nb, n, 1, c]
        parts.append(out.reshape(nb, n, block_cols).transpose(1, 0, 2).reshape(n, main))
    if main < N:
        rest = weight[main:].T
        parts.append((rows[:, None, :] @ mx.broadcast_to(rest, (n,) + rest.shape)).reshape(n, -1))
    out = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
    return out.reshape(*lead, T, N)


def kernel_products(layer, x: mx.array) -> mx.array:
    """``x @ layer.weight.T`` with the compiled kernel (``row_kernel``) for the output columns
    in whole groups of 8 and BLAS one-row products for the last N % 8 (which BLIS reduces with
    another kernel; a one-row call on those rows alone reduces them as the whole matrix does).
    The weight's zero-copy host view is made once and kept on the layer (it checks the weight
    is row-contiguous float32; the eager kernel reads it); the lazy op takes the weight itself."""
    weight = layer.weight
    cached = layer.__dict__.get("_kernel_view")
    if cached is None or cached[0] != id(weight):
        cached = (id(weight), row_kernel.weight_view(weight))
        layer.__dict__["_kernel_view"] = cached  # a plain attribute, not a module parameter
    N = weight.shape[0]
    main = N - N % row_kernel.COLUMN_GROUP
    w = weight if lazy_kernels.available() else cached[1]  # the view: checked, eager use
    rows = x.shape[-2]
    threads = (one_row_threads(weight.nbytes) if rows == 1
               else kernel_threads(weight.nbytes * rows))
    out = row_kernel.products(x, w, main, threads) if main else None
    if main < N:
        rest = one_row_products(x, weight[main:], N - main)
        out = rest if out is None else mx.concatenate([out, rest], axis=-1)
    return out


# A product of at least this many weight bytes times rows runs on every core this process may
# use: it does enough work to repay the threads' hand-off (a realistic-size target's layers);
# smaller ones, such as the demo pair's, gain nothing from a second thread (chosen by
# benchmarks/verify_arms.py --kernel-threads; docs/cpu-backend.md, "Threads", cites its records).
PARALLEL_WORK_BYTES = 16 * 1024 * 1024


def kernel_threads(work_bytes: int = 0) -> int:
    """The kernel's threads for a product of ``work_bytes`` (weight bytes times rows):
    ``MLX_MTP_VERIFY_THREADS`` if set (0 = the bound library's count); else every usable core
    from ``PARALLEL_WORK_BYTES`` on, one below. Each output is computed by one thread, so the
    bytes do not depend on it. More threads are slower on a busy machine (threads wait for
    descheduled ones): set the variable to 1 there."""
    if cpu_blas.verify_threads_set():
        n = cpu_blas.verify_thread_count()
        return n if n else (cpu_blas.STATE.threads or 1)
    return cpu_blas.usable_cores() if work_bytes >= PARALLEL_WORK_BYTES else 1


# A one-row product reads its weight once and does little else, so from this many weight bytes
# on every usable core reads a share (chosen by benchmarks/bench_decode_step.py on the realistic
# calibrated pair, as ``bf16_weights.BF16_PARALLEL_BYTES``; its record holds the numbers).
ONE_ROW_PARALLEL_BYTES = 4 * 1024 * 1024


def one_row_threads(weight_bytes: int) -> int:
    """The kernel's threads for a one-row product of a weight of ``weight_bytes``:
    ``kernel_threads``'s where ``MLX_MTP_VERIFY_THREADS`` is set; else every usable core from
    ``ONE_ROW_PARALLEL_BYTES`` on, one below."""
    if cpu_blas.verify_threads_set():
        return kernel_threads()
    return cpu_blas.usable_cores() if weight_bytes >= ONE_ROW_PARALLEL_BYTES else 1


def threaded(model: nn.Module, width: int) -> bool:
    """Whether a verify of ``width`` rows runs any of ``model``'s kernel products on more than
    one thread (then its threads must not be pinned to one core: ``mlx_mtp.cpu.pin``)."""
    return any(getattr(m, "use_kernel", False) and kernel_threads(m.weight.nbytes * width) > 1
               for _, m in model.named_modules())


def kernel_equal_rows(fn, layer, max_width: int) -> bool:
    """Whether ``kernel_products`` equals ``fn`` (the layer's own one-row call) row for row,
    bitwise, for every width 2..max_width, on the layer's own weights."""
    K = layer.weight.shape[1]
    try:
        row_kernel.weight_view(layer.weight)
    except ValueError:  # a strided view (not [N, K] row-major in memory): not for the kernel
        return False
    return _equal_to_rows(fn, lambda x: kernel_products(layer, x), K, max_width, mx.float32, 2468)


def kernel_equal_one_row(fn, layer) -> bool:
    """Whether ``kernel_products`` of one row equals ``fn`` (the layer's own one-row call)
    bitwise, on the layer's own weights."""
    x = mx.random.normal((1, 1, layer.weight.shape[1]), key=mx.random.key(1357))
    mine, theirs = kernel_products(layer, x), fn(x)
    mx.eval(mine, theirs)
    return bitwise_equal(mine, theirs)


def transposed_equal_rows(fn, weight: mx.array, max_width: int, dtype) -> bool:
    """Whether ``transposed_products`` equals ``fn`` (the layer's own one-row call) row for row,
    bitwise, for every width 2..max_width, on the layer's own weights."""
    return _equal_to_rows(fn, lambda x: transposed_products(x, weight), weight.shape[1],
                          max_width, dtype, 2791)


def chunks_equal_rows(fn, max_width: int, chunk: int, in_dims: int, dtype) -> bool:
    """Whether ``chunked`` with chunks of at most ``chunk`` rows equals ``fn`` (the layer's own
    one-row call) row for row, bitwise, for every width 2..max_width."""
    return _equal_to_rows(fn, lambda x: chunked(fn, x, chunk), in_dims, max_width, dtype, 3579)


def block_columns(weight: mx.array) -> int:
    """Output columns per block of ``weight`` ([N, K]): 64 (chosen with BLIS by
    benchmarks/verify_arms.py's ``blocked`` arm),
    fewer where 64 rows of K would not fit BLOCK_BYTES (a multiple
    of 16, at least 16); the whole matrix when it is narrower."""
    N, K = weight.shape
    cols = 64
    while cols > 16 and cols * K * weight.dtype.size > BLOCK_BYTES:
        cols //= 2
    return N if cols >= N else cols


class RowExactLinear(_RowExact, nn.Linear):
    pass


class RowExactQuantizedLinear(_RowExact, nn.QuantizedLinear):
    pass


class RowExactEmbedding(_RowExactEmbedding, nn.Embedding):
    pass


class RowExactQuantizedEmbedding(_RowExactEmbedding, nn.QuantizedEmbedding):
    pass


ROW_EXACT_CLASS = {
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


_ROW_EXACT_ADAPTERS: Dict[type, type] = {}  # one made class per adapter class for the process


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
        in_dims = layer.lora_a.shape[0]
        width = first_divergent_width(layer, max_width, in_dims, dtype)
        chunk = width - 1 if width > 2 and chunks_equal_rows(layer, max_width, width - 1,
                                                             in_dims, dtype) else 0
        measured[sig] = (width, chunk)
    width, chunk = measured[sig]
    if width:
        layer.__class__ = _row_exact_adapter(base)
        layer.exact_from = width
        layer.chunk_rows = chunk
    elif type(layer) is not base:
        layer.__class__ = base
    return width


def first_divergent_width(fn, max_width: int, in_dims: int, dtype) -> int:
    """Smallest T in 2..max_width at which ``fn`` of a T-row input differs from T one-row calls
    (0 if none)."""
    return _first_divergent(fn, fn, in_dims, max_width, dtype, 1234)


def products_equal_rows(fn, weight: mx.array, block_cols: int, max_width: int, dtype) -> bool:
    """Whether ``one_row_products`` with ``block_cols`` equals ``fn`` (the layer's own one-row
    call) row for row, bitwise, for every width 2..max_width."""
    return _equal_to_rows(fn, lambda x: one_row_products(x, weight, block_cols), weight.shape[1],
                          max_width, dtype, 4321)


def _equal_to_rows(fn, product, K: int, max_width: int, dtype, seed: int) -> bool:
    """Whether ``product`` of a T-row input equals ``fn``'s T one-row calls bitwise, for every
    T in 2..max_width."""
    return _first_divergent(fn, product, K, max_width, dtype, seed) == 0


def _first_divergent(fn, product, K: int, max_width: int, dtype, seed: int) -> int:
    """Smallest T in 2..max_width at which ``product`` of a T-row input differs bitwise from
    ``fn``'s T one-row calls (0 if none); the T-row product runs with the loop's BLAS threads."""
    x = mx.random.normal((1, max_width, K), key=mx.random.key(seed)).astype(dtype)
    rows = [fn(x[:, i : i + 1, :]) for i in range(max_width)]
    mx.eval(rows)
    for T in range(2, max_width + 1):
        with cpu_blas.verify_threads():  # as the round loop verifies
            block = product(x[:, :T, :])
            mx.eval(block)
        if not all(bitwise_equal(block[:, i : i + 1, :], rows[i]) for i in range(T)):
            return T
    return 0


def bitwise_equal(x: mx.array, y: mx.array) -> bool:
    """Same shape, dtype and bytes (signed zeros and NaN payloads included)."""
    return (x.shape == y.shape and x.dtype == y.dtype
            and bytes(memoryview(x)) == bytes(memoryview(y)))


def switch_to_row_exact(model: nn.Module, max_width: int,
                        tied_head: bool = False) -> Dict[str, int]:
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
        base = next((b for b in type(layer).__mro__ if b in ROW_EXACT_CLASS), None)
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
            width = first_divergent_width(fn, max_width, in_dims, dtype)
            cols, kernel, chunk, flip = 0, False, 0, False
            plain_float = not quantized and "bias" not in layer
            one_row = False
            if width and dtype == mx.float32 and plain_float and row_kernel.available():
                kernel = kernel_equal_rows(fn, layer, max_width)
                # One-row products (decode steps) through the kernel only as a lazy op: the
                # eager kernel syncs with the host per call.
                one_row = (kernel and lazy_kernels.available()
                           and kernel_equal_one_row(fn, layer))
            if width and not kernel and plain_float:
                flip = transposed_equal_rows(fn, layer.weight, max_width, dtype)
            if width > 2 and not (kernel or flip) and chunks_equal_rows(fn, max_width, width - 1,
                                                                        in_dims, dtype):
                chunk = width - 1
            if width and not (kernel or flip or chunk) and plain_float:
                cols = block_columns(layer.weight)
                if not products_equal_rows(fn, layer.weight, cols, max_width, dtype):
                    cols = layer.weight.shape[0]  # one block: the one-row calls themselves
                    if not products_equal_rows(fn, layer.weight, cols, max_width, dtype):
                        cols = 0
            measured[sig] = (width, cols, kernel, chunk, flip, one_row)
        width, cols, kernel, chunk, flip, one_row = measured[sig]
        if width:
            layer.__class__ = ROW_EXACT_CLASS[base]
            layer.exact_from = width
            layer.block_cols = cols
            layer.use_kernel = kernel
            layer.one_row_kernel = one_row
            layer.chunk_rows = chunk
            layer.transposed = flip
            switched[path] = width
        elif type(layer) is not base:
            layer.__class__ = base
    return switched


def row_method(layer) -> str:
    """How a layer computes a verify block: ``kernel`` (``row_kernel``), ``transposed``
    (``transposed_products``), ``chunked`` (its own
    product on chunks of rows narrower than its first divergent width), ``blocked``
    (``one_row_products`` over column blocks or the whole matrix), ``rows`` (separate one-row
    calls), or ``multi-row`` (not switched: the layer's own multi-row product)."""
    if not isinstance(layer, _ExactRows):
        return "multi-row"
    if layer.use_kernel:
        return "kernel"
    if layer.transposed:
        return "transposed"
    return "chunked" if layer.chunk_rows else "blocked" if layer.block_cols else "rows"


def row_exact_report(model: nn.Module) -> Dict[str, object]:
    """The switched layers of ``model`` counted by ``row_method``, and whether the kernel is
    available (why not, when it is not) and, where a layer uses it, whether it runs lazily or
    eagerly (``mlx_mtp.cpu.lazy_ops.mode``): for the run's stats (``gate.verify_report``)."""
    counts: Dict[str, int] = {}
    for _, layer in model.named_modules():
        m = row_method(layer)
        if m != "multi-row":
            counts[m] = counts.get(m, 0) + 1
    if not row_kernel.available():
        return {"layers": counts, "kernel": f"unavailable ({row_kernel.reason()})"}
    # How it runs, where a layer uses it (asking builds the extension, which no other layer needs)
    return {"layers": counts, "kernel": (f"available, {lazy_kernels.mode()}"
                                         if counts.get("kernel") else "available")}
