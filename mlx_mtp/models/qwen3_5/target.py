"""Target adapter for the hybrid Qwen families, Qwen3.5 / Qwen3.6 (``qwen3_5``, ``qwen3_5_moe``) and
Qwen3-Next (``qwen3_next``): mlx-lm's own model, its GatedDeltaNet layers swapped for a subclass
that keeps the recurrent state after every verified token, so a rollback selects the state at
the accepted length; the verify's pieces compiled (``gdn_block``, ``compiled_layers``).
docs/architecture.md, "Rollback"; docs/cpu-backend.md, "The verify on the CPU".

Hooks mlx-lm 0.32.x internals (``GatedDeltaNet.__call__``, ``Qwen3NextGatedDeltaNet.__call__``):
``tests/qwen3_5/test_target.py`` and ``test_prefill.py`` pin the subclasses to the parents
bitwise, so an mlx-lm change that breaks the copy fails there first."""

from __future__ import annotations

from typing import Any, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5 as _qwen3_5
from mlx_lm.models import qwen3_next as _qwen3_next
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache
from mlx_lm.models.gated_delta import gated_delta_update

from mlx_mtp.cpu.attention_kernel import KVRows
from mlx_mtp.exactness import row_attention, row_exact_layers
from mlx_mtp import draft_tree
from mlx_mtp.models.packed_batch import PackedCache, packed_caches, split_rows
from mlx_mtp.models.target_base import TrunkTarget
from mlx_mtp.models.qwen3_5 import compiled_layers
from mlx_mtp.models.qwen3_5.gdn_block import (capture_mixer, conv_qkv, prefill_kernel_applies,
                                              prefill_recurrence)

QWEN3_5_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


class SpecArraysCache(ArraysCache):
    """mlx-lm's GDN cache (conv state, recurrent state) plus what the last verify kept for a
    rollback: ``("states", per-token states, conv_input)`` or ``("replay", inputs..., conv_input)``."""

    capture = False
    prefill = False  # a prompt's prefill: the recurrence in the C kernel where it applies
    stash = None
    keep_stash = False  # a prompt-cache turn keeps the last verify's stash for ``rewind``

    def __init__(self):
        super().__init__(size=2)


def uses_ops_recurrence(head_k_dim: int, use_kernel: bool) -> bool:
    """Whether mlx-lm's ``gated_delta_update`` runs its ops loop here (else its Metal kernel)."""
    return (not use_kernel or mx.default_device() != mx.gpu or not mx.metal.is_available()
            or head_k_dim < 32 or head_k_dim % 32 != 0)


