"""A quantized MTP drafter: the head's projections in affine 4- or 8-bit.

The drafter proposes and the target verifies, so quantizing the head can only cost acceptance.
``fc`` (the 2H -> H input projection) stays unquantized unless asked (quantized checkpoints in the
wild keep it in bf16); MoE router gates stay unquantized too. The borrowed LM head is the
target's and is left as the target has it.

At load: ``DraftOptions(bits=4)`` (``--draft-bits 4``). As a drafter folder that loads with
``--drafter DIR``:

    python -m mlx_mtp.quantize_drafter  (the CLI: mlx_mtp/quantize_drafter.py)
        --model M [--drafter D] --out DIR [--bits 4]
        [--group-size 64] [--quantize-fc]
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_mtp.models.options import DraftOptions

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


def write_drafter(out: Path, head: nn.Module, config: dict, *, bits: Optional[int],
                  group_size: int) -> None:
    """A ``qwen3_5_mtp`` drafter folder (prefix-stripped keys, norms as used, ``format: mlx``);
    its config records the quantization when ``bits`` is not None."""
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(head.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    drafter_config = {"model_type": "qwen3_5_mtp", "text_config": config.get("text_config", config)}
    if bits is not None:
        drafter_config["quantization"] = {"group_size": group_size, "bits": bits, "mode": "affine"}
    (out / "config.json").write_text(json.dumps(drafter_config, indent=1))
