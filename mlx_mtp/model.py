"""What ``mlx_mtp.load`` returns: mlx-lm's target model, its adapter, and a drafter."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import mlx.nn as nn


@dataclass
class MTPModel:
    mlx_model: nn.Module  # mlx-lm's own model: plain decode runs on this unchanged
    target: Any  # family adapter (``mlx_mtp.qwen3_5 and mlx_mtp.gemma4``)
    drafter: Optional[Any]  # ``mlx_mtp.interfaces.Drafter``; None when no head was loaded
    config: dict = field(default_factory=dict)
    path: Optional[Path] = None
