"""Benchmark records carry pictures drawn from their JSON (benchmarks.plots).

Small records are built here in the structure bench_mtp.py / bench_drafter.py write (the fields
their summarize() returns), so the pictures and markdown come from the same code a real run uses.
"""

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bench_drafter, bench_mtp
from benchmarks import common as bench_common
from benchmarks import plots as record_plots

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "tests" / "data" / "records"  # trimmed copies of committed records

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STEM = "smoke-host-2026-01-01"
MTP_PICTURES = [("tok/s per block size", f"{STEM}-tps.png"),
                ("per-position acceptance per block size", f"{STEM}-acceptance.png"),
                ("round split per block size", f"{STEM}-rounds.png")]
DRAFTER_PICTURES = [("drafter step and accept hook vs their read floor, per arm", f"{STEM}-step.png"),
                    ("round split per arm", f"{STEM}-rounds.png")]
NO_MATPLOTLIB = "import sys; sys.modules['matplotlib'] = None; "


def png_size(path: Path) -> tuple:
    """(width, height) from the IHDR chunk of a PNG file, after checking it is one."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def setup_fields() -> dict:
    return {"topic": "smoke", "date": "2026-01-01",
            "host": {"name": "host", "cpu": "test cpu", "cores": 2, "memory_gib": 8.0,
                     "os": "Linux", "device": "Device(cpu, 0)"},
            "versions": {"mlx": "0.32.4", "mlx-lm": "0.32.2", "mlx_mtp": "0.1.0",
                         "python": "3.11.7"},
            "cpu_blas": "BLIS (test)", "git_commit": "abc", "command": "bench", "env": {},
            "prompts": {"code": "def f():"}, "max_tokens": 16, "pairs": 2}


def phase_ms(verify, draft, accept, finalize=1.0, residual=0.25) -> dict:
    return {"verify": verify, "draft": draft, "accept": accept, "finalize": finalize,
            "residual": residual}


def mtp_record() -> dict:
    """A bench_mtp record: block sizes 1 and 3, one prompt, two pairs."""
    exact = {"verdict": "equal", "override": False, "widths": [{"width": 2, "verdict": "equal"}]}

    def run(pair, tps, bs=None, accepted=0):
        out = {"pair": pair, "prompt": "code", "prompt_s": 0.1, "gen_s": 15 / tps, "tps": tps}
        if bs is not None:
            rounds = 8
            out["stats"] = {"block_size": bs, "rounds": rounds, "drafted": rounds * (bs - 1),
                            "accepted": accepted, "phase_ms": phase_ms(240.0, 16.0 * (bs - 1), 40.0),
                            "per_position_acceptance": [0.75, 0.5][:bs - 1],
                            "per_position_rounds": [rounds] * (bs - 1)}
        return out

    rows = [
        {"block_size": 1, "classic_tps": 40.0, "mtp_tps": 38.0, "ratio_median": 0.95,
         "ratio_min": 0.9, "ratio_max": 1.0, "acceptance": 0.0, "tokens_per_round": 1.0,
         "per_position_acceptance": [], "round_ms": phase_ms(25.0, 0.0, 0.0),
         "drafter_step_ms": None, "identical_to_classic": True, "acceptance_rule": "greedy",
         "mtp_enabled": True, "gate_reason": "block size 1", "exactness": {"verdict": "not_needed"}},
        {"block_size": 3, "classic_tps": 40.0, "mtp_tps": 55.0, "ratio_median": 1.375,
         "ratio_min": 1.2, "ratio_max": 1.5, "acceptance": 0.625, "tokens_per_round": 2.25,
         "per_position_acceptance": [0.75, 0.5], "round_ms": phase_ms(30.0, 4.0, 5.0),
         "drafter_step_ms": 4.0, "identical_to_classic": True, "acceptance_rule": "greedy",
         "mtp_enabled": True, "gate_reason": "probe", "exactness": exact},
    ]
    return {**setup_fields(), "model": "pair", "drafter": None, "target_dtype": "float32",
            "temperature": 0.0, "top_p": 0.0, "top_k": 0, "seed": 0, "acceptance": "auto",
            "bandwidth_gbs": 10.0, "target_step_bytes": 50_000_000, "lm_head_bytes": 8_000_000,
            "drafter_step_bytes": 11_000_000, "target_step_floor_ms": 5.0, "classic_step_ms": 25.0,
            "drafter_step_floor_ms": 1.1, "rows": rows,
            "raw": {"classic": [run(0, 39.0), run(1, 41.0)],
                    "mtp1": [run(0, 37.0, 1), run(1, 39.0, 1)],
                    "mtp3": [run(0, 50.0, 3, 10), run(1, 60.0, 3, 10)]},
            "summary": "fixture"}


def drafter_record() -> dict:
    """A bench_drafter record: every arm the script runs, one prompt, two pairs."""
    arms = ["all", *[f"-{p}" for p in bench_drafter.PHASES], "default", "all+prof", "default+prof"]
    rows, raw = [], {"classic": [{"pair": k, "prompt": "code", "gen_s": 0.5, "tps": 30.0,
                                  "identical_to_classic": True} for k in range(2)]}
    for i, arm in enumerate(arms):
        step = 2.0 + 0.25 * i
        row = {"arm": arm, "options": {"profiled": arm.endswith("+prof")}, "draft": {},
               "tps": 40.0 + i, "vs_classic": [1.3, 1.4], "vs_all": [0.95, 1.05],
               "identical_to_classic": True, "mtp_enabled": True, "acceptance": 0.7,
               "tokens_per_round": 2.4, "round_ms": phase_ms(40.0, step, 5.0, 2.0),
               "step_ms": step, "phase_step_ms": step, "accept_ms": 5.0,
               "draft_syncs_per_round": 1.0, "head_bytes": 1_000_000, "lm_head_bytes": 2_000_000,
               "step_bytes": 3_000_000, "step_floor_ms": 0.3}
        if row["options"]["profiled"]:
            row["stages_ms"] = {s: 0.5 for s in bench_drafter.STAGES}
            row["accept_stages_ms"] = {s: 1.0 for s in bench_drafter.ACCEPT_STAGES}
        rows.append(row)
        raw[arm] = [{"pair": k, "prompt": "code", "gen_s": 0.4, "tps": 40.0 + i + k,
                     "identical_to_classic": True,
                     "stats": {"rounds": 6, "phase_ms": phase_ms(240.0, 6 * step, 30.0),
                               "draft_profile": {"step_ms": step}}} for k in range(2)]
    return {**setup_fields(), "model": "pair", "random_pair": False,
            "pair_config": {"hidden_size": 64, "num_hidden_layers": 4,
                            "full_attention_interval": 4, "intermediate_size": 128,
                            "vocab_size": 320, "tie_word_embeddings": False},
            "target_dtype": "float32", "block_size": 3, "temperature": 0.0, "group_size": 64,
            "draft_vocab": {"size": 128, "vocab_size": 320, "coverage": 0.9, "corpus_tokens": 1000},
            "exactness": {"verdict": "equal", "override": False}, "gate_reason": "probe",
            "bandwidth_gbs": 10.0, "target_step_bytes": 50_000_000, "target_step_floor_ms": 5.0,
            "classic_step_ms": 33.0, "classic_tps": 30.0, "rows": rows, "raw": raw,
            "summary": "fixture"}


def linked_pictures(md: str) -> list:
    return re.findall(r"^!\[([^\]]*)\]\(([^)]*)\)$", md, flags=re.M)


def assert_pictures(folder: Path, md: str, expected: list) -> None:
    """The .md links exactly ``expected`` (caption, file), in a pictures section before the
    results, and each file is a PNG of the fixed size."""
    assert linked_pictures(md) == expected
    assert md.index(record_plots.SECTION) < md.index("## Results")
    for _, name in expected:
        assert png_size(folder / name) == record_plots.SIZE_PX == (700, 420)


# ------------------------------------------------------------------------------ writing a record


def test_mtp_record_is_written_with_its_pictures(tmp_path):
    bench_common.write_record(tmp_path, mtp_record(), bench_mtp.render)
    md = (tmp_path / f"{STEM}.md").read_text()
    assert_pictures(tmp_path, md, MTP_PICTURES)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{STEM}.json", f"{STEM}.md"] + [name for _, name in MTP_PICTURES])
    # Apart from the pictures section, the .md is exactly what render() makes of the JSON.
    pictures = record_plots.section([(c, tmp_path / n) for c, n in MTP_PICTURES], tmp_path)
    assert md.replace(pictures + "\n", "") == bench_common.render_markdown(
        json.loads((tmp_path / f"{STEM}.json").read_text()), bench_mtp.render)


def test_drafter_record_is_written_with_its_pictures(tmp_path):
    bench_common.write_record(tmp_path, drafter_record(), bench_drafter.render, "drafter")
    assert_pictures(tmp_path, (tmp_path / f"{STEM}.md").read_text(), DRAFTER_PICTURES)


def test_without_matplotlib_the_record_is_written_and_the_pictures_skipped(tmp_path):
    (tmp_path / "record.json").write_text(json.dumps(mtp_record()))
    code = (NO_MATPLOTLIB + "import json, pathlib; from benchmarks import common, bench_mtp; "
            "out = pathlib.Path(sys.argv[1]); common.write_record(out, "
            "json.loads((out / 'record.json').read_text()), bench_mtp.render)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        'pictures skipped: matplotlib is not installed (pip install -e ".[bench]")',
        f"wrote {tmp_path / STEM}.md and .json"]
    assert not list(tmp_path.glob("*.png"))
    assert (tmp_path / f"{STEM}.md").read_text() == bench_common.render_markdown(mtp_record(),
                                                                                bench_mtp.render)


# ------------------------------------------------------------------------------ --render


def run_script(module: str, *args, prefix: str = "") -> subprocess.CompletedProcess:
    if prefix:  # run the module's main() after ``prefix`` (e.g. hiding matplotlib)
        cmd = [sys.executable, "-c", prefix + "import runpy; sys.argv = sys.argv[1:]; "
               "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)", module, *args]
    else:
        cmd = [sys.executable, "-m", module, *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def committed(kind: str) -> Path:
    """A real record of ``kind`` (a fixture: re-drawing needs only the record's shape)."""
    path = RECORDS / {"mtp": "demo-pair-blis.json", "drafter": "drafter-phases.json"}[kind]
    assert record_plots.check(json.loads(path.read_text()), kind) is None
    return path


@pytest.mark.parametrize("script,kind,pictures", [
    ("benchmarks.bench_mtp", "mtp", MTP_PICTURES),
    ("benchmarks.bench_drafter", "drafter", DRAFTER_PICTURES)])
def test_render_redraws_a_committed_record(tmp_path, script, kind, pictures):
    src = committed(kind)
    js, md = tmp_path / src.name, tmp_path / src.with_suffix(".md").name
    js.write_bytes(src.read_bytes())
    before = src.with_suffix(".md").read_text()
    md.write_text(before)
    proc = run_script(script, "--render", str(js))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"rewrote {md} and {len(pictures)} pictures\n"
    stem = src.with_suffix("").name
    expected = [(caption, name.replace(STEM, stem)) for caption, name in pictures]
    after = md.read_text()
    assert linked_pictures(after) == expected
    for _, name in expected:
        assert png_size(tmp_path / name) == record_plots.SIZE_PX
    # The .md is kept but for the pictures section (one, whether the record had one or not),
    # and the JSON is untouched.
    section = record_plots.section([(c, tmp_path / n) for c, n in expected], tmp_path)
    assert after.count(section) == 1 and after.count("## Pictures") == 1
    assert after.replace(section + "\n", "") == before.replace(section + "\n", "")
    assert js.read_bytes() == src.read_bytes()
    # Redrawing is idempotent: same section (not a second one), same bytes.
    first = {name: (tmp_path / name).read_bytes() for _, name in expected}
    assert run_script(script, "--render", str(js)).returncode == 0
    assert md.read_text() == after
    assert {name: (tmp_path / name).read_bytes() for _, name in expected} == first


def test_render_with_summary_rewrites_the_md_from_the_json(tmp_path):
    js = tmp_path / f"{STEM}.json"
    js.write_text(json.dumps(mtp_record()))
    (tmp_path / f"{STEM}.md").write_text("# stale\n")
    result = bench_mtp.main(["--render", str(js), "--summary", "new words"])
    assert result["summary"] == "new words" == json.loads(js.read_text())["summary"]
    md = (tmp_path / f"{STEM}.md").read_text()
    assert "# stale" not in md and "new words" in md
    assert_pictures(tmp_path, md, MTP_PICTURES)


def test_render_without_an_md_writes_one(tmp_path):
    js = tmp_path / f"{STEM}.json"
    js.write_text(json.dumps(drafter_record()))
    bench_drafter.main(["--render", str(js)])
    md = (tmp_path / f"{STEM}.md").read_text()
    assert md.startswith("# smoke on host, 2026-01-01") and "fixture" in md
    assert_pictures(tmp_path, md, DRAFTER_PICTURES)


def test_render_without_matplotlib_is_a_clear_error(tmp_path):
    js = tmp_path / f"{STEM}.json"
    js.write_text(json.dumps(mtp_record()))
    proc = run_script("benchmarks.bench_mtp", "--render", str(js), prefix=NO_MATPLOTLIB)
    assert proc.returncode == 1
    assert proc.stderr == 'error: --render needs matplotlib: pip install -e ".[bench]"\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == [js.name]


@pytest.mark.parametrize("content,message", [
    (None, "expected a record's .json ([Errno 2] No such file or directory: '{path}')"),
    ("{", "expected a record's .json (Expecting property name enclosed in double quotes: "
          "line 1 column 2 (char 1))"),
    ({"rows": []}, "not a benchmark record (no 'rows')"),
    ({"rows": [{"block_size": 1, "round_ms": {}}]},
     "not a bench_mtp.py record (rows lack 'mtp_tps', 'classic_tps', 'per_position_acceptance')"),
    (drafter_record(), "not a bench_mtp.py record (rows lack 'block_size', 'mtp_tps', "
                       "'classic_tps', 'per_position_acceptance')"),
])
def test_render_refuses_what_is_not_a_bench_mtp_record(tmp_path, content, message):
    js = tmp_path / "record.json"
    if content is not None:
        js.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(SystemExit) as e:
        bench_mtp.main(["--render", str(js)])
    assert str(e.value) == f"error: --render {js}: " + message.format(path=js)
    assert not list(tmp_path.glob("*.png"))


def test_render_of_a_bench_mtp_record_by_bench_drafter_is_refused(tmp_path):
    js = tmp_path / "record.json"
    js.write_text(json.dumps(mtp_record()))
    with pytest.raises(SystemExit) as e:
        bench_drafter.main(["--render", str(js)])
    assert str(e.value) == (f"error: --render {js}: not a bench_drafter.py record (rows lack "
                            "'arm', 'step_ms', 'step_floor_ms', 'accept_ms')")


def test_bench_mtp_without_model_or_render_is_an_error(capsys):
    with pytest.raises(SystemExit) as e:
        bench_mtp.main([])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        ": error: --model is required (or --render RECORD.json)")


