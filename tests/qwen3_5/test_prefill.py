"""A prompt's prefill (``Qwen3_5Target.prefill``): mlx-lm's forward with the GatedDeltaNet
recurrence in the C kernel where its check passes, bitwise what ``hidden`` (mlx-lm's own ops)
gives, hidden states and caches; the rule of where it applies, the fallback when the check fails,
and T=0 generation identical to mlx-lm's plain decode with a prompt it prefills."""

from pathlib import Path

import mlx.core as mx
import pytest
from support.reference import CODE_PROMPT, reference_greedy
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.utils import load_model as mlx_load_model

import mlx_mtp
from support.native_support import require_kernel
from mlx_mtp.cpu import native
from mlx_mtp.models.qwen3_5 import gdn_block, gdn_kernel
from mlx_mtp.models.qwen3_5.target import Qwen3_5Target


def bitwise(a, b):
    return (a.shape == b.shape and a.dtype == b.dtype
            and bytes(memoryview(a)) == bytes(memoryview(b)))


@pytest.fixture
def kernel_calls(monkeypatch):
    """The kernel loaded, no recurrence check carried in or out; the T of every kernel call."""
    require_kernel(native.cpu_problem(), gdn_kernel.available, gdn_kernel.reason, "gdn kernel")
    saved = dict(gdn_block._recurrence_checked)
    gdn_block._recurrence_checked.clear()
    calls = []
    states = gdn_kernel.states
    monkeypatch.setattr(gdn_kernel, "states",
                        lambda *a: calls.append(a[0].shape[1]) or states(*a))
    yield calls
    gdn_block._recurrence_checked.clear()
    gdn_block._recurrence_checked.update(saved)


def target_of(path) -> Qwen3_5Target:
    return Qwen3_5Target(mlx_load_model(Path(path))[0])


def ids(n: int, seed: int) -> mx.array:
    return mx.array([[(seed * 37 + 11 * i) % 200 + 3 for i in range(n)]])


def both_ways(target, chunks):
    """The chunks fed one after another through ``hidden`` and through ``prefill``, each on a
    fresh cache: ([hidden per chunk], cache state) per way."""
    out = []
    for way in (target.hidden, target.prefill):
        cache = target.make_cache()
        hs = []
        for chunk in chunks:
            hs.append(way(chunk, cache))
            mx.eval(hs[-1], target.cache_state(cache))
        out.append((hs, target.cache_state(cache)))
    return out


@pytest.mark.parametrize("kind", ["big", "dense", "next"])
def test_prefill_equals_mlx_lms_forward_bitwise(kind, request, kernel_calls, monkeypatch):
    """From a fresh cache and on top of an earlier chunk, a prompt spanning several kernel blocks:
    every hidden state and the caches after it equal mlx-lm's ops path bit for bit, and the
    recurrence ran in the kernel, a block at a time."""
    if kind != "big":  # small states: the kernel pays only with the thresholds lowered
        monkeypatch.setattr(gdn_block, "KERNEL_MIN_BYTES", 0)
        monkeypatch.setattr(gdn_block, "LAZY_KERNEL_MIN_BYTES", 0)
    monkeypatch.setattr(gdn_block, "PREFILL_BLOCK", 4)
    target = target_of(request.getfixturevalue(
        "big_state_dir" if kind == "big" else f"{kind}_dir"))
    linear = sum(l.is_linear for l in target.layers)
    (ref, ref_state), (got, got_state) = both_ways(target, [ids(10, 1), ids(7, 2)])
    assert all(bitwise(a, b) for a, b in zip(ref, got))
    assert len(ref_state) == len(got_state)
    assert all(bitwise(a, b) for a, b in zip(ref_state, got_state))
    # the check's 3 calls (blocks of 2 of 5 tokens) once, then per layer 4 + 4 + 2 and 4 + 3
    assert kernel_calls == [2, 2, 1] + [4, 4, 2] * linear + [4, 3] * linear


def test_hidden_keeps_mlx_lms_ops(big_state_dir, kernel_calls):
    """Only ``prefill`` asks for the kernel: ``hidden`` (mlx-lm's own forward, as its own decode
    on the target's model) runs mlx-lm's recurrence."""
    target = target_of(big_state_dir)
    cache = target.make_cache()
    mx.eval(target.hidden(ids(9, 3), cache), target.cache_state(cache))
    assert kernel_calls == []