class _CapturingGDN:
    """Mixin: when the cache asks for capture, run the parent's forward while keeping what a
    rollback needs on the cache (the per-token states, or the inputs to replay where mlx-lm runs
    a kernel that only returns the last state). Otherwise defer to the parent."""

    def _project(self, inputs):  # -> (mixed_qkv [B,S,conv_dim], z [B,S,Hv,Dv], b, a)
        raise NotImplementedError

    def __call__(self, inputs: mx.array, mask: Optional[mx.array] = None, cache: Optional[Any] = None):
        if isinstance(cache, PackedCache):
            return self._mix_packed(inputs, cache)
        if not getattr(cache, "capture", False):
            # (prefill_kernel_applies holds only on the CPU, where mlx-lm runs its ops recurrence)
            if (getattr(cache, "prefill", False) and mask is None and cache.lengths is None
                    and getattr(self, "sharding_group", None) is None
                    and prefill_kernel_applies(self, inputs)):
                return self._prefill(inputs, cache)
            return super().__call__(inputs, mask, cache)
        if cache.lengths is not None:
            raise NotImplementedError("speculative capture supports batch 1")
        # Tensor-split (mlx-lm's ``shard``): this rank holds a slice of the heads; capture and
        # replay work on the local heads, and the out projection is summed over the ranks.
        group = getattr(self, "sharding_group", None)
        B, S, _ = inputs.shape
        qkv, z, b, a = self._project(inputs)
        conv_state = self._conv_state(cache, inputs)
        rows = draft_tree.current()
        if rows is None:
            out, cache[0], cache[1], cache.stash = self._mix(qkv, z, b, a, conv_state, cache[1],
                                                             mask)
        else:
            out = self._mix_tree(qkv, z, b, a, conv_state, cache, rows)
        cache.advance(S)
        out = self.out_proj(out.reshape(B, S, -1))
        return out if group is None else mx.distributed.all_sum(out, group=group)

    def _conv_state(self, cache, inputs: mx.array) -> mx.array:
        """The cache's conv window, or zeros before the first token (as the parent starts)."""
        if cache[0] is not None:
            return cache[0]
        return mx.zeros((inputs.shape[0], self.conv_kernel_size - 1, self.conv_dim),
                        dtype=inputs.dtype)

    def _prefill(self, inputs: mx.array, cache: SpecArraysCache) -> mx.array:
        """The parent's forward, op for op, with its recurrence in the C kernel
        (``gdn_block.prefill_recurrence``)."""
        B, S, _ = inputs.shape
        qkv, z, b, a = self._project(inputs)
        _, cache[0], q, k, v = conv_qkv(self, qkv, self._conv_state(cache, inputs))
        out, cache[1] = prefill_recurrence(self, q, k, v, a, b, cache[1])
        cache.advance(S)
        return self.out_proj(self.norm(out, z).reshape(B, S, -1))

    def _mix(self, qkv, z, b, a, conv_state, state_in, mask):
        """The block's mixer output, the conv and recurrent states after it, and the stash a
        rollback selects from: the per-token states, or (masked, or where mlx-lm runs its Metal
        kernel) the inputs, to replay the kept tokens as mlx-lm computes them."""
        if mask is None and uses_ops_recurrence(self.head_k_dim, not self.training):
            out, conv_input, conv_end, states = capture_mixer(self, qkv, z, b, a, conv_state,
                                                              state_in)
            return out, conv_end, states[-1], ("states", states, conv_input)
        if mask is not None:
            qkv = mx.where(mask[..., None], qkv, 0)
        conv_input, conv_end, q, k, v = conv_qkv(self, qkv, conv_state)
        out, state_end = gated_delta_update(
            q, k, v, a, b, self.A_log, self.dt_bias, state_in, mask, use_kernel=not self.training)
        return (self.norm(out, z), conv_end, state_end,
                ("replay", q, k, v, a, b, state_in, conv_input))

    def _mix_tree(self, qkv, z, b, a, conv_state, cache, rows):
        """A draft tree's rows: the block's mixer over every root-to-leaf path from the cache's
        states, the paths as one batch (shorter ones padded with their last row, whose outputs
        are not read), so each row is what the chain through its ancestors gives. The stash
        keeps every path's states (``keep_path`` selects the accepted one)."""
        paths = rows.paths()
        P = len(paths)
        state_in = cache[1]
        out, conv_end, state_end, stash = self._mix_runs(
            qkv, z, b, a, paths, _repeat(conv_state, P),
            None if state_in is None else _repeat(state_in, P))
        cache[0], cache[1] = conv_end[:1], state_end[:1]  # a path's ends until ``keep_path``
        cache.stash = ("tree", paths, stash)
        return out

    def _mix_runs(self, qkv, z, b, a, runs: List[List[int]], conv_state, state_in):
        """The mixer over ``runs`` of rows (each a list of row indices, one chain from its own
        states in ``conv_state`` / ``state_in``) as one batch, shorter runs padded with their
        last row, whose outputs are not read: every row's output (``[1, rows, ...]``, from the
        first run holding it), and the batch's conv and recurrent ends and stash."""
        longest = max(len(r) for r in runs)
        idx = mx.array([r + r[-1:] * (longest - len(r)) for r in runs], dtype=mx.uint32)
        out, conv_end, state_end, stash = self._mix(qkv[0][idx], z[0][idx], b[0][idx],
                                                    a[0][idx], conv_state, state_in, None)
        first = {}
        for i, r in enumerate(runs):
            for j, row in enumerate(r):
                first.setdefault(row, i * longest + j)
        flat = out.reshape(len(runs) * longest, *out.shape[2:])
        picked = flat[mx.array([first[n] for n in range(qkv.shape[1])], dtype=mx.uint32)]
        return picked[None], conv_end, state_end, stash

    def _mix_packed(self, inputs: mx.array, cache: PackedCache) -> mx.array:
        """Several sequences' blocks (``packed_batch``): the mixer over each from its own
        cache's states, the sequences as one batch (narrower blocks padded with their last row,
        whose outputs are not read). Each sequence's cache then holds its states after its own
        block and the stash its rollback selects from, as after a verify of that block alone."""
        if getattr(self, "sharding_group", None) is not None:
            raise NotImplementedError("a packed batch does not run on a tensor-split target")
        if any(part[1] is None for part in cache.parts):
            raise ValueError("a packed batch's sequences must be prefilled first")
        qkv, z, b, a = self._project(inputs)
        out, _, _, (kind, *stash) = self._mix_runs(
            qkv, z, b, a, [list(range(f, f + w)) for f, w, _ in cache.segments],
            mx.concatenate([part[0] for part in cache.parts], axis=0),
            mx.concatenate([part[1] for part in cache.parts], axis=0))
        for s, (_, w, part) in enumerate(cache.segments):
            part.stash = (kind, *(_row(x, s) for x in stash))
            self.rewind(part, w)  # the states after its own block (selected, or replayed)
            part.advance(w)
        return self.out_proj(out.reshape(1, inputs.shape[1], -1))

    def keep_path(self, cache: SpecArraysCache, path: List[int]) -> None:
        """After a tree verify, the states after the nodes ``path`` (root first); the stash
        becomes that path's, so a later ``rewind`` works as after a chain."""
        _, paths, (kind, *stash) = cache.stash
        i = next(i for i, p in enumerate(paths) if p[: len(path)] == path)
        cache.stash = (kind, *(_row(x, i) for x in stash))
        self.rewind(cache, len(path))

    def rewind(self, cache: SpecArraysCache, keep: int) -> None:
        """Set the cache to the state after the first ``keep`` tokens of the last verify."""
        kind, *stash = cache.stash
        conv_input = stash[-1]
        cache[0] = mx.contiguous(conv_input[:, keep : keep + self.conv_kernel_size - 1, :])
        if kind == "states":
            cache[1] = stash[0][keep - 1]
            return
        q, k, v, a, b, state_in, _ = stash
        _, cache[1] = gated_delta_update(
            q[:, :keep], k[:, :keep], v[:, :keep], a[:, :keep], b[:, :keep],
            self.A_log, self.dt_bias, state_in, None, use_kernel=not self.training,
        )


