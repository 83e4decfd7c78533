"""Gemma 4: target adapter, verify attention, rollback caches, the assistant drafter and its
loading."""

from mlx_lm.models import cache as _mlx_cache

from mlx_mtp.models import families
from mlx_mtp.models.gemma4 import loading
from mlx_mtp.models.gemma4.rollback_caches import RollbackKVCache, RollbackRotatingKVCache
from mlx_mtp.models.gemma4.target import GEMMA4_MODEL_TYPES

FAMILY = families.register(families.Family(
    name="gemma4",
    model_types=GEMMA4_MODEL_TYPES,  # the assistant is a separate checkpoint (``drafter=``)
    load=loading.load_gemma4_model,
    title="Gemma 4",
    cache_classes={_mlx_cache.KVCache: RollbackKVCache,
                   _mlx_cache.RotatingKVCache: RollbackRotatingKVCache},
    check_conversion=loading.check_conversion,
    convert_drafter=loading.convert_assistant,
))
