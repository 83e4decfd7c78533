"""The draft-processors benchmark writes a complete record (smoke run on a tiny pair whose head
computes its target's logits) and refuses a run without a penalty."""

import json

import pytest

from benchmarks import bench_draft_processors
from support import tiny_checkpoints as tc


def test_bench_draft_processors_compares_penalty_and_none(tmp_path):
    model = tc.write_mirroring_checkpoint(tmp_path / "pair", seed=5)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"a": "def f(x):", "b": "The sea was"}))
    bench_draft_processors.main([
        "--model", str(model), "--block-sizes", "2,3", "--pairs", "2", "--max-tokens", "32",
        "--repetition-penalty", "2.0", "--repetition-context-size", "48",
        "--unprocessed-drafts", "--prompts-json", str(prompts), "--out", str(tmp_path / "out"),
        "--topic", "smoke", "--summary", "smoke", "--allow-busy", "--idle-window", "0.2"])
    data = json.loads(next((tmp_path / "out").glob("smoke-*.json")).read_text())
    rows = {(r["block_size"], r["kind"]): r for r in data["rows"]}
    assert sorted(rows) == [(2, "none"), (2, "penalty"), (2, "target-only"),
                            (3, "none"), (3, "penalty"), (3, "target-only")]
    assert all(r["identical_to_plain"] for r in rows.values())
    # the head computes the target's logits: processed drafts are all kept, unprocessed not
    for bs in (2, 3):
        assert rows[(bs, "penalty")]["per_position_acceptance"] == [1.0] * (bs - 1)
        assert rows[(bs, "none")]["per_position_acceptance"] == [1.0] * (bs - 1)
        assert min(rows[(bs, "target-only")]["per_position_acceptance"]) < 1.0
        assert rows[(bs, "penalty")]["draft_processors"] == ["applied"]
        assert rows[(bs, "target-only")]["draft_processors"] == [
            "not applied: logits processor TargetOnly has draftable=False"]
    assert [c["penalty_over_none"] for c in data["compared"]] == [[1.0], [1.0, 1.0]]
    assert all(c["meets_bar"] for c in data["compared"])
    assert len(data["raw"]) == 2 * 2 * (2 + 6)  # pairs x prompts x (2 plain + 6 MTP arms)
    md = next((tmp_path / "out").glob("smoke-*.md")).read_text()
    assert "| 3 | 1.000 / 1.000 | yes |" in md and "| 3 | target-only | " in md
    assert md.rstrip().endswith("smoke")


def test_a_run_without_a_penalty_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        bench_draft_processors.main(["--model", "x"])
    assert e.value.code == 2
    assert ("--repetition-penalty or --presence-penalty: the penalty arms need one"
            in capsys.readouterr().err)
