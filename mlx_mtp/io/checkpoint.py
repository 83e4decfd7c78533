"""Checkpoint files, checked: a path or Hugging Face repo id -> a folder, its config.json, its
safetensors (headers checked before loading), mlx-lm's model class for them, and one loader that
puts drafter weights into a module after checking every name and shape. Family-independent."""

from __future__ import annotations

import glob
import json
import re
import struct
from pathlib import Path
from typing import Callable, Dict, Optional

import huggingface_hub
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm import utils as mlx_lm_utils

from mlx_mtp.io import fp8
from mlx_mtp.errors import MTPError

_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
_DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


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
            return Path(huggingface_hub.snapshot_download(repo_id=s,
                                                          allow_patterns=_DOWNLOAD_PATTERNS,
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


def load_safetensors(f: Path) -> Dict[str, mx.array]:
    try:
        return mx.load(str(f))
    except Exception as e:
        raise MTPError(f"{f}: corrupted safetensors file ({e})") from None



def text_config(config: dict) -> dict:
    return config.get("text_config", config)


def default_dtype() -> Optional[mx.Dtype]:
    """float32 on the CPU backend (its bf16/f16/quantized matmuls are scalar loops on x86)."""
    return mx.float32 if mx.default_device() == mx.cpu else None


def cast_floats(params, dtype, predicate: Callable[[str], bool] = lambda _: True):
    """Cast floating parameters (not packed quantized ints) to ``dtype`` where ``predicate``
    (of the parameter's dotted path); the one place a weight's dtype changes."""
    def cast(path, v):
        if mx.issubdtype(v.dtype, mx.floating) and predicate(path):
            return v.astype(dtype)
        return v

    return tree_map_with_path(cast, params)


def loader_message(e: BaseException, limit: int = 5) -> str:
    """mlx's ``load_weights`` error (a count, then one name per line) as one line that keeps the
    first ``limit`` names."""
    lines = [l.strip().rstrip(",.") for l in str(e).strip().splitlines() if l.strip()]
    if len(lines) <= 1:
        return first_line(e)
    head, names = lines[0].rstrip(": "), lines[1:]
    more = f", ... ({len(names)} in all)" if len(names) > limit else ""
    return f"{head}: {', '.join(names[:limit])}{more}"


def _fp8_classes(block, dtype, model_type: str):
    """mlx-lm's ``get_model_classes`` with a model whose ``sanitize`` first dequantizes FP8
    block-quantized weights (mlx-lm's own qwen3_5 / qwen3_next sanitize does not)."""
    def get_classes(config):
        # mlx-lm's default get_model_classes: it has no public name (load_model's default)
        model_cls, args_cls = mlx_lm_utils._get_classes(config)

        class FP8Dequantizing(model_cls):
            def sanitize(self, weights):
                weights = fp8.dequantize_weights(weights, block, dtype)
                if model_type in fp8.PER_EXPERT_TO_FUSED:
                    weights = fp8.fuse_experts(weights)
                return super().sanitize(weights)

        FP8Dequantizing.__name__ = model_cls.__name__
        FP8Dequantizing.mlx_lm_class = model_cls
        return FP8Dequantizing, args_cls

    return get_classes


def load_mlx_lm_model(path: Path, config: dict, *, lazy: bool = False,
                      fp8_dtype: Optional[mx.Dtype] = None, model_config: Optional[dict] = None,
                      trust_remote_code: bool = False):
    """``(model, config)``: mlx-lm's ``load_model`` for ``path``, FP8 block-quantized weights
    dequantized to ``fp8_dtype`` (default: the config's dtype, else bfloat16); errors as one line
    that keeps the first few tensor names."""
    source = str(path / "config.json")
    fp8.check_quantization(config, source)
    block = fp8.fp8_block(config, source)
    kwargs = {}
    if block is not None:
        dtype = fp8_dtype or config_dtype(config) or mx.bfloat16
        kwargs["get_model_classes"] = _fp8_classes(block, dtype, config.get("model_type"))
    try:
        model, mlx_config = mlx_lm_utils.load_model(path, lazy=lazy, model_config=model_config,
                                                    trust_remote_code=trust_remote_code, **kwargs)
    except MTPError:
        raise
    except Exception as e:
        msg = loader_message(e)
        if "trust_remote_code" in msg:  # mlx-lm's refusal of a custom model_file
            raise MTPError(f"{path}: {msg}") from None
        raise MTPError(f"{path}: weights do not match config.json ({msg})") from None
    if block is not None:  # the model is mlx-lm's own class again once its weights are in
        model.__class__ = model.__class__.mlx_lm_class
    return model, mlx_config


def config_dtype(config: dict) -> Optional[mx.Dtype]:
    """The checkpoint's float dtype as its config states it (``torch_dtype`` / ``dtype``)."""
    for c in (config, config.get("text_config") or {}):
        for key in ("torch_dtype", "dtype"):
            if c.get(key) in ("bfloat16", "float16", "float32"):
                return getattr(mx, c[key])
    return None


def load_checked(module: nn.Module, weights: Dict[str, mx.array], source: str, *, dtype,
                 quantization: Optional[dict] = None, noun: str = "tensor",
                 shape_note: str = "from its config.json") -> nn.Module:
    """Load ``weights`` into ``module`` (quantized first as an MLX-quantized folder says) after
    checking that the names are exactly the module's and every shape matches; floats cast to
    ``dtype``. Any mismatch is one line naming ``source``, the tensor and what was expected."""
    if quantization is not None:  # only the layers the folder holds scales for
        q = quantization
        nn.quantize(module, group_size=q.get("group_size", 64), bits=q.get("bits", 4),
                    mode=q.get("mode", "affine"),
                    class_predicate=lambda p, m: (hasattr(m, "to_quantized")
                                                  and f"{p}.scales" in weights))
    expected = dict(tree_flatten(module.parameters()))
    for names, what in ((sorted(set(expected) - set(weights)), "missing"),
                        (sorted(set(weights) - set(expected)), "unexpected")):
        if names:
            raise MTPError(f"{source}: {what} {noun} {names[0]} ({len(names)} {what} in all)")
    for k, v in expected.items():
        if tuple(weights[k].shape) != tuple(v.shape):
            raise MTPError(f"{source}: {noun} {k} has shape {tuple(weights[k].shape)}, expected "
                           f"{tuple(v.shape)} {shape_note}")
    module.load_weights(list(cast_floats(weights, dtype).items()), strict=True)
    module.eval()
    mx.eval(module.parameters())
    return module


def load_tokenizer(path: Path, tokenizer_config: Optional[dict] = None, eos_token_ids=None):
    try:
        return mlx_lm_utils.load_tokenizer(path, tokenizer_config, eos_token_ids=eos_token_ids)
    except Exception as e:
        msg = first_line(e)
        raise MTPError(f"{path}: could not load the tokenizer ({msg})") from None
