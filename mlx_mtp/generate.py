"""The CLI: ``python -m mlx_mtp.generate`` (the library call is ``mlx_mtp.stream_generate``).

Mirrors ``mlx_lm.generate``: the text first, then one table of the run's statistics
(or one JSON object with ``--json``). ``--no-mtp`` runs mlx-lm's own plain decode of the same
target, for comparison.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import types

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors
from tabulate import tabulate

from . import cpu_blas, loading
from .block_chooser import AUTO, DEFAULT_MAX_BLOCK_SIZE
from .cli import (Parser, block_size, block_size_or_auto, cli_main, non_negative_float,
                  non_negative_int, positive_int, temperature, unit_interval)
from .demo import model_or_demo
from .diagnostics import RunStats
from .distributed import SPLITS
from .draft_profile import table_rows as draft_profile_rows
from .gate import table_rows as gate_table_rows
from .qwen3_5.options import QUANT_BITS, QUANT_GROUP_SIZES, DraftOptions
from .sampling import REQUESTABLE_RULES, make_sampler
from .speculative import MAX_BLOCK_SIZE
from .stream import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_TOKENS, plain_stream_generate, stream_generate
from .stream import generate as generate_text


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m mlx_mtp.generate",
               description="Generate text with MTP speculative decoding (exact at --temp 0).")
    p.add_argument("--model", help="local folder or Hugging Face repo id of the target "
                   "(default: the embedded demo pair, mlx_mtp/demo_pair)")
    p.add_argument("--drafter", help="folder or repo id of a separate MTP head (qwen3_5_mtp), "
                   "or the Gemma 4 assistant (gemma4_assistant; required for Gemma 4)")
    p.add_argument("--prompt", default=None, help="prompt text (default: a short code prompt)")
    p.add_argument("--max-tokens", type=positive_int, default=DEFAULT_MAX_TOKENS)
    p.add_argument("--block-size", type=block_size_or_auto, default=DEFAULT_BLOCK_SIZE,
                   help=f"tokens verified per round, drafts + 1 (1..{MAX_BLOCK_SIZE}; 1 = plain "
                        f"decode through the MTP loop), or auto: chosen every round from the "
                        f"acceptance and round costs measured so far (default)")
    p.add_argument("--max-block-size", type=block_size, default=DEFAULT_MAX_BLOCK_SIZE,
                   help=f"the widest block --block-size auto may choose (default "
                        f"{DEFAULT_MAX_BLOCK_SIZE})")
    p.add_argument("--temp", type=temperature, default=0.0, help="sampling temperature")
    p.add_argument("--top-p", type=unit_interval, default=0.0, help="sampling top-p (0: off)")
    p.add_argument("--min-p", type=unit_interval, default=0.0, help="sampling min-p (0: off)")
    p.add_argument("--top-k", type=non_negative_int, default=0, help="sampling top-k (0: off)")
    p.add_argument("--min-tokens-to-keep", type=positive_int, default=1,
                   help="tokens min-p always keeps")
    p.add_argument("--repetition-penalty", type=non_negative_float, default=None,
                   help="mlx-lm's repetition penalty (e.g. 1.1; default: none)")
    p.add_argument("--repetition-context-size", type=positive_int, default=20,
                   help="tokens of history the repetition penalty looks at")
    p.add_argument("--acceptance", choices=REQUESTABLE_RULES, default="auto",
                   help="acceptance rule at temperature > 0 (auto: speculative-sampling when the "
                        "drafter can sample, else point-mass)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--draft-vocab", default=None,
                   help="reduced draft vocabulary sidecar folder (python -m mlx_mtp.draft_vocab)")
    p.add_argument("--draft-bits", type=int, choices=QUANT_BITS, default=None,
                   help="quantize the MTP head's projections at load (default: as loaded)")
    p.add_argument("--draft-group-size", type=int, choices=QUANT_GROUP_SIZES, default=64,
                   help="quantization group size for --draft-bits")
    p.add_argument("--draft-quantize-fc", action="store_true",
                   help="with --draft-bits, quantize the head's fc too")
    p.add_argument("--no-mtp", action="store_true",
                   help="plain decode of the same target through mlx-lm, for comparison")
    p.add_argument("--ignore-chat-template", action="store_true",
                   help="feed the prompt as is, even if the tokenizer has a chat template")
    p.add_argument("--split", choices=SPLITS, default=None,
                   help="split the target over the processes mlx.launch started: pipeline "
                        "(layers) or tensor (heads); output on rank 0 only")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


# Code, like the demo pair's corpus (the Python standard library).
DEFAULT_PROMPT = ("class Stack:\n    def __init__(self):\n        self.items = []\n\n"
                  "    def push(self, item):\n")


def _prepare_prompt(tokenizer, text: str, ignore_chat_template: bool):
    if not ignore_chat_template and getattr(tokenizer, "has_chat_template", False):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=True)
    return text


def _without_eos(tokens, tokenizer):
    return tokens[:-1] if tokens and tokens[-1] in tokenizer.eos_token_ids else tokens


def run(args) -> dict:
    args.model = model_or_demo(args.model, args.drafter)
    widest = args.max_block_size if args.block_size == AUTO else args.block_size
    need_head = not args.no_mtp and widest > 1
    options = DraftOptions(vocab=args.draft_vocab, bits=args.draft_bits,
                           group_size=args.draft_group_size, quantize_fc=args.draft_quantize_fc)
    model, tokenizer = loading.load(args.model, drafter=args.drafter, require_head=need_head,
                            draft_options=options, split=args.split)
    prompt = _prepare_prompt(tokenizer, args.prompt if args.prompt is not None else DEFAULT_PROMPT,
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
                                         block_size=args.block_size,
                                         max_block_size=args.max_block_size, sampler=sampler,
                                         stats=stats,
                                         logits_processors=processors, seed=args.seed,
                                         acceptance=args.acceptance))
    text = "".join(r.text for r in responses)
    tokens = _without_eos([r.token for r in responses], tokenizer)
    out = {"text": text, "tokens": tokens, "cpu_blas": cpu_blas.STATE.describe(), "model": str(args.model), "drafter": args.drafter,
           "mtp_enabled": not args.no_mtp, "temperature": args.temp,
           "draft": model.drafter.describe() if model.drafter is not None else None}
    out.update(sampler.describe(), seed=args.seed, repetition_penalty=args.repetition_penalty,
               repetition_context_size=args.repetition_context_size)
    out.update(stats.to_dict())
    if model.split is not None:  # only rank 0 prints (mlx_mtp.cli.cli_main)
        out["rank"] = model.split.rank
    return out


def print_report(result: dict, stats_rows) -> None:
    print(result["text"])
    print("=" * 40)
    print(tabulate(stats_rows, headers=["statistic", "value"], tablefmt="simple"))


def main(argv=None) -> int:
    return cli_main(build_parser(), run, lambda result: print_report(
        result, gate_table_rows(result) + _rows_from_result(result)), argv)


def _rows_from_result(result: dict):
    rows = [
        ("prompt", f"{result['prompt_tokens']} tokens, {result['prompt_tps']:.1f} tok/s"),
        ("generation", f"{result['generation_tokens']} tokens, {result['generation_tps']:.1f} tok/s"),
    ]
    if result["mtp_enabled"]:
        rows += [
            ("acceptance rule", result["acceptance_rule"]),
            ("block size", result["block_size"] if result["block_size"] != AUTO
             else f"auto (up to {result['max_block_size']})"),
            ("block sizes used (width: rounds)", ", ".join(
                f"{w}: {n}" for w, n in result["block_sizes"].items()) or "-"),
            ("rounds", result["rounds"]),
            ("drafted / accepted", f"{result['drafted']} / {result['accepted']}"),
            ("acceptance rate", f"{result['acceptance_rate']:.3f}"),
            ("tokens per round", f"{result['tokens_per_round']:.3f}"),
        ]
        for j, (rate, n) in enumerate(zip(result["per_position_acceptance"],
                                          result["per_position_rounds"]), 1):
            rows.append((f"draft {j} accepted (share of the {n} rounds that drafted it)",
                         f"{rate:.3f}"))
        per_round = max(result["rounds"], 1)
        for phase, ms in result["phase_ms"].items():
            rows.append((f"{phase} ms/round", f"{ms / per_round:.2f}"))
        rows += draft_profile_rows(result.get("draft_profile"))
    if result.get("split"):
        rows.append(("split", result["split"]))
        rows.append(("collectives per token (rank 0)",
                     f"{result['split_messages_per_token']:.2f} "
                     f"({result['split_bytes_per_token'] / 1e3:.1f} kB)"))
    rows.append(("peak memory", f"{result['peak_memory_gb']:.3f} GB"))
    rows.append(("cpu blas", result["cpu_blas"]))
    return rows


class _CallableModule(types.ModuleType):
    """``mlx_mtp.generate`` names both this module (the CLI: ``python -m mlx_mtp.generate``) and,
    as in mlx-lm, the ``generate`` function: once Python has imported this module it is the
    package's ``generate`` attribute, so calling it calls the function."""

    def __call__(self, *args, **kwargs):
        return generate_text(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
sys.modules[__name__].__signature__ = inspect.signature(generate_text)

if __name__ == "__main__":
    sys.exit(main())
