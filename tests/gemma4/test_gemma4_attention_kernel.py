"""Gemma 4's verify through the attention kernel: blocks written in one go give every row the
K/V of its plain decode step and roll back to plain decode's cache bit for bit (full and sliding
caches, across the ring's wrap); the kernel's rows over those caches equal decode's SDPA; the
tiny pairs give mlx-lm's greedy output through the kernel (chains at blocks 2-5 and trees)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache
from support.reference import reference_greedy
from support.tiny_gemma4 import WINDOW, Checkpoints

import mlx_mtp
from mlx_mtp.cpu import attention_kernel
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.exactness import row_attention
from mlx_mtp.models.gemma4.rollback_caches import RollbackKVCache, RollbackRotatingKVCache

D = 16
PROMPTS = {"short": [(7 * i + 3) % 300 for i in range(5)],  # crosses the window while decoding
           "long": [(11 * i + 5) % 300 for i in range(40)]}  # longer than the window
assert len(PROMPTS["short"]) < WINDOW < len(PROMPTS["long"])
needs_kernel = pytest.mark.skipif(attention_kernel.problem() is not None,
                                  reason=f"attention kernel: {attention_kernel.problem()}")


def marks(positions):
    """K/V [1, 2, n, D] that differ per position, head and feature."""
    p = mx.array(np.asarray(positions, dtype=np.float32)).reshape(1, 1, -1, 1)
    f = mx.arange(2 * D, dtype=mx.float32).reshape(1, 2, 1, D)
    k = mx.sin(p * 0.37 + f * 0.11)
    return k, mx.cos(p * 0.23 - f * 0.07)


def bitwise(a, b):
    mx.eval(a, b)
    return a.shape == b.shape and a.dtype == b.dtype and \
        bytes(memoryview(a)) == bytes(memoryview(b))


def state_of(cache):
    return tuple(x[...] if isinstance(x, mx.array) else x for x in cache.state)


def same_state(a, b):
    return all(bitwise(x, y) if isinstance(x, mx.array) else x == y for x, y in zip(a, b))


@pytest.fixture(autouse=True)
def fresh_checks():
    row_attention.reset()
    yield
    row_attention.reset()


@pytest.mark.parametrize("kind", ["full", "sliding"])
@pytest.mark.parametrize("window", [4, 16])
@pytest.mark.parametrize("prompt_len", [1, 3, 17, 300])
def test_block_writes_and_rollbacks_reproduce_plain_decode(kind, window, prompt_len):
    """Blocks of 1..7 rows written in one go where the cache allows it (else row by row, as the
    attention does), rolled back to 1..T kept rows (in one trim or two): every row sees the K/V
    of the stock cache's decode step, and every kept state is the stock cache's, bit for bit."""
    stock, ours = ((KVCache(), RollbackKVCache()) if kind == "full" else
                   (RotatingKVCache(max_size=window, keep=0), RollbackRotatingKVCache(window)))
    n_decode = 3 * window + 270
    want_state, want_kv = {}, {}
    stock.update_and_fetch(*marks(range(prompt_len)))
    want_state[prompt_len] = state_of(stock)
    for q in range(prompt_len, prompt_len + n_decode):
        want_kv[q] = tuple(a[...] for a in stock.update_and_fetch(*marks([q])))
        want_state[q + 1] = state_of(stock)
    ours.update_and_fetch(*marks(range(prompt_len)))
    blocks, q, r, in_one_go = [1, 3, 7, 2, 5, 1, 6, 4], prompt_len, 0, 0
    while q < prompt_len + n_decode - 8:
        T = blocks[r % len(blocks)]
        if ours.plan(T) is not None:
            rows = ours.update_block(*marks(range(q, q + T)))
            seen = [rows.row(i) for i in range(T)]
            in_one_go += 1
        else:
            seen = ours.update_rows(*marks(range(q, q + T)))
        for i, (k, v) in enumerate(seen):
            assert bitwise(k, want_kv[q + i][0]) and bitwise(v, want_kv[q + i][1]), (q, i)
        keep = 1 + (r % T)
        if T - keep >= 2 and r % 2:
            assert ours.trim(1) == 1 and ours.trim(T - keep - 1) == T - keep - 1
        else:
            assert ours.trim(T - keep) == T - keep
        q += keep
        assert same_state(state_of(ours), want_state[q]), q
        r += 1
    assert in_one_go > 30


def test_block_trim_refuses_more_than_the_block():
    c = RollbackRotatingKVCache(4)
    c.update_and_fetch(*marks(range(30)))
    assert c.plan(3) is None  # the prefill's buffer is longer than the ring: rows first
    c.update_and_fetch(*marks([30]))  # a decode step trims it to the ring
    c.update_block(*marks(range(31, 34)))
    with pytest.raises(ValueError, match=r"^cannot trim 4 positions: only the 3 rows of the last "
                                         r"verify block can be rolled back$"):
        c.trim(4)
    assert c.trim(2) == 2 and c.trim(1) == 1 and c.offset == 31
    with pytest.raises(ValueError, match=r"^update_block: the block would grow or trim the "
                                         r"buffer$"):
        RollbackKVCache().update_block(*marks(range(2)))  # nothing allocated yet


@needs_kernel
@pytest.mark.parametrize("kind", ["full", "sliding"])
@pytest.mark.parametrize("w", [1, 2, 3, 4, 5, 6])
def test_kernel_rows_over_the_caches_equal_decode_sdpa(kind, w):
    """The kernel over a block's KVRows (GQA: 4 query heads on 2 KV heads) equals one SDPA per
    row over the K/V the stock cache's decode step returns, short and past the window."""
    H = 4
    for prompt_len in (3, WINDOW - 2, WINDOW + 5, 300):
        stock, ours = ((KVCache(), RollbackKVCache()) if kind == "full" else
                       (RotatingKVCache(max_size=WINDOW, keep=0), RollbackRotatingKVCache(WINDOW)))
        stock.update_and_fetch(*marks(range(prompt_len)))
        ours.update_and_fetch(*marks(range(prompt_len)))
        ours.update_rows(*marks(range(prompt_len, prompt_len + 1)))  # a round: the ring wraps
        ours.trim(0)
        stock.update_and_fetch(*marks(range(prompt_len, prompt_len + 1)))
        q0 = prompt_len + 1
        if ours.plan(w) is None:
            continue
        rows = ours.update_block(*marks(range(q0, q0 + w)))
        queries = mx.random.normal((1, H, w, D), key=mx.random.key(q0 + w))
        want = mx.concatenate([
            mx.fast.scaled_dot_product_attention(
                queries[:, :, i : i + 1], *stock.update_and_fetch(*marks([q0 + i])), scale=0.25)
            for i in range(w)], axis=2)
        assert row_attention.applies_to(H, rows, 0.25)
        assert bitwise(row_attention.attend(queries, rows, 0.25), want), (prompt_len, w)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return Checkpoints(tmp_path_factory)


@needs_kernel
@pytest.mark.parametrize("kind", ["e2b", "31b"])
def test_greedy_identity_through_the_kernel(kind, ckpts):
    """Chains at blocks 2-5 and trees: mlx-lm's greedy output, the verify's attention through
    the kernel (counted), none by rows."""
    path = ckpts.target(kind)
    model = mlx_mtp.load_model(path, drafter=ckpts.assistant(kind))
    for name, prompt in PROMPTS.items():
        ref = reference_greedy(path, prompt, 24)
        for block_size, tree in ((2, {}), (3, {}), (4, {}), (5, {}), (3, {"draft_topk": 2})):
            row_attention.reset()
            stats = RunStats()
            out = [t for t, _ in mlx_mtp.generate_step(
                mx.array(prompt), model, max_tokens=24, block_size=block_size, stats=stats,
                **tree)]
            assert out == ref, (kind, name, block_size, tree)
            used = row_attention.usage()
            assert used["kernel"] > 0 and used["rows"] == 0, (kind, name, block_size, used)
            if tree:
                assert stats.to_dict()["tree_nodes_per_round"] > 0
