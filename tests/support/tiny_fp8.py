"""Tiny FP8 block-quantized checkpoints in the layout Qwen publishes (e.g. Qwen3.6-35B-A3B-FP8).

config.json: ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
"dynamic", "weight_block_size": [b, b], "modules_to_not_convert": [...]}``; every linear
projection's ``X.weight`` stored as safetensors dtype ``F8_E4M3`` with ``X.weight_scale_inv``
(one float per b x b block, edge blocks included) beside it; embeddings, LM head, norms, conv1d
and router gates unquantized; MoE experts per expert; the ``mtp.*`` tensors in their own file.

The files are written by hand (raw header + bytes): safetensors writers in MLX have no F8 dtype.
``e4m3_table`` and ``reference_dequantize`` are the independent reference the tests compare the
loader against: the 256 codes decoded from the bit layout, numpy only.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Dict, Tuple

import mlx_mtp  # noqa: F401  (before mlx.core: binds the system BLAS)
import mlx.core as mx
import numpy as np

FP8_MAX = 448.0
UNQUANTIZED = ("embed_tokens", "lm_head", "norm", "conv1d", "mlp.gate.", "shared_expert_gate",
               "A_log", "dt_bias")


def e4m3_table() -> np.ndarray:
    """float32 value of each of the 256 e4m3fn codes: 1 sign, 4 exponent (bias 7), 3 mantissa
    bits; exponent 0 is subnormal (m/8 * 2^-6); S.1111.111 is NaN; no infinities."""
    out = np.empty(256, dtype=np.float32)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        e, m = (code >> 3) & 0xF, code & 0x7
        if e == 0xF and m == 0x7:
            out[code] = np.nan
        elif e == 0:
            out[code] = sign * (m / 8.0) * 2.0 ** -6
        else:
            out[code] = sign * (1.0 + m / 8.0) * 2.0 ** (e - 7)
    return out


def reference_dequantize(raw: np.ndarray, scale_inv: np.ndarray, block: Tuple[int, int]) -> np.ndarray:
    """float32 ``e4m3(raw) * scale_inv`` repeated over blocks, edge blocks cut (numpy only)."""
    w = e4m3_table()[raw]
    rows, cols = raw.shape[-2:]
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), block[0], axis=-2), block[1], axis=-1)
    return (w * s[..., :rows, :cols]).astype(np.float32)


def quantize(w: np.ndarray, block: Tuple[int, int], scale_dtype: str):
    """(e4m3 bytes, scale_inv) for ``w`` [..., rows, cols]: per block scale = amax / 448."""
    rows, cols = w.shape[-2:]
    b0, b1 = block
    g0, g1 = -(-rows // b0), -(-cols // b1)
    pad = np.zeros((*w.shape[:-2], g0 * b0, g1 * b1), dtype=np.float32)
    pad[..., :rows, :cols] = w
    blocks = pad.reshape(*w.shape[:-2], g0, b0, g1, b1)
    amax = np.abs(blocks).max(axis=(-3, -1))
    scale = np.maximum(amax, 1e-12) / FP8_MAX
    if scale_dtype == "BF16":  # the scale the file holds is what dequantizes
        scale = np.asarray(mx.array(scale).astype(mx.bfloat16).astype(mx.float32))
    full = np.repeat(np.repeat(scale, b0, axis=-2), b1, axis=-1)[..., :rows, :cols]
    raw = np.asarray(mx.to_fp8(mx.array(w / full)))  # MLX's encoder (round to nearest)
    return raw.astype(np.uint8), scale.astype(np.float32)


def _bytes(name: str, v: np.ndarray, dtype: str) -> bytes:
    if dtype == "BF16":
        return np.asarray(mx.array(v).astype(mx.bfloat16).view(mx.uint16)).tobytes()
    return np.ascontiguousarray(v).tobytes()


def write_safetensors(f: Path, tensors: Dict[str, Tuple[np.ndarray, str]]) -> None:
    """``tensors``: name -> (array, safetensors dtype: F8_E4M3 / F32 / BF16 / I64 ...)."""
    header, chunks, offset = {}, [], 0
    for name in sorted(tensors):
        v, dtype = tensors[name]
        data = _bytes(name, v, dtype)
        header[name] = {"dtype": dtype, "shape": list(v.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(f, "wb") as fh:
        fh.write(struct.pack("<Q", len(h)) + h + b"".join(chunks))


def _quantized(name: str, v: np.ndarray) -> bool:
    return name.endswith(".weight") and v.ndim >= 2 and not any(u in name for u in UNQUANTIZED)


def write_fp8(raw_dir: Path, out: Path, *, block=(128, 128), scale_dtype: str = "F32") -> Path:
    """The FP8 release of the raw HF checkpoint ``raw_dir`` (written by ``tiny_checkpoints``):
    same config plus ``quantization_config``, weights per expert, ``mtp.*`` in ``mtp.safetensors``.
    Returns ``out``; ``out/reference.npz`` holds every quantized tensor's bytes and scales."""
    out = Path(out)
    out.mkdir(parents=True)
    weights = {}
    for f in sorted(Path(raw_dir).glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    # per-expert layout (what the FP8 MoE releases ship), for the target and the head
    for k in [k for k in weights if k.endswith("experts.gate_up_proj")]:
        base = k[: -len("gate_up_proj")]
        gate_up = np.asarray(weights.pop(k))
        down = np.asarray(weights.pop(base + "down_proj"))
        mid = gate_up.shape[-2] // 2
        for e in range(gate_up.shape[0]):
            weights[f"{base}{e}.gate_proj.weight"] = mx.array(gate_up[e, :mid])
            weights[f"{base}{e}.up_proj.weight"] = mx.array(gate_up[e, mid:])
            weights[f"{base}{e}.down_proj.weight"] = mx.array(down[e])
    files = {"model.safetensors": {}, "mtp.safetensors": {}}
    reference = {}
    for name, v in weights.items():
        v = np.asarray(v.astype(mx.float32))
        part = files["mtp.safetensors" if name.startswith("mtp.") else "model.safetensors"]
        if _quantized(name, v):
            raw, scale = quantize(v, block, scale_dtype)
            part[name] = (raw, "F8_E4M3")
            part[name + "_scale_inv"] = (scale, scale_dtype)
            reference[name] = raw
            reference[name + "_scale_inv"] = scale
        else:
            part[name] = (v, "F32")
    for fname, tensors in files.items():
        write_safetensors(out / fname, tensors)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        k: fname for fname, tensors in files.items() for k in tensors}}))
    config = json.loads((Path(raw_dir) / "config.json").read_text())
    config["quantization_config"] = {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
        "weight_block_size": list(block),
        "modules_to_not_convert": ["lm_head", "embed_tokens", "mlp.gate", "shared_expert_gate"]}
    config["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((Path(raw_dir) / f).read_bytes())
    np.savez(out.parent / f"{out.name}-reference.npz", **reference)
    return out