def test_a_failing_check_keeps_mlx_lms_ops(big_state_dir, kernel_calls, monkeypatch):
    """A kernel off by one state element fails its check: prefill runs mlx-lm's ops recurrence
    and still equals ``hidden``."""
    states = gdn_kernel.states

    def off_by_one(*a):
        y, s = states(*a)  # (the fixture's, which counts the call)
        return y, s[:-1] + [s[-1].reshape(-1).at[3].add(1.0).reshape(s[-1].shape)]

    monkeypatch.setattr(gdn_kernel, "states", off_by_one)
    target = target_of(big_state_dir)
    layer = next(l for l in target.layers if l.is_linear).linear_attn
    assert not gdn_block.prefill_kernel_applies(layer, mx.zeros((1, 6, target.hidden_size)))
    kernel_calls.clear()
    (ref, ref_state), (got, got_state) = both_ways(target, [ids(8, 4)])
    assert bitwise(ref[0], got[0]) and all(bitwise(a, b) for a, b in zip(ref_state, got_state))
    assert kernel_calls == []  # the check is not run again, nor the kernel


def test_where_the_kernel_applies(big_state_dir, dense_dir, kernel_calls, monkeypatch):
    """Float32 on the CPU where it pays: a big state from one token (as a lazy op) or two; a
    small state only from enough tokens; bfloat16 inputs never."""
    big = next(l for l in target_of(big_state_dir).layers if l.is_linear).linear_attn
    small = next(l for l in target_of(dense_dir).layers if l.is_linear).linear_attn
    H = big.in_proj_qkv.weight.shape[1]
    applies = gdn_block.prefill_kernel_applies
    assert applies(big, mx.zeros((1, 2, H)))
    assert applies(big, mx.zeros((1, 1, H))) == gdn_block.kernel_pays(big, mx.zeros((1, 1, H)))
    assert not applies(big, mx.zeros((1, 4, H), dtype=mx.bfloat16))
    state_bytes = 4 * small.num_v_heads * small.head_v_dim * small.head_k_dim
    least = min(gdn_block.KERNEL_MIN_BYTES, gdn_block.LAZY_KERNEL_MIN_BYTES) \
        if gdn_block.lazy_kernels.available() else gdn_block.KERNEL_MIN_BYTES
    T = -(-least // state_bytes)  # the fewest tokens that pay
    Hs = small.in_proj_qkv.weight.shape[1]
    assert not applies(small, mx.zeros((1, T - 1, Hs)))
    assert applies(small, mx.zeros((1, T, Hs)))


@pytest.mark.slow
def test_generation_with_a_kernel_prefill_is_identical_to_plain_decode(big_state_dir,
                                                                       kernel_calls):
    """T=0, blocks 2 and 4 and auto: mlx-lm's plain greedy output from a pristine copy of the
    target, with the prompt prefilled through the kernel."""
    model = mlx_mtp.load_model(big_state_dir, require_head=False)
    prompt = load_tokenizer(big_state_dir).encode(CODE_PROMPT)
    ref = reference_greedy(big_state_dir, prompt, 16)
    linear = sum(l.is_linear for l in model.target.layers)
    for bs in (2, 4, "auto"):
        kernel_calls.clear()
        out = [t for t, _ in mlx_mtp.generate_step(mx.array(prompt), model, max_tokens=16,
                                                   block_size=bs)]
        assert out == ref, bs
        assert kernel_calls.count(len(prompt) - 1) == linear  # the prompt's prefill chunk


@pytest.mark.parametrize("split", [None, "a split"])
def test_prefill_chunks_run_on_every_core_except_across_split_ranks(split, dense_dir,
                                                                   monkeypatch):
    """Each prefill chunk's forward and evaluation run inside ``prefill_threads``; a split
    target's do not (its ranks share the machine's cores)."""
    import contextlib
    from types import SimpleNamespace

    from mlx_mtp.cpu import blas as cpu_blas
    from mlx_mtp.decoding import round_steps
    from mlx_mtp.io.kv_settings import KVSettings

    inside, seen = [False], []

    @contextlib.contextmanager
    def spy():
        inside[0] = True
        yield
        inside[0] = False

    monkeypatch.setattr(cpu_blas, "prefill_threads", spy)
    target = target_of(dense_dir)
    forward = target.prefill
    monkeypatch.setattr(target, "prefill", lambda *a: seen.append(inside[0]) or forward(*a))
    session = SimpleNamespace(target=target, drafter=None, cache=target.make_cache(),
                              prompt_len=9, kv=KVSettings(), split=split, turn=None)
    request = SimpleNamespace(prefill_step_size=3, embeddings=lambda start, stop: None)
    list(round_steps._prefill_chunks(session, ids(9, 5)[0], request, lambda *_: None))
    assert seen == [split is None] * 3  # 8 tokens in chunks of 3, 3, 2
