"""The benchmark harness writes a complete record (smoke run on a tiny head-agreeing pair)."""

import json
import sys
from pathlib import Path

import tiny_checkpoints as tc

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_mtp  # noqa: E402


def test_bench_writes_markdown_and_json(tmp_path):
    model = tc.write_agreeing_checkpoint(tmp_path / "pair", seed=3)
    result = bench_mtp.main(["--model", str(model), "--block-sizes", "1,3", "--pairs", "2",
                             "--max-tokens", "12", "--out", str(tmp_path / "out"),
                             "--topic", "smoke", "--summary", "smoke run", "--allow-busy",
                             "--idle-window", "0.2"])
    md = list((tmp_path / "out").glob("smoke-*.md"))
    js = list((tmp_path / "out").glob("smoke-*.json"))
    assert len(md) == 1 and len(js) == 1
    data = json.loads(js[0].read_text())
    assert [r["block_size"] for r in data["rows"]] == [1, 3]
    assert all(r["identical_to_classic"] for r in data["rows"])
    three = data["rows"][1]
    assert three["acceptance"] > 0.9 and len(three["per_position_acceptance"]) == 2
    assert len(data["raw"]["classic"]) == 2 * 3 and len(data["raw"]["mtp3"]) == 2 * 3
    assert data["cpu_blas"] == result["cpu_blas"] and data["bandwidth_gbs"] > 0
    text = md[0].read_text()
    assert three["mtp_enabled"] and three["exactness"]["verdict"] == "equal"
    assert "- block 3: MTP ran; verdict equal; all widths equal" in md[0].read_text()
    for section in ("## Setup", "## Exactness gate", "## Results", "## Round split",
                    "## The floor", "## Idle check", "smoke run"):
        assert section in text
    # The idle check is in the record; a busy machine (--allow-busy) is labelled, not hidden.
    check = data["idle_check"]
    assert check["verdict"] in ("idle", "contended") and check["during"]["total"]["wall_s"] > 0
    contended = check["verdict"] == "contended"
    assert (data.get("label") == "contended: not a result") == contended
    assert md[0].name.endswith("-contended.md") == contended
    assert ("**CONTENDED: NOT A RESULT**" in text) == contended
    # The pictures (tests/test_record_plots.py checks what they are), linked from the .md.
    stem = md[0].stem
    assert sorted(p.name for p in (tmp_path / "out").glob("*.png")) == sorted(
        f"{stem}-{name}.png" for name in ("tps", "acceptance", "rounds"))
    for name in ("tps", "acceptance", "rounds"):
        assert f"]({stem}-{name}.png)" in text


def test_bench_at_temperature_states_the_rule_and_claims_no_identity(tmp_path):
    model = tc.write_agreeing_checkpoint(tmp_path / "pair", seed=3)
    bench_mtp.main(["--model", str(model), "--block-sizes", "3", "--pairs", "1",
                    "--max-tokens", "10", "--out", str(tmp_path / "out"), "--topic", "hot",
                    "--temp", "1.0", "--seed", "5", "--acceptance", "point-mass", "--allow-busy",
                    "--idle-window", "0.2"])
    data = json.loads(next((tmp_path / "out").glob("hot-*.json")).read_text())
    row = data["rows"][0]
    assert (data["temperature"], data["seed"], data["acceptance"]) == (1.0, 5, "point-mass")
    assert row["acceptance_rule"] == "point-mass" and row["identical_to_classic"] is None
    text = next((tmp_path / "out").glob("hot-*.md")).read_text()
    assert "T=1.0, top-p 0.0, top-k 0, seed 5 (+ run index), acceptance rule point-mass" in text
    assert "| n/a (sampled) |" in text
