"""The rest of a decoder layer's verify as compiled graphs (``compiled_layers``): each piece equals
mlx-lm's uncompiled ops bitwise (norms, the layer's tail, the attention's parts around its cache
update), a piece whose check fails runs the ops, and a verify through the pieces equals one
without them (hidden states and caches), so T=0 output stays mlx-lm's."""

import json
import os
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from support.reference import CODE_PROMPT, reference_greedy
from mlx_lm.models.qwen3_next import Qwen3NextMLP
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.utils import load_model as mlx_load_model
from support.native_support import blas_bindings
from support.pieces import in_graph
from support.processes import CHILD_PYTHONPATH

import mlx_mtp
from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.exactness import row_exact_layers
from mlx_mtp.models.qwen3_5 import compiled_layers
from mlx_mtp.models.qwen3_5.target import Qwen3_5Target

DEMO = Path(mlx_mtp.__file__).parent / "demo_pair"
KINDS = ["dense", "next", "moe", "wide", "q4", "demo"]


def bitwise(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and bytes(memoryview(a)) == bytes(memoryview(b))


def all_bitwise(xs, ys):
    xs = xs if isinstance(xs, (tuple, list)) else (xs,)
    ys = ys if isinstance(ys, (tuple, list)) else (ys,)
    mx.eval(xs, ys)
    return len(xs) == len(ys) and all(bitwise(x, y) for x, y in zip(xs, ys))


def path_of(kind, request):
    return DEMO if kind == "demo" else request.getfixturevalue(f"{kind}_dir")


def target_of(path, width=6, exact=True):
    target = Qwen3_5Target(mlx_load_model(Path(path))[0])
    target.prepare(width, exact)  # the row-exact layers a session at these widths verifies with
    return target


def normal(shape, seed):
    x = mx.random.normal(shape, key=mx.random.key(seed))
    mx.eval(x)
    return x


@pytest.fixture(autouse=True)
def fresh_checks(monkeypatch):
    monkeypatch.setattr(compiled_layers, "_checked", {})


@pytest.mark.parametrize("kind", KINDS)
def test_every_piece_equals_the_ops_bitwise(kind, request):
    """T = 1..6, every decoder layer of the pair (its own weights), inside and outside the
    row-exact verify: the norm, the tail (each choice that applies) and the attention's parts
    (products inside and outside the graph)."""
    target = target_of(path_of(kind, request))
    H = target.hidden_size
    seen = set()
    for exact in (True, False):
        with row_exact_layers.verifying() if exact else nullcontext():
            for T in range(1, 7):
                for i, layer in enumerate(target.layers):
                    x, r = normal((1, T, H), 10 * T + i), normal((1, T, H), 10 * T + i + 500)
                    norm = layer.input_layernorm
                    assert all_bitwise(nn.RMSNorm.__call__(norm, x),
                                       compiled_layers._norm_fn(norm.eps)(x, norm["weight"]))
                    ref = compiled_layers.reference_tail(layer, x, r)
                    choices = [compiled_layers.SPLIT]
                    if compiled_layers._mlp_plain(layer, T):
                        choices.append(compiled_layers.WHOLE)
                    for choice in choices:
                        assert all_bitwise(ref, compiled_layers.compiled_tail(layer, x, r, choice)), \
                            (kind, exact, T, i, choice)
                        seen.add(choice)
                    if not layer.is_linear:
                        attn = layer.self_attn
                        qkv_plain = bool(compiled_layers._attn_plain(attn, T,
                                                                 ("q_proj", "k_proj", "v_proj")))
                        for offset in (0, 17 * T, 40001):
                            pre = compiled_layers.reference_pre(attn, x, offset)
                            for inside in (False, True)[: 1 + qkv_plain]:
                                assert all_bitwise(
                                    pre, compiled_layers.compiled_pre(attn, x, inside, offset))
                        gate = pre[1]
                        D = pre[0].shape[-1]
                        for rows in (1, T):
                            outs = [normal((1, attn.num_attention_heads, T // rows, D), 7 + j)
                                    for j in range(rows)]
                            post = compiled_layers.reference_post(attn, outs, gate)
                            o_plain = bool(compiled_layers._attn_plain(attn, T, ("o_proj",)))
                            for inside in (False, True)[: 1 + o_plain]:
                                assert all_bitwise(
                                    post, compiled_layers.compiled_post(attn, outs, gate, inside))
    # A float dense MLP's products are plain outside a verify (whole); a mixture of experts
    # (moe, next) and 4-bit products (q4) are split.
    assert all(type(l.mlp) is Qwen3NextMLP for l in target.layers) == (kind not in ("moe", "next"))
    assert compiled_layers.SPLIT in seen
    assert (compiled_layers.WHOLE in seen) == (kind not in ("moe", "next", "q4"))


@pytest.mark.parametrize("kind", ["demo", "wide", "moe"])
def test_the_checks_choose_a_compiled_piece(kind, request):
    target = target_of(path_of(kind, request))
    layer = next(l for l in target.layers if not l.is_linear)
    x, r = normal((1, 3, target.hidden_size), 1), normal((1, 3, target.hidden_size), 2)
    with row_exact_layers.verifying():
        tail = compiled_layers.tail_choice(layer, x, r)
        pre, post = compiled_layers.attention_choice(layer.self_attn, x, 3)
    # A product stays inside the graph where its row-exact form (measured on this BLAS: BLIS's
    # AVX2 kernels need the wide pair's 576-wide q/k/v products outside, as kernel or column
    # blocks) is plain MLX ops; a mixture of experts' tail is always split.
    attn, mlp = layer.self_attn, layer.mlp
    dense = kind != "moe"
    whole = dense and in_graph([mlp.gate_proj, mlp.up_proj, mlp.down_proj], 3)
    assert tail == (compiled_layers.WHOLE if whole else compiled_layers.SPLIT)
    assert pre is in_graph([attn.q_proj, attn.k_proj, attn.v_proj], 3)
    assert post is in_graph([attn.o_proj], 3)
    if kind == "demo" and not target.row_exact_layers:  # nothing switched: everything inside
        assert (tail, pre, post) == (compiled_layers.WHOLE, True, True)
    assert compiled_layers.norm_equal(x, layer.input_layernorm["weight"], layer.input_layernorm.eps)


@pytest.mark.slow
def test_the_compiled_rope_equals_the_ops_at_every_offset():
    """The rope runs inside the compiled part with its offset as an input array: equal to
    mlx-lm's rope (an int offset) at every position tried, 0..4099 and some far ones."""
    target = target_of(DEMO)
    attn = next(l for l in target.layers if not l.is_linear).self_attn
    assert compiled_layers.rope_inside(attn)
    x = normal((1, 3, target.hidden_size), 21)
    for offset in list(range(4100)) + [65535, 65536, 131071, 1 << 20, (1 << 24) + 1]:
        assert all_bitwise(compiled_layers.reference_pre(attn, x, offset),
                           compiled_layers.compiled_pre(attn, x, True, offset)), offset


def bump(x):
    return x.reshape(-1).at[5].add(1.0).reshape(x.shape)


def test_a_failing_tail_check_runs_the_ops(monkeypatch):
    target = target_of(DEMO)
    layer = target.layers[0]
    compiled = compiled_layers.compiled_tail
    monkeypatch.setattr(compiled_layers, "compiled_tail", lambda *a: bump(compiled(*a)))
    x, r = normal((1, 4, target.hidden_size), 3), normal((1, 4, target.hidden_size), 4)
    with row_exact_layers.verifying():
        assert compiled_layers.tail_choice(layer, x, r) is None
        out = compiled_layers.tail(layer, x, r)
        assert all_bitwise(out, compiled_layers.reference_tail(layer, x, r))


def test_a_tail_whose_whole_graph_differs_takes_the_split_one(monkeypatch):
    target = target_of(DEMO)
    layer = target.layers[0]
    compiled = compiled_layers.compiled_tail

    def off(layer, x, r, choice):
        out = compiled(layer, x, r, choice)
        return bump(out) if choice == compiled_layers.WHOLE else out

    monkeypatch.setattr(compiled_layers, "compiled_tail", off)
    x, r = normal((1, 2, target.hidden_size), 5), normal((1, 2, target.hidden_size), 6)
    with row_exact_layers.verifying():
        assert compiled_layers.tail_choice(layer, x, r) == compiled_layers.SPLIT


@pytest.mark.parametrize("part", ["pre", "post"])
def test_a_failing_attention_check_runs_the_ops(part, monkeypatch):
    target = target_of(DEMO)
    attn = next(l for l in target.layers if not l.is_linear).self_attn
    name = f"compiled_{part}"
    compiled = getattr(compiled_layers, name)

    def off(*a):
        out = compiled(*a)
        if part == "pre":
            return (out[0], bump(out[1]), *out[2:])  # the gate only: every output is compared
        return bump(out)

    monkeypatch.setattr(compiled_layers, name, off)
    x = normal((1, 3, target.hidden_size), 8)
    with row_exact_layers.verifying():
        pre, post = compiled_layers.attention_choice(attn, x, 3)
    assert (pre, post) == ((None, True) if part == "pre" else (True, None))


def test_a_failing_norm_check_runs_the_ops(monkeypatch):
    target = target_of(DEMO)
    norm = target.layers[0].input_layernorm
    assert type(norm) is compiled_layers.VerifyRMSNorm
    compiled = compiled_layers._norm_fn(norm.eps)
    monkeypatch.setattr(compiled_layers, "_norm_fn", lambda eps: lambda x, w: bump(compiled(x, w)))
    x = normal((1, 3, target.hidden_size), 9)
    with compiled_layers.compiling():
        out = norm(x)
    assert all_bitwise(out, nn.RMSNorm.__call__(norm, x))
    assert list(compiled_layers._checked.values()) == [False]


def test_outside_a_verify_the_layers_are_mlx_lms(monkeypatch):
    """Prefill and ``hidden`` (the probe's chain: mlx-lm's decode) never reach a compiled piece
    or a check."""
    target = target_of(DEMO)
    for name in ("tail", "attention_choices", "norm_equal"):
        monkeypatch.setattr(compiled_layers, name, lambda *a, name=name: pytest.fail(f"{name} ran"))
    cache = target.make_cache()
    mx.eval(target.hidden(mx.array([[5, 6, 7, 8]]), cache))
    mx.eval(target.hidden(mx.array([[9]]), cache))
    assert compiled_layers._checked == {}


def two_prefilled(path, exact, monkeypatch):
    """Two targets of the checkpoint at ``path``, each with a cache holding the same 20-token
    prompt, and a list that counts the compiled layer tails run from here on."""
    targets = [target_of(path, exact=exact), target_of(path, exact=exact)]
    caches = [t.make_cache() for t in targets]
    prompt = mx.array([[5 + i % 50 for i in range(20)]])
    for t, c in zip(targets, caches):
        mx.eval(t.hidden(prompt, c))
    tails = []
    tail = compiled_layers.tail
    monkeypatch.setattr(compiled_layers, "tail", lambda *a: tails.append(1) or tail(*a))
    return targets, caches, tails


@pytest.mark.parametrize("kind,exact", [(k, True) for k in KINDS] + [("demo", False),
                                                                     ("wide", False)])
def test_a_verify_through_the_pieces_equals_one_without_them(kind, exact, request, monkeypatch):
    """Widths 1..6 in turn on one cache: the hidden states and every cache array after each
    verify (a full accept, then a rollback to one token) bitwise equal to the same verifies with
    the pieces off, and the pieces ran; also with the gate overridden (``exact=False``: no
    row-exact products, one multi-query attention)."""
    targets, caches, tails = two_prefilled(path_of(kind, request), exact, monkeypatch)
    for T in range(1, 7):
        ids = mx.array([[11 + 3 * T + j for j in range(T)]])
        outs = []
        for on, t, c in zip((True, False), targets, caches):
            monkeypatch.setattr(compiled_layers, "enabled", on)
            h = t.verify(ids, c)
            logits = t.logits(h)
            mx.eval(h, logits, t.cache_state(c))
            outs.append([h, logits, *t.cache_state(c)])
            t.rollback(c, T, 1 if T > 1 else T)
            outs[-1] += t.cache_state(c)
        assert all_bitwise(outs[0], outs[1]), (kind, T)
    assert len(tails) == 6 * len(targets[0].layers)  # the pieces ran in every verify
    assert any(v for k, v in compiled_layers._checked.items() if k[0] == "tail")


@pytest.mark.parametrize("kind", KINDS)
def test_a_decode_step_equals_mlx_lms_bitwise(kind, request, monkeypatch):
    """``decode`` (the loop's one-token steps: block 1, rounds without drafts) runs the pieces,
    and over 12 steps its hidden states, logits and every cache array equal ``hidden``'s (mlx-lm's
    own layers) bitwise, with no rollback stash left behind."""
    targets, caches, tails = two_prefilled(path_of(kind, request), True, monkeypatch)
    y = mx.array([[7]])
    for step in range(12):
        outs = []
        for t, c, forward in zip(targets, caches, ("decode", "hidden")):
            h = getattr(t, forward)(y, c)
            logits = t.logits(h[0])
            mx.eval(h, logits, t.cache_state(c))
            outs.append([h, logits, *t.cache_state(c)])
        assert all_bitwise(outs[0], outs[1]), (kind, step)
        assert all(getattr(c, "stash", None) is None for c in caches[0])
        y = mx.argmax(outs[0][1], axis=-1)[None]
    assert len(tails) == 12 * len(targets[0].layers)  # every decode step ran the pieces
    assert any(v for k, v in compiled_layers._checked.items() if k[0] == "tail")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["demo", "wide", "next"])
def test_greedy_output_is_mlx_lms_with_the_pieces(kind, request):
    path = path_of(kind, request)
    model = mlx_mtp.load_model(path)
    prompt = load_tokenizer(path).encode(CODE_PROMPT)
    ref = reference_greedy(path, prompt, 20)
    for bs in (1, 2, 3, 4, 6, "auto"):  # block 1 and auto's rounds without drafts: decode
        got = [t for t, _ in mlx_mtp.generate_step(mx.array(prompt), model, max_tokens=20,
                                                   block_size=bs)]
        assert got == ref, (kind, bs)
    assert any(v for k, v in compiled_layers._checked.items() if k[0] == "tail")


BINDING_CHECK = """
import json, sys, mlx_mtp
import mlx.core as mx
from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.models.qwen3_5 import compiled_layers
from support.pieces import expected_choices
model = mlx_mtp.load_model(sys.argv[1], require_head=False)
t = model.target
t.prepare(4)
prompt = mx.array([[5 + i % 50 for i in range(20)]])
caches = [t.make_cache(), t.make_cache()]
for c in caches:
    mx.eval(t.hidden(prompt, c))
equal = []
for T in (2, 3, 4):
    outs = []
    for on, c in zip((True, False), caches):
        compiled_layers.enabled = on
        h = t.verify(mx.array([[9 + j for j in range(T)]]), c)
        mx.eval(h, t.cache_state(c))
        outs.append([h, *t.cache_state(c)])
    equal.append(all(bytes(memoryview(a)) == bytes(memoryview(b)) for a, b in zip(*outs)))
choices = sorted({str(v) for k, v in compiled_layers._checked.items() if k[0] in ("tail", "attn")})
expected = expected_choices(t, (2, 3, 4))
compiled_layers.enabled = True
outs = []
for c, forward in zip(caches, (t.decode, t.hidden)):  # a one-token step, mlx-lm's as reference
    h = forward(mx.array([[13]]), c)
    mx.eval(h, t.cache_state(c))
    outs.append([h, *t.cache_state(c)])
equal.append(all(bytes(memoryview(a)) == bytes(memoryview(b)) for a, b in zip(*outs)))
from mlx_mtp.exactness import row_exact_layers
kernel = row_exact_layers.row_exact_report(model.mlx_model)["layers"].get("kernel", 0)
print(json.dumps({"blas": cpu_blas.STATE.name, "equal": equal, "choices": choices,
                  "expected": expected, "kernel_layers": kernel,
                  "methods": row_exact_layers.row_exact_report(model.mlx_model)["layers"]}))
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("name,value", blas_bindings())
def test_the_pieces_equal_the_ops_with_every_blas_binding(name, value):
    """The demo pair's verifies at widths 2-4 with and without the pieces, then a ``decode`` step
    against mlx-lm's, in a fresh process per binding: hidden states and caches bitwise equal,
    and every check chose a compiled piece, with a layer's products inside wherever the forms
    this host's measurement chose for them are plain MLX ops (``support.pieces``)."""
    env = {k: v for k, v in os.environ.items() if k != cpu_blas.ENV}
    env.update({cpu_blas.ENV: value, "PYTHONPATH": CHILD_PYTHONPATH})
    r = subprocess.run([sys.executable, "-c", BINDING_CHECK, str(DEMO)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if sys.platform.startswith("linux"):
        assert out["blas"] == name
    assert out["equal"] == [True, True, True, True], out["methods"]
    # Which forms the row-exact layers take depends on how this BLAS reduces on this CPU (the
    # row kernel where it reproduces BLIS's one-row order, transposed products, row chunks,
    # column blocks); a piece keeps the products that are plain MLX ops inside its graph, and
    # runs the others outside it (``split``, ``False``).
    assert out["choices"] == out["expected"], out["methods"]
