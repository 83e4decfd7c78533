"""The Gemma 4 side of ``benchmarks.realistic_pair``: a random target and an assistant that agrees
with it the way the Qwen3.5 head does.

The target is a ``gemma4_text`` model in the 26B/31B layout (five sliding-window layers, then one
full-attention layer with K = V and one global KV head), untied LM head. Gemma 4 normalises each
residual branch before adding it (``post_attention_layernorm``, ``post_feedforward_layernorm``), so
the residual scale C is simply those norms' weight: the last hidden state is the current token's
scaled embedding plus a context-dependent perturbation of relative size about C, and the target
mostly maps token x to f(x) = argmax(lm_head . norm(embed(x))).

The assistant (``gemma4_assistant``, four layers as the published ones, as wide as the target: real
assistants are 1024 wide, and so is this target) computes f exactly: ``pre_projection`` = [I | 0] keeps the drafted
token's embedding and drops the recurrent state, its layers add nothing (zero ``o_proj`` and
``down_proj``; they still read the target's K/V, so a draft step costs what a real one does), and
its tied head is the target's LM head. A draft is then accepted where the context does not flip
the target's choice, about equally at every depth.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import gemma4_text

SLIDING, FULL = "sliding_attention", "full_attention"
ROPE = {FULL: {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
        SLIDING: {"rope_theta": 10000.0, "rope_type": "default"}}
POST_NORMS = ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")


def text_config(a) -> dict:
    return {
        "model_type": "gemma4_text", "hidden_size": a.hidden, "intermediate_size": a.intermediate,
        "num_hidden_layers": a.layers, "num_attention_heads": a.heads, "head_dim": a.head_dim,
        "global_head_dim": 2 * a.head_dim, "num_key_value_heads": a.kv_heads,
        "num_global_key_value_heads": 1, "attention_k_eq_v": True, "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": a.vocab,
        "use_double_wide_mlp": False, "enable_moe_block": False, "vocab_size": a.vocab,
        "sliding_window": a.sliding_window, "rope_parameters": ROPE,
        "layer_types": [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(a.layers)],
        "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "max_position_embeddings": 131072, "hidden_activation": "gelu_pytorch_tanh",
        "architectures": ["Gemma4ForCausalLM"], "eos_token_id": 0,
    }


def assistant_config(a) -> dict:
    text = {
        "model_type": "gemma4_text", "hidden_size": a.hidden, "num_hidden_layers": 4,
        "intermediate_size": a.assistant_intermediate, "num_attention_heads": a.heads,
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


def target_weights(a, scale: float, rng: _Random) -> Dict[str, mx.array]:
    """mlx-lm's parameter names and shapes of the target, filled by rule (evaluated a layer at a
    time, so the model mlx-lm builds for the shapes is never materialised)."""
    args = gemma4_text.ModelArgs.from_dict(text_config(a))
    shapes = {k: v.shape for k, v in tree_flatten(gemma4_text.Model(args).parameters())}
    out = {}
    for name, shape in shapes.items():
        if name == "model.embed_tokens.weight":  # times sqrt(H) on the way in: RMS 1
            w = rng.normal(shape, 1.0 / math.sqrt(a.hidden))
        elif name.endswith(POST_NORMS):
            w = mx.full(shape, scale)
        elif len(shape) == 1:  # the other norms and layer_scalar: weight 1 (used as is)
            w = mx.ones(shape)
        else:
            w = rng.normal(shape, 1.0 / math.sqrt(shape[-1]))
        out[name] = w
        mx.eval(w)
    return out


def set_scale(lm, scale: float) -> None:
    """Set the residual scale of a loaded target (mlx-lm's ``gemma4_text.Model``) in place."""
    for layer in lm.layers:
        for norm in (layer.post_attention_layernorm, layer.post_feedforward_layernorm):
            norm.weight = mx.full(norm.weight.shape, scale, dtype=norm.weight.dtype)


def assistant_weights(a, lm_head: mx.array, rng: _Random) -> Dict[str, mx.array]:
    H = a.hidden
    w = {"pre_projection.weight": mx.concatenate([mx.eye(H), mx.zeros((H, H))], axis=1),
         "post_projection.weight": rng.normal((H, H), 1.0 / math.sqrt(H)),
         "model.embed_tokens.weight": lm_head, "model.norm.weight": mx.ones((H,))}
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
        w[p + "mlp.gate_proj.weight"] = rng.normal((a.assistant_intermediate, H), 1 / math.sqrt(H))
        w[p + "mlp.up_proj.weight"] = rng.normal((a.assistant_intermediate, H), 1 / math.sqrt(H))
        w[p + "mlp.down_proj.weight"] = mx.zeros((H, a.assistant_intermediate))
    mx.eval(w)
    return w


def write(out: Path, a, scale: float) -> Dict[str, mx.array]:
    """``out/target`` and ``out/assistant``; returns every tensor written (for the count)."""
    rng = _Random(a.seed)
    target = target_weights(a, scale, rng)
    assistant = assistant_weights(a, target["lm_head.weight"], rng)
    for folder, weights, config in ((out / "target", target, text_config(a)),
                                    (out / "assistant", assistant, assistant_config(a))):
        folder.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(config, indent=1))
    return {**target, **{"assistant." + k: v for k, v in assistant.items()}}
