"""Path or HF repo id -> (mlx-lm target, its adapter, the MTP drafter).

MTP head weights come from, in this order: a drafter folder (``drafter=``), or the target
checkpoint's own ``mtp.*`` tensors. Raw HF norms are zero-centred and get +1 exactly once; which
weights are raw HF is decided by provenance (key prefix and file metadata), never by values.
"""

from __future__ import annotations

import glob
import json
import re
import struct
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import cpu_blas, draft_vocab
from .drafters.options import DraftOptions
from .drafters.qwen3_5_mtp import MTPHead, QwenMTPDrafter, is_zero_centred_norm
from .errors import MTPError
from .model import MTPModel
from .targets.gemma4 import GEMMA4_MODEL_TYPES
from .targets.qwen3_5 import Qwen3_5Target

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next") + GEMMA4_MODEL_TYPES
DRAFTER_MODEL_TYPES = ("qwen3_5_mtp",)
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
_DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


# ---------------------------------------------------------------------------------------- files


def first_line(e: BaseException) -> str:
    """An exception as one line for a user-facing error (its first line, or its type)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def resolve_path(path_or_repo, what: str = "model", revision: Optional[str] = None) -> Path:
    """A local folder as is; anything else shaped like ``owner/name`` via the Hugging Face Hub
    (at ``revision``: a branch, tag or commit, as ``mlx_lm.load`` passes it)."""
    s = str(path_or_repo)
    p = Path(s).expanduser()
    if p.exists():
        if not p.is_dir():
            raise MTPError(f"{what} path {s} is a file: expected a model folder")
        return p
    if _REPO_ID.match(s) and not s.startswith("."):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(repo_id=s, allow_patterns=_DOWNLOAD_PATTERNS,
                                          revision=revision))
        except Exception as e:  # network, auth, missing repo: all one user-facing line
            msg = first_line(e)
            raise MTPError(f"{what} {s} is not a local folder and could not be fetched from "
                           f"the Hugging Face Hub: {msg}") from None
    raise MTPError(f"{what} path {s} does not exist")


def read_config(path: Path) -> dict:
    f = path / "config.json"
    if not f.is_file():
        raise MTPError(f"{f} not found: expected a Hugging Face or MLX model folder with a config.json")
    try:
        config = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MTPError(f"{f} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise MTPError(f"{f} must hold a JSON object")
    return config


def safetensors_header(f: Path) -> dict:
    """Parse and sanity-check a safetensors header; a corrupt file gets a one-line error."""
    size = f.stat().st_size
    try:
        with open(f, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise ValueError("shorter than its 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise ValueError(f"header length {n} exceeds the file size {size}")
            header = json.loads(fh.read(n))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        data = size - 8 - n
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            if not 0 <= start <= end <= data:
                raise ValueError(f"tensor {name} lies outside the file (truncated?)")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise MTPError(f"{f}: corrupted safetensors file ({e})") from None
    return header


def weight_files(path: Path, pattern: str = "*.safetensors") -> list:
    return sorted(Path(p) for p in glob.glob(str(path / pattern)))


def _load_safetensors(f: Path) -> Dict[str, mx.array]:
    try:
        return mx.load(str(f))
    except Exception as e:
        raise MTPError(f"{f}: corrupted safetensors file ({e})") from None


# ---------------------------------------------------------------------------------------- target


def _text_config(config: dict) -> dict:
    return config.get("text_config", config)


def load_target(path: Path, config: dict, dtype: Optional[mx.Dtype] = None, *,
                model_config: Optional[dict] = None, lazy: bool = False,
                trust_remote_code: bool = False, adapter_path=None) -> nn.Module:
    """mlx-lm's own model for ``path`` (its sanitize drops ``mtp.*``), with ``mlx_lm.load``'s
    ``model_config``, ``lazy``, ``trust_remote_code`` and ``adapter_path`` (LoRA / DoRA adapters
    from ``mlx_lm.lora``, applied after the cast to ``dtype``)."""
    from mlx_lm.utils import load_model

    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise MTPError(f"{path / 'config.json'}: unknown model_type {model_type!r}, expected one "
                       f"of {', '.join(SUPPORTED_MODEL_TYPES)}")
    files = weight_files(path, "model*.safetensors")
    if not files:
        raise MTPError(f"{path}: no model*.safetensors weight files found")
    for f in files:
        safetensors_header(f)
    try:
        model, _ = load_model(path, lazy, model_config=model_config,
                              trust_remote_code=trust_remote_code)
    except MTPError:
        raise
    except Exception as e:
        msg = first_line(e)
        if "trust_remote_code" in msg:  # mlx-lm's refusal of a custom model_file
            raise MTPError(f"{path}: {msg}") from None
        raise MTPError(f"{path}: weights do not match config.json ({msg})") from None
    if dtype is not None:
        predicate = getattr(model, "cast_predicate", None) or (lambda _: True)
        model.update(tree_map_floats(model.parameters(), dtype, predicate))
    if adapter_path is not None:
        model = _load_adapters(model, adapter_path)
    return model


def _load_adapters(model: nn.Module, adapter_path) -> nn.Module:
    """mlx-lm's ``load_adapters`` (what ``mlx_lm.load(adapter_path=...)`` runs), one-line errors."""
    from mlx_lm.utils import load_adapters

    p = Path(adapter_path).expanduser()
    if not (p / "adapter_config.json").is_file() or not (p / "adapters.safetensors").is_file():
        raise MTPError(f"adapter_path {adapter_path}: expected a folder with adapter_config.json "
                       "and adapters.safetensors (as mlx_lm.lora writes)")
    try:
        model = load_adapters(model, str(p))
    except Exception as e:
        raise MTPError(f"adapter_path {adapter_path}: {first_line(e)}") from None
    model.eval()
    return model


