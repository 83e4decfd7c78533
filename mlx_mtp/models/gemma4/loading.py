"""Gemma 4 loading: the target through mlx-lm, the assistant from ``drafter=`` (``--drafter``).

Gemma 4 targets carry no MTP head; the assistant is its own checkpoint (``gemma4_assistant``, or
``gemma4_unified_assistant`` for 12B: same code, different sizes). A pair that cannot work
together (hidden size, vocabulary, head geometry, window, RoPE) is rejected at load time with one
line that names the drafter folder, the setting and both values.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx

from mlx_mtp.io.checkpoint import (cast_floats, load_checked, load_safetensors, read_config,
                                   resolve_path, safetensors_header, weight_files)
from mlx_mtp.errors import MTPError
from mlx_mtp.models import families
from mlx_mtp.models.loader import load_target
from mlx_mtp.models.model import MTPModel
from mlx_mtp.models.options import DraftOptions
from mlx_mtp.models.gemma4 import bf16_assistant
from mlx_mtp.models.gemma4.drafter import Gemma4Assistant, Gemma4AssistantDrafter
from mlx_mtp.models.gemma4.target import Gemma4Target

ASSISTANT_MODEL_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")
# Where ``python -m mlx_mtp.convert --drafter`` puts the assistant inside the target's folder.
EMBEDDED_ASSISTANT = "assistant"
# HF's Gemma4AssistantConfig.validate_architecture: settings every assistant layer must have.
_ASSISTANT_ARCH = {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
                   "enable_moe_block": False, "use_double_wide_mlp": False}


def load_gemma4_model(path: Path, config: dict, *, drafter, dtype, require_head: bool,
                      draft_options: Optional[DraftOptions],
                      target_args: Optional[dict] = None) -> MTPModel:
    options = draft_options or DraftOptions()
    if dataclasses.replace(options, bf16=None) != DraftOptions():
        raise MTPError("the drafter options (--draft-vocab, --draft-bits, --draft-group-size, "
                       "--draft-quantize-fc) apply to the Qwen MTP head, not to a Gemma 4 "
                       "assistant (--draft-bf16 applies to both)")
    target = Gemma4Target(load_target(path, dtype, **(target_args or {})))
    assistant = None
    if drafter is None and (path / EMBEDDED_ASSISTANT / "config.json").is_file():
        drafter = path / EMBEDDED_ASSISTANT  # a folder written by python -m mlx_mtp.convert
    bf16 = False
    if drafter is not None:
        assistant = load_assistant(drafter, target)
        bf16 = bf16_assistant.resolve(options.bf16, assistant, f"drafter {drafter}")
        if bf16:
            bf16_assistant.use_bf16(assistant)
    elif require_head:
        raise MTPError(f"{path} is a Gemma 4 target: its MTP drafter is a separate assistant "
                       "checkpoint. Pass --drafter DIR (drafter=), e.g. the matching "
                       "google/gemma-4-*-it-assistant")
    return MTPModel(
        mlx_model=target.model,
        target=target,
        drafter=(Gemma4AssistantDrafter(assistant, target, bf16=bf16)
                 if assistant is not None else None),
        config=config,
        path=path,
    )


def _rope(params: dict) -> tuple:
    return (params.get("rope_type", "default"), float(params.get("rope_theta", 10000.0)),
            float(params.get("partial_rotary_factor", 1.0)), float(params.get("factor", 1.0)))


def check_pair(config: dict, target: Gemma4Target, source: str) -> None:
    """Config-level checks of the assistant against the target: the settings a pair must share."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise MTPError(f"{source}: config.json has no text_config object")
    args = target.args
    for key, want in _ASSISTANT_ARCH.items():
        got = text.get(key, want)
        if got != want and not (want == 0 and got is None):
            raise MTPError(f"{source}: text_config.{key} is {got!r}, a Gemma 4 assistant needs {want!r}")
    checks = [("backbone_hidden_size", config.get("backbone_hidden_size"), "hidden_size", args.hidden_size),
              ("vocab_size", text.get("vocab_size"), "vocab_size", args.vocab_size),
              ("sliding_window", text.get("sliding_window"), "sliding_window", args.sliding_window)]
    for key, got, target_key, want in checks:
        if got != want:
            raise MTPError(f"{source}: {key} {got} does not match the target's {target_key} {want}")
    for layer_type in dict.fromkeys(text.get("layer_types") or []):
        if layer_type not in target.producers:
            raise MTPError(f"{source}: has {layer_type} layers but the target has no own-KV "
                           f"{layer_type} layer to read from")
        mine = _rope((text.get("rope_parameters") or {}).get(layer_type, {}))
        theirs = _rope(args.rope_parameters.get(layer_type, {}))
        if mine != theirs:
            raise MTPError(f"{source}: {layer_type} RoPE (type, theta, partial factor, factor) "
                           f"{mine} does not match the target's {theirs}")


