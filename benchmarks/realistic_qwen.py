"""The Qwen side of ``benchmarks.realistic_pair``: random tensors in the raw Hugging Face layouts
of Qwen3.5 / 3.6 (``model.language_model.*``; with ``--moe`` the MoE layout: fused
``experts.gate_up_proj`` / ``experts.down_proj`` stacks, a router ``mlp.gate``, a shared expert
with its gate, and an MoE layer in the MTP head) and of Qwen3-Next (``model.*``, its own
GatedDeltaNet projections, per-expert tensors ``experts.{e}.gate_proj`` ...), with the top-level
``mtp.*`` head. The residual scale C multiplies every branch's output weights; the head is wired to
compute the target's map f (its ``fc`` keeps the drafted token's embedding, its layer outputs
nothing, it borrows the LM head). MoE pairs get topics and routers with locality
(``benchmarks.realistic_moe``).
"""

from __future__ import annotations

import math
from typing import Dict, List

import mlx.core as mx

from benchmarks import realistic_moe, realistic_zipf

ROPE = {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
        "mrope_interleaved": True, "mrope_section": [11, 11, 10]}


def layer_types(a) -> List[str]:
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(a.layers)]


def text_config(a) -> dict:
    """The Qwen3.5 text config (``qwen3_5_text``, or ``qwen3_5_moe_text`` with ``--moe``)."""
    text = {
        "model_type": "qwen3_5_moe_text" if a.moe else "qwen3_5_text", "vocab_size": a.vocab,
        "hidden_size": a.hidden,
        "intermediate_size": a.intermediate, "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads, "head_dim": a.head_dim,
        "attn_output_gate": True, "attention_bias": False, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": a.linear_key_dim, "linear_value_head_dim": a.linear_value_dim,
        "linear_num_key_heads": a.linear_key_heads, "linear_num_value_heads": a.linear_value_heads,
        "full_attention_interval": 4, "layer_types": layer_types(a), "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False, "tie_word_embeddings": False,
        "mamba_ssm_dtype": "float32", "rope_parameters": dict(ROPE),
    }
    if a.moe:
        text.update(_moe_fields(a))
    return text


def _moe_fields(a) -> dict:
    return {"num_experts": a.experts, "num_experts_per_tok": a.top_k,
            "moe_intermediate_size": a.expert_width,
            "shared_expert_intermediate_size": a.shared_width, "norm_topk_prob": True}


def config(a) -> dict:
    """The checkpoint's ``config.json``."""
    if a.family == "qwen3_next":
        return {
            "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
            "hidden_size": a.hidden, "num_hidden_layers": a.layers,
            "intermediate_size": a.intermediate, "num_attention_heads": a.heads,
            "num_key_value_heads": a.kv_heads, "head_dim": a.head_dim,
            "linear_num_value_heads": a.linear_value_heads,
            "linear_num_key_heads": a.linear_key_heads, "linear_key_head_dim": a.linear_key_dim,
            "linear_value_head_dim": a.linear_value_dim, "linear_conv_kernel_dim": 4,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
            "vocab_size": a.vocab, "rope_theta": ROPE["rope_theta"],
            "partial_rotary_factor": ROPE["partial_rotary_factor"],
            "max_position_embeddings": 32768, "tie_word_embeddings": False,
            "full_attention_interval": 4, "eos_token_id": 0, **_moe_fields(a)}
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration" if a.moe
                              else "Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5_moe" if a.moe else "qwen3_5",
            "tie_word_embeddings": False, "eos_token_id": 0, "text_config": text_config(a)}


