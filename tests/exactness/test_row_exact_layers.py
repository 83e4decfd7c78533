"""Row-exact verify layers: inside a verify, every T-row product equals T one-row products."""

import mlx.core as mx
import mlx.nn as nn
import pytest

import mlx_mtp
from mlx_mtp.exactness import row_exact_layers
from mlx_mtp.cpu import row_kernel


@pytest.fixture
def no_kernel(monkeypatch):
    """The compiled row kernel switched off (MLX_MTP_ROW_KERNEL=0): today's fallbacks."""
    monkeypatch.setenv(row_kernel.ENV, "0")
    row_kernel.reset()
    yield
    monkeypatch.delenv(row_kernel.ENV)
    row_kernel.reset()


def bitwise(a, b):
    return a.shape == b.shape and bytes(memoryview(a)) == bytes(memoryview(b))


def check_rows(fn, in_dims, width):
    x = mx.random.normal((1, width, in_dims), key=mx.random.key(7))
    with row_exact_layers.verifying():
        block = fn(x)
    rows = [fn(x[:, i : i + 1]) for i in range(width)]
    mx.eval(block, rows)
    return all(bitwise(block[:, i : i + 1], rows[i]) for i in range(width))


def test_every_target_linear_is_row_exact_inside_verify(dense_dir, tied_dir, q4_dir):
    for path in (dense_dir, tied_dir, q4_dir):
        model = mlx_mtp.load_model(path, require_head=False)
        model.target.prepare(6)
        tied = model.target.args.tie_word_embeddings
        for name, layer in model.mlx_model.named_modules():
            if isinstance(layer, (nn.Linear, nn.QuantizedLinear)):
                quantized = isinstance(layer, nn.QuantizedLinear)
                k = layer.weight.shape[1] * (32 // layer.bits if quantized else 1)
                assert check_rows(layer, k, 6), (path.name, name)
        if tied:
            emb = model.target.trunk.embed_tokens
            assert check_rows(emb.as_linear, emb.weight.shape[1], 6)
        if path != q4_dir:  # quantized matmuls skip BLAS
            # The GatedDeltaNet a/b projections (4 value heads here: outputs not a multiple of
            # 8 wide, which BLIS's AVX2 kernels reduce differently for several rows) are switched
            # exactly where this BLAS's multi-row product of them differs from one-row products.
            switched = model.target.row_exact_layers
            layer = next(m for n, m in model.mlx_model.named_modules()
                         if n.endswith("linear_attn.in_proj_a"))  # outside a verify: plain
            diverges = row_exact_layers.first_divergent_width(layer, 6, layer.weight.shape[1],
                                                       layer.weight.dtype) > 0
            assert any(n.endswith("linear_attn.in_proj_a") for n in switched) == diverges, \
                switched


def test_outside_verify_the_multi_row_path_is_untouched():
    layer = nn.Linear(64, 4, bias=False)
    mx.eval(layer.parameters())
    row_exact_layers.switch_to_row_exact(layer, 4)
    x = mx.random.normal((1, 4, 64), key=mx.random.key(3))
    plain = x @ layer.weight.T
    mx.eval(plain, layer(x))
    assert bitwise(layer(x), plain)  # no verify: the same op as an un-swapped Linear


def test_first_divergent_width_sees_a_row_dependent_function():
    w = mx.random.normal((8, 16), key=mx.random.key(1))

    def leaky(x):  # row i depends on the number of rows: never row-invariant
        return x @ w.T + x.shape[-2]

    assert row_exact_layers.first_divergent_width(leaky, 4, 16, mx.float32) == 2
    assert row_exact_layers.first_divergent_width(lambda x: x * 2.0, 4, 16, mx.float32) == 0


def test_one_row_products_equal_one_row_calls_per_block_size():
    """The column-blocked batched formulation equals the one-row product of the whole matrix,
    bitwise, with this BLAS, for shapes where a plain multi-row product differs (BLIS: K > 512,
    outputs not a multiple of 8) and for every block size tried, ragged last block included."""
    for K, N in ((1024, 640), (768, 36), (256, 512)):
        w = mx.random.normal((N, K), key=mx.random.key(K + N))
        x = mx.random.normal((1, 4, K), key=mx.random.key(5))
        rows = [x[:, i : i + 1] @ w.T for i in range(4)]
        for cols in (N, 256, 96, 64, 16):
            got = row_exact_layers.one_row_products(x, w, cols)
            mx.eval(got, rows)
            assert got.shape == (1, 4, N)
            assert all(bitwise(got[:, i : i + 1], rows[i]) for i in range(4)), (K, N, cols)


def test_block_columns_keeps_a_block_within_block_bytes():
    assert row_exact_layers.block_columns(mx.zeros((8192, 1024))) == 64
    assert row_exact_layers.block_columns(mx.zeros((1024, 8192))) == 32  # 64 x 8192 x 4 > 1 MiB
    assert row_exact_layers.block_columns(mx.zeros((1024, 65536))) == 16  # the floor
    assert row_exact_layers.block_columns(mx.zeros((36, 1024))) == 36  # narrower than a block: whole


def test_install_uses_blocked_one_row_products_for_float_layers(no_kernel, monkeypatch):
    """With the transposed form and row chunks ruled out, a diverging float layer is computed as
    batched one-row products over column blocks of ``block_columns`` (64 here) where those
    measure equal to the one-row call on this BLAS."""
    layer = nn.Linear(1024, 8192, bias=False)
    mx.eval(layer.parameters())
    monkeypatch.setattr(row_exact_layers, "transposed_equal_rows", lambda *a: False)
    monkeypatch.setattr(row_exact_layers, "chunks_equal_rows", lambda *a: False)
    calls = []
    original = row_exact_layers.one_row_products

    def spy(x, w, cols):
        calls.append(cols)
        return original(x, w, cols)

    divergent = row_exact_layers.first_divergent_width(layer, 3, 1024, mx.float32)
    blocks_ok = row_exact_layers.products_equal_rows(layer, layer.weight, 64, 3, mx.float32)
    switched = row_exact_layers.switch_to_row_exact(layer, 3)
    assert switched == ({"": divergent} if divergent else {})
    if not divergent:  # this BLAS (bundled) reduces 3 rows like 1 here: the layer stays plain
        assert type(layer) is nn.Linear
        return
    if not blocks_ok:  # not on this BLAS: the fallbacks (test below), exact all the same
        assert layer.block_cols != 64 and check_rows(layer, 1024, 3)
        return
    assert layer.block_cols == 64
    row_exact_layers.one_row_products = spy
    try:
        assert check_rows(layer, 1024, 3)
    finally:
        row_exact_layers.one_row_products = original
    assert calls == [64]


def test_waived_exactness_verifies_with_the_multi_row_kernels(dense_dir, monkeypatch):
    """prepare(exact=False) (the gate overridden): a verify is the plain multi-row forward, with
    no row-exact products and no per-row attention; prepare() turns them back on."""
    from mlx_mtp.exactness import row_attention
    from mlx_mtp.models.qwen3_5 import target as qwen3_5

    model = mlx_mtp.load_model(dense_dir, require_head=False)
    target = model.target
    calls = []
    for name in ("one_row_products", "_by_rows", "transposed_products", "chunked",
                 "kernel_products"):  # every row-exact form, whichever this BLAS needs
        original = getattr(row_exact_layers, name)
        monkeypatch.setattr(row_exact_layers, name,
                            lambda *a, _o=original, _n=name: calls.append(_n) or _o(*a))
    per_row = []
    sdpa = mx.fast.scaled_dot_product_attention
    monkeypatch.setattr(qwen3_5.mx.fast, "scaled_dot_product_attention",
                        lambda q, *a, **kw: per_row.append(q.shape[2]) or sdpa(q, *a, **kw))
    ids = mx.array([[3, 1, 4, 1]])

    def run(fn):
        cache = target.make_cache()
        mx.eval(target.hidden(mx.array([[2, 7, 1, 8, 2]]), cache))
        calls.clear(), per_row.clear()
        out = target.logits(fn(ids, cache)[0])
        mx.eval(out)
        return out

    target.prepare(4, exact=False)
    waived = run(target.verify)
    assert calls == [] and set(per_row) == {4}  # whole-block products and attention
    plain = run(target.hidden)
    assert bitwise(waived, plain)
    target.prepare(4)
    before = row_attention.usage()
    run(target.verify)
    # each query row on its own again: the attention kernel's rows (whose check runs one-row
    # SDPAs) or one SDPA per row
    used = {k: n - before[k] for k, n in row_attention.usage().items()}
    assert used["kernel"] + used["rows"] == sum(not layer.is_linear for layer in target.layers)
    assert set(per_row) <= {1} and (bool(per_row) or not used["rows"])
    assert bool(calls) == bool(target.row_exact_layers)


def test_install_falls_back_to_whole_matrix_rows_where_blocks_differ(monkeypatch, no_kernel):
    """Where column blocks (7 wide here) differ from the one-row product of the whole matrix (as
    BLIS's AVX2 kernels make a one-row product narrower than 8 columns differ; forced here, so on
    every BLAS), install must not use them: the whole matrix's batched one-row products where
    those equal the one-row call (measured), else separate one-row calls; exact either way."""
    layer = nn.Linear(1024, 640, bias=False)
    mx.eval(layer.parameters())
    divergent = row_exact_layers.first_divergent_width(layer, 3, 1024, mx.float32)
    whole_ok = row_exact_layers.products_equal_rows(layer, layer.weight, 640, 3, mx.float32)
    measured = row_exact_layers.products_equal_rows
    monkeypatch.setattr(row_exact_layers, "products_equal_rows",
                        lambda fn, w, cols, *a: cols != 7 and measured(fn, w, cols, *a))
    monkeypatch.setattr(row_exact_layers, "transposed_equal_rows", lambda *a: False)
    monkeypatch.setattr(row_exact_layers, "chunks_equal_rows", lambda *a: False)
    monkeypatch.setattr(row_exact_layers, "block_columns", lambda w: 7)
    switched = row_exact_layers.switch_to_row_exact(layer, 3)
    assert switched == ({"": divergent} if divergent else {})
    if not divergent:  # a BLAS that reduces 3 rows like 1 here (bundled): nothing switched
        assert type(layer) is nn.Linear
        return
    assert layer.block_cols == (640 if whole_ok else 0)
    assert row_exact_layers.row_method(layer) == ("blocked" if whole_ok else "rows")
    assert check_rows(layer, 1024, 3)
