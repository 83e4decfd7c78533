"""The attention kernel against MLX's one-query SDPA (decode's call), bit for bit: widths 1-6,
GQA, short and long rows, a ring's overridden slots, a tree's paths; the check that gates it
fails closed; bad layouts are refused."""

import mlx_mtp  # noqa: F401  (binds the system BLAS before mlx.core runs an op)
import mlx.core as mx
import pytest

from mlx_mtp.cpu import attention_kernel
from mlx_mtp.cpu.attention_kernel import KVRows
from mlx_mtp.exactness import row_attention

pytestmark = pytest.mark.skipif(attention_kernel.problem() is not None,
                                reason=f"attention kernel: {attention_kernel.problem()}")


def bitwise(a, b):
    mx.eval(a, b)
    return a.shape == b.shape and a.dtype == b.dtype and \
        bytes(memoryview(a)) == bytes(memoryview(b))


def tensors(seed, G, cap, D, H, w):
    k = mx.random.split(mx.random.key(seed), 5)
    return (mx.random.normal((1, G, cap, D), key=k[0]), mx.random.normal((1, G, cap, D), key=k[1]),
            mx.random.normal((1, H, w, D), key=k[2]), mx.random.normal((1, G, w, D), key=k[3]),
            mx.random.normal((1, G, w, D), key=k[4]))


@pytest.fixture(autouse=True)
def fresh_checks():
    row_attention.reset()
    yield
    row_attention.reset()


@pytest.mark.parametrize("H, G, D", [(4, 2, 16), (4, 1, 32), (2, 2, 256), (8, 8, 64)])
@pytest.mark.parametrize("w", [1, 2, 3, 4, 5, 6])
def test_prefix_rows_equal_one_query_sdpa(H, G, D, w):
    """A full cache's block: row i sees the first start + i + 1 keys of a buffer with room to
    spare (a view, as the cache holds it); every residue mod 8, short and past 1k keys."""
    scale = D ** -0.5
    keys, values, queries, _, _ = tensors(H * 100 + w, G, 1300, D, H, w)
    for start in [0, 1, 2, 3, 5, 6, 7, 8, 13, 60, 517, 1030 + w]:
        rows = KVRows(keys[..., : start + w, :], values[..., : start + w, :],
                      [start + i + 1 for i in range(w)])
        mine = attention_kernel.attend(queries, rows, scale, threads=1 + start % 3)
        assert bitwise(mine, row_attention.by_rows(queries, rows, scale)), (start, w)


@pytest.mark.parametrize("w", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("size", [16, 61, 512])
def test_ring_rows_with_overwritten_slots_equal_one_query_sdpa(w, size):
    """A sliding window's ring after a block's writes: every row sees the whole ring, with the
    slots that later rows overwrote holding what they held before (overrides), across the wrap."""
    H, G, D = 4, 2, 16
    keys, values, queries, old_k, old_v = tensors(size + w, G, size, D, H, w)
    for first in (size - w, size - 2, 0, 3):
        slots = [(first + j) % size for j in range(w)]
        ring = [sorted((slots[j], j) for j in range(i + 1, w)) for i in range(w)]
        rows = KVRows(keys, values, [size] * w, ring, old_k, old_v)
        mine = attention_kernel.attend(queries, rows, 0.25)
        assert bitwise(mine, row_attention.by_rows(queries, rows, 0.25)), (first, w)


def test_tree_rows_equal_one_query_sdpa():
    """A draft tree: each row sees the cache as it was plus its path's rows."""
    H, G, D, base = 4, 2, 32, 29
    parents = [-1, 0, 0, 1, 1, 2]
    w = len(parents)
    keys, values, queries, extra_k, extra_v = tensors(7, G, 64, D, H, w)
    paths = []
    for i in range(w):
        p, node = [], i
        while node >= 0:
            p.append(node)
            node = parents[node]
        paths.append(p[::-1])
    rows = KVRows(keys[..., :base, :], values[..., :base, :], [base + len(p) for p in paths],
                  [[(base + t, n) for t, n in enumerate(p)] for p in paths], extra_k, extra_v)
    mine = attention_kernel.attend(queries, rows, 0.2)
    assert bitwise(mine, row_attention.by_rows(queries, rows, 0.2))


def test_check_passes_per_signature_and_doubles_its_tier():
    assert row_attention.applies(4, 2, 16, [5, 6, 7], 0.25, mx.float32)
    assert row_attention.applies(4, 2, 16, [1100, 1101, 1102], 0.25, mx.float32)
    assert row_attention.report()["checked"] == {"heads 4 kv 2 dim 16 width 3":
                                                 "equal up to 2048 keys"}
    assert not row_attention.applies(4, 2, 16, [5, 6], 0.25, mx.float16)  # float32 only
    assert not row_attention.applies(4, 2, 12, [5, 6], 0.25, mx.float32)  # head dim % 8


def test_check_fails_closed_on_a_kernel_that_differs(monkeypatch):
    """One ulp off anywhere: the signature stays on one SDPA per row."""
    real = attention_kernel.attend

    def off_by_an_ulp(queries, rows, scale, threads=1):
        out = real(queries, rows, scale, threads)
        return out.at[0, 0, -1, 0].add(mx.array(1e-6))

    monkeypatch.setattr(attention_kernel, "attend", off_by_an_ulp)
    assert not row_attention.applies(4, 2, 16, [9, 10], 0.25, mx.float32)
    assert row_attention.report()["checked"] == {
        "heads 4 kv 2 dim 16 width 2": "diverges (longer rows: by rows)"}
    assert not row_attention.applies(4, 2, 16, [9, 10], 0.25, mx.float32)  # remembered


def test_switch_off(monkeypatch):
    monkeypatch.setenv(row_attention.ENV, "0")
    assert row_attention.problem() == f"{row_attention.ENV}=0"
    assert not row_attention.applies(4, 2, 16, [9, 10], 0.25, mx.float32)


def test_bad_layouts_are_refused():
    keys, values, queries, extra_k, _ = tensors(1, 2, 16, 16, 4, 2)
    with pytest.raises(ValueError, match=r"^attention kernel: 2 query rows for a layout of 3$"):
        attention_kernel.attend(queries, KVRows(keys, values, [3, 4, 5]), 0.25)
    # a row that sees past the buffer with nothing there: the C layout check refuses it
    with pytest.raises(RuntimeError, match=r"attention kernel \(scores\) failed"):
        mx.eval(attention_kernel.attend(queries, KVRows(keys[..., :4, :], values[..., :4, :],
                                                        [4, 5]), 0.25))
