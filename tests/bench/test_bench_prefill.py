"""The prefill benchmark writes a complete record (smoke run on a tiny Qwen checkpoint whose
recurrent states make the kernel pay): every arm bitwise identical to mlx-lm's forward, one row
per prompt length and arm, the picture; a Gemma 4 target is refused in one line."""

import json

import pytest

from benchmarks import bench_prefill


def test_bench_prefill_writes_a_record_of_identical_arms(tmp_path, big_state_dir):
    bench_prefill.main(["--model", str(big_state_dir), "--lengths", "3,17", "--pairs", "2",
                        "--out", str(tmp_path), "--topic", "smoke", "--summary", "smoke",
                        "--allow-busy", "--idle-window", "0.2"])
    data = json.loads(next(tmp_path.glob("smoke-*.json")).read_text())
    assert [(row["prompt_tokens"], row["arm"]) for row in data["rows"]] == [
        (n, arm) for n in (3, 17) for arm in bench_prefill.ARMS]
    for row in data["rows"]:
        assert row["identical"] is True
        assert 0 < row["ms_min"] <= row["ms"] <= row["ms_max"]
        assert row["tokens_per_s"] == pytest.approx(row["prompt_tokens"] / row["ms"] * 1e3)
        if row["arm"] == bench_prefill.MLX_LM:
            assert row["speedup"] == row["speedup_min"] == row["speedup_max"] == 1.0
    md = next(tmp_path.glob("smoke-*.md")).read_text()
    assert "| 17 | kernel, every core | " in md and md.rstrip().endswith("smoke")
    if bench_prefill.common.plots.available():
        assert len(list(tmp_path.glob("smoke-*.png"))) == 1


def test_a_gemma_target_is_refused(tmp_path_factory):
    from support.tiny_gemma4 import Checkpoints

    path = Checkpoints(tmp_path_factory).target("e2b")
    with pytest.raises(SystemExit) as e:
        bench_prefill.main(["--model", str(path), "--allow-busy", "--idle-window", "0.2",
                            "--out", str(tmp_path_factory.mktemp("out"))])
    assert str(e.value) == (f"error: --model {path}: bench_prefill compares the hybrid Qwen "
                            "targets' prefill, got the gemma4 family")
