"""The concurrency benchmark writes a complete record (smoke run: three servers on a tiny
checkpoint whose head agrees with its target, levels 1 and 2)."""

import json

import pytest
from support import tiny_checkpoints as tc

pytest.importorskip("openai")
pytest.importorskip("uvicorn")
from benchmarks import bench_concurrency  # noqa: E402

pytestmark = pytest.mark.subprocess


def test_bench_concurrency_writes_the_record(tmp_path, ckpt_root):
    model = tc.write_agreeing_checkpoint(ckpt_root / "agreeing-concurrency", seed=3)
    out = tmp_path / "records"
    result = bench_concurrency.main(["--model", str(model), "--levels", "1,2",
                                     "--max-tokens", "6", "--max-batch", "2", "--out", str(out),
                                     "--topic", "smoke", "--allow-busy", "--idle-window", "0.2"])
    data = json.loads(next(out.glob("smoke-*.json")).read_text())
    assert data["rows"] == result["rows"]
    assert [(r["clients"], r["arm"]) for r in data["rows"]] == [
        (c, a) for c in (1, 2) for a in ("batched", "serial", "mlx_lm")]
    for row in data["rows"]:  # (an EOS may end a request early, in every arm alike)
        assert 0 < row["tokens"] <= 6 * row["clients"] and row["aggregate_tps"] > 0
    tokens = {(r["clients"], r["arm"]): r["tokens"] for r in data["rows"]}
    assert all(tokens[(c, "batched")] == tokens[(c, "serial")] for c in (1, 2))
    # T=0: the batched server's texts and mlx-lm's plain decode equal each prompt's solo text
    assert all(r["texts_equal_solo"] for r in data["rows"])
    assert data["batch"] == {"max_batch": 2, "batched": True, "active": 0,
                             "reason": "up to 2 requests per round"}
    text = next(out.glob("smoke-*.md")).read_text()
    for section in ("## Aggregate and per-request tok/s", "## Ratios", "| 2 | mlx_lm.server |",
                    "## What it says"):
        assert section in text
    pictures = sorted(p.name for p in out.glob("smoke-*.png"))
    assert len(pictures) == 2
    assert pictures[0].endswith("-aggregate.png") and pictures[1].endswith("-per-request.png")
