"""The Gemma 4 assistant (``gemma4_assistant`` / ``gemma4_unified_assistant``) and its drafter.

A separate small checkpoint: a stack of Q-only Gemma 4 decoder layers (no k/v projections, no KV
cache of its own) whose attention reads the target's K/V (the last own-KV target layer of each layer
type). One draft step:

    x  = pre_projection([embed_tgt(tok) * sqrt(H_tgt), h])    # h: target post-norm hidden, or
    x  = layers(x, target K/V, RoPE at a constant position)   #    the previous step's state
    hn = norm(x);  h' = post_projection(hn)                    # h' feeds the next step
    next token = argmax(hn @ E_assistant^T)                    # own tied head, no softcap
                 (E2B/E4B: over the candidates of the top-k centroid clusters only)

Drafting k tokens is k forwards, all at the same query position; nothing to undo after a
verify, so the accept hook only keeps (bonus, hidden) and re-arms the K/V views.
"""

from __future__ import annotations

import copy
from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma4_text as _gemma4_text

from mlx_mtp.errors import MTPError
from mlx_mtp import draft_tree
from mlx_mtp.models.protocols import DrafterDefaults

QUERY_POSITIONS = ("last_kv", "bonus")
DEFAULT_QUERY_POSITION = "last_kv"  # p - 1, as vLLM and mlx-vlm


def assistant_text_args(config: dict) -> _gemma4_text.ModelArgs:
    """The assistant's layer args: every layer is KV-shared (HF's ``__post_init__``)."""
    text = copy.deepcopy(config.get("text_config") or {})
    text["num_kv_shared_layers"] = text.get("num_hidden_layers", 4)
    return _gemma4_text.ModelArgs.from_dict(text)


class MaskedEmbedder(nn.Module):
    """E2B/E4B centroid head: score ``num_centroids`` clusters, keep the top ``top_k``, and rank
    only their tokens (``token_ordering`` lists the vocabulary cluster by cluster)."""

    def __init__(self, hidden_size: int, num_centroids: int, top_k: int, vocab_size: int):
        super().__init__()
        self.centroids = nn.Linear(hidden_size, num_centroids, bias=False)
        self.num_centroids = num_centroids
        self.top_k = top_k
        # A buffer, not a parameter (the leading underscore keeps it out of parameters()).
        self._token_ordering = mx.arange(vocab_size, dtype=mx.int32)

    def set_token_ordering(self, ordering: mx.array) -> None:
        self._token_ordering = ordering.astype(mx.int32)

    def candidates(self, hn: mx.array) -> mx.array:
        """Token ids ``[..., top_k * V / C]`` of the best ``top_k`` clusters for ``hn [..., H]``."""
        scores = self.centroids(hn)
        top = mx.argpartition(-scores, kth=self.top_k - 1, axis=-1)[..., : self.top_k]
        ids = self._token_ordering.reshape(self.num_centroids, -1)[top]
        return ids.reshape(*ids.shape[:-2], -1)

    def scores(self, hn: mx.array, embed: nn.Module) -> Tuple[mx.array, mx.array]:
        """(candidate ids, their logits ``hn . E[id]``)."""
        ids = self.candidates(hn)
        sel = (embed(ids) @ hn[..., None])[..., 0]
        return ids, sel

    def argmax(self, hn: mx.array, embed: nn.Module) -> mx.array:
        ids, sel = self.scores(hn, embed)
        return mx.take_along_axis(ids, mx.argmax(sel, axis=-1, keepdims=True), axis=-1)[..., 0]

    def logits(self, hn: mx.array, embed: nn.Module, vocab_size: int) -> mx.array:
        """Full-vocabulary logits for sampling: -inf outside the candidates (HF's ``min - 1``
        fill would leave probability on the tokens the head never ranked)."""
        ids, sel = self.scores(hn, embed)
        full = mx.full((*sel.shape[:-1], vocab_size), -mx.inf, dtype=sel.dtype)
        return mx.put_along_axis(full, ids, sel, axis=-1)


