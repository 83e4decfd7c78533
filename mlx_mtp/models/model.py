"""What ``mlx_mtp.load`` returns: mlx-lm's target model, its adapter, and a drafter."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import mlx.nn as nn

from mlx_mtp.models.protocols import Drafter, Target


@dataclass
class MTPModel:
    mlx_model: nn.Module  # mlx-lm's own model: plain decode runs on this unchanged
    # the family's adapter (``mlx_mtp.models.qwen3_5.target``, ``mlx_mtp.models.gemma4.target``)
    target: Target
    drafter: Optional[Drafter]  # None when no head was loaded
    config: dict = field(default_factory=dict)
    path: Optional[Path] = None
    split: Optional[Any] = None  # mlx_mtp.models.distributed.Split when split across processes
