"""What the CLIs share: a parser whose errors are one line, checked argument types, the
speculation and drafter flags of ``mlx_mtp.generate`` and ``mlx_mtp.server``
(``add_speculation_args``, ``speculation_options``), and ``cli_main`` (parse, run, print a table
or ``--json``; ``MTPError`` -> one line and exit 1)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Tuple

from mlx_mtp.decoding.acceptance import REQUESTABLE_RULES
from mlx_mtp.decoding.block_chooser import AUTO
from mlx_mtp.decoding.limits import (DEFAULT_MAX_BLOCK_SIZE, MAX_BLOCK_SIZE, MAX_TOPK,
                                     block_size_problem)
from mlx_mtp.decoding.speculation import CLI_NAMES, SpeculationOptions
from mlx_mtp.errors import MTPError
from mlx_mtp.models.options import QUANT_BITS, QUANT_GROUP_SIZES, DraftOptions


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, like argparse, without the usage dump
        sys.stderr.write(f"error: {message}\n")
        sys.exit(2)


def _int(s) -> int:
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}")


def positive_int(s):
    v = _int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def block_size(s):
    v = _int(s)
    problem = block_size_problem(v)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return v


def draft_topk(s):
    v = _int(s)
    if not 1 <= v <= MAX_TOPK:
        raise argparse.ArgumentTypeError(f"must be between 1 and {MAX_TOPK}, got {v}")
    return v


def block_size_or_auto(s):
    if s == AUTO:
        return s
    try:
        int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {s!r}")
    return block_size(s)


def non_negative_float(s):
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}")
    if not v >= 0.0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {s}")
    return v


temperature = non_negative_float


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


unit_interval = _checked(float, "a number", lambda v: 0.0 <= v <= 1.0, "between 0 and 1")
non_negative_int = _checked(int, "an integer", lambda v: v >= 0, ">= 0")


_SIZE_UNITS = {"": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9,
               "T": 10**12, "TB": 10**12}


def byte_size(s):
    """A number of bytes, with mlx_lm.server's units (``512M``, ``8G``: powers of 10)."""
    text = s.strip().upper()
    digits = text.rstrip("KMGTB")
    unit = text[len(digits):]
    try:
        value = float(digits)
    except ValueError:
        value = None
    if value is None or unit not in _SIZE_UNITS or not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a size in bytes such as 512M or 8G "
                                         f"(0: none), got {s!r}")
    return int(value * _SIZE_UNITS[unit])


def chat_template(value: str) -> str:
    """``--chat-template``: a Jinja template, or the path of a file holding one; checked to
    parse."""
    import jinja2

    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                value = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise argparse.ArgumentTypeError(f"cannot read {value}: {e}") from None
    try:
        jinja2.Environment().parse(value)
    except jinja2.TemplateSyntaxError as e:
        raise argparse.ArgumentTypeError(f"not a Jinja template (line {e.lineno}: {e.message})"
                                         ) from None
    return value


def json_object(value: str) -> dict:
    """``--chat-template-args``: a JSON object."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("expected a JSON object, e.g. "
                                         "'{\"enable_thinking\": false}'")
    return parsed


def add_speculation_args(parser: argparse.ArgumentParser) -> None:
    """The flags that say how a run speculates and how its drafter runs, the same (names, types,
    defaults, help) for ``mlx_mtp.generate`` and ``mlx_mtp.server``; ``speculation_options``
    reads them."""
    parser.add_argument(
        "--block-size", type=block_size_or_auto, default=AUTO,
        help=f"tokens verified per round, drafts + 1 (1..{MAX_BLOCK_SIZE}; 1 = plain decode "
             f"through the MTP loop), or auto: chosen every round from the acceptance and round "
             f"costs measured so far (default)")
    parser.add_argument("--max-block-size", type=block_size, default=DEFAULT_MAX_BLOCK_SIZE,
                        help=f"the widest block --block-size auto may choose (default "
                             f"{DEFAULT_MAX_BLOCK_SIZE})")
    parser.add_argument(
        "--draft-topk", type=draft_topk, default=1,
        help=f"children drafted per tree node (1..{MAX_TOPK}; default 1: a chain). Above 1 each "
             "round drafts a tree, its depth --block-size less one, and verifies it in one "
             "forward; under --block-size auto (temperature 0 only) a round drafts a chain or a "
             "tree, whichever measured faster")
    parser.add_argument("--draft-tokens", type=positive_int, default=None,
                        help="most draft nodes a tree verifies per round (default: --draft-topk "
                             "per depth)")
    parser.add_argument(
        "--acceptance", choices=REQUESTABLE_RULES, default="auto",
        help="how drafts are accepted at temperature > 0 (default auto: speculative-sampling "
             "with a fixed --block-size, gumbel-coupled under --block-size auto, when the drafter "
             "can sample, else point-mass). At temperature 0 the rule is greedy. The stats name "
             "the rule used: greedy, point-mass, speculative-sampling or gumbel-coupled")
    parser.add_argument("--draft-vocab", default=None,
                        help="reduced draft vocabulary sidecar folder (python -m "
                             "mlx_mtp.draft_vocab)")
    parser.add_argument("--draft-bits", type=int, choices=QUANT_BITS, default=None,
                        help="quantize the MTP head's projections at load (default: as loaded)")
    parser.add_argument("--draft-group-size", type=int, choices=QUANT_GROUP_SIZES, default=64,
                        help="quantization group size for --draft-bits")
    parser.add_argument("--draft-quantize-fc", action="store_true",
                        help="with --draft-bits, quantize the head's fc too")
    parser.add_argument(
        "--draft-bf16", action="store_true",
        help="CPU: the draft step's products on bfloat16 copies of the drafter's weights (the "
             "Qwen head's and its draft LM head's, or the Gemma 4 assistant's), through "
             "mlx_mtp's bf16 kernel (half the bytes), also where the "
             "copy rounds a float32 head (drafts may then differ in a near tie, the output never "
             "does). Default: on where it rounds nothing (a bfloat16 checkpoint)")


def speculation_options(args) -> Tuple[SpeculationOptions, DraftOptions]:
    """The options ``add_speculation_args``'s flags give, checked before anything loads (errors
    name the flags)."""
    speculation = SpeculationOptions(block_size=args.block_size,
                                     max_block_size=args.max_block_size,
                                     draft_topk=args.draft_topk, draft_tokens=args.draft_tokens,
                                     acceptance=args.acceptance, names=CLI_NAMES)
    draft = DraftOptions(vocab=args.draft_vocab, bits=args.draft_bits,
                         group_size=args.draft_group_size, quantize_fc=args.draft_quantize_fc,
                         bf16=True if args.draft_bf16 else None)
    return speculation, draft


def cli_main(parser, run_fn, show, argv=None, *, args=None) -> int:
    """Parse (unless ``args`` are given), run, print (``--json``: one JSON object, else
    ``show(result)``); bad input is one ``error: ...`` line on stderr and a non-zero exit, never a
    traceback."""
    if args is None:
        args = parser.parse_args(argv)
    try:
        result = run_fn(args)
    except MTPError as e:
        sys.stderr.write(f"error: {e}\n")
        return 1
    if result.get("rank", 0) != 0:  # a split run: rank 0 speaks for all ranks
        return 0
    if args.json:
        print(json.dumps(result))
    else:
        show(result)
    return 0
