"""The rollback-safe caches against mlx-lm's own caches in plain decode, and the Gemma 4 target's
verify rows against mlx-lm's plain decode, bit for bit."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, trim_prompt_cache
from mlx_lm.utils import load_model as mlx_load_model
from support.tiny_gemma4 import WINDOW, Checkpoints

import mlx_mtp.models.gemma4.attention as gemma4_attention
from mlx_mtp.exactness import row_attention
from mlx_mtp.models.gemma4.rollback_caches import RollbackKVCache, RollbackRotatingKVCache
from mlx_mtp.models.gemma4.target import Gemma4Target
from mlx_mtp.models.gemma4.attention import Gemma4VerifyAttention


def marks(positions, width=1):
    """K/V whose features are the absolute position: what a cache holds is readable."""
    a = mx.array(np.asarray(positions, dtype=np.float32)).reshape(1, 1, -1, 1)
    a = mx.broadcast_to(a, (1, 1, a.shape[2], width))
    return a, a + 0.5


def prefill_chunks(prompt_len, step):
    """mlx-lm's generate_step prefill: prompt[:-1] in chunks of ``step``, then the last token."""
    out, s = [], 0
    while prompt_len - s > 1:
        e = min(s + step, prompt_len - 1)
        out.append((s, e))
        s = e
    return out + [(prompt_len - 1, prompt_len)]


