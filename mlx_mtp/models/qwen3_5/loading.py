"""Qwen3.5 / Qwen3.6 / Qwen3-Next loading: the target through mlx-lm, its MTP head and drafter.

MTP head weights come from, in this order: a drafter folder (``drafter=``), or the target
checkpoint's own ``mtp.*`` tensors. Raw HF norms are zero-centred and get +1 exactly once; which
weights are raw HF is decided by provenance (key prefix and file metadata), never by values.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Optional, Tuple

import mlx.core as mx

from mlx_mtp.io.checkpoint import (load_checked, load_safetensors, load_tokenizer, read_config,
                                   resolve_path, safetensors_header, text_config, weight_files)
from mlx_mtp.io import fp8
from mlx_mtp.errors import MTPError
from mlx_mtp.models import families, loader
from mlx_mtp.models.model import MTPModel
from mlx_mtp.models.qwen3_5 import vocab_reduction as draft_vocab
from mlx_mtp.models.qwen3_5.drafter import MTPHead, QwenMTPDrafter, is_zero_centred_norm
from mlx_mtp.models.options import DraftOptions
from mlx_mtp.models.qwen3_5.head_quantization import quantize_head, write_drafter
from mlx_mtp.models.qwen3_5.target import Qwen3_5Target

DRAFTER_MODEL_TYPES = ("qwen3_5_mtp",)
# Where ``python -m mlx_mtp.convert`` puts the head (a qwen3_5_mtp drafter folder) inside the
# converted target's folder, and the draft vocabulary sidecar when one was asked for.
EMBEDDED_HEAD = "mtp"
EMBEDDED_DRAFT_VOCAB = "mtp/draft_vocab"


def _provenance(header: dict, keys) -> str:
    """'hf' (zero-centred norms) or 'mlx' (norms already shifted), from file metadata or layout."""
    fmt = (header.get("__metadata__") or {}).get("format")
    if fmt == "mlx":
        return "mlx"
    if fmt == "pt":
        return "hf"
    # No metadata: HF conv1d is [C, 1, K], MLX's is [C, K, 1] (mlx-lm's own rule).
    for name, info in header.items():
        if "conv1d.weight" in name and isinstance(info, dict):
            return "hf" if info["shape"][-1] != 1 else "mlx"
    return "hf" if any(k.startswith("mtp.") for k in keys) else "mlx"


_HEAD_PREFIXES = ("language_model.model.mtp.", "model.language_model.mtp.", "language_model.mtp.",
                  "model.mtp.", "mtp.")


def _strip_head_prefix(key: str) -> Tuple[Optional[str], bool]:
    """(key relative to the head or None, whether it carried the raw-HF top-level ``mtp.``)."""
    for p in _HEAD_PREFIXES:
        if key.startswith(p):
            return key[len(p):], p == "mtp."
    return None, False


def collect_head_weights(files, *, prefixed_only: bool) -> Dict[str, mx.array]:
    """Head tensors (keys relative to the head, norms shifted where raw HF) from ``files``."""
    weights = {}
    for f in files:
        header = safetensors_header(f)
        names = [k for k in header if k != "__metadata__"]
        picked = {}
        for k in names:
            rel, raw_prefix = _strip_head_prefix(k)
            if rel is None and not prefixed_only:
                rel = k
            if rel is not None:
                picked[k] = (rel, raw_prefix)
        if not picked:
            continue
        prov = _provenance(header, names)
        tensors = load_safetensors(f)
        for k, (rel, raw_prefix) in picked.items():
            v = tensors[k]
            # Raw HF ``mtp.*`` tensors are zero-centred; prefix-stripped keys (mlx-vlm's drafter
            # layout) and MLX-format files carry norms that are already shifted.
            if raw_prefix and prov == "hf" and is_zero_centred_norm(rel) and v.ndim == 1:
                v = v + 1.0
            weights[rel] = v
    return weights


def _stack_experts(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """Both HF expert layouts (fused ``gate_up_proj`` or per-expert) -> mlx-lm's ``switch_mlp``."""
    out = dict(weights)
    for k in [k for k in out if k.endswith("mlp.experts.gate_up_proj")]:
        base = k[: -len("experts.gate_up_proj")]
        gate_up = out.pop(k)
        mid = gate_up.shape[-2] // 2
        out[base + "switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
        out[base + "switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
        out[base + "switch_mlp.down_proj.weight"] = out.pop(base + "experts.down_proj")
    per_expert = re.compile(r"^(.*mlp\.)experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    groups: Dict[Tuple[str, str], Dict[int, mx.array]] = {}
    for k in list(out):
        m = per_expert.match(k)
        if m:
            groups.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = out.pop(k)
    for (base, name), experts in groups.items():
        if sorted(experts) != list(range(len(experts))):
            raise MTPError(f"MTP head: experts of {base}{name} are not numbered 0..{len(experts) - 1}")
        out[f"{base}switch_mlp.{name}.weight"] = mx.stack([experts[e] for e in range(len(experts))])
    return out


def build_head(target: Qwen3_5Target, weights: Dict[str, mx.array], source: str,
               quantization: Optional[dict] = None,
               fp8_block: Optional[Tuple[int, int]] = None) -> MTPHead:
    if any(k.endswith(fp8.SCALE_SUFFIX) for k in weights):
        if fp8_block is None:
            raise MTPError(f"{source}: MTP weights carry FP8 scales (weight_scale_inv) but its "
                           "config.json has no FP8 quantization_config with a weight_block_size")
        weights = fp8.dequantize_weights(weights, fp8_block, target.dtype or mx.float32)
    weights = _stack_experts(weights)
    layer_ids = {int(m.group(1)) for k in weights if (m := re.match(r"layers\.(\d+)\.", k))}
    if not layer_ids:
        raise MTPError(f"{source}: no MTP decoder layer tensors (layers.0.*) found")
    head = MTPHead(target.args, num_layers=max(layer_ids) + 1)
    return load_checked(head, weights, source, dtype=target.dtype, quantization=quantization,
                        noun="MTP head tensor",
                        shape_note=f"for this target (hidden_size {target.hidden_size}, "
                                   f"vocab_size {target.vocab_size})")


def load_head_from_target(path: Path, target: Qwen3_5Target,
                          config: Optional[dict] = None) -> Optional[MTPHead]:
    weights = collect_head_weights(weight_files(path), prefixed_only=True)
    if not weights:
        return None
    config = read_config(path) if config is None else config
    return build_head(target, weights, str(path),
                      fp8_block=fp8.fp8_block(config, str(path / "config.json")))


def load_head_from_drafter(drafter_path, target: Qwen3_5Target) -> MTPHead:
    path = resolve_path(drafter_path, "drafter")
    config = read_config(path) if (path / "config.json").exists() else {}
    mt = config.get("model_type")
    targets = families.model_types()  # a target checkpoint of any family
    if mt is not None and mt not in DRAFTER_MODEL_TYPES + targets:
        raise MTPError(f"{path / 'config.json'}: model_type {mt!r} is not an MTP drafter "
                       f"(expected {', '.join(DRAFTER_MODEL_TYPES)})")
    files = weight_files(path)
    if not files:
        raise MTPError(f"drafter {path}: no .safetensors files found")
    # A full checkpoint given as drafter contributes only its mtp.* tensors.
    weights = collect_head_weights(files, prefixed_only=mt in targets)
    if not weights:
        raise MTPError(f"drafter {path}: no MTP head tensors found")
    text = text_config(config) if config else {}
    for key in ("hidden_size", "vocab_size"):
        want = getattr(target.args, key)
        if key in text and text[key] != want:
            raise MTPError(f"drafter {path}: {key} {text[key]} does not match the target's {want}")
    return build_head(target, weights, f"drafter {path}", config.get("quantization"),
                      fp8_block=fp8.fp8_block(config, str(path / "config.json")) if config else None)



def make_drafter(head: MTPHead, target: Qwen3_5Target, options: DraftOptions,
                 path: Path) -> QwenMTPDrafter:
    """The drafter with ``options`` applied: the head quantized (``bits``), a draft vocabulary
    sidecar read against the target's tokenizer and LM head (``vocab``)."""
    if options.bits is not None:
        quantize_head(head, bits=options.bits, group_size=options.group_size,
                      quantize_fc=options.quantize_fc)
    ids = None
    if options.vocab is not None:
        ids = draft_vocab.load_ids(options.vocab, load_tokenizer(path), target)
    return QwenMTPDrafter(head, target, options, ids)


def load_qwen3_5_model(path: Path, config: dict, *, drafter, dtype, require_head: bool,
                       draft_options: Optional[DraftOptions],
                       target_args: Optional[dict] = None, split=None) -> MTPModel:
    if text_config(config).get("mtp_use_dedicated_embeddings"):
        raise MTPError(f"{path / 'config.json'}: mtp_use_dedicated_embeddings=true is not supported")
    mlx_model = loader.load_target(path, dtype, split=split, **(target_args or {}))
    target = Qwen3_5Target(mlx_model)
    options = draft_options or DraftOptions()
    embedded = path / EMBEDDED_HEAD
    if drafter is not None:
        head = load_head_from_drafter(drafter, target)
    else:
        head = load_head_from_target(path, target, config)
        if head is None and (embedded / "config.json").is_file():  # a converted folder
            head = load_head_from_drafter(embedded, target)
        # A draft vocabulary shipped in the folder (a converted folder's, the demo pair's) is
        # used with the head loaded from it, unless one is given.
        sidecar = path / EMBEDDED_DRAFT_VOCAB
        if head is not None and options.vocab is None and (sidecar / draft_vocab.META_FILE).is_file():
            options = replace(options, vocab=sidecar)
    if head is None and require_head:
        raise MTPError(
            f"{path} has no MTP head weights (mtp.*): MLX conversions (mlx_lm.convert, mlx-vlm) "
            "strip them. Pass --drafter DIR (a qwen3_5_mtp drafter folder, or the raw Hugging "
            "Face checkpoint), load the raw Hugging Face checkpoint itself, or convert it with "
            "python -m mlx_mtp.convert (which keeps the head)")
    return MTPModel(
        mlx_model=mlx_model,
        target=target,
        drafter=(make_drafter(head, target, options, path)
                 if head is not None else None),
        config=config,
        path=path,
        split=split,
    )


# ------------------------------------------------------------------------------- conversion
# ``mlx_mtp.convert``'s hooks (``mlx_mtp.models.families.Family``): the head goes into the
# converted folder as a qwen3_5_mtp drafter (``EMBEDDED_HEAD``) and the draft vocabulary sidecar
# beside it (``EMBEDDED_DRAFT_VOCAB``), where ``load_qwen3_5_model`` looks for them.


def _head_target(model, dtype: mx.Dtype) -> SimpleNamespace:
    """What ``build_head`` reads of a target adapter, without making one (an adapter swaps layer
    classes, which a conversion has no use for)."""
    lm = model.language_model if hasattr(model, "language_model") else model
    return SimpleNamespace(args=lm.args, dtype=dtype, hidden_size=lm.args.hidden_size,
                           vocab_size=lm.args.vocab_size)


def convert_head(conv: families.Conversion) -> dict:
    """The MTP head (``--drafter``'s, else the checkpoint's ``mtp.*``), its projections
    quantized with ``--head-bits``, written into ``EMBEDDED_HEAD``."""
    target = _head_target(conv.model, conv.dtype)
    if conv.drafter is not None:
        head = load_head_from_drafter(conv.drafter, target)
    else:
        weights = collect_head_weights(weight_files(conv.src), prefixed_only=True)
        if not weights:
            raise MTPError(f"{conv.src} has no MTP head weights (mtp.*): pass --drafter DIR (a "
                           "qwen3_5_mtp drafter folder or the raw Hugging Face checkpoint)")
        head = build_head(target, weights, str(conv.src),
                          fp8_block=fp8.fp8_block(conv.config, str(conv.src / "config.json")))
    quantized: List[str] = []
    if conv.head_bits is not None:
        quantized = quantize_head(head, bits=conv.head_bits, group_size=conv.head_group_size)
        if not quantized:
            raise MTPError(f"--head-group-size {conv.head_group_size}: no head projection has "
                           "an input dimension divisible by it")
    write_drafter(conv.out / EMBEDDED_HEAD, head, conv.drafter_config,
                  bits=conv.head_bits if quantized else None, group_size=conv.head_group_size)
    return {"head_bits": conv.head_bits, "head_quantized": quantized}


def convert_draft_vocab(conv: families.Conversion) -> dict:
    """With ``--draft-vocab N``: the sidecar, built on the converted folder as it loads, written
    into ``EMBEDDED_DRAFT_VOCAB``. Without it, a sidecar the checkpoint ships (the demo pair's)
    goes along with the head taken from that checkpoint."""
    shipped = conv.src / EMBEDDED_DRAFT_VOCAB
    if conv.draft_vocab is None:
        if conv.drafter is None and (shipped / draft_vocab.META_FILE).is_file():
            return _carry_draft_vocab(shipped, conv.out)
        return {}
    model, tokenizer = loader.load(conv.out, require_head=False)
    built = draft_vocab.build(model, tokenizer, size=conv.draft_vocab, corpus=conv.corpus,
                              out=conv.out / EMBEDDED_DRAFT_VOCAB)
    return {"draft_vocab": {"size": built["size"], "coverage": built["coverage"]}}


def _carry_draft_vocab(shipped: Path, out: Path) -> dict:
    """Copy a shipped sidecar into the converted folder. Its ids are token ids, the same for the
    converted target; its LM-head fingerprint is re-taken on the converted head (a cast or a
    quantization changes the head's bytes, not which ids are frequent)."""
    import json
    import shutil

    model, _ = loader.load(out, require_head=False)  # before the copy: no sidecar to check
    dest = out / EMBEDDED_DRAFT_VOCAB
    shutil.copytree(shipped, dest)
    meta = json.loads((dest / draft_vocab.META_FILE).read_text())
    meta["head_sha256"] = draft_vocab.head_sha256(model.target)
    (dest / draft_vocab.META_FILE).write_text(json.dumps(meta, indent=1))
    return {"draft_vocab": {"size": meta["size"], "coverage": meta.get("coverage")}}
