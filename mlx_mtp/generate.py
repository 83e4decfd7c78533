"""``stream_generate`` and the CLI: ``python -m mlx_mtp.generate``.

Mirrors ``mlx_lm.generate``: the text first, then one table of the run's statistics
(or one JSON object with ``--json``). ``--no-mtp`` runs mlx-lm's own plain decode of the same
target, for comparison.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
import types
from dataclasses import dataclass
from typing import Generator, List, Optional, Union

import mlx.core as mx

from . import cpu_blas
from .diagnostics import RunStats
from .drafters.options import QUANT_BITS, QUANT_GROUP_SIZES, DraftOptions
from .draft_profile import table_rows as draft_profile_rows
from .errors import MTPError
from .sampling import REQUESTABLE_RULES, make_sampler
from .gate import table_rows as gate_table_rows
from .speculative import MAX_BLOCK_SIZE, generate_step

DEFAULT_MAX_TOKENS = 256
DEFAULT_BLOCK_SIZE = 3


def _response_class():
    from mlx_lm.generate import GenerationResponse

    @dataclass
    class MTPGenerationResponse(GenerationResponse):
        """mlx-lm's response; the last one of a run also carries ``stats``."""

        stats: Optional[RunStats] = None

    return MTPGenerationResponse


def encode_prompt(tokenizer, prompt: Union[str, List[int], mx.array]) -> mx.array:
    if isinstance(prompt, mx.array):
        return prompt
    if isinstance(prompt, str):
        add_special = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
        prompt = tokenizer.encode(prompt, add_special_tokens=add_special)
    return mx.array(prompt)


def stream_generate(model, tokenizer, prompt: Union[str, mx.array, List[int]],
                    max_tokens: int = DEFAULT_MAX_TOKENS, draft_model=None, stream=None, *,
                    block_size: int = DEFAULT_BLOCK_SIZE, stats: Optional[RunStats] = None,
                    **kwargs) -> Generator:
    """mlx-lm's ``stream_generate``: yields ``GenerationResponse``s (``text``, ``token``,
    ``logprobs``, ``from_draft``, ``prompt_tokens``, ``prompt_tps``, ``generation_tokens``,
    ``generation_tps``, ``peak_memory``, ``finish_reason``); the last one also carries the run's
    ``stats`` (``RunStats``). Stops at an EOS token. ``kwargs`` go to ``generate_step`` (mlx-lm's
    arguments and ours). ``draft_model`` must be None: the drafter is the model's MTP head.
    ``stream``: run on this MLX stream (default: the current one).
    """
    from mlx_lm.generate import wired_limit
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    if draft_model is not None:
        raise MTPError("draft_model is not supported: mlx_mtp drafts with the target's own MTP "
                       "head (load it with mlx_mtp.load(..., drafter=...)); for a separate "
                       "draft model use mlx_lm.stream_generate")
    if "num_draft_tokens" in kwargs:
        raise MTPError("num_draft_tokens is mlx-lm's setting for a separate draft model: "
                       "use block_size (tokens verified per round = drafts + 1)")
    if max_tokens == 0:
        raise MTPError("max_tokens must be non-zero (use -1 for no limit)")
    Response = _response_class()
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    prompt = encode_prompt(tokenizer, prompt)
    stats = stats if stats is not None else RunStats()
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    tokens = generate_step(prompt, model, stream, max_tokens=max_tokens, block_size=block_size,
                           stats=stats, **kwargs)
    token, logprobs, from_draft, n = None, None, False, 0
    with wired_limit(model.mlx_model, [stream] if stream is not None else None):
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


# ---------------------------------------------------------------------------------------- CLI


def _int(s) -> int:
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}")


def _positive_int(s):
    v = _int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def _block_size(s):
    v = _int(s)
    if not 1 <= v <= MAX_BLOCK_SIZE:
        raise argparse.ArgumentTypeError(f"must be between 1 and {MAX_BLOCK_SIZE}, got {v}")
    return v


def _temperature(s):
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}")
    if not v >= 0.0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {s}")
    return v


_non_negative_float = _temperature  # the same check, for flags that are not temperatures


def _checked(parse, what: str, ok, bound: str):
    """An argparse type: ``parse`` the text (else "expected <what>"), then require ``ok``."""
    def check(s):
        try:
            v = parse(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}")
        if not ok(v):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {s}")
        return v
    return check


