"""benchmarks/sampling_gate.py: both arms run, the byte-gate arm is gated as at T=0 (probe, exact
verify) and the default promises the distribution; the record says so."""

import json

from support import tiny_checkpoints as tc

from benchmarks import sampling_gate


def test_the_record_has_both_arms_and_their_promises(tmp_path):
    model = tc.write_agreeing_checkpoint(tmp_path / "pair", seed=3, lm_scale=0.3)
    sampling_gate.main(["--model", str(model), "--pairs", "1", "--max-tokens", "10",
                        "--out", str(tmp_path / "out"), "--allow-busy", "--idle-window", "0.2",
                        "--prompts", "code"])
    data = json.loads(next((tmp_path / "out").glob("sampling-gate-*.json")).read_text())
    assert data["arms"]["byte-gate"]["promise"] == "byte-identity"
    assert data["arms"]["distribution"]["promise"] == "distribution"
    assert data["probe_s"] > 0 and set(data["probe_verdicts"]) <= {"equal", "diverges"}
    assert len(data["raw"]) == len(data["prompts"]) and data["ratio"] > 0
    text = next((tmp_path / "out").glob("sampling-gate-*.md")).read_text()
    assert "| byte-gate (probe + exact verify) |" in text
    assert "| distribution (no probe, fast verify) | 0 |" in text
