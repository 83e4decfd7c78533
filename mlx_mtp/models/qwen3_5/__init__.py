"""Qwen3.5 / Qwen3.6 / Qwen3-Next: target adapter, MTP head and drafter, head loading, draft
vocabulary and head quantization."""

from mlx_lm.models import cache as _mlx_cache

from mlx_mtp.models import families
from mlx_mtp.models.qwen3_5 import loading
from mlx_mtp.models.qwen3_5.target import QWEN3_5_MODEL_TYPES, SpecArraysCache

FAMILY = families.register(families.Family(
    name="qwen3_5",
    model_types=QWEN3_5_MODEL_TYPES,
    load=loading.load_qwen3_5_model,
    # mlx-lm 0.32's splits (qwen3_next: ``pipeline`` but no ``shard``)
    splits={"qwen3_5": ("pipeline", "tensor"), "qwen3_5_moe": ("pipeline", "tensor"),
            "qwen3_next": ("pipeline",)},
    title="Qwen3.5 / 3.6 / Qwen3-Next",
    cache_classes={_mlx_cache.ArraysCache: SpecArraysCache},
    convert_drafter=loading.convert_head,
    finish_conversion=loading.convert_draft_vocab,
))