_unit_interval = _checked(float, "a number", lambda v: 0.0 <= v <= 1.0, "between 0 and 1")
_non_negative_int = _checked(int, "an integer", lambda v: v >= 0, ">= 0")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, like argparse, without the usage dump
        sys.stderr.write(f"error: {message}\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m mlx_mtp.generate",
                description="Generate text with MTP speculative decoding (exact at --temp 0).")
    p.add_argument("--model", help="local folder or Hugging Face repo id of the target "
                   "(default: the embedded demo pair, mlx_mtp/demo_pair)")
    p.add_argument("--drafter", help="folder or repo id of a separate MTP head (qwen3_5_mtp), "
                   "or the Gemma 4 assistant (gemma4_assistant; required for Gemma 4)")
    p.add_argument("--prompt", default=None, help="prompt text (default: a short code prompt)")
    p.add_argument("--max-tokens", type=_positive_int, default=DEFAULT_MAX_TOKENS)
    p.add_argument("--block-size", type=_block_size, default=DEFAULT_BLOCK_SIZE,
                   help=f"tokens verified per round, drafts + 1 (1..{MAX_BLOCK_SIZE}; 1 = plain "
                        f"decode through the MTP loop)")
    p.add_argument("--temp", type=_temperature, default=0.0, help="sampling temperature")
    p.add_argument("--top-p", type=_unit_interval, default=0.0, help="sampling top-p (0: off)")
    p.add_argument("--min-p", type=_unit_interval, default=0.0, help="sampling min-p (0: off)")
    p.add_argument("--top-k", type=_non_negative_int, default=0, help="sampling top-k (0: off)")
    p.add_argument("--min-tokens-to-keep", type=_positive_int, default=1,
                   help="tokens min-p always keeps")
    p.add_argument("--repetition-penalty", type=_non_negative_float, default=None,
                   help="mlx-lm's repetition penalty (e.g. 1.1; default: none)")
    p.add_argument("--repetition-context-size", type=_positive_int, default=20,
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


def _run_plain(model, tokenizer, prompt, args, sampler, processors):
    """mlx-lm's own plain decode of the target (``--no-mtp``)."""
    from mlx_lm.generate import stream_generate as mlx_stream_generate

    stats = RunStats(block_size=1, mtp_enabled=False, gate_reason="--no-mtp: mlx-lm plain decode")
    text, tokens, last = [], [], None
    t0 = time.perf_counter()
    for last in mlx_stream_generate(model.mlx_model, tokenizer, prompt,
                                    max_tokens=args.max_tokens, sampler=sampler,
                                    logits_processors=processors):
        text.append(last.text)
        tokens.append(last.token)
    stats.prompt_tokens = last.prompt_tokens
    stats.prompt_s = last.prompt_tokens / last.prompt_tps if last.prompt_tps else 0.0
    stats.generation_tokens = last.generation_tokens
    stats.generation_s = (last.generation_tokens / last.generation_tps if last.generation_tps
                          else time.perf_counter() - t0)
    stats.peak_memory_gb = last.peak_memory
    return "".join(text), _without_eos(tokens, tokenizer), stats


def _without_eos(tokens, tokenizer):
    return tokens[:-1] if tokens and tokens[-1] in tokenizer.eos_token_ids else tokens


def run(args) -> dict:
    from mlx_lm.sample_utils import make_logits_processors

    from .demo import demo_path
    from .loading import load

    if args.model is None:
        if args.drafter is not None:
            raise MTPError("--drafter needs --model: the embedded demo pair has its own head")
        args.model = str(demo_path())
    need_head = not args.no_mtp and args.block_size > 1
    options = DraftOptions(vocab=args.draft_vocab, bits=args.draft_bits,
                           group_size=args.draft_group_size, quantize_fc=args.draft_quantize_fc)
    model, tokenizer = load(args.model, drafter=args.drafter, require_head=need_head,
                            draft_options=options)
    prompt = _prepare_prompt(tokenizer, args.prompt if args.prompt is not None else DEFAULT_PROMPT,
                             args.ignore_chat_template)
    sampler = make_sampler(temp=args.temp, top_p=args.top_p, min_p=args.min_p,
                           min_tokens_to_keep=args.min_tokens_to_keep, top_k=args.top_k)
    sampler.check_vocab(model.target.vocab_size)
    processors = make_logits_processors(repetition_penalty=args.repetition_penalty,
                                        repetition_context_size=args.repetition_context_size)
    if args.seed is not None:  # after loading: building the model draws from the global stream
        mx.random.seed(args.seed)
    if args.no_mtp:
        text, tokens, stats = _run_plain(model, tokenizer, prompt, args, sampler, processors)
    else:
        stats = RunStats()
        responses = list(stream_generate(model, tokenizer, prompt, max_tokens=args.max_tokens,
                                         block_size=args.block_size, sampler=sampler, stats=stats,
                                         logits_processors=processors, seed=args.seed,
                                         acceptance=args.acceptance))
        text = "".join(r.text for r in responses)
        tokens = _without_eos([r.token for r in responses], tokenizer)
    out = {"text": text, "tokens": tokens, "cpu_blas": cpu_blas.STATE.describe(), "model": str(args.model), "drafter": args.drafter,
           "mtp_enabled": not args.no_mtp, "temperature": args.temp,
           "draft": model.drafter.describe() if hasattr(model.drafter, "describe") else None}
    out.update(sampler.describe(), seed=args.seed, repetition_penalty=args.repetition_penalty,
               repetition_context_size=args.repetition_context_size)
    out.update(stats.to_dict())
    return out


def print_report(result: dict, stats_rows) -> None:
    from tabulate import tabulate

    print(result["text"])
    print("=" * 40)
    print(tabulate(stats_rows, headers=["statistic", "value"], tablefmt="simple"))


def cli_main(parser, run_fn, show, argv=None) -> int:
    """Parse, run, print (``--json``: one JSON object, else ``show(result)``); bad input is one
    ``error: ...`` line on stderr and a non-zero exit, never a traceback."""
    args = parser.parse_args(argv)
    try:
        result = run_fn(args)
    except MTPError as e:
        sys.stderr.write(f"error: {e}\n")
        return 1
    if args.json:
        print(json.dumps(result))
    else:
        show(result)
    return 0


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
            ("block size", result["block_size"]),
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
    rows.append(("peak memory", f"{result['peak_memory_gb']:.3f} GB"))
    rows.append(("cpu blas", result["cpu_blas"]))
    return rows


class _CallableModule(types.ModuleType):
    """``mlx_mtp.generate`` names both this module (the CLI: ``python -m mlx_mtp.generate``) and,
    as in mlx-lm, the ``generate`` function: calling the module calls the function."""

    def __call__(self, *args, **kwargs):
        return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
sys.modules[__name__].__signature__ = inspect.signature(generate)

if __name__ == "__main__":
    sys.exit(main())
