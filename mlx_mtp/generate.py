"""Text generation with MTP, as mlx-lm's ``generate.py``: ``generate``, ``stream_generate``,
``generate_step`` and ``speculative_generate_step`` for Python, and ``main()`` for
``python -m mlx_mtp.generate``.

The CLI mirrors ``mlx_lm.generate``: the text first, then one table of the run's statistics
(or one JSON object with ``--json``). ``--no-mtp`` runs mlx-lm's own plain decode of the same
target, for comparison.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Generator, List, Optional, Union

import mlx.core as mx
from mlx_lm.generate import wired_limit
from mlx_lm.sample_utils import make_logits_processors
from tabulate import tabulate

from mlx_mtp.cli import (Parser, add_speculation_args, cli_main, non_negative_float,
                         non_negative_int, positive_int, speculation_options, temperature,
                         unit_interval)
from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.cpu import lazy_ops, native
from mlx_mtp.decoding.api import check_no_draft_model, generate_step, speculative_generate_step
from mlx_mtp.decoding.block_chooser import AUTO, BlockChooser
from mlx_mtp.decoding.limits import DEFAULT_MAX_BLOCK_SIZE, DEFAULT_MAX_TOKENS
from mlx_mtp.decoding.plain import plain_stream_generate
from mlx_mtp.decoding.responses import prepare, stream_responses
from mlx_mtp.decoding.sampling import make_sampler
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.demo import (DEMO_DECODE, REPETITION_CONTEXT_SIZE, model_or_demo,
                          repetition_settings)
from mlx_mtp.errors import MTPError
from mlx_mtp.exactness.gate import gate_rows
from mlx_mtp.models import loader
from mlx_mtp.models.distributed import SPLITS
from mlx_mtp.models.draft_profile import profile_rows

__all__ = ["generate", "stream_generate", "generate_step", "speculative_generate_step", "main"]


def stream_generate(model, tokenizer, prompt: Union[str, mx.array, List[int]],
                    max_tokens: int = DEFAULT_MAX_TOKENS, draft_model=None, stream=None, *,
                    block_size: Union[int, str, BlockChooser] = AUTO,
                    max_block_size: int = DEFAULT_MAX_BLOCK_SIZE,
                    stats: Optional[RunStats] = None, **kwargs) -> Generator:
    """A generator of text from the prompt, as mlx-lm's ``stream_generate``; stops at EOS.

    Args:
        model (MTPModel): The model, from ``mlx_mtp.load``.
        tokenizer (TokenizerWrapper): The tokenizer ``mlx_mtp.load`` returned (or one to wrap).
        prompt (Union[str, mx.array, List[int]]): The prompt text or its token ids.
        max_tokens (int): The most tokens to generate; ``-1``: no limit. Default: ``256``.
        draft_model: Must be None: the drafter is the model's MTP head. Default: ``None``.
        stream (mx.Stream, optional): Run on this MLX stream. Default: ``None`` (the current one).
        block_size (Union[int, str, BlockChooser]): Tokens verified per round, drafts + 1, or
          ``"auto"`` (see ``generate_step``). Default: ``"auto"``.
        max_block_size (int): The widest block ``"auto"`` may choose. Default: ``6``.
        stats (RunStats, optional): Filled with the run's statistics. Default: ``None``.
        kwargs: The rest go to ``generate_step`` (mlx-lm's arguments and ours); mlx-lm's
          ``num_draft_tokens`` must be None.

    Yields:
        MTPGenerationResponse: mlx-lm's ``GenerationResponse`` (``text``, ``token``,
          ``logprobs``, ``from_draft``, ``prompt_tokens``, ``prompt_tps``,
          ``generation_tokens``, ``generation_tps``, ``peak_memory``, ``finish_reason``); the
          last one also carries the run's ``stats`` (``RunStats``).
    """
    check_no_draft_model(draft_model, kwargs.pop("num_draft_tokens", None))
    if max_tokens == 0:
        raise MTPError("max_tokens must be non-zero (use -1 for no limit)")
    tokenizer, prompt, stats = prepare(tokenizer, prompt, stats)
    tokens = speculative_generate_step(prompt, model, stream=stream, max_tokens=max_tokens,
                                       block_size=block_size, max_block_size=max_block_size,
                                       stats=stats, **kwargs)
    with wired_limit(model.mlx_model, [stream] if stream is not None else None):
        yield from stream_responses(tokens, tokenizer, prompt, max_tokens, stats)


def generate(model, tokenizer, prompt: Union[str, List[int]], verbose: bool = False,
             **kwargs) -> str:
    """Generate a complete response, as mlx-lm's ``generate``.

    Args:
        model (MTPModel): The model, from ``mlx_mtp.load``.
        tokenizer (TokenizerWrapper): The tokenizer ``mlx_mtp.load`` returned.
        prompt (Union[str, List[int]]): The prompt text or its token ids.
        verbose (bool): Print the text as it comes, then mlx-lm's speed lines and one line on
          MTP. Default: ``False``.
        kwargs: The rest go to ``stream_generate`` (and on to ``generate_step``).

    Returns:
        str: The generated text.
    """
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


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m mlx_mtp.generate",
               description="Generate text with MTP speculative decoding (exact at --temp 0).")
    p.add_argument("--model", help="local folder or Hugging Face repo id of the target "
                   "(default: the embedded demo pair, mlx_mtp/demo_pair)")
    p.add_argument("--drafter", help="folder or repo id of a separate MTP head (qwen3_5_mtp), "
                   "or the Gemma 4 assistant (gemma4_assistant; required for Gemma 4)")
    p.add_argument("--prompt", type=prompt_text, default=None,
                   help="prompt text (default: the start of a Python class, for the demo pair)")
    p.add_argument("--max-tokens", type=positive_int, default=DEFAULT_MAX_TOKENS,
                   help=f"most tokens to generate (default {DEFAULT_MAX_TOKENS})")
    add_speculation_args(p)  # --block-size ... --draft-bf16, as the server's
    p.add_argument("--temp", type=temperature, default=0.0,
                   help="sampling temperature (default 0: greedy, identical to plain decode)")
    p.add_argument("--top-p", type=unit_interval, default=0.0, help="sampling top-p (0: off)")
    p.add_argument("--min-p", type=unit_interval, default=0.0, help="sampling min-p (0: off)")
    p.add_argument("--top-k", type=non_negative_int, default=0, help="sampling top-k (0: off)")
    p.add_argument("--min-tokens-to-keep", type=positive_int, default=1,
                   help="tokens min-p always keeps")
    p.add_argument("--repetition-penalty", type=non_negative_float, default=None,
                   help=f"mlx-lm's repetition penalty (default: none; with the demo pair "
                        f"{DEMO_DECODE.repetition_penalty})")
    p.add_argument("--repetition-context-size", type=positive_int, default=None,
                   help=f"tokens of history the repetition penalty looks at (default "
                        f"{REPETITION_CONTEXT_SIZE}; with the demo pair "
                        f"{DEMO_DECODE.repetition_context_size})")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--no-mtp", action="store_true",
                   help="plain decode of the same target through mlx-lm, for comparison")
    p.add_argument("--ignore-chat-template", action="store_true",
                   help="feed the prompt as is, even if the tokenizer has a chat template")
    p.add_argument("--split", choices=SPLITS, default=None,
                   help="split the target over the processes mlx.launch started: pipeline "
                        "(layers) or tensor (heads); output on rank 0 only")
    p.add_argument("--verbose", type=str2bool, default=True, metavar="{True,False}",
                   help="after the text, print the run's statistics to stderr (default True; "
                        "False: the text only), as mlx_lm.generate's --verbose")
    p.add_argument("--stats", choices=("short", "full"), default="short",
                   help="the statistics table: short (what a run's flags change: MTP on or off, "
                        "tok/s, acceptance, block sizes) or full (also the counts, time per "
                        "phase, the drafter step, the BLAS and the C kernels); docs/usage.md "
                        "explains every row")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


# Code, like the demo pair's corpus (the Python standard library). It ends inside the method's
# body: the demo tokenizer merges a newline with the next line's indent, so a bare trailing
# newline is a token the model rarely saw there.
DEFAULT_PROMPT = ("class Stack:\n    def __init__(self):\n        self.items = []\n\n"
                  "    def push(self, item):\n        ")


def prompt_text(s: str) -> str:
    if not s:
        raise argparse.ArgumentTypeError("expected some text to continue, got an empty string")
    return s


def str2bool(s: str) -> bool:
    """mlx_lm.generate's ``--verbose`` values: True / T / False / F, any case."""
    if s.lower() in ("true", "t"):
        return True
    if s.lower() in ("false", "f"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {s!r}")


def prepare_prompt(tokenizer, text: str, ignore_chat_template: bool):
    """The prompt as the CLI feeds it: one user message through the tokenizer's chat template,
    unless it has none or ``ignore_chat_template``."""
    if not ignore_chat_template and getattr(tokenizer, "has_chat_template", False):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=True)
    return text


