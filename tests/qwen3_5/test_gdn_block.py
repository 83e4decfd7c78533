"""The compiled verify of a GatedDeltaNet layer (``gdn_block``) equals the reference (mlx-lm's ops:
``_gated_delta_step_ops`` T times, its norms and conv) bitwise, output, conv input and window and
every state, on every CPU BLAS binding; a signature whose check fails keeps the reference."""

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.utils import load_model as mlx_load_model
from support.native_support import blas_bindings, conv_sums_taps_in_order
from support.processes import CHILD_PYTHONPATH

import mlx_mtp
from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.models.qwen3_5 import gdn_block
from mlx_mtp.models.qwen3_5.target import Qwen3_5Target

DEMO = Path(mlx_mtp.__file__).parent / "demo_pair"


def bitwise(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and bytes(memoryview(a)) == bytes(memoryview(b))


def inputs(T, Hk, Hv, Dk, Dv, seed, state=True):
    mx.random.seed(seed)
    q = 0.125 * mx.random.normal((1, T, Hk, Dk))
    k = 0.125 * mx.random.normal((1, T, Hk, Dk))
    v = mx.random.normal((1, T, Hv, Dv))
    a, b = mx.random.normal((1, T, Hv)), mx.random.normal((1, T, Hv))
    A_log, dt_bias = mx.random.normal((Hv,)), mx.random.normal((Hv,))
    s = mx.random.normal((1, Hv, Dv, Dk)) if state else None
    args = (q, k, v, a, b, A_log, dt_bias, s)
    mx.eval([x for x in args if x is not None])
    return args


# (Hk, Hv, Dk, Dv): the demo pair's GQA shape, equal heads, and a Qwen3.5-like head size.
SHAPES = [(2, 8, 64, 32), (4, 4, 32, 32), (2, 4, 128, 128)]


@pytest.mark.parametrize("T", [2, 3, 4, 6])
@pytest.mark.parametrize("shape", SHAPES)
def test_compiled_recurrence_equals_per_step_reference_bitwise(T, shape):
    for seed, state in ((T, True), (T + 100, False)):
        args = inputs(T, *shape, seed=seed, state=state)
        y0, s0 = gdn_block.reference_states(*args)
        y1, s1 = gdn_block.compiled_states(*args)
        mx.eval(y0, s0, y1, s1)
        assert y1.shape == (1, T, shape[1], shape[3])
        assert bitwise(y0, y1)
        assert len(s1) == T and all(bitwise(x, y) for x, y in zip(s0, s1))


def gdn_layer(path):
    target = Qwen3_5Target(mlx_load_model(Path(path))[0])
    return next(l for l in target.layers if l.is_linear).linear_attn


def mixer_inputs(layer, T, seed, state=True):
    mx.random.seed(seed)
    qkv = mx.random.normal((1, T, layer.conv_dim))
    z = mx.random.normal((1, T, layer.num_v_heads, layer.head_v_dim))
    b, a = mx.random.normal((1, T, layer.num_v_heads)), mx.random.normal((1, T, layer.num_v_heads))
    conv_state = mx.random.normal((1, layer.conv_kernel_size - 1, layer.conv_dim))
    s = 0.1 * mx.random.normal((1, layer.num_v_heads, layer.head_v_dim, layer.head_k_dim))
    args = (qkv, z, b, a, conv_state, s if state else None)
    mx.eval([x for x in args if x is not None])
    return args


def mixed_equal(m0, m1):
    return (all(bitwise(x, y) for x, y in zip(m0[:3], m1[:3])) and len(m0[3]) == len(m1[3])
            and all(bitwise(x, y) for x, y in zip(m0[3], m1[3])))


@pytest.mark.parametrize("kind", ["dense", "next", "demo"])
def test_compiled_mixer_equals_the_reference_bitwise(kind, request, monkeypatch):
    # The C kernel's choice (where it pays, e.g. the demo pair at T = 6) is test_gdn_kernel's.
    monkeypatch.setattr(gdn_block, "KERNEL_MIN_BYTES", float("inf"))
    monkeypatch.setattr(gdn_block, "LAZY_KERNEL_MIN_BYTES", float("inf"))
    path = DEMO if kind == "demo" else request.getfixturevalue(f"{kind}_dir")
    layer = gdn_layer(path)
    assert gdn_block._taps_apply(layer)
    for T in (2, 3, 4, 6):
        for state in (True, False):
            args = mixer_inputs(layer, T, seed=T, state=state)
            ref = gdn_block.reference_mixer(layer, *args)
            conv = gdn_block.compiled_mixer(layer, *args, taps=False)
            taps = gdn_block.compiled_mixer(layer, *args, taps=True)
            mx.eval(ref, conv, taps)
            assert conv[0].shape == (1, T, layer.num_v_heads, layer.head_v_dim)
            assert len(conv[3]) == T and mixed_equal(ref, conv), (T, state)
            choice = gdn_block.mixer_choice(layer, *args)
            assert choice == (gdn_block.TAPS if mixed_equal(ref, taps) else gdn_block.CONV)
            if conv_sums_taps_in_order(layer.conv_dim):  # MLX's conv sums the taps in order
                assert choice == gdn_block.TAPS  # (BLIS on AVX2, the bundled BLAS: measured)


def test_capture_mixer_takes_the_compiled_graph_where_its_check_passes(dense_dir, monkeypatch):
    monkeypatch.setattr(gdn_block, "_checked", {})
    layer = gdn_layer(dense_dir)
    calls = []
    compiled = gdn_block.compiled_mixer
    monkeypatch.setattr(gdn_block, "compiled_mixer",
                        lambda *a, taps: calls.append(taps) or compiled(*a, taps=taps))
    monkeypatch.setattr(gdn_block, "_equal_on_random", lambda *a, taps: True)
    args = mixer_inputs(layer, 3, seed=7)
    out = gdn_block.capture_mixer(layer, *args)
    ref = gdn_block.reference_mixer(layer, *args)
    taps = compiled(layer, *args, taps=True)  # not through the spy
    mx.eval(out, ref, taps)
    assert calls == [True] and mixed_equal(out, taps)
    if conv_sums_taps_in_order(layer.conv_dim):  # the taps form is then the reference's bytes
        assert mixed_equal(out, ref)
    gdn_block.capture_mixer(layer, *mixer_inputs(layer, 3, seed=8))
    assert calls == [True, True] and list(gdn_block._checked.values()) == [gdn_block.TAPS]


def test_a_failing_taps_check_takes_the_compiled_conv(dense_dir, monkeypatch):
    monkeypatch.setattr(gdn_block, "_checked", {})
    monkeypatch.setattr(gdn_block, "_equal_on_random", lambda *a, taps: not taps)
    layer = gdn_layer(dense_dir)
    calls = []
    compiled = gdn_block.compiled_mixer
    monkeypatch.setattr(gdn_block, "compiled_mixer",
                        lambda *a, taps: calls.append(taps) or compiled(*a, taps=taps))
    args = mixer_inputs(layer, 2, seed=9)
    out = gdn_block.capture_mixer(layer, *args)
    ref = gdn_block.reference_mixer(layer, *args)
    mx.eval(out, ref)
    assert calls == [False] and mixed_equal(out, ref)
    assert list(gdn_block._checked.values()) == [gdn_block.CONV]


def test_a_signature_whose_checks_fail_keeps_the_reference(dense_dir, monkeypatch):
    monkeypatch.setattr(gdn_block, "_checked", {})
    monkeypatch.setattr(gdn_block, "_equal_on_random", lambda *a, taps: False)

    def refuse(*a, **k):
        raise AssertionError("a compiled mixer ran after its check failed")

    monkeypatch.setattr(gdn_block, "compiled_mixer", refuse)
    layer = gdn_layer(dense_dir)
    args = mixer_inputs(layer, 4, seed=11)
    out = gdn_block.capture_mixer(layer, *args)
    ref = gdn_block.reference_mixer(layer, *args)
    mx.eval(out, ref)
    assert mixed_equal(out, ref) and len(out[3]) == 4
    assert list(gdn_block._checked.values()) == [None]


@pytest.mark.parametrize("output", [0, 1, 2, 3])
def test_the_check_compares_every_output(output, dense_dir, monkeypatch):
    """A compiled mixer that differs in one element of any output (or of the last state) fails
    both checks."""
    monkeypatch.setattr(gdn_block, "_checked", {})
    compiled = gdn_block.compiled_mixer

    def bump(x):
        return x.reshape(-1).at[5].add(1.0).reshape(x.shape)

    def off_by_one(*a, taps):
        out = list(compiled(*a, taps=taps))
        if output == 3:
            out[3] = out[3][:-1] + [bump(out[3][-1])]
        else:
            out[output] = bump(out[output])
        return tuple(out)

    monkeypatch.setattr(gdn_block, "compiled_mixer", off_by_one)
    layer = gdn_layer(dense_dir)
    assert gdn_block.mixer_choice(layer, *mixer_inputs(layer, 3, seed=13)) is None


@pytest.mark.parametrize("T", [1, 3, 5])
def test_taps_conv_equals_the_conv_and_keeps_the_sign_of_a_zero_sum(T, dense_dir):
    """MLX's conv sums a window of -0.0 from zero (+0.0); the taps do too (a plain sum of the
    products would give -0.0)."""
    layer = gdn_layer(dense_dir)
    mx.random.seed(T)
    x = mx.random.normal((1, layer.conv_kernel_size - 1 + T, layer.conv_dim))
    x[..., :2] = -0.0
    w = mx.abs(layer.conv1d.weight)  # positive: every product of a -0.0 window is -0.0
    conv = mx.conv1d(x, w, 1, 0, 1, layer.conv_dim)
    taps = gdn_block.taps_conv(x, w, T)
    plain = x[:, 0:T] * w[:, 0, 0]
    for j in range(1, w.shape[1]):
        plain = plain + x[:, j : j + T] * w[:, j, 0]
    mx.eval(conv, taps, plain)
    assert bitwise(conv[..., :2], mx.zeros((1, T, 2)))  # +0.0
    assert not bitwise(plain[..., :2], mx.zeros((1, T, 2)))  # -0.0: the case the + 0.0 is for
    if conv_sums_taps_in_order(layer.conv_dim):  # measured on random windows
        assert bitwise(conv, taps)
    else:
        assert bitwise(taps[..., :2], conv[..., :2])


def test_one_token_and_other_layers_use_the_reference(dense_dir, monkeypatch):
    layer = gdn_layer(dense_dir)
    monkeypatch.setattr(gdn_block, "compiled_mixer", lambda *a, **k: pytest.fail("compiled"))
    args = mixer_inputs(layer, 1, seed=17)
    out = gdn_block.capture_mixer(layer, *args)
    mx.eval(out)
    assert mixed_equal(out, gdn_block.reference_mixer(layer, *args))
    # A conv with a bias is not what the compiled mixer computes: the reference, unchecked.
    layer.conv1d.bias = mx.zeros((layer.conv_dim,))
    monkeypatch.setattr(gdn_block, "_equal_on_random", lambda *a, **k: pytest.fail("checked"))
    args = mixer_inputs(layer, 3, seed=19)
    out = gdn_block.capture_mixer(layer, *args)
    mx.eval(out)
    assert mixed_equal(out, gdn_block.reference_mixer(layer, *args))


CHECK = """
import json, sys, mlx_mtp
import mlx.core as mx
from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.models.qwen3_5 import gdn_block
from support.native_support import conv_sums_taps_in_order
gdn_block.kernel_pays = lambda *a: False  # the C kernel's choice: test_gdn_kernel's
model = mlx_mtp.load_model(sys.argv[1], require_head=False)
out = []
in_order = []
for layer in [l.linear_attn for l in model.target.layers if l.is_linear][:3]:
    for T in (2, 3, 4, 5):
        V, H, Dv, Dk = layer.conv_dim, layer.num_v_heads, layer.head_v_dim, layer.head_k_dim
        mx.random.seed(T)
        args = (mx.random.normal((1, T, V)), mx.random.normal((1, T, H, Dv)),
                mx.random.normal((1, T, H)), mx.random.normal((1, T, H)),
                mx.random.normal((1, layer.conv_kernel_size - 1, V)), mx.zeros((1, H, Dv, Dk)))
        gdn_block._checked.clear()
        in_order.append(conv_sums_taps_in_order(V))
        out.append([gdn_block.mixer_choice(layer, *args),
                    gdn_block._equal_on_random(layer, *args, taps=True),
                    gdn_block._equal_on_random(layer, *args, taps=False)])
print(json.dumps({"blas": cpu_blas.STATE.name, "checks": out, "in_order": all(in_order)}))
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("name,value", blas_bindings())
def test_the_compiled_mixer_equals_the_reference_with_every_blas_binding(name, value):
    """On the demo pair's layers (their own weights), in a fresh process per binding."""
    env = {k: v for k, v in os.environ.items() if k != cpu_blas.ENV}
    env.update({cpu_blas.ENV: value, "PYTHONPATH": CHILD_PYTHONPATH})
    r = subprocess.run([sys.executable, "-c", CHECK, str(DEMO)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if sys.platform.startswith("linux"):
        assert out["blas"] == name
    assert len(out["checks"]) == 12
    for choice, taps, conv in out["checks"]:
        assert conv  # compiling mx.conv1d's graph changes no bytes
        assert choice == ("taps" if taps else "conv")
    if out["in_order"]:  # MLX's conv sums the taps in order with this BLAS here (measured:
        # BLIS on AVX2, the bundled BLAS)
        assert all(taps for _, taps, _ in out["checks"])
