"""The GatedDeltaNet recurrence's C kernel (``gdn_kernel``): y and every step's state bitwise equal
to the reference (mlx-lm's ``_gated_delta_step_ops`` T times), how ``gdn_block`` picks it (where
it pays and its check passes) and its fallbacks; T=0 generation identical to plain decode on a
checkpoint whose layers use it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from support.reference import CODE_PROMPT, reference_greedy
from mlx_lm.models.gated_delta import compute_g
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.utils import load_model as mlx_load_model
from support.oracle import OracleDrafter

import mlx_mtp
from support.native_support import blas_bindings, require_kernel, require_lazy, gdn_inputs as inputs
from support.native_support import conv_sums_taps_in_order
from support.processes import CHILD_PYTHONPATH
from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.cpu import lazy_ops as lazy_kernels
from mlx_mtp.cpu import native
from mlx_mtp.models.model import MTPModel
from mlx_mtp.models.qwen3_5 import gdn_block, gdn_kernel
from mlx_mtp.models.qwen3_5.target import Qwen3_5Target

DEMO = Path(mlx_mtp.__file__).parent / "demo_pair"


def bitwise(a, b):
    return (a.shape == b.shape and a.dtype == b.dtype
            and bytes(memoryview(a)) == bytes(memoryview(b)))


def needs_kernel():
    require_kernel(native.cpu_problem(), gdn_kernel.available, gdn_kernel.reason, "gdn kernel")


@pytest.fixture
def fresh_kernel():
    """The kernel loaded anew (the test's environment applies) and forgotten afterwards; no
    check result carried in or out."""
    gdn_kernel.KERNEL.reset()
    saved = dict(gdn_block._checked)
    gdn_block._checked.clear()
    yield
    gdn_kernel.KERNEL.reset()
    gdn_block._checked.clear()
    gdn_block._checked.update(saved)


def kernel_states(q, k, v, a, b, A_log, dt_bias, state):
    """``reference_states``' signature, through the kernel (g and beta as mlx-lm computes them)."""
    if state is None:
        state = mx.zeros((q.shape[0], v.shape[2], v.shape[3], q.shape[3]))
    return gdn_kernel.states(q, k, v, compute_g(A_log, a, dt_bias), mx.sigmoid(b), state)


def assert_equal_to_reference(args):
    y0, s0 = gdn_block.reference_states(*args)
    y1, s1 = kernel_states(*args)
    mx.eval(y0, s0, y1, s1)
    T = args[0].shape[1]
    assert y1.shape == y0.shape and len(s0) == len(s1) == T
    assert bitwise(y0, y1)
    for t in range(T):
        assert bitwise(s0[t], s1[t]), t


def test_the_facts_the_kernel_relies_on():
    """On the CPU, MLX's sum over a contiguous last axis is sequential in index order from +0.0
    (a row of -0.0 sums to +0.0), which no lane-split order matches; the kernel sums the same
    way (and its build has no FMA contraction, which the tests above would see)."""
    if mx.default_device() != mx.cpu:
        pytest.skip("the CPU backend's reduction")
    rng = np.random.default_rng(3)
    scale = np.exp(rng.uniform(-8, 8, (512, 128)))  # magnitudes that make the order show
    x = (rng.standard_normal((512, 128)) * scale).astype(np.float32)
    x[0] = -0.0
    got = np.asarray(mx.sum(mx.array(x), axis=-1))
    sequential = np.add.accumulate(np.concatenate([np.zeros((512, 1), np.float32), x], 1),
                                   axis=1, dtype=np.float32)[:, -1]
    lanes8 = np.add.accumulate(np.concatenate([np.zeros((512, 1, 8), np.float32),
                                               x.reshape(512, 16, 8)], 1),
                               axis=1, dtype=np.float32)[:, -1].sum(axis=-1, dtype=np.float32)
    assert got.view(np.uint32).tolist() == sequential.view(np.uint32).tolist()
    assert got[0] == 0.0 and not np.signbit(got[0])
    assert (got.view(np.uint32) != lanes8.view(np.uint32)).sum() > 100


# (Hk, Hv, Dk, Dv): the demo pair's (Hv = 4 Hk), Hv == Hk, Hv = 2 Hk with Dk 64 and 128 (the
# realistic-size pair's), and odd sizes (rows past the last block of 32, whole or part of a
# tile of 8; keys past a tile of 8).
SHAPES = [(2, 8, 64, 32), (4, 4, 64, 64), (2, 4, 128, 128), (8, 16, 128, 128), (3, 3, 36, 40),
          (1, 2, 36, 36)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 6])
def test_kernel_equals_the_per_step_reference_bitwise(T, shape):
    needs_kernel()
    for i, state in enumerate(("random", "none")):
        assert_equal_to_reference(inputs(T, *shape, seed=10 * T + i, state=state))


