"""``python -m mlx_mtp.draft_vocab build``: write a reduced draft vocabulary sidecar
(``mlx_mtp.models.qwen3_5.vocab_reduction``) from a calibration corpus."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mlx_mtp.models import loader
from mlx_mtp.cli import Parser, cli_main, positive_int
from mlx_mtp.errors import MTPError
from mlx_mtp.models.qwen3_5.vocab_reduction import build


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m mlx_mtp.draft_vocab",
               description="Reduced draft vocabulary sidecars for the MTP drafter.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    b = sub.add_parser("build", help="most frequent target ids over a calibration corpus")
    b.add_argument("--model", required=True, help="local folder or Hugging Face repo id")
    b.add_argument("--size", type=positive_int, default=None,
                   help="ids in the draft vocabulary (default: 32768, at most a quarter of the "
                        "target's vocabulary)")
    b.add_argument("--corpus", type=Path, nargs="+", required=True, help="UTF-8 text files")
    b.add_argument("--out", type=Path, required=True, help="sidecar folder to write")
    b.add_argument("--generate-tokens", type=int, default=0,
                   help="also count this many greedy tokens of the target per prompt (0: off)")
    b.add_argument("--generate-prompts", type=positive_int, default=8,
                   help="corpus paragraphs used as generation prompts")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run(args) -> dict:
    if args.generate_tokens < 0:
        raise MTPError(f"--generate-tokens must be >= 0, got {args.generate_tokens}")
    model, tokenizer = loader.load(args.model, require_head=False)
    return build(model, tokenizer, size=args.size, corpus=args.corpus, out=args.out,
                 generate_tokens=args.generate_tokens, generate_prompts=args.generate_prompts)


def _show(result: dict) -> None:
    print(f"wrote {result['out']}: {result['size']} of {result['vocab_size']} ids, covering "
          f"{100 * result['coverage']:.1f}% of {result['corpus_tokens']} corpus + "
          f"{result['generated_tokens']} generated tokens")


def main(argv=None) -> int:
    return cli_main(build_parser(), run, _show, argv)


if __name__ == "__main__":
    sys.exit(main())
