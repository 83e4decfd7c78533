"""benchmarks/realistic_pair.py's mixture-of-experts pairs on small shapes: the real layouts (key
names and shapes, fused or per-expert stacks, the MTP head's own MoE layer, Gemma 4's tied head and
softcap), the folders load with mlx_mtp.load and mlx_lm.load, T=0 output is mlx-lm's, and the
routers' locality is measurable (benchmarks.realistic_moe.DistinctExperts): consecutive rows share
experts more than random routes do, and more with a higher --router-locality."""

import json

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step as plain_step

import mlx_mtp
from benchmarks import realistic_pair
from benchmarks.realistic_moe import DistinctExperts
from support.realistic_shapes import QWEN_SMALL

QWEN = ["--hidden", "256", *QWEN_SMALL[2:], "--experts", "32", "--top-k", "4",
        "--expert-width", "32", "--shared-width", "64"]
GEMMA = ["--family", "gemma4", "--moe", "--hidden", "256", "--layers", "6", "--vocab", "12288",
         "--intermediate", "128", "--heads", "2", "--kv-heads", "1", "--head-dim", "64",
         "--sliding-window", "16", "--experts", "32", "--top-k", "4", "--expert-width", "32"]
assert QWEN_SMALL[0] == "--hidden"


def write(tmp_path, flags, scale="0.05", name="pair"):
    out = tmp_path / name
    assert realistic_pair.main([str(out), *flags, "--residual-scale", scale]) == 0
    return out


def tensors(folder):
    return {k: v for k, v in mx.load(str(folder / "model.safetensors")).items()}


def distinct_ratio(model, tokenizer, prompts=("The river", "def f(x):")) -> float:
    """Mean distinct experts of a 4-row verify over one row's, the pair's own head drafting."""
    counter = DistinctExperts().attach(model.mlx_model)
    try:
        for p in prompts:
            list(mlx_mtp.generate_step(mx.array(tokenizer.encode(p)), model, max_tokens=40,
                                       block_size=4))
    finally:
        counter.detach()
    return counter.ratios()[4]


def same_as_plain(path, model, tokenizer, n=24) -> bool:
    prompt = mx.array(tokenizer.encode("abc"))
    ids = [t for t, _ in mlx_mtp.generate_step(prompt, model, max_tokens=n, block_size=3)]
    lm, _ = mlx_lm_load(str(path))
    lm.set_dtype(mx.float32)  # mlx's CPU gather_mm takes float32 only (mlx_mtp loads so)
    return ids == [int(t) for t, _ in plain_step(prompt, lm, max_tokens=n)]


def test_qwen3_5_moe_pair_has_the_35b_a3b_layout_and_loads_everywhere(tmp_path):
    out = write(tmp_path, ["--moe", *QWEN])
    config = json.loads((out / "config.json").read_text())
    text = config["text_config"]
    assert (config["model_type"], text["model_type"]) == ("qwen3_5_moe", "qwen3_5_moe_text")
    assert (text["num_experts"], text["num_experts_per_tok"], text["moe_intermediate_size"],
            text["shared_expert_intermediate_size"], text["tie_word_embeddings"]) == \
        (32, 4, 32, 64, False)
    w = tensors(out)
    p = "model.language_model.layers.0.mlp."
    assert w[p + "experts.gate_up_proj"].shape == (32, 64, 256)  # gate rows, then up rows
    assert w[p + "experts.down_proj"].shape == (32, 256, 32)
    assert w[p + "gate.weight"].shape == (32, 256)
    assert w[p + "shared_expert.gate_proj.weight"].shape == (64, 256)
    assert w[p + "shared_expert_gate.weight"].shape == (1, 256)
    assert w["mtp.layers.0.mlp.experts.gate_up_proj"].shape == (32, 64, 256)  # the head's MoE
    assert w["lm_head.weight"].shape == (12288, 256)
    assert all(v.dtype == mx.bfloat16 for v in w.values())  # as the real checkpoints
    info = json.loads((out / "realistic_pair.json").read_text())
    assert info["moe"] == {"experts": 32, "top_k": 4, "expert_width": 32, "shared_width": 64,
                           "router_locality": 0.7}
    model, tokenizer = mlx_mtp.load(str(out))
    assert type(model.drafter.head.layers[0].mlp).__name__ == "Qwen3NextSparseMoeBlock"
    assert same_as_plain(out, model, tokenizer)