class Weights:
    """Random tensors in the raw Hugging Face layout, from one seed (the dense Qwen3.5 pair's
    draws come in the same order whatever MoE code exists beside them)."""

    def __init__(self, a, scale: float):
        self.a, self.c = a, scale
        self.key = mx.random.key(a.seed)
        self.w: Dict[str, mx.array] = {}
        self.next = a.family == "qwen3_next"
        self.prefix = "model." if self.next else "model.language_model."
        self.dtype = getattr(mx, a.dtype)

    def normal(self, shape, std):
        self.key, k = mx.random.split(self.key)
        return mx.random.normal(shape, key=k) * std

    def linear(self, name, out_features, in_features, mult=1.0):
        self.w[name] = self.normal((out_features, in_features), mult / math.sqrt(in_features))

    def zeros(self, name, n):  # a zero-centred norm's stored weight: gamma 1
        self.w[name] = mx.zeros((n,))

    def attention(self, p, out_mult):
        a = self.a
        self.linear(p + "self_attn.q_proj.weight", 2 * a.heads * a.head_dim, a.hidden)
        self.linear(p + "self_attn.k_proj.weight", a.kv_heads * a.head_dim, a.hidden)
        self.linear(p + "self_attn.v_proj.weight", a.kv_heads * a.head_dim, a.hidden)
        self.linear(p + "self_attn.o_proj.weight", a.hidden, a.heads * a.head_dim, out_mult)
        self.zeros(p + "self_attn.q_norm.weight", a.head_dim)
        self.zeros(p + "self_attn.k_norm.weight", a.head_dim)

    def gated_delta_net(self, p):
        a = self.a
        kd, vd = a.linear_key_heads * a.linear_key_dim, a.linear_value_heads * a.linear_value_dim
        if self.next:  # Qwen3-Next: q, k, v and z in one projection, b and a in another
            self.linear(p + "linear_attn.in_proj_qkvz.weight", 2 * kd + 2 * vd, a.hidden)
            self.linear(p + "linear_attn.in_proj_ba.weight", 2 * a.linear_value_heads, a.hidden)
        else:
            self.linear(p + "linear_attn.in_proj_qkv.weight", 2 * kd + vd, a.hidden)
            self.linear(p + "linear_attn.in_proj_z.weight", vd, a.hidden)
            self.linear(p + "linear_attn.in_proj_b.weight", a.linear_value_heads, a.hidden)
            self.linear(p + "linear_attn.in_proj_a.weight", a.linear_value_heads, a.hidden)
        self.w[p + "linear_attn.conv1d.weight"] = self.normal((2 * kd + vd, 1, 4), 0.3)
        self.key, k = mx.random.split(self.key)
        self.w[p + "linear_attn.A_log"] = mx.log(
            mx.random.uniform(1, 16, (a.linear_value_heads,), key=k))
        self.w[p + "linear_attn.dt_bias"] = mx.ones((a.linear_value_heads,))
        self.w[p + "linear_attn.norm.weight"] = mx.ones((a.linear_value_dim,))
        self.linear(p + "linear_attn.out_proj.weight", a.hidden, vd, self.c)

    def mlp(self, p, out_mult):
        a = self.a
        self.linear(p + "mlp.gate_proj.weight", a.intermediate, a.hidden)
        self.linear(p + "mlp.up_proj.weight", a.intermediate, a.hidden)
        self.linear(p + "mlp.down_proj.weight", a.hidden, a.intermediate, out_mult)

    def moe(self, p, out_mult):
        """The sparse MoE block: router, routed experts (fused stacks, or per expert for
        Qwen3-Next), shared expert and its gate; ``out_mult`` on both down projections."""
        a = self.a
        H, E, I = a.hidden, a.experts, a.expert_width
        self.key, k = mx.random.split(self.key)
        self.w[p + "mlp.gate.weight"] = realistic_moe.router(E, H, a.router_locality, k)
        gate_up = self.normal((E, 2 * I, H), 1 / math.sqrt(H)).astype(self.dtype)
        down = (self.normal((E, H, I), out_mult / math.sqrt(I))).astype(self.dtype)
        mx.eval(gate_up, down)
        if self.next:
            for e in range(E):
                q = f"{p}mlp.experts.{e}."
                self.w[q + "gate_proj.weight"] = gate_up[e, :I]
                self.w[q + "up_proj.weight"] = gate_up[e, I:]
                self.w[q + "down_proj.weight"] = down[e]
        else:
            self.w[p + "mlp.experts.gate_up_proj"] = gate_up
            self.w[p + "mlp.experts.down_proj"] = down
        self.linear(p + "mlp.shared_expert.gate_proj.weight", a.shared_width, H)
        self.linear(p + "mlp.shared_expert.up_proj.weight", a.shared_width, H)
        self.linear(p + "mlp.shared_expert.down_proj.weight", H, a.shared_width, out_mult)
        self.linear(p + "mlp.shared_expert_gate.weight", 1, H)

    def feed_forward(self, p, out_mult):
        (self.moe if self.a.moe else self.mlp)(p, out_mult)

    def embeddings(self):
        """The input embedding and the LM head; with MoE, each id's topic in ``TOPIC_DIMS``
        coordinates of both (``realistic_moe``)."""
        a = self.a
        embed = self.normal((a.vocab, a.hidden), 1.0)
        if a.moe:
            self.key, k = mx.random.split(self.key)
            vectors = realistic_moe.topic_vectors(a.vocab, k)
            embed = realistic_moe.with_topics(embed, vectors, 1.0)
        self.w[self.prefix + "embed_tokens.weight"] = embed
        return vectors if a.moe else None

    def build(self) -> Dict[str, mx.array]:
        a, c = self.a, self.c
        types = layer_types(a)
        vectors = self.embeddings()
        for i, kind in enumerate(types):
            p = f"{self.prefix}layers.{i}."
            self.zeros(p + "input_layernorm.weight", a.hidden)
            self.zeros(p + "post_attention_layernorm.weight", a.hidden)
            if kind == "full_attention":
                self.attention(p, c)
            else:
                self.gated_delta_net(p)
            self.feed_forward(p, c)
            self._settle()
        self.zeros(self.prefix + "norm.weight", a.hidden)
        self.linear("lm_head.weight", a.vocab, a.hidden)
        if vectors is not None:
            self.w["lm_head.weight"] = realistic_moe.with_topics(
                self.w["lm_head.weight"], vectors,
                realistic_moe.TOPIC_BOOST / realistic_moe.TOPIC_DIMS)
        # The head computes f(x): fc keeps the drafted token's embedding, its layer adds nothing.
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            self.zeros(f"mtp.{n}.weight", a.hidden)
        self.w["mtp.fc.weight"] = mx.concatenate(
            [mx.eye(a.hidden), mx.zeros((a.hidden, a.hidden))], axis=1)
        p = "mtp.layers.0."
        self.zeros(p + "input_layernorm.weight", a.hidden)
        self.zeros(p + "post_attention_layernorm.weight", a.hidden)
        self.attention(p, 0.0)
        self.feed_forward(p, 0.0)
        self._settle()
        if a.zipf is not None:
            self.key, k = mx.random.split(self.key)
            realistic_zipf.apply(self.w, a, types, a.zipf, k)
        return self.w

    def _settle(self) -> None:
        """Evaluate what is built so far, in the checkpoint's dtype (one layer's tensors at a
        time: the full-size float32 model never sits in memory)."""
        for k, v in self.w.items():
            if v.dtype != self.dtype and mx.issubdtype(v.dtype, mx.floating):
                self.w[k] = v.astype(self.dtype)
        mx.eval(self.w)
