"""The Qwen3.5 / Qwen3.6 / Qwen3-Next MTP head (spec ``qwen3_5-mtp.md`` §1-2) and its drafter.

The head is one full-attention decoder layer of the target's own family, an ``fc`` (2H -> H) over
``[norm(embed(x_{p+1})), norm(h_p)]`` (embedding first), and a final norm. It borrows the target's
embedding and LM head and keeps its own KV cache, whose offset always equals the target's.
"""

from __future__ import annotations

from typing import List

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5 as _qwen3_5
from mlx_lm.models import qwen3_next as _qwen3_next
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

# Norm-weight suffixes that use the zero-centred (1 + w) convention in raw HF checkpoints.
ZERO_CENTRED_NORMS = (
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)


def is_zero_centred_norm(key: str) -> bool:
    """``key`` relative to the head (``fc.weight``, ``layers.0...``, ``norm.weight``)."""
    return key == "norm.weight" or key.endswith(ZERO_CENTRED_NORMS)


class MTPHead(nn.Module):
    def __init__(self, args, num_layers: int = 1):
        super().__init__()
        H = args.hidden_size
        layer_cls = (
            _qwen3_next.Qwen3NextDecoderLayer
            if isinstance(args, _qwen3_next.ModelArgs)
            else _qwen3_5.DecoderLayer
        )
        full_attn_idx = args.full_attention_interval - 1  # any such index builds full attention
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.layers = [layer_cls(args, layer_idx=full_attn_idx) for _ in range(num_layers)]
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: List[KVCache]) -> mx.array:
        """Post-norm head output ``g [1, S, H]``; ``lm_head(g[:, i])`` predicts x_{p_i + 2}."""
        x = mx.concatenate(
            [self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], axis=-1
        )
        x = self.fc(x)
        for layer, c in zip(self.layers, cache):
            x = layer(x, mask=create_attention_mask(x, c), cache=c)
        return self.norm(x)


class QwenMTPDrafter:
    """Drafts with the MTP head, recurrently: draft j > 1 feeds the head its own output.

    Accept hook (exact variant, spec §2.4): trim this round's approximate entries, then run the
    head over the accepted pairs with the target's true hidden states; that forward also yields
    the next round's first draft (the seed).
    """

    def __init__(self, head: MTPHead, target):
        self.head = head
        self.target = target
        self.reset()

    def reset(self) -> None:
        self.cache = [KVCache() for _ in self.head.layers]
        self.seed = None  # [1] id of x_{N+1}, on device
        self.seed_hidden = None  # [1, 1, H] head output that produced it
        self.seed_logits = None  # [1, V] its logits: draft_sampled draws the seed from them
        self.in_round = 0  # approximate cache entries appended by the current draft

    @property
    def offset(self) -> int:
        return self.cache[0].offset

    def _greedy(self, g: mx.array) -> mx.array:
        return mx.argmax(self.target.logits(g[:, -1]), axis=-1)  # [1]

    def prefill(self, hidden: mx.array, next_ids: mx.array) -> None:
        g = self.head(self.target.embed(next_ids[None]), hidden, self.cache)
        self.seed_hidden = g[:, -1:]
        self.seed_logits = self.target.logits(g[:, -1])
        self.seed = mx.argmax(self.seed_logits, axis=-1)

    def _draft(self, k: int, first: mx.array, pick) -> mx.array:
        # The ids stay on device: each one feeds the next embedding lookup directly.
        ids = [first]
        g = self.seed_hidden
        for _ in range(k - 1):
            g = self.head(self.target.embed(ids[-1][None]), g, self.cache)
            ids.append(pick(g))
        self.in_round = k - 1
        return mx.concatenate(ids)

    def draft(self, k: int) -> mx.array:
        return self._draft(k, self.seed, self._greedy)

    def draft_sampled(self, k: int, sample) -> mx.array:
        """Like ``draft``, but every id is drawn by ``sample`` (``mlx_mtp.sampling.DraftSampler``),
        which records the distribution q it was drawn from."""
        return self._draft(k, sample(self.seed_logits),
                           lambda g: sample(self.target.logits(g[:, -1])))

    def accept(self, hidden: mx.array, next_ids: mx.array) -> None:
        for c in self.cache:
            c.trim(self.in_round)
        self.in_round = 0
        self.prefill(hidden, next_ids)

    def state_arrays(self) -> list:
        out = [self.seed, self.seed_hidden]
        for c in self.cache:
            if c.keys is not None:
                out += [c.keys, c.values]
        return out
