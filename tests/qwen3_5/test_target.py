"""The capturing GatedDeltaNet subclasses match mlx-lm's classes bitwise; rewinding to any kept
length (selecting a kept per-token state, or replaying where mlx-lm runs a kernel) equals decode."""

import mlx.core as mx
import pytest
from mlx_lm.utils import load_model as mlx_load_model

from mlx_mtp.exactness import row_exact_layers
from mlx_mtp.models.qwen3_5 import target as qwen3_5
from mlx_mtp.models.qwen3_5.target import Qwen3_5Target, SpecArraysCache


def bitwise(a, b):
    return a.shape == b.shape and bytes(memoryview(a)) == bytes(memoryview(b))


@pytest.mark.parametrize("rewind", ["states", "replay"])
@pytest.mark.parametrize("kind", ["dense", "next"])
def test_capture_and_rewind_are_bitwise_exact(kind, rewind, request, monkeypatch):
    if rewind == "replay":  # as where mlx-lm runs its Metal kernel: stash inputs, replay on rewind
        monkeypatch.setattr(qwen3_5, "uses_ops_recurrence", lambda head_k_dim, use_kernel: False)
    path = request.getfixturevalue(f"{kind}_dir")
    pristine, _ = mlx_load_model(path)
    wrapped, _ = mlx_load_model(path)
    target = Qwen3_5Target(wrapped)
    parent_layer = next(l for l in (pristine.layers) if l.is_linear).linear_attn
    layer = next(l for l in target.layers if l.is_linear).linear_attn
    assert type(layer).__mro__[1].__name__ == "_CapturingGDN"

    mx.random.seed(0)
    H = target.hidden_size
    prefix = mx.random.normal((1, 5, H))
    block = mx.random.normal((1, 4, H))

    # Parent reference: prefix, then the block one token at a time (sequential decode).
    ref_cache = SpecArraysCache()
    parent_layer(prefix, None, ref_cache)
    seq_states = []
    for t in range(4):
        y = parent_layer(block[:, t : t + 1], None, ref_cache)
        mx.eval(y, ref_cache[0], ref_cache[1])
        seq_states.append((ref_cache[0], ref_cache[1]))

    # Parent on the whole block vs the capturing subclass on the whole block.
    c_parent, c_spec = SpecArraysCache(), SpecArraysCache()
    parent_layer(prefix, None, c_parent)
    layer(prefix, None, c_spec)
    y_parent = parent_layer(block, None, c_parent)
    c_spec.capture = True
    y_spec = layer(block, None, c_spec)
    c_spec.capture = False
    mx.eval(y_parent, y_spec, c_parent.cache, c_spec.cache)
    assert bitwise(y_parent, y_spec)
    assert bitwise(c_parent[0], c_spec[0]) and bitwise(c_parent[1], c_spec[1])
    assert c_spec.stash[0] == rewind

    # Inside a verify (row-exact layers installed, as the round loop does), rewinding to the first
    # `keep` tokens gives the sequential decode states bitwise.
    target.prepare(4)
    c_verify = SpecArraysCache()
    layer(prefix, None, c_verify)
    c_verify.capture = True
    with row_exact_layers.verifying():
        layer(block, None, c_verify)
    c_verify.capture = False
    stash = c_verify.stash
    for keep in range(1, 5):
        c_verify.stash = stash
        layer.rewind(c_verify, keep)
        mx.eval(c_verify.cache)
        conv, state = seq_states[keep - 1]
        assert bitwise(c_verify[0], conv), keep
        assert bitwise(c_verify[1], state), keep
