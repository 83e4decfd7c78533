"""The demo pair's trainer side: Hugging Face's own ``Qwen3_5ForCausalLM`` (the reference
implementation of the architecture) with a faster chunked gated-delta rule, and the MTP head.

Only the GatedDeltaNet chunk kernel is replaced: transformers' CPU fallback solves the per-chunk
unit-lower-triangular system with ``torch.linalg.solve_triangular``, which is slow for thousands
of tiny batched systems on CPU. Here the inverse is built from the nilpotent series
``(I + N)^-1 = (I - N)(I + N^2)(I + N^4)...`` (exact: N^C = 0 for a C x C strictly lower N), a
handful of batched matmuls. Everything else is transformers' code, so the trained weights are
HF-layout by construction; ``export.py`` checks mlx-lm's logits against this model's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

CHUNK = 32  # 5 squarings; entries of N are bounded by 1 (unit keys, beta < 1, decays <= 1)


def _unit_lower_inverse(strict: torch.Tensor) -> torch.Tensor:
    """(I + strict)^-1 for a strictly lower-triangular ``strict`` [..., C, C]."""
    C = strict.shape[-1]
    eye = torch.eye(C, dtype=strict.dtype, device=strict.device)
    inv = eye - strict
    power = strict
    for _ in range(max(1, math.ceil(math.log2(C))) - 1):
        power = power @ power
        inv = inv @ (eye + power)
    return inv


def fast_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=CHUNK, initial_state=None,
                                output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
    """Same contract as ``transformers...torch_chunk_gated_delta_rule`` (B, T, H, D inputs)."""
    dtype = query.dtype
    B, T, Hk, Dk = key.shape
    Hv, Dv = value.shape[-2:]
    if Hk != Hv:
        query = query.repeat_interleave(Hv // Hk, dim=2)
        key = key.repeat_interleave(Hv // Hk, dim=2)
    query, key, value, beta, g = [x.transpose(1, 2).float() for x in (query, key, value, beta, g)]
    if use_qk_l2norm_in_kernel:
        query = hf.l2norm(query, dim=-1, eps=1e-6)
        key = hf.l2norm(key, dim=-1, eps=1e-6)
    query = query * Dk ** -0.5
    C = chunk_size
    pad = (C - T % C) % C
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    n = (T + pad) // C
    v_beta = value * beta[..., None]
    k_beta = key * beta[..., None]
    query, key, k_beta, v_beta = (x.reshape(B, Hv, n, C, -1) for x in (query, key, k_beta, v_beta))
    cum = g.reshape(B, Hv, n, C).cumsum(-1)
    lower = torch.ones(C, C, dtype=torch.bool, device=query.device).tril()
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    strict = ((k_beta @ key.transpose(-1, -2)) * pair).tril(-1)
    inv = _unit_lower_inverse(strict)
    new_values = inv @ v_beta
    k_cumdecay = inv @ (k_beta * cum.exp()[..., None])
    attn = (query @ key.transpose(-1, -2)) * pair
    state = (torch.zeros(B, Hv, Dk, Dv, dtype=torch.float32, device=query.device)
             if initial_state is None else initial_state.float())
    q_dec = query * cum.exp()[..., None]
    k_dec = key * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    outs = []
    for i in range(n):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        outs.append(q_dec[:, :, i] @ state + attn[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k_dec[:, :, i].transpose(-1, -2) @ v_new
    out = torch.stack(outs, 2).reshape(B, Hv, -1, Dv)[:, :, :T]
    return out.transpose(1, 2).contiguous().to(dtype), (state if output_final_state else None)


def install_fast_gdn() -> None:
    hf.torch_chunk_gated_delta_rule = fast_chunk_gated_delta_rule


# The demo target's text config, as it appears under ``text_config`` in the shipped config.json.
# Deep and narrow like the real models; every projection's input width is <= 512 and every output a
# multiple of 8, so a BLIS verify stays row-invariant without row-by-row fallbacks (README).
TEXT_CONFIG = {
    "model_type": "qwen3_5_text", "vocab_size": 8192, "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 16, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "attn_output_gate": True, "attention_bias": False,
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 32,
    "linear_num_key_heads": 2, "linear_num_value_heads": 8, "full_attention_interval": 4,
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(16)],
    "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
    "tie_word_embeddings": True, "mamba_ssm_dtype": "float32", "eos_token_id": 0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                        "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                        "mrope_section": [2, 1, 1]},
}


def target_config():
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(**{k: v for k, v in TEXT_CONFIG.items() if k != "model_type"})
    cfg._attn_implementation = "sdpa"
    return cfg


class MTPHead(torch.nn.Module):
    """The Qwen3.5 MTP head, built from transformers' own layers so
    its ``state_dict`` names are the raw checkpoint's ``mtp.*`` names without the prefix.

    ``step`` runs the head over a whole sequence of (token, hidden) pairs at once, with explicit
    positions and extra keys, so training can reproduce what a drafting round attends to.
    """

    def __init__(self, config, init_layer=None):
        super().__init__()
        H = config.hidden_size
        self.config = config
        self.fc = torch.nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = hf.Qwen3_5RMSNorm(H, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = hf.Qwen3_5RMSNorm(H, eps=config.rms_norm_eps)
        full = config.layer_types.index("full_attention")
        self.layers = torch.nn.ModuleList([hf.Qwen3_5DecoderLayer(config, layer_idx=full)])
        self.norm = hf.Qwen3_5RMSNorm(H, eps=config.rms_norm_eps)
        self.rotary = hf.Qwen3_5TextRotaryEmbedding(config)
        with torch.no_grad():
            # Start as "the hidden state, through one more target layer": fc picks the hidden half.
            self.fc.weight.zero_()
            self.fc.weight[:, H:] = torch.eye(H)
            self.fc.weight[:, :H].normal_(0, 0.02)
            if init_layer is not None:
                self.layers[0].load_state_dict(init_layer.state_dict())

    def step(self, embeds, hidden, positions, past, mask):
        """embeds, hidden [B, N, H]; positions [N]; past: list of (k, v) of earlier steps;
        mask [N, N_past + N] bool (True = attend). Returns (g [B, N, H], (k, v))."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds),
                               self.pre_fc_norm_hidden(hidden)], dim=-1))
        layer = self.layers[0]
        attn = layer.self_attn
        B, N, _ = x.shape
        hd = attn.head_dim
        h = layer.input_layernorm(x)
        q, gate = torch.chunk(attn.q_proj(h).view(B, N, -1, 2 * hd), 2, dim=-1)
        gate = gate.reshape(B, N, -1)
        q = attn.q_norm(q).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(h).view(B, N, -1, hd)).transpose(1, 2)
        v = attn.v_proj(h).view(B, N, -1, hd).transpose(1, 2)
        cos, sin = self.rotary(h, positions.view(1, 1, -1).expand(3, B, -1))
        q, k = hf.apply_rotary_pos_emb(q, k, cos, sin)
        keys = torch.cat([pk for pk, _ in past] + [k], dim=2)
        values = torch.cat([pv for _, pv in past] + [v], dim=2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=hd ** -0.5,
                                             enable_gqa=True)
        out = out.transpose(1, 2).reshape(B, N, -1) * torch.sigmoid(gate)
        x = x + attn.o_proj(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x), (k, v)

    def recurrent(self, embed, hidden, tokens, steps):
        """Step s = 1..steps over bases p = 0..N-1, as drafting round s would see them.

        Step 1 pairs (x_{p+1}, h_p) at position p and attends to step-1 pairs 0..p (the accepted,
        true-hidden entries). Step s > 1 pairs (x_{p+s}, g^{s-1}_p) at position p+s-1 and
        attends to step-1 entries 0..p plus its own base's entries of steps 2..s. ``tokens``
        [B, N+steps]; ``hidden`` [B, N, H]. Returns [g^1, ..., g^steps], each [B, N, H].
        """
        B, N, _ = hidden.shape
        dev = hidden.device
        idx = torch.arange(N, device=dev)
        causal = idx[None, :] <= idx[:, None]
        own = torch.eye(N, dtype=torch.bool, device=dev)
        outs, past, g = [], [], hidden
        for s in range(1, steps + 1):
            mask = torch.cat([causal] + [own] * (s - 1), dim=1)
            g, kv = self.step(embed(tokens[:, s:s + N]), g, idx + (s - 1), past, mask)
            past.append(kv)
            outs.append(g)
        return outs
