"""mlx-lm's ``batch_generate`` over batched MTP rounds (``mlx_mtp.decoding.batch_rounds``)."""

from __future__ import annotations

import time
from collections import deque
from typing import Any, List, Optional, Union

import mlx.core as mx
from mlx_lm.generate import BatchResponse, BatchStats
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlx_mtp.decoding.batch_rounds import BatchRounds
from mlx_mtp.decoding.block_chooser import AUTO
from mlx_mtp.decoding.limits import DEFAULT_MAX_BATCH, DEFAULT_MAX_BLOCK_SIZE
from mlx_mtp.errors import MTPError

# generate_step's per-sequence arguments batch_generate passes on (the same for every prompt)
_SEQUENCE_KWARGS = ("sampler", "logits_processors", "seed", "acceptance", "prefill_step_size")


def batch_generate(model, tokenizer, prompts: List[List[int]],
                   prompt_caches: Optional[List[List[Any]]] = None,
                   max_tokens: Union[int, List[int]] = 128, verbose: bool = False,
                   return_prompt_caches: bool = False, return_token_ids: bool = False,
                   return_logprobs: bool = False, **kwargs) -> BatchResponse:
    """Generate responses for a batch of prompts, as mlx-lm's ``batch_generate``.

    Up to ``max_batch`` sequences decode together in batched MTP rounds
    (``mlx_mtp.decoding.batch_rounds``); the rest join as others finish. At temperature 0 each
    text is what ``mlx_mtp.generate`` gives for its prompt alone.

    Args:
        model (MTPModel): The model, from ``mlx_mtp.load``.
        tokenizer (TokenizerWrapper): The tokenizer ``mlx_mtp.load`` returned.
        prompts (List[List[int]]): The prompts' token ids.
        prompt_caches: Must be None (use ``generate_step`` with a prompt cache per turn).
          Default: ``None``.
        max_tokens (Union[int, List[int]]): The most tokens per prompt, one for all or one per
          prompt. Default: ``128``.
        verbose (bool): Print progress and timing lines. Default: ``False``.
        return_prompt_caches (bool): Must be False. Default: ``False``.
        return_token_ids (bool): Return the generated token ids. Default: ``False``.
        return_logprobs (bool): Return each generated token's log probability.
          Default: ``False``.
        kwargs: ``block_size`` (default ``"auto"``), ``max_block_size`` (default ``6``) and
          ``max_batch`` (default ``8``), and ``generate_step``'s ``sampler``,
          ``logits_processors``, ``seed``, ``acceptance``, ``prefill_step_size`` (the same for
          every prompt).

    Returns:
        BatchResponse: mlx-lm's: the texts, ``BatchStats``, and the token ids and logprobs
          where asked for.
    """
    if prompt_caches is not None or return_prompt_caches:
        raise MTPError("batch_generate takes no prompt caches (prompt_caches, "
                       "return_prompt_caches): use generate_step with a prompt cache per turn")
    block_size = kwargs.pop("block_size", AUTO)
    max_block_size = kwargs.pop("max_block_size", DEFAULT_MAX_BLOCK_SIZE)
    max_batch = kwargs.pop("max_batch", DEFAULT_MAX_BATCH)
    unknown = sorted(set(kwargs) - set(_SEQUENCE_KWARGS))
    if unknown:
        raise MTPError(f"batch_generate got unexpected arguments: {', '.join(unknown)} "
                       f"(it takes block_size, max_block_size, max_batch, "
                       f"{', '.join(_SEQUENCE_KWARGS)})")
    budgets = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    if len(budgets) != len(prompts):
        raise MTPError(f"max_tokens has {len(budgets)} entries for {len(prompts)} prompts")
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    eos = tokenizer.eos_token_ids
    rounds = BatchRounds(model, max(1, min(max_batch, len(prompts))), block_size=block_size,
                         max_block_size=max_block_size)
    waiting = deque(range(len(prompts)))
    ids: List[List[int]] = [[] for _ in prompts]
    logprobs: List[List[float]] = [[] for _ in prompts]
    running = {}  # prompt index -> its sequence's token generator
    stats = BatchStats()
    started = time.perf_counter()
    mx.reset_peak_memory()
    while waiting or running:
        while waiting and len(running) < rounds.max_batch:
            i = waiting.popleft()
            joined = time.perf_counter()
            seq = rounds.start(mx.array(prompts[i]), max_tokens=budgets[i], **kwargs)
            stats.prompt_tokens += len(prompts[i])
            stats.prompt_time += time.perf_counter() - joined
            running[i] = (seq, rounds.tokens(seq))
        for i, (seq, tokens) in list(running.items()):
            while seq.out or seq.done:
                item = next(tokens, None)
                if item is None or item[0] in eos:
                    tokens.close()
                    del running[i]
                    if verbose:
                        print(f"[batch_generate] Finished processing "
                              f"{len(prompts) - len(waiting) - len(running)}/{len(prompts)}",
                              end="\r")
                    break
                ids[i].append(item[0])
                stats.generation_tokens += 1
                if return_logprobs:
                    logprobs[i].append(item[1][item[0]].item())
        if running:
            decoding = time.perf_counter()
            rounds.round()
            stats.decode_time += time.perf_counter() - decoding
            stats.generation_steps += 1
    stats.wall_time = time.perf_counter() - started
    stats.peak_memory = mx.get_peak_memory() / 1e9
    if verbose:
        print()
        print(f"[batch_generate] Prompt: {stats.prompt_tokens} tokens, "
              f"{stats.prompt_tps:.3f} tokens-per-sec")
        print(f"[batch_generate] Generation: {stats.generation_tokens} tokens, "
              f"{stats.generation_tps:.3f} tokens-per-sec")
        print(f"[batch_generate] Peak memory: {stats.peak_memory:.3f} GB")
    return BatchResponse([tokenizer.decode(x) for x in ids], stats, None,
                         ids if return_token_ids else None,
                         logprobs if return_logprobs else None)