def test_the_routers_locality_is_measured_and_follows_the_flag(tmp_path):
    """Four consecutive rows of top-4 of 32 random routes touch about 3.2x one row's experts;
    the default locality fewer, and a locality of 0.95 fewer still."""
    ratios = {}
    for locality in ("0.0", "0.7", "0.95"):
        out = write(tmp_path, ["--moe", *QWEN, "--router-locality", locality], name=locality)
        model, tokenizer = mlx_mtp.load(str(out))
        ratios[locality] = distinct_ratio(model, tokenizer)
    assert ratios["0.0"] > 2.8, ratios
    assert ratios["0.0"] > ratios["0.7"] + 0.3 > ratios["0.95"] + 0.6, ratios


def test_qwen3_next_pair_has_per_expert_tensors_and_loads_everywhere(tmp_path):
    out = write(tmp_path, ["--family", "qwen3_next", *QWEN])
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["num_experts"], config["num_experts_per_tok"],
            config["decoder_sparse_step"]) == ("qwen3_next", 32, 4, 1)
    w = tensors(out)
    assert w["model.layers.0.mlp.experts.31.gate_proj.weight"].shape == (32, 256)
    assert w["model.layers.0.mlp.experts.0.down_proj.weight"].shape == (256, 32)
    assert w["model.layers.0.linear_attn.in_proj_qkvz.weight"].shape == (2 * 64 + 2 * 64, 256)
    assert w["model.layers.3.self_attn.q_proj.weight"].shape == (2 * 2 * 64, 256)
    assert w["mtp.layers.0.mlp.experts.31.up_proj.weight"].shape == (32, 256)
    assert not any(".experts.gate_up_proj" in k for k in w)
    model, tokenizer = mlx_mtp.load(str(out))
    assert same_as_plain(out, model, tokenizer)
    assert distinct_ratio(model, tokenizer) < 2.8


def test_gemma4_moe_pair_has_the_26b_a4b_layout_and_loads_everywhere(tmp_path):
    out = write(tmp_path, GEMMA, scale="0.005")
    target, assistant = out / "target", out / "assistant"
    config = json.loads((target / "config.json").read_text())
    assert (config["enable_moe_block"], config["num_experts"], config["top_k_experts"],
            config["moe_intermediate_size"], config["tie_word_embeddings"],
            config["final_logit_softcapping"]) == (True, 32, 4, 32, True, 30.0)
    w = tensors(target)
    p = "model.layers.0."
    assert w[p + "experts.gate_up_proj"].shape == (32, 64, 256)
    assert w[p + "experts.down_proj"].shape == (32, 256, 32)
    assert w[p + "router.proj.weight"].shape == (32, 256)
    assert w[p + "mlp.gate_proj.weight"].shape == (128, 256)  # the dense MLP beside the experts
    assert "lm_head.weight" not in w
    model, tokenizer = mlx_mtp.load(str(target), drafter=str(assistant))
    assert same_as_plain(target, model, tokenizer)
    assert distinct_ratio(model, tokenizer) < 2.8


@pytest.mark.parametrize("flags,message", [
    (["--experts", "8"], "--experts needs --moe"),
    (["--moe", "--router-locality", "1.5"], "--router-locality must be between 0 and 1"),
    (["--moe", "--zipf", "1.0"], "--zipf takes an exponent > 0, with --family qwen3_5 (dense)"),
])
def test_bad_moe_flags_are_one_line(tmp_path, flags, message):
    with pytest.raises(SystemExit, match=message.replace("(", r"\(").replace(")", r"\)")):
        realistic_pair.main([str(tmp_path / "x"), *QWEN_SMALL, *flags, "--residual-scale", "0.1"])
    assert not (tmp_path / "x").exists()
