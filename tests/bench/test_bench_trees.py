"""The tree benchmark writes a complete record (smoke run on a tiny head-agreeing pair) and
rejects a malformed arm."""

import json

import pytest

from benchmarks import bench_trees
from support import tiny_checkpoints as tc


def test_bench_trees_writes_markdown_json_and_pictures(tmp_path):
    model = tc.write_agreeing_checkpoint(tmp_path / "pair", seed=3)
    bench_trees.main(["--model", str(model), "--arms", "3,3t2x4", "--pairs", "1",
                      "--max-tokens", "12", "--prompts-json", str(_prompts(tmp_path)),
                      "--out", str(tmp_path / "out"), "--topic", "smoke", "--summary", "smoke",
                      "--allow-busy", "--idle-window", "0.2"])
    data = json.loads(next((tmp_path / "out").glob("smoke-*.json")).read_text())
    chain, tree = data["rows"]
    assert (chain["arm"], tree["arm"], tree["topk"], tree["draft_tokens"]) == \
        ("3", "3t2x4", 2, 4)
    assert chain["identical"] and tree["identical"]
    # the agreeing head is accepted at both depths; the tree verifies more nodes than the chain
    assert tree["per_depth_acceptance"] == [1.0, 1.0] and tree["accepted_by_sibling_rank"][0] > 0
    assert tree["nodes_per_round"] > chain["nodes_per_round"] > 0
    assert tree["verify_ms_synced"] > 0 and tree["verify_ms_per_node"] > 0
    assert len(data["raw"]["plain"]) == len(data["raw"]["3t2x4"]) == 2  # 2 prompts x 1 pair
    md = next((tmp_path / "out").glob("smoke-*.md")).read_text()
    assert "| 3t2x4 | " in md and md.rstrip().endswith("smoke")
    if bench_trees.common.plots.available():
        assert len(list((tmp_path / "out").glob("smoke-*.png"))) == 2


def _prompts(tmp_path):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps({"a": "def f(x):", "b": "The sea was"}))
    return path


def test_a_malformed_arm_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        bench_trees.main(["--model", "x", "--arms", "3,3tree"])
    assert e.value.code == 2
    assert ("--arms: expected a block size (3), a tree BtKxN (4t2x6), auto or autotK (autot2), "
            "got '3tree'") in capsys.readouterr().err
    assert [bench_trees.Arm.parse(a).name for a in ("3", "4t2x6", "auto", "autot2")] == \
        ["3", "4t2x6", "auto", "autot2"]
    assert bench_trees.Arm.parse("autot3") == bench_trees.Arm("auto", 3, None)