class Qwen3_5SpecGDN(_CapturingGDN, _qwen3_5.GatedDeltaNet):
    def _project(self, inputs):
        B, S, _ = inputs.shape
        qkv = self.in_proj_qkv(inputs)
        z = self.in_proj_z(inputs).reshape(B, S, self.num_v_heads, self.head_v_dim)
        return qkv, z, self.in_proj_b(inputs), self.in_proj_a(inputs)


class Qwen3NextSpecGDN(_CapturingGDN, _qwen3_next.Qwen3NextGatedDeltaNet):
    def _project(self, inputs):
        B, S, _ = inputs.shape
        q, k, v, z, b, a = self.fix_query_key_value_ordering(
            self.in_proj_qkvz(inputs), self.in_proj_ba(inputs)
        )
        qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
        return qkv, z, b, a


class Qwen3NextSpecAttention(_qwen3_next.Qwen3NextAttention):
    """mlx-lm's gated full attention (both families use this class). Inside a verify it computes
    the attention of each query row separately, against the keys a decode step at that position
    would see: a multi-query SDPA is not reduced like a one-query SDPA on every backend (with BLIS
    on the CPU it is not: the score matmul's width is the context length). Its parts before the
    cache update and after the attention are compiled graphs where ``compiled_layers``'s check
    passed."""

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache: Optional[Any] = None):
        B, L, D = x.shape
        if isinstance(cache, PackedCache):
            return self._packed_rows(x, cache)
        rows = draft_tree.current()
        if rows is not None and cache is not None:
            return self._tree_rows(x, cache, rows)
        by_rows = row_exact_layers.active() and L > 1
        compiled = compiled_layers.active()
        if cache is None or not (by_rows or compiled):
            return super().__call__(x, mask, cache)
        # As Qwen3NextAttention.__call__ (mlx-lm 0.32.2), except the SDPA (by rows) and the
        # parts before and after the cache update (compiled, where compiled_layers's check passed).
        pre, post = (compiled_layers.attention_choices(self, x, L if by_rows else 1) if compiled
                     else (None, None))
        start = cache.offset
        queries, gate, keys, values = (compiled_layers.reference_pre(self, x, start) if pre is None
                                       else compiled_layers.compiled_pre(self, x, pre, start))
        keys, values = cache.update_and_fetch(keys, values)  # tuples when quantized (kv_bits)
        if by_rows:
            rows = self._attend_rows(queries, keys, values, cache,
                                     [start + i + 1 for i in range(L)])
        else:
            rows = [scaled_dot_product_attention(queries, keys, values, cache=cache,
                                                 scale=self.scale, mask=mask)]
        if post is None:
            return compiled_layers.reference_post(self, rows, gate)
        return compiled_layers.compiled_post(self, rows, gate, post)

    def _packed_rows(self, x: mx.array, cache: PackedCache) -> mx.array:
        """Several sequences' blocks (``packed_batch``): each sequence's rows at its own
        positions, each query against the keys a decode step of its own sequence at that
        position would see."""
        positions = [part.offset + j for _, w, part in cache.segments for j in range(w)]
        queries, gate, keys, values = compiled_layers.tree_pre(self, x, positions)
        out = []
        for first, w, part in cache.segments:
            start = part.offset
            k, v = part.update_and_fetch(keys[:, :, first : first + w],
                                         values[:, :, first : first + w])
            out += self._attend_rows(queries[:, :, first : first + w], k, v, part,
                                     [start + i + 1 for i in range(w)])
        return compiled_layers.reference_post(self, out, gate)

    def _tree_rows(self, x: mx.array, cache, rows: draft_tree.Rows) -> mx.array:
        """Draft-tree rows (``draft_tree.Rows``): each query at its node's position, against the
        keys of the cache's committed entries and then its path's, in path order, as a chain's
        row at that position sees them."""
        queries, gate, keys, values = compiled_layers.tree_pre(self, x, rows.positions)
        keys, values = cache.update_and_fetch(keys, values)
        out = self._attend_rows(queries, keys, values, cache,
                                [rows.base + len(seen) for seen in rows.visible],
                                rows.visible, rows.base)
        return compiled_layers.reference_post(self, out, gate)

    def _attend_rows(self, queries: mx.array, keys, values, cache, lengths: List[int],
                     visible: Optional[List[List[int]]] = None, base: int = 0
                     ) -> List[mx.array]:
        """Per query row i, its attention as decode's one-query SDPA computes it, over the
        cache's first ``lengths[i]`` positions (or, for tree rows, the first ``base`` and then
        ``base + j`` for j in ``visible[i]``): all rows in one pass over the cache through the
        attention kernel where its check passed (``row_attention``), else one SDPA per row."""
        if isinstance(keys, mx.array) and queries.dtype == mx.float32 and queries.shape[0] == 1:
            overrides = [[(base + t, j) for t, j in enumerate(v) if j != t] for v in visible or []]
            seen = (KVRows(keys, values, lengths, overrides, keys[..., base:, :],
                           values[..., base:, :]) if any(overrides)
                    else KVRows(keys, values, lengths))
            if row_attention.applies_to(queries.shape[1], seen, self.scale):
                out = row_attention.attend(queries, seen, self.scale)
                return [out[:, :, i : i + 1] for i in range(len(lengths))]
        row_attention.count_by_rows()
        if visible is None:
            kv = [(_first(keys, n), _first(values, n)) for n in lengths]
        else:
            kv = [(_seen(keys, base, v), _seen(values, base, v)) for v in visible]
        return [scaled_dot_product_attention(queries[:, :, i : i + 1], k, v, cache=cache,
                                             scale=self.scale, mask=None)
                for i, (k, v) in enumerate(kv)]


