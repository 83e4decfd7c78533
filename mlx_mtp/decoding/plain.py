"""Plain decode of the same target through mlx-lm: what a session runs when the exactness gate
declines MTP, and the ``--no-mtp`` baseline (``plain_stream_generate``). Same yield shape as the
round loop, same ``RunStats`` bookkeeping (no rounds)."""

from __future__ import annotations

import time
from typing import Callable, Generator, List, Optional, Tuple

import mlx.core as mx

from mlx_mtp.decoding import responses
from mlx_mtp.decoding.limits import DEFAULT_MAX_TOKENS
from mlx_mtp.decoding.stats import RunStats


def plain_generate_step(prompt: mx.array, model, *, max_tokens: int,
                        sampler: Optional[Callable[[mx.array], mx.array]],
                        prefill_step_size: int,
                        logits_processors: Optional[List[Callable]] = None,
                        stats: RunStats, prompt_cache=None, kv=None, progress=None,
                        input_embeddings=None) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Yield ``(token, logprobs, False)`` from mlx-lm's own ``generate_step`` on
    ``model.mlx_model``: token for token what plain decoding of the target gives. ``prompt_cache``
    (the target's layers), ``kv`` (``KVSettings``), ``progress`` and ``input_embeddings`` go to it
    with mlx-lm's meaning."""
    from mlx_lm.generate import generate_step as mlx_generate_step

    split = getattr(model, "split", None)
    crossings = stats.count_split(split)
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    stats.prompt_tokens = prompt.size
    n = 0
    steps = mlx_generate_step(prompt, model.mlx_model, max_tokens=max_tokens, sampler=sampler,
                              logits_processors=logits_processors or None,
                              prefill_step_size=prefill_step_size, prompt_cache=prompt_cache,
                              prompt_progress_callback=progress,
                              input_embeddings=input_embeddings, **_kv_args(kv))
    if split is not None:  # every step bounded by the split's watchdog (mlx_mtp.models.distributed)
        steps = split.guard(steps)
    for n, (token, logprobs) in enumerate(steps, 1):
        crossings()
        now = time.perf_counter()
        if n == 1:
            stats.prompt_s = now - t0
            t_gen = now
        stats.generation_tokens = n
        stats.generation_s = now - t_gen
        stats.peak_memory_gb = mx.get_peak_memory() / 1e9
        yield token, logprobs, False
    stats.generation_s = time.perf_counter() - t_gen if n else 0.0
    stats.peak_memory_gb = mx.get_peak_memory() / 1e9


def _kv_args(kv) -> dict:
    if kv is None or kv.bits is None:
        return {}
    return dict(kv_bits=kv.bits, kv_group_size=kv.group_size, quantized_kv_start=kv.start)


def plain_stream_generate(model, tokenizer, prompt, *, max_tokens: int = DEFAULT_MAX_TOKENS,
                          sampler=None, logits_processors=None, prefill_step_size: int = 2048,
                          stats: Optional[RunStats] = None) -> Generator:
    """``stream_generate`` over mlx-lm's own plain decode of ``model.mlx_model`` (no drafter,
    no gate): the baseline that MTP must equal token for token at temperature 0 (the CLI's and
    the server's ``--no-mtp``)."""
    tokenizer, prompt, stats = responses.prepare(tokenizer, prompt, stats)
    tokens = plain_generate_step(prompt, model, max_tokens=max_tokens, sampler=sampler,
                                 logits_processors=logits_processors,
                                 prefill_step_size=prefill_step_size, stats=stats)
    yield from responses.stream_responses(tokens, tokenizer, prompt, max_tokens, stats)
