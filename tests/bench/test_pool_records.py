"""tools.pool_records: two takes of one record, their pairs pooled, the per-prompt tables
over all of them; takes of different experiments refused with the file named."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bench_mtp
from tools import pool_records

ROOT = Path(__file__).resolve().parents[2]
POOL = [sys.executable, "-m", "tools.pool_records"]


def take(tps: dict, commit: str) -> dict:
    """A record of one prompt, blocks 3 and 5 and auto, one run per arm and pair (tok/s given)."""
    raw = {arm: [{"pair": i, "prompt": "code", "tps": float(t),
                  **({"stats": {"block_sizes": {"2": 1, "6": 10}}} if arm == "mtpauto" else {})}
                 for i, t in enumerate(ts)] for arm, ts in tps.items()}
    return {"topic": "t", "model": "m", "prompts": {"code": "x"}, "max_tokens": 512,
            "temperature": 0.0, "git_commit": commit, "date": "2026-12-02",
            "rows": [{"block_size": 3, "classic_tps": 50.0}, {"block_size": 5},
                     {"block_size": "auto"}], "raw": raw}


A = take({"classic": (50, 50, 50), "mtp3": (80, 70, 90), "mtp5": (100, 80, 110),
          "mtpauto": (90, 88, 99)}, "a" * 40)
B = take({"classic": (52, 48), "mtp3": (95, 85), "mtp5": (90, 92),
          "mtpauto": (93, 91)}, "b" * 40)


def test_pooled_pairs_are_the_takes_pairs_renumbered(tmp_path, capsys):
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for p, r in zip(paths, (A, B)):
        p.write_text(json.dumps(r))
    raw = pool_records.pool([A, B], [str(p) for p in paths])
    assert [r["pair"] for r in raw["mtp5"]] == [0, 1, 2, 3, 4]
    assert [r["tps"] for r in raw["mtpauto"]] == [90, 88, 99, 93, 91]
    text = pool_records.main([str(p) for p in paths])
    assert capsys.readouterr().out.strip() == text
    # held out over the five pairs of both takes (bench_mtp's own arithmetic, tested there)
    want = bench_mtp.held_out_vs_best(raw, "code", [3, 5])
    assert want["pairs"] == 5 and want != bench_mtp.held_out_vs_best(
        pool_records.pool([A, A], ["a", "a"]), "code", [3, 5])
    assert text.splitlines()[-1].endswith(f": code {want['median']:.3f}.")
    assert f"- {paths[0]}: commit aaaaaaaaaaaa, 2026-12-02, 3 pairs, plain 50.0 tok/s" in text
    assert f"- {paths[1]}: commit bbbbbbbbbbbb, 2026-12-02, 2 pairs, plain 50.0 tok/s" in text
    assert "| code | 50.0 | 85.0 | 92.0 | 91.0 |" in text  # medians over the five pairs
    assert "widths auto chose" in text and "2: 5, 6: 50" in text


@pytest.mark.parametrize("change, msg", [
    ({"prompts": {"prose": "y"}}, "prompts differ from"),
    ({"max_tokens": 128}, "max_tokens differs from"),
    ({"raw": {"classic": [], "mtp3": []}}, "arms ['classic', 'mtp3'] differ from"),
])
def test_takes_of_another_experiment_are_refused(tmp_path, change, msg):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(A))
    b.write_text(json.dumps({**B, **change}))
    run = subprocess.run([*POOL, str(a), str(b)], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr.strip().startswith(f"pool_records.py: {b}: ")
    assert msg.replace("differ from", "") in run.stderr and str(a) in run.stderr


def test_bad_files_are_named(tmp_path):
    a = tmp_path / "a.json"
    a.write_text(json.dumps(A))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for other, msg in ((tmp_path / "none.json", "no such file"), (bad, "not a JSON record")):
        run = subprocess.run([*POOL, str(a), str(other)], capture_output=True, text=True,
                             cwd=ROOT)
        assert run.returncode == 1 and run.stderr.strip() == f"pool_records.py: {other}: {msg}"
    one = subprocess.run([*POOL, str(a)], capture_output=True, text=True, cwd=ROOT)
    assert one.returncode == 2
    assert one.stderr.strip().splitlines()[-1].endswith("expected two or more records, got 1")