def tree_map_floats(params, dtype, predicate):
    """Cast floating parameters (not packed quantized ints) to ``dtype`` where ``predicate``."""
    from mlx.utils import tree_map_with_path

    def cast(path, v):
        if mx.issubdtype(v.dtype, mx.floating) and predicate(path):
            return v.astype(dtype)
        return v

    return tree_map_with_path(cast, params)


# ---------------------------------------------------------------------------------------- head


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


def collect_head_weights(files, *, prefixed_only: bool) -> Tuple[Dict[str, mx.array], dict]:
    """Head tensors (keys relative to the head, norms shifted where raw HF) from ``files``."""
    weights, info = {}, {"files": [], "shifted": False}
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
        tensors = _load_safetensors(f)
        for k, (rel, raw_prefix) in picked.items():
            v = tensors[k]
            # Raw HF ``mtp.*`` tensors are zero-centred; prefix-stripped keys (mlx-vlm's drafter
            # layout) and MLX-format files carry norms that are already shifted.
            if raw_prefix and prov == "hf" and is_zero_centred_norm(rel) and v.ndim == 1:
                v = v + 1.0
                info["shifted"] = True
            weights[rel] = v
        info["files"].append(str(f))
    return weights, info


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
               quantization: Optional[dict] = None) -> MTPHead:
    if any(k.endswith("weight_scale_inv") for k in weights):
        raise MTPError(f"{source}: FP8 block-quantized MTP weights are not supported; "
                       "use the BF16 checkpoint or an MLX drafter folder")
    weights = _stack_experts(weights)
    layer_ids = {int(m.group(1)) for k in weights if (m := re.match(r"layers\.(\d+)\.", k))}
    if not layer_ids:
        raise MTPError(f"{source}: no MTP decoder layer tensors (layers.0.*) found")
    head = MTPHead(target.args, num_layers=max(layer_ids) + 1)
    if quantization is not None:
        q = quantization

        def predicate(p, m):
            return hasattr(m, "to_quantized") and f"{p}.scales" in weights

        nn.quantize(head, group_size=q.get("group_size", 64), bits=q.get("bits", 4),
                    mode=q.get("mode", "affine"), class_predicate=predicate)
    expected = dict(tree_flatten(head.parameters()))
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing:
        raise MTPError(f"{source}: MTP head tensor {missing[0]} missing "
                       f"({len(missing)} missing in all)")
    if extra:
        raise MTPError(f"{source}: unexpected MTP head tensor {extra[0]} "
                       f"({len(extra)} unexpected in all)")
    for k, v in expected.items():
        if tuple(weights[k].shape) != tuple(v.shape):
            raise MTPError(f"{source}: MTP head tensor {k} has shape {tuple(weights[k].shape)}, "
                           f"expected {tuple(v.shape)} for this target (hidden_size "
                           f"{target.hidden_size}, vocab_size {target.vocab_size})")
    dtype = target.dtype
    cast = {k: (v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v)
            for k, v in weights.items()}
    head.load_weights(list(cast.items()), strict=True)
    head.eval()
    mx.eval(head.parameters())
    return head


