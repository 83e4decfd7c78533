"""``stream_generate``: mlx-lm-style responses (text segments, then one carrying the run's
``RunStats``) over the speculative loop, or over plain decode of the same target."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generator, Iterator, List, Optional, Tuple, Union

import mlx.core as mx
from mlx_lm.generate import GenerationResponse, wired_limit
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .block_chooser import AUTO, DEFAULT_MAX_BLOCK_SIZE
from .diagnostics import RunStats
from .errors import MTPError
from .plain import plain_generate_step
from .speculative import check_no_draft_model, speculative_generate_step

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


def stream_generate(model, tokenizer, prompt: Union[str, mx.array, List[int]],
                    max_tokens: int = DEFAULT_MAX_TOKENS, draft_model=None, stream=None, *,
                    block_size=DEFAULT_BLOCK_SIZE, max_block_size: int = DEFAULT_MAX_BLOCK_SIZE,
                    stats: Optional[RunStats] = None,
                    **kwargs) -> Generator:
    """mlx-lm's ``stream_generate``: yields ``GenerationResponse``s (``text``, ``token``,
    ``logprobs``, ``from_draft``, ``prompt_tokens``, ``prompt_tps``, ``generation_tokens``,
    ``generation_tps``, ``peak_memory``, ``finish_reason``); the last one also carries the run's
    ``stats`` (``RunStats``). Stops at an EOS token. ``block_size``: an integer, or ``"auto"``
    (drafts chosen per round, up to ``max_block_size - 1``; see ``generate_step``). ``kwargs`` go
    to ``generate_step`` (mlx-lm's arguments and ours). ``draft_model`` (and ``num_draft_tokens``)
    must be None: the drafter is the model's MTP head.
    ``stream``: run on this MLX stream (default: the current one).
    """
    check_no_draft_model(draft_model, kwargs.pop("num_draft_tokens", None))
    if max_tokens == 0:
        raise MTPError("max_tokens must be non-zero (use -1 for no limit)")
    tokenizer, prompt, stats = _start(tokenizer, prompt, stats)
    tokens = speculative_generate_step(prompt, model, stream=stream, max_tokens=max_tokens,
                                       block_size=block_size, max_block_size=max_block_size,
                                       stats=stats, **kwargs)
    with wired_limit(model.mlx_model, [stream] if stream is not None else None):
        yield from _responses(tokens, tokenizer, prompt, max_tokens, stats)


def generate(model, tokenizer, prompt: Union[str, List[int]], verbose: bool = False,
             **kwargs) -> str:
    """mlx-lm's ``generate``: the whole response as text. ``verbose`` prints the text as it comes
    and then mlx-lm's speed lines, plus one line on MTP. ``kwargs`` go to ``stream_generate``."""
    if verbose:
        print("=" * 10)
    text, response = "", None
    for response in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose:
        print()
        print("=" * 10)
        if len(text) == 0:
            print("No text generated for this prompt")
            return text
        print(f"Prompt: {response.prompt_tokens} tokens, "
              f"{response.prompt_tps:.3f} tokens-per-sec")
        print(f"Generation: {response.generation_tokens} tokens, "
              f"{response.generation_tps:.3f} tokens-per-sec")
        print(f"Peak memory: {response.peak_memory:.3f} GB")
        print(_mtp_line(response.stats))
    return text


def _mtp_line(stats: RunStats) -> str:
    if not stats.mtp_enabled:
        return f"MTP: off ({stats.gate_reason})"
    if stats.block_size == 1:
        return "MTP: block size 1 (plain decode through the round loop)"
    return (f"MTP: block size {stats.block_size}, {stats.accepted} of {stats.drafted} drafts "
            f"accepted ({stats.acceptance_rate:.3f}), {stats.tokens_per_round:.3f} tokens per round")


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
