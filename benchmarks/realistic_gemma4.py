"""The Gemma 4 side of ``benchmarks.realistic_pair``: a random target and an assistant that agrees
with it the way the Qwen3.5 head does.

The target is ``gemma4_text`` in the 26B/31B layout (five sliding-window layers, then one full one,
K = V, one global KV head), its LM head tied to its embedding with the final softcap, as Gemma 4's
checkpoints; with ``--moe``, also 26B-A4B's expert block in every layer (HF's fused stacks). A tied
head maps a token to itself, so the first MLP branch is large (``FIRST_MLP_SCALE``): the target
mostly maps x to f(x) = argmax(embed . norm(u(x))), u that branch. Each residual branch is
normalised before it is added, so the residual scale C is the post-branch norms' weight (relative
to the stream, ``branch_norms``) and the context's perturbation flips f's choice. The assistant
(``gemma4_assistant``, four layers) computes f: ``pre_projection`` = [I | 0] keeps the scaled
embedding, its first MLP copies the target's, its other layers add nothing (zero ``o_proj`` and
``down_proj``; they still read the target's K/V, as a real draft step), its tied head is the
target's table.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import gemma4_text

from benchmarks import realistic_moe

SLIDING, FULL = "sliding_attention", "full_attention"
ROPE = {FULL: {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
        SLIDING: {"rope_theta": 10000.0, "rope_type": "default"}}
# The first layer's MLP branch, per coordinate, against the scaled embedding's 1: a token's own
# row then wins its tied logit about 0.1% of the time (a fixed point of f), where the branch's
# random part beats the self-product sqrt(H)
FIRST_MLP_SCALE = 64.0


def text_config(a) -> dict:
    return {
        "model_type": "gemma4_text", "hidden_size": a.hidden, "intermediate_size": a.intermediate,
        "num_hidden_layers": a.layers, "num_attention_heads": a.heads, "head_dim": a.head_dim,
        "global_head_dim": 2 * a.head_dim, "num_key_value_heads": a.kv_heads,
        "num_global_key_value_heads": 1, "attention_k_eq_v": True, "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": a.vocab,
        "use_double_wide_mlp": False, "enable_moe_block": a.moe, "vocab_size": a.vocab,
        "sliding_window": a.sliding_window, "rope_parameters": ROPE,
        "layer_types": [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(a.layers)],
        "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "max_position_embeddings": 131072, "hidden_activation": "gelu_pytorch_tanh",
        "architectures": ["Gemma4ForCausalLM"], "eos_token_id": 0,
        **({"num_experts": a.experts, "top_k_experts": a.top_k,
            "moe_intermediate_size": a.expert_width} if a.moe else {}),
    }


def assistant_config(a) -> dict:
    text = {
        "model_type": "gemma4_text", "hidden_size": a.hidden, "num_hidden_layers": 4,
        "intermediate_size": a.intermediate, "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads, "num_global_key_value_heads": 1,
        "attention_k_eq_v": True, "head_dim": a.head_dim, "global_head_dim": 2 * a.head_dim,
        "num_kv_shared_layers": 4, "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 0, "use_double_wide_mlp": False, "enable_moe_block": False,
        "vocab_size": a.vocab, "sliding_window": a.sliding_window,
        "layer_types": [SLIDING, SLIDING, SLIDING, FULL], "rope_parameters": ROPE,
        "final_logit_softcapping": None, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "max_position_embeddings": 131072,
    }
    return {"model_type": "gemma4_assistant", "architectures": ["Gemma4AssistantForCausalLM"],
            "backbone_hidden_size": a.hidden, "use_ordered_embeddings": False,
            "tie_word_embeddings": True, "dtype": "float32", "text_config": text}


class _Random:
    def __init__(self, seed: int):
        self.key = mx.random.key(seed)

    def normal(self, shape, std):
        self.key, k = mx.random.split(self.key)
        return mx.random.normal(shape, key=k) * std


def topic_scale(a) -> float:
    """The embedding's topic entries (times 1/sqrt(H), as the rest of the table): in the tied
    logits the same topic pulls ``TOPIC_BOOST`` standard deviations of their random part, which
    the first MLP branch dominates."""
    spread = math.sqrt(1.0 + FIRST_MLP_SCALE ** 2)
    return math.sqrt(realistic_moe.TOPIC_BOOST * spread * math.sqrt(a.hidden)
                     / realistic_moe.TOPIC_DIMS)


def _fill(name: str, shape, a, rng: _Random, vectors) -> mx.array:
    """A target tensor by rule (mlx-lm's name)."""
    H = a.hidden
    layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
    if name == "model.embed_tokens.weight":  # times sqrt(H) on the way in: RMS 1
        w = rng.normal(shape, 1.0 / math.sqrt(H))
        return w if vectors is None else realistic_moe.with_topics(
            w, vectors, topic_scale(a) / math.sqrt(H))
    if name.endswith("router.proj.weight"):
        rng.key, k = mx.random.split(rng.key)
        return realistic_moe.router(shape[0], H, a.router_locality, k, topic_scale(a),
                                    math.sqrt(1.0 + FIRST_MLP_SCALE ** 2))
    if len(shape) == 1:  # norms, router scales and layer_scalar: weight 1 (used as is);
        return mx.ones(shape)  # ``set_scale`` sets the post-branch norms
    w = rng.normal(shape, 1.0 / math.sqrt(shape[-1]))
    if layer == 0 and vectors is not None:  # the first MLP neither reads nor writes the topic
        if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            w[:, :realistic_moe.TOPIC_DIMS] = 0
        elif name.endswith("mlp.down_proj.weight"):
            w[:realistic_moe.TOPIC_DIMS] = 0
    return w


def target_weights(a, scale: float, rng: _Random) -> Dict[str, mx.array]:
    """mlx-lm's parameter names and shapes of the target, filled by rule (evaluated a layer at a
    time, so the model mlx-lm builds for the shapes is never materialised); the experts' stacks
    as HF's fused ``experts.gate_up_proj`` (gate rows first) and ``experts.down_proj``."""
    args = gemma4_text.ModelArgs.from_dict(text_config(a))
    shapes = {k: v.shape for k, v in tree_flatten(gemma4_text.Model(args).parameters())}
    vectors = None
    if a.moe:
        rng.key, k = mx.random.split(rng.key)
        vectors = realistic_moe.topic_vectors(a.vocab, k)
    out = {}
    for name, shape in shapes.items():
        w = _fill(name, shape, a, rng, vectors).astype(getattr(mx, a.dtype))
        mx.eval(w)
        out[name] = w
    set_scale_weights(out, a.layers, scale)
    for i in range(a.layers):
        p = f"model.layers.{i}.experts."
        if p + "switch_glu.gate_proj.weight" in out:
            gate, up = out.pop(p + "switch_glu.gate_proj.weight"), out.pop(
                p + "switch_glu.up_proj.weight")
            out[p + "gate_up_proj"] = mx.concatenate([gate, up], axis=-2)
            out[p + "down_proj"] = out.pop(p + "switch_glu.down_proj.weight")
            mx.eval(out[p + "gate_up_proj"])
    return out


def branch_norms(layer: int, scale: float) -> Dict[str, float]:
    """The post-branch norms' weights of a layer at residual scale ``scale``: the first layer's
    MLP branch ``FIRST_MLP_SCALE`` (its attention and experts perturb the embedding it reads by
    ``scale``); later branches ``scale`` relative to the stream that branch made."""
    if layer == 0:
        return {"post_attention_layernorm": scale,
                "post_feedforward_layernorm": FIRST_MLP_SCALE,
                "post_feedforward_layernorm_2": scale}
    return {"post_attention_layernorm": scale * FIRST_MLP_SCALE,
            "post_feedforward_layernorm": scale * FIRST_MLP_SCALE}


def set_scale_weights(weights: Dict[str, mx.array], layers: int, scale: float) -> None:
    """``branch_norms`` on a target's tensors by mlx-lm name (those present)."""
    for i in range(layers):
        for norm, value in branch_norms(i, scale).items():
            name = f"model.layers.{i}.{norm}.weight"
            if name in weights:
                w = weights[name]
                weights[name] = mx.full(w.shape, value, dtype=w.dtype)


def set_scale(lm, scale: float) -> None:
    """Set the residual scale of a loaded target (mlx-lm's ``gemma4_text.Model``) in place."""
    for i, layer in enumerate(lm.layers):
        for norm, value in branch_norms(i, scale).items():
            module = getattr(layer, norm, None)
            if module is not None:
                module.weight = mx.full(module.weight.shape, value, dtype=module.weight.dtype)


def assistant_weights(a, target: Dict[str, mx.array], rng: _Random) -> Dict[str, mx.array]:
    H = a.hidden
    dtype = getattr(mx, a.dtype)
    table = target["model.embed_tokens.weight"]
    w = {"pre_projection.weight": mx.concatenate([mx.eye(H), mx.zeros((H, H))], axis=1),
         "post_projection.weight": rng.normal((H, H), 1.0 / math.sqrt(H)),
         "model.embed_tokens.weight": table, "model.norm.weight": mx.ones((H,))}
    for i, kind in enumerate(assistant_config(a)["text_config"]["layer_types"]):
        hd = 2 * a.head_dim if kind == FULL else a.head_dim
        p = f"model.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            w[p + n + ".weight"] = mx.ones((H,))
        w[p + "layer_scalar"] = mx.ones((1,))
        w[p + "self_attn.q_proj.weight"] = rng.normal((a.heads * hd, H), 1.0 / math.sqrt(H))
        w[p + "self_attn.q_norm.weight"] = mx.ones((hd,))
        w[p + "self_attn.o_proj.weight"] = mx.zeros((H, a.heads * hd))
        if i == 0:  # the target's first MLP branch: what its tied head reads
            for n in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                      "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"):
                w[p + n] = target["model.layers.0." + n]
            continue
        w[p + "mlp.gate_proj.weight"] = rng.normal((a.intermediate, H), 1 / math.sqrt(H))
        w[p + "mlp.up_proj.weight"] = rng.normal((a.intermediate, H), 1 / math.sqrt(H))
        w[p + "mlp.down_proj.weight"] = mx.zeros((H, a.intermediate))
    w = {k: v.astype(dtype) for k, v in w.items()}
    mx.eval(w)
    return w


def write(out: Path, a, scale: float) -> Dict[str, mx.array]:
    """``out/target`` and ``out/assistant``; returns every tensor written (for the count)."""
    rng = _Random(a.seed)
    target = target_weights(a, scale, rng)
    assistant = assistant_weights(a, target, rng)
    for folder, weights, config in ((out / "target", target, text_config(a)),
                                    (out / "assistant", assistant, assistant_config(a))):
        folder.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(config, indent=1))
    return {**target, **{"assistant." + k: v for k, v in assistant.items()}}
