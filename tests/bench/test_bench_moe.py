"""benchmarks/bench_moe.py on tiny pairs (a smoke test: the record's fields, not its speeds): the
arms at each temperature, each width's verify set against the bytes of the experts its rounds
touched (counted, and fewer than random routes would touch), the head's draft step against its
floor, the dense pair's arms, and the flags it refuses."""

import json

import pytest

from benchmarks import bench_moe, realistic_pair
from support.realistic_shapes import QWEN_SMALL

SMALL = ["--hidden", "256", *QWEN_SMALL[2:]]
MOE = ["--moe", "--experts", "32", "--top-k", "4", "--expert-width", "32", "--shared-width", "64"]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_moe")
    moe, dense = root / "moe", root / "dense"
    assert realistic_pair.main([str(moe), *SMALL, *MOE, "--residual-scale", "0.05"]) == 0
    # dense of the same shape: the MLP as wide as a token's experts and the shared expert
    assert realistic_pair.main([str(dense), *SMALL, "--intermediate", "192", "--dtype",
                                "bfloat16", "--residual-scale", "0.05"]) == 0
    return moe, dense


@pytest.mark.slow
def test_a_smoke_run_writes_the_record(pairs, tmp_path):
    moe, dense = pairs
    out = tmp_path / "records"
    result = bench_moe.main(["--model", str(moe), "--dense", str(dense), "--block-sizes",
                             "1,2,3,auto", "--max-block-size", "3", "--temps", "0,0.6",
                             "--pairs", "1", "--max-tokens", "12", "--prompts", "default",
                             "--out", str(out), "--allow-busy", "--idle-window", "0.2"])
    assert set(result["moe"]) == {"0.0", "0.6"}
    for arms in result["moe"].values():
        assert [row["block_size"] for row in arms["rows"]] == [1, 2, 3, "auto"]
    assert all(row["identical_to_classic"] for row in result["moe"]["0.0"]["rows"])
    e = result["experts"]
    assert (e["layers"], e["experts"], e["top_k"]) == (4, 32, 4)
    widths = {w["width"]: w for w in e["widths"]}
    assert {2, 3} <= set(widths)
    for w in (2, 3):
        row = widths[w]
        assert row["verify_ms"] > 0 and row["floor_ms"] > 0 and row["verify_over_floor"] > 0
        assert 4 <= row["distinct_per_layer"] <= 4 * w
        assert row["distinct_per_layer"] < row["random_per_layer"]  # the routers' locality
        assert sum(row["method"].values()) == 4  # how the grouped verify ran this width
    assert widths[3]["floor_bytes"] > widths[2]["floor_bytes"]
    assert e["drafter_step_ms"] > 0 and e["drafter_step_floor_ms"] > 0
    assert [row["block_size"] for row in result["dense_pair"]["rows"]] == [1, 2, 3, "auto"]
    record = next(out.glob("moe-pair-*.json"))
    assert json.loads(record.read_text())["experts"]["widths"]
    md = record.with_suffix(".md").read_text()
    assert "## Verify against the distinct-expert floor" in md
    assert "## Dense pair of the same shape" in md and "MTP head draft step" in md


@pytest.mark.parametrize("flags,message", [
    (["--block-sizes", "1,auto"], "--block-sizes needs a fixed block of 2 or more"),
    (["--temps", "0.6"], "--temps a 0"),
    (["--block-sizes", "x"], "expected comma-separated values"),
])
def test_flags_it_refuses(flags, message, capsys):
    with pytest.raises(SystemExit):
        bench_moe.main(["--model", "somewhere", *flags, "--allow-busy"])
    assert message in capsys.readouterr().err


def test_the_pair_file_is_found_beside_the_model_or_one_folder_up(tmp_path):
    """A Gemma 4 pair keeps realistic_pair.json above its target and assistant folders."""
    from benchmarks import common

    (tmp_path / "pair" / "target").mkdir(parents=True)
    (tmp_path / "pair" / "realistic_pair.json").write_text('{"residual_scale": 0.02}')
    assert common.pair_info(tmp_path / "pair" / "target") == {"residual_scale": 0.02}
    assert common.pair_info(tmp_path / "pair") == {"residual_scale": 0.02}
    assert common.pair_info(tmp_path / "other" / "target") == {}