def test_zero_large_and_subnormal_states_and_inputs():
    """A state with rows of -0.0 (the sums start from +0.0, as MLX's sum does), large values
    (sums that overflow), subnormals, and a head whose k and q are -0.0."""
    needs_kernel()
    for T in (1, 3):
        q, k, v, a, b, A_log, dt_bias, s = inputs(T, 2, 4, 64, 32, seed=5 + T)
        s[:, 0, :4] = -0.0
        s[:, 1, :2] = 1e30 * s[:, 1, :2]
        s[:, 2, :3] = 1e-39 * mx.sign(s[:, 2, :3])
        s[:, 3, 5] = 3e38
        k[:, :, 1] = -0.0
        q[:, :, 1] = -0.0
        # Key head 0 positive: the -0.0 rows' products are all -0.0, so a sum started from
        # -0.0 (or from its first product) would give -0.0 where MLX's gives +0.0, and with
        # v = -0.0 that sign reaches delta, the state and y.
        k[:, :, 0] = mx.abs(k[:, :, 0])
        q[:, :, 0] = mx.abs(q[:, :, 0])
        v[:, :, 0, :3] = -0.0
        args = [q, k, v, a, b, A_log, dt_bias, s]
        mx.eval(args)
        assert_equal_to_reference(args)
    z = inputs(2, 2, 2, 64, 32, seed=3, state="zeros")
    z[-1] = -1.0 * z[-1]  # a state of -0.0 everywhere
    assert_equal_to_reference(z)


def test_bad_shapes_are_a_clear_error():
    needs_kernel()
    q, k, v, a, b, A_log, dt_bias, s = inputs(2, 3, 4, 32, 32, seed=1)
    with pytest.raises(ValueError, match=r"^gdn kernel: shapes q \(1, 2, 3, 32\) .* do not fit$"):
        kernel_states(q, k, v, a, b, A_log, dt_bias, s)


def test_the_rule_of_where_it_pays(monkeypatch):
    layer = gdn_layer(DEMO)  # 8 heads of 32 x 64: 64 KB
    assert layer.num_v_heads * layer.head_v_dim * layer.head_k_dim * 4 == 64 * 1024
    assert gdn_block.KERNEL_MIN_BYTES == 384 * 1024
    assert gdn_block.LAZY_KERNEL_MIN_BYTES == 128 * 1024
    pays = lambda: [gdn_block.kernel_pays(layer, mx.zeros((1, T, 1)))  # noqa: E731
                    for T in (1, 2, 5, 6, 8)]
    with lazy_kernels.eager():  # a host sync per call: only from 384 KB (T = 6 here)
        assert pays() == [False, False, False, True, True]
    if lazy_kernels.available():  # a lazy op: from 128 KB (T = 2 here)
        assert pays() == [False, True, True, True, True]


def gdn_layer(path):
    target = Qwen3_5Target(mlx_load_model(Path(path))[0])
    return next(l for l in target.layers if l.is_linear).linear_attn


def mixer_inputs(layer, T, seed):
    mx.random.seed(seed)
    H, Dv, Dk = layer.num_v_heads, layer.head_v_dim, layer.head_k_dim
    args = (mx.random.normal((1, T, layer.conv_dim)), mx.random.normal((1, T, H, Dv)),
            mx.random.normal((1, T, H)), mx.random.normal((1, T, H)),
            mx.random.normal((1, layer.conv_kernel_size - 1, layer.conv_dim)),
            0.1 * mx.random.normal((1, H, Dv, Dk)))
    mx.eval(args)
    return args


def mixed_equal(m0, m1):
    return (all(bitwise(x, y) for x, y in zip(m0[:3], m1[:3])) and len(m0[3]) == len(m1[3])
            and all(bitwise(x, y) for x, y in zip(m0[3], m1[3])))


@pytest.mark.parametrize("kind", ["dense", "next", "demo"])
def test_kernel_mixer_equals_the_reference_and_is_chosen(kind, request, monkeypatch,
                                                        fresh_kernel):
    """Where it pays (here: everywhere) the check picks the kernel, and the layer's verify
    through it equals the reference: output, conv input and window, every state."""
    needs_kernel()
    monkeypatch.setattr(gdn_block, "KERNEL_MIN_BYTES", 0)
    path = DEMO if kind == "demo" else request.getfixturevalue(f"{kind}_dir")
    layer = gdn_layer(path)
    calls = []
    states = gdn_kernel.states
    monkeypatch.setattr(gdn_kernel, "states", lambda *a: calls.append(a[0].shape[1]) or states(*a))
    for T in (1, 2, 3, 4, 6):
        args = mixer_inputs(layer, T, seed=T)
        ref = gdn_block.reference_mixer(layer, *args)
        calls.clear()
        out = gdn_block.capture_mixer(layer, *args)
        mx.eval(ref, out)
        assert mixed_equal(ref, out), T
        choice = gdn_block.mixer_choice(layer, *args)
        assert choice in (gdn_block.KERNEL_TAPS, gdn_block.KERNEL_CONV)
        if conv_sums_taps_in_order(layer.conv_dim):  # MLX's conv sums the taps in order
            assert choice == gdn_block.KERNEL_TAPS  # (BLIS on AVX2, the bundled BLAS: measured)
        assert calls[-1] == T  # the verify itself ran the kernel (after the check's runs)


