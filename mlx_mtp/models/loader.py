"""``mlx_mtp.load`` / ``load_model``: a path or Hugging Face repo id -> ``MTPModel`` (mlx-lm's
target, its family adapter, the drafter). The config's ``model_type`` picks the family
(``mlx_mtp.models.families``), whose ``load`` does the rest, calling ``load_target`` here for
mlx-lm's model (split, cast, adapters); file checks live in ``mlx_mtp.io.checkpoint``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm import utils as mlx_lm_utils

from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.demo import demo_path
from mlx_mtp.io.checkpoint import (cast_floats, default_dtype, first_line, load_mlx_lm_model,
                                   load_tokenizer, read_config, resolve_path, safetensors_header,
                                   weight_files)
from mlx_mtp.models import families
from mlx_mtp.models.distributed import Split, init_split, shard_model
from mlx_mtp.errors import MTPError
from mlx_mtp.models.model import MTPModel
from mlx_mtp.models.options import DraftOptions


def load_model(path_or_hf_repo, *, drafter=None, dtype="auto", require_head: bool = True,
               draft_options: Optional[DraftOptions] = None, model_config: Optional[dict] = None,
               adapter_path=None, lazy: bool = False, revision: Optional[str] = None,
               trust_remote_code: bool = False, split=None) -> MTPModel:
    """Load the target through mlx-lm and attach its MTP drafter (run as ``draft_options``
    says: ``mlx_mtp.models.options``). The other arguments are ``mlx_lm.load``'s; adapters
    change the target only (the MTP head stays the checkpoint's: acceptance may drop, output
    stays exact). ``split``: ``"pipeline"`` or ``"tensor"`` (or a
    ``mlx_mtp.models.distributed.Split``) splits the target over the processes ``mlx.launch``
    started (``mlx_mtp.models.distributed``)."""
    if cpu_blas.STATE.error:
        raise MTPError(cpu_blas.STATE.error)
    if model_config is not None and not isinstance(model_config, dict):
        raise MTPError(f"model_config must be a dict, got {type(model_config).__name__}")
    path = resolve_path(path_or_hf_repo, revision=revision)
    config = read_config(path)
    config.update(model_config or {})
    model_type = config.get("model_type")
    family = families.for_model_type(model_type)
    if family is None:
        raise MTPError(f"{path / 'config.json'}: unknown model_type {model_type!r}, expected one "
                       f"of {', '.join(families.model_types())}")
    kwargs = {}
    if split is not None:
        kind = getattr(split, "kind", split)
        splits = family.splits.get(model_type)
        if splits is None:
            splittable = " or ".join(f.title for f in families.all_families() if f.splits)
            raise MTPError(f"{path}: --split {kind}: mlx-lm {_mlx_lm_version()} cannot split "
                           f"{model_type} (no pipeline or shard method); only {splittable} "
                           "targets can be split")
        if kind in ("pipeline", "tensor") and kind not in splits:
            raise MTPError(f"{path}: --split {kind}: mlx-lm {_mlx_lm_version()} cannot split "
                           f"{model_type} that way; use --split {' or '.join(splits)}")
        kwargs["split"] = split if isinstance(split, Split) else init_split(split)
    target_args = dict(model_config=model_config, lazy=lazy,
                       trust_remote_code=trust_remote_code, adapter_path=adapter_path)
    return family.load(path, config, drafter=drafter,
                       dtype=default_dtype() if dtype == "auto" else dtype,
                       require_head=require_head, draft_options=draft_options,
                       target_args=target_args, **kwargs)


def _mlx_lm_version() -> str:
    import mlx_lm

    return mlx_lm.__version__


def load(path_or_hf_repo=None, tokenizer_config: Optional[dict] = None,
         model_config: Optional[dict] = None, adapter_path: Optional[str] = None,
         lazy: bool = False, return_config: bool = False, revision: Optional[str] = None,
         trust_remote_code: bool = False, *, drafter=None, dtype="auto",
         require_head: bool = True, draft_options: Optional[DraftOptions] = None, split=None):
    """Load a target and its MTP drafter, as ``mlx_lm.load`` loads a model.

    Args:
        path_or_hf_repo (str, optional): The target's folder or Hugging Face repo id.
          Default: ``None``, the demo pair embedded in the package (the CLI's default; its
          decode settings: ``mlx_mtp.DEMO_DECODE.generation_kwargs()``).
        tokenizer_config (dict, optional): Tokenizer settings, as mlx-lm's. Default: ``None``.
        model_config (dict, optional): Overrides of the target's config. Default: ``None``.
        adapter_path (str, optional): LoRA adapters for the target (the head stays the
          checkpoint's: acceptance may drop, output stays exact). Default: ``None``.
        lazy (bool): Leave the weights unevaluated until used. Default: ``False``.
        return_config (bool): Also return the config. Default: ``False``.
        revision (str, optional): The Hugging Face revision. Default: ``None``.
        trust_remote_code (bool): Allow custom model code, as mlx-lm's. Default: ``False``.
        drafter (str, optional): A separate MTP head's (or Gemma 4 assistant's) folder or repo
          id. Default: ``None`` (the head in the target's folder or checkpoint).
        dtype: The float dtype of the target and head; ``"auto"``: float32 on the CPU backend,
          else as stored. Default: ``"auto"``.
        require_head (bool): Fail when no drafter is found; False loads a plain target.
          Default: ``True``.
        draft_options (DraftOptions, optional): How the drafter runs
          (``mlx_mtp.models.options``). Default: ``None`` (the defaults).
        split: ``"pipeline"`` or ``"tensor"`` (or a ``Split``): split the target over the
          processes ``mlx.launch`` started. Default: ``None``.

    Returns:
        Tuple[MTPModel, TokenizerWrapper]: The model and its tokenizer, and with
          ``return_config`` the config third.
    """
    if path_or_hf_repo is None:
        if drafter is not None:
            raise MTPError("drafter needs a path_or_hf_repo: the embedded demo pair has its own "
                           "head")
        path_or_hf_repo = demo_path()
    model = load_model(path_or_hf_repo, drafter=drafter, dtype=dtype, require_head=require_head,
                       draft_options=draft_options, model_config=model_config,
                       adapter_path=adapter_path, lazy=lazy, revision=revision,
                       trust_remote_code=trust_remote_code, split=split)
    tokenizer = load_tokenizer(model.path, tokenizer_config,
                               eos_token_ids=model.config.get("eos_token_id"))
    return (model, tokenizer, model.config) if return_config else (model, tokenizer)


def load_target(path: Path, dtype: Optional[mx.Dtype] = None, *,
                model_config: Optional[dict] = None, lazy: bool = False,
                trust_remote_code: bool = False, adapter_path=None, split=None) -> nn.Module:
    """mlx-lm's own model for ``path`` (its sanitize drops ``mtp.*``), with ``mlx_lm.load``'s
    ``model_config``, ``lazy``, ``trust_remote_code`` and ``adapter_path`` (LoRA / DoRA adapters
    from ``mlx_lm.lora``, applied after the cast to ``dtype``). With ``split``
    (``mlx_mtp.models.distributed.Split``): loaded lazily and split by mlx-lm's own method, as
    ``mlx_lm.utils.sharded_load`` does, so each rank materializes only its part."""
    files = weight_files(path, "model*.safetensors")
    if not files:
        raise MTPError(f"{path}: no model*.safetensors weight files found")
    for f in files:
        safetensors_header(f)
    config = read_config(path)
    config.update(model_config or {})
    model, _ = load_mlx_lm_model(path, config, fp8_dtype=dtype, lazy=lazy or split is not None,
                                 model_config=model_config, trust_remote_code=trust_remote_code)
    if split is not None:
        shard_model(model, split, str(path))
    if dtype is not None:
        predicate = getattr(model, "cast_predicate", None) or (lambda _: True)
        model.update(cast_floats(model.parameters(), dtype, predicate))
    if adapter_path is not None:
        model = _load_adapters(model, adapter_path)
    if split is not None:
        mx.eval(model.parameters())
        split.barrier("loading the split target")
    return model


def _load_adapters(model: nn.Module, adapter_path) -> nn.Module:
    """mlx-lm's ``load_adapters`` (what ``mlx_lm.load(adapter_path=...)`` runs), one-line errors."""
    p = Path(adapter_path).expanduser()
    if not (p / "adapter_config.json").is_file() or not (p / "adapters.safetensors").is_file():
        raise MTPError(f"adapter_path {adapter_path}: expected a folder with adapter_config.json "
                       "and adapters.safetensors (as mlx_lm.lora writes)")
    try:
        model = mlx_lm_utils.load_adapters(model, str(p))
    except Exception as e:
        raise MTPError(f"adapter_path {adapter_path}: {first_line(e)}") from None
    model.eval()
    return model
