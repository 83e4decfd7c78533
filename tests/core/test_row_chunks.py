"""Chunked row-exact products: where a BLAS reduces products of up to c rows like one row but
wider ones otherwise (OpenBLAS 0.3.21 on one thread: from 4 rows), a verify block is computed
as the layer's own products on chunks of at most c rows, bitwise equal to one-row products."""

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_mtp import cpu_blas, row_exact, row_kernel

ROOT = Path(__file__).resolve().parents[2]
OPENBLAS = next((p for name, p in cpu_blas.find() if name == "OpenBLAS"), None)


def bitwise(a, b):
    return a.shape == b.shape and bytes(memoryview(a)) == bytes(memoryview(b))


def test_chunks_cut_rows_into_the_fewest_even_chunks():
    assert row_exact.chunks(4, 3) == [(0, 2), (2, 4)]
    assert row_exact.chunks(5, 3) == [(0, 3), (3, 5)]
    assert row_exact.chunks(6, 3) == [(0, 3), (3, 6)]
    assert row_exact.chunks(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert row_exact.chunks(3, 3) == [(0, 3)]
    assert row_exact.chunks(5, 2) == [(0, 2), (2, 4), (4, 5)]


def test_install_chunks_rows_below_the_first_divergent_width(monkeypatch):
    """A layer that first diverges at width 4 is computed as its own product on chunks of at
    most 3 rows inside a verify (no product wider than 3 rows), bitwise equal to one-row calls."""
    monkeypatch.setenv(row_kernel.ENV, "0")  # the kernel would be chosen first where it passes
    row_kernel.reset()
    try:
        layer = nn.Linear(256, 512, bias=False)
        mx.eval(layer.parameters())
        monkeypatch.setattr(row_exact, "first_divergent_width", lambda *a: 4)
        assert row_exact.install(layer, 6) == {"": 4}
        assert row_exact.method(layer) == "chunked" and layer.chunk_rows == 3
        widths = []
        matmul = nn.Linear.__call__
        monkeypatch.setattr(nn.Linear, "__call__",
                            lambda self, x: widths.append(x.shape[-2]) or matmul(self, x))
        x = mx.random.normal((1, 6, 256), key=mx.random.key(11))
        rows = [x[:, i : i + 1] @ layer.weight.T for i in range(6)]
        for T, cut in ((3, [3]), (4, [2, 2]), (5, [3, 2]), (6, [3, 3])):
            widths.clear()
            with row_exact.verifying():
                block = layer(x[:, :T])
            mx.eval(block, rows)
            assert widths == cut, T
            assert all(bitwise(block[:, i : i + 1], rows[i]) for i in range(T)), T
    finally:
        row_kernel.reset()


def test_install_keeps_blocked_products_where_chunks_differ(monkeypatch):
    monkeypatch.setenv(row_kernel.ENV, "0")
    row_kernel.reset()
    try:
        layer = nn.Linear(256, 512, bias=False)
        mx.eval(layer.parameters())
        monkeypatch.setattr(row_exact, "first_divergent_width", lambda *a: 4)
        monkeypatch.setattr(row_exact, "chunks_equal_rows", lambda *a: False)
        row_exact.install(layer, 6)
        assert row_exact.method(layer) == "blocked" and layer.chunk_rows == 0
    finally:
        row_kernel.reset()


VERIFY_CHECK = """
import json, sys
sys.path.insert(0, "tests")
import mlx_mtp
import mlx.core as mx
from mlx_mtp import cpu_blas, row_exact
from mlx_mtp.qwen3_5 import layer_block

model = mlx_mtp.load_model("mlx_mtp/demo_pair", require_head=False)
target = model.target
target.prepare(6)
methods = {}
for _, layer in model.mlx_model.named_modules():
    m = row_exact.method(layer)
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
result["compiled_tails"] = sorted({str(k[1]) for k in layer_block._checked
                                   if k[0] == "tail" and layer_block._checked[k] == "whole"})
print(json.dumps(result))
"""


@pytest.mark.skipif(OPENBLAS is None, reason="OpenBLAS is not installed")
def test_openblas_verify_equals_decode_steps_bitwise_at_every_width():
    """With OpenBLAS bound, the demo pair's verify of 2..6 tokens (chunked where the install
    chose it, compiled tails with the chunks inside) gives each row's logits and the caches
    bitwise as that many plain decode steps."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("BLIS_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                        *cpu_blas.BLIS_WAYS)}
    env.update(MLX_MTP_CPU_BLAS=OPENBLAS, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", VERIFY_CHECK], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["blas"] == "OpenBLAS"
    assert out["widths"] == {str(w): [True, True] for w in range(2, 7)}
    # OpenBLAS 0.3.21 (this machine's): every projection first diverges at 4 rows and chunks
    assert set(out["methods"]) <= {"multi-row", "chunked", "blocked", "rows"}
    assert out["methods"].get("chunked", 0) > 0, out["methods"]