def test_a_failing_kernel_check_falls_back_to_the_compiled_graph(dense_dir, monkeypatch,
                                                                 fresh_kernel):
    """A kernel that differs in one state element fails its check: the compiled mixer (whose
    check passes) runs instead, and at one token the reference."""
    needs_kernel()
    monkeypatch.setattr(gdn_block, "KERNEL_MIN_BYTES", 0)
    states = gdn_kernel.states

    def off_by_one(*a):
        y, s = states(*a)
        return y, s[:-1] + [s[-1].reshape(-1).at[3].add(1.0).reshape(s[-1].shape)]

    monkeypatch.setattr(gdn_kernel, "states", off_by_one)
    layer = gdn_layer(dense_dir)
    args = mixer_inputs(layer, 3, seed=21)
    choice = gdn_block.mixer_choice(layer, *args)
    assert choice == (gdn_block.TAPS if conv_sums_taps_in_order(layer.conv_dim)
                      else gdn_block.CONV)
    monkeypatch.setattr(gdn_kernel, "states", lambda *a: pytest.fail("the kernel ran"))
    out = gdn_block.capture_mixer(layer, *args)
    ref = gdn_block.reference_mixer(layer, *args)
    mx.eval(out, ref)
    assert mixed_equal(out, ref)
    monkeypatch.setattr(gdn_kernel, "states", off_by_one)
    one = mixer_inputs(layer, 1, seed=22)
    assert gdn_block.mixer_choice(layer, *one) is None


@pytest.mark.parametrize("switch", [gdn_kernel.ENV, native.ALL_ENV])
def test_switched_off_the_layer_keeps_the_compiled_graph(switch, dense_dir, monkeypatch,
                                                         fresh_kernel):
    monkeypatch.setattr(gdn_block, "KERNEL_MIN_BYTES", 0)
    monkeypatch.setenv(switch, "0")
    assert not gdn_kernel.available()
    assert gdn_kernel.reason() == f"{switch}=0"
    states = gdn_kernel.states
    monkeypatch.setattr(gdn_kernel, "states", lambda *a: pytest.fail("the kernel ran"))
    layer = gdn_layer(dense_dir)
    args = mixer_inputs(layer, 3, seed=23)
    out = gdn_block.capture_mixer(layer, *args)
    ref = gdn_block.reference_mixer(layer, *args)
    mx.eval(out, ref)
    assert mixed_equal(out, ref)
    assert list(gdn_block._checked.values()) in ([gdn_block.TAPS], [gdn_block.CONV])
    with pytest.raises(RuntimeError, match=rf"^gdn kernel unavailable: {switch}=0$"):
        states(*[mx.zeros((1,))] * 6)


def test_a_missing_compiler_is_reported_and_the_layer_keeps_the_compiled_graph(
        dense_dir, monkeypatch, tmp_path, fresh_kernel):
    monkeypatch.setattr(gdn_block, "KERNEL_MIN_BYTES", 0)
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    if native.cpu_problem():
        pytest.skip(native.cpu_problem())
    assert gdn_kernel.reason() == ("cannot build gdn_steps.c: no C compiler '/nonexistent/cc' "
                                   "(set CC)")
    layer = gdn_layer(dense_dir)
    args = mixer_inputs(layer, 2, seed=24)
    assert gdn_block.mixer_choice(layer, *args) in (gdn_block.TAPS, gdn_block.CONV)


def test_the_kernel_builds_into_the_shared_cache_folder(monkeypatch, tmp_path, fresh_kernel):
    needs_kernel()
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    gdn_kernel.KERNEL.reset()
    assert gdn_kernel.available(), gdn_kernel.reason()
    files = list((tmp_path / "cache").iterdir())
    assert len(files) == 1 and files[0].name.startswith("gdn_steps-") and files[0].suffix == ".so"


