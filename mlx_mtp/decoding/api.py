"""The round loop's public entry points, as mlx-lm's: ``speculative_generate_step`` and
``generate_step``, with their argument checks. ``mlx_mtp.generate`` re-exports them; the loop
itself is ``mlx_mtp.decoding.rounds``."""

from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Callable, Generator, List, Optional, Tuple, Union

import mlx.core as mx
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START

from mlx_mtp import config as env
from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.decoding import sampling
from mlx_mtp.decoding.block_chooser import AUTO, BlockChooser
from mlx_mtp.decoding.limits import DEFAULT_MAX_BLOCK_SIZE, DEFAULT_MAX_TOKENS
from mlx_mtp.decoding.request import Request
from mlx_mtp.decoding.round_session import SYNC_PHASES_ENV
from mlx_mtp.decoding.round_steps import Emitted
from mlx_mtp.decoding.rounds import generate_rounds
from mlx_mtp.decoding.speculation import SpeculationOptions
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.errors import MTPError
from mlx_mtp.io.kv_settings import KVSettings, note_max_kv_size
from mlx_mtp.decoding.prompt_cache import PromptCache, Turn, check_prompt_cache, make_prompt_cache
from mlx_mtp.models.model import MTPModel
from mlx_mtp.models.protocols import Drafter

__all__ = ["speculative_generate_step", "generate_step", "check_no_draft_model",
           "checked_max_tokens", "checked_prompt"]