def _repeat(x: mx.array, n: int) -> mx.array:
    """``x`` (a batch of one) as a batch of ``n`` copies."""
    return x if n == 1 else mx.concatenate([x] * n, axis=0)


def _row(x, i: int):
    """Batch entry ``i`` of a stashed array (or of each array of a per-token list)."""
    if isinstance(x, (list, tuple)):
        return [_row(y, i) for y in x]
    return x[i : i + 1]


def _seen(kv, base: int, seen: List[int]):
    """Positions ``0..base-1``, then ``base + j`` for j in ``seen``, of a cache's keys or values
    (an array, or a quantized tuple)."""
    if seen == list(range(len(seen))):
        return _first(kv, base + len(seen))
    if isinstance(kv, (tuple, list)):
        return tuple(_seen(x, base, seen) for x in kv)
    idx = mx.array([base + j for j in seen], dtype=mx.uint32)
    return mx.concatenate([kv[..., :base, :], kv[..., idx, :]], axis=-2)


def _compact(c, fed: int, path: List[int]) -> None:
    """A KV cache that took ``fed`` tree nodes: their entries become those of ``path``, at
    consecutive positions from the block's start."""
    start = c.offset - fed
    idx = mx.array([start + j for j in path], dtype=mx.uint32)
    stop = start + len(path)
    if isinstance(c.keys, (tuple, list)):  # a quantized cache: (packed, scales, biases)
        for part in (c.keys, c.values):
            for x in part:
                x[..., start:stop, :] = x[..., idx, :]
    else:
        c.keys[..., start:stop, :] = c.keys[..., idx, :]
        c.values[..., start:stop, :] = c.values[..., idx, :]
    c.offset = stop