# ------------------------------------------------------------------------------ the markdown


def test_embed_replaces_its_own_section_and_finds_a_place_without_results(tmp_path):
    one = [("a", tmp_path / "x-a.png")]
    two = [("b", tmp_path / "x-b.png"), ("c", tmp_path / "sub" / "x-c.png")]
    md = "# t\n\n## Setup\n- s\n\n## What it says\n\nw\n"
    first = record_plots.embed(md, one, tmp_path)
    assert first == "# t\n\n## Setup\n- s\n\n## Pictures\n\n![a](x-a.png)\n\n## What it says\n\nw\n"
    assert record_plots.embed(first, two, tmp_path) == (
        "# t\n\n## Setup\n- s\n\n## Pictures\n\n![b](x-b.png)\n\n![c](sub/x-c.png)\n\n"
        "## What it says\n\nw\n")
    assert record_plots.embed("# t\n", one, tmp_path) == "# t\n\n## Pictures\n\n![a](x-a.png)\n"
    assert record_plots.embed(md, [], tmp_path) == md


def test_the_package_never_imports_matplotlib():
    for path in (ROOT / "mlx_mtp").rglob("*.py"):
        assert "matplotlib" not in path.read_text(), path
    code = ("import importlib, pkgutil, sys, mlx_mtp\n"
            "for m in pkgutil.walk_packages(mlx_mtp.__path__, 'mlx_mtp.'):\n"
            "    importlib.import_module(m.name)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "[]\n"
