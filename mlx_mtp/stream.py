"""``stream_generate``: mlx-lm-style responses (text segments, then one carrying the run's
``RunStats``) over the speculative loop, or over plain decode of the same target."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generator, Iterator, List, Optional, Tuple, Union

import mlx.core as mx
from mlx_lm.generate import GenerationResponse
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .block_chooser import AUTO, DEFAULT_MAX_BLOCK_SIZE
from .diagnostics import RunStats
from .plain import plain_generate_step
from .speculative import generate_step

DEFAULT_MAX_TOKENS = 256
DEFAULT_BLOCK_SIZE = AUTO


@dataclass
class MTPGenerationResponse(GenerationResponse):
    """mlx-lm's response; the last one of a run also carries ``stats``."""

    stats: Optional[RunStats] = None


def encode_prompt(tokenizer, prompt: Union[str, List[int], mx.array]) -> mx.array:
    if isinstance(prompt, mx.array):
        return prompt
    if isinstance(prompt, str):
        add_special = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
        prompt = tokenizer.encode(prompt, add_special_tokens=add_special)
    return mx.array(prompt)


def stream_generate(model, tokenizer, prompt, *, max_tokens: int = DEFAULT_MAX_TOKENS,
                    block_size=DEFAULT_BLOCK_SIZE, max_block_size: int = DEFAULT_MAX_BLOCK_SIZE,
                    sampler=None, stats: Optional[RunStats] = None, **kwargs) -> Generator:
    """Yield mlx-lm-style responses; the last one carries the run's ``stats`` (``RunStats``).
    ``block_size``: an integer, or ``"auto"`` (drafts chosen per round, up to
    ``max_block_size - 1``; see ``generate_step``).

    Stops at an EOS token like mlx-lm's ``stream_generate``.
    """
    tokenizer, prompt, stats = _start(tokenizer, prompt, stats)
    tokens = generate_step(prompt, model, max_tokens=max_tokens, block_size=block_size,
                           max_block_size=max_block_size, sampler=sampler, stats=stats, **kwargs)
    yield from _responses(tokens, tokenizer, prompt, max_tokens, stats)


def plain_stream_generate(model, tokenizer, prompt, *, max_tokens: int = DEFAULT_MAX_TOKENS,
                          sampler=None, logits_processors=None, prefill_step_size: int = 2048,
                          stats: Optional[RunStats] = None) -> Generator:
    """``stream_generate`` over mlx-lm's own plain decode of ``model.mlx_model`` (no drafter,
    no gate): the baseline that MTP must equal token for token at temperature 0."""
    tokenizer, prompt, stats = _start(tokenizer, prompt, stats)
    tokens = plain_generate_step(prompt, model, max_tokens=max_tokens, sampler=sampler,
                                 logits_processors=logits_processors,
                                 prefill_step_size=prefill_step_size, stats=stats)
    yield from _responses(tokens, tokenizer, prompt, max_tokens, stats)


def _start(tokenizer, prompt, stats):
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    return (tokenizer, encode_prompt(tokenizer, prompt),
            stats if stats is not None else RunStats())


def _responses(tokens: Iterator[Tuple[int, mx.array, bool]], tokenizer: TokenizerWrapper,
               prompt: mx.array, max_tokens: int, stats: RunStats) -> Generator:
    Response = MTPGenerationResponse
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    token, logprobs, from_draft, n = None, None, False, 0
    for n, (token, logprobs, from_draft) in enumerate(tokens, 1):
        if token in tokenizer.eos_token_ids:
            break
        detokenizer.add_token(token)
        if n == max_tokens:
            break
        yield Response(text=detokenizer.last_segment, token=token, logprobs=logprobs,
                       from_draft=from_draft, prompt_tokens=prompt.size,
                       prompt_tps=stats.prompt_tps, generation_tokens=n,
                       generation_tps=stats.generation_tps,
                       peak_memory=mx.get_peak_memory() / 1e9)
    tokens.close()
    detokenizer.finalize()
    yield Response(text=detokenizer.last_segment, token=token, logprobs=logprobs,
                   from_draft=from_draft, prompt_tokens=prompt.size, prompt_tps=stats.prompt_tps,
                   generation_tokens=n, generation_tps=stats.generation_tps,
                   peak_memory=stats.peak_memory_gb,
                   finish_reason="stop" if token in tokenizer.eos_token_ids else "length",
                   stats=stats)
