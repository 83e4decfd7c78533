"""Under auto, a batch caps each sequence's drafts by what its rows cost the whole batch: the
round-time line over total rows, the greedy allocation of drafts on it, and batched rounds whose
caps change how many drafts are made but never a token."""

import mlx.core as mx
import pytest
from conftest import reference_greedy
from support import tiny_checkpoints as tc

import mlx_mtp
from mlx_mtp.decoding.batch_rounds import BatchRounds
from mlx_mtp.decoding.batch_widths import BatchWidths
from mlx_mtp.decoding.block_chooser import BlockChooser
from mlx_mtp.decoding.round_steps import RoundPlan


def measured(a, b, rows=(4, 6, 9), times=2):
    """A BatchWidths that saw ``times`` rounds of each row count on the line a + b R."""
    widths = BatchWidths()
    for _ in range(times):
        for r in rows:
            widths.observe(r, a + b * r)
    return widths


def test_the_line_needs_two_row_counts_measured_twice_and_must_rise():
    widths = BatchWidths()
    widths.observe(4, 1.0)
    widths.observe(6, 1.4)
    widths.observe(4, 1.0)
    assert widths.line() is None  # row count 6 was seen once
    widths.observe(6, 1.4)
    a, b = widths.line()
    assert (a, b) == pytest.approx((0.2, 0.2))
    assert measured(3.0, -0.1).line() is None  # rows look free: nothing to cap
    assert BatchWidths().caps([[0.9]], [1]) is None


def test_drafts_go_where_they_pay_until_the_next_row_costs_more_than_it_brings():
    """T(R) = 10 + 2R: from two bonus tokens over 14, s0's 0.9 and 0.72 and s1's 0.5 each raise
    the rate (2.9/16, 3.62/18, 4.12/20). At 10 + 4R s1's 0.5 no longer does (4.12/30 < 3.62/26).
    Limits bound each sequence; rows that cost nothing beside the round take every draft; rows
    that cost everything take none."""
    acc = [[0.9, 0.8], [0.5]]
    assert measured(10, 2).caps(acc, [2, 1]) == [2, 1]
    assert measured(10, 4).caps(acc, [2, 1]) == [2, 0]
    assert measured(10, 2).caps(acc, [1, 1]) == [1, 1]
    assert measured(1000, 0.001).caps(acc, [2, 1]) == [2, 1]
    assert measured(0.001, 1000).caps(acc, [2, 1]) == [0, 0]
    # a tree round's four rows are in the round and count one token: from 3 tokens over 34 a
    # row is a smaller share of the round, and s1's 0.5 pays again (5.12/46 > 4.62/42)
    assert measured(10, 4).caps(acc, [2, 1], fixed_rows=4, fixed_blocks=1) == [2, 1]


def test_cap_lowers_the_chains_of_auto_sequences_only():
    """Every row dear: a draft pays only if it brings more than the round's tokens per row (3
    over 8 here); a chooser that saw its first drafts rejected twenty times expects less."""
    widths = measured(0.001, 1000)
    auto = BlockChooser(3)
    for _ in range(20):
        auto.observe(3, 0, 0.1)
    assert auto.optimistic_acceptance()[0] < 3 / 8
    plans = [RoundPlan(3, 0.0, 0.0), RoundPlan(3, 0.0, 0.0), RoundPlan(2, 0.0, 0.0, tree=True)]
    capped = widths.cap([auto, None, auto], plans)
    assert [p.drafts for p in capped] == [0, 3, 2]  # a fixed block size and a tree keep theirs
    assert capped[1] is plans[1] and capped[2] is plans[2]
    assert widths.cap([auto], plans[:1]) == plans[:1]  # one sequence: its own chooser decides


@pytest.fixture(scope="module")
def agreeing_dir(ckpt_root):
    return tc.write_agreeing_checkpoint(ckpt_root / "agreeing-widths", seed=3)


def test_only_auto_batches_are_capped_and_the_setting_turns_it_off(agreeing_dir, monkeypatch):
    model = mlx_mtp.load_model(agreeing_dir)
    assert isinstance(BatchRounds(model, 2, block_size="auto").widths, BatchWidths)
    assert BatchRounds(model, 2, block_size=3).widths is None
    monkeypatch.setenv("MLX_MTP_BATCH_WIDTHS", "0")
    assert BatchRounds(model, 2, block_size="auto").widths is None
    monkeypatch.setenv("MLX_MTP_BATCH_WIDTHS", "yes")
    with pytest.raises(mlx_mtp.MTPError, match="environment variable MLX_MTP_BATCH_WIDTHS must "
                                               "be 0 or 1, got 'yes'"):
        BatchRounds(model, 2, block_size="auto")


@pytest.mark.parametrize("dear", [True, False])
def test_capped_batches_draft_as_the_line_says_and_keep_every_token(agreeing_dir, dear):
    """With rows dear the batch drafts nothing; with rows cheap its sequences draft; either
    way each sequence's tokens are mlx-lm's greedy tokens."""
    model = mlx_mtp.load_model(agreeing_dir)
    V = model.target.vocab_size
    prompts = [[(5 * i + s) % V for i in range(n)] for s, n in enumerate((7, 12, 9))]
    rounds = BatchRounds(model, 3, block_size="auto")
    rounds.widths = measured(0.001, 1000) if dear else measured(1000, 0.001)
    rounds.widths.observe = lambda rows, seconds: None  # keep the line as set
    seqs = [rounds.start(mx.array(p), max_tokens=24) for p in prompts]
    gens = [rounds.tokens(s) for s in seqs]
    outs = [[t for t, _, _ in g] for g in gens]
    for p, out in zip(prompts, outs):
        assert out == reference_greedy(agreeing_dir, p, 24)
    drafted = [s.stats.drafted for s in seqs]
    if dear:
        assert drafted == [0, 0, 0]
    else:
        assert all(d > 0 for d in drafted)
