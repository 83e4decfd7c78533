"""The session's fixtures: tiny checkpoints written once per run, and the C kernels' cache folder.
What the tests share beyond fixtures is in ``support/`` (on ``sys.path`` through pyproject.toml's
``pythonpath``)."""

import os
import re
import tempfile
from pathlib import Path

import mlx_mtp  # (first: it binds MLX to the system BLAS before mlx.core loads)
import pytest

from support import tiny_checkpoints as tc


def pytest_collection_modifyitems(config, items):
    """The ``bench`` tests run only when ``-m`` names the marker (``-m bench``, ``-m "bench or not
    bench"``): any other run, with or without ``-m``, leaves them out, as if ``not bench`` were
    added to its expression."""
    if re.search(r"\bbench\b", config.getoption("markexpr") or ""):
        return
    bench = [item for item in items if item.get_closest_marker("bench")]
    if bench:
        config.hook.pytest_deselected(items=bench)
        items[:] = [item for item in items if not item.get_closest_marker("bench")]


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ckpts")


@pytest.fixture(scope="session")
def dense_dir(ckpt_root):
    return tc.write_raw_hf(ckpt_root / "dense", seed=0)


@pytest.fixture(scope="session")
def moe_dir(ckpt_root):
    return tc.write_raw_hf(ckpt_root / "moe", moe=True, seed=10)


@pytest.fixture(scope="session")
def moe_per_expert_dir(ckpt_root):
    return tc.write_raw_hf(ckpt_root / "moe_per_expert", moe=True, seed=10,
                           expert_layout="per_expert", shards=2)


@pytest.fixture(scope="session")
def tied_dir(ckpt_root):
    return tc.write_raw_hf(ckpt_root / "tied", tied=True, seed=20)


@pytest.fixture(scope="session")
def wide_dir(ckpt_root):
    """Projections with inputs wider than 512 (hidden 576, MLP 1152), where BLIS reduces a
    multi-row product differently from a one-row one: the row-exact layers (and, where it
    builds, the compiled row kernel) are what keeps its verify exact."""
    return tc.write_raw_hf(ckpt_root / "wide", seed=40, hidden=576)


# The test runs' own cache of built C kernels (see row_kernel_cache).
KERNEL_CACHE = Path(tempfile.gettempdir()) / f"mlx_mtp-tests-{os.getuid()}" / "kernels"


@pytest.fixture(scope="session", autouse=True)
def row_kernel_cache():
    """The C kernels (the row kernel, the GatedDeltaNet steps and their MLX extension) build into
    the test runs' own cache folder, never ~/.cache, so no test depends on what a user's cache
    holds; fresh interpreters (CLI tests) inherit it. A build is named by a hash of its sources,
    compiler, flags and MLX version, so the next run reuses it (the extension takes about a
    minute on 2 cores) and a changed source is built again; the tests of the build itself use
    fresh folders. Delete the folder to build everything again."""
    from mlx_mtp.cpu import row_kernel

    KERNEL_CACHE.mkdir(parents=True, exist_ok=True)
    os.environ[row_kernel.CACHE_ENV] = str(KERNEL_CACHE)
    row_kernel.reset()
    return KERNEL_CACHE


@pytest.fixture(scope="session")
def big_state_dir(ckpt_root):
    """GatedDeltaNet layers of 4 heads of 128 x 128 (256 KB states): the recurrence's C kernel
    pays from one token on as a lazy op and from two eagerly, without patching its thresholds."""
    return tc.write_raw_hf(ckpt_root / "big_state", seed=60,
                           text_overrides={"linear_key_head_dim": 128,
                                           "linear_value_head_dim": 128})


@pytest.fixture(scope="session")
def next_dir(ckpt_root):
    return tc.write_raw_hf_qwen3_next(ckpt_root / "qwen3_next", seed=30)


@pytest.fixture(scope="session")
def mlx_dir(ckpt_root, dense_dir):
    return tc.write_mlx_converted(dense_dir, ckpt_root / "dense-mlx")


@pytest.fixture(scope="session")
def q4_dir(ckpt_root, dense_dir):
    return tc.write_mlx_converted(dense_dir, ckpt_root / "dense-mlx-4bit", quantize=True)


@pytest.fixture(scope="session")
def soft_dir(ckpt_root):
    """The head agrees with its target in the mode but not in every probability (sampling)."""
    return tc.write_agreeing_checkpoint(ckpt_root / "soft", seed=3, lm_scale=0.05)


@pytest.fixture(scope="module")
def soft_model(soft_dir):
    """Loaded once per test module (a module's tests may share its memo, not another's)."""
    return mlx_mtp.load_model(soft_dir)
