"""benchmarks.verify_arms: every arm timed on a tiny wide target and the demo pair, the layers'
choices restored; the all-kernel arms compute the installed verify's bytes."""

import json
from pathlib import Path

import mlx.core as mx
import pytest
import mlx_mtp
from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.cpu import lazy_ops as lazy_kernels
from mlx_mtp.exactness import row_exact_layers
from mlx_mtp.cpu import row_kernel
from mlx_mtp.models.qwen3_5 import gdn_block

from benchmarks import verify_arms


def test_verify_arms_reports_every_arm_against_the_decode_step(wide_dir, capsys):
    assert verify_arms.main(["--model", str(wide_dir), "--width", "3", "--reps", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out["ms"]) == list(verify_arms.ARMS) == list(out["x_decode"])
    assert all(v > 0 for v in out["ms"].values()) and out["x_decode"]["decode"] == 1.0
    assert out["width"] == 3 and out["reps"] == 2 and out["blas"] == cpu_blas.STATE.describe()
    assert out["kernel_threads"] == "by size"  # row_exact_layers.kernel_threads's default
    if cpu_blas.STATE.name == "BLIS" and row_kernel.available():
        assert out["kernel_layers"] == out["row_exact"]["layers"]["kernel"] >= 20


def test_chosen_arms_only_and_a_bad_arm_is_a_clear_error(wide_dir, capsys):
    assert verify_arms.main(["--model", str(wide_dir), "--width", "2", "--reps", "1",
                             "--arms", "eager,kernel"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out["ms"]) == ["decode", "kernel", "eager"]  # decode always, in ARMS order
    assert out["kernels"] in ("lazy", f"eager ({lazy_kernels.reason()})")
    with pytest.raises(SystemExit) as e:
        verify_arms.main(["--model", str(wide_dir), "--arms", "kernel,fast"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().endswith(
        f"error: --arms: expected names from {','.join(verify_arms.ARMS)}, got 'kernel,fast'")


def test_the_arms_leave_the_installed_choice_as_it_was(wide_dir):
    mixer_choice = gdn_block.mixer_choice
    model = mlx_mtp.load_model(wide_dir, require_head=False)
    model.target.prepare(3)

    def choices():
        return {n: (row_exact_layers.row_method(m), m.block_cols) for n, m in
                model.mlx_model.named_modules() if row_exact_layers.row_method(m) != "multi-row"}

    before = choices()
    if cpu_blas.STATE.name == "BLIS":  # its multi-row products differ for 576-wide inputs
        assert len(before) >= 20
    out = verify_arms.measure(model, 3, 1, kernel_threads=2)
    assert out["kernel_threads"] == 2
    assert choices() == before and model.target.exact is True
    assert row_exact_layers.kernel_threads(0) == 1  # the kernel arm's threads were its own
    assert row_exact_layers.kernel_threads(row_exact_layers.PARALLEL_WORK_BYTES) == cpu_blas.usable_cores()
    assert gdn_block.mixer_choice is mixer_choice  # the stepwise arm's switch undone


DEMO = Path(mlx_mtp.__file__).parent / "demo_pair"


def _classes(model):
    return [(n, type(m)) for n, m in model.mlx_model.named_modules()]


def test_all_kernel_arms_find_the_demo_pairs_row_invariant_layers_and_switch_them_back():
    model = mlx_mtp.load_model(DEMO, require_head=False)
    model.target.prepare(3)
    before = _classes(model)
    extra, head = verify_arms.speed_candidates(model, 3)
    assert head is model.target.lm_head_module and model.target.tied_head
    assert all(row_exact_layers.row_method(layer) == "multi-row" for layer, _, _ in extra)
    if cpu_blas.STATE.name == "BLIS" and row_kernel.available():
        # each of the demo target's 124 projections (16 layers) and its tied head either is
        # row-invariant under BLIS, the kernel equal to its one-row product (all of them on an
        # AVX2 host), or already runs through the kernel (the 16 down projections, whose
        # multi-row products BLIS reduces differently on an AVX-512 host)
        installed = row_exact_layers.row_exact_report(model.mlx_model)["layers"]
        assert set(installed) <= {"kernel"}
        assert len(extra) + installed.get("kernel", 0) == 125
        assert any(layer is head for layer, _, _ in extra)
    out = verify_arms.measure(model, 3, 1)
    assert out["all_kernel_extra_layers"] == len(extra)
    assert _classes(model) == before and model.target.exact is True


def test_the_all_kernel_verify_is_bitwise_the_installed_verify_on_the_demo_pair(monkeypatch):
    """What the all_kernel arm times is the same computation, byte for byte: logits and caches."""
    model = mlx_mtp.load_model(DEMO, require_head=False)
    target = model.target
    target.prepare(4)
    extra, _ = verify_arms.speed_candidates(model, 4)
    if not extra:
        pytest.skip(f"no layer goes through the kernel here ({cpu_blas.STATE.name}, kernel "
                    f"{row_exact_layers.row_exact_report(model.mlx_model)['kernel']})")
    prompt = mx.array([[5 + i % 200 for i in range(40)]])
    block = mx.array([[9, 301, 77, 4000]])
    calls = []  # (arm on, the layer is one the arm switches) per kernel call
    switched = {id(layer) for layer, _, _ in extra}
    kernel_products = row_exact_layers.kernel_products
    monkeypatch.setattr(row_exact_layers, "kernel_products", lambda layer, x: calls.append(
        (on, id(layer) in switched)) or kernel_products(layer, x))
    results = []
    for on in (False, True):
        cache = target.make_cache()
        mx.eval(target.hidden(prompt, cache))
        verify_arms.switch(extra, on)
        try:
            with cpu_blas.verify_threads():
                logits = target.logits(target.verify(block, cache))
                mx.eval(logits)
        finally:
            verify_arms.switch(extra, False)
        states = [a for c in cache for a in c.state if isinstance(a, mx.array)]
        mx.eval(states)
        results.append((bytes(memoryview(logits)), [bytes(memoryview(a)) for a in states]))
    # the kernel ran for the arm's layers, only when on (layers installed with the kernel, as
    # the demo's down projections with BLIS on an AVX-512 host, run it in both arms)
    assert calls.count((True, True)) >= len(extra) and (False, True) not in calls
    assert results[0][0] == results[1][0]
    assert results[0][1] == results[1][1] and results[0][1]
