"""The rollback-safe sliding-window cache against mlx-lm's RotatingKVCache and plain decode."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import RotatingKVCache, trim_prompt_cache
from mlx_lm.utils import load_model as mlx_load_model
from tiny_gemma4 import WINDOW, Checkpoints

import mlx_mtp.sliding_cache as sliding_cache
from mlx_mtp.sliding_cache import SlidingWindowCache
from mlx_mtp.targets.gemma4 import Gemma4Target


def marks(positions):
    """K/V whose single feature is the absolute position: the order of keys is readable."""
    a = mx.array(np.asarray(positions, dtype=np.float32)).reshape(1, 1, -1, 1)
    return a, a + 0.5


def order(keys):
    return [int(x) for x in np.array(keys).reshape(-1)]


def prefill_chunks(prompt_len, step):
    """mlx-lm's generate_step prefill: prompt[:-1] in chunks of ``step``, then the last token."""
    out, s = [], 0
    while prompt_len - s > 1:
        e = min(s + step, prompt_len - 1)
        out.append((s, e))
        s = e
    return out + [(prompt_len - 1, prompt_len)]


def stock_plain_decode_orders(window, prompt_len, step, n_decode):
    """Key order the stock cache hands attention at every plain-decode step, by position."""
    stock = RotatingKVCache(max_size=window, keep=0)
    orders = {}
    for s, e in prefill_chunks(prompt_len, step):
        k, _ = stock.update_and_fetch(*marks(range(s, e)))
        orders[(s, e)] = order(k)
    for q in range(prompt_len, prompt_len + n_decode):
        k, _ = stock.update_and_fetch(*marks([q]))
        orders[(q, q + 1)] = order(k)
    return orders


@pytest.mark.parametrize("window", [4, 16])
@pytest.mark.parametrize("prompt_len", [1, 2, 3, 15, 16, 17, 50])
@pytest.mark.parametrize("step", [2048, 5])
def test_every_row_sees_the_stock_plain_decode_key_order(window, prompt_len, step):
    """Prefill returns the stock tensors; every row of a verify block (blocks of 1..7, with the
    rollbacks of the round loop) sees exactly the keys, in the order, of the stock ring buffer at
    that position in plain decode; masked keys are the only extras."""
    n_decode = 3 * window + 20
    want = stock_plain_decode_orders(window, prompt_len, step, n_decode)
    ours, stock = SlidingWindowCache(window), RotatingKVCache(max_size=window, keep=0)
    for s, e in prefill_chunks(prompt_len, step)[:-1]:
        mask, stock_mask = (c.make_mask(e - s, window_size=window) for c in (ours, stock))
        k, v = ours.update_and_fetch(*marks(range(s, e)))
        stock.update_and_fetch(*marks(range(s, e)))
        assert order(k) == want[(s, e)]
        if isinstance(stock_mask, mx.array):
            assert mx.array_equal(mask, stock_mask).item()
        else:
            assert mask == stock_mask
    blocks = [1, 3, 7, 2, 5, 1, 6, 4]
    q, r = prompt_len - 1, 0
    while q < prompt_len + n_decode - 8:
        T = blocks[r % len(blocks)]
        mask = ours.make_mask(T, window_size=window)
        k, v = ours.update_and_fetch(*marks(range(q, q + T)))
        assert np.array_equal(np.array(v) - 0.5, np.array(k))
        keys = order(k)
        if T == 1:
            assert mask is None
            assert keys == want[(q, q + 1)]
        else:
            m = np.array(mask)
            assert m.shape == (T, len(keys))
            for row in range(T):
                assert [p for p, ok in zip(keys, m[row]) if ok] == want[(q + row, q + row + 1)]
        keep = 1 + (r % T)
        assert ours.trim(T - keep) == T - keep
        q += keep
        r += 1


def test_stock_rotating_cache_cannot_roll_back_past_the_window():
    """Why the target does not use RotatingKVCache: past the window, trim_prompt_cache silently
    trims nothing."""
    stock = RotatingKVCache(max_size=WINDOW, keep=0)
    stock.update_and_fetch(*marks(range(WINDOW + 3)))
    assert not stock.is_trimmable()
    assert trim_prompt_cache([stock], 2) == 0
    assert stock.offset == WINDOW + 3
    ours = SlidingWindowCache(WINDOW)
    ours.update_and_fetch(*marks(range(WINDOW + 3)))
    assert ours.is_trimmable() and trim_prompt_cache([ours], 2) == 2 and ours.offset == WINDOW + 1


