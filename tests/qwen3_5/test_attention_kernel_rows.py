"""The hybrid Qwen targets' full-attention verify through the attention kernel: chains at blocks
2-5, trees and packed batches give mlx-lm's greedy output with every verify attention in one
pass over the cache (counted), the same tokens and bytes as one SDPA per row
(``MLX_MTP_ATTENTION_KERNEL=0``), and a quantized KV cache keeps one SDPA per row."""

import mlx.core as mx
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer
from support.oracle import OracleDrafter
from support.packed import assert_packed_verify_equals_alone
from support.reference import CODE_PROMPT, reference_greedy

import mlx_mtp
from mlx_mtp.cpu import attention_kernel
from mlx_mtp.exactness import row_attention
from mlx_mtp.exactness.row_exact_layers import bitwise_equal
from mlx_mtp.models.model import MTPModel

N = 24
pytestmark = pytest.mark.skipif(attention_kernel.problem() is not None,
                                reason=f"attention kernel: {attention_kernel.problem()}")


@pytest.fixture(autouse=True)
def fresh_checks():
    row_attention.reset()
    yield
    row_attention.reset()


def forced(path, prompt, ref, block_size):
    """The checkpoint's target with an oracle drafter that accepts 0..k drafts in turn."""
    model = mlx_mtp.load_model(path, require_head=False)
    oracle = OracleDrafter(prompt + ref, schedule=list(range(block_size)),
                           vocab_size=model.target.vocab_size)
    return MTPModel(model.mlx_model, model.target, oracle), oracle


def through_kernel(used):
    """Every verify attention through the kernel where its checks passed on this host (else
    by rows, as decode's SDPA)."""
    checked = row_attention.report().get("checked", {})
    assert checked
    if all(verdict.startswith("equal") for verdict in checked.values()):
        assert used["kernel"] > 0 and used["rows"] == 0, (used, checked)
    else:
        assert used["rows"] > 0, (used, checked)


def generate(model, prompt, **kw):
    return [t for t, _ in mlx_mtp.generate_step(mx.array(prompt), model, max_tokens=N, **kw)]


@pytest.mark.parametrize("kind", ["dense_dir", pytest.param("next_dir", marks=pytest.mark.slow)])
def test_chains_give_greedy_output_through_the_kernel(kind, request, monkeypatch):
    """Blocks 2-5, every acceptance length: mlx-lm's greedy tokens, the verify's attention all
    through the kernel; with the kernel off, the same tokens, all by rows."""
    path = request.getfixturevalue(kind)
    prompt = load_tokenizer(path).encode(CODE_PROMPT)
    ref = reference_greedy(path, prompt, N)
    for block_size in range(2, 6):
        model, oracle = forced(path, prompt, ref, block_size)
        row_attention.reset()
        assert generate(model, prompt, block_size=block_size) == ref, block_size
        assert set(range(block_size)) <= set(oracle.planned)
        through_kernel(row_attention.usage())
    monkeypatch.setenv(row_attention.ENV, "0")
    model, _ = forced(path, prompt, ref, 3)
    row_attention.reset()
    assert generate(model, prompt, block_size=3) == ref
    used = row_attention.usage()
    assert used["kernel"] == 0 and used["rows"] > 0, used


def test_verify_rows_equal_one_sdpa_per_row_bitwise(dense_dir, monkeypatch):
    """Verifies of 1-5 rows after a 600-token prompt (past the first checked tier): the logits
    and, after a rollback to every length, the caches through the kernel are the bytes of one
    SDPA per row."""
    target = mlx_mtp.load_model(dense_dir, require_head=False).target
    target.prepare(8)
    V = target.vocab_size
    prompt = mx.array([(13 * i + 7) % V for i in range(600)])[None]
    full = sum(not layer.is_linear for layer in target.layers)
    assert full > 0

    def verified(width, keep):
        cache = target.make_cache()
        target.hidden(prompt, cache)
        block = mx.array([(11 * i + 5) % V for i in range(width)])[None]
        logits = target.logits(target.verify(block, cache)[0])
        target.rollback(cache, width, keep)
        return logits, target.cache_state(cache)

    for width in range(1, 6):
        for keep in range(1, width + 1):
            monkeypatch.delenv(row_attention.ENV, raising=False)
            row_attention.reset()
            kernel = verified(width, keep)
            # one attention per full-attention layer; one row is decode's own SDPA
            used = row_attention.usage()
            if width == 1:
                assert used == {"kernel": 0, "rows": 0}
            else:
                assert used["kernel"] + used["rows"] == full
                through_kernel(used)
            monkeypatch.setenv(row_attention.ENV, "0")
            rows = verified(width, keep)
            assert bitwise_equal(kernel[0], rows[0]), (width, keep)
            assert all(bitwise_equal(a, b) for a, b in zip(kernel[1], rows[1])), (width, keep)


def test_trees_and_packed_batches_go_through_the_kernel(dense_dir):
    """A draft tree (top-2, 4 nodes): mlx-lm's greedy output; three sequences' blocks in one
    verify equal each verified alone; the verify's attention all through the kernel."""
    model = mlx_mtp.load_model(dense_dir, require_head=False)
    prompt = load_tokenizer(dense_dir).encode(CODE_PROMPT)
    ref = reference_greedy(dense_dir, prompt, N)
    assert generate(model, prompt, block_size=3, draft_topk=2, draft_tokens=4) == ref
    through_kernel(row_attention.usage())
    row_attention.reset()
    target = model.target
    target.prepare(8)
    V = target.vocab_size
    prompts = [[(7 * i + s) % V for i in range(n)] for s, n in enumerate((9, 14, 5))]
    blocks = [[(11 * i + s) % V for i in range(w)] for s, w in enumerate((3, 2, 4))]
    assert_packed_verify_equals_alone(target, prompts, blocks, "dense")
    through_kernel(row_attention.usage())


def test_a_quantized_kv_cache_keeps_one_sdpa_per_row(dense_dir):
    """``kv_bits``: once the cache is quantized its keys are packed tuples, which the kernel does
    not read; those verifies attend by rows."""
    model = mlx_mtp.load_model(dense_dir, require_head=False)
    prompt = load_tokenizer(dense_dir).encode(CODE_PROMPT)
    generate(model, prompt, block_size=3, kv_bits=8, kv_group_size=32, quantized_kv_start=0)
    assert row_attention.usage()["rows"] > 0
