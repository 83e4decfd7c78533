"""benchmarks.cli_pairs: the CLI's default run against --no-mtp over alternating pairs of fresh
processes, with what each tok/s covers stated in the record."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def cli_pairs(*args, out):
    return subprocess.run([sys.executable, "-m", "benchmarks.cli_pairs", *args, "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))


def test_pairs_alternate_and_the_ratio_is_each_pairs_own(tmp_path):
    r = cli_pairs("--pairs", "2", "--cli-args=--max-tokens 6", "--allow-busy", "--topic", "cli",
                  out=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    (record,) = tmp_path.glob("cli-*.json")
    data = json.loads(record.read_text())
    runs = data["runs"]
    assert [p["first"] for p in runs] == ["mtp", "plain"]
    for p in runs:
        assert p["ratio"] == p["mtp"]["generation_tps"] / p["plain"]["generation_tps"]
        assert p["mtp"]["mtp_enabled"] is True and p["plain"]["mtp_enabled"] is False
        assert p["mtp"]["generation_tokens"] == p["plain"]["generation_tokens"] == 6
        assert p["identical"] is True and p["mtp"]["tokens"] == p["plain"]["tokens"]
        assert p["mtp"]["process_wall_s"] > 0 and p["plain"]["process_wall_s"] > 0
    s = data["results"]
    ratios = sorted(p["ratio"] for p in runs)
    assert s["ratio"] == {"median": sum(ratios) / 2, "min": ratios[0], "max": ratios[1]}
    assert s["identical"] is True and s["generation_tokens"] == [6]
    assert s["meets_bar"] == (s["ratio"]["median"] >= 1.7)
    assert sum(s["widths"].values()) == sum(sum(p["mtp"]["block_sizes"].values()) for p in runs)
    # each run's output: its share of distinct 4-grams (the record's: the plain runs' median)
    for p in runs:
        assert p["mtp"]["distinct_4gram_share"] == p["plain"]["distinct_4gram_share"] > 0
    assert s["distinct_4gram_share"] == runs[0]["plain"]["distinct_4gram_share"]
    md = record.with_suffix(".md").read_text()
    assert "`python -m mlx_mtp.generate --json --max-tokens 6` (MTP)" in md
    assert f"- What the tok/s cover: {data['covers']}" in md
    assert "## Pairs" in md and "| 1 | plain |" in md
    share = f"{s['distinct_4gram_share']:.2f}"
    assert f"| {share} / {share} |" in md and f"| {_cell_ratio(s)} | {share} |" in md
    assert r.stdout.count("pair ") == 2


def _cell_ratio(s):
    r = s["ratio"]
    return f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})"


def test_flags_the_script_sets_itself_are_refused(tmp_path):
    r = cli_pairs("--pairs", "1", "--cli-args=--no-mtp --max-tokens 4", out=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].endswith(
        "error: --cli-args: --no-mtp is set by the script itself")
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


def test_a_failing_cli_run_is_one_line_naming_it(tmp_path):
    r = cli_pairs("--pairs", "1", "--cli-args=--max-tokens 0", "--allow-busy", out=tmp_path)
    assert r.returncode == 1
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error: -m mlx_mtp.generate --json --max-tokens 0 failed (2): error: "
                           "argument --max-tokens: must be at least 1, got 0"), line
