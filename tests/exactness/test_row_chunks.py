"""Row-exact products for a BLAS that reduces products of up to c rows like one row but wider ones
otherwise (OpenBLAS 0.3.21 on one thread, on some cores from 4 rows): a verify block computed as
``(W @ x.T).T`` (transposed) or as the layer's own products on chunks of at most c rows, bitwise
equal to one-row products.

How a BLAS reduces a multi-row product depends on the kernels it picked for the CPU (OpenBLAS:
``openblas_get_corename``; a core it does not know, e.g. ``OPENBLAS_CORETYPE=Prescott``, gets
generic kernels). So these tests never expect a form for a kind of CPU: they measure on this host
which forms equal one-row products, expect ``row_exact_layers.switch_to_row_exact`` to follow that measurement, and
expect every verify to equal the one-row products bitwise, whatever form was picked."""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.exactness import row_exact_layers
from mlx_mtp.cpu import row_kernel
from support.processes import CHILD_PYTHONPATH

ROOT = Path(__file__).resolve().parents[2]
OPENBLAS = next((p for name, p in cpu_blas.find() if name == "OpenBLAS"), None)


@functools.lru_cache(maxsize=None)
def openblas_core() -> str:
    """The kernel family OpenBLAS picked for this CPU (``openblas_get_corename``, which honours
    ``OPENBLAS_CORETYPE``), named in failure messages: how its products reduce depends on it."""
    import ctypes

    lib = ctypes.CDLL(OPENBLAS)
    lib.openblas_get_corename.restype = ctypes.c_char_p
    return lib.openblas_get_corename().decode()


def bitwise(a, b):
    return a.shape == b.shape and bytes(memoryview(a)) == bytes(memoryview(b))


