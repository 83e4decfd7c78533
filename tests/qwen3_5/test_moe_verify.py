"""Qwen3.5-MoE and Qwen3-Next targets verify through the grouped experts
(``mlx_mtp.exactness.grouped_experts``): T=0 output is mlx-lm's greedy decode at block sizes 1-6,
with draft trees and in batches, the grouped products ran (asserted, by width), the stats say how
each width ran, a check that fails keeps mlx-lm's calls, and sampling keeps plain sampling's
distribution."""

import mlx.core as mx
import pytest
from support.reference import CODE_PROMPT, reference_greedy
from mlx_lm.models.switch_layers import SwitchGLU
from mlx_lm.tokenizer_utils import load as load_tokenizer
from support import tiny_checkpoints as tc
from support.chisquare import goodness_of_fit, two_sample
from support.grouped_rows import record_kernel_rows
from support.native_support import one_row_products_in_kernel_order, require_lazy
from support.packed import assert_packed_verify_equals_alone
from support.plain_sampling import reference

import mlx_mtp
from mlx_mtp.cpu import expert_kernel
from mlx_mtp.decoding.batch_rounds import BatchRounds
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.exactness import grouped_experts
from mlx_mtp.exactness.block_vs_chain import probe_exactness

N_TOKENS = 24
KINDS = ["moe", "moe_per_expert", "next", "wide_moe"]


@pytest.fixture(scope="module")
def wide_moe_dir(tmp_path_factory):
    """Hidden 576 (BLIS reduces a multi-row product of more than 512 inputs in another order than
    one row), 8 experts of 64, top 3, a shared expert of 128: the grouped products carry the
    exactness here, not the BLAS."""
    return tc.write_raw_hf(tmp_path_factory.mktemp("wide_moe"), moe=True, seed=70, hidden=576,
                           text_overrides={"num_experts": 8, "num_experts_per_tok": 3,
                                           "moe_intermediate_size": 64,
                                           "shared_expert_intermediate_size": 128})


@pytest.fixture(autouse=True)
def lazy():
    require_lazy()


@pytest.fixture
def grouped_rows(monkeypatch):
    """The widths of the verify blocks (and one-token steps) the expert kernel computed."""
    return record_kernel_rows(monkeypatch)


def expected_method():
    """The kernel where the bound BLAS reduces one row in its order (the check passes), else
    mlx-lm's products sorted by expert (the kernel's check fails: it keeps mlx-lm's order)."""
    return grouped_experts.KERNEL if one_row_products_in_kernel_order() else grouped_experts.SORTED


def run(model, prompt, block_size, stats=None, n=N_TOKENS, **kw):
    return [t for t, _ in mlx_mtp.generate_step(mx.array(prompt), model, max_tokens=n,
                                                block_size=block_size, stats=stats, **kw)]


@pytest.mark.parametrize("kind", [k if k == "wide_moe" else pytest.param(k, marks=pytest.mark.slow)
                                  for k in KINDS])
def test_greedy_identity_at_every_block_size_through_the_grouped_verify(kind, request,
                                                                        grouped_rows):
    path = request.getfixturevalue(f"{kind}_dir")
    model = mlx_mtp.load_model(path)
    prompt = load_tokenizer(path).encode(CODE_PROMPT)
    ref = reference_greedy(path, prompt, N_TOKENS)
    method = expected_method()
    for block_size in range(1, 7):
        grouped_rows.clear()
        stats = RunStats()
        assert run(model, prompt, block_size, stats) == ref, (kind, block_size)
        if block_size == 1:
            continue
        experts = stats.exactness["row_exact"]["experts"]
        layers = experts["layers"]
        assert layers == len([m for _, m in model.mlx_model.named_modules()
                              if isinstance(m, SwitchGLU)]) > 0
        for w in range(2, block_size + 1):
            assert experts["widths"][str(w)] == {method: layers}, (kind, w, experts)
        if method == grouped_experts.KERNEL:
            # the first token after the prompt is a one-token step; every round verifies
            # block_size rows (the random head's drafts are rejected, so no budget trims them)
            assert experts["widths"]["1"] == {method: layers}
            assert {1, block_size} <= set(grouped_rows), (kind, block_size, grouped_rows)


def test_the_probe_finds_the_grouped_verify_equal_at_every_width(wide_moe_dir, grouped_rows):
    target = mlx_mtp.load_model(wide_moe_dir).target
    results = probe_exactness(target, list(range(2, 7)), memoize=False)
    assert [r.verdict for r in results] == ["equal"] * 5, [r.describe() for r in results]
    if expected_method() == grouped_experts.KERNEL:
        assert set(range(2, 7)) <= set(grouped_rows)


@pytest.mark.parametrize("kind", ["wide_moe", pytest.param("next", marks=pytest.mark.slow)])
def test_draft_trees_verify_grouped_and_give_greedy_output(kind, request, grouped_rows):
    path = request.getfixturevalue(f"{kind}_dir")
    model = mlx_mtp.load_model(path)
    prompt = load_tokenizer(path).encode(CODE_PROMPT)
    ref = reference_greedy(path, prompt, N_TOKENS)
    for block_size, topk in ((3, 2), (4, 3)):
        stats = RunStats()
        assert run(model, prompt, block_size, stats, draft_topk=topk) == ref, (block_size, topk)
        assert stats.exactness["tree"]["verdict"] == "equal"
    if expected_method() == grouped_experts.KERNEL:
        assert max(grouped_rows) > 4  # a tree of 1 + 2 x 2 + ... rows went through the kernel