def speculative_generate_step(
    prompt: mx.array,
    model: MTPModel,
    draft_model=None,
    stream=None,
    *,
    num_draft_tokens: Optional[int] = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    sampler: Optional[Callable[[mx.array], mx.array]] = None,
    logits_processors: Optional[List[Callable[[mx.array, mx.array], mx.array]]] = None,
    max_kv_size: Optional[int] = None,
    prompt_cache: Optional[PromptCache] = None,
    prefill_step_size: int = 2048,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    input_embeddings: Optional[mx.array] = None,
    block_size: Union[int, str, BlockChooser] = AUTO,
    max_block_size: int = DEFAULT_MAX_BLOCK_SIZE,
    seed: Optional[int] = None,
    acceptance: str = "auto",
    stats: Optional[RunStats] = None,
    draft_topk: int = 1,
    draft_tokens: Optional[int] = None,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Yield ``(token, logprobs, from_draft)``, as mlx-lm's ``speculative_generate_step``.

    mlx-lm ``generate_step``'s arguments keep their meaning and defaults; the drafter is the
    model's own MTP head, so mlx-lm's ``draft_model`` and ``num_draft_tokens`` are there for its
    call shape only.
    At temperature 0 the tokens are mlx-lm's plain greedy decode of the target, token for token.

    Args:
        prompt (mx.array): The prompt's token ids, 1-D and non-empty.
        model (MTPModel): The model, from ``mlx_mtp.load``.
        draft_model: Must be None. Default: ``None``.
        stream (mx.Stream, optional): Run on this MLX stream. Default: ``None`` (the current one).
        num_draft_tokens: Must be None; ``block_size`` sets the drafts. Default: ``None``.
        max_tokens (int): The most tokens to yield; ``-1``: no limit. Default: ``256``.
        sampler (Callable, optional): mlx-lm's sampler; one from ``mlx_mtp.make_sampler`` also
          lets the loop read the distribution (speculative sampling). Default: ``None`` (argmax).
        logits_processors (List[Callable], optional): mlx-lm's logits processors; the logprobs
          yielded are the processed ones. Default: ``None``.
        max_kv_size (int, optional): mlx-lm's rotating-cache size. Default: ``None``.
        prompt_cache (List[Any], optional): From ``mlx_mtp.make_prompt_cache``; updated in place
          to hold the prompt and every token yielded. Default: ``None``.
        prefill_step_size (int): Prompt tokens per prefill chunk. Default: ``2048``.
        kv_bits (int, optional): Quantize the KV cache to these bits. Default: ``None``.
        kv_group_size (int): The KV quantization's group size. Default: ``64``.
        quantized_kv_start (int): Tokens before the KV cache is quantized. Default: ``5000``.
        prompt_progress_callback (Callable[[int, int], None], optional): Called with the prompt
          tokens processed so far and their total. Default: ``None``.
        input_embeddings (mx.array, optional): ``[prompt length, hidden size]`` embeddings fed
          instead of the prompt's; the head still drafts from the ids. Default: ``None``.
        block_size (Union[int, str, BlockChooser]): Tokens verified per round, drafts + 1
          (1: plain decode through the same loop); ``"auto"``: each round's drafts chosen from
          the acceptance and round costs measured so far (``mlx_mtp.decoding.block_chooser``;
          its sampled draws are keyed per output position, so they do not depend on the
          choices); or a ``BlockChooser`` to tune it. Default: ``"auto"``.
        max_block_size (int): The widest block ``"auto"`` may choose. Default: ``6``.
        seed (int, optional): Seeds speculative sampling's key streams, or under ``"auto"`` the
          per-position keys. Default: ``None`` (drawn from mlx's global random state).
        acceptance (str): The rule at temperature > 0: ``"auto"``, ``"point-mass"`` or
          ``"speculative-sampling"`` (``mlx_mtp.decoding.acceptance``); temperature 0 is always
          greedy. Default: ``"auto"``.
        stats (RunStats, optional): Filled with the run's statistics. Default: ``None``.
        draft_topk (int): Above 1, each round drafts a tree (``mlx_mtp.draft_tree``)
          with this many children per node, its depth the block size less one, walked at
          temperature > 0 by the point-mass rule; under ``"auto"`` (temperature 0 only) each
          round drafts a chain or a tree, whichever measured faster. Default: ``1`` (chains).
        draft_tokens (int, optional): The most draft nodes a tree verifies per round.
          Default: ``None`` (``draft_topk`` per depth).

    Yields:
        Tuple[int, mx.array, bool]: One token, its vector of log probabilities, and whether it
          was a draft the target accepted. On a split target every step is bounded by the
          split's watchdog (``mlx_mtp.models.distributed``).
    """
    check_no_draft_model(draft_model, num_draft_tokens)
    max_tokens = checked_max_tokens(max_tokens)
    speculation = SpeculationOptions(block_size=block_size, max_block_size=max_block_size,
                                     draft_topk=draft_topk, draft_tokens=draft_tokens,
                                     acceptance=acceptance, seed=seed)
    speculation.check_sampling(not sampling.is_argmax(sampler))
    speculation.check_model(model)
    cpu_blas.verify_thread_count()  # a bad MLX_MTP_VERIFY_THREADS fails before any work
    env.flag(SYNC_PHASES_ENV)  # as a bad MLX_MTP_SYNC_PHASES does
    prompt = checked_prompt(prompt, input_embeddings)
    kv = KVSettings(kv_bits, kv_group_size, quantized_kv_start).check(model.target)
    cache = _session_cache(model, prompt_cache, max_kv_size)
    drafter = _drafter(model, speculation.widest)
    # The caller's cache must end holding exactly the tokens yielded (``Turn.finish``).
    turn = Turn(model, cache, kv, drafter) if prompt_cache is not None else None
    request = Request(max_tokens=max_tokens, sampler=sampler,
                      logits_processors=logits_processors, prefill_step_size=prefill_step_size,
                      progress=prompt_progress_callback, input_embeddings=input_embeddings,
                      block_size=speculation.widest, chooser=speculation.make_chooser(),
                      seed=speculation.seed, acceptance=speculation.acceptance, stats=stats,
                      tree=speculation.tree)
    context = mx.stream(stream) if stream is not None else contextlib.nullcontext()
    with context:
        tokens = _finish_turn(generate_rounds(prompt, model, cache, kv, turn, drafter, request),
                              turn)
        if getattr(model, "split", None) is not None:
            # the turn's finish too: it may run a forward, which every rank takes together
            tokens = model.split.guard(tokens)
        yield from tokens


def generate_step(prompt: mx.array, model: MTPModel, stream=None, **kwargs
                  ) -> Generator[Tuple[int, mx.array], None, None]:
    """Yield ``(token, logprobs)``, as mlx-lm's ``generate_step``.

    Args:
        prompt (mx.array): The prompt's token ids.
        model (MTPModel): The model, from ``mlx_mtp.load``.
        stream (mx.Stream, optional): Run on this MLX stream. Default: ``None`` (the current one).
        kwargs: ``speculative_generate_step``'s keyword arguments (shown by
          ``inspect.signature``), less ``draft_model`` and ``num_draft_tokens``.

    Yields:
        Tuple[int, mx.array]: One token and its vector of log probabilities.
    """
    steps = speculative_generate_step(prompt, model, stream=stream, **kwargs)
    try:
        for token, logprobs, _ in steps:
            yield token, logprobs
    finally:
        steps.close()  # a prompt cache ends at exactly the tokens yielded (GeneratorExit)


generate_step.__signature__ = inspect.signature(speculative_generate_step).replace(
    parameters=[p for p in inspect.signature(speculative_generate_step).parameters.values()
                if p.name not in ("draft_model", "num_draft_tokens")],
    return_annotation=Generator[Tuple[int, mx.array], None, None])


def check_no_draft_model(draft_model, num_draft_tokens) -> None:
    """mlx-lm's separate-draft-model arguments: one clear error each (MTP drafts with the
    target's own head)."""
    if draft_model is not None:
        raise MTPError("draft_model is not supported: mlx_mtp drafts with the target's own MTP "
                       "head (load it with mlx_mtp.load(..., drafter=...)); for a separate "
                       "draft model use mlx-lm's own functions")
    if num_draft_tokens is not None:
        raise MTPError("num_draft_tokens is mlx-lm's setting for a separate draft model: "
                       "use block_size (tokens verified per round = drafts + 1)")


def checked_max_tokens(max_tokens) -> int:
    """A positive integer, or -1 for no limit (returned as ``sys.maxsize``)."""
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or \
            not (max_tokens >= 1 or max_tokens == -1):
        raise MTPError(f"max_tokens must be a positive integer or -1 (no limit), got "
                       f"{max_tokens!r}")
    return sys.maxsize if max_tokens == -1 else max_tokens


def checked_prompt(prompt, input_embeddings: Optional[mx.array]) -> mx.array:
    prompt = mx.array(prompt) if not isinstance(prompt, mx.array) else prompt
    if prompt.ndim != 1 or prompt.size == 0:
        raise MTPError("the prompt must be a non-empty 1-D array of token ids (with "
                       "input_embeddings too: the MTP head drafts from token ids)")
    if input_embeddings is not None and (input_embeddings.ndim != 2 or
                                         input_embeddings.shape[0] != prompt.size):
        raise MTPError(f"input_embeddings must be [prompt length, hidden size] = "
                       f"[{prompt.size}, ...], got shape {tuple(input_embeddings.shape)}")
    return prompt


def _session_cache(model: MTPModel, prompt_cache: Optional[PromptCache],
                   max_kv_size: Optional[int]) -> PromptCache:
    """The caller's prompt cache, checked, or a fresh one."""
    if prompt_cache is None:  # as in mlx-lm, max_kv_size only matters when making the cache
        note_max_kv_size(model, max_kv_size)
        return make_prompt_cache(model)
    return check_prompt_cache(model, prompt_cache)


def _drafter(model: MTPModel, block_size: int) -> Optional[Drafter]:
    """The model's MTP head when rounds draft (block size above 1), else None."""
    drafter = model.drafter if block_size > 1 else None
    if block_size > 1 and drafter is None:
        raise MTPError("this model has no MTP head: load one with drafter= (--drafter), "
                       "or use block_size=1")
    return drafter


def _finish_turn(tokens: Generator[Emitted, None, None], turn: Optional[Turn]
                 ) -> Generator[Emitted, None, None]:
    """``tokens``, then a prompt cache's turn finished at exactly the tokens yielded: when they
    ran out or the caller closed the generator; an error leaves the cache as mlx-lm would."""
    yielded = 0
    finish = turn is not None
    try:
        for item in tokens:
            yielded += 1
            yield item
    except BaseException as e:
        finish = finish and isinstance(e, GeneratorExit)
        raise
    finally:
        tokens.close()
        if finish:
            turn.finish(yielded)