def test_chunks_cut_rows_into_the_fewest_even_chunks():
    assert row_exact_layers.chunks(4, 3) == [(0, 2), (2, 4)]
    assert row_exact_layers.chunks(5, 3) == [(0, 3), (3, 5)]
    assert row_exact_layers.chunks(6, 3) == [(0, 3), (3, 6)]
    assert row_exact_layers.chunks(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert row_exact_layers.chunks(3, 3) == [(0, 3)]
    assert row_exact_layers.chunks(5, 2) == [(0, 2), (2, 4), (4, 5)]


@pytest.fixture
def no_kernel(monkeypatch):
    monkeypatch.setenv(row_kernel.ENV, "0")  # the kernel would be chosen first where it passes
    row_kernel.reset()
    yield
    monkeypatch.delenv(row_kernel.ENV)
    row_kernel.reset()


def test_install_uses_transposed_products_where_they_equal_one_row_calls(monkeypatch, no_kernel):
    """A layer that first diverges at width 4 and whose ``(W @ x.T).T`` equals its one-row calls
    computes a verify block of 4 rows or more in that one product: the block is that product's
    bytes, and wherever this BLAS's transposed form measures exact (BLIS and OpenBLAS on many
    cores, for K = 256), each row is its one-row call's bytes."""
    layer = nn.Linear(256, 512, bias=False)
    mx.eval(layer.parameters())
    exact_here = row_exact_layers.transposed_equal_rows(layer, layer.weight, 6, mx.float32)
    monkeypatch.setattr(row_exact_layers, "first_divergent_width", lambda *a: 4)
    monkeypatch.setattr(row_exact_layers, "transposed_equal_rows", lambda *a: True)
    assert row_exact_layers.switch_to_row_exact(layer, 6) == {"": 4}
    assert row_exact_layers.row_method(layer) == "transposed" and layer.transposed
    calls = []
    original = row_exact_layers.transposed_products
    monkeypatch.setattr(row_exact_layers, "transposed_products",
                        lambda x, w: calls.append(x.shape[-2]) or original(x, w))
    x = mx.random.normal((1, 6, 256), key=mx.random.key(12))
    rows = [x[:, i : i + 1] @ layer.weight.T for i in range(6)]
    for T in (3, 4, 5, 6):
        with row_exact_layers.verifying():
            block = layer(x[:, :T])
        want = original(x[:, :T], layer.weight) if T >= 4 else x[:, :T] @ layer.weight.T
        mx.eval(block, want, rows)
        assert bitwise(block, want), T
        if exact_here:
            assert all(bitwise(block[:, i : i + 1], rows[i]) for i in range(T)), T
    assert calls == [4, 5, 6]  # width 3 is below the first divergent width: the plain product


def test_install_chunks_rows_below_the_first_divergent_width(monkeypatch, no_kernel):
    """A layer that first diverges at width 4, where the transposed form differs and chunks of 3
    rows equal one-row calls, is computed as its own product on chunks of at most 3 rows inside a
    verify (no product wider than 3 rows): bitwise the chunks' products and, wherever this BLAS's
    3-row products measure exact, bitwise the one-row calls."""
    layer = nn.Linear(256, 512, bias=False)
    mx.eval(layer.parameters())
    exact_here = row_exact_layers.chunks_equal_rows(layer, 6, 3, 256, mx.float32)
    monkeypatch.setattr(row_exact_layers, "first_divergent_width", lambda *a: 4)
    monkeypatch.setattr(row_exact_layers, "transposed_equal_rows", lambda *a: False)
    monkeypatch.setattr(row_exact_layers, "chunks_equal_rows", lambda *a: True)
    assert row_exact_layers.switch_to_row_exact(layer, 6) == {"": 4}
    assert row_exact_layers.row_method(layer) == "chunked" and layer.chunk_rows == 3
    widths = []
    matmul = nn.Linear.__call__
    monkeypatch.setattr(nn.Linear, "__call__",
                        lambda self, x: widths.append(x.shape[-2]) or matmul(self, x))
    x = mx.random.normal((1, 6, 256), key=mx.random.key(11))
    rows = [x[:, i : i + 1] @ layer.weight.T for i in range(6)]
    for T, cut in ((3, [3]), (4, [2, 2]), (5, [3, 2]), (6, [3, 3])):
        widths.clear()
        with row_exact_layers.verifying():
            block = layer(x[:, :T])
        want = mx.concatenate([x[:, a:b] @ layer.weight.T for a, b in row_exact_layers.chunks(T, 3)],
                              axis=1)
        mx.eval(block, want, rows)
        assert widths == cut, T
        assert bitwise(block, want), T
        if exact_here:
            assert all(bitwise(block[:, i : i + 1], rows[i]) for i in range(T)), T


def test_a_lora_adapter_chunks_rows_below_its_first_divergent_width(monkeypatch):
    """mlx-lm's LoRA wrapper (its own ``x @ lora_a @ lora_b`` beside the wrapped product) is
    chunked too where it first diverges above width 2 and its chunks measure exact: bitwise
    equal to one-row calls whatever this BLAS does with 3 rows (the install measures it)."""
    from mlx_lm.tuner.lora import LoRALinear

    layer = LoRALinear.from_base(nn.Linear(256, 512, bias=False), r=8)
    layer.lora_b = mx.random.normal(layer.lora_b.shape, key=mx.random.key(5)) * 0.1
    mx.eval(layer.parameters())
    monkeypatch.setattr(row_exact_layers, "first_divergent_width", lambda *a: 4)
    assert row_exact_layers.switch_to_row_exact(layer, 6) == {"": 4, "linear": 4}  # the wrapped layer too
    if row_exact_layers.chunks_equal_rows(layer, 6, 3, 256, mx.float32):
        assert row_exact_layers.row_method(layer) == "chunked" and layer.chunk_rows == 3
    else:  # 3-row products differ here too: the adapter's rows run one at a time
        assert row_exact_layers.row_method(layer) == "rows" and layer.chunk_rows == 0
    x = mx.random.normal((1, 6, 256), key=mx.random.key(13))
    rows = [layer(x[:, i : i + 1]) for i in range(6)]
    with row_exact_layers.verifying():
        block = layer(x)
    mx.eval(block, rows)
    assert all(bitwise(block[:, i : i + 1], rows[i]) for i in range(6))


def test_install_keeps_blocked_products_where_neither_form_equals(monkeypatch, no_kernel):
    layer = nn.Linear(256, 512, bias=False)
    mx.eval(layer.parameters())
    monkeypatch.setattr(row_exact_layers, "first_divergent_width", lambda *a: 4)
    monkeypatch.setattr(row_exact_layers, "transposed_equal_rows", lambda *a: False)
    monkeypatch.setattr(row_exact_layers, "chunks_equal_rows", lambda *a: False)
    row_exact_layers.switch_to_row_exact(layer, 6)
    assert row_exact_layers.row_method(layer) == "blocked" and layer.chunk_rows == 0
    assert not layer.transposed


VERIFY_CHECK = """
import json, sys
import mlx_mtp
import mlx.core as mx
from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.exactness import row_exact_layers
from mlx_mtp.models.qwen3_5 import compiled_layers
from support.pieces import expected_choices

if sys.argv[1] == "chunked":  # the fallback where the transposed form would differ
    row_exact_layers.transposed_equal_rows = lambda *a: False
model = mlx_mtp.load_model("mlx_mtp/demo_pair", require_head=False)
target = model.target
target.prepare(6)
methods = {}
for _, layer in model.mlx_model.named_modules():
    m = row_exact_layers.row_method(layer)
    methods[m] = methods.get(m, 0) + 1
prompt = mx.array([[5 + i % 200 for i in range(40)]])
result = {"blas": cpu_blas.STATE.name, "methods": methods, "widths": {}}
for w in (2, 3, 4, 5, 6):
    ids = mx.array([[7 + 3 * i for i in range(w)]])
    seq = target.make_cache(); mx.eval(target.hidden(prompt, seq))
    ver = target.make_cache(); mx.eval(target.hidden(prompt, ver))
    rows = [target.logits(target.hidden(ids[:, i : i + 1], seq)) for i in range(w)]
    mx.eval(rows)
    with cpu_blas.verify_threads():
        block = target.logits(target.verify(ids, ver))
        mx.eval(block)
    target.rollback(ver, w, w)
    logits = all(bytes(memoryview(block[:, i : i + 1])) == bytes(memoryview(rows[i]))
                 for i in range(w))
    a, b = target.cache_state(ver), target.cache_state(seq)
    mx.eval(a, b)
    caches = len(a) == len(b) and all(x.shape == y.shape and
                                      bytes(memoryview(x)) == bytes(memoryview(y))
                                      for x, y in zip(a, b))
    result["widths"][w] = [logits, caches]
result["choices"] = sorted({str(v) for k, v in compiled_layers._checked.items()
                           if k[0] in ("tail", "attn")})
result["expected_choices"] = expected_choices(target, range(2, 7))
print(json.dumps(result))
"""


def run_openblas(code, *args, **extra_env):
    """``code`` in a fresh interpreter with OpenBLAS bound (its default threads; the host's
    ``OPENBLAS_CORETYPE`` / ``OPENBLAS_L2_SIZE``, if any, kept): its last stdout line as JSON."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("BLIS_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                        *cpu_blas.BLIS_WAYS)}
    env.update(extra_env, MLX_MTP_CPU_BLAS=OPENBLAS, PYTHONPATH=CHILD_PYTHONPATH)
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["blas"] == "OpenBLAS"
    return out


@pytest.mark.subprocess
@pytest.mark.skipif(OPENBLAS is None, reason="OpenBLAS is not installed")
@pytest.mark.parametrize("form", ["installed", "chunked"])
def test_openblas_verify_equals_decode_steps_bitwise_at_every_width(form):
    """With OpenBLAS bound, the demo pair's verify of 2..6 tokens gives each row's logits and
    the caches bitwise as that many plain decode steps: with the forms the install chose on this
    host and with the transposed form ruled out (row chunks or column blocks instead); the
    compiled layer pieces with the products inside wherever those forms are plain MLX ops."""
    out = run_openblas(VERIFY_CHECK, form)
    why = (openblas_core(), out["methods"])
    assert out["widths"] == {str(w): [True, True] for w in range(2, 7)}, why
    assert set(out["methods"]) <= {"multi-row", "transposed", "chunked", "blocked", "rows",
                                   "kernel"}, why
    if form == "chunked":
        assert "transposed" not in out["methods"], why
    assert out["choices"] == out["expected_choices"], why


SHAPES_CHECK = """
import json
import mlx_mtp
import mlx.core as mx
import mlx.nn as nn
from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.exactness import row_exact_layers

def same(ys, rows):
    return [all(bytes(memoryview(mx.contiguous(y[:, i : i + 1]))) == bytes(memoryview(rows[i]))
                for i in range(y.shape[1])) for y in ys]

out = {}
for N, K in ((8, 256), (128, 256), (512, 256), (256, 512), (4096, 1024), (1024, 3072)):
    w = mx.random.normal((N, K), key=mx.random.key(N + K))
    x = mx.random.normal((1, 6, K), key=mx.random.key(3))
    rows = [x[:, i : i + 1] @ w.T for i in range(6)]
    mx.eval(rows)
    with cpu_blas.verify_threads():
        flipped = [row_exact_layers.transposed_products(x[:, :T], w) for T in range(1, 7)]
        plain = [x[:, :T] @ w.T for T in range(1, 7)]
        mx.eval(flipped, plain)
    layer = nn.Linear(K, N, bias=False)
    layer.weight = w
    row_exact_layers.switch_to_row_exact(layer, 6)
    with row_exact_layers.verifying(), cpu_blas.verify_threads():
        blocks = [layer(x[:, :T]) for T in range(1, 7)]
        mx.eval(blocks)
    out[f"{N}x{K}"] = {"flipped": same(flipped, rows), "plain": same(plain, rows),
                       "method": row_exact_layers.row_method(layer), "verify": same(blocks, rows)}
print(json.dumps({"blas": cpu_blas.STATE.name, "shapes": out}))
"""


@pytest.mark.subprocess
@pytest.mark.skipif(OPENBLAS is None, reason="OpenBLAS is not installed")
def test_openblas_install_uses_transposed_products_exactly_where_they_equal_one_row_products():
    """What the transposed form rests on, measured on this host's OpenBLAS with the verify's
    threads for the demo pair's and the realistic-size pair's shapes: where ``x @ W.T`` of some
    width differs from one-row products and ``(W @ x.T).T`` of every width 1..6 equals them, the
    install computes the layer transposed; where both differ, another form; where the plain
    product never differs, nothing is switched. Whatever the form, the layer's verify of 1..6
    rows is bitwise its one-row products (the row kernel is off: it mimics BLIS's order)."""
    out = run_openblas(SHAPES_CHECK, MLX_MTP_ROW_KERNEL="0")
    for shape, got in out["shapes"].items():
        why = (openblas_core(), shape, got)
        assert got["verify"] == [True] * 6, why
        assert got["plain"][0], why  # one row is the one-row product itself
        plain, flipped = got["plain"][1:], got["flipped"][1:]  # widths 2..6, as install measures
        if all(plain):
            assert got["method"] == "multi-row", why
        elif all(flipped):
            assert got["method"] == "transposed", why
        else:
            assert got["method"] in ("chunked", "blocked", "rows"), why


GENERATE_CHECK = """
import json
import mlx_mtp
import mlx.core as mx
from pathlib import Path
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model
from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.exactness import row_exact_layers

prompt = mx.array([5 + (7 * i) % 300 for i in range(60)])
pristine, _ = load_model(Path("mlx_mtp/demo_pair"))
plain = [t for t, _ in generate_step(prompt, pristine, max_tokens=40)]
model = mlx_mtp.load_model("mlx_mtp/demo_pair")
out = {"blas": cpu_blas.STATE.name, "runs": {}}
for block in (4, 6):
    stats = RunStats()
    got = [t for t, _ in mlx_mtp.generate_step(prompt, model, max_tokens=40, block_size=block,
                                               stats=stats)]
    out["runs"][block] = [got == plain, stats.exactness.get("verdict"),
                          stats.exactness.get("row_exact", {}).get("layers"), stats.accepted,
                          row_exact_layers.row_exact_report(model.mlx_model)["layers"]]
print(json.dumps(out))
"""


@pytest.mark.subprocess
@pytest.mark.skipif(OPENBLAS is None, reason="OpenBLAS is not installed")
def test_openblas_greedy_output_is_mlx_lms_at_blocks_4_and_6():
    """With OpenBLAS bound, the gate's probe says ``equal`` at widths up to 6 and T=0 MTP output
    on the demo pair is mlx-lm's plain greedy decode, drafts accepted; the run's stats name the
    row-exact forms the model runs (whichever this host's measurement chose)."""
    out = run_openblas(GENERATE_CHECK)
    for block, (same, verdict, layers, accepted, running) in out["runs"].items():
        why = (openblas_core(), block, layers, accepted)
        assert same and verdict == "equal", why
        assert accepted > 0, why
        assert layers == running, why