def test_a_packed_batch_verifies_grouped_and_each_sequence_equals_its_verify_alone(
        wide_moe_dir, grouped_rows):
    target = mlx_mtp.load_model(wide_moe_dir, require_head=False).target
    target.prepare(8)
    V = target.vocab_size
    prompts = [[(7 * i + 3 * s + 1) % V for i in range(n)] for s, n in enumerate((9, 14, 5))]
    blocks = [[(11 * i + s) % V for i in range(w)] for s, w in enumerate((3, 1, 4))]
    assert_packed_verify_equals_alone(target, prompts, blocks, "wide_moe")
    if expected_method() == grouped_experts.KERNEL:
        assert 8 in grouped_rows  # the three blocks' rows in one grouped call


def test_batched_rounds_give_each_prompts_greedy_tokens(wide_moe_dir, grouped_rows):
    model = mlx_mtp.load_model(wide_moe_dir)
    V = model.target.vocab_size
    prompts = [[(5 * i + s + 2) % V for i in range(n)] for s, n in enumerate((6, 11, 8))]
    budgets = [12, 7, 10]
    rounds = BatchRounds(model, 3, block_size=3)
    seqs = [rounds.start(mx.array(p), max_tokens=n) for p, n in zip(prompts, budgets)]
    gens = [rounds.tokens(s) for s in seqs]
    outs = [[] for _ in seqs]
    live = list(range(len(seqs)))
    while live:  # read in turn, as a server does
        for i in list(live):
            item = next(gens[i], None)
            if item is None:
                live.remove(i)
            else:
                outs[i].append(item[0])
    for p, n, out in zip(prompts, budgets, outs):
        assert out == reference_greedy(wide_moe_dir, p, n)
    if expected_method() == grouped_experts.KERNEL:
        assert max(grouped_rows) >= 4  # sequences' blocks packed into one grouped verify


def test_a_failing_check_keeps_mlx_lms_order(wide_moe_dir, monkeypatch):
    """An expert kernel one ulp off in one output: the check declines it at every width, the
    layers compute their blocks with mlx-lm's own one-row calls sorted by expert, and the output
    is still greedy."""
    real = expert_kernel.products

    def off_by_one_ulp(x, indices, weight, threads=1):
        out = real(x, indices, weight, threads)
        bits = out.view(mx.uint32)
        return (bits + (mx.arange(bits.size).reshape(bits.shape) == 0)).view(mx.float32)

    monkeypatch.setattr(expert_kernel, "products", off_by_one_ulp)
    model = mlx_mtp.load_model(wide_moe_dir)
    prompt = load_tokenizer(wide_moe_dir).encode(CODE_PROMPT)
    stats = RunStats()
    assert run(model, prompt, 4, stats) == reference_greedy(wide_moe_dir, prompt, N_TOKENS)
    widths = stats.exactness["row_exact"]["experts"]["widths"]
    assert "1" not in widths  # one row: nothing to sort, mlx-lm's own call
    assert all(widths[str(w)] == {grouped_experts.SORTED: 4} for w in (2, 3, 4)), widths
    assert stats.exactness["verdict"] == "equal"


def test_where_the_kernel_cannot_run_the_stats_say_why(wide_moe_dir, monkeypatch):
    monkeypatch.setattr(expert_kernel, "problem", lambda: "the lazy kernels are unavailable (x)")
    model = mlx_mtp.load_model(wide_moe_dir)
    stats = RunStats()
    run(model, [3, 4, 5], 3, stats, n=6)
    experts = stats.exactness["row_exact"]["experts"]
    assert experts["kernel"] == "unavailable (the lazy kernels are unavailable (x))"
    assert experts["widths"] == {"2": {"sorted": 4}, "3": {"sorted": 4}}


# ------------------------------------------------------------ sampling (the distribution)

PROMPT = [5]
SAMPLING = dict(temp=1.0, top_k=3)
N_SAMPLED = 4
ALPHA = 1e-3


@pytest.fixture(scope="module")
def soft_moe_dir(tmp_path_factory):
    """An MoE head that agrees with its target in the mode but not in every probability."""
    return tc.write_agreeing_checkpoint(tmp_path_factory.mktemp("soft_moe"), seed=3,
                                        lm_scale=0.05, moe=True)


@pytest.mark.slow
def test_sampling_through_the_grouped_verify_keeps_plain_samplings_distribution(
        soft_moe_dir, grouped_rows):
    exact, plain = reference(soft_moe_dir, PROMPT, SAMPLING, N_SAMPLED, 20000)[:2]
    model = mlx_mtp.load_model(soft_moe_dir)
    sampler = mlx_mtp.make_sampler(**SAMPLING)
    stats = RunStats()
    draws = [tuple(t for t, _ in mlx_mtp.generate_step(
        mx.array(PROMPT), model, max_tokens=N_SAMPLED, block_size=3, sampler=sampler, seed=i,
        stats=stats)) for i in range(300)]
    assert stats.acceptance_rule == "speculative-sampling"
    assert stats.accepted > 0  # drafts were kept, so both the kept and the resampled path ran
    assert two_sample(draws, plain)[2] > ALPHA
    assert goodness_of_fit(draws, exact)[2] > ALPHA
    if expected_method() == grouped_experts.KERNEL:
        assert 3 in grouped_rows
