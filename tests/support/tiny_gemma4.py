"""Tiny, random, structurally faithful Gemma 4 targets and assistants, written on the fly.

Spec ``gemma4-mtp.md`` §4. Targets:
- ``e2b``: KV sharing (layers 6..9 read layers 5 / 4), per-layer inputs, double-wide MLP in the
  shared layers, softcap 30;
- ``31b``: ``(5 sliding + 1 full) x 2``, no sharing, K=V full attention with 1 global KV head;
- ``26b``: the same plus the MoE block (experts stored in HF's fused layout).
Each as a ``gemma4_text`` checkpoint (``model.*`` keys) or a multimodal ``gemma4`` one (HF's
``model.language_model.*`` keys, nested ``text_config``, plus a vision tensor mlx-lm drops).
Assistants (``gemma4_assistant``): Q-only 4-layer stacks, the ``e2b`` one with the centroid head.

Initialisation follows §4.3: small embeddings (std 0.02) so the target's next token depends on
its context, not only on the current token; a rollback bug then changes the output.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .tiny_checkpoints import build_target, write_tokenizer

VOCAB = 320  # >= the test tokenizer's 300 ids; a multiple of the 16 centroids
WINDOW = 16

ROPE = {
    "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                       "rope_type": "proportional"},
    "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
}


def text_config(kind: str) -> dict:
    common = {
        "model_type": "gemma4_text", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "head_dim": 16, "global_head_dim": 32, "vocab_size": VOCAB,
        "sliding_window": WINDOW, "rope_parameters": copy.deepcopy(ROPE),
        "final_logit_softcapping": 30.0, "enable_moe_block": False, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "max_position_embeddings": 131072,
        "hidden_activation": "gelu_pytorch_tanh",
    }
    s, f = "sliding_attention", "full_attention"
    if kind == "e2b":
        common.update({
            "num_hidden_layers": 10, "num_key_value_heads": 1, "num_global_key_value_heads": None,
            "num_kv_shared_layers": 4, "hidden_size_per_layer_input": 8,
            "vocab_size_per_layer_input": VOCAB, "use_double_wide_mlp": True,
            "attention_k_eq_v": False, "layer_types": [s, s, s, s, f] * 2,
        })
    elif kind == "31b":
        common.update({
            "num_hidden_layers": 12, "num_key_value_heads": 2, "num_global_key_value_heads": 1,
            "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": VOCAB, "use_double_wide_mlp": False,
            "attention_k_eq_v": True, "layer_types": [s, s, s, s, s, f] * 2,
        })
    elif kind == "26b":  # the 31B-like layout with Gemma 4's MoE block beside the dense MLP
        common.update(text_config("31b"))
        common.update({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                       "moe_intermediate_size": 32})
    else:
        raise ValueError(kind)
    return common


def target_config(kind: str, naming: str) -> dict:
    text = text_config(kind)
    if naming == "text":
        return dict(text, architectures=["Gemma4ForCausalLM"])
    return {"model_type": naming, "architectures": ["Gemma4ForConditionalGeneration"],
            "vocab_size": VOCAB, "text_config": text, "tie_word_embeddings": True}


def _init(params: Dict[str, mx.array], rng) -> Dict[str, mx.array]:
    out = {}
    for k, v in params.items():
        shape = v.shape
        if "embed_tokens" in k:
            w = 0.02 * rng.standard_normal(shape)
        elif k.endswith("layer_scalar"):
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif v.ndim == 1:  # norms: weights used as is (no +1 in Gemma 4)
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            w = 0.05 * rng.standard_normal(shape)
        out[k] = mx.array(w.astype(np.float32))
    return out


def random_target_params(kind: str, seed: int) -> Dict[str, mx.array]:
    """mlx-lm parameter names of a ``gemma4_text.Model`` (``model.*``)."""
    model = build_target(text_config(kind))
    return _init(dict(tree_flatten(model.parameters())), np.random.default_rng(seed))


def _fuse_experts(params: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """mlx-lm's ``experts.switch_glu.*`` -> HF's fused ``experts.gate_up_proj`` [E, 2I, H] and
    ``experts.down_proj`` [E, H, I] (mlx-lm's sanitize splits them back)."""
    out = {}
    for k, v in params.items():
        if k.endswith("experts.switch_glu.gate_proj.weight"):
            base = k[: -len("switch_glu.gate_proj.weight")]
            up = params[base + "switch_glu.up_proj.weight"]
            out[base + "gate_up_proj"] = mx.concatenate([v, up], axis=-2)
        elif k.endswith("experts.switch_glu.down_proj.weight"):
            out[k[: -len("switch_glu.down_proj.weight")] + "down_proj"] = v
        elif not k.endswith("experts.switch_glu.up_proj.weight"):
            out[k] = v
    return out


def to_naming(params: Dict[str, mx.array], naming: str) -> Dict[str, mx.array]:
    params = _fuse_experts(params)
    if naming == "text":
        return dict(params)
    out = {"model." + k.replace("model.", "language_model.", 1): v for k, v in params.items()}
    out["model.vision_tower.patch_embed.weight"] = mx.zeros((4, 4))  # mlx-lm's sanitize drops it
    return out


def save(path: Path, weights: Dict[str, mx.array], config: dict, fmt: str = "pt") -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(sorted(weights.items())),
                        metadata={"format": fmt})
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def write_target(path: Path, kind: str, naming: str = "text", seed: int = 0,
                 params: Optional[Dict[str, mx.array]] = None) -> Path:
    params = params if params is not None else random_target_params(kind, seed)
    path = save(path, to_naming(params, naming), target_config(kind, naming))
    write_tokenizer(path)
    return path


