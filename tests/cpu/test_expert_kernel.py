"""The expert kernel (mlx_mtp.cpu.expert_kernel, row_dot.c's expert_dot): every (row, expert)
product in the row kernel's documented order (``support.native_support.row_dot_reference``, any
host), bitwise mlx-lm's one-row ``gather_mm`` calls where the bound BLAS reduces one row in that
order (BLIS's AVX2 configurations: measured, not assumed); rows sharing experts, rows sharing
none, one row, every expert, strided stacks, bfloat16 weights, any thread count."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_mtp.cpu import expert_kernel
from support.native_support import (one_row_products_in_kernel_order, require_lazy,
                                    row_dot_reference)

E, N, K = 16, 64, 580  # K > 512 (BLIS's multi-row order differs there) and K % 8 != 0


@pytest.fixture(autouse=True)
def lazy():
    require_lazy()


def stack(seed, experts=E, rows=N, dtype=mx.float32):
    w = mx.random.normal((experts, rows, K), key=mx.random.key(seed)).astype(dtype)
    mx.eval(w)
    return w


def inputs(X, seed):
    return mx.random.normal((X, K), key=mx.random.key(seed))


ROUTES = {
    "shared": [[3, 7, 1, 12]] * 5,  # every row the same experts: one expert, five rows
    "none": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],  # every expert once
    "mixed": [[5, 2, 9, 0], [2, 5, 11, 4], [0, 13, 2, 9], [14, 2, 5, 6], [9, 8, 7, 2],
              [1, 2, 3, 4], [15, 2, 0, 9]],  # 7 rows: expert 2 in every row (more than 6 rows)
    "one row": [[4, 15, 0, 8]],
}


def reference(x, idx, w):
    """Entry i's row in the documented order, one entry at a time (numpy)."""
    x, idx, w = np.array(x), np.array(idx), np.array(w.astype(mx.float32))
    k = idx.shape[1]
    return np.concatenate([row_dot_reference(x[i // k : i // k + 1], w[e])
                           for i, e in enumerate(idx.reshape(-1))])


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_each_entry_is_the_documented_one_row_order(route):
    idx = mx.array(ROUTES[route], dtype=mx.uint32)
    x, w = inputs(idx.shape[0], 1), stack(2)
    got = expert_kernel.products(x, idx, w)
    assert got.shape == (idx.size, N)
    assert np.array(got).tobytes() == reference(x, idx, w).tobytes()


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_each_entry_equals_mlx_lms_one_row_gather_mm_where_blas_has_that_order(route):
    if not one_row_products_in_kernel_order():
        pytest.skip("the bound BLAS reduces one row in another order (the check declines)")
    idx = mx.array(ROUTES[route], dtype=mx.uint32)
    x, w = inputs(idx.shape[0], 3), stack(4)
    k = idx.shape[1]
    rows = [mx.gather_mm(x[r : r + 1][None, None], w.swapaxes(-1, -2),
                         rhs_indices=idx[r : r + 1]).reshape(k, N) for r in range(idx.shape[0])]
    want = mx.concatenate(rows)
    got = expert_kernel.products(x, idx, w, threads=2)
    mx.eval(want, got)
    assert bytes(memoryview(got)) == bytes(memoryview(want))


def test_halves_of_a_fused_stack_are_read_in_place_and_inputs_per_entry():
    """A fused gate/up stack's halves (strided views: each expert's rows contiguous), and one
    input row per entry (the down projection's: ``idx [n, 1]``)."""
    fused = stack(5, rows=2 * N)
    gate, up = fused[:, :N], fused[:, N:]
    assert expert_kernel.fits(gate) and expert_kernel.fits(up)
    idx = mx.array(ROUTES["mixed"], dtype=mx.uint32)
    x = inputs(idx.shape[0], 6)
    for half in (gate, up):
        got = expert_kernel.products(x, idx, half)
        assert np.array(got).tobytes() == reference(x, idx, mx.contiguous(half)).tobytes()
    per_entry = inputs(idx.size, 7)
    flat = idx.reshape(-1, 1)
    got = expert_kernel.products(per_entry, flat, gate)
    assert np.array(got).tobytes() == reference(per_entry, flat, mx.contiguous(gate)).tobytes()


def test_bfloat16_weights_give_the_float32_kernels_bytes_on_their_values():
    w16 = stack(8, dtype=mx.bfloat16)
    idx = mx.array(ROUTES["mixed"], dtype=mx.uint32)
    x = inputs(idx.shape[0], 9)
    got = expert_kernel.products(x, idx, w16)
    want = expert_kernel.products(x, idx, w16.astype(mx.float32))
    mx.eval(got, want)
    assert bytes(memoryview(got)) == bytes(memoryview(want))
    assert np.array(got).tobytes() == reference(x, idx, w16).tobytes()


def test_the_bytes_do_not_depend_on_the_thread_count():
    w = stack(10, experts=8, rows=512)  # large enough that the kernel splits it
    idx = mx.array([[0, 3, 5, 7], [3, 1, 0, 6], [2, 3, 4, 5]], dtype=mx.uint32)
    x = inputs(3, 11)
    outs = [expert_kernel.products(x, idx, w, threads=t) for t in (1, 2, 3, 8)]
    mx.eval(outs)
    assert len({bytes(memoryview(o)) for o in outs}) == 1


def test_what_the_kernel_refuses():
    x, w = inputs(2, 12), stack(13)
    with pytest.raises(ValueError, match="N a multiple of 8"):
        expert_kernel.products(x, mx.zeros((2, 2), mx.uint32), stack(13, rows=60))
    with pytest.raises(RuntimeError, match="expert kernel failed"):
        mx.eval(expert_kernel.products(x, mx.array([[0, E]], dtype=mx.uint32).reshape(2, 1), w))
    assert not expert_kernel.fits(stack(13, rows=60))  # float32 columns not in groups of 8
    assert expert_kernel.fits(stack(13, rows=60, dtype=mx.bfloat16))  # bf16: any N
    square = mx.random.normal((4, 64, 64), key=mx.random.key(14))
    assert expert_kernel.fits(square) and not expert_kernel.fits(mx.swapaxes(square, 1, 2))
