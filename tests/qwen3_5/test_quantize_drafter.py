"""Phase 3: a 4-bit (or 8-bit) MTP head, at load or as a converted drafter folder."""

import importlib
import json

import mlx.core as mx
import pytest
from support import tiny_checkpoints as tc
from support.reference import reference_greedy
from mlx.utils import tree_flatten

import mlx_mtp
from mlx_mtp import MTPError
from mlx_mtp import quantize_drafter
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.models.options import DraftOptions

PROMPT = [5, 17, 3, 99, 42]


def kinds(head):
    return {p: (type(m).__name__, getattr(m, "bits", None), getattr(m, "group_size", None))
            for p, m in head.named_modules() if hasattr(m, "to_quantized") or hasattr(m, "bits")}


def test_at_load_quantizes_the_projections_but_not_fc(dense_dir):
    head = mlx_mtp.load_model(dense_dir, draft_options=DraftOptions(bits=4)).drafter.head
    q4 = ("QuantizedLinear", 4, 64)
    assert kinds(head) == {
        "fc": ("Linear", None, None),
        **{f"layers.0.self_attn.{p}": q4 for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
        **{f"layers.0.mlp.{p}": q4 for p in ("gate_proj", "up_proj", "down_proj")},
    }
    head = mlx_mtp.load_model(dense_dir, draft_options=DraftOptions(
        bits=8, group_size=32, quantize_fc=True)).drafter.head
    assert kinds(head)["fc"] == ("QuantizedLinear", 8, 32)


def test_moe_router_gates_stay_unquantized(moe_dir):
    found = kinds(mlx_mtp.load_model(moe_dir, draft_options=DraftOptions(bits=4)).drafter.head)
    assert found["layers.0.mlp.gate"] == ("Linear", None, None)
    assert found["layers.0.mlp.shared_expert_gate"] == ("Linear", None, None)
    assert found["layers.0.mlp.switch_mlp.gate_proj"] == ("QuantizedSwitchLinear", 4, 64)
    # moe_intermediate_size 32 is not a multiple of the group: down_proj cannot be quantized.
    assert found["layers.0.mlp.switch_mlp.down_proj"] == ("SwitchLinear", None, None)


def test_conversion_writes_a_drafter_that_loads_as_the_same_head(capsys, dense_dir, tmp_path):
    out = tmp_path / "q4"
    assert quantize_drafter.main(["--model", str(dense_dir), "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["fc_quantized"] is False and len(result["quantized"]) == 7
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_mtp"
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    converted = mlx_mtp.load_model(dense_dir, drafter=out)
    at_load = mlx_mtp.load_model(dense_dir, draft_options=DraftOptions(bits=4))
    a = dict(tree_flatten(converted.drafter.head.parameters()))
    b = dict(tree_flatten(at_load.drafter.head.parameters()))
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and bytes(memoryview(a[k])) == bytes(memoryview(b[k])), k
    assert kinds(converted.drafter.head) == kinds(at_load.drafter.head)


def test_bad_quantization_settings():
    with pytest.raises(MTPError) as e:
        DraftOptions(bits=3)
    assert str(e.value) == "draft bits (--draft-bits) must be one of 4, 8, got 3"
    with pytest.raises(MTPError) as e:
        DraftOptions(bits=4, group_size=48)
    assert str(e.value) == "draft group size (--draft-group-size) must be one of 32, 64, 128, got 48"


def test_cli_rejects_bad_bits(capsys, dense_dir, tmp_path):
    with pytest.raises(SystemExit) as e:
        quantize_drafter.main(["--model", str(dense_dir), "--out", str(tmp_path), "--bits", "3"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "error: argument --bits: invalid choice: 3 (choose from 4, 8)")


def test_quantized_agreeing_head_is_accepted_and_exact(tmp_path):
    path = tc.write_agreeing_checkpoint(tmp_path / "pair", seed=3)
    ref = reference_greedy(path, PROMPT, 24)
    model = mlx_mtp.load_model(path, draft_options=DraftOptions(bits=4))
    assert model.drafter.describe()["bits"] == [4]
    for bs in (2, 3, 5):
        stats = RunStats()
        out = [t for t, _ in mlx_mtp.generate_step(mx.array(PROMPT), model, max_tokens=24,
                                                   block_size=bs, stats=stats)]
        assert out == ref
        assert stats.acceptance_rate > 0.5, stats.acceptance_rate


def test_cli_draft_bits_flag(capsys, dense_dir):
    generate = importlib.import_module("mlx_mtp.generate")  # the CLI module (mlx_mtp.generate is also the function)

    assert generate.main(["--model", str(dense_dir), "--max-tokens", "8", "--json",
                          "--ignore-chat-template", "--draft-bits", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["draft"]["bits"] == [4] and out["draft"]["fc_quantized"] is False
    assert out["draft"]["quantized_layers"] == 7
