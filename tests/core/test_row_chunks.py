"""Row-exact products for a BLAS that reduces products of up to c rows like one row but wider ones
otherwise (OpenBLAS 0.3.21 on one thread: from 4 rows): a verify block computed as
``(W @ x.T).T`` (transposed: OpenBLAS reduces up to 7 such columns like one row) or as the layer's
own products on chunks of at most c rows, bitwise equal to one-row products."""

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
from mlx_mtp.exactness import row_exact
from mlx_mtp.cpu import row_kernel

ROOT = Path(__file__).resolve().parents[2]
OPENBLAS = next((p for name, p in cpu_blas.find() if name == "OpenBLAS"), None)


@functools.lru_cache(maxsize=None)
def openblas_core() -> str:
    """The kernel family OpenBLAS picked for this CPU (``openblas_get_corename``): how its
    multi-row products reduce depends on it."""
    import ctypes

    lib = ctypes.CDLL(OPENBLAS)
    lib.openblas_get_corename.restype = ctypes.c_char_p
    return lib.openblas_get_corename().decode()


# OpenBLAS 0.3.21's AVX-512 kernels (an Intel Xeon VM): ``x @ W.T`` and ``(W @ x.T).T`` reduce
# alike, equal to one-row products up to 2 rows for 512 x 256 (outputs x inputs) and 4 rows for
# 256 x 512 (and the demo's 256 x 256), at every width for the other shapes below; so the demo
# pair verifies its 512 x 256 projections (MLP gate and up, GatedDeltaNet qkv, attention q: 48)
# as chunks of 2 rows from width 3, and from width 5 its 256 x 512 and 256 x 256 ones too (down,
# z, out, o: 44 more) as chunks of 4; nothing transposed. Its AVX2 kernels (an AMD EPYC VM):
# plain products differ from 4 rows for every shape below, transposed ones never.
CHUNKED_AVX512 = {4: 48, 6: 92}  # verify width -> the demo pair's chunked layers
AVX512_CORES = ("SkylakeX", "Cooperlake", "SapphireRapids")


def avx512_openblas() -> bool:
    return openblas_core() in AVX512_CORES


def bitwise(a, b):
    return a.shape == b.shape and bytes(memoryview(a)) == bytes(memoryview(b))


