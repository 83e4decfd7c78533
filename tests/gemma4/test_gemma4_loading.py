"""Loading Gemma 4 pairs: both namings, the assistant folder, bad pairs, and the CLI."""

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from support.processes import cli
from support.reference import assert_headless_model_decodes_plainly, reference_greedy
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import load as load_tokenizer
from support.tiny_gemma4 import Checkpoints

import mlx_mtp
from mlx_mtp import MTPError
from mlx_mtp.models.gemma4.drafter import Gemma4AssistantDrafter
from mlx_mtp.models.gemma4.target import Gemma4Target

PROMPT = [11, 22, 33, 44, 55]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return Checkpoints(tmp_path_factory)


def generate(model, n=12, bs=3):
    return [t for t, _ in mlx_mtp.generate_step(mx.array(PROMPT), model, max_tokens=n,
                                                block_size=bs)]


def edited_copy(src, dst, config=None, weights=None):
    """Copy a folder; ``config(cfg)`` / ``weights(dict)`` edit it in place."""
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if weights is not None:
        w = mx.load(str(dst / "model.safetensors"))
        weights(w)
        mx.save_safetensors(str(dst / "model.safetensors"), w, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("naming", ["text", "gemma4", "gemma4_unified"])
def test_load_pair_in_every_naming(naming, ckpts, tmp_path):
    if naming == "gemma4_unified":  # mlx-lm maps it onto the gemma4 wrapper
        path = edited_copy(ckpts.target("e2b", "gemma4"), tmp_path / "unified",
                           config=lambda c: c.update(model_type="gemma4_unified"))
    else:
        path = ckpts.target("e2b", naming)
    model, tokenizer = mlx_mtp.load(path, drafter=ckpts.assistant("e2b"))
    assert isinstance(model.target, Gemma4Target) and isinstance(model.drafter, Gemma4AssistantDrafter)
    assert tokenizer.encode("def add") and model.target.hidden_size == 64
    stored = mx.load(str(ckpts.assistant("e2b") / "model.safetensors"))
    params = dict(tree_flatten(model.drafter.assistant.parameters()))
    order = stored.pop("masked_embedding.token_ordering")
    assert set(params) == set(stored)
    assert all(mx.array_equal(params[k], stored[k]).item() for k in params)
    assert model.drafter.assistant.masked_embedding._token_ordering.tolist() == order.tolist()
    assert generate(model) == reference_greedy(ckpts.target("e2b"), PROMPT, 12)


def test_unified_assistant_and_a_stray_lm_head_load(ckpts, tmp_path):
    folder = edited_copy(
        ckpts.assistant("31b"), tmp_path / "unified-assistant",
        config=lambda c: c.update(model_type="gemma4_unified_assistant"),
        weights=lambda w: w.update({"lm_head.weight": w["model.embed_tokens.weight"]}))
    model = mlx_mtp.load_model(ckpts.target("31b"), drafter=folder)
    assert generate(model) == reference_greedy(ckpts.target("31b"), PROMPT, 12)


def test_gemma_target_without_drafter(ckpts):
    path = ckpts.target("e2b")
    with pytest.raises(MTPError) as e:
        mlx_mtp.load_model(path)
    assert str(e.value) == (
        f"{path} is a Gemma 4 target: its MTP drafter is a separate assistant checkpoint. "
        "Pass --drafter DIR (drafter=), e.g. the matching google/gemma-4-*-it-assistant")
    assert_headless_model_decodes_plainly(path, PROMPT)


def _set_text(key, value):
    return lambda c: c["text_config"].update({key: value})


def _rope_theta(c):
    c["text_config"]["rope_parameters"]["sliding_attention"]["rope_theta"] = 20000.0


def _scramble_order(w):
    w["masked_embedding.token_ordering"] = mx.zeros((320,), dtype=mx.int64)


BAD_CONFIGS = {
    "backbone": (lambda c: c.update(backbone_hidden_size=128),
                 "backbone_hidden_size 128 does not match the target's hidden_size 64"),
    "vocab": (_set_text("vocab_size", 256), "vocab_size 256 does not match the target's vocab_size 320"),
    "window": (_set_text("sliding_window", 32),
               "sliding_window 32 does not match the target's sliding_window 16"),
    "head_dim": (_set_text("head_dim", 8),
                 "sliding_attention head_dim 8 does not match the target's 16"),
    "global_head_dim": (_set_text("global_head_dim", 64),
                        "full_attention head_dim 64 does not match the target's 32"),
    "rope": (_rope_theta, "sliding_attention RoPE (type, theta, partial factor, factor) "
                          "('default', 20000.0, 1.0, 1.0) does not match the target's "
                          "('default', 10000.0, 1.0, 1.0)"),
    "per_layer_inputs": (_set_text("hidden_size_per_layer_input", 8),
                         "text_config.hidden_size_per_layer_input is 8, a Gemma 4 assistant needs 0"),
    "gqa": (_set_text("num_attention_heads", 3),
            "num_attention_heads 3 is not a multiple of the target's 2 sliding_attention KV heads"),
}
BAD_WEIGHTS = {
    "missing": (lambda w: w.pop("model.layers.2.self_attn.q_norm.weight"),
                "missing tensor model.layers.2.self_attn.q_norm.weight (1 missing in all)"),
    "unexpected": (lambda w: w.update({"model.layers.0.self_attn.k_proj.weight": mx.zeros((16, 32))}),
                   "unexpected tensor model.layers.0.self_attn.k_proj.weight (1 unexpected in all)"),
    "shape": (lambda w: w.update({"pre_projection.weight": mx.zeros((32, 100))}),
              "tensor pre_projection.weight has shape (32, 100), expected (32, 128) from its "
              "config.json"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS) + sorted(BAD_WEIGHTS))
def test_bad_pairs_are_one_line_errors(case, ckpts, tmp_path):
    kind = "31b" if case == "gqa" else "e2b"
    edit, msg = BAD_CONFIGS[case] if case in BAD_CONFIGS else BAD_WEIGHTS[case]
    key = "config" if case in BAD_CONFIGS else "weights"
    folder = edited_copy(ckpts.assistant(kind), tmp_path / case, **{key: edit})
    with pytest.raises(MTPError) as e:
        mlx_mtp.load_model(ckpts.target(kind), drafter=folder)
    assert str(e.value) == f"drafter {folder}: {msg}"


@pytest.mark.parametrize("case", ["permutation", "absent"])
def test_bad_token_ordering(case, ckpts, tmp_path):
    edit = _scramble_order if case == "permutation" else (
        lambda w: w.pop("masked_embedding.token_ordering"))
    folder = edited_copy(ckpts.assistant("e2b"), tmp_path / case, weights=edit)
    with pytest.raises(MTPError) as e:
        mlx_mtp.load_model(ckpts.target("e2b"), drafter=folder)
    assert str(e.value) == f"drafter {folder}: " + (
        "masked_embedding.token_ordering must be a permutation of 0..319 (got shape (320,), "
        "dtype mlx.core.int64)" if case == "permutation" else
        "use_ordered_embeddings is set but masked_embedding.token_ordering is missing")


def test_wrong_family_drafters(ckpts, dense_dir, tmp_path):
    qwen_drafter = edited_copy(ckpts.assistant("e2b"), tmp_path / "qwen-typed",
                               config=lambda c: c.update(model_type="qwen3_5_mtp"))
    with pytest.raises(MTPError) as e:
        mlx_mtp.load_model(ckpts.target("e2b"), drafter=qwen_drafter)
    assert str(e.value) == (f"{qwen_drafter / 'config.json'}: model_type 'qwen3_5_mtp' is not a "
                            "Gemma 4 assistant (expected gemma4_assistant or gemma4_unified_assistant)")
    with pytest.raises(MTPError, match=r"model_type 'gemma4_assistant' is not an MTP drafter"):
        mlx_mtp.load_model(dense_dir, drafter=ckpts.assistant("e2b"))


def test_quantized_assistant_folder(ckpts, tmp_path):
    """An MLX-quantized assistant (``quantization`` in config.json): projections and the tied
    embedding quantized, the centroids kept in float (spec §1.3)."""
    model = mlx_mtp.load_model(ckpts.target("e2b"), drafter=ckpts.assistant("e2b"))
    assistant = model.drafter.assistant
    nn.quantize(assistant, group_size=32, bits=4,
                class_predicate=lambda p, m: hasattr(m, "to_quantized") and "centroids" not in p)
    weights = dict(tree_flatten(assistant.parameters()))
    weights["masked_embedding.token_ordering"] = assistant.masked_embedding._token_ordering
    folder = tmp_path / "assistant-4bit"
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    cfg = json.loads((ckpts.assistant("e2b") / "config.json").read_text())
    cfg["quantization"] = {"group_size": 32, "bits": 4}
    (folder / "config.json").write_text(json.dumps(cfg))

    q = mlx_mtp.load_model(ckpts.target("e2b"), drafter=folder)
    qa = q.drafter.assistant
    assert isinstance(qa.model.embed_tokens, nn.QuantizedEmbedding)
    assert isinstance(qa.pre_projection, nn.QuantizedLinear)
    assert type(qa.masked_embedding.centroids) is nn.Linear
    hn = mx.random.normal((1, 1, 32), key=mx.random.key(0))
    assert np.array_equal(np.array(qa.argmax(hn)), np.array(assistant.argmax(hn)))
    assert generate(q, n=16, bs=4) == reference_greedy(ckpts.target("e2b"), PROMPT, 16)


@pytest.mark.subprocess
def test_cli_runs_a_gemma_pair_and_errors_in_one_line(ckpts):
    path = ckpts.target("31b", "gemma4")
    r = cli("--model", path, "--drafter", ckpts.assistant("31b"), "--prompt", "def add(a, b):",
            "--max-tokens", 12, "--block-size", 3, "--ignore-chat-template", "--json")
    out = json.loads(r.stdout)
    tok = load_tokenizer(path)
    assert out["tokens"] == reference_greedy(path, tok.encode("def add(a, b):"), 12)
    assert out["mtp_enabled"] and out["block_size"] == 3 and out["host_syncs_per_round"] == 1.0
    r = cli("--model", path, "--prompt", "x", check=False)
    assert r.returncode == 1
    assert r.stderr == (f"error: {path} is a Gemma 4 target: its MTP drafter is a separate "
                        "assistant checkpoint. Pass --drafter DIR (drafter=), e.g. the matching "
                        "google/gemma-4-*-it-assistant\n")


def test_qwen_drafter_options_are_refused_for_gemma(ckpts):
    from mlx_mtp.models.options import DraftOptions

    target, assistant = ckpts.target("e2b"), ckpts.assistant("e2b")
    assert mlx_mtp.load_model(target, drafter=assistant, draft_options=DraftOptions()).drafter
    assert mlx_mtp.load_model(target, drafter=assistant,
                              draft_options=DraftOptions(bf16=False)).drafter
    with pytest.raises(MTPError) as e:
        mlx_mtp.load_model(target, drafter=assistant, draft_options=DraftOptions(bits=4))
    assert str(e.value) == ("the drafter options (--draft-vocab, --draft-bits, --draft-group-size, "
                            "--draft-quantize-fc) apply to the Qwen MTP head, not to a Gemma 4 "
                            "assistant (--draft-bf16 applies to both)")