def _first(kv, n: int):

    """Positions ``0..n-1`` of a cache's keys or values (an array, or a quantized tuple)."""
    if isinstance(kv, (tuple, list)):  # (packed, scales, biases)
        return tuple(x[..., :n, :] for x in kv)
    return kv[..., :n, :]


_SPEC_GDN = {
    _qwen3_5.GatedDeltaNet: Qwen3_5SpecGDN,
    _qwen3_next.Qwen3NextGatedDeltaNet: Qwen3NextSpecGDN,
}


class Qwen3_5Target(TrunkTarget):
    """What the round loop and the MTP drafter need from a hybrid Qwen target.

    ``model`` is the mlx-lm model (``qwen3_5.Model`` wrapper or ``qwen3_next.Model``).
    """

    family = "qwen3_5"

    def __init__(self, model: nn.Module):
        super().__init__(model)
        for layer in self.layers:
            if not layer.is_linear and type(layer.self_attn) is _qwen3_next.Qwen3NextAttention:
                layer.self_attn.__class__ = Qwen3NextSpecAttention
            if layer.is_linear:
                gdn = layer.linear_attn
                spec_cls = _SPEC_GDN.get(type(gdn))
                if spec_cls is None and not isinstance(gdn, _CapturingGDN):
                    raise TypeError(f"unsupported GatedDeltaNet class {type(gdn).__name__}")
                if spec_cls is not None:
                    gdn.__class__ = spec_cls
        compiled_layers.switch_to_compiled(self.trunk, self.layers)

    def make_cache(self) -> List[Any]:
        return [SpecArraysCache() if l.is_linear else KVCache() for l in self.layers]

    def embed(self, ids: mx.array) -> mx.array:
        return self.trunk.embed_tokens(ids)

    def logits(self, hidden: mx.array) -> mx.array:
        return self.project(hidden)

    def prefill(self, ids: mx.array, cache: List[Any], input_embeddings=None) -> mx.array:
        """``hidden`` of a prompt's tokens, bitwise, with the GatedDeltaNet recurrence in the C
        kernel where a check says it equals mlx-lm's ops (``gdn_block.prefill_kernel_applies``)."""
        flagged = [c for c in cache if isinstance(c, SpecArraysCache)]
        for c in flagged:
            c.prefill = True
        try:
            return self.hidden(ids, cache, input_embeddings)
        finally:
            for c in flagged:
                c.prefill = False

    def verify(self, ids: mx.array, cache: List[Any]) -> mx.array:
        """Like ``hidden`` but keeps what ``rollback`` needs to undo part of the block."""
        with compiled_layers.compiling():
            return self.flagged_trunk(ids, cache, SpecArraysCache, "capture")

    def verify_tree(self, ids: mx.array, cache: List[Any], tree: draft_tree.DraftTree
                    ) -> mx.array:
        """``verify`` of a draft tree's nodes (``ids [1, n]``: the root, then ``tree``'s nodes
        breadth first): every row is what a chain verify through the node's ancestors gives,
        and ``keep_path`` commits one root-to-node path."""
        start = next((c.offset for c in cache if not isinstance(c, SpecArraysCache)), 0)
        with draft_tree.laid_out(draft_tree.node_rows(tree, start)):
            return self.verify(ids, cache)

    def verify_batch(self, blocks: List[mx.array], caches: List[List[Any]]) -> List[mx.array]:
        """``verify`` of several sequences' blocks (``blocks[s]``: ids ``[w_s]``, ``caches[s]``
        its cache) in one forward, their rows packed (``mlx_mtp.models.packed_batch``): each
        sequence's hidden states ``[1, w_s, H]`` and cache are what ``verify`` of its block alone
        gives, and ``rollback`` works on each cache as after that verify."""
        widths = [b.shape[0] for b in blocks]
        packed = packed_caches(caches, widths)
        with compiled_layers.compiling(), self._verifying():
            hidden = self.trunk(mx.concatenate(blocks)[None], packed)
        return split_rows(hidden, widths)

    def keep_path(self, cache: List[Any], fed: int, path: List[int]) -> None:
        """After ``verify_tree`` of ``fed`` nodes: keep the nodes ``path`` (root first) as
        consecutive positions, as a chain verify of them then a rollback would leave the caches;
        nothing of the other nodes remains."""
        contiguous = path == list(range(len(path)))
        for layer, c in zip(self.layers, cache):
            if isinstance(c, SpecArraysCache):
                layer.linear_attn.keep_path(c, path)
                if not c.keep_stash:
                    c.stash = None
            elif contiguous:
                if len(path) < fed:
                    c.trim(fed - len(path))
            else:
                _compact(c, fed, path)

    def decode(self, ids: mx.array, cache: List[Any]) -> mx.array:
        """A one-token step through the verify's compiled pieces (``gdn_block``,
        ``compiled_layers``: each checked bitwise against mlx-lm's ops, else the ops run), fewer
        and fused ops than mlx-lm's decode step; the rollback stash it keeps is dropped (a step
        is never undone)."""
        with compiled_layers.compiling():
            h = self.flagged_trunk(ids, cache, SpecArraysCache, "capture")
        for c in cache:
            if isinstance(c, SpecArraysCache):
                c.stash = None
        return h

    def rollback(self, cache: List[Any], fed: int, keep: int) -> None:
        """Keep the first ``keep`` of the ``fed`` tokens of the last verify; drop the stash."""
        for layer, c in zip(self.layers, cache):
            if isinstance(c, SpecArraysCache):
                if keep < fed:
                    layer.linear_attn.rewind(c, keep)
                if not c.keep_stash:
                    c.stash = None
            elif keep < fed:
                c.trim(fed - keep)

    def rewind(self, cache: List[Any], kept: int, keep: int) -> None:
        """After ``rollback`` kept ``kept`` tokens of the last verify, keep only its first ``keep``
        (the caller stopped reading mid-round). Selects (or replays) from the stash
        ``keep_stash`` retained."""
        for layer, c in zip(self.layers, cache):
            if isinstance(c, SpecArraysCache):
                if c.stash is None:
                    raise RuntimeError("rewind needs the last verify's stash (keep_stash)")
                layer.linear_attn.rewind(c, keep)
                c.stash = None
            else:
                c.trim(kept - keep)

    def cache_state(self, cache: List[Any]) -> List[mx.array]:
        """The arrays that hold the committed state (for eval and for bitwise comparisons)."""
        out = []
        for c in cache:
            if isinstance(c, KVCache):
                if c.keys is not None:
                    out += [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
            elif isinstance(c, QuantizedKVCache):  # kv_bits: (packed, scales, biases) each
                if c.keys is not None:
                    out += [x[..., : c.offset, :] for x in (*c.keys, *c.values)]
            else:
                out += [x for x in c.cache if x is not None]
        return out