class AssistantStack(nn.Module):
    """``model.*`` of the checkpoint: the assistant's own (tied) embedding, layers, final norm."""

    def __init__(self, args: _gemma4_text.ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        # mlx-lm's DecoderLayer with num_kv_shared_layers == num_hidden_layers: Q-only attention
        # (scale 1.0, q_norm, the target's RoPE per layer type), plain MLP, layer_scalar.
        self.layers = [_gemma4_text.DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Gemma4Assistant(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        self.args = assistant_text_args(config)
        H, Bh = self.args.hidden_size, config["backbone_hidden_size"]
        self.pre_projection = nn.Linear(2 * Bh, H, bias=False)
        self.post_projection = nn.Linear(H, Bh, bias=False)
        self.model = AssistantStack(self.args)
        if config.get("use_ordered_embeddings"):
            self.masked_embedding = MaskedEmbedder(
                H, config.get("num_centroids", 2048), config.get("centroid_intermediate_top_k", 32),
                self.args.vocab_size)

    def __call__(self, embeds: mx.array, hidden: mx.array,
                 shared_kv: Dict[str, Tuple[mx.array, mx.array]], position) -> Tuple[mx.array, mx.array]:
        """One step for ``embeds``/``hidden [B, 1, Bh]``: (normed output ``hn [B, 1, H]``, next
        recurrent state ``[B, 1, Bh]``). ``shared_kv`` holds exactly the keys to attend to."""
        x = self.pre_projection(mx.concatenate([embeds, hidden], axis=-1))
        for layer in self.model.layers:
            x, _, _ = layer(x, None, None, shared_kv=shared_kv[layer.layer_type], offset=position)
        hn = self.model.norm(x)
        return hn, self.post_projection(hn)

    def argmax(self, hn: mx.array) -> mx.array:
        """The head's argmax ``[B, L]`` (never materialises the full logits for the centroid head)."""
        if "masked_embedding" in self:
            return self.masked_embedding.argmax(hn, self.model.embed_tokens)
        return mx.argmax(self.model.embed_tokens.as_linear(hn), axis=-1)

    def logits(self, hn: mx.array) -> mx.array:
        """Full-vocabulary logits (no softcap)."""
        if "masked_embedding" in self:
            return self.masked_embedding.logits(hn, self.model.embed_tokens, self.args.vocab_size)
        return self.model.embed_tokens.as_linear(hn)


def check_query_position(value) -> str:
    if value not in QUERY_POSITIONS:
        raise MTPError(f"query_position must be one of {', '.join(QUERY_POSITIONS)}, "
                       f"got {value!r}")
    return value


class Gemma4AssistantDrafter(DrafterDefaults):
    """The drafter protocol (``mlx_mtp.models.protocols``) over the assistant.

    ``query_position``: the constant RoPE position of every draft query in a round, for ``p``
    committed positions: ``"last_kv"`` = p - 1 (default; vLLM, mlx-vlm) or ``"bonus"`` = p (HF).
    Either keeps the output exact; only acceptance may differ. ``bf16``: whether the assistant's
    products run on bfloat16 copies (``bf16_assistant.use_bf16`` did it; reported by
    ``describe``).
    """

    def __init__(self, assistant: Gemma4Assistant, target, query_position: str = DEFAULT_QUERY_POSITION,
                 bf16: bool = False):
        self.assistant = assistant
        self.target = target
        self.bf16 = bf16
        self.query_position = query_position
        self.cache = None
        self.reset()

    @property
    def query_position(self) -> str:
        return self._query_position

    @query_position.setter
    def query_position(self, value: str) -> None:
        self._query_position = check_query_position(value)

    def bind_cache(self, cache: list) -> None:
        """The round loop hands over the target's live cache: the assistant reads its K/V."""
        self.cache = cache

    def reset(self) -> None:
        self.bonus: Optional[mx.array] = None  # [1] token at position p, not yet in the target
        self.hidden: Optional[mx.array] = None  # [1, 1, H] target post-norm hidden at p - 1
        self.position: Optional[int] = None
        self.shared_kv = None

    def _rearm(self, hidden: mx.array, next_ids: mx.array) -> None:
        """Keep the newest (hidden, token) pair and re-point at the target's committed K/V."""
        if self.cache is None:
            raise RuntimeError("Gemma4AssistantDrafter needs the target cache: call bind_cache")
        self.hidden = hidden[:, -1:]
        self.bonus = next_ids[-1:]
        p = self.target.offset(self.cache)
        self.position = p - 1 if self.query_position == "last_kv" else p
        self.shared_kv = self.target.shared_kv(self.cache, self.position)

    def prefill(self, hidden: mx.array, next_ids: mx.array) -> None:
        self._rearm(hidden, next_ids)

    def accept(self, hidden: mx.array, next_ids: mx.array) -> None:
        # No forward here: the assistant has no cache to extend.
        self._rearm(hidden, next_ids)

    def _draft(self, k: int, pick) -> mx.array:
        # Ids stay on the device: each one feeds the next embedding lookup directly.
        tok, h, ids = self.bonus, self.hidden, []
        for _ in range(k):
            hn, h = self.assistant(self.target.embed(tok[None]), h, self.shared_kv, self.position)
            tok = pick(hn[:, -1]).astype(mx.uint32)  # [1]
            ids.append(tok)
        return mx.concatenate(ids)

    def draft(self, k: int) -> mx.array:
        return self._draft(k, self.assistant.argmax)

    def draft_tree(self, topk: int, nodes: int, depth: int,
                   process=None) -> draft_tree.DraftTree:
        """A tree of at most ``nodes`` drafts and ``depth`` levels after the bonus
        (``draft_tree.TreeSearch``): the ``topk`` best children of each expanded node by the
        assistant's log-probabilities (over the centroid head's candidates where it has one);
        at each depth the ``topk`` children of highest path probability are expanded, one
        assistant step over all of them as a batch (every step attends to the same committed
        K/V at the same position, so the nodes need no mask); the best ``nodes`` are kept.
        ``process(logits, paths)``: the request's logits processors over each expansion's rows
        first."""
        search = draft_tree.TreeSearch(topk, process=process)
        hn, h = self.assistant(self.target.embed(self.bonus[None]), self.hidden, self.shared_kv,
                               self.position)
        state = {search.ROOT: h}
        frontier = search.expand(self.assistant.logits(hn[:, -1]), [search.ROOT], 1)
        for d in range(2, depth + 1):
            n = len(frontier)
            ids = mx.array([search.token(f) for f in frontier], dtype=mx.uint32)
            hidden = mx.concatenate([state[search.parent(f)] for f in frontier], axis=0)
            shared = {t: tuple(mx.broadcast_to(x, (n, *x.shape[1:])) for x in kv)
                      for t, kv in self.shared_kv.items()}
            hn, h = self.assistant(self.target.embed(ids[:, None]), hidden, shared, self.position)
            for r, f in enumerate(frontier):
                state[f] = h[r : r + 1]
            frontier = search.expand(self.assistant.logits(hn[:, -1]), frontier, d)
        self.syncs += search.reads
        return search.select(nodes)

    def draft_sampled(self, k: int, sample) -> mx.array:
        """Like ``draft``, each id picked by ``sample(logits [1, V])`` (the sampling drafter
        protocol: a draw, or the argmax after logits processors): full-vocabulary logits, -inf
        outside the centroid head's candidates."""
        return self._draft(k, lambda hn: sample(self.assistant.logits(hn)))

    # -- prompt caches across turns: nothing of its own to carry (it reads the target's K/V) --

    def carry(self) -> list:
        return []

    def resume(self, carried: list) -> None:
        self.reset()

    def rewind(self, n: int) -> None:
        """Nothing to undo: the next prefill re-arms from the target's cache."""

    def state_arrays(self) -> list:
        return [a for a in (self.hidden, self.bonus) if a is not None]

    def describe(self) -> dict:
        """What this drafter runs with (for ``--json`` and benchmark records)."""
        return {"assistant_layers": len(self.assistant.model.layers),
                "vocab_size": self.assistant.args.vocab_size,
                "centroid_head": "masked_embedding" in self.assistant,
                "query_position": self.query_position, "bf16": self.bf16}