def load_head_from_target(path: Path, target: Qwen3_5Target) -> Optional[MTPHead]:
    weights, info = collect_head_weights(weight_files(path), prefixed_only=True)
    if not weights:
        return None
    return build_head(target, weights, str(path))


def load_head_from_drafter(drafter_path, target: Qwen3_5Target) -> MTPHead:
    path = resolve_path(drafter_path, "drafter")
    config = read_config(path) if (path / "config.json").exists() else {}
    mt = config.get("model_type")
    if mt is not None and mt not in DRAFTER_MODEL_TYPES + SUPPORTED_MODEL_TYPES:
        raise MTPError(f"{path / 'config.json'}: model_type {mt!r} is not an MTP drafter "
                       f"(expected {', '.join(DRAFTER_MODEL_TYPES)})")
    files = weight_files(path)
    if not files:
        raise MTPError(f"drafter {path}: no .safetensors files found")
    # A full checkpoint given as drafter contributes only its mtp.* tensors.
    weights, _ = collect_head_weights(files, prefixed_only=mt in SUPPORTED_MODEL_TYPES)
    if not weights:
        raise MTPError(f"drafter {path}: no MTP head tensors found")
    text = _text_config(config) if config else {}
    for key in ("hidden_size", "vocab_size"):
        want = getattr(target.args, key)
        if key in text and text[key] != want:
            raise MTPError(f"drafter {path}: {key} {text[key]} does not match the target's {want}")
    return build_head(target, weights, f"drafter {path}", config.get("quantization"))


# ---------------------------------------------------------------------------------------- public


def default_dtype() -> Optional[mx.Dtype]:
    """float32 on the CPU backend (its bf16/f16/quantized matmuls are scalar loops on x86)."""
    return mx.float32 if mx.default_device() == mx.cpu else None


def make_drafter(head: MTPHead, target: Qwen3_5Target, options: DraftOptions,
                 path: Path) -> QwenMTPDrafter:
    """The drafter with ``options`` applied: the head quantized (phase 3), a draft vocabulary
    sidecar read against the target's tokenizer and LM head (phase 2b)."""
    from .quantize_drafter import quantize_head

    if options.bits is not None:
        quantize_head(head, bits=options.bits, group_size=options.group_size,
                      quantize_fc=options.quantize_fc)
    ids = None
    if options.vocab is not None:
        ids = draft_vocab.load_ids(options.vocab, load_tokenizer(path), target)
    return QwenMTPDrafter(head, target, options, ids)


