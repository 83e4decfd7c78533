"""The verify-by-op benchmark writes a complete record (smoke run on a tiny Qwen checkpoint) and
its split adds up: the categories sum to the split run's total, less the barriers' own time."""

import json

import pytest

from benchmarks import verify_ops


def test_verify_ops_writes_a_record_whose_split_adds_up(tmp_path, dense_dir):
    verify_ops.main(["--model", str(dense_dir), "--max-width", "3", "--reps", "2",
                     "--out", str(tmp_path), "--topic", "smoke", "--summary", "smoke",
                     "--allow-busy", "--idle-window", "0.2"])
    data = json.loads(next(tmp_path.glob("smoke-*.json")).read_text())
    assert [row["width"] for row in data["rows"]] == [1, 2, 3]
    for row in data["rows"]:
        parts = row["split_ms"]
        assert set(parts) == set(verify_ops.CATEGORIES)
        assert all(parts[c] > 0 for c in ("gdn_layers", "gdn_mixer", "attention_layers", "sdpa",
                                          "lm_head"))
        assert sum(parts.values()) <= row["split_total_ms"] * 1.001
        assert row["whole_ms"] > 0
    assert data["floor_ms"]["gdn_layers"] > 0 and data["floor_ms"]["sdpa"] == 0
    assert data["weight_bytes"]["lm_head"] > 0 and data["bandwidth_gbs"] > 0
    md = next(tmp_path.glob("smoke-*.md")).read_text()
    assert "| 3 | " in md and md.rstrip().endswith("smoke")
    if verify_ops.common.plots.available():
        assert len(list(tmp_path.glob("smoke-*.png"))) == 1


def test_a_gemma_target_is_refused(tmp_path_factory):
    from support.tiny_gemma4 import Checkpoints

    path = Checkpoints(tmp_path_factory).target("e2b")
    with pytest.raises(SystemExit) as e:
        verify_ops.main(["--model", str(path), "--allow-busy", "--idle-window", "0.2",
                         "--out", str(tmp_path_factory.mktemp("out"))])
    assert str(e.value) == (f"error: --model {path}: verify_ops splits the hybrid Qwen targets' "
                            "verify, got the gemma4 family")
