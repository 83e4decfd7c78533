"""The Qwen3.5 / Qwen3.6 / Qwen3-Next MTP head and its drafter.

The head is one full-attention decoder layer of the target's own family, an ``fc`` (2H -> H) over
``[norm(embed(x_{p+1})), norm(h_p)]`` (embedding first), and a final norm. It borrows the target's
embedding and LM head and keeps its own KV cache, whose offset always equals the target's.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from itertools import accumulate
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5 as _qwen3_5
from mlx_lm.models import qwen3_next as _qwen3_next
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from mlx_mtp import draft_tree
from mlx_mtp.models.draft_profile import DraftProfiler
from mlx_mtp.models.packed_batch import packed_caches
from mlx_mtp.draft_tree import DraftTree
from mlx_mtp.models.protocols import DrafterDefaults
from mlx_mtp.models import bf16_weights
from mlx_mtp.models.qwen3_5 import drafter_products
from mlx_mtp.models.qwen3_5.compiled_head import CompiledHead
from mlx_mtp.models.qwen3_5.fused_head import FusedHead, fusable
from mlx_mtp.models.qwen3_5.lm_head import DraftLMHead
from mlx_mtp.models.qwen3_5.target import Qwen3NextSpecAttention
from mlx_mtp.models.options import DraftOptions

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


def bf16_candidates(head: MTPHead, target, vocab_ids: Optional[mx.array]) -> list:
    """The matrices ``DraftOptions.bf16`` copies to bfloat16: the head's (an MoE layer's expert
    stacks too) and the LM head rows it drafts over; empty where any is quantized (the option is
    for float heads)."""
    modules = [m for _, m in head.named_modules()]
    if any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear))
           for m in modules + [target.lm_head_module]):
        return []
    matrices = [m.weight for m in modules if isinstance(m, (nn.Linear, SwitchLinear))]
    lm = target.lm_head_module.weight
    return matrices + [lm if vocab_ids is None else lm[vocab_ids]]


class QwenMTPDrafter(DrafterDefaults):
    """Drafts with the MTP head, recurrently: draft j > 1 feeds the head its own output.

    Accept hook (exact variant): trim this round's approximate entries, then run the head over the
    accepted pairs with the target's true hidden states; that forward also yields the next round's
    first draft (``first_draft``). ``options`` and ``vocab_ids`` (a reduced draft vocabulary, sorted
    target ids) select the optimizations of ``mlx_mtp.models.options``.
    """

    def __init__(self, head: MTPHead, target, options: DraftOptions = DraftOptions(),
                 vocab_ids: Optional[mx.array] = None):
        self.head = head
        self.target = target
        self.options = options
        # The products of the compiled step through the row kernel (with OpenBLAS, by default).
        # The step's products on bfloat16 copies of the weights (by default where that rounds
        # nothing: a bfloat16 checkpoint), else through the row kernel (with OpenBLAS, by default).
        self.bf16 = (options.compiled and options.bits is None and options.row_kernel is not True
                     and bf16_weights.resolve_bf16(
                         options.bf16, lambda: bf16_candidates(head, target, vocab_ids)))
        self.row_kernel = (options.compiled and not self.bf16
                           and drafter_products.resolve(options.row_kernel))
        # An MoE layer's experts through the expert kernel (drafter_products.KernelSwitchGLU).
        self.expert_layers = (drafter_products.experts_through_kernel(head, self.bf16)
                              if options.compiled else 0)
        self.lm = DraftLMHead(target, vocab_ids, fused=options.fused_argmax,
                              chunk=options.fused_chunk, rows_by_kernel=self.row_kernel,
                              bf16=self.bf16)
        # The merged head is built from the weights the head has now (a head quantized later,
        # as ``quantize_drafter`` does to write a folder, is not drafted with).
        fast = (FusedHead(head, row_kernel=self.row_kernel, bf16=self.bf16)
                if options.compiled and options.merged and type(head) is MTPHead
                and fusable(head) else None)
        self.compiled = (CompiledHead(head, embed=target.embed, pick=self.lm.pick, fast=fast)
                         if options.compiled else None)
        # The embedding lookup, head and LM head + argmax of a step as one compiled call (not
        # with the fused chunked argmax, which exists to avoid the logits row).
        self.whole_step = self.compiled is not None and not self.lm.fused and self.lm.whole
        # a run installs its own (mlx_mtp.models.draft_profile.attach)
        self.profiler = DraftProfiler()
        self.syncs = 0  # host reads made while drafting (only with device_ids off)
        self.reset()

    def reset(self) -> None:
        self.cache = [KVCache() for _ in self.head.layers]
        self.first_draft = None  # [1] id of x_{N+1}, on device
        self.first_draft_hidden = None  # [1, 1, H] head output that produced it
        self.first_draft_logits = None  # [1, Vd] its logits (None when fused: computed if sampling)
        self.in_round = 0  # approximate cache entries appended by the current draft

    @property
    def offset(self) -> int:
        return self.cache[0].offset

    def prefill(self, hidden: mx.array, next_ids: mx.array) -> None:
        g, self.first_draft, self.first_draft_logits = self._step(next_ids, hidden)
        self.first_draft_hidden = g[:, -1:]

    def _step(self, ids: mx.array, hidden: mx.array, logits: bool = False):
        """The head over ``ids [S]`` and ``hidden [1, S, H]``: ``(g, argmax id of the last row
        [1], its logits [1, Vd] or None when fused)``; ``logits``: never fused (a pick after
        logits processors reads the row). One compiled call for a draft step or an accept hook
        (the profiler then charges it all to ``layers``), else eager stage by stage."""
        prof = self.profiler
        if self.whole_step and self.compiled.usable(ids.shape[0], self.cache):
            g, tok, row = self.compiled.step(ids[None], hidden, self.cache)
            prof.stage("layers", g, tok, row)
            return g, tok, row
        embeds = self.target.embed(ids[None])
        prof.stage("ids", embeds)
        g = self._forward(embeds, hidden)
        prof.stage("layers", g)
        return (g, *self.lm.argmax(g[:, -1], prof, fused=False if logits else None))

    def _forward(self, embeds: mx.array, hidden: mx.array) -> mx.array:
        """The head over ``S`` new rows: compiled for the few rows of a draft step or an accept
        hook (``DraftOptions.compiled``), eager for a prompt chunk."""
        if self.compiled is not None and self.compiled.usable(embeds.shape[1], self.cache):
            return self.compiled(embeds, hidden, self.cache)
        return self.head(embeds, hidden, self.cache)

    def _via_host(self, tok: mx.array) -> mx.array:
        """``device_ids`` off (kept to measure it): the id makes a host round trip, as it would
        if the loop read every draft."""
        value = tok.item()
        self.syncs += 1
        self.profiler.stage("readback")
        return mx.array([value], dtype=tok.dtype)

    def _draft(self, k: int, first: mx.array, pick=None) -> mx.array:
        # With device_ids (the default) each id feeds the next embedding lookup as an array.
        # ``pick(g_last, logits)``: the next id (None: the step's argmax).
        prof = self.profiler
        ids = [first]
        g = self.first_draft_hidden
        for _ in range(k - 1):
            with prof.step("draft"):
                prev = ids[-1] if self.options.device_ids else self._via_host(ids[-1])
                g, tok, logits = self._step(prev, g, logits=pick is not None)
                ids.append(tok if pick is None else pick(g[:, -1], logits))
        self.in_round = k - 1
        return mx.concatenate(ids)

    def draft(self, k: int) -> mx.array:
        return self._draft(k, self.first_draft)

    def draft_tree(self, topk: int, nodes: int, depth: int, process=None) -> DraftTree:
        """A tree of at most ``nodes`` drafts and ``depth`` levels after the bonus
        (``draft_tree.TreeSearch``): the ``topk`` best children of each expanded node by the
        head's log-probabilities; at each depth the ``topk`` children of highest path
        probability are expanded, the head run once over them, each row attending along its
        path; the ``nodes`` of highest path probability are kept. ``process(logits, paths,
        ids=)``: the request's logits processors over each expansion's rows first."""
        logits = self.first_draft_logits
        if logits is None:
            logits = self.lm.project(self.first_draft_hidden[:, -1])
        base = self.offset
        search = draft_tree.TreeSearch(
            topk, self.lm.to_target,
            process=None if process is None else partial(process, ids=self.lm.ids))
        parent_g = {search.ROOT: self.first_draft_hidden}
        entry = {}  # expanded candidate -> its in-round head cache entry
        frontier = search.expand(logits, [search.ROOT], 1)
        for d in range(2, depth + 1):
            hidden = mx.concatenate([parent_g[search.parent(f)] for f in frontier], axis=1)
            ids = mx.array([search.token(f) for f in frontier], dtype=mx.uint32)
            first = len(entry)
            for r, f in enumerate(frontier):
                entry[f] = first + r
            rows = draft_tree.Rows(base, [base + d - 2] * len(frontier),
                                   [_entries(f, search, entry) for f in frontier])
            with draft_tree.laid_out(rows), _attending_by_rows(self.head):
                g = self.head(self.target.embed(ids[None]), hidden, self.cache)
            for r, f in enumerate(frontier):
                parent_g[f] = g[:, r : r + 1]
            frontier = search.expand(self.lm.project(g[0]), frontier, d)
        self.in_round = len(entry)
        self.syncs += search.reads
        return search.select(nodes)

    def _sample(self, logits: mx.array, sample) -> mx.array:
        self.profiler.stage("lm_head", logits)
        tok = sample(logits, ids=self.lm.ids)
        self.profiler.stage("sample", tok)
        return tok

    def draft_sampled(self, k: int, sample) -> mx.array:
        """Like ``draft``, but every id is picked by ``sample`` from the step's logits (a
        ``mlx_mtp.decoding.sampling.DraftSampler``, which records the distribution q it draws
        from, on the draft vocabulary if any; or the processed argmax,
        ``mlx_mtp.decoding.draft_processing.DraftArgmax``)."""
        return self._draft(k, sample(self._first_logits(), ids=self.lm.ids),
                           lambda x, logits: self._sample(
                               self.lm.project(x) if logits is None else logits, sample))

    def _first_logits(self) -> mx.array:
        """The first draft's logits row ``[1, Vd]`` (projected again where the step fused)."""
        logits = self.first_draft_logits
        return self.lm.project(self.first_draft_hidden[:, -1]) if logits is None else logits

    def accept(self, hidden: mx.array, next_ids: mx.array) -> None:
        with self.profiler.step("accept"):
            for c in self.cache:
                c.trim(self.in_round)
            self.in_round = 0
            self.prefill(hidden, next_ids)

    # -- several sequences at once (mlx_mtp.decoding.batch_rounds) -------------------------------

    @staticmethod
    def draft_batch(drafters: List["QwenMTPDrafter"], drafts: List[int],
                    picks: Optional[list] = None) -> List[mx.array]:
        """``draft`` for several sequences' drafters (one head and LM head, each its own
        cache): ``drafts[s]`` ids each, every head step one forward over the sequences still
        drafting, their rows packed (``mlx_mtp.models.packed_batch``). ``picks[s]``, where not
        None, picks sequence s's ids from its logits rows as ``draft_sampled``'s ``sample``
        (its logits processors: ``mlx_mtp.decoding.draft_processing.DraftArgmax``)."""
        picks = picks or [None] * len(drafters)
        ids = [[d.first_draft if p is None else p(d._first_logits(), ids=d.lm.ids)]
               for d, p in zip(drafters, picks)]
        g = [d.first_draft_hidden for d in drafters]
        for step in range(1, max(drafts)):
            live = [s for s, k in enumerate(drafts) if k > step]
            rows = any(picks[s] is not None for s in live)
            last, toks, logits = _packed_step(drafters, live,
                                              mx.concatenate([ids[s][-1] for s in live]),
                                              mx.concatenate([g[s] for s in live], axis=1),
                                              [1] * len(live), logits=rows)
            for r, s in enumerate(live):
                pick = picks[s]
                ids[s].append(toks[r : r + 1] if pick is None
                              else pick(logits[r : r + 1], ids=drafters[s].lm.ids))
                g[s] = last[r : r + 1][None]
        for d, k in zip(drafters, drafts):
            d.in_round = k - 1
        return [mx.concatenate(x) for x in ids]

    @staticmethod
    def accept_batch(drafters: List["QwenMTPDrafter"], hidden: List[mx.array],
                     next_ids: List[mx.array]) -> None:
        """``accept`` for several sequences' drafters, their accepted pairs as one packed
        head forward."""
        for d in drafters:
            for c in d.cache:
                c.trim(d.in_round)
            d.in_round = 0
        widths = [ids.shape[0] for ids in next_ids]
        last, toks, logits = _packed_step(drafters, list(range(len(drafters))),
                                          mx.concatenate(next_ids), mx.concatenate(hidden, axis=1),
                                          widths)
        for s, d in enumerate(drafters):
            d.first_draft = toks[s : s + 1]
            d.first_draft_hidden = last[s : s + 1][None]
            # (None where fused: projected again where a tree, a sampler or a processor needs it)
            d.first_draft_logits = None if logits is None else logits[s : s + 1]

    # -- prompt caches across turns (mlx_mtp.decoding.prompt_cache) -------------------------------

    def carry(self) -> list:
        """What a prompt cache keeps between turns: the head's KV caches (exact entries only)."""
        return self.cache

    def resume(self, carried: list) -> None:
        self.reset()
        self.cache = carried

    def rewind(self, n: int) -> None:
        """Forget the last ``n`` pairs consumed (rows the caller never read)."""
        for c in self.cache:
            c.trim(n)

    def state_arrays(self) -> list:
        out = [self.first_draft, self.first_draft_hidden]
        for c in self.cache:
            if c.keys is not None:
                out += [c.keys, c.values]
        return out

    def describe(self) -> dict:
        """What this drafter runs with (for ``--json`` and benchmark records)."""
        quantized = [m for _, m in self.head.named_modules() if hasattr(m, "bits")]
        return {"device_ids": self.options.device_ids, "compiled": self.compiled is not None,
                "merged": self.compiled is not None and self.compiled.fast is not None,
                "row_kernel": self.row_kernel,
                "bf16": self.bf16,
                "expert_kernel_layers": self.expert_layers,
                "fused_argmax": self.lm.fused,
                "vocab_size": self.lm.size, "reduced_vocab": self.lm.ids is not None,
                "quantized_layers": len(quantized),
                "bits": sorted({m.bits for m in quantized}),
                "group_size": sorted({m.group_size for m in quantized}),
                "fc_quantized": hasattr(self.head.fc, "bits")}


