import os
import sys
import tempfile
from pathlib import Path

import pytest

import mlx_mtp  # noqa: F401  (first: it binds MLX to the system BLAS before mlx.core loads)
import mlx.core as mx  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

from support import tiny_checkpoints as tc  # noqa: E402
from mlx_lm.generate import generate_step as mlx_generate_step  # noqa: E402
from mlx_lm.utils import load_model as mlx_load_model  # noqa: E402

CODE_PROMPT = "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x"


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


def run_module(module, *args, check=True):
    """``python -m module args`` in a fresh interpreter (how a user runs the CLIs)."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    r = subprocess.run([sys.executable, "-m", module, *map(str, args)],
                       capture_output=True, text=True, env=env, timeout=300)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def cli(*args, check=True):
    """``python -m mlx_mtp.generate args`` in a fresh interpreter."""
    return run_module("mlx_mtp.generate", *args, check=check)


def draft_accept_draft(drafter, hidden, prompt):
    """A drafter's ids over one round trip: prefill, six drafts, their entries trimmed, an accept
    hook of three rows, six drafts again: ``(first drafts, the hook's seed, second drafts)``."""
    drafter.prefill(hidden, prompt[1:])
    first = drafter.draft(6)
    for c in drafter.cache:
        c.trim(drafter.in_round)
    drafter.in_round = 0
    drafter.accept(hidden[:, :3], prompt[2:5])
    return first.tolist(), drafter.first_draft.tolist(), drafter.draft(6).tolist()


def reference_greedy(path, prompt, max_tokens):
    """mlx-lm's own plain greedy decode of a pristine copy of the target."""
    model, _ = mlx_load_model(Path(path))
    return [t for t, _ in mlx_generate_step(mx.array(prompt), model, max_tokens=max_tokens)]


def assert_headless_model_decodes_plainly(path, prompt, n=12):
    """Loaded without a drafter, a target still decodes plainly (exactly mlx-lm's greedy output),
    and asking it for MTP is a clear error."""
    from mlx_mtp import MTPError

    model = mlx_mtp.load_model(path, require_head=False)
    assert model.drafter is None

    def run(bs):
        return [t for t, _ in mlx_mtp.generate_step(mx.array(prompt), model, max_tokens=n,
                                                    block_size=bs)]

    assert run(1) == reference_greedy(path, prompt, n)
    with pytest.raises(MTPError, match="this model has no MTP head: load one with drafter="):
        run(3)
