"""mlx-lm's ``GenerationResponse`` stream from a stream of ``(token, logprobs, from_draft)``:
what ``stream_generate``, the plain-decode baseline and the server's batched requests share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generator, Iterator, List, Optional, Tuple, Union

import mlx.core as mx
from mlx_lm.generate import GenerationResponse
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlx_mtp.decoding.stats import RunStats


@dataclass
class MTPGenerationResponse(GenerationResponse):
    """mlx-lm's response; the last one of a run also carries ``stats``."""

    stats: Optional[RunStats] = None


def encode_prompt(tokenizer, prompt: Union[str, List[int], mx.array]) -> mx.array:
    """The prompt's ids as mlx-lm's ``stream_generate`` encodes them: special tokens added
    unless the text already starts with the BOS token."""
    if isinstance(prompt, mx.array):
        return prompt
    if isinstance(prompt, str):
        add_special = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
        prompt = tokenizer.encode(prompt, add_special_tokens=add_special)
    return mx.array(prompt)


def prepare(tokenizer, prompt, stats: Optional[RunStats]
            ) -> Tuple[TokenizerWrapper, mx.array, RunStats]:
    """``(tokenizer wrapped as mlx-lm wraps it, the prompt's ids, stats or a fresh RunStats)``."""
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    return (tokenizer, encode_prompt(tokenizer, prompt),
            stats if stats is not None else RunStats())


def stream_responses(tokens: Iterator[Tuple[int, mx.array, bool]], tokenizer: TokenizerWrapper,
                     prompt: mx.array, max_tokens: int, stats: RunStats) -> Generator:
    """One ``MTPGenerationResponse`` per token until an EOS token or ``max_tokens``, as mlx-lm's
    ``stream_generate`` yields them; the last one has the ``finish_reason`` and the ``stats``.
    ``tokens`` is closed when the responses end."""
    Response = MTPGenerationResponse
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    token, logprobs, from_draft, n = None, None, False, 0
    try:
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
    finally:
        tokens.close()  # a prompt cache now holds the prompt and exactly the tokens yielded
    detokenizer.finalize()
    yield Response(text=detokenizer.last_segment, token=token, logprobs=logprobs,
                   from_draft=from_draft, prompt_tokens=prompt.size, prompt_tps=stats.prompt_tps,
                   generation_tokens=n, generation_tps=stats.generation_tps,
                   peak_memory=stats.peak_memory_gb,
                   finish_reason="stop" if token in tokenizer.eos_token_ids else "length",
                   stats=stats)
