"""The block-size simulator: its recorded traces reproduce the idle BLIS record's fixed-block runs
round for round, its cost model is the record's, and it replays the chooser."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import simulate_chooser as sim  # noqa: E402

from mlx_mtp.block_chooser import BlockChooser  # noqa: E402


def test_traces_reproduce_the_records_fixed_block_runs():
    """At T=0 a fixed block's rounds are a function of the text: replaying the traces gives the
    rounds and kept drafts every run of the record counted."""
    traces = json.loads(sim.TRACES.read_text())
    record = json.loads(sim.RECORD.read_text())
    costs = sim.costs_from_record(sim.RECORD)
    n = traces["max_tokens"]
    checked = 0
    for block in (2, 3, 4):
        for run in record["raw"][f"mtp{block}"]:
            got = sim.replay(traces["prompts"][run["prompt"]]["L"], n, costs, sim.Noise(0, 0.0),
                             fixed=block)
            rounds = sum(got["widths"].values())
            assert (rounds, n - 1 - rounds) == (run["stats"]["rounds"], run["stats"]["accepted"])
            checked += 1
    assert checked == 3 * record["pairs"] * len(record["prompts"])


def test_cost_model_is_the_records():
    record = {str(r["block_size"]): r for r in json.loads(sim.RECORD.read_text())["rows"]}
    c = sim.costs_from_record(sim.RECORD)
    assert c.verify == {int(w): ms for w, ms in record["auto"]["verify_ms_by_width"].items()}
    assert c.plain_step == record["1"]["round_ms"]["residual"]
    # the accept hook line passes through the fixed blocks of fewest and most tokens per round
    fixed_blocks = [b for b in record if b not in ("1", "auto")]
    ends = (min(fixed_blocks, key=lambda b: record[b]["tokens_per_round"]),
            max(fixed_blocks, key=lambda b: record[b]["tokens_per_round"]))
    assert ends == ("2", "6")
    for b in ends:
        assert c.accept(record[b]["tokens_per_round"]) == pytest.approx(
            record[b]["round_ms"]["accept"])
    fixed = sim.costs_from_record(sim.RECORD, "fixed")
    assert fixed.verify[3] == record["3"]["verify_ms_by_width"]["3"]
    # a round of 2 drafts keeping 1: verify(3) + one drafter step + accept(2 pairs) + the rest
    assert c.round_ms(2, 1) == pytest.approx(c.verify[3] + c.draft_step + c.accept(2)
                                             + c.finalize + c.residual)
    assert c.round_ms(0, 0) == c.verify[1] + c.residual
    # queued phases (no drafter_step_ms): a drafter step is the draft phase per step 2..k
    assert all(record[b]["drafter_step_ms"] is None for b in fixed_blocks)
    per_step = sorted(record[b]["round_ms"]["draft"] / (int(b) - 2) for b in ("3", "4", "5", "6"))
    assert c.draft_step == pytest.approx((per_step[1] + per_step[2]) / 2)  # median of four


def test_simulation_is_deterministic_and_reports_every_prompt(capsys):
    traces = json.loads(sim.TRACES.read_text())
    costs = sim.costs_from_record(sim.RECORD)
    a = sim.simulate(traces, costs, seeds=2, sigma=0.15)
    assert a == sim.simulate(traces, costs, seeds=2, sigma=0.15)
    assert list(a) == ["code", "prose", "enumeration", "random"]
    for r in a.values():
        assert r["ratio"] == pytest.approx(r["auto"] / r["fixed"][r["best"]])
        assert r["best"] == max(r["fixed"], key=r["fixed"].get)
    # noise-free, the chooser's rounds on a trace are what BlockChooser chooses there
    L = traces["prompts"]["random"]["L"]
    got = sim.replay(L, 128, costs, sim.Noise(0, 0.0), chooser=BlockChooser(5))
    assert got["widths"] == {1: 1, 2: 1, 3: 1, 4: 1, 5: 2, 6: 18}
    sim.main(["--seeds", "1"])
    out = capsys.readouterr().out
    assert "| enumeration |" in out and "auto / best fixed" in out


def test_acceptance_traces_agree_with_real_runs_on_a_tiny_pair(tmp_path):
    """The trace script's replay one position at a time and its check against real fixed-block
    and auto runs (which raises on any round that kept other than min(L(p), k))."""
    import tiny_checkpoints as tc
    import acceptance_traces

    model = tc.write_agreeing_checkpoint(tmp_path / "pair", seed=3)
    out = tmp_path / "traces.json"
    acceptance_traces.main(["--model", str(model), "--max-tokens", "16", "--drafts", "3",
                            "--out", str(out)])
    got = json.loads(out.read_text())
    assert (got["max_tokens"], got["drafts"]) == (16, 3)
    assert list(got["prompts"]) == ["code", "prose", "enumeration", "random"]
    for tr in got["prompts"].values():
        assert len(tr["L"]) == 15 and len(tr["tokens"]) == 16
        assert all(0 <= x <= 3 for x in tr["L"])
    assert any(x > 0 for tr in got["prompts"].values() for x in tr["L"])  # the head agrees
