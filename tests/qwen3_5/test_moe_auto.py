"""``auto`` on a mixture-of-experts target falls back to plain steps where no width pays: with a head
that accepts nothing it drafts only its first rounds and its probes, whose gaps grow, and with an
agreeing head it keeps drafting. The chooser sees round times from a cost model of an MoE verify
(dearer per row than a dense one's), not the shared machine's clock; output is greedy either way."""

import mlx.core as mx
import pytest
from support.reference import reference_greedy
from support import tiny_checkpoints as tc

import mlx_mtp
from mlx_mtp.decoding.block_chooser import BlockChooser
from mlx_mtp.decoding.stats import RunStats

N_TOKENS = 96
PROMPT = [5, 17, 42, 9, 77, 3, 120, 64]


class PricedChooser(BlockChooser):
    """``auto``'s chooser, each round timed by a model of an MoE target: a verify of w rows costs
    1 + 0.3 (w - 1) plain steps (its rows read about 1.5x one row's experts), a draft step 0.15."""

    def record_round(self, drafts, accepted, wall_s):
        if wall_s is not None:
            wall_s = 0.05 * (1 + 0.3 * drafts + 0.15 * max(drafts - 1, 0))
        super().record_round(drafts, accepted, wall_s)


def run(path, prompt):
    model = mlx_mtp.load_model(path)
    stats = RunStats()
    chooser = PricedChooser(5)
    ids = [t for t, _ in mlx_mtp.generate_step(mx.array(prompt), model, max_tokens=N_TOKENS,
                                               block_size=chooser, stats=stats)]
    assert ids == reference_greedy(path, prompt, N_TOKENS)
    widths = {int(w): n for w, n in stats.to_dict()["block_sizes"].items()}
    return stats, widths


def test_a_head_that_accepts_nothing_falls_back_to_plain_steps(moe_dir):
    stats, widths = run(moe_dir, PROMPT)
    assert stats.accepted == 0
    drafting = sum(n for w, n in widths.items() if w > 1)
    # the first rounds, then probes after 4, 8, 16 and 32 undrafted steps
    assert drafting <= 9, widths
    assert widths[1] >= N_TOKENS - 12, widths
    # one wide round of the opening's exploration at most, then no wide block
    assert sum(n for w, n in widths.items() if w > 2) <= 1, widths


@pytest.mark.slow
def test_an_agreeing_head_keeps_drafting(tmp_path):
    path = tc.write_agreeing_checkpoint(tmp_path / "agreeing_moe", seed=5, moe=True)
    stats, widths = run(path, PROMPT[:3])
    assert stats.accepted > N_TOKENS // 2
    drafting = sum(n for w, n in widths.items() if w > 1)
    assert drafting > widths.get(1, 0), widths
