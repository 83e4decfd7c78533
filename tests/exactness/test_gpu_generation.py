"""Apple GPU generation from the Metal architecture string, and the device facts the gate uses."""

import mlx.core as mx
import pytest

from mlx_mtp.exactness.device import (DeviceFacts, chip_name, current_device_facts, facts_from,
                                    narrow_kernel_architecture, parse_generation)


@pytest.mark.parametrize("arch,generation", [
    ("applegpu_g13g", 13),  # M1
    ("applegpu_g13s", 13),  # M1 Max
    ("applegpu_g13d", 13),  # M1 Ultra
    ("applegpu_g14g", 14),  # M2
    ("applegpu_g14s", 14),
    ("applegpu_g15s", 15),  # M3 Max
    ("applegpu_g15d", 15),  # M3 Ultra
    ("applegpu_g16s", 16),  # M4 Max
    ("applegpu_g16g", 16),
    ("applegpu_g17s", 17),  # M5 Max
    ("applegpu_g18p", 18),  # a phone part of a later generation
    ("APPLEGPU_G15S", 15),
    (" applegpu_g15s\n", 15),
    ("applegpu_g15", None),  # no size suffix
    ("applegpu_g5s", None),
    ("applegpu_g155s", None),
    ("applegpu_gxxs", None),
    ("apple9", None),
    ("x86_64", None),  # the CPU device
    ("arm64", None),
    ("sm_90", None),  # a CUDA device
    ("", None),
    (None, None),
    (15, None),
])
def test_parse_generation(arch, generation):
    assert parse_generation(arch) == generation


@pytest.mark.parametrize("generation,chip", [(13, "M1"), (14, "M2"), (15, "M3"), (16, "M4"),
                                             (17, "M5"), (12, None), (18, None), (None, None)])
def test_chip_names(generation, chip):
    assert chip_name(generation) == chip


@pytest.mark.parametrize("arch,narrow", [
    ("applegpu_g15s", "applegpu_g14s"),
    ("applegpu_g16g", "applegpu_g14g"),
    ("applegpu_g17d", "applegpu_g14d"),
    ("applegpu_g14s", None),  # already the one-row kernel
    ("applegpu_g13d", None),
    ("x86_64", None),
])
def test_narrow_kernel_architecture(arch, narrow):
    assert narrow_kernel_architecture(arch) == narrow


@pytest.mark.parametrize("device_type,metal,cuda,info,environ,want", [
    (mx.gpu, True, False, {"architecture": "applegpu_g15s"}, {},
     DeviceFacts("metal", "applegpu_g15s", 15)),
    (mx.gpu, True, False, {"architecture": "applegpu_g14s"},
     {"MLX_METAL_GPU_ARCH": "applegpu_g14s"},
     DeviceFacts("metal", "applegpu_g14s", 14, "applegpu_g14s")),
    (mx.gpu, True, False, {}, {}, DeviceFacts("metal", "", None)),
    (mx.cpu, True, False, {"architecture": "arm64"}, {}, DeviceFacts("cpu", "arm64", None)),
    (mx.gpu, False, True, {"architecture": "sm_90"}, {}, DeviceFacts("cuda", "sm_90", None)),
    (mx.cpu, False, False, {"architecture": "x86_64"}, {}, DeviceFacts("cpu", "x86_64", None)),
])
def test_facts_from(device_type, metal, cuda, info, environ, want):
    assert facts_from(device_type, metal, cuda, info, environ) == want


@pytest.mark.parametrize("facts,text", [
    (DeviceFacts("metal", "applegpu_g15s", 15), "metal (applegpu_g15s: Apple GPU generation 15, M3)"),
    (DeviceFacts("metal", "applegpu_g14s", 14, "applegpu_g14s"),
     "metal (applegpu_g14s: Apple GPU generation 14, M2, MLX_METAL_GPU_ARCH=applegpu_g14s)"),
    (DeviceFacts("metal", "apple9", None), "metal (apple9: Apple GPU of unknown generation)"),
    (DeviceFacts("cpu", "x86_64", None), "cpu (x86_64)"),
    (DeviceFacts("cuda", "sm_90", None), "cuda (sm_90)"),
])
def test_describe(facts, text):
    assert facts.describe() == text


def test_current_device_facts_on_the_cpu():
    previous = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        facts = current_device_facts()
    finally:
        mx.set_default_device(previous)
    assert facts == DeviceFacts("cpu", mx.device_info(mx.cpu)["architecture"], None)
    assert facts.to_dict() == {"device": "cpu", "architecture": facts.architecture,
                               "gpu_generation": None, "arch_override": None}
