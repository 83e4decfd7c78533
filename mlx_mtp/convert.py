"""``python -m mlx_mtp.convert``: one MLX folder with the (quantized) target and its MTP drafter
(``mlx_mtp.conversion``); ``--model OUT`` then runs MTP with no ``--drafter``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .cli import Parser, cli_main, positive_int
from .conversion import DTYPES, convert
from .qwen3_5.options import QUANT_BITS, QUANT_GROUP_SIZES


def _head_bits(s):
    if s == "none":
        return None
    if s in map(str, QUANT_BITS):
        return int(s)
    raise argparse.ArgumentTypeError(f"expected none, {', '.join(map(str, QUANT_BITS))}, got {s!r}")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m mlx_mtp.convert",
               description="Convert a checkpoint to MLX (mlx-lm's conversion of the target) with "
                           "its MTP head or Gemma 4 assistant in the same folder.")
    p.add_argument("--hf-path", "--model", dest="hf_path", required=True,
                   help="local folder or Hugging Face repo id (BF16 or FP8 block-quantized)")
    p.add_argument("--mlx-path", type=Path, required=True, help="folder to write (must not exist)")
    p.add_argument("-q", "--quantize", action="store_true", help="quantize the target (affine)")
    p.add_argument("--q-bits", type=int, choices=QUANT_BITS, help="target bits (default 4)")
    p.add_argument("--q-group-size", type=int, choices=QUANT_GROUP_SIZES,
                   help="target group size (default 64)")
    p.add_argument("--dtype", choices=DTYPES,
                   help="float dtype of what is not quantized (default: the config's)")
    p.add_argument("--head-bits", type=_head_bits, default=None, metavar="none|4|8",
                   help="quantize the MTP head's projections (default none)")
    p.add_argument("--head-group-size", type=int, choices=QUANT_GROUP_SIZES, default=64)
    p.add_argument("--draft-vocab", type=positive_int, metavar="N",
                   help="also write a reduced draft vocabulary of N ids (needs --corpus)")
    p.add_argument("--corpus", type=Path, nargs="+", default=[], help="UTF-8 text files")
    p.add_argument("--drafter", help="the MTP head if not in the checkpoint; for Gemma 4 the "
                                     "assistant checkpoint")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run(args) -> dict:
    return convert(args.hf_path, args.mlx_path, quantize=args.quantize, q_bits=args.q_bits,
                   q_group_size=args.q_group_size, dtype=args.dtype, drafter=args.drafter,
                   head_bits=args.head_bits, head_group_size=args.head_group_size,
                   draft_vocab=args.draft_vocab, corpus=args.corpus, quiet=args.quiet)


def _show(r: dict) -> None:
    target = (f"{r['q_bits']}-bit (group {r['q_group_size']})" if r["quantized"] else r["dtype"])
    drafter = ("Gemma 4 assistant" if "assistant" in r else
               "no drafter" if r["model_type"].startswith("gemma4") else
               f"MTP head {r['head_bits']}-bit" if r.get("head_bits") else f"MTP head {r['dtype']}")
    extra = " (FP8 dequantized)" if r["fp8_dequantized"] else ""
    print(f"wrote {r['out']}: target {target}{extra}, {drafter}"
          + (f", draft vocabulary of {r['draft_vocab']['size']} ids" if "draft_vocab" in r else ""))


def main(argv=None) -> int:
    return cli_main(build_parser(), run, _show, argv)


if __name__ == "__main__":
    sys.exit(main())
