"""benchmarks/sampling_gate.py: every arm runs, the byte-gate arm is gated as at T=0 (probe,
row-exact verify), the default and the plain-verify arm promise the distribution, the
plain-verify arm runs without row-exact products; the record says so."""

import json
import os

from support import tiny_checkpoints as tc

from benchmarks import sampling_gate


def test_the_record_has_every_arm_and_their_promises(tmp_path):
    model = tc.write_agreeing_checkpoint(tmp_path / "pair", seed=3, lm_scale=0.3)
    sampling_gate.main(["--model", str(model), "--pairs", "1", "--max-tokens", "10",
                        "--out", str(tmp_path / "out"), "--allow-busy", "--idle-window", "0.2",
                        "--prompts", "code"])
    data = json.loads(next((tmp_path / "out").glob("sampling-gate-*.json")).read_text())
    assert data["arms"]["byte-gate"]["promise"] == "byte-identity"
    assert data["arms"]["distribution"]["promise"] == "distribution"
    assert data["arms"]["plain-verify"]["promise"] == "distribution"
    assert [data["arms"][a]["row_exact_verify"] for a in sampling_gate.ARMS] == [True, True, False]
    assert data["probe_s"] > 0 and set(data["probe_verdicts"]) <= {"equal", "diverges"}
    assert len(data["raw"]) == len(data["prompts"])
    assert set(data["ratios"]) == {"byte-gate", "plain-verify"}
    assert all(q["range"][0] <= q["median"] <= q["range"][1] for q in data["ratios"].values())
    text = next((tmp_path / "out").glob("sampling-gate-*.md")).read_text()
    assert "| byte-gate (probe + row-exact verify) |" in text
    assert "| distribution (the default: no probe, this device's verify) | 0 |" in text
    assert "| plain-verify (no probe, plain multi-row verify) | 0 |" in text
    assert "MLX_MTP_ROW_EXACT" not in os.environ  # the arm puts it back

    record = next((tmp_path / "out").glob("sampling-gate-*.json"))
    sampling_gate.main(["--render", str(record), "--summary", "What the arms say."])
    assert json.loads(record.read_text())["summary"] == "What the arms say."
    md = record.with_suffix(".md").read_text()
    assert md.rstrip().endswith("What the arms say.") and "| plain-verify (no probe" in md
