"""Real token statistics for the realistic Qwen3.5 pair (``benchmarks.realistic_pair --zipf S``).

The plain realistic pair's target mostly maps the current token x to f(x), a random function of
x over the whole vocabulary: its text uses every id about equally, unlike real text, whose token
frequencies fall as a power of their rank (Zipf). A reduced draft vocabulary is only measured
honestly on outputs with real statistics, so this variant changes three things (the embeddings,
the LM head, the first two full-attention layers and the MTP head's ``fc`` are rewritten):

- **A bias per id.** Every embedding carries one constant coordinate ``u`` (value ``ALPHA``), and
  the LM head's ``u`` column turns it into a logit bias ``-c * S * beta * ln(rank)``, ranks a
  random permutation of the ids (id 0, the EOS id, last). The random rest of a logit is about a
  standard normal, whose maximum over V ids has a Gumbel tail of scale ``beta = 1/sqrt(2 ln V)``,
  so an id wins about ``rank^-S`` as often: Zipf's law with exponent S. The tail is only
  approximate, so c is set on random hidden states to give the top quarter of the ranks Zipf's
  share of the wins; records measure the frequencies the text really has.
- **The tokens before.** A bias alone would make f's image a few hundred ids and its orbits cycle
  within tens of tokens. So the next token depends on the last three: the first two
  full-attention layers attend to the position one and two back only (constant queries and keys
  read from ``u``, placed on the rotary dimensions so the score peaks at that distance) and each
  writes a random rotation of part of that token's embedding into its own dimensions, where no
  embedding lives. Every embedding's parts have fixed norms, so the last hidden state's norm is
  the same at every position and the head can match it. The text then runs over triples of ids,
  whose orbits are far longer.
- **The head** computes the same: its ``fc`` keeps the drafted token's embedding (with ``u``) and
  maps the target hidden state's parts through the same rotations (the embedding part to the
  one-back dimensions, the one-back part to the two-back dimensions), so it agrees with
  the target except where the other, context-dependent branches (scaled by the residual scale)
  flip the choice. Calibration sets that scale for the asked acceptance, as for the plain pair.

Draft vocabularies for such a pair: ``python -m benchmarks.realistic_zipf PAIR OUT --sizes
8192,32768`` writes one sidecar per size (``OUT/<size>``, read with ``--draft-vocab``) from the
counts of a corpus drawn from the pair's language (Zipf's law over its ranks, 10M ids by
default), as ``mlx_mtp.draft_vocab build`` does from a text corpus; a text corpus cannot name the
pair's ids past the demo tokenizer's 8k (they decode to ``<xN>`` and do not encode back).
``--ship SIZE`` also copies one into the pair's ``mtp/draft_vocab/``, which the loader uses
unless told otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Dict, List

import mlx_mtp  # noqa: F401  (before mlx.core: binds the system BLAS)
import mlx.core as mx
import numpy as np

ALPHA = 4.0  # the embeddings' constant coordinate
DISTANCES = (1, 2)  # the earlier tokens the next one depends on
EARLIER = 0.5  # energy of each earlier token's part relative to the current token's
ROPE_BASE = 10000000.0  # text_config's rope_theta
ROTARY_SHARE = 0.25  # text_config's partial_rotary_factor
ATTENTION_MARGIN = 64.0  # score gap between the peak distance and its neighbours
GATE = 8.0  # output gate pre-activation per unit of the normalized u coordinate


class Layout:
    """Where things live in the hidden dimensions: embeddings in ``E`` (their first ``m``
    dimensions the part later positions read), the constant at ``u``, then one block of ``m``
    dimensions per distance for that earlier token's part."""

    def __init__(self, hidden: int, head_dim: int):
        self.m = min(head_dim, hidden // 8)
        self.n_e = hidden - 1 - len(DISTANCES) * self.m
        self.u = self.n_e
        self.hidden = hidden
        # rms of the residual entering the k-th earlier-token layer (the embedding, the constant
        # and the k parts written before it), and the gain lam_k that gives that layer's part
        # (m dimensions of norm sqrt(m) / rms_in, times lam) EARLIER times the E part's energy
        self.rms_in = [math.sqrt((self.n_e * (1 + k * EARLIER) + ALPHA ** 2) / hidden)
                       for k in range(len(DISTANCES) + 1)]
        self.lam = [r * math.sqrt(EARLIER * self.n_e / self.m) for r in self.rms_in[:-1]]
        self.rms_e, self.rms_r = self.rms_in[0], self.rms_in[-1]

    def block(self, k: int) -> slice:
        """The dimensions of the k-th earlier token's part (k = 0: one back)."""
        start = self.u + 1 + k * self.m
        return slice(start, start + self.m)


def ranks(vocab: int, key) -> mx.array:
    """Each id's frequency rank (1 = most frequent): a random permutation, id 0 (EOS) last."""
    order = mx.random.permutation(vocab - 1, key=key) + 1  # ids 1.. in rank order
    rank = mx.zeros((vocab,)).at[order].add(mx.arange(1, vocab, dtype=mx.float32))
    rank[0] = vocab
    return rank


def zipf_share(top: int, vocab: int, exponent: float) -> float:
    """The share of Zipf-distributed draws whose rank is at most ``top``."""
    weights = mx.arange(1, vocab + 1, dtype=mx.float32) ** -exponent
    return (weights[:top].sum() / weights.sum()).item()


def bias_for(head: mx.array, rank: mx.array, u: int, u_final: float, exponent: float, key,
             samples: int = 1024, steps: int = 14) -> mx.array:
    """The per-id bias ``-c * exponent * beta * ln(rank)`` (beta = 1 / sqrt(2 ln V), the Gumbel
    scale of the maximum of V standard normals) whose argmax over random unit-rms hidden states
    falls in the top quarter of ranks as often as Zipf's law with ``exponent`` says: c by
    bisection, as the Gumbel tail is only approximate at this V."""
    vocab, hidden = head.shape
    g = mx.random.normal((samples, hidden), key=key)
    g = g * math.sqrt(hidden) / mx.linalg.norm(g, axis=-1, keepdims=True)
    g[:, u] = u_final
    random_part = g @ head.T  # head's u column is still zero
    base = -exponent / math.sqrt(2.0 * math.log(vocab)) * mx.log(rank)
    top, want = vocab // 4, zipf_share(vocab // 4, vocab, exponent)
    lo, hi = 0.0, 8.0
    for _ in range(steps):
        c = (lo + hi) / 2
        winners = mx.argmax(random_part + c * base, axis=-1)
        share = (rank[winners] <= top).mean().item()
        lo, hi = (c, hi) if share < want else (lo, c)
    return (lo + hi) / 2 * base


def earlier_token_queries(head_dim: int, distance: int):
    """(query, key) vectors of one head, before RoPE, whose score after RoPE is
    ``sum_f cos((d - distance) theta_f)`` at distance d: largest at ``distance``; and the q / k
    norms' gain that puts the peak ``ATTENTION_MARGIN`` above its neighbours."""
    rot = int(head_dim * ROTARY_SHARE)
    half = rot // 2
    freqs = min(8, half)
    theta = [ROPE_BASE ** (-2.0 * f / rot) for f in range(freqs)]
    q, k = [0.0] * head_dim, [0.0] * head_dim
    for f, t in enumerate(theta):  # pairs (f, f + half) rotate together (non-traditional RoPE)
        k[f] = 1.0
        q[f], q[f + half] = math.cos(distance * t), -math.sin(distance * t)
    # after q_norm / k_norm (rms 1, gain g) the score is g^2 sqrt(hd) / freqs * sum_f cos(...)
    gap = sum(1 - math.cos(t) for t in theta)
    gain = math.sqrt(ATTENTION_MARGIN * freqs / (math.sqrt(head_dim) * gap))
    return mx.array(q), mx.array(k), gain


def earlier_token_layers(layer_types: List[str]) -> List[int]:
    layers = [i for i, t in enumerate(layer_types) if t == "full_attention"][:len(DISTANCES)]
    if len(layers) < len(DISTANCES):
        raise ValueError(f"--zipf needs {len(DISTANCES)} full-attention layers (--layers of at "
                         f"least {4 * len(DISTANCES)})")
    return layers


def apply(w: Dict[str, mx.array], a, layer_types: List[str], exponent: float, key) -> None:
    """Rewrite the weights ``w`` of a built realistic pair (raw Hugging Face layout) in place."""
    layers = earlier_token_layers(layer_types)
    lay = Layout(a.hidden, a.head_dim)
    m, hd = lay.m, a.head_dim
    keys = iter(mx.random.split(key, 4 + len(DISTANCES)))

    def fixed_norm(x):  # every row of norm sqrt(its width): unit rms
        return x * math.sqrt(x.shape[-1]) / mx.linalg.norm(x, axis=-1, keepdims=True)

    e = mx.random.normal((a.vocab, lay.n_e), key=next(keys))
    w["model.language_model.embed_tokens.weight"] = mx.concatenate(
        [fixed_norm(e[:, :m]), fixed_norm(e[:, m:]), mx.full((a.vocab, 1), ALPHA),
         mx.zeros((a.vocab, len(DISTANCES) * m))], axis=1)

    one_u = mx.zeros((a.hidden,)).at[lay.u].add(1.0)
    rotations = []
    for k, (layer, distance) in enumerate(zip(layers, DISTANCES)):
        p = f"model.language_model.layers.{layer}.self_attn."
        q0, k0, gain = earlier_token_queries(hd, distance)
        per_head = mx.concatenate([q0[:, None] * one_u, mx.full((hd, 1), GATE) * one_u])
        w[p + "q_proj.weight"] = mx.concatenate([per_head] * a.heads)
        w[p + "k_proj.weight"] = mx.concatenate([k0[:, None] * one_u] * a.kv_heads)
        w[p + "q_norm.weight"] = mx.full((hd,), gain - 1.0)  # stored zero-centred: g is g - 1
        w[p + "k_norm.weight"] = mx.full((hd,), gain - 1.0)
        v = mx.zeros((a.kv_heads * hd, a.hidden))
        v[:m, :m] = mx.eye(m)  # kv head 0 carries the embedding's first m dimensions
        w[p + "v_proj.weight"] = v
        rotation = mx.linalg.qr(mx.random.normal((m, m), key=next(keys)), stream=mx.cpu)[0]
        o = mx.zeros((a.hidden, a.heads * hd))
        o[lay.block(k), :m] = lay.lam[k] * rotation  # query head 0 writes them, rotated
        w[p + "o_proj.weight"] = o
        rotations.append(rotation)

    head = mx.random.normal((a.vocab, a.hidden), key=next(keys)) / math.sqrt(a.hidden)
    head[:, lay.u] = 0.0
    u_final = ALPHA / lay.rms_r  # the u coordinate after the final norm
    bias = bias_for(head, ranks(a.vocab, next(keys)), lay.u, u_final, exponent, next(keys))
    head[:, lay.u] = bias / u_final
    w["lm_head.weight"] = head

    # The head: [norm(embed(x_{p+1})), norm(h_p)] -> embed(x_{p+1}) plus, from h_p, the
    # embedding part rotated into the one-back block and the one-back part rotated on into the
    # two-back block, each scaled as the target's last residual has it.
    #   target (pre-norm): e(x) + sum_k lam_k / rms_in[k] * R_k e1(x_{-1-k})
    #   head x rms_e:      e(x) + rms_e / rms_r * (kappa_0 R_0 e1(x_{-1})
    #                              + kappa_1 R_1 R_0^T lam_0 / rms_e R_0 e1(x_{-2}))
    hidden_part = mx.zeros((a.hidden, a.hidden))
    kappa = lay.lam[0] * lay.rms_r / lay.rms_e ** 2
    hidden_part[lay.block(0), :m] = kappa * rotations[0]
    for k in range(1, len(DISTANCES)):
        kappa = lay.lam[k] * lay.rms_r / (lay.rms_in[k] * lay.lam[k - 1] / lay.rms_in[k - 1]
                                          * lay.rms_e)
        hidden_part[lay.block(k), lay.block(k - 1)] = kappa * rotations[k] @ rotations[k - 1].T
    w["mtp.fc.weight"] = mx.concatenate([mx.eye(a.hidden), hidden_part], axis=1)
    mx.eval(w)


# ------------------------------------------------------------------------------ draft vocabularies


def pair_ranks(model) -> mx.array:
    """Each id's frequency rank (1 = most frequent) in a loaded Zipf pair, read from its LM
    head's bias column."""
    args = model.target.args
    bias = model.target.lm_head_module.weight[:, Layout(args.hidden_size, args.head_dim).u]
    return mx.argsort(mx.argsort(-bias)) + 1


def sample_counts(rank: mx.array, exponent: float, tokens: int, seed: int) -> np.ndarray:
    """Per-id counts of a corpus of ``tokens`` ids drawn from the pair's language: Zipf's law with
    ``exponent`` over its ranks, as a text corpus is drawn from a language, not from the model."""
    r = np.asarray(rank).astype(np.int64)
    p = r.astype(np.float64) ** -exponent
    return np.random.default_rng(seed).multinomial(tokens, p / p.sum())


def write_draft_vocabs(pair: Path, out: Path, sizes: List[int], tokens: int,
                       seed: int = 0) -> List[dict]:
    """One draft vocabulary sidecar per size in ``out/<size>``: the most frequent ids of a
    ``tokens``-id corpus of the pair's language (``sample_counts``), with the EOS ids."""
    from mlx_mtp.models.qwen3_5 import vocab_reduction as vr

    info = json.loads((pair / "realistic_pair.json").read_text())
    if not info.get("zipf"):
        raise SystemExit(f"error: {pair} is not a --zipf pair (realistic_pair.json has no zipf "
                         f"exponent)")
    model, tokenizer = mlx_mtp.load(str(pair))
    vocab = model.target.vocab_size
    bad = [s for s in sizes if not 1 <= s < vocab]
    if bad:
        raise SystemExit(f"error: --sizes must lie between 1 and {vocab - 1}, got {bad}")
    counts = sample_counts(pair_ranks(model), info["zipf"], tokens, seed)
    return [vr.write_counted(model, tokenizer, counts, size=size, out=out / str(size),
                             corpus={"zipf": info["zipf"], "seed": seed}, corpus_tokens=tokens)
            for size in sizes]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.realistic_zipf",
        description="draft vocabulary sidecars for a --zipf realistic pair, from a corpus drawn "
                    "from its language")
    p.add_argument("pair", type=Path, help="a pair written by benchmarks.realistic_pair --zipf")
    p.add_argument("out", type=Path, help="folder for one sidecar per size (out/<size>)")
    p.add_argument("--sizes", default="8192,16384,32768,65536",
                   help="comma-separated draft vocabulary sizes")
    p.add_argument("--corpus-tokens", type=int, default=10_000_000,
                   help="ids in the drawn corpus (default 10M)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ship", type=int, default=None, metavar="SIZE",
                   help="also copy the sidecar of SIZE ids into the pair's mtp/draft_vocab/, "
                        "which the loader uses by default (as a converted checkpoint ships one)")
    a = p.parse_args(argv)
    try:
        sizes = [int(s) for s in a.sizes.split(",")]
    except ValueError:
        p.error(f"--sizes: expected comma-separated integers, got {a.sizes!r}")
    if a.corpus_tokens < 1:
        p.error(f"--corpus-tokens must be >= 1, got {a.corpus_tokens}")
    if a.ship is not None and a.ship not in sizes:
        p.error(f"--ship: {a.ship} is not one of --sizes {a.sizes}")
    for w in write_draft_vocabs(a.pair, a.out, sizes, a.corpus_tokens, a.seed):
        print(f"wrote {w['out']}: {w['size']} ids covering {100 * w['coverage']:.1f}% of the "
              f"corpus")
    if a.ship is not None:
        from mlx_mtp.models.qwen3_5.loading import EMBEDDED_DRAFT_VOCAB

        shipped = a.pair / EMBEDDED_DRAFT_VOCAB
        shutil.copytree(a.out / str(a.ship), shipped, dirs_exist_ok=True)
        print(f"copied {a.out / str(a.ship)} to {shipped}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
