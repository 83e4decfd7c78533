"""Gemma 4's mixture-of-experts target (the 26B-A4B layout) verifies through the grouped experts
(``mlx_mtp.exactness.grouped_experts``): T=0 output is mlx-lm's greedy decode at block sizes
1-6, with draft trees and in batches, and the grouped products ran (asserted, by width)."""

import mlx.core as mx
import pytest
from support.reference import reference_greedy
from support.grouped_rows import record_kernel_rows
from support.native_support import one_row_products_in_kernel_order, require_lazy
from support.packed import assert_packed_verify_equals_alone
from support.tiny_gemma4 import Checkpoints

import mlx_mtp
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.exactness import grouped_experts

MAX_TOKENS = 24
PROMPT = [(11 * i + 5) % 300 for i in range(20)]  # longer than the window (16)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return Checkpoints(tmp_path_factory)


@pytest.fixture(autouse=True)
def lazy():
    require_lazy()


@pytest.fixture
def grouped_rows(monkeypatch):
    """The widths of the verify blocks (and one-token steps) the expert kernel computed."""
    return record_kernel_rows(monkeypatch)


def kernel_runs() -> bool:
    return one_row_products_in_kernel_order()


def run(model, block_size, stats=None, **kw):
    return [t for t, _ in mlx_mtp.generate_step(mx.array(PROMPT), model, max_tokens=MAX_TOKENS,
                                                block_size=block_size, stats=stats, **kw)]


def test_greedy_identity_at_every_block_size_and_with_trees(ckpts, grouped_rows):
    path = ckpts.target("26b", "gemma4")
    model = mlx_mtp.load_model(path, drafter=ckpts.assistant("26b"))
    ref = reference_greedy(path, PROMPT, MAX_TOKENS)
    assert len(set(ref)) > MAX_TOKENS // 2
    method = grouped_experts.KERNEL if kernel_runs() else grouped_experts.SORTED
    for block_size in range(1, 7):
        grouped_rows.clear()
        stats = RunStats()
        assert run(model, block_size, stats) == ref, block_size
        if block_size > 1:
            widths = stats.exactness["row_exact"]["experts"]["widths"]
            assert widths[str(block_size)] == {method: 12}, widths  # every layer has experts
            if kernel_runs():
                assert block_size in grouped_rows
    grouped_rows.clear()
    stats = RunStats()
    assert run(model, 4, stats, draft_topk=2) == ref
    assert stats.exactness["tree"]["verdict"] == "equal"
    if kernel_runs():
        assert max(grouped_rows) > 4


def test_a_packed_batch_verifies_grouped(ckpts, grouped_rows):
    target = mlx_mtp.load_model(ckpts.target("26b", "text"), require_head=False).target
    target.prepare(8)
    prompts = [[(7 * i + 3 * s + 1) % 300 for i in range(n)] for s, n in enumerate((9, 20, 5))]
    blocks = [[(11 * i + s) % 300 for i in range(w)] for s, w in enumerate((3, 1, 4))]
    assert_packed_verify_equals_alone(target, prompts, blocks, "26b")
    if kernel_runs():
        assert 8 in grouped_rows