def load_model(path_or_hf_repo, *, drafter=None, dtype="auto", require_head: bool = True,
               draft_options: Optional[DraftOptions] = None, model_config: Optional[dict] = None,
               adapter_path=None, lazy: bool = False, revision: Optional[str] = None,
               trust_remote_code: bool = False) -> MTPModel:
    """Load the target through mlx-lm and attach its MTP drafter (run as ``draft_options``
    says: ``mlx_mtp.drafters.options``). The other arguments are ``mlx_lm.load``'s; adapters
    change the target only (the MTP head stays the checkpoint's: acceptance may drop, output
    stays exact)."""
    if cpu_blas.STATE.error:
        raise MTPError(cpu_blas.STATE.error)
    if model_config is not None and not isinstance(model_config, dict):
        raise MTPError(f"model_config must be a dict, got {type(model_config).__name__}")
    path = resolve_path(path_or_hf_repo, revision=revision)
    config = read_config(path)
    config.update(model_config or {})
    target_args = dict(model_config=model_config, lazy=lazy,
                       trust_remote_code=trust_remote_code, adapter_path=adapter_path)
    if config.get("model_type") in GEMMA4_MODEL_TYPES:  # separate assistant checkpoint
        from .gemma4_loading import load_gemma4_model

        if draft_options is not None and draft_options != DraftOptions():
            raise MTPError("the drafter options (--draft-vocab, --draft-bits, --draft-group-size, "
                           "--draft-quantize-fc) apply to the Qwen MTP head, not to a Gemma 4 "
                           "assistant")

        dtype = default_dtype() if dtype == "auto" else dtype
        return load_gemma4_model(path, config, drafter=drafter, dtype=dtype,
                                 require_head=require_head, target_args=target_args)
    text = _text_config(config)
    if text.get("mtp_use_dedicated_embeddings"):
        raise MTPError(f"{path / 'config.json'}: mtp_use_dedicated_embeddings=true is not supported")
    dtype = default_dtype() if dtype == "auto" else dtype
    mlx_model = load_target(path, config, dtype, **target_args)
    target = Qwen3_5Target(mlx_model)
    if drafter is not None:
        head = load_head_from_drafter(drafter, target)
    else:
        head = load_head_from_target(path, target)
    if head is None and require_head:
        raise MTPError(
            f"{path} has no MTP head weights (mtp.*): MLX conversions (mlx_lm.convert, mlx-vlm) "
            "strip them. Pass --drafter DIR (a qwen3_5_mtp drafter folder, or the raw Hugging "
            "Face checkpoint), or load the raw Hugging Face checkpoint itself")
    return MTPModel(
        mlx_model=mlx_model,
        target=target,
        drafter=(make_drafter(head, target, draft_options or DraftOptions(), path)
                 if head is not None else None),
        config=config,
        path=path,
    )


def load_tokenizer(path: Path, tokenizer_config: Optional[dict] = None, eos_token_ids=None):
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    try:
        return mlx_load_tokenizer(path, tokenizer_config, eos_token_ids=eos_token_ids)
    except Exception as e:
        msg = first_line(e)
        raise MTPError(f"{path}: could not load the tokenizer ({msg})") from None


def load(path_or_hf_repo, tokenizer_config: Optional[dict] = None,
         model_config: Optional[dict] = None, adapter_path: Optional[str] = None,
         lazy: bool = False, return_config: bool = False, revision: Optional[str] = None,
         trust_remote_code: bool = False, *, drafter=None, dtype="auto",
         require_head: bool = True, draft_options: Optional[DraftOptions] = None):
    """``(MTPModel, TokenizerWrapper)``, or with ``return_config`` ``(model, tokenizer,
    config)``: ``mlx_lm.load``'s arguments and defaults, plus ours after them (``drafter``,
    ``dtype``, ``require_head``, ``draft_options``)."""
    model = load_model(path_or_hf_repo, drafter=drafter, dtype=dtype, require_head=require_head,
                       draft_options=draft_options, model_config=model_config,
                       adapter_path=adapter_path, lazy=lazy, revision=revision,
                       trust_remote_code=trust_remote_code)
    tokenizer = load_tokenizer(model.path, tokenizer_config,
                               eos_token_ids=model.config.get("eos_token_id"))
    return (model, tokenizer, model.config) if return_config else (model, tokenizer)