@pytest.mark.slow
@pytest.mark.parametrize("ckpt,path", [("big", "lazy"), ("big", "eager"), ("demo", "lazy")])
def test_generation_with_the_kernel_is_identical_to_plain_decode(ckpt, path, request,
                                                                 monkeypatch, fresh_kernel):
    """T=0, an oracle drafter forcing every acceptance length (so every rollback selects a
    kernel-made state), block sizes 2-5: mlx-lm's plain greedy output, and the kernel ran; as
    a lazy MLX op and called eagerly (256 KB states), and on the demo pair's 64 KB states,
    where only the lazy op pays (``gdn_block.LAZY_KERNEL_MIN_BYTES``)."""
    needs_kernel()
    if path == "lazy":
        require_lazy()
    else:
        monkeypatch.setattr(lazy_kernels, "load", lambda environ=None: None)
    ckpt_dir = DEMO if ckpt == "demo" else request.getfixturevalue("big_state_dir")
    calls = []
    states = gdn_kernel.states
    monkeypatch.setattr(gdn_kernel, "states", lambda *a: calls.append(a[0].shape[1]) or states(*a))
    model = mlx_mtp.load_model(ckpt_dir, require_head=False)
    prompt = load_tokenizer(ckpt_dir).encode(CODE_PROMPT)
    ref = reference_greedy(ckpt_dir, prompt, 24)
    for bs in range(2, 6):
        K = bs - 1
        oracle = OracleDrafter(prompt + ref, schedule=list(range(K + 1)),
                               vocab_size=model.target.vocab_size)
        forced = MTPModel(model.mlx_model, model.target, oracle)
        calls.clear()
        out = [t for t, _ in mlx_mtp.generate_step(mx.array(prompt), forced, max_tokens=24,
                                                   block_size=bs)]
        assert out == ref, bs
        assert set(range(K + 1)) <= set(oracle.planned)
        assert bs in calls, (bs, calls)  # the verify of bs tokens ran through the kernel
    conv_dims = {l.linear_attn.conv_dim for l in model.target.layers if l.is_linear}
    assert set(gdn_block._checked.values()) >= {
        gdn_block.KERNEL_TAPS if conv_sums_taps_in_order(d) else gdn_block.KERNEL_CONV
        for d in conv_dims}


def test_other_dtypes_are_not_tried(dense_dir, monkeypatch, fresh_kernel):
    """bfloat16 inputs: the kernel (float32 only) is not tried, the check picks among the rest."""
    monkeypatch.setattr(gdn_block, "KERNEL_MIN_BYTES", 0)
    monkeypatch.setattr(gdn_kernel, "states", lambda *a: pytest.fail("the kernel ran"))
    layer = gdn_layer(dense_dir)
    args = [x.astype(mx.bfloat16) for x in mixer_inputs(layer, 3, seed=25)[:5]] + [None]
    assert gdn_block.mixer_choice(layer, *args) in (gdn_block.TAPS, gdn_block.CONV, None)
    assert [k[-1] for k in gdn_block._checked] == [False]


CHECK = """
import json, sys, mlx_mtp
import mlx.core as mx
from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.models.qwen3_5 import gdn_block
from support.native_support import conv_sums_taps_in_order
gdn_block.KERNEL_MIN_BYTES = 0
model = mlx_mtp.load_model(sys.argv[1], require_head=False)
out = []
in_order = []
for layer in [l.linear_attn for l in model.target.layers if l.is_linear][:3]:
    for T in (1, 2, 3):
        V, H, Dv, Dk = layer.conv_dim, layer.num_v_heads, layer.head_v_dim, layer.head_k_dim
        mx.random.seed(T)
        args = (mx.random.normal((1, T, V)), mx.random.normal((1, T, H, Dv)),
                mx.random.normal((1, T, H)), mx.random.normal((1, T, H)),
                mx.random.normal((1, layer.conv_kernel_size - 1, V)), mx.zeros((1, H, Dv, Dk)))
        out.append(gdn_block.mixer_choice(layer, *args))
        in_order.append(conv_sums_taps_in_order(V))
print(json.dumps({"blas": cpu_blas.STATE.name, "choices": out, "in_order": all(in_order)}))
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("name,value", blas_bindings())
def test_the_kernel_mixer_is_chosen_with_every_blas_binding(name, value):
    """On the demo pair's layers (their own weights), in a fresh process per binding: the
    recurrence does not touch the BLAS, so the kernel's check passes with every binding (its
    conv as taps where MLX's conv sums them in order)."""
    needs_kernel()
    env = {k: v for k, v in os.environ.items() if k != cpu_blas.ENV}
    env.update({cpu_blas.ENV: value, "PYTHONPATH": CHILD_PYTHONPATH})
    r = subprocess.run([sys.executable, "-c", CHECK, str(DEMO)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if sys.platform.startswith("linux"):
        assert out["blas"] == name
    assert len(out["choices"]) == 9
    assert set(out["choices"]) <= {gdn_block.KERNEL_TAPS, gdn_block.KERNEL_CONV}
    if out["in_order"]:  # MLX's conv sums the taps in order with this BLAS here (measured)
        assert set(out["choices"]) == {gdn_block.KERNEL_TAPS}
