"""``python -m mlx_mtp.quantize_drafter``: write a quantized MTP drafter folder (loads with
``--drafter DIR``); the quantization itself is ``mlx_mtp.models.qwen3_5.head_quantization``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mlx_mtp.models import loader
from mlx_mtp.cli import Parser, cli_main
from mlx_mtp.errors import MTPError
from mlx_mtp.models.options import QUANT_BITS, QUANT_GROUP_SIZES
from mlx_mtp.models.qwen3_5.head_quantization import quantize_head, write_drafter


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m mlx_mtp.quantize_drafter",
               description="Write a quantized MTP drafter folder (loads with --drafter).")
    p.add_argument("--model", required=True, help="the target (local folder or repo id)")
    p.add_argument("--drafter", help="its MTP head, if not in the target checkpoint")
    p.add_argument("--out", type=Path, required=True, help="drafter folder to write")
    p.add_argument("--bits", type=int, choices=QUANT_BITS, default=4)
    p.add_argument("--group-size", type=int, choices=QUANT_GROUP_SIZES, default=64)
    p.add_argument("--quantize-fc", action="store_true", help="quantize fc too (default: keep it)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run(args) -> dict:
    # Not cast to float32: the folder keeps the checkpoint's own float dtype for scales.
    model = loader.load_model(args.model, drafter=args.drafter, dtype=None)
    head = model.drafter.head
    layers = quantize_head(head, bits=args.bits, group_size=args.group_size,
                           quantize_fc=args.quantize_fc)
    if not layers:
        raise MTPError(f"--group-size {args.group_size}: no head projection has an input "
                       f"dimension divisible by it")
    write_drafter(args.out, head, model.config, bits=args.bits, group_size=args.group_size)
    return {"out": str(args.out), "bits": args.bits, "group_size": args.group_size,
            "quantized": layers, "fc_quantized": "fc" in layers}


def main(argv=None) -> int:
    return cli_main(build_parser(), run, lambda r: print(
        f"wrote {r['out']}: {len(r['quantized'])} projections at {r['bits']} bits, group "
        f"{r['group_size']}{'' if r['fc_quantized'] else ', fc unquantized'}"), argv)


if __name__ == "__main__":
    sys.exit(main())
