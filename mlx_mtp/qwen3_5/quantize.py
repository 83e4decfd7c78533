"""A quantized MTP drafter (phase 3): the head's projections in affine 4- or 8-bit.

The drafter proposes and the target verifies, so quantizing the head can only cost acceptance.
``fc`` (the 2H -> H input projection) stays unquantized unless asked (quantized checkpoints in the
wild keep it in bf16); MoE router gates stay unquantized too. The borrowed LM head is the
target's and is left as the target has it.

At load: ``DraftOptions(bits=4)`` (``--draft-bits 4``). As a drafter folder that loads with
``--drafter DIR``:

    python -m mlx_mtp.quantize_drafter --model M [--drafter D] --out DIR [--bits 4]
        [--group-size 64] [--quantize-fc]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .options import QUANT_BITS, QUANT_GROUP_SIZES, DraftOptions
from ..errors import MTPError

ROUTER_GATES = ("mlp.gate", "shared_expert_gate")


def quantize_head(head: nn.Module, *, bits: int = 4, group_size: int = 64,
                  quantize_fc: bool = False) -> list:
    """Quantize ``head`` in place; returns the paths of the layers quantized."""
    DraftOptions(bits=bits, group_size=group_size)  # the same checks as the load options
    done = []

    def predicate(path, module):
        ok = (hasattr(module, "to_quantized") and not hasattr(module, "bits")
              and not path.endswith(ROUTER_GATES) and (quantize_fc or path != "fc")
              and module.weight.shape[-1] % group_size == 0)
        if ok:
            done.append(path)
        return ok

    nn.quantize(head, group_size=group_size, bits=bits, mode="affine", class_predicate=predicate)
    mx.eval(head.parameters())
    return done


def write_drafter(out: Path, head: nn.Module, config: dict, *, bits: int, group_size: int) -> None:
    """A ``qwen3_5_mtp`` drafter folder (prefix-stripped keys, norms as used, ``format: mlx``)."""
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(head.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps({
        "model_type": "qwen3_5_mtp", "text_config": config.get("text_config", config),
        "quantization": {"group_size": group_size, "bits": bits, "mode": "affine"}}, indent=1))


def build_parser() -> argparse.ArgumentParser:
    from ..generate import _Parser

    p = _Parser(prog="python -m mlx_mtp.quantize_drafter",
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
    from ..loading import load_model

    # Not cast to float32: the folder keeps the checkpoint's own float dtype for scales.
    model = load_model(args.model, drafter=args.drafter, dtype=None)
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
    from ..generate import cli_main

    return cli_main(build_parser(), run, lambda r: print(
        f"wrote {r['out']}: {len(r['quantized'])} projections at {r['bits']} bits, group "
        f"{r['group_size']}{'' if r['fc_quantized'] else ', fc unquantized'}"), argv)


if __name__ == "__main__":
    sys.exit(main())