@contextmanager
def _attending_by_rows(head: MTPHead):
    """The head's attention layers as ``Qwen3NextSpecAttention`` for this body, so a draft tree's
    rows attend along their paths (``draft_tree.Rows``); mlx-lm's class again after it (the
    merged head and the compiled step look for it)."""
    swapped = [layer.self_attn for layer in head.layers
               if type(getattr(layer, "self_attn", None)) is _qwen3_next.Qwen3NextAttention]
    for attn in swapped:
        attn.__class__ = Qwen3NextSpecAttention
    try:
        yield
    finally:
        for attn in swapped:
            attn.__class__ = _qwen3_next.Qwen3NextAttention


def _packed_step(drafters: List[QwenMTPDrafter], members: List[int], ids: mx.array,
                 hidden: mx.array, widths: List[int], logits: bool = False):
    """The head over the packed rows of ``drafters[members]`` (``widths`` rows each): each
    sequence's last output row (``[len(members), H]``), the argmax id after it and its logits
    (None where fused, unless ``logits``)."""
    d = drafters[0]
    caches = packed_caches([drafters[s].cache for s in members], widths)
    with _attending_by_rows(d.head):
        rows = d.head(d.target.embed(ids[None]), hidden, caches)
    last = rows[0][mx.array(list(accumulate(widths)), dtype=mx.uint32) - 1]
    toks, row_logits = d.lm.argmax(last, d.profiler, fused=False if logits else None)
    return last, toks, row_logits


def _entries(f: int, search: draft_tree.TreeSearch, entry: dict) -> List[int]:
    """The in-round head entries candidate ``f`` sees: its expanded ancestors' and its own."""
    out = [entry[f]]
    p = search.parent(f)
    while p != search.ROOT:
        out.append(entry[p])
        p = search.parent(p)
    return out[::-1]