def test_trim_is_exact_and_refuses_more_than_it_holds():
    c = SlidingWindowCache(4)
    c.update_and_fetch(*marks(range(510)))  # capacity 512: the third update compacts
    c.update_and_fetch(*marks([510]))
    c.update_and_fetch(*marks(range(511, 516)))
    assert c.start == 507
    assert c.trim(5) == 5 and c.offset == 511
    assert order(c.committed()[0]) == [507, 508, 509, 510]
    assert order(c.window_kv(508, 511)[0]) == [508, 509, 510]
    with pytest.raises(ValueError, match=r"^cannot trim 2 positions: the window would then need "
                                         r"position 505, the cache holds 507\.\.510$"):
        c.trim(2)
    with pytest.raises(ValueError, match=r"^cannot trim -1 positions$"):
        c.trim(-1)
    with pytest.raises(ValueError, match=r"^positions 3\.\.510 are not held \(cache holds "
                                         r"507\.\.510\)$"):
        c.window_kv(3, 511)


def test_memory_stays_bounded():
    c = SlidingWindowCache(WINDOW)
    c.update_and_fetch(*marks(range(40)))
    caps = []
    for q in range(40, 3000, 3):
        c.update_and_fetch(*marks(range(q, q + 5)))
        c.trim(2)
        caps.append(c.keys.shape[2])
    assert max(caps[10:]) <= WINDOW + 2 * SlidingWindowCache.step
    assert order(c.committed()[0]) == list(range(c.offset - WINDOW, c.offset))


# ---------------------------------------------------------------------------------------- model


def stock_logits(model, prompt, n):
    """mlx-lm plain decode with the stock caches: the logits row of every step."""
    cache = model.make_cache()
    if len(prompt) > 1:
        model(mx.array(prompt[:-1])[None], cache=cache)
    x, toks, rows = prompt[-1], [], []
    for _ in range(n):
        row = model(mx.array([[x]]), cache=cache)[0, -1]
        x = mx.argmax(row).item()
        rows.append(row)
        toks.append(x)
    return toks, rows


def verify_rows_mismatching_plain_decode(path, prompt, n=30):
    """Verify blocks of 1..6 tokens (rolled back to one kept token each round) through the
    adapter; count logit rows that are not bitwise mlx-lm's plain-decode rows."""
    model, _ = mlx_load_model(path)
    toks, ref = stock_logits(model, prompt, n)
    target = Gemma4Target(model)
    cache = target.make_cache()
    if len(prompt) > 1:
        target.hidden(mx.array(prompt[:-1])[None], cache)
    first = target.logits(target.hidden(mx.array(prompt[-1:])[None], cache)[0, -1])
    bad = int(not mx.array_equal(first, ref[0]).item())
    seq = prompt[-1:] + toks
    for i in range(1, n - 6):
        T = 1 + i % 6
        rows = target.logits(target.verify(mx.array(seq[i : i + T])[None], cache)[0])
        bad += sum(not mx.array_equal(rows[r], ref[i + r]).item() for r in range(T))
        target.rollback(cache, fed=T, keep=1)
    return bad


@pytest.mark.parametrize("kind", ["e2b", "31b"])
@pytest.mark.parametrize("naming", ["text", "gemma4"])
@pytest.mark.parametrize("prompt_len", [1, 5, 17, 40])
def test_verify_rows_are_bitwise_plain_decode(kind, naming, prompt_len, tmp_path_factory):
    path = Checkpoints(tmp_path_factory).target(kind, naming)
    prompt = list(range(3, 3 + prompt_len))
    assert verify_rows_mismatching_plain_decode(path, prompt) == 0


def test_temporal_key_order_is_not_bitwise_plain_decode(tmp_path_factory, monkeypatch):
    """Mutation: lay the verify rows' windows out in temporal order (what a simpler buffered
    cache does). The rows are then NOT mlx-lm's bits, and the check above catches it."""

    def temporal(offset, n, window, ring_base):
        rows = np.arange(offset, offset + n)
        pos = np.arange(max(0, offset - window + 1), offset + n)
        return pos, (pos[None] <= rows[:, None]) & (pos[None] > rows[:, None] - window)

    monkeypatch.setattr(sliding_cache, "_decode_layout", temporal)
    path = Checkpoints(tmp_path_factory).target("e2b")
    assert verify_rows_mismatching_plain_decode(path, list(range(3, 43))) > 0


@pytest.mark.parametrize("kind", ["e2b", "31b"])
def test_block_vs_chain_through_the_adapter_interface(kind, tmp_path_factory):
    """What an exactness probe does with any target adapter: prefill, verify a block, roll it
    all back, feed the same tokens one by one; the logits must agree bitwise, also when the
    block follows a multi-token prefill past the window directly."""
    model, _ = mlx_load_model(Checkpoints(tmp_path_factory).target(kind))
    target = Gemma4Target(model)
    block = mx.array([[5, 17, 240, 3, 99, 12]])
    cache = target.make_cache()
    target.hidden(mx.array(list(range(3, 43)))[None], cache)
    blk = target.logits(target.verify(block, cache)[0])
    target.rollback(cache, fed=6, keep=0)
    chain = mx.concatenate([target.logits(target.hidden(block[:, i : i + 1], cache)[0])
                            for i in range(6)])
    assert bytes(memoryview(blk)) == bytes(memoryview(chain))
