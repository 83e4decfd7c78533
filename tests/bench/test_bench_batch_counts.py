"""The batch-counts benchmark writes a complete record (smoke run: a tiny checkpoint whose head
agrees with its target, batches of 2, blocks up to 3)."""

import json

from support import tiny_checkpoints as tc

from benchmarks import bench_batch_counts


def test_bench_batch_counts_writes_the_record(tmp_path, ckpt_root):
    model = tc.write_agreeing_checkpoint(ckpt_root / "agreeing-batch-counts", seed=3)
    out = tmp_path / "records"
    result = bench_batch_counts.main(["--model", str(model), "--sizes", "2,3", "--max-tokens",
                                      "6", "--pairs", "1", "--max-block-size", "3", "--out",
                                      str(out), "--topic", "smoke", "--allow-busy",
                                      "--idle-window", "0.2"])
    data = json.loads(next(out.glob("smoke-*.json")).read_text())
    assert data["arms"] == ["auto", "own choosers", "0 drafts", "1 draft", "2 drafts"]
    assert data["raw"] == result["raw"]
    for size in ("2", "3"):
        got = data["raw"][size]
        # T=0: every arm's tokens are plain batched decode's
        assert all(got[arm]["identical"] for arm in data["arms"])
        assert all(len(got[arm]["tps"]) == 1 and got[arm]["tps"][0] > 0 for arm in data["arms"])
        for arm in data["arms"]:  # the rounds alone, and the joins' share of the run
            assert len(got[arm]["rounds_tps"]) == len(got[arm]["join_share"]) == 1
            assert got[arm]["rounds_tps"][0] > 0
            assert 0 < got[arm]["join_share"][0] < 1
        assert got["auto_choice"] in (0, 1, 2)
    text = next(out.glob("smoke-*.md")).read_text()
    for section in ("## Tokens per second (medians over the passes)", "| 3 | 2 drafts |",
                    "| rounds only tok/s | rounds only vs 0 drafts |",
                    "## Auto against the best fixed count", "## What it says"):
        assert section in text
