"""``mlx_mtp.load`` / ``load_model``: a path or Hugging Face repo id -> ``MTPModel`` (mlx-lm's
target, its family adapter, the drafter). The config's ``model_type`` picks the family's loader
(``LOADERS``); file checks live in ``mlx_mtp.io.checkpoint``, the families in their folders."""

from __future__ import annotations

from typing import Optional

from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.io.checkpoint import default_dtype, load_tokenizer, read_config, resolve_path
from mlx_mtp.models.distributed import Split, init_split
from mlx_mtp.errors import MTPError
from mlx_mtp.models.gemma4.loading import load_gemma4_model
from mlx_mtp.models.gemma4.target import GEMMA4_MODEL_TYPES
from mlx_mtp.models.model import MTPModel
from mlx_mtp.models.qwen3_5.loading import load_qwen3_5_model
from mlx_mtp.models.options import DraftOptions
from mlx_mtp.models.qwen3_5.target import QWEN3_5_MODEL_TYPES

# model_type -> loader(path, config, *, drafter, dtype, require_head, draft_options,
#                       target_args[, split]) -> MTPModel (target_args: load_target's keywords;
#                       families that mlx-lm can split take ``split``: SPLITTABLE)
LOADERS = {
    **{t: load_qwen3_5_model for t in QWEN3_5_MODEL_TYPES},
    **{t: load_gemma4_model for t in GEMMA4_MODEL_TYPES},  # the assistant: a separate checkpoint
}
SUPPORTED_MODEL_TYPES = tuple(LOADERS)
# model_type -> the splits mlx-lm 0.32 has for it (qwen3_next: ``pipeline`` but no ``shard``)
SPLITTABLE = {"qwen3_5": ("pipeline", "tensor"), "qwen3_5_moe": ("pipeline", "tensor"),
              "qwen3_next": ("pipeline",)}


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
    loader = LOADERS.get(model_type)
    if loader is None:
        raise MTPError(f"{path / 'config.json'}: unknown model_type {model_type!r}, expected one "
                       f"of {', '.join(SUPPORTED_MODEL_TYPES)}")
    kwargs = {}
    if split is not None:
        kind = getattr(split, "kind", split)
        if model_type not in SPLITTABLE:
            raise MTPError(f"{path}: --split {kind}: mlx-lm {_mlx_lm_version()} cannot split "
                           f"{model_type} (no pipeline or shard method); only Qwen3.5 / 3.6 / "
                           "Qwen3-Next targets can be split")
        if kind in ("pipeline", "tensor") and kind not in SPLITTABLE[model_type]:
            raise MTPError(f"{path}: --split {kind}: mlx-lm {_mlx_lm_version()} cannot split "
                           f"{model_type} that way; use --split "
                           f"{' or '.join(SPLITTABLE[model_type])}")
        kwargs["split"] = split if isinstance(split, Split) else init_split(split)
    target_args = dict(model_config=model_config, lazy=lazy,
                       trust_remote_code=trust_remote_code, adapter_path=adapter_path)
    return loader(path, config, drafter=drafter,
                  dtype=default_dtype() if dtype == "auto" else dtype,
                  require_head=require_head, draft_options=draft_options,
                  target_args=target_args, **kwargs)


def _mlx_lm_version() -> str:
    import mlx_lm

    return mlx_lm.__version__


def load(path_or_hf_repo, tokenizer_config: Optional[dict] = None,
         model_config: Optional[dict] = None, adapter_path: Optional[str] = None,
         lazy: bool = False, return_config: bool = False, revision: Optional[str] = None,
         trust_remote_code: bool = False, *, drafter=None, dtype="auto",
         require_head: bool = True, draft_options: Optional[DraftOptions] = None, split=None):
    """``(MTPModel, TokenizerWrapper)``, or with ``return_config`` ``(model, tokenizer,
    config)``: ``mlx_lm.load``'s arguments and defaults, plus ours after them (``drafter``,
    ``dtype``, ``require_head``, ``draft_options``, ``split``)."""
    model = load_model(path_or_hf_repo, drafter=drafter, dtype=dtype, require_head=require_head,
                       draft_options=draft_options, model_config=model_config,
                       adapter_path=adapter_path, lazy=lazy, revision=revision,
                       trust_remote_code=trust_remote_code, split=split)
    tokenizer = load_tokenizer(model.path, tokenizer_config,
                               eos_token_ids=model.config.get("eos_token_id"))
    return (model, tokenizer, model.config) if return_config else (model, tokenizer)
