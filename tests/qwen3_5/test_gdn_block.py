"""The compiled T-step GatedDeltaNet recurrence (``gdn_block``) equals the per-step reference
(mlx-lm's ``_gated_delta_step_ops`` T times) bitwise, y and every state, on every CPU BLAS binding;
a signature whose check fails keeps the per-step path."""

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_mtp import cpu_blas
from mlx_mtp.qwen3_5 import gdn_block

ROOT = Path(__file__).resolve().parents[2]


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
def test_compiled_block_equals_per_step_reference_bitwise(T, shape):
    for seed, state in ((T, True), (T + 100, False)):
        args = inputs(T, *shape, seed=seed, state=state)
        y0, s0 = gdn_block.reference_states(*args)
        y1, s1 = gdn_block.compiled_states(*args)
        mx.eval(y0, s0, y1, s1)
        assert y1.shape == (1, T, shape[1], shape[3])
        assert bitwise(y0, y1)
        assert len(s1) == T and all(bitwise(x, y) for x, y in zip(s0, s1))
        assert gdn_block.block_equal(args[0], args[2], args[3], args[5], args[6], args[7])


def test_block_states_takes_the_compiled_block_where_its_check_passes(monkeypatch):
    monkeypatch.setattr(gdn_block, "_checked", {})
    args = inputs(3, 2, 8, 64, 32, seed=7)
    calls = []
    compiled = gdn_block.compiled_states
    monkeypatch.setattr(gdn_block, "compiled_states", lambda *a: calls.append(1) or compiled(*a))
    y, states = gdn_block.block_states(*args)
    y0, s0 = gdn_block.reference_states(*args)
    mx.eval(y, states, y0, s0)
    assert calls == [1, 1]  # the check's run, then the block's
    assert bitwise(y, y0) and all(bitwise(x, z) for x, z in zip(states, s0))


def test_a_signature_whose_check_fails_keeps_the_per_step_path(monkeypatch):
    monkeypatch.setattr(gdn_block, "_checked", {})
    monkeypatch.setattr(gdn_block, "_equal_on_random", lambda *a: False)

    def refuse(*a):
        raise AssertionError("the compiled block ran after its check failed")

    monkeypatch.setattr(gdn_block, "compiled_states", refuse)
    args = inputs(4, 2, 8, 64, 32, seed=11)
    y, states = gdn_block.block_states(*args)
    y0, s0 = gdn_block.reference_states(*args)
    mx.eval(y, states, y0, s0)
    assert bitwise(y, y0) and len(states) == 4 and all(bitwise(x, z) for x, z in zip(states, s0))
    assert list(gdn_block._checked.values()) == [False]


def test_the_check_compares_every_state(monkeypatch):
    """A block whose last state differs in one element fails the check."""
    monkeypatch.setattr(gdn_block, "_checked", {})
    compiled = gdn_block.compiled_states

    def off_by_one(*a):
        y, states = compiled(*a)
        last = states[-1]
        bumped = last.reshape(-1).at[5].add(1.0).reshape(last.shape)
        return y, states[:-1] + [bumped]

    monkeypatch.setattr(gdn_block, "compiled_states", off_by_one)
    args = inputs(3, 2, 8, 64, 32, seed=13)
    assert not gdn_block.block_equal(args[0], args[2], args[3], args[5], args[6], args[7])


def test_one_token_uses_the_per_step_path(monkeypatch):
    monkeypatch.setattr(gdn_block, "block_equal", lambda *a: pytest.fail("checked at T = 1"))
    args = inputs(1, 2, 8, 64, 32, seed=17)
    y, states = gdn_block.block_states(*args)
    y0, s0 = gdn_block.reference_states(*args)
    mx.eval(y, states, y0, s0)
    assert bitwise(y, y0) and bitwise(states[0], s0[0])


CHECK = """
import json, mlx_mtp
import mlx.core as mx
from mlx_mtp import cpu_blas
from mlx_mtp.qwen3_5 import gdn_block
out = []
for T in (2, 3, 4, 5):
    for Hk, Hv, Dk, Dv in ((2, 8, 64, 32), (2, 4, 128, 128)):
        mx.random.seed(T)
        q = mx.random.normal((1, T, Hk, Dk))
        v = mx.random.normal((1, T, Hv, Dv))
        a = mx.random.normal((1, T, Hv))
        out.append(gdn_block._equal_on_random(q, v, a, mx.zeros((Hv,)), mx.zeros((Hv,)),
                                              mx.zeros((1, Hv, Dv, Dk))))
print(json.dumps({"blas": cpu_blas.STATE.name, "equal": out}))
"""


def _bindings():
    found = {name: path for name, path in reversed(cpu_blas.find())}  # the first of each kind
    return [("bundled", "off")] + sorted(found.items())


@pytest.mark.parametrize("name,value", _bindings())
def test_the_block_equals_the_reference_with_every_blas_binding(name, value):
    env = {k: v for k, v in os.environ.items() if k != cpu_blas.ENV}
    env.update({cpu_blas.ENV: value, "PYTHONPATH": str(ROOT)})
    r = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if sys.platform.startswith("linux"):
        assert out["blas"] == name
    assert out["equal"] == [True] * 8