def bitwise(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and bytes(memoryview(a)) == bytes(memoryview(b))


def same_state(a, b):
    return all(bitwise(x, y) if isinstance(x, mx.array) else x == y for x, y in zip(a, b))


def plain_decode(stock, prompt_len, step, n_decode):
    """A stock cache through mlx-lm's plain decode: its state after every position, and the
    K/V each decode step attends to."""
    states, fetched = {}, {}
    for s, e in prefill_chunks(prompt_len, step):
        stock.update_and_fetch(*marks(range(s, e)))
    states[prompt_len] = tuple(x[...] if isinstance(x, mx.array) else x for x in stock.state)
    for q in range(prompt_len, prompt_len + n_decode):
        fetched[q] = tuple(a[...] for a in stock.update_and_fetch(*marks([q])))
        states[q + 1] = tuple(x[...] if isinstance(x, mx.array) else x for x in stock.state)
    return states, fetched


@pytest.mark.parametrize("kind", ["full", "sliding"])
@pytest.mark.parametrize("window", [4, 16])
@pytest.mark.parametrize("prompt_len", [1, 2, 3, 15, 16, 17, 50, 300])
@pytest.mark.parametrize("step", [2048, 5])
def test_verify_rows_and_rollbacks_reproduce_plain_decode(kind, window, prompt_len, step):
    """Verify blocks of 1..7 rows, each rolled back to 1..T kept rows, as the round loop does:
    every row attends to exactly the K/V of the stock cache's decode step at that position, and
    after every rollback the cache state (buffers with their capacity, ring index, offset) is
    bitwise the stock cache's in plain decode. Past the window too."""
    make = ((lambda: KVCache(), lambda: RollbackKVCache()) if kind == "full" else
            (lambda: RotatingKVCache(max_size=window, keep=0), lambda: RollbackRotatingKVCache(window)))
    n_decode = 3 * window + 300
    want_state, want_kv = plain_decode(make[0](), prompt_len, step, n_decode)
    ours = make[1]()
    for s, e in prefill_chunks(prompt_len, step):
        ours.update_and_fetch(*marks(range(s, e)))
    blocks = [1, 3, 7, 2, 5, 1, 6, 4]
    q, r = prompt_len, 0
    while q < prompt_len + n_decode - 8:
        T = blocks[r % len(blocks)]
        rows = ours.update_rows(*marks(range(q, q + T)))
        for i, (k, v) in enumerate(rows):
            assert bitwise(k, want_kv[q + i][0]) and bitwise(v, want_kv[q + i][1]), (q, i)
        keep = 1 + (r % T)
        assert ours.trim(T - keep) == T - keep
        q += keep
        assert same_state(ours.state, want_state[q]), q
        r += 1
    if kind == "sliding":
        assert ours.keys.shape[2] == window  # bounded: the ring, nothing more


def test_stock_rotating_cache_cannot_roll_back_past_the_window():
    """Why the target does not use RotatingKVCache as is: past the window, trim_prompt_cache
    silently trims nothing."""
    stock = RotatingKVCache(max_size=WINDOW, keep=0)
    stock.update_and_fetch(*marks(range(WINDOW + 3)))
    assert not stock.is_trimmable()
    assert trim_prompt_cache([stock], 2) == 0
    assert stock.offset == WINDOW + 3
    ours = RollbackRotatingKVCache(WINDOW)
    ours.update_and_fetch(*marks(range(WINDOW + 3)))
    ours.update_rows(*marks(range(WINDOW + 3, WINDOW + 6)))
    assert ours.is_trimmable() and trim_prompt_cache([ours], 2) == 2 and ours.offset == WINDOW + 4


def test_trim_refuses_what_the_last_verify_did_not_add():
    c = RollbackRotatingKVCache(4)
    c.update_and_fetch(*marks(range(30)))
    with pytest.raises(ValueError, match=r"^cannot trim 1 positions: only the 0 rows of the last "
                                         r"verify block can be rolled back$"):
        c.trim(1)
    c.update_rows(*marks(range(30, 33)))
    with pytest.raises(ValueError, match=r"^cannot trim 4 positions: only the 3 rows of the last "
                                         r"verify block can be rolled back$"):
        c.trim(4)
    assert c.trim(2) == 2 and c.trim(1) == 1 and c.offset == 30 and c.trim(0) == 0
    c.update_rows(*marks(range(30, 32)))
    c.update_and_fetch(*marks([32]))  # a plain update ends what can be undone
    with pytest.raises(ValueError, match=r"only the 0 rows"):
        c.trim(1)


def test_drafter_window_is_the_committed_positions_in_temporal_order():
    for cache in (RollbackRotatingKVCache(8), RollbackKVCache()):
        cache.update_and_fetch(*marks(range(20)))
        cache.update_rows(*marks(range(20, 25)))
        cache.trim(2)
        keys, values = cache.window(15, 23)
        assert np.array(keys).reshape(-1).tolist() == list(range(15, 23))
        assert np.array(values).reshape(-1).tolist() == [p + 0.5 for p in range(15, 23)]
    ring = RollbackRotatingKVCache(8)
    ring.update_and_fetch(*marks(range(20)))
    ring.update_and_fetch(*marks([20]))  # the ring now holds 13..20
    with pytest.raises(ValueError, match=r"^positions 12\.\.20 are not held \(cache holds "
                                         r"13\.\.20\)$"):
        ring.window(12, 21)


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
    getattr(target, "prepare", lambda width: None)(6)  # verify-width setup, if any
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
@pytest.mark.parametrize("prompt_len", [pytest.param(n, marks=pytest.mark.slow) for n in (1, 5, 17)]
                         + [40])  # 40 (past the window) in the quick subset
def test_verify_rows_are_bitwise_plain_decode(kind, naming, prompt_len, tmp_path_factory):
    path = Checkpoints(tmp_path_factory).target(kind, naming)
    prompt = list(range(3, 3 + prompt_len))
    assert verify_rows_mismatching_plain_decode(path, prompt) == 0


@pytest.mark.parametrize("kind", ["e2b", "31b"])
def test_block_vs_chain_through_the_adapter_interface(kind, tmp_path_factory):
    """What an exactness probe does with any target adapter: prefill, verify a block, roll it
    all back, feed the same tokens one by one; the logits must agree bitwise, also when the
    block follows a multi-token prefill past the window directly."""
    model, _ = mlx_load_model(Checkpoints(tmp_path_factory).target(kind))
    target = Gemma4Target(model)
    getattr(target, "prepare", lambda width: None)(6)
    block = mx.array([[5, 17, 240, 3, 99, 12]])
    cache = target.make_cache()
    target.hidden(mx.array(list(range(3, 43)))[None], cache)
    blk = target.logits(target.verify(block, cache)[0])
    target.rollback(cache, fed=6, keep=0)
    chain = mx.concatenate([target.logits(target.hidden(block[:, i : i + 1], cache)[0])
                            for i in range(6)])
    assert bytes(memoryview(blk)) == bytes(memoryview(chain))


def _skew_multi_query_attention(monkeypatch):
    """A backend whose multi-query SDPA rounds differently from a one-query one (BLIS does, on
    this project's CPU, even for 8 keys): every multi-query result is off in the last bits."""
    real = mx.fast.scaled_dot_product_attention

    def skewed(q, k, v, *, scale, mask=None, **kw):
        out = real(q, k, v, scale=scale, mask=mask, **kw)
        return out * (1 + 2.0 ** -20) if q.shape[2] > 1 else out

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", skewed)


@pytest.mark.parametrize("kind", ["e2b", "31b"])
def test_verify_rows_stay_exact_when_multi_query_attention_rounds_differently(
        kind, tmp_path_factory, monkeypatch):
    _skew_multi_query_attention(monkeypatch)
    path = Checkpoints(tmp_path_factory).target(kind)
    assert verify_rows_mismatching_plain_decode(path, list(range(3, 43))) == 0




@pytest.mark.slow
def test_mutation_one_multi_query_attention_for_full_layers_is_caught(tmp_path_factory, monkeypatch):
    """Mutation: full-attention layers attend the whole block in one causal multi-query SDPA
    (what mlx-lm does). Under such a backend the verify rows are no longer decode's bits."""
    _skew_multi_query_attention(monkeypatch)
    per_row = Gemma4VerifyAttention.attend_rows

    def one_sdpa_for_full_layers(self, queries, rows):
        if self.is_sliding:
            return per_row(self, queries, rows)
        if isinstance(rows, gemma4_attention.BlockKV):  # the kernel's rows: one segment here
            (_, _, seen), = rows
            keys, values = seen.row(seen.width - 1)
        else:
            keys, values = rows[-1]  # the last row's prefix holds every row's keys
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale,
                                                    mask="causal")

    path = Checkpoints(tmp_path_factory).target("e2b")
    assert verify_rows_mismatching_plain_decode(path, list(range(3, 43))) == 0
    monkeypatch.setattr(Gemma4VerifyAttention, "attend_rows", one_sdpa_for_full_layers)
    assert verify_rows_mismatching_plain_decode(path, list(range(3, 43))) > 0


def test_verify_without_the_kernel_attends_one_query_row_at_a_time(tmp_path_factory,
                                                                    monkeypatch):
    """With the attention kernel off, every SDPA in a verify of T rows has one query row and no
    mask; T per layer, each over the keys its decode step sees."""
    monkeypatch.setenv(row_attention.ENV, "0")
    calls = []
    real = gemma4_attention.scaled_dot_product_attention

    def spy(q, k, v, cache, scale, mask):
        calls.append((q.shape[2], mask, k.shape[2]))
        return real(q, k, v, cache=cache, scale=scale, mask=mask)

    model, _ = mlx_load_model(Checkpoints(tmp_path_factory).target("e2b"))
    target = Gemma4Target(model)
    cache = target.make_cache()
    target.hidden(mx.array(list(range(3, 43)))[None], cache)
    monkeypatch.setattr(gemma4_attention, "scaled_dot_product_attention", spy)
    target.verify(mx.array([[5, 6, 7, 8]]), cache)
    assert len(calls) == 4 * len(target.layers)
    assert all(n == 1 and m is None for n, m, _ in calls)
    # sliding rows see the window (16 keys), full rows the prefix 0..40+i
    assert sorted({k for _, _, k in calls}) == [16, 41, 42, 43, 44]