def check_geometry(assistant: Gemma4Assistant, target: Gemma4Target, source: str) -> None:
    """Per layer type: head_dim equal to the target producer's, query heads a multiple of its
    KV heads (grouped-query attention over the target's K/V)."""
    for layer in assistant.model.layers:
        mine = layer.self_attn
        theirs = target.layers[target.producers[layer.layer_type]].self_attn
        if mine.head_dim != theirs.head_dim:
            raise MTPError(f"{source}: {layer.layer_type} head_dim {mine.head_dim} does not match "
                           f"the target's {theirs.head_dim}")
        if mine.n_heads % theirs.n_kv_heads:
            raise MTPError(f"{source}: num_attention_heads {mine.n_heads} is not a multiple of the "
                           f"target's {theirs.n_kv_heads} {layer.layer_type} KV heads")


def _token_ordering(weights: Dict[str, mx.array], assistant: Gemma4Assistant, source: str) -> None:
    key = "masked_embedding.token_ordering"
    if "masked_embedding" not in assistant:
        weights.pop(key, None)
        return
    if key not in weights:
        raise MTPError(f"{source}: use_ordered_embeddings is set but {key} is missing")
    order = weights.pop(key)
    V = assistant.args.vocab_size
    C = assistant.masked_embedding.num_centroids
    if V % C:
        raise MTPError(f"{source}: vocab_size {V} is not a multiple of num_centroids {C}")
    if order.shape != (V,) or not mx.issubdtype(order.dtype, mx.integer) or \
            not mx.array_equal(mx.sort(order), mx.arange(V, dtype=order.dtype)).item():
        raise MTPError(f"{source}: {key} must be a permutation of 0..{V - 1} "
                       f"(got shape {tuple(order.shape)}, dtype {order.dtype})")
    assistant.masked_embedding.set_token_ordering(order)


def read_assistant_config(drafter_path) -> Tuple[Path, dict]:
    """The assistant folder ``drafter=`` names and its config.json, refused unless it is a
    Gemma 4 assistant (loading and ``python -m mlx_mtp.convert`` read it the same way)."""
    path = resolve_path(drafter_path, "drafter")
    config = read_config(path)
    mt = config.get("model_type")
    if mt not in ASSISTANT_MODEL_TYPES:
        raise MTPError(f"{path / 'config.json'}: model_type {mt!r} is not a Gemma 4 assistant "
                       f"(expected {' or '.join(ASSISTANT_MODEL_TYPES)})")
    return path, config


def read_assistant_weights(path: Path) -> Dict[str, mx.array]:
    """Every tensor of the assistant folder's .safetensors files, as stored."""
    files = weight_files(path)
    if not files:
        raise MTPError(f"drafter {path}: no .safetensors files found")
    weights = {}
    for f in files:
        safetensors_header(f)
        weights.update(load_safetensors(f))
    return weights


def load_assistant(drafter_path, target: Gemma4Target) -> Gemma4Assistant:
    path, config = read_assistant_config(drafter_path)
    source = f"drafter {path}"
    check_pair(config, target, source)
    weights = read_assistant_weights(path)
    weights.pop("lm_head.weight", None)  # tied to model.embed_tokens
    try:
        assistant = Gemma4Assistant(config)
    except (TypeError, ValueError, KeyError) as e:
        raise MTPError(f"{source}: config.json does not describe a Gemma 4 assistant ({e})") from None
    check_geometry(assistant, target, source)
    _token_ordering(weights, assistant, source)
    # An MLX-quantized folder is quantized as it says; the centroids stay unquantized.
    return load_checked(assistant, weights, source, dtype=target.dtype,
                        quantization=config.get("quantization"))


# ------------------------------------------------------------------------------- conversion
# ``mlx_mtp.convert``'s hooks (``mlx_mtp.models.families.Family``): the assistant, when one is
# given, goes into the converted folder (``EMBEDDED_ASSISTANT``), where ``load_gemma4_model``
# looks for it.


def check_conversion(conv: families.Conversion) -> None:
    if conv.head_bits is not None or conv.draft_vocab is not None:
        raise MTPError("--head-bits and --draft-vocab apply to the Qwen MTP head, not to a "
                       "Gemma 4 assistant")


def convert_assistant(conv: families.Conversion) -> dict:
    """With ``--drafter``: the assistant's tensors, floats cast to the target's dtype, written
    into ``EMBEDDED_ASSISTANT`` (names and config as they are: the loader reads the checkpoint
    layout)."""
    if conv.drafter is None:
        return {}
    path, config = read_assistant_config(conv.drafter)
    weights = cast_floats(read_assistant_weights(path), conv.dtype)
    bar = conv.progress("converting assistant", len(weights))
    for v in weights.values():
        mx.eval(v)
        bar.update()
    bar.close()
    out = conv.out / EMBEDDED_ASSISTANT
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    config["dtype"] = str(conv.dtype).split(".")[-1]
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return {"assistant": str(path)}
