"""FP8 block-quantized checkpoints (Qwen's and DeepSeek's published layout), dequantized on load.

config.json: ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [128, 128], ...}``; beside each quantized ``X.weight`` (safetensors dtype
``F8_E4M3``, which ``mx.load`` returns as its raw bytes, uint8) lies ``X.weight_scale_inv``, one
float per block of the last two dims: ``scale_inv[..., ceil(rows / b0), ceil(cols / b1)]``.
Dequantized: ``w[..., i, j] = e4m3(w_bytes[..., i, j]) * scale_inv[..., i // b0, j // b1]``
(transformers' ``Fp8Dequantize`` / DeepSeek-V3's ``weight_dequant``; edge blocks use their block's
scale), computed in float32 and rounded once to the output dtype.

Every other quantization mlx-lm 0.32 does not load itself is refused with one line
(``check_quantization``).
"""

from __future__ import annotations

import re
from typing import Dict, Optional, Tuple

import mlx.core as mx

from mlx_mtp.errors import MTPError

SCALE_SUFFIX = "_scale_inv"
# quant_method values mlx-lm 0.32's load_model handles itself (some formats of them only).
MLX_LM_QUANT_METHODS = ("bitnet", "mxfp4", "mxfp8", "compressed-tensors", "modelopt", "awq", "gptq")
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def quantization_config(config: dict) -> Optional[dict]:
    q = config.get("quantization_config")
    if q is None:
        q = (config.get("text_config") or {}).get("quantization_config")
    return q if isinstance(q, dict) else None


def fp8_block(config: dict, source: str) -> Optional[Tuple[int, int]]:
    """The FP8 block size this module dequantizes, None for a checkpoint that is not FP8 or one
    mlx-lm loads natively (ue8m0 scales over 32x32 blocks are mxfp8)."""
    q = quantization_config(config)
    if q is None or q.get("quant_method") != "fp8" or "quantization" in config:
        return None
    block = q.get("weight_block_size")
    if q.get("scale_fmt") == "ue8m0" and list(block or ()) == [32, 32]:
        return None
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise MTPError(f"{source}: FP8 format {fmt!r} is not supported (only e4m3 block-quantized "
                       "checkpoints load): use the BF16 checkpoint")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise MTPError(f"{source}: FP8 quantization_config.weight_block_size {block!r} is not "
                       "supported (expected two positive integers, e.g. [128, 128]; per-tensor "
                       "FP8 does not load): use the BF16 checkpoint")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise MTPError(f"{source}: FP8 activation_scheme {q.get('activation_scheme')!r} is not "
                       "supported (only 'dynamic'): use the BF16 checkpoint")
    return int(block[0]), int(block[1])


def check_quantization(config: dict, source: str) -> None:
    """One line for a quantization neither mlx-lm nor this module loads."""
    if "quantization" in config:  # an MLX conversion
        return
    q = quantization_config(config)
    if q is None:
        return
    method = q.get("quant_method")
    if method == "fp8":
        fp8_block(config, source)
        return
    if method not in MLX_LM_QUANT_METHODS:
        raise MTPError(f"{source}: quantization_config.quant_method {method!r} is not supported: "
                       "use the BF16 checkpoint, or an MLX conversion of it "
                       "(python -m mlx_mtp.convert -q)")


def dequantize(w: mx.array, scale_inv: mx.array, block: Tuple[int, int],
               dtype: mx.Dtype = mx.float32, name: str = "weight") -> mx.array:
    """One FP8 weight (e4m3 bytes, any leading dims) times its per-block scales."""
    if w.dtype != mx.uint8:
        raise MTPError(f"{name}: has a weight_scale_inv but dtype {w.dtype}, expected F8_E4M3")
    if not mx.issubdtype(scale_inv.dtype, mx.floating):
        raise MTPError(f"{name}_scale_inv: dtype {scale_inv.dtype} is not supported (expected "
                       "float32 / bfloat16 / float16 scales)")
    *lead, rows, cols = w.shape
    b0, b1 = block
    grid = (-(-rows // b0), -(-cols // b1))
    if tuple(scale_inv.shape) != (*lead, *grid):
        raise MTPError(f"{name}_scale_inv: shape {tuple(scale_inv.shape)}, expected "
                       f"{(*lead, *grid)} for a weight of shape {tuple(w.shape)} in "
                       f"{b0}x{b1} blocks")
    s = scale_inv.astype(mx.float32)
    s = mx.repeat(mx.repeat(s, b0, axis=-2), b1, axis=-1)[..., :rows, :cols]
    return (mx.from_fp8(w, dtype=mx.float32) * s).astype(dtype)


def dequantize_weights(weights: Dict[str, mx.array], block: Tuple[int, int],
                       dtype: mx.Dtype = mx.float32) -> Dict[str, mx.array]:
    """Every ``X.weight`` with a ``X.weight_scale_inv`` dequantized (lazily); scales dropped."""
    out = {}
    for k, v in weights.items():
        if k.endswith(SCALE_SUFFIX):
            if k[: -len(SCALE_SUFFIX)] not in weights:
                raise MTPError(f"{k}: a scale without its weight {k[: -len(SCALE_SUFFIX)]}")
            continue
        s = weights.get(k + SCALE_SUFFIX)
        if s is not None:
            v = dequantize(v, s, block, dtype, k)
        elif v.dtype == mx.uint8 and k.endswith(".weight"):
            raise MTPError(f"{k}: an FP8 weight without its {k}{SCALE_SUFFIX}")
        out[k] = v
    return out


def fuse_experts(weights: Dict[str, mx.array], skip_prefix: str = "mtp.") -> Dict[str, mx.array]:
    """Per-expert ``experts.E.{gate,up,down}_proj.weight`` (how the FP8 Qwen3.5 MoE releases store
    them) -> HF's fused ``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj`` [E, H, I],
    the layout mlx-lm's ``qwen3_5_moe`` sanitize reads. Keys under ``skip_prefix`` stay as they
    are (the MTP head's loader reads both layouts)."""
    out, groups = {}, {}
    for k, v in weights.items():
        m = _EXPERT.match(k)
        if m and not k.startswith(skip_prefix):
            groups.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = v
        else:
            out[k] = v
    for base, parts in groups.items():
        stacked = {}
        for name in ("gate_proj", "up_proj", "down_proj"):
            experts = parts.get(name, {})
            if not experts or sorted(experts) != list(range(len(experts))):
                raise MTPError(f"{base}*.{name}: experts are not numbered 0..N-1")
            stacked[name] = mx.stack([experts[e] for e in range(len(experts))])
        out[base + "gate_up_proj"] = mx.concatenate([stacked["gate_proj"], stacked["up_proj"]],
                                                    axis=-2)
        out[base + "down_proj"] = stacked["down_proj"]
    return out


# Model types whose mlx-lm sanitize reads only the fused expert layout.
PER_EXPERT_TO_FUSED = ("qwen3_5_moe",)
