"""mlx_mtp.exactness.grouped_experts on mlx-lm's SwitchGLU: which method each width gets and why
(the kernel where its rows equal the one-row calls bitwise, mlx-lm's products sorted by expert
where they do not or for quantized experts, mlx-lm's own call otherwise), that a switched layer's
rows equal its one-row calls for rows sharing experts, rows sharing none, one row and every
expert, that outside a verify it is mlx-lm's layer, and the stats it reports."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.switch_layers import SwitchGLU
from support.native_support import one_row_products_in_kernel_order, require_lazy

from mlx_mtp.cpu import expert_kernel
from mlx_mtp.exactness import gate, grouped_experts, row_exact_layers

D, WIDTH, E = 576, 64, 8  # inputs wider than 512: BLIS's multi-row order differs there


@pytest.fixture(autouse=True)
def lazy():
    require_lazy()


class Block(nn.Module):
    """A model holding one mlx-lm SwitchGLU (what ``install`` walks)."""

    def __init__(self, seed=0, bias=False):
        super().__init__()
        mx.random.seed(seed)
        self.experts = SwitchGLU(D, WIDTH, E, bias=bias)
        mx.eval(self.parameters())


def method():
    return grouped_experts.KERNEL if one_row_products_in_kernel_order() else grouped_experts.SORTED


def rows_equal(glu, x, route) -> bool:
    """Whether the layer's block inside a verify is bitwise its one-row calls."""
    with row_exact_layers.verifying():
        block = glu(x, route)
    rows = [SwitchGLU.__call__(glu, x[:, t : t + 1], route[:, t : t + 1])
            for t in range(x.shape[1])]
    mx.eval(block, rows)
    return all(row_exact_layers.bitwise_equal(block[:, t : t + 1], rows[t]) for t in range(x.shape[1]))


ROUTES = {
    "shared": [[1, 4, 6]] * 5,
    "none": [[0, 1, 2], [3, 4, 5], [6, 7, 0]],
    "every expert": [[0, 1, 2], [3, 4, 5], [6, 7, 1], [2, 5, 7]],
    "one row": [[7, 2, 3]],
}


def test_install_switches_the_layer_and_its_rows_equal_one_row_calls():
    model = Block()
    switched = grouped_experts.switch_to_grouped(model, 6)
    first = 1 if method() == grouped_experts.KERNEL else 2
    assert switched == {"experts": {w: method() for w in range(first, 7)}}
    assert type(model.experts) is grouped_experts.GroupedSwitchGLU
    for name, route in ROUTES.items():
        r = mx.array(route, dtype=mx.uint32)[None]
        x = mx.random.normal((1, r.shape[1], D), key=mx.random.key(len(name)))
        assert rows_equal(model.experts, x, r), name
    # outside a verify it is mlx-lm's layer, call for call
    x = mx.random.normal((1, 3, D), key=mx.random.key(1))
    r = mx.array(ROUTES["none"], dtype=mx.uint32)[None]
    assert row_exact_layers.bitwise_equal(model.experts(x, r), SwitchGLU.__call__(model.experts, x, r))


def test_wider_blocks_than_checked_keep_mlx_lms_call(monkeypatch):
    model = Block()
    grouped_experts.switch_to_grouped(model, 3)
    calls = []
    monkeypatch.setattr(grouped_experts, "kernel_call", lambda *a: calls.append(a))
    monkeypatch.setattr(grouped_experts, "sorted_call", lambda *a: calls.append(a))
    x = mx.random.normal((1, 4, D), key=mx.random.key(2))
    r = mx.array(ROUTES["every expert"], dtype=mx.uint32)[None]
    with row_exact_layers.verifying():
        out = model.experts(x, r)
    assert calls == [] and out.shape == (1, 4, 3, D)
    assert grouped_experts.expert_method(model.experts, 4) == grouped_experts.GATHER


def test_a_layer_the_kernel_cannot_take_is_sorted_and_a_failing_check_keeps_its_call(
        monkeypatch):
    model = Block(bias=True)  # the kernel takes no bias; sorting is mlx-lm's own products
    assert grouped_experts.switch_to_grouped(model, 4) == {"experts": {w: "sorted" for w in (2, 3, 4)}}
    r = mx.array(ROUTES["shared"], dtype=mx.uint32)[None, :4]
    assert rows_equal(model.experts, mx.random.normal((1, 4, D), key=mx.random.key(3)), r)
    monkeypatch.setattr(grouped_experts, "sorted_call",
                        lambda glu, x, i: SwitchGLU.__call__(glu, x, i) + 1e-3)
    other = Block(seed=1, bias=True)
    assert grouped_experts.switch_to_grouped(other, 4) == {}
    assert type(other.experts) is SwitchGLU


def test_quantized_experts_are_sorted_by_expert_exactly():
    model = Block()
    nn.quantize(model, group_size=64, bits=4)
    assert grouped_experts.switch_to_grouped(model, 5) == {"experts": {w: "sorted" for w in range(2, 6)}}
    for name, route in ROUTES.items():
        r = mx.array(route, dtype=mx.uint32)[None]
        x = mx.random.normal((1, r.shape[1], D), key=mx.random.key(7 + len(name)))
        assert rows_equal(model.experts, x, r), name


def test_one_check_per_signature(monkeypatch):
    model = nn.Module()
    model.a, model.b = Block(seed=2).experts, Block(seed=3).experts
    chosen = []
    real = grouped_experts.choose
    monkeypatch.setattr(grouped_experts, "choose",
                        lambda glu, w: chosen.append(glu) or real(glu, w))
    switched = grouped_experts.switch_to_grouped(model, 2)
    assert sorted(switched) == ["a", "b"] and len(chosen) == 1  # one check for both


def test_the_report_and_its_table_cell(monkeypatch):
    model = Block()
    grouped_experts.switch_to_grouped(model, 4)
    info = grouped_experts.experts_report(model)
    want = method()
    widths = {str(w): {want: 1} for w in range(1 if want == "kernel" else 2, 5)}
    assert info == {"layers": 1, "widths": widths}
    assert gate.verify_report(model)["experts"] == info
    span = "1-4" if want == "kernel" else "2-4"
    cell = dict(gate.gate_rows({"mtp_enabled": True,
                                 "exactness": {"verdict": "equal", "widths": [],
                                               "row_exact": gate.verify_report(model)}},
                                 full=True))
    assert cell["expert layers"] == f"1 layers: {want} at widths {span}"
    monkeypatch.setattr(expert_kernel, "problem", lambda: "no (test)")
    assert grouped_experts.experts_summary(grouped_experts.experts_report(model)).endswith(
        "; expert kernel unavailable (no (test))")
    assert grouped_experts.experts_report(nn.Linear(4, 4)) == {}


def test_off_the_cpu_the_layers_keep_mlx_lms_kernels(monkeypatch):
    """Measured on the CPU only: on another device nothing is checked or switched."""
    model = Block()
    monkeypatch.setattr(grouped_experts.mx, "default_device", lambda: mx.gpu)
    assert grouped_experts.switch_to_grouped(model, 4) == {}
    assert type(model.experts) is SwitchGLU
