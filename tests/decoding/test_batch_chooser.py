"""``auto`` in batched rounds: one draft count for the batch, climbed to by measured rate per
batch size; the sequences' own choosers count the rounds' judgments but not their times."""

import pytest

from mlx_mtp import MTPError
from mlx_mtp.decoding.batch_chooser import BatchChooser
from mlx_mtp.decoding.block_chooser import BlockChooser, ChooserSettings


def climb(chooser, size, seconds, rounds):
    """``rounds`` rounds of ``size`` sequences, each emitting 2 tokens a round in
    ``seconds[k]`` at k drafts; the counts chosen, in order."""
    chosen = []
    for _ in range(rounds):
        k = chooser.choose(size)
        chosen.append(k)
        chooser.record_round(size, k, 2 * size, seconds[k])
    return chosen


# a batch whose rate peaks at 3 drafts (the fastest round emits the same tokens here)
SECONDS = [0.5, 0.4, 0.35, 0.3, 0.32, 0.45]


def test_a_batch_size_climbs_to_its_best_count_and_re_measures_its_neighbours():
    chooser = BatchChooser(5, stale_rounds=8)
    chosen = climb(chooser, 4, SECONDS, 16)
    # from first_drafts 1 up to 3 (each better than the last), 4 (worse); then 3, and each of
    # its neighbours again once its measurement is 8 rounds old
    assert chosen == [1, 2, 3, 4, 3, 3, 3, 3, 3, 3, 2, 3, 4, 3, 3, 3]
    assert chooser.best == {4: 3}


def test_a_new_batch_size_starts_from_the_nearest_sizes_choice():
    chooser = BatchChooser(5, stale_rounds=100)
    climb(chooser, 4, SECONDS, 6)
    assert chooser.best == {4: 3}
    # size 7 starts from size 4's 3, then climbs down to 2 (and measures 1, worse)
    assert climb(chooser, 7, [0.5, 0.4, 0.3, 0.4, 0.5, 0.6], 4) == [3, 4, 2, 1]
    assert chooser.best == {4: 3, 7: 2}
    assert chooser.choose(6) == 2 and chooser.choose(5) == 3  # the nearer size's choice
    assert climb(chooser, 2, [0.2, 0.3, 0.4, 0.5, 0.6, 0.7], 5) == [3, 4, 2, 1, 0]
    assert chooser.choose(3) == 3  # sizes 2 and 4 as near: the larger one's


def test_a_counts_rate_is_its_mean_tokens_over_its_median_time():
    chooser = BatchChooser(2, window=3)
    for tokens, seconds in [(9, 9.0), (4, 0.2), (6, 0.3), (8, 0.4)]:  # the first leaves
        chooser.record_round(2, 1, tokens, seconds)
    assert chooser.rate(2, 1) == pytest.approx(6 / 0.3)
    assert chooser.rate(2, 0) is None and chooser.rate(3, 1) is None


def test_what_the_batch_chooser_refuses():
    with pytest.raises(MTPError, match=r"^BatchChooser needs max_drafts >= 1, got 0$"):
        BatchChooser(0)
    with pytest.raises(MTPError, match=r"^BatchChooser needs 0 <= first_drafts <= 3, got 4$"):
        BatchChooser(3, first_drafts=4)
    with pytest.raises(MTPError, match=r"^BatchChooser needs window >= 1 and stale_rounds >= 1$"):
        BatchChooser(3, window=0)


def test_a_sequences_chooser_in_a_batch_counts_judgments_not_times():
    """``record_round`` without a time (a batched round): the judgments count and the widths'
    measurements age, no width gets a sample; ``batched_round`` keys the round's judgments as
    ``choose`` does."""
    chooser = BlockChooser(3, settings=ChooserSettings(token_context=2))
    chooser.see_tokens([4, 5])
    chooser.record_round(0, 0, 0.1)  # width 1 timed alone
    chooser.batched_round()
    assert chooser.key == (4, 5)
    chooser.record_round(2, 1, None)
    assert {w: len(s) for w, s in chooser.samples.items()} == {1: 1, 2: 0, 3: 0, 4: 0}
    assert chooser.tests[:2] == [1.0, 1.0] and chooser.hits[:2] == [1.0, 0.0]
    assert chooser.token_tests[(4, 5)][:2] == [1.0, 1.0]
    assert chooser.round == 2 and chooser.measured_at == {1: 1}
