"""Loader paths (raw HF, drafter folders, MLX conversions, MoE layouts, repo ids) and bad input."""

import json
import re
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from support import tiny_checkpoints as tc
from support.reference import assert_headless_model_decodes_plainly, reference_greedy
from mlx.utils import tree_flatten

import mlx_mtp
from mlx_mtp import MTPError
from mlx_mtp.models.qwen3_5.drafter import is_zero_centred_norm

PROMPT = [11, 22, 33, 44, 55]


def head_params(model):
    return dict(tree_flatten(model.drafter.head.parameters()))


def stored_mtp(path):
    return {k[len("mtp."):]: v for k, v in mx.load(str(Path(path) / "model.safetensors")).items()
            if k.startswith("mtp.")}


def bitwise(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and bytes(memoryview(a)) == bytes(memoryview(b))


def generate(model, n=12, bs=3):
    return [t for t, _ in mlx_mtp.generate_step(mx.array(PROMPT), model, max_tokens=n,
                                                block_size=bs)]


def test_raw_hf_norms_shifted_exactly_once(dense_dir):
    params = head_params(mlx_mtp.load_model(dense_dir))
    stored = stored_mtp(dense_dir)
    assert set(params) == set(stored)
    n_norms = 0
    for k, v in stored.items():
        if is_zero_centred_norm(k):
            n_norms += 1
            assert bitwise(params[k], v + 1.0), k
        else:
            assert bitwise(params[k], v), k
    assert n_norms == 7


def test_mlx_vlm_drafter_folder_is_not_shifted(ckpt_root, dense_dir, mlx_dir):
    effective = head_params(mlx_mtp.load_model(dense_dir))
    config = json.loads((dense_dir / "config.json").read_text())
    folder = tc.write_drafter_folder(ckpt_root / "drafter-mlx", effective, config)
    model = mlx_mtp.load_model(mlx_dir, drafter=folder)
    got = head_params(model)
    assert set(got) == set(effective)
    assert all(bitwise(got[k], effective[k]) for k in got)
    assert generate(model) == reference_greedy(mlx_dir, PROMPT, 12)


def test_raw_prefixed_drafter_folder_is_shifted_once(ckpt_root, dense_dir, mlx_dir):
    effective = head_params(mlx_mtp.load_model(dense_dir))
    config = json.loads((dense_dir / "config.json").read_text())
    folder = tc.write_drafter_folder(ckpt_root / "drafter-raw", effective, config, raw_prefix=True)
    got = head_params(mlx_mtp.load_model(mlx_dir, drafter=folder))
    assert all(bitwise(got[k], effective[k]) for k in got)


def test_stripped_mlx_conversion_needs_a_drafter(mlx_dir):
    assert not any("mtp." in k for k in mx.load(str(mlx_dir / "model.safetensors")))
    with pytest.raises(MTPError, match=r"has no MTP head weights \(mtp\.\*\).*strip.*--drafter"):
        mlx_mtp.load_model(mlx_dir)
    assert_headless_model_decodes_plainly(mlx_dir, PROMPT)  # plain decode needs no head


def test_moe_expert_layouts_load_the_same_head(moe_dir, moe_per_expert_dir):
    fused = head_params(mlx_mtp.load_model(moe_dir))
    per_expert = head_params(mlx_mtp.load_model(moe_per_expert_dir))
    assert any("switch_mlp" in k for k in fused)
    assert set(fused) == set(per_expert)
    assert all(bitwise(fused[k], per_expert[k]) for k in fused)


def test_tied_target_head_borrows_the_embedding(tied_dir):
    model = mlx_mtp.load_model(tied_dir)
    assert model.target.args.tie_word_embeddings
    assert not hasattr(model.target.lm, "lm_head")
    assert generate(model) == reference_greedy(tied_dir, PROMPT, 12)


def test_quantized_drafter_folder(ckpt_root, dense_dir, q4_dir):
    base = mlx_mtp.load_model(dense_dir)
    head = base.drafter.head
    nn.quantize(head, group_size=32, bits=4, class_predicate=lambda p, m: isinstance(m, nn.Linear)
                and not p.endswith("fc"))
    params = dict(tree_flatten(head.parameters()))
    config = json.loads((dense_dir / "config.json").read_text())
    folder = tc.write_drafter_folder(ckpt_root / "drafter-q4", params, config)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization"] = {"group_size": 32, "bits": 4}
    (folder / "config.json").write_text(json.dumps(cfg))
    model = mlx_mtp.load_model(q4_dir, drafter=folder)
    got = model.drafter.head
    assert isinstance(got.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert isinstance(got.fc, nn.Linear) and not isinstance(got.fc, nn.QuantizedLinear)
    assert isinstance(model.mlx_model.language_model.lm_head, nn.QuantizedLinear)
    assert generate(model) == reference_greedy(q4_dir, PROMPT, 12)


def test_repo_id_goes_through_snapshot_download(dense_dir, monkeypatch):
    import huggingface_hub

    calls = []

    def fake(repo_id, allow_patterns=None, **kw):
        calls.append((repo_id, allow_patterns))
        return str(dense_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    model = mlx_mtp.load_model("Qwen/Qwen3.5-0.8B")
    assert calls and calls[0][0] == "Qwen/Qwen3.5-0.8B" and "*.safetensors" in calls[0][1]
    assert model.drafter is not None


def test_unreachable_repo_id_is_one_clear_error(monkeypatch):
    import huggingface_hub

    def offline(repo_id, **kw):
        raise OSError("We couldn't connect to the Hub\nmore lines")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(MTPError) as e:
        mlx_mtp.load_model("someone/missing-model")
    assert str(e.value) == ("model someone/missing-model is not a local folder and could not be "
                            "fetched from the Hugging Face Hub: We couldn't connect to the Hub")


# ---------------------------------------------------------------------------------- bad input


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return Path(dst)


def test_missing_path(tmp_path):
    with pytest.raises(MTPError, match=r"model path .*nowhere does not exist"):
        mlx_mtp.load_model(tmp_path / "nowhere")


def test_no_config(tmp_path):
    with pytest.raises(MTPError, match=r"config.json not found"):
        mlx_mtp.load_model(tmp_path)


def test_unknown_model_type(tmp_path, dense_dir):
    d = copy_ckpt(dense_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MTPError, match=r"unknown model_type 'llama', expected one of qwen3_5"):
        mlx_mtp.load_model(d)


def test_invalid_config_json(tmp_path, dense_dir):
    d = copy_ckpt(dense_dir, tmp_path / "m")
    (d / "config.json").write_text("{not json")
    with pytest.raises(MTPError, match=r"config.json is not valid JSON"):
        mlx_mtp.load_model(d)


@pytest.mark.parametrize("damage", ["truncate", "header"])
def test_corrupted_safetensors(tmp_path, dense_dir, damage):
    d = copy_ckpt(dense_dir, tmp_path / "m")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\xff" * 64)
    with pytest.raises(MTPError, match=r"model.safetensors: corrupted safetensors file"):
        mlx_mtp.load_model(d)


def test_head_shape_mismatch(tmp_path, dense_dir):
    d = copy_ckpt(dense_dir, tmp_path / "m")
    w = mx.load(str(d / "model.safetensors"))
    w["mtp.fc.weight"] = mx.zeros((64, 96))
    mx.save_safetensors(str(d / "model.safetensors"), w, metadata={"format": "pt"})
    with pytest.raises(MTPError, match=r"MTP head tensor fc.weight has shape \(64, 96\), "
                                       r"expected \(64, 128\) for this target \(hidden_size 64"):
        mlx_mtp.load_model(d)


def test_head_missing_tensor(tmp_path, dense_dir):
    d = copy_ckpt(dense_dir, tmp_path / "m")
    w = mx.load(str(d / "model.safetensors"))
    del w["mtp.layers.0.self_attn.k_proj.weight"]
    mx.save_safetensors(str(d / "model.safetensors"), w, metadata={"format": "pt"})
    with pytest.raises(MTPError, match=r"missing MTP head tensor layers.0.self_attn.k_proj.weight \(1 missing in all\)"):
        mlx_mtp.load_model(d)


def test_drafter_for_another_target_is_rejected(tmp_path, dense_dir, mlx_dir):
    other = tmp_path / "wide"
    mx.random.seed(0)
    cfg = tc.qwen3_5_config(hidden=96)
    big = tc.build_target(cfg)
    tc.write_drafter_folder(other, tc.random_head_params(big, 1), cfg)
    with pytest.raises(MTPError, match=r"drafter .*wide: hidden_size 96 does not match the target's 64"):
        mlx_mtp.load_model(mlx_dir, drafter=other)
    (other / "config.json").unlink()  # without a config the tensor shapes still catch it
    with pytest.raises(MTPError, match=r"MTP head tensor .* has shape .*expected"):
        mlx_mtp.load_model(mlx_dir, drafter=other)


def test_drafter_folder_without_weights(tmp_path, mlx_dir):
    (tmp_path / "d").mkdir()
    with pytest.raises(MTPError, match=r"drafter .*d: no .safetensors files found"):
        mlx_mtp.load_model(mlx_dir, drafter=tmp_path / "d")


@pytest.mark.parametrize("kw,msg", [
    ({"block_size": 0}, "block_size must be between 1 and 16, got 0"),
    ({"block_size": 17}, "block_size must be between 1 and 16, got 17"),
    ({"block_size": 2.5}, "block_size must be an integer, got 2.5"),
    ({"max_tokens": 0}, "max_tokens must be a positive integer or -1 (no limit), got 0"),
])
def test_bad_generation_arguments(dense_dir, kw, msg):
    model = mlx_mtp.load_model(dense_dir)
    with pytest.raises(MTPError, match=re.escape(msg)):
        next(mlx_mtp.generate_step(mx.array(PROMPT), model, **kw))