# ---------------------------------------------------------------------------------------- drafter


def assistant_config(kind: str, *, centroids: Optional[bool] = None) -> dict:
    target = text_config(kind)
    ordered = (kind == "e2b") if centroids is None else centroids
    s, f = "sliding_attention", "full_attention"
    text = {
        "model_type": "gemma4_text", "hidden_size": 32, "num_hidden_layers": 4,
        "intermediate_size": 64, "num_attention_heads": 2 if kind == "e2b" else 4,
        "num_key_value_heads": target["num_key_value_heads"],
        "num_global_key_value_heads": target["num_global_key_value_heads"],
        "attention_k_eq_v": target["attention_k_eq_v"],
        "head_dim": target["head_dim"], "global_head_dim": target["global_head_dim"],
        "num_kv_shared_layers": 4, "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 0, "use_double_wide_mlp": False, "enable_moe_block": False,
        "vocab_size": VOCAB, "sliding_window": WINDOW, "layer_types": [s, s, s, f],
        "rope_parameters": copy.deepcopy(ROPE), "final_logit_softcapping": None,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "max_position_embeddings": 131072,
    }
    return {"model_type": "gemma4_assistant", "architectures": ["Gemma4AssistantForCausalLM"],
            "backbone_hidden_size": target["hidden_size"], "use_ordered_embeddings": ordered,
            "num_centroids": 16, "centroid_intermediate_top_k": 4, "tie_word_embeddings": True,
            "dtype": "float32", "text_config": text}


def random_assistant_weights(config: dict, seed: int) -> Dict[str, mx.array]:
    """The tensors of spec §1.3 under their checkpoint names (``token_ordering`` int64)."""
    rng = np.random.default_rng(seed)
    t = config["text_config"]
    H, Bh, V, I = t["hidden_size"], config["backbone_hidden_size"], t["vocab_size"], t["intermediate_size"]
    nq = t["num_attention_heads"]
    w = {
        "pre_projection.weight": (H, 2 * Bh), "post_projection.weight": (Bh, H),
        "model.embed_tokens.weight": (V, H), "model.norm.weight": (H,),
    }
    for i, lt in enumerate(t["layer_types"]):
        hd = t["global_head_dim"] if lt == "full_attention" else t["head_dim"]
        p = f"model.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            w[p + n + ".weight"] = (H,)
        w[p + "layer_scalar"] = (1,)
        w[p + "self_attn.q_proj.weight"] = (nq * hd, H)
        w[p + "self_attn.q_norm.weight"] = (hd,)
        w[p + "self_attn.o_proj.weight"] = (H, nq * hd)
        w[p + "mlp.gate_proj.weight"] = (I, H)
        w[p + "mlp.up_proj.weight"] = (I, H)
        w[p + "mlp.down_proj.weight"] = (H, I)
    if config["use_ordered_embeddings"]:
        w["masked_embedding.centroids.weight"] = (config["num_centroids"], H)
    out = {}
    for k, shape in w.items():
        if len(shape) == 1:
            a = 1.0 + 0.1 * rng.standard_normal(shape)
        elif "embed_tokens" in k:
            a = 0.5 * rng.standard_normal(shape)
        else:
            a = 0.1 * rng.standard_normal(shape)
        out[k] = mx.array(a.astype(np.float32))
    if config["use_ordered_embeddings"]:
        out["masked_embedding.token_ordering"] = mx.array(rng.permutation(V).astype(np.int64))
    return out


def write_assistant(path: Path, kind: str, seed: int = 100, *, config: Optional[dict] = None,
                    weights: Optional[Dict[str, mx.array]] = None) -> Path:
    config = config if config is not None else assistant_config(kind)
    weights = weights if weights is not None else random_assistant_weights(config, seed)
    return save(path, weights, config)


class Checkpoints:
    """The tiny Gemma 4 folders, written once per test session (module-level, so every test
    module that asks gets the same folders)."""

    _root: Optional[Path] = None
    _made: Dict[str, Path] = {}

    def __init__(self, tmp_path_factory):
        if Checkpoints._root is None:
            Checkpoints._root = Path(tmp_path_factory.mktemp("gemma4"))

    def _get(self, name: str, make) -> Path:
        if name not in Checkpoints._made:
            Checkpoints._made[name] = make(Checkpoints._root / name)
        return Checkpoints._made[name]

    def target(self, kind: str, naming: str = "text") -> Path:
        seed = {"e2b": 1, "31b": 2, "26b": 3}[kind]  # the same weights under every naming
        return self._get(f"{kind}-{naming}", lambda p: write_target(p, kind, naming, seed=seed))

    def assistant(self, kind: str) -> Path:
        return self._get(f"assistant-{kind}", lambda p: write_assistant(p, kind, seed=100))
