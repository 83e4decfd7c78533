"""The decode-step benchmark writes a complete record (smoke run on the tiny checkpoint whose
projections are wider than 512, so its layers verify through the kernel): every arm's tokens equal
mlx-lm's, one row per arm, mlx-lm's own ratio 1.0; bad flags are one line."""

import json

import pytest

from benchmarks import bench_decode_step


def test_bench_decode_step_writes_a_record_of_identical_arms(tmp_path, wide_dir):
    result = bench_decode_step.main(["--model", str(wide_dir), "--steps", "6", "--pairs", "2",
                                     "--out", str(tmp_path), "--topic", "smoke", "--summary",
                                     "smoke", "--allow-busy", "--idle-window", "0.2"])
    data = json.loads(next(tmp_path.glob("smoke-*.json")).read_text())
    assert data["rows"] == result["rows"]
    assert [row["arm"] for row in data["rows"]] == list(bench_decode_step.ARMS)
    for row in data["rows"]:
        assert row["identical"] is True
        assert 0 < row["ms_min"] <= row["ms"] <= row["ms_max"]
    assert data["rows"][0]["speedup"] == 1.0
    assert 0 <= data["one_row_layers"] <= data["kernel_layers"]
    md = next(tmp_path.glob("smoke-*.md")).read_text()
    assert "| target step, one-row kernel | " in md and md.rstrip().endswith("smoke")


def test_bad_counts_are_one_line(tmp_path, wide_dir):
    with pytest.raises(SystemExit) as e:
        bench_decode_step.main(["--model", str(wide_dir), "--steps", "0", "--allow-busy",
                                "--out", str(tmp_path)])
    assert str(e.value) == ("error: --steps and --pairs must be at least 1, --prompt-tokens at "
                            "least 2")