def _without_eos(tokens, tokenizer):
    return tokens[:-1] if tokens and tokens[-1] in tokenizer.eos_token_ids else tokens


def run(args) -> dict:
    args.repetition_penalty, args.repetition_context_size = repetition_settings(
        args.model, args.repetition_penalty, args.repetition_context_size)
    args.model = model_or_demo(args.model, args.drafter)
    # before loading: bad settings fail at once
    speculation, draft_options = speculation_options(args)
    speculation.check_sampling(args.temp > 0)
    need_head = not args.no_mtp and speculation.widest > 1
    model, tokenizer = loader.load(args.model, drafter=args.drafter, require_head=need_head,
                                     draft_options=draft_options, split=args.split)
    prompt = prepare_prompt(tokenizer, args.prompt if args.prompt is not None else DEFAULT_PROMPT,
                            args.ignore_chat_template)
    sampler = make_sampler(temp=args.temp, top_p=args.top_p, min_p=args.min_p,
                           min_tokens_to_keep=args.min_tokens_to_keep, top_k=args.top_k)
    sampler.check_vocab(model.target.vocab_size)
    processors = make_logits_processors(repetition_penalty=args.repetition_penalty,
                                        repetition_context_size=args.repetition_context_size)
    if args.seed is None and model.split is not None and args.temp > 0:
        args.seed = model.split.shared_seed()  # every rank must draw the same tokens
    if args.seed is not None:  # after loading: building the model draws from the global stream
        mx.random.seed(args.seed)
    if args.no_mtp:  # mlx-lm's own plain decode of the target, for comparison
        stats = RunStats(block_size=1, mtp_enabled=False,
                         gate_reason="--no-mtp: mlx-lm plain decode")
        responses = list(plain_stream_generate(model, tokenizer, prompt,
                                               max_tokens=args.max_tokens, sampler=sampler,
                                               logits_processors=processors, stats=stats))
    else:
        stats = RunStats()
        responses = list(stream_generate(model, tokenizer, prompt, max_tokens=args.max_tokens,
                                         sampler=sampler, stats=stats,
                                         logits_processors=processors,
                                         **replace(speculation, seed=args.seed).as_kwargs()))
    text = "".join(r.text for r in responses)
    tokens = _without_eos([r.token for r in responses], tokenizer)
    out = {"text": text, "tokens": tokens, "cpu_blas": cpu_blas.STATE.describe(),
           "cpu_kernels": _kernel_mode(), "model": str(args.model), "drafter": args.drafter,
           "mtp_enabled": not args.no_mtp, "temperature": args.temp,
           "draft": model.drafter.describe() if model.drafter is not None else None}
    out.update(sampler.describe(), seed=args.seed, repetition_penalty=args.repetition_penalty,
               repetition_context_size=args.repetition_context_size)
    out.update(stats.to_dict())
    if model.split is not None:  # only rank 0 prints (mlx_mtp.cli.cli_main)
        out["rank"] = model.split.rank
    return out


