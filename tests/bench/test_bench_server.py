"""The serving benchmark writes a complete record (smoke run: both servers on the demo pair)."""

import json

import pytest

from benchmarks import common

pytest.importorskip("openai")
pytest.importorskip("uvicorn")
from benchmarks import bench_server  # noqa: E402


def test_bench_server_writes_the_record(tmp_path):
    result = bench_server.main(["--pairs", "2", "--max-tokens", "6", "--clients", "2",
                                "--requests", "1", "--out", str(tmp_path), "--topic", "smoke",
                                "--allow-busy", "--idle-window", "0.2"])
    data = json.loads(next(tmp_path.glob("smoke-*.json")).read_text())
    assert data["rows"] == result["rows"]
    prompts = list(common.DEFAULT_PROMPTS)  # the same prompts as bench_mtp's
    assert [r["prompt"] for r in data["rows"]] == prompts
    assert all(r["identical_text"] for r in data["rows"])  # T=0: both arms, the same text
    for arm in ("mtp", "plain"):
        assert len(data["raw"][arm]) == len(prompts) * 2
        assert data["throughput"][arm]["requests"] == 2
        assert all(r["tokens"] == 6 and r["ttft_ms"] > 0 for r in data["raw"][arm])
    assert all(r["acceptance_rate"] is not None for r in data["raw"]["mtp"])
    assert all(r["acceptance_rate"] is None for r in data["raw"]["plain"])
    assert data["gate"]["plain"] == "--no-mtp: mlx-lm plain decode"
    assert data["gate"]["mtp"].startswith("exactness probe on cpu")
    text = next(tmp_path.glob("smoke-*.md")).read_text()
    # each prompt's output: its share of distinct 4-grams (of the plain arm's text), in its row
    for row in data["rows"]:
        shares = [r["distinct_4gram_share"] for r in data["raw"]["plain"]
                  if r["prompt"] == row["prompt"]]
        assert row["distinct_4gram_share"] == sorted(shares)[0] and 0 < shares[0] <= 1
        assert f"| {row['prompt']} | {row['distinct_4gram_share']:.2f} | " in text
    pictures = sorted(p.name for p in tmp_path.glob("smoke-*.png"))
    assert [p.split("-")[-1] for p in pictures] == ["tps.png", "ttft.png"]
    check = data["idle_check"]
    assert check["verdict"] in ("idle", "contended")
    assert (data.get("label") == "contended: not a result") == (check["verdict"] == "contended")
    for section in ("## Idle check", "## Setup", "## Single client", "## 2 concurrent clients",
                    "requests/s ratio MTP / plain", "## What it says"):
        assert section in text
