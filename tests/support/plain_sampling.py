"""Plain sampling's exact distribution over short continuations, and mlx-lm's own samples of
it: the reference the sampling tests compare MTP's draws with."""

from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.sample_utils import make_sampler as mlx_make_sampler
from mlx_lm.utils import load_model as mlx_load_model


def plain_tree(path, prompt, sampler, n_tokens, processors=()):
    """Plain decoding's reachable prefixes (``index``: prefix -> row of ``logprobs``, mlx-lm's
    next-token logprobs after it, its logits ``processors`` applied with the prompt and the
    prefix as history) and the exact probability of every ``n_tokens`` continuation (the
    processed distribution multiplied out along the tree)."""
    model, _ = mlx_load_model(Path(path))
    index, rows, exact = {}, [], {(): 1.0}
    for _ in range(n_tokens):
        prefixes = list(exact)
        logits = model(mx.array([list(prompt) + list(p) for p in prefixes]))[:, -1]
        if processors:
            processed = []
            for i, p in enumerate(prefixes):
                row = logits[i : i + 1]
                for proc in processors:
                    row = proc(mx.array(list(prompt) + list(p)), row)
                processed.append(row)
            logits = mx.concatenate(processed)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        probs = np.array(sampler.probs(logprobs))
        level = {}
        for i, prefix in enumerate(prefixes):
            index[prefix] = len(index)
            for t in np.flatnonzero(probs[i]):
                level[prefix + (int(t),)] = exact[prefix] * float(probs[i, t])
        rows.append(logprobs)
        exact = level
    return index, mx.concatenate(rows), exact


def plain_samples(index, logprobs, n, n_tokens, settings, seed):
    """``n`` plain generations with mlx-lm's own sampler, batched over the tree's logprob rows (a
    token outside the enumerated support raises KeyError)."""
    mlx_sampler = mlx_make_sampler(**settings)
    mx.random.seed(seed)
    seqs = [()] * n
    for _ in range(n_tokens):
        lp = logprobs[mx.array([index[s] for s in seqs])]
        seqs = [s + (t,) for s, t in zip(seqs, mlx_sampler(lp).tolist())]
    return seqs


@lru_cache(maxsize=None)
def _reference(path: str, prompt: tuple, settings: tuple, n_tokens: int, n_samples: int,
               seed: int, penalties: tuple):
    import mlx_mtp

    processors = make_logits_processors(**{k: dict(v) if k == "logit_bias" else v
                                           for k, v in penalties})
    index, logprobs, exact = plain_tree(path, prompt, mlx_mtp.make_sampler(**dict(settings)),
                                        n_tokens, processors)
    samples = plain_samples(index, logprobs, n_samples, n_tokens, dict(settings), seed)
    return exact, samples, index, logprobs


def reference(path, prompt, settings: dict, n_tokens: int, n_samples: int, seed: int = 0,
              penalties: dict = None):
    """``(exact, samples, index, logprobs)``: ``plain_tree`` of ``prompt`` under mlx_mtp's sampler
    of ``settings`` (and mlx-lm's logits processors of ``penalties``, ``make_logits_processors``'
    arguments) and ``n_samples`` of mlx-lm's own draws from it; computed once per session for
    the same arguments (the chain and tree sampling tests share it)."""
    penalties = tuple(sorted((k, tuple(sorted(v.items())) if k == "logit_bias" else v)
                             for k, v in (penalties or {}).items()))  # hashable: cached
    return _reference(str(path), tuple(prompt), tuple(sorted(settings.items())), n_tokens,
                      n_samples, seed, penalties)

