"""The mixture-of-experts side of ``benchmarks.realistic_pair``: routing as published, routers with
the locality real ones have, and the distinct experts each verify touched.

``SHAPES``: the published routing (``config.json``) of Qwen3.5 / 3.6-35B-A3B (256 experts, top 8,
a gated shared expert of 512, an MoE layer in the MTP head), Qwen3-Next-80B-A3B (512, top 10,
shared 512, per-expert tensors) and Gemma 4 26B-A4B (128, top 8, beside a dense MLP); scaled to a
CPU's memory in float32: hidden 2048 / 2816 -> 1024, layers 40 / 48 / 30 -> 8 / 8 / 12, expert
width 512 -> 128 (Qwen3.5), 512 -> 64 (Qwen3-Next), 704 -> 256 (Gemma 4, its share of the hidden
size), vocabulary -> 32k (about the LM head's share of a real step's bytes). Locality: the text has
topics (``TOPIC_DIMS`` coordinates of each embedding hold its topic's vector, the LM head leans to
the current topic, about 3% of tokens change it), and each router reads the topic with a share
``locality`` of its logits' variance: a published measurement has 4 verified tokens load about
2.5x one token's experts, which 0.7 gives for top-8 of 256 (random routes: 3.8x).
"""

from __future__ import annotations

import math
from typing import Dict, List

import mlx.core as mx

TOPIC_DIMS = 64  # the coordinates that hold an embedding's topic
TOPIC_SIZE = 4096  # ids per topic
# A topic's pull on the next token, in standard deviations of a logit's random part: about 3% of
# tokens change topic, and the text's 4-grams stay distinct (chosen by simulation of f's orbits)
TOPIC_BOOST = 1.2
LOCALITY = 0.7  # the topic's share of a router's logit variance (the default)

# family -> routing and scaled widths (see the module's doc)
SHAPES: Dict[str, dict] = {
    "qwen3_5": dict(experts=256, top_k=8, expert_width=128, shared_width=512, layers=8,
                    vocab=32768),
    "qwen3_next": dict(experts=512, top_k=10, expert_width=64, shared_width=512, layers=8,
                       vocab=32768),
    "gemma4": dict(experts=128, top_k=8, expert_width=256, shared_width=0, layers=12,
                   vocab=32768, intermediate=768),
}


def topics(vocab: int) -> int:
    return max(1, vocab // TOPIC_SIZE)


def topic_of(vocab: int) -> mx.array:
    """Each id's topic (ids in runs of ``TOPIC_SIZE``)."""
    return mx.arange(vocab) * topics(vocab) // vocab


def topic_vectors(vocab: int, key) -> mx.array:
    """One standard normal vector of ``TOPIC_DIMS`` per topic."""
    return mx.random.normal((topics(vocab), TOPIC_DIMS), key=key)


def with_topics(table: mx.array, vectors: mx.array, scale: float) -> mx.array:
    """``table [V, H]`` with its first ``TOPIC_DIMS`` columns replaced by each row's topic vector
    times ``scale``."""
    V = table.shape[0]
    return mx.concatenate([scale * vectors[topic_of(V)], table[:, TOPIC_DIMS:]], axis=1)


def untied_head_scale(hidden: int) -> float:
    """The LM head rows' topic scale (rows std 1/sqrt(H), embeddings' topic entries standard
    normal): ``TOPIC_BOOST`` standard deviations of a logit in the same topic."""
    return TOPIC_BOOST * math.sqrt(hidden) / TOPIC_DIMS


def router(experts: int, hidden: int, locality: float, key, topic_rms: float = 1.0,
           other_rms: float = 1.0, spread: float = 1.0) -> mx.array:
    """A router's weight ``[E, H]``: logits of standard deviation about ``spread`` on inputs whose
    topic coordinates have RMS ``topic_rms`` and the others ``other_rms``, the topic's share of
    their variance ``locality``."""
    k1, k2 = mx.random.split(key)
    on_topic = mx.random.normal((experts, TOPIC_DIMS), key=k1) * (
        spread * math.sqrt(locality / TOPIC_DIMS) / topic_rms)
    on_token = mx.random.normal((experts, hidden - TOPIC_DIMS), key=k2) * (
        spread * math.sqrt((1.0 - locality) / (hidden - TOPIC_DIMS)) / other_rms)
    return mx.concatenate([on_topic, on_token], axis=1)


class DistinctExperts:
    """Counts the distinct experts each verify block (and one-token step) touched, per layer:
    installed on mlx-lm's ``SwitchGLU`` layers of a model (``attach``), it reads the indices of
    every call inside a verify (``row_exact_layers.active()``: not the prompt's prefill) until
    ``detach``. Each count is a host read: time nothing while it is attached."""

    def __init__(self):
        self.calls: Dict[int, List[int]] = {}  # width -> distinct experts of each call
        self.top_k = 0
        self._layers = []

    def attach(self, model) -> "DistinctExperts":
        from mlx_lm.models.switch_layers import SwitchGLU

        for _, m in model.named_modules():
            if isinstance(m, SwitchGLU):
                real = type(m).__call__
                counter = self

                class Counting(type(m)):
                    def __call__(self, x, indices):
                        counter.record(indices)
                        return real(self, x, indices)

                Counting.__name__ = type(m).__name__  # the layer keeps its name in reports
                self._layers.append((m, type(m)))
                m.__class__ = Counting
        return self

    def detach(self) -> None:
        for m, cls in self._layers:
            m.__class__ = cls
        self._layers = []

    def record(self, indices: mx.array) -> None:
        from mlx_mtp.exactness import row_exact_layers

        if not row_exact_layers.active():
            return
        flat = indices.reshape(-1, indices.shape[-1])
        self.top_k = flat.shape[1]
        self.calls.setdefault(flat.shape[0], []).append(
            len(set(flat.reshape(-1).tolist())))  # a host read: only while counting

    def by_width(self) -> Dict[int, float]:
        """Width -> mean distinct experts per layer call."""
        return {w: sum(v) / len(v) for w, v in sorted(self.calls.items())}

    def ratios(self) -> Dict[int, float]:
        """Width -> its mean distinct experts over one row's (the top-k)."""
        return {w: m / self.top_k for w, m in self.by_width().items()}