def test_chunks_cut_rows_into_the_fewest_even_chunks():
    assert row_exact.chunks(4, 3) == [(0, 2), (2, 4)]
    assert row_exact.chunks(5, 3) == [(0, 3), (3, 5)]
    assert row_exact.chunks(6, 3) == [(0, 3), (3, 6)]
    assert row_exact.chunks(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert row_exact.chunks(3, 3) == [(0, 3)]
    assert row_exact.chunks(5, 2) == [(0, 2), (2, 4), (4, 5)]


@pytest.fixture
def no_kernel(monkeypatch):
    monkeypatch.setenv(row_kernel.ENV, "0")  # the kernel would be chosen first where it passes
    row_kernel.reset()
    yield
    monkeypatch.delenv(row_kernel.ENV)
    row_kernel.reset()


def test_install_uses_transposed_products_where_they_equal_one_row_calls(monkeypatch, no_kernel):
    """A layer that first diverges at width 4, where ``(W @ x.T).T`` equals its one-row calls
    (BLIS and OpenBLAS both, for K = 256), computes a verify block in that one product."""
    layer = nn.Linear(256, 512, bias=False)
    mx.eval(layer.parameters())
    monkeypatch.setattr(row_exact, "first_divergent_width", lambda *a: 4)
    assert row_exact.install(layer, 6) == {"": 4}
    assert cpu_blas.STATE.name in ("BLIS", "OpenBLAS")  # the test binding: both measured equal
    assert row_exact.method(layer) == "transposed" and layer.transposed
    calls = []
    original = row_exact.transposed_products
    monkeypatch.setattr(row_exact, "transposed_products",
                        lambda x, w: calls.append(x.shape[-2]) or original(x, w))
    x = mx.random.normal((1, 6, 256), key=mx.random.key(12))
    rows = [x[:, i : i + 1] @ layer.weight.T for i in range(6)]
    for T in (3, 4, 5, 6):
        with row_exact.verifying():
            block = layer(x[:, :T])
        mx.eval(block, rows)
        assert all(bitwise(block[:, i : i + 1], rows[i]) for i in range(T)), T
    assert calls == [4, 5, 6]  # width 3 is below the first divergent width: the plain product


def test_install_chunks_rows_below_the_first_divergent_width(monkeypatch, no_kernel):
    """A layer that first diverges at width 4, where the transposed form differs, is computed as
    its own product on chunks of at most 3 rows inside a verify (no product wider than 3 rows),
    bitwise equal to one-row calls."""
    layer = nn.Linear(256, 512, bias=False)
    mx.eval(layer.parameters())
    monkeypatch.setattr(row_exact, "first_divergent_width", lambda *a: 4)
    monkeypatch.setattr(row_exact, "transposed_equal_rows", lambda *a: False)
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


def test_a_lora_adapter_chunks_rows_below_its_first_divergent_width(monkeypatch):
    """mlx-lm's LoRA wrapper (its own ``x @ lora_a @ lora_b`` beside the wrapped product) is
    chunked too where it first diverges above width 2, bitwise equal to one-row calls."""
    from mlx_lm.tuner.lora import LoRALinear

    layer = LoRALinear.from_base(nn.Linear(256, 512, bias=False), r=8)  # 8 wide: BLIS-exact
    layer.lora_b = mx.random.normal(layer.lora_b.shape, key=mx.random.key(5)) * 0.1
    mx.eval(layer.parameters())
    monkeypatch.setattr(row_exact, "first_divergent_width", lambda *a: 4)
    assert row_exact.install(layer, 6) == {"": 4, "linear": 4}  # the wrapped layer too
    assert row_exact.method(layer) == "chunked" and layer.chunk_rows == 3
    x = mx.random.normal((1, 6, 256), key=mx.random.key(13))
    rows = [layer(x[:, i : i + 1]) for i in range(6)]
    with row_exact.verifying():
        block = layer(x)
    mx.eval(block, rows)
    assert all(bitwise(block[:, i : i + 1], rows[i]) for i in range(6))


def test_install_keeps_blocked_products_where_neither_form_equals(monkeypatch, no_kernel):
    layer = nn.Linear(256, 512, bias=False)
    mx.eval(layer.parameters())
    monkeypatch.setattr(row_exact, "first_divergent_width", lambda *a: 4)
    monkeypatch.setattr(row_exact, "transposed_equal_rows", lambda *a: False)
    monkeypatch.setattr(row_exact, "chunks_equal_rows", lambda *a: False)
    row_exact.install(layer, 6)
    assert row_exact.method(layer) == "blocked" and layer.chunk_rows == 0
    assert not layer.transposed


VERIFY_CHECK = """
import json, sys
sys.path.insert(0, "tests")
import mlx_mtp
import mlx.core as mx
from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.exactness import row_exact
from mlx_mtp.models.qwen3_5 import layer_block

if sys.argv[1] == "chunked":  # the fallback where the transposed form would differ
    row_exact.transposed_equal_rows = lambda *a: False
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
result["choices"] = sorted({str(v) for k, v in layer_block._checked.items()
                           if k[0] in ("tail", "attn")})
print(json.dumps(result))
"""


def run_openblas(code, *args):
    env = {k: v for k, v in os.environ.items()
           if k not in ("BLIS_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                        *cpu_blas.BLIS_WAYS)}
    env.update(MLX_MTP_CPU_BLAS=OPENBLAS, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["blas"] == "OpenBLAS"
    return out


@pytest.mark.skipif(OPENBLAS is None, reason="OpenBLAS is not installed")
@pytest.mark.parametrize("form", ["installed", "chunked"])
def test_openblas_verify_equals_decode_steps_bitwise_at_every_width(form):
    """With OpenBLAS bound, the demo pair's verify of 2..6 tokens gives each row's logits and
    the caches bitwise as that many plain decode steps: with the forms the install chose
    (OpenBLAS 0.3.21, this machine's: every projection first diverges at 4 rows and is computed
    transposed) and with the chunked fallback; the compiled layer pieces with the products
    inside in both."""
    out = run_openblas(VERIFY_CHECK, form)
    assert out["widths"] == {str(w): [True, True] for w in range(2, 7)}
    avx512 = avx512_openblas()
    if form == "installed" and not avx512:
        assert set(out["methods"]) == {"multi-row", "transposed"}
    else:  # the fallback, or AVX-512 kernels where the transposed form is no better (above)
        assert set(out["methods"]) == {"multi-row", "chunked"}
        if avx512:
            assert out["methods"]["chunked"] == CHUNKED_AVX512[6]
    assert set(out["choices"]) == {"(True, True)", "whole"}


SHAPES_CHECK = """
import json
import mlx_mtp
import mlx.core as mx
from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.exactness import row_exact
out = {}
for N, K in ((8, 256), (128, 256), (512, 256), (256, 512), (4096, 1024), (1024, 3072)):
    w = mx.random.normal((N, K), key=mx.random.key(N + K))
    x = mx.random.normal((1, 6, K), key=mx.random.key(3))
    rows = [x[:, i : i + 1] @ w.T for i in range(6)]
    mx.eval(rows)
    with cpu_blas.verify_threads():
        flipped = [row_exact.transposed_products(x[:, :T], w) for T in range(1, 7)]
        plain = [x[:, :T] @ w.T for T in range(1, 7)]
        mx.eval(flipped, plain)
    same = lambda ys: [all(bytes(memoryview(mx.contiguous(y[:, i : i + 1])))
                           == bytes(memoryview(rows[i])) for i in range(y.shape[1])) for y in ys]
    out[f"{N}x{K}"] = [same(flipped), same(plain)]
print(json.dumps({"blas": cpu_blas.STATE.name, "shapes": out}))
"""


@pytest.mark.skipif(OPENBLAS is None, reason="OpenBLAS is not installed")
def test_openblas_transposed_products_equal_one_row_products_where_plain_ones_do_not():
    """What the transposed form rests on, on this machine's OpenBLAS (0.3.21) with the verify's
    one thread: ``x @ W.T`` of 4..6 rows differs from one-row products, ``(W @ x.T).T`` of 1..6
    rows equals them, for the demo pair's and the realistic-size pair's shapes."""
    out = run_openblas(SHAPES_CHECK)
    if avx512_openblas():  # no gain from the transposed form there: the row chunks take over
        exact_rows = {"512x256": 2, "256x512": 4}
        for shape, (flipped, plain) in out["shapes"].items():
            n = exact_rows.get(shape, 6)
            assert flipped == plain == [True] * n + [False] * (6 - n), shape
        return
    for shape, (flipped, plain) in out["shapes"].items():
        assert flipped == [True] * 6, shape
        assert plain == [True] * 3 + [False] * 3, shape


GENERATE_CHECK = """
import json
import mlx_mtp
import mlx.core as mx
from pathlib import Path
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model
from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.decoding.stats import RunStats

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
                          stats.exactness.get("row_exact", {}).get("layers"), stats.accepted]
print(json.dumps(out))
"""


@pytest.mark.skipif(OPENBLAS is None, reason="OpenBLAS is not installed")
def test_openblas_greedy_output_is_mlx_lms_at_blocks_4_and_6():
    """With OpenBLAS bound, the gate's probe says ``equal`` at widths up to 6 and T=0 MTP output
    on the demo pair is mlx-lm's plain greedy decode, drafts accepted."""
    out = run_openblas(GENERATE_CHECK)
    for block, (same, verdict, layers, accepted) in out["runs"].items():
        assert same and verdict == "equal", block
        want = ({"chunked": CHUNKED_AVX512[int(block)]} if avx512_openblas()
                else {"transposed": 125})
        assert layers == want and accepted > 0, (block, layers, accepted)