def _kernel_mode() -> str:
    """How mlx_mtp's C kernels run here: ``lazy``, ``eager (why)``, or ``none (why)``."""
    problem = native.cpu_problem()
    return f"none ({problem})" if problem else lazy_ops.mode()


def print_report(result: dict, stats_rows, verbose: bool = True) -> None:
    """The text on stdout; the statistics on stderr, so that ``> out.txt`` keeps the text only."""
    print(result["text"], flush=True)
    if verbose:
        print("=" * 40, file=sys.stderr)
        print(tabulate(stats_rows, headers=["statistic", "value"], tablefmt="simple"),
              file=sys.stderr)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    full = args.stats == "full"
    return cli_main(parser, run, lambda result: print_report(
        result, gate_rows(result, full) + _rows_from_result(result, full), args.verbose),
        args=args)


def _rate(tokens: int, tps: float) -> str:
    """``N tokens, R tok/s``; a rate needs time to measure: ``n/a`` for a run without any."""
    return f"{tokens} tokens, " + (f"{tps:.1f} tok/s" if tps > 0 else "n/a tok/s")


def _rows_from_result(result: dict, full: bool = False):
    """The table's rows after the gate's: what a run's flags change (speed, acceptance, block
    sizes) and with ``full`` also the counts, phases, drafter, BLAS and kernels."""
    rows = [
        ("prompt", _rate(result["prompt_tokens"], result["prompt_tps"])),
        ("generation", _rate(result["generation_tokens"], result["generation_tps"])),
    ]
    if result["mtp_enabled"]:
        tree = result.get("draft_topk", 1) > 1
        if full or result["temperature"] > 0:
            rows.append(("acceptance rule", result["acceptance_rule"]))
        rows += [
            ("tokens per round", f"{result['tokens_per_round']:.3f}"),
            ("block size", result["block_size"] if result["block_size"] != AUTO
             else f"auto (up to {result['max_block_size']})"),
            ("block sizes used (width: rounds)", ", ".join(
                f"{w}: {n}" for w, n in result["block_sizes"].items()) or "-"),
        ]
        if full:
            rows += [
                ("rounds", result["rounds"]),
                ("drafted / accepted", f"{result['drafted']} / {result['accepted']}"),
                ("acceptance rate", f"{result['acceptance_rate']:.3f}"),
            ]
        if result.get("draft_processors"):  # (None: no processors, or no draft made)
            rows.append(("logits processors on drafts", result["draft_processors"]))
        if tree:
            rows += [("draft tree", f"top {result['draft_topk']} per node, at most "
                                    f"{result['draft_tokens']} nodes"),
                     ("tree rounds", f"{result['tree_rounds']} of {result['rounds']}")]
        if tree and full:
            rows += [("tree nodes verified per tree round",
                      f"{result['tree_nodes_per_round']:.2f}"),
                     ("accepted nodes by sibling rank (0: the head's first choice)",
                      ", ".join(map(str, result["accepted_by_sibling_rank"])) or "-")]
        for j, (rate, n) in enumerate(zip(result["per_position_acceptance"],
                                          result["per_position_rounds"]), 1):
            # the share of the rounds that drafted position j (reached depth j) where it was kept
            rows.append((f"depth {j} reached" if tree else f"draft {j} accepted",
                         f"{rate:.3f} (of {n} rounds)"))
        if full:
            per_round = max(result["rounds"], 1)
            for phase, ms in result["phase_ms"].items():
                rows.append((f"{phase} ms/round", f"{ms / per_round:.2f}"))
            rows += profile_rows(result.get("draft_profile"))
    if result.get("split"):
        rows.append(("split", result["split"]))
        if full:
            rows.append(("collectives per token (rank 0)",
                         f"{result['split_messages_per_token']:.2f} "
                         f"({result['split_bytes_per_token'] / 1e3:.1f} kB)"))
    rows.append(("peak memory", f"{result['peak_memory_gb']:.3f} GB"))
    if full:
        rows.append(("cpu blas", result["cpu_blas"]))
        rows.append(("C kernels", result["cpu_kernels"]))
    return rows


if __name__ == "__main__":
    sys.exit(main())
