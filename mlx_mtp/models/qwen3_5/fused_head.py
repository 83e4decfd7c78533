"""``FusedHead``: the MTP head with its small products merged (the pre-``fc`` norms as one, q/k/v
and the output gate as one product, the MLP's gate and up as one), fewer ops per draft step, on
copies of the weights taken when the drafter is built; the head's own modules stay as they are.
It computes what ``MTPHead`` computes up to rounding. docs/models.md, "How the compiled draft
step works"."""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.qwen3_next import Qwen3NextAttention, Qwen3NextMLP

from mlx_mtp.models.qwen3_5 import drafter_products


def _plain(*linears) -> bool:
    return all(type(m) is nn.Linear and "bias" not in m for m in linears)


def fusable(head) -> bool:
    """Whether every layer is the dense attention + MLP layer this module rearranges (not
    quantized, no biases, no mixture of experts)."""
    if not _plain(head.fc):
        return False
    for layer in head.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if type(attn) is not Qwen3NextAttention or type(mlp) is not Qwen3NextMLP:
            return False
        if not _plain(attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                      mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            return False
    return True


def _rms(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """RMSNorm with a weight of any broadcastable shape (the normalisation is the same op)."""
    return mx.fast.rms_norm(x, None, eps) * weight


class FusedLayer(nn.Module):
    def __init__(self, layer, row_kernel: bool = False, bf16: bool = False):
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        nh, nkv, hd = attn.num_attention_heads, attn.num_key_value_heads, attn.head_dim
        self.nh, self.nkv, self.hd, self.scale = nh, nkv, hd, attn.scale
        self.rope = attn.rope
        self.in_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        # q_proj's rows are [head][query | gate][hd]: split them into query rows and gate rows.
        qg = attn.q_proj.weight.reshape(nh, 2, hd, -1)
        rows = [qg[:, 0].reshape(nh * hd, -1), attn.k_proj.weight,
                qg[:, 1].reshape(nh * hd, -1), attn.v_proj.weight]
        self.w_qkvg = mx.concatenate(rows, axis=0)
        self.w_qk_norm = mx.concatenate(
            [mx.broadcast_to(attn.q_norm.weight, (nh, hd)),
             mx.broadcast_to(attn.k_norm.weight, (nkv, hd))], axis=0)
        self.eps_qk = attn.q_norm.eps
        self.w_o = attn.o_proj.weight
        self.inter = mlp.gate_proj.weight.shape[0]
        self.w_gu = mx.concatenate([mlp.gate_proj.weight, mlp.up_proj.weight], axis=0)
        self.w_down = mlp.down_proj.weight
        # x @ W.T of each product: the BLAS, the row kernel or the bf16 kernel
        # (``drafter_products``)
        self.mm_qkvg, self.mm_o, self.mm_gu, self.mm_down = (
            drafter_products.matmul_for(w, row_kernel, bf16)
            for w in (self.w_qkvg, self.w_o, self.w_gu, self.w_down))
        if bf16:  # the products read bfloat16 copies: the merged float32 matrices are not kept
            del self.w_qkvg, self.w_gu

    def __call__(self, x: mx.array, mask: Optional[mx.array], cache) -> mx.array:
        B, L, _ = x.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        y = self.mm_qkvg(self.in_norm(x))
        qk_end, gate_end = (nh + nkv) * hd, (2 * nh + nkv) * hd
        qk = y[..., :qk_end].reshape(B, L, nh + nkv, hd)
        qk = _rms(qk, self.w_qk_norm, self.eps_qk).transpose(0, 2, 1, 3)
        qk = self.rope(qk, offset=cache.offset)
        queries, keys = qk[:, :nh], qk[:, nh:]
        gate = y[..., qk_end:gate_end]
        values = y[..., gate_end:].reshape(B, L, nkv, hd).transpose(0, 2, 1, 3)
        keys, values = cache.update_and_fetch(keys, values)
        out = scaled_dot_product_attention(queries, keys, values, cache=cache,
                                           scale=self.scale, mask=mask)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        h = x + self.mm_o(out * mx.sigmoid(gate))
        gu = self.mm_gu(self.post_norm(h))
        return h + self.mm_down(nn.silu(gu[..., :self.inter]) * gu[..., self.inter:])


class FusedHead(nn.Module):
    """Called like ``MTPHead``: ``head(embeds, hidden, caches) -> g``. ``row_kernel``: its
    products through the row kernel where the weights fit; ``bf16``: through the bf16 kernel on
    bfloat16 copies of the weights (``drafter_products``)."""

    def __init__(self, head, row_kernel: bool = False, bf16: bool = False):
        super().__init__()
        self.pre_norm = mx.stack([head.pre_fc_norm_embedding.weight,
                                  head.pre_fc_norm_hidden.weight])
        self.eps = head.pre_fc_norm_embedding.eps
        self.w_fc = head.fc.weight
        self.mm_fc = drafter_products.matmul_for(self.w_fc, row_kernel, bf16)
        self.layers = [FusedLayer(layer, row_kernel, bf16) for layer in head.layers]
        self.norm = head.norm
        mx.eval(self.parameters())

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: List) -> mx.array:
        B, L, H = embeds.shape
        x = _rms(mx.stack([embeds, hidden], axis=-2), self.pre_norm, self.eps)
        x = self.mm_fc(x.reshape(B, L, 2 * H))
        for layer, c in zip(self.layers, cache):
            x = layer(x, mask=create_attention_mask(x, c), cache=c)
        return self.norm(x)
