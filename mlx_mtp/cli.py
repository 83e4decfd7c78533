"""What the CLIs share: a parser whose errors are one line, checked argument types, and
``cli_main`` (parse, run, print a table or ``--json``; ``MTPError`` -> one line and exit 1)."""

from __future__ import annotations

import argparse
import json
import sys

from mlx_mtp.decoding.block_chooser import AUTO
from mlx_mtp.errors import MTPError
from mlx_mtp.decoding.rounds import block_size_problem
from mlx_mtp.models.draft_tree import MAX_TOPK


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
