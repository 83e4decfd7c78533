"""benchmarks.bench_convert writes a complete record (smoke run on a tiny head-agreeing pair)."""

import json
from pathlib import Path

from benchmarks import bench_convert
from support import tiny_checkpoints as tc


def test_bench_convert_writes_a_record_per_arm(tmp_path):
    model = tc.write_agreeing_checkpoint(tmp_path / "pair", seed=3)
    bench_convert.main(["--model", str(model), "--arms", "8:none,8:8", "--group-size", "32",
                        "--pairs", "1", "--max-tokens", "8", "--out", str(tmp_path / "out"),
                        "--topic", "smoke", "--allow-busy", "--idle-window", "0.2"])
    data = json.loads(next((tmp_path / "out").glob("smoke-*.json")).read_text())
    assert [(r["target_bits"], r["head_bits"]) for r in data["rows"]] == [(8, None), (8, 8)]
    assert all(r["identical_to_classic"] and r["mtp_enabled"] for r in data["rows"])
    # the head built to agree with its target still agrees after an 8-bit conversion
    assert data["rows"][0]["acceptance"] > 0.9
    md_path = next((tmp_path / "out").glob("smoke-*.md"))
    md = md_path.read_text()
    assert "| target 8-bit, head 8-bit |" in md
    # each arm's output: its share of distinct 4-grams, in the JSON and the arm's row
    for r in data["rows"]:
        assert 0 < r["distinct_4gram_share"] <= 1
    row = data["rows"][1]
    assert (f"| target 8-bit, head 8-bit | {row['distinct_4gram_share']:.2f} | "
            f"{row['classic_tps']:.1f} | {row['mtp_tps']:.1f} |") in md
    # The idle check is in the record; a busy machine (--allow-busy) is labelled, not hidden.
    check = data["idle_check"]
    assert check["verdict"] in ("idle", "contended") and check["during"]["total"]["wall_s"] > 0
    contended = check["verdict"] == "contended"
    assert (data.get("label") == "contended: not a result") == contended
    assert md_path.name.endswith("-contended.md") == contended
    assert ("**CONTENDED: NOT A RESULT**" in md) == contended
    assert f"## Idle check\n\n- Verdict: **{check['verdict']}**" in md
    assert not list(Path(bench_convert.tempfile.gettempdir()).glob("bench_convert-*/q8-hNone"))
