"""The assistant-bf16 benchmark writes a complete record (smoke run on a tiny Gemma 4 pair) and
refuses a pair that is not a Gemma 4 target and assistant."""

import json

import pytest

from benchmarks import bench_assistant_bf16
from mlx_mtp.models import bf16_weights
from support import tiny_checkpoints as tc
from support.tiny_gemma4 import write_assistant, write_target

pytestmark = pytest.mark.skipif(bf16_weights.bf16_problem() is not None,
                                reason=f"bf16 kernel: {bf16_weights.bf16_problem()}")


def test_bench_assistant_bf16_compares_the_two_assistants(tmp_path):
    target = write_target(tmp_path / "target", "31b", seed=2)
    assistant = write_assistant(tmp_path / "assistant", "31b")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"a": "def f(x):", "b": "The sea was"}))
    bench_assistant_bf16.main([
        "--model", str(target), "--drafter", str(assistant), "--block-sizes", "2,4",
        "--pairs", "2", "--max-tokens", "16", "--draft-steps", "2", "--reps", "3",
        "--prompts-json", str(prompts), "--out", str(tmp_path / "out"), "--topic", "smoke",
        "--summary", "smoke", "--allow-busy", "--idle-window", "0.2"])
    data = json.loads(next((tmp_path / "out").glob("smoke-*.json")).read_text())
    assert [(r["block_size"], r["drafter"]) for r in data["rows"]] == [
        (2, "float32"), (2, "bf16"), (4, "float32"), (4, "bf16")]
    assert all(r["identical_to_plain"] for r in data["rows"])
    assert [len(r["per_position_acceptance"]) for r in data["rows"]] == [1, 1, 3, 3]
    assert [c["block_size"] for c in data["compared"]] == [2, 4]
    assert data["draft"]["bf16"] is True
    assert data["rounds_nothing"] is False  # a float32 assistant: the copy rounds it
    assert len(data["raw"]["plain"]) == 2 * 2 and len(data["raw"]["4/bf16"]) == 2 * 2
    s = data["draft_step_ms"]
    assert s["float32"] > 0 and s["bf16"] > 0
    assert s["bf16_over_float32"] == pytest.approx(s["bf16"] / s["float32"])
    md = next((tmp_path / "out").glob("smoke-*.md")).read_text()
    assert "| 4 | bf16 | " in md and "## Drafting alone" in md
    assert md.rstrip().endswith("smoke")


def test_a_qwen_pair_is_refused(tmp_path):
    model = tc.write_mirroring_checkpoint(tmp_path / "pair", seed=5)
    with pytest.raises(SystemExit) as e:
        bench_assistant_bf16.main([
            "--model", str(model), "--drafter", str(model), "--out", str(tmp_path / "out"),
            "--allow-busy", "--idle-window", "0.2"])
    assert e.value.code == (f"error: --model {model} with --drafter {model} is not a Gemma 4 "
                            "target and assistant")


def test_block_sizes_that_are_not_integers_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        bench_assistant_bf16.main(["--model", "t", "--drafter", "a", "--block-sizes", "3,x"])
    assert e.value.code == 2
    assert "--block-sizes: expected comma-separated integers, got '3,x'" in capsys.readouterr().err
