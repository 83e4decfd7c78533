"""Which device the session computes on, and the Apple GPU generation when it is a Metal GPU.

MLX routes quantized matmuls by the generation parsed from the Metal architecture string
(``applegpu_g15s``: the two digits before the one-letter size suffix). From generation 15 (M3) a
verify block of 2+ rows takes a different kernel (``qmv_wide``) than a one-row decode step, so the
two round differently. CPU and CUDA devices have no Apple GPU generation.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

# The first Apple GPU generation whose multi-row quantized matmul reduces differently from the
# one-row kernel (mlx-lm on M3 and later).
FIRST_WIDE_KERNEL_GENERATION = 15
CHIPS = {13: "M1", 14: "M2", 15: "M3", 16: "M4", 17: "M5"}
# MLX reads this once, when it creates the Metal device, and then routes kernels by it.
ARCH_OVERRIDE_ENV = "MLX_METAL_GPU_ARCH"

_METAL_ARCH = re.compile(r"^applegpu_g(\d{2})([a-z])$")


def parse_generation(architecture) -> Optional[int]:
    """``applegpu_g15s`` -> 15. Anything that is not an Apple GPU architecture string -> None."""
    if not isinstance(architecture, str):
        return None
    m = _METAL_ARCH.match(architecture.strip().lower())
    return int(m.group(1)) if m else None


def chip_name(generation: Optional[int]) -> Optional[str]:
    return CHIPS.get(generation)


def narrow_kernel_architecture(architecture: str) -> Optional[str]:
    """The generation-14 architecture string of the same size class (``applegpu_g15s`` ->
    ``applegpu_g14s``): with it in ``MLX_METAL_GPU_ARCH`` MLX sends 2+ affine-quantized rows
    through the one-row kernel. None where the device already does that."""
    gen = parse_generation(architecture)
    if gen is None or gen < FIRST_WIDE_KERNEL_GENERATION:
        return None
    return f"applegpu_g14{architecture.strip().lower()[-1]}"


@dataclass(frozen=True)
class DeviceFacts:
    kind: str  # "metal", "cuda" or "cpu": where the default device computes
    architecture: str  # as MLX reports it (x86_64, arm64, applegpu_g15s, sm_90, ...)
    generation: Optional[int]  # Apple GPU generation; None off Metal or when unparseable
    arch_override: Optional[str] = None  # MLX_METAL_GPU_ARCH when set

    @property
    def chip(self) -> Optional[str]:
        return chip_name(self.generation)

    def describe(self) -> str:
        if self.kind != "metal":
            return f"{self.kind} ({self.architecture})"
        gen = (f"Apple GPU generation {self.generation}" if self.generation is not None
               else "Apple GPU of unknown generation")
        chip = f", {self.chip}" if self.chip else ""
        override = f", {ARCH_OVERRIDE_ENV}={self.arch_override}" if self.arch_override else ""
        return f"metal ({self.architecture}: {gen}{chip}{override})"

    def to_dict(self) -> dict:
        return {"device": self.kind, "architecture": self.architecture,
                "gpu_generation": self.generation, "arch_override": self.arch_override}


def facts_from(device_type, metal: bool, cuda: bool, info: dict, environ=None) -> DeviceFacts:
    """Pure part of ``current_device_facts`` (table-testable without the hardware)."""
    environ = os.environ if environ is None else environ
    arch = str(info.get("architecture", "")) if info else ""
    if device_type == mx.gpu and metal:
        return DeviceFacts("metal", arch, parse_generation(arch),
                           environ.get(ARCH_OVERRIDE_ENV) or None)
    if device_type == mx.gpu and cuda:
        return DeviceFacts("cuda", arch, None)
    return DeviceFacts("cpu", arch, None)


def current_device_facts() -> DeviceFacts:
    """Facts about MLX's default device, where the session's forwards run."""
    device = mx.default_device()
    metal = mx.metal.is_available()
    cuda = hasattr(mx, "cuda") and mx.cuda.is_available()
    try:
        info = mx.device_info(device)
    except Exception:  # an MLX without device_info, or a device it cannot describe
        info = {}
    return facts_from(device.type, metal, cuda, info)
