"""The benchmark harness writes a complete record (smoke run on a tiny head-agreeing pair)."""

import json

import pytest

from benchmarks import bench_mtp, common
from support import tiny_checkpoints as tc


def test_distinct_ngram_share_on_hand_made_ids():
    """Distinct n-grams over all n-grams of the ids: 1.0 without a repeat, falling with a loop."""
    share = common.distinct_ngram_share
    assert share([1, 2, 3, 4, 5, 6]) == 1.0  # 3 four-grams, all distinct
    assert share([7, 7, 7, 7, 7, 7, 7]) == 0.25  # 4 four-grams, one distinct
    # a loop of period 3: 7 four-grams (1 2 3 1, 2 3 1 2, 3 1 2 3, then again), 3 distinct
    assert share([1, 2, 3, 1, 2, 3, 1, 2, 3, 1]) == 3 / 7
    assert share([1, 2, 3, 4]) == 1.0  # exactly one four-gram
    assert share([1, 2, 3]) is None and share([]) is None  # no four-gram to judge
    assert share([1, 1, 2, 1, 1], n=2) == 3 / 4  # (1 1), (1 2), (2 1), (1 1)
    assert share((5, 6, 5, 6), n=1) == 0.5
    with pytest.raises(ValueError):
        share([1, 2], n=0)


def test_bench_writes_markdown_and_json(tmp_path):
    model = tc.write_agreeing_checkpoint(tmp_path / "pair", seed=3)
    result = bench_mtp.main(["--model", str(model), "--block-sizes", "1,3", "--pairs", "2",
                             "--max-tokens", "12", "--out", str(tmp_path / "out"),
                             "--topic", "smoke", "--summary", "smoke run", "--allow-busy",
                             "--idle-window", "0.2"])
    md = list((tmp_path / "out").glob("smoke-*.md"))
    js = list((tmp_path / "out").glob("smoke-*.json"))
    assert len(md) == 1 and len(js) == 1
    data = json.loads(js[0].read_text())
    assert [r["block_size"] for r in data["rows"]] == [1, 3]
    assert all(r["identical_to_classic"] for r in data["rows"])
    three = data["rows"][1]
    assert three["acceptance"] > 0.9 and len(three["per_position_acceptance"]) == 2
    n_prompts = len(common.DEFAULT_PROMPTS)  # code, prose, a repetitive list, random characters
    assert n_prompts == 4
    assert len(data["raw"]["classic"]) == 2 * 4 and len(data["raw"]["mtp3"]) == 2 * 4
    assert data["cpu_blas"] == result["cpu_blas"] and data["bandwidth_gbs"] > 0
    text = md[0].read_text()
    assert three["mtp_enabled"] and three["exactness"]["verdict"] == "equal"
    assert "- block 3: MTP ran; verdict equal; all widths equal" in md[0].read_text()
    # every run's output and every prompt's row carry the share of distinct 4-grams (the
    # prompt's: the median of its plain runs'), in the .md's per-prompt table too
    assert all(0 < r["distinct_4gram_share"] <= 1 for arm in data["raw"].values() for r in arm)
    for p in data["per_prompt"]:
        runs = [r["distinct_4gram_share"] for r in data["raw"]["classic"]
                if r["prompt"] == p["prompt"]]
        assert p["distinct_4gram_share"] == sorted(runs)[0] == sorted(runs)[1]  # T=0: one text
        assert f"| {p['prompt']} | {p['distinct_4gram_share']:.2f} | {p['classic_tps']:.1f} |" \
            in text
    # verify ms per width (3 drafts-full rounds, and the budget's shorter last rounds) and the
    # same as a multiple of the plain decode step
    assert "3" in three["verify_ms_by_width"] and data["rows"][0]["verify_ms_by_width"] == {}
    for w, ms in three["verify_ms_by_width"].items():
        assert ms > 0
        assert abs(three["verify_over_step_by_width"][w] - ms / data["classic_step_ms"]) < 1e-12
    assert f"{three['verify_ms_by_width']['3']:.2f} ms ({three['verify_over_step_by_width']['3']:.2f}x)" in text
    # round times within a run: pooled over the arm's runs, each width and all, in a table
    spread = three["round_spread_by_width"]
    assert "3" in spread and spread["all"]["rounds"] >= spread["3"]["rounds"] >= 2
    assert all(v["log_sd"] >= 0 for v in spread.values())
    assert "## Round times within a run" in text
    assert f"| {spread['3']['log_sd']:.3f} ({spread['3']['rounds']}) |" in text
    for section in ("## Setup", "## Exactness gate", "## Results", "## Round split",
                    "## Verify cost per width", "## The floor", "## Idle check", "smoke run"):
        assert section in text
    # Queued phases (the default): the split says so, and no drafter step is claimed from them.
    assert three["phases_synced"] is False and three["drafter_step_ms"] is None
    assert "`MLX_MTP_SYNC_PHASES=1`" in text.split("## Round split")[1].split("## Verify")[0]
    # The synced pass (one run per prompt of every arm, each phase waiting for its own work):
    # its split, the verify alone over the same pass's plain step, not mixed into the tok/s.
    synced = data["synced"]
    assert [(r["arm"], r["prompt"]) for r in synced] == [
        (arm, p) for p in common.DEFAULT_PROMPTS for arm in ("classic", "mtp1", "mtp3")]
    assert all(r["stats"]["phases_synced"] for r in synced if r["arm"] != "classic")
    assert all(r["identical"] for r in synced if r["arm"] != "classic")
    assert three["synced_runs"] == 4 and three["synced_identical"] is True
    step = sorted(1e3 / r["tps"] for r in synced if r["arm"] == "classic")
    assert three["synced_step_ms"] == (step[1] + step[2]) / 2
    split = three["synced_round_ms"]
    assert abs(three["synced_non_verify_share"]
               - (1 - split["verify"] / sum(split.values()))) < 1e-12
    for w, ms in three["synced_verify_ms_by_width"].items():
        assert three["synced_verify_over_step_by_width"][w] == ms / three["synced_step_ms"]
    assert three["drafter_step_ms"] is None  # the synced runs are not the queued arm's runs
    assert "## Each phase on its own (`MLX_MTP_SYNC_PHASES=1`)" in text
    assert (f"| 3 | {split['verify']:.2f} | {split['draft']:.2f} | {split['accept']:.2f} | "
            f"{split['finalize']:.2f} | {split['residual']:.2f} | "
            f"{100 * three['synced_non_verify_share']:.0f}% |") in text
    # The idle check is in the record; a busy machine (--allow-busy) is labelled, not hidden.
    check = data["idle_check"]
    assert check["verdict"] in ("idle", "contended") and check["during"]["total"]["wall_s"] > 0
    contended = check["verdict"] == "contended"
    assert (data.get("label") == "contended: not a result") == contended
    assert md[0].name.endswith("-contended.md") == contended
    assert ("**CONTENDED: NOT A RESULT**" in text) == contended
    # The pictures (tests/test_record_plots.py checks what they are), linked from the .md.
    stem = md[0].stem
    assert sorted(p.name for p in (tmp_path / "out").glob("*.png")) == sorted(
        f"{stem}-{name}.png" for name in ("tps", "acceptance", "rounds"))
    for name in ("tps", "acceptance", "rounds"):
        assert f"]({stem}-{name}.png)" in text


def test_bench_at_temperature_states_the_rule_and_claims_no_identity(tmp_path):
    model = tc.write_agreeing_checkpoint(tmp_path / "pair", seed=3)
    bench_mtp.main(["--model", str(model), "--block-sizes", "3", "--pairs", "1",
                    "--max-tokens", "10", "--out", str(tmp_path / "out"), "--topic", "hot",
                    "--temp", "1.0", "--seed", "5", "--acceptance", "point-mass", "--allow-busy",
                    "--idle-window", "0.2", "--synced-runs", "0"])
    data = json.loads(next((tmp_path / "out").glob("hot-*.json")).read_text())
    row = data["rows"][0]
    assert (data["temperature"], data["seed"], data["acceptance"]) == (1.0, 5, "point-mass")
    assert row["acceptance_rule"] == "point-mass" and row["identical_to_classic"] is None
    text = next((tmp_path / "out").glob("hot-*.md")).read_text()
    assert "T=1.0, top-p 0.0, top-k 0, seed 5 (+ run index), acceptance rule point-mass" in text
    assert "| n/a (sampled) |" in text
    # --synced-runs 0: no synced pass, no section for it
    assert data["synced"] == [] and "synced_runs" not in row
    assert "## Each phase on its own" not in text


def test_bench_auto_arm_reports_per_prompt_against_the_best_fixed_block(tmp_path):
    model = tc.write_agreeing_checkpoint(tmp_path / "pair", seed=3)
    bench_mtp.main(["--model", str(model), "--block-sizes", "1,3,auto", "--max-block-size", "4",
                    "--pairs", "1", "--max-tokens", "10", "--out", str(tmp_path / "out"),
                    "--topic", "auto", "--allow-busy"])
    data = json.loads(next((tmp_path / "out").glob("auto-*.json")).read_text())
    assert [r["block_size"] for r in data["rows"]] == [1, 3, "auto"]
    auto = data["rows"][2]
    assert auto["identical_to_classic"] and auto["mtp_enabled"]
    assert [w["width"] for w in auto["exactness"]["widths"]] == [2, 3, 4]
    runs = data["raw"]["mtpauto"]
    assert sum(auto["block_sizes"].values()) == sum(r["stats"]["rounds"] for r in runs)
    assert set(auto["block_sizes"]) <= {"1", "2", "3", "4"} and data["max_block_size"] == 4
    assert [p["prompt"] for p in data["per_prompt"]] == list(common.DEFAULT_PROMPTS)
    for p in data["per_prompt"]:
        fixed = {b: p["mtp_tps"][b] for b in ("1", "3")}
        best = max(fixed, key=fixed.get)
        assert p["best_fixed"] == int(best)
        assert p["auto_vs_best_fixed"] == p["mtp_tps"]["auto"] / fixed[best]
        assert p["auto_vs_plain"] == p["mtp_tps"]["auto"] / p["classic_tps"]
    text = next((tmp_path / "out").glob("auto-*.md")).read_text()
    assert "## Per prompt (medians over pairs)" in text
    assert "| prompt | distinct 4-grams | classic tok/s | block 1 tok/s | block 3 tok/s | " \
           "block auto tok/s | auto / best fixed | that block, paired | auto / plain | " \
           "widths auto chose (width: rounds) |" in text
    # and pair by pair: one pair, so each range is that pair's own ratio
    for p in data["per_prompt"]:
        auto_tps = {r["prompt"]: r["tps"] for r in runs}[p["prompt"]]
        for b in ("1", "3"):
            other = next(r["tps"] for r in data["raw"][f"mtp{b}"] if r["prompt"] == p["prompt"])
            ratio = auto_tps / other
            assert p["auto_vs_fixed_paired"][b] == {"median": ratio, "min": ratio, "max": ratio,
                                                    "pairs": 1}
    assert "## Auto against each fixed block, pair by pair" in text
    assert "| prompt | vs block 1 | vs block 3 | hardest block, paired |" in text
    assert "- block auto: MTP ran; verdict equal; all widths equal" in text


def test_bench_rejects_a_bad_arm(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        bench_mtp.main(["--model", "x", "--block-sizes", "1,fast"])
    assert e.value.code == 2
    assert "--block-sizes: expected comma-separated block sizes or auto, got '1,fast'" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        bench_mtp.main(["--model", "x", "--synced-runs", "-1"])
    assert e.value.code == 2
    assert ("--pairs >= 1, --max-tokens >= 2, --max-block-size >= 1, --synced-runs >= 0 and "
            "block sizes >= 1 are required") in capsys.readouterr().err


def _made_up_raw():
    """Three pairs of one prompt: plain, blocks 3 and 5, auto (tok/s chosen by hand)."""
    tps = {"classic": (50, 50, 50), "mtp3": (80, 70, 90), "mtp5": (100, 80, 110),
           "mtpauto": (90, 88, 99)}
    raw = {arm: [{"pair": i, "prompt": "code", "tps": float(t)} for i, t in enumerate(ts)]
           for arm, ts in tps.items()}
    for r in raw["mtpauto"]:
        r["stats"] = {"block_sizes": {"2": 1, "6": 10}}
    return raw


def test_auto_against_each_fixed_block_pair_by_pair():
    """The per-prompt comparison: the plain one (auto's median over the best fixed arm's median)
    and, beside it, auto over each fixed block in the same pair: median and range over pairs."""
    from types import SimpleNamespace

    raw = _made_up_raw()
    args = SimpleNamespace(prompts={"code": "x"}, block_sizes=[3, 5, "auto"])
    [row] = bench_mtp.per_prompt(args, raw)
    # medians: block 3 80, block 5 100, auto 90: the best fixed block is 5, auto 0.9x of it
    assert row["best_fixed"] == 5 and row["auto_vs_best_fixed"] == 90 / 100
    assert row["auto_vs_plain"] == 90 / 50
    # pair by pair, auto / block 5 is 90/100, 88/80, 99/110 = 0.9, 1.1, 0.9; auto / block 3 is
    # 90/80, 88/70, 99/90 = 1.125, 1.257, 1.1
    assert row["auto_vs_fixed_paired"] == {
        "3": {"median": 90 / 80, "min": 99 / 90, "max": 88 / 70, "pairs": 3},
        "5": {"median": 90 / 100, "min": 90 / 100, "max": 88 / 80, "pairs": 3}}
    assert bench_mtp.hardest_fixed(row["auto_vs_fixed_paired"]) == "5"
    assert row["auto_block_sizes"] == {"2": 3, "6": 30}
    # held out: block 5 is the best over the other two pairs for every pair (95 / 105 / 90
    # against block 3's 80 / 85 / 75), so its ratios are the paired ones
    assert row["auto_vs_best_fixed_held_out"] == {"median": 90 / 100, "min": 90 / 100,
                                                  "max": 88 / 80, "pairs": 3, "chosen": {"5": 3}}
    lines = bench_mtp.per_prompt_lines({"per_prompt": [row], "raw": raw})
    assert lines[3] == ("| prompt | classic tok/s | block 3 tok/s | block 5 tok/s "
                        "| block auto tok/s | auto / best fixed | that block, paired "
                        "| auto / best fixed, held out "
                        "| auto / plain | widths auto chose (width: rounds) |")
    assert lines[5] == ("| code | 50.0 | 80.0 | 100.0 | 90.0 | 0.90x (block 5) | 0.90x (0.90-1.10) "
                        "| 0.90x (0.90-1.10) | 1.80x | 2: 3, 6: 30 |")
    assert lines[7].endswith("Blocks so chosen: code 5: 3.")
    assert "## Auto against each fixed block, pair by pair" in lines
    assert lines[-3:-1] == ["| prompt | vs block 3 | vs block 5 | hardest block, paired |",
                            "|---|---|---|---|"]
    assert lines[-1] == ("| code | 1.12x (1.10-1.26) | 0.90x (0.90-1.10) "
                         "| block 5: 0.90x (0.90-1.10) |")


def test_a_record_from_before_the_paired_comparison_still_renders():
    """Records written before ``auto_vs_fixed_paired``: computed from their raw runs; without
    raw runs the table is the one they were written with."""
    from types import SimpleNamespace

    raw = _made_up_raw()
    [row] = bench_mtp.per_prompt(SimpleNamespace(prompts={"code": "x"},
                                                 block_sizes=[3, 5, "auto"]), raw)
    new = bench_mtp.per_prompt_lines({"per_prompt": [row], "raw": raw})
    del row["auto_vs_fixed_paired"], row["auto_vs_best_fixed_held_out"]
    assert bench_mtp.per_prompt_lines({"per_prompt": [row], "raw": raw}) == new
    old = bench_mtp.per_prompt_lines({"per_prompt": [row]})
    assert old == ["", "## Per prompt (medians over pairs)", "",
                   "| prompt | classic tok/s | block 3 tok/s | block 5 tok/s | block auto tok/s "
                   "| auto / best fixed | auto / plain | widths auto chose (width: rounds) |",
                   "|---|---|---|---|---|---|---|---|",
                   "| code | 50.0 | 80.0 | 100.0 | 90.0 | 0.90x (block 5) | 1.80x | 2: 3, 6: 30 |"]


def test_held_out_best_fixed_block_is_chosen_on_the_other_pairs():
    """Blocks 3 and 5 about equal, noisy: the best of the medians measured on the same runs
    (block 3: 90 against 88) makes auto look 1.00x; chosen on the other pairs, each pair's
    block is 5, 3, 5 and auto is 90/88, 90/80, 90/85 of it."""
    tps = {"classic": (50, 50, 50), "mtp3": (100, 80, 90), "mtp5": (88, 95, 85),
           "mtpauto": (90, 90, 90)}
    raw = {arm: [{"pair": i, "prompt": "p", "tps": float(t)} for i, t in enumerate(ts)]
           for arm, ts in tps.items()}
    # pair 0: others' medians 85 (3) / 90 (5) -> 5; pair 1: 95 / 86.5 -> 3; pair 2: 90 / 91.5 -> 5
    got = bench_mtp.held_out_vs_best(raw, "p", [3, 5])
    assert got == {"median": 90 / 85, "min": 90 / 88, "max": 90 / 80, "pairs": 3,
                   "chosen": {"5": 2, "3": 1}}
    assert bench_mtp.held_out_vs_best(raw, "other prompt", [3, 5]) == {}
    one = {arm: runs[:1] for arm, runs in raw.items()}
    assert bench_mtp.held_out_vs_best(one, "p", [3, 5]) == {}  # one pair: nothing to hold out


def test_round_spread_pools_each_runs_deviations_from_its_own_mean():
    """Two runs at width 3 (4 and 3 rounds) and one at width 6: the pooled log-sd is the root of
    the runs' squared deviations over their degrees of freedom, not the spread of all the rounds
    together (run 2's rounds sit 10% higher: drift between runs, not noise within one)."""
    import math
    import statistics

    from mlx_mtp.decoding.stats import RunStats

    runs = [{3: [0.0150, 0.0155, 0.0148, 0.0160], 6: [0.020, 0.021, 0.0205]},
            {3: [0.0165, 0.0170, 0.0162]}]
    stats = []
    for walls in runs:
        st = RunStats()
        for w, ts in walls.items():
            for t in ts:
                st.record_round(w - 1, 0, t)
        stats.append(st.to_dict())
    got = bench_mtp.round_spread_by_width(stats)
    logs = [[math.log(t) for t in r[3]] for r in runs]
    ss3 = sum(statistics.variance(x) * (len(x) - 1) for x in logs)
    assert got["3"]["rounds"] == 7 and abs(got["3"]["log_sd"] - math.sqrt(ss3 / 5)) < 1e-12
    assert got["3"]["log_sd"] < statistics.stdev(logs[0] + logs[1])  # the drift is left out
    ss6 = statistics.variance([math.log(t) for t in runs[0][6]]) * 2
    assert got["6"]["rounds"] == 3 and abs(got["6"]["log_sd"] - math.sqrt(ss6 / 2)) < 1e-12
    assert got["all"]["rounds"] == 10
    assert abs(got["all"]["log_sd"] - math.sqrt((ss3 + ss6) / 7)) < 1e-12
    assert bench_mtp.round_spread_by_width([{"rounds": 5}]) == {}  # a record before the field


def _write(folder, name, topic):
    path = folder / name
    path.write_text(json.dumps({"topic": topic}))
    return path


def test_the_newest_record_of_a_topic_is_found_by_the_date_in_its_name(tmp_path):
    """``<topic>-*.json`` also matches longer topics and contended records: neither counts."""
    _write(tmp_path, "drafter-phases-vm-2026-11-30.json", "drafter-phases")
    _write(tmp_path, "drafter-phases-vm-2026-12-01.json", "drafter-phases")
    _write(tmp_path, "drafter-phases-demo-pair-vm-2026-12-09.json", "drafter-phases-demo-pair")
    _write(tmp_path, "drafter-phases-vm-2026-12-05-contended.json", "drafter-phases")
    _write(tmp_path, "drafter-phases-other-host-2026-10-01.json", "drafter-phases")
    got = common.topic_records("drafter-phases", tmp_path)
    assert [p.name for p in got] == ["drafter-phases-other-host-2026-10-01.json",
                                     "drafter-phases-vm-2026-11-30.json",
                                     "drafter-phases-vm-2026-12-01.json"]
    assert common.newest_record("drafter-phases", tmp_path).name == \
        "drafter-phases-vm-2026-12-01.json"
    assert common.newest_record("drafter-phases-demo-pair", tmp_path).name == \
        "drafter-phases-demo-pair-vm-2026-12-09.json"
    assert common.record_date(got[1].with_suffix(".md")) == "2026-11-30"
    assert common.record_date(tmp_path / "drafter-phases-vm-2026-11-30-tps.png") == "2026-11-30"
    assert common.record_date(tmp_path / "idle-baseline-vm.json") is None
    with pytest.raises(FileNotFoundError):
        common.newest_record("no-such-topic", tmp_path)


def test_superseded_files_are_every_file_of_the_topic_but_the_newest_records(tmp_path):
    for name in ("t-vm-2026-12-01.json", "t-vm-2026-12-03.json"):
        _write(tmp_path, name, "t")
    _write(tmp_path, "t-vm-2026-12-04-contended.json", "t")
    _write(tmp_path, "t-longer-vm-2026-11-01.json", "t-longer")  # another topic
    for name in ("t-vm-2026-12-01.md", "t-vm-2026-12-01-tps.png", "t-vm-2026-12-02-tps.png",
                 "t-vm-2026-12-03.md", "t-vm-2026-12-03-tps.png", "t-vm-2026-12-04-contended.md",
                 "t-longer-vm-2026-11-01.md", "idle-baseline-vm.json"):
        (tmp_path / name).write_text("")
    got = [p.name for p in common.superseded("t", tmp_path)]
    assert got == ["t-vm-2026-12-01-tps.png", "t-vm-2026-12-01.json", "t-vm-2026-12-01.md",
                   "t-vm-2026-12-02-tps.png", "t-vm-2026-12-04-contended.json",
                   "t-vm-2026-12-04-contended.md"]
    assert common.superseded("t-longer", tmp_path) == []
    assert common.superseded("none", tmp_path) == []


def test_prompt_sets_and_a_bad_prompts_file(tmp_path, capsys):
    import argparse

    p = argparse.ArgumentParser(prog="bench")
    common.add_prompt_args(p)
    assert common.prompts_of(p.parse_args([]), p) == common.DEFAULT_PROMPTS
    assert list(common.prompts_of(p.parse_args(["--prompts", "code"]), p)) == [
        "code2", "code3", "code4"]
    assert len(common.prompts_of(p.parse_args(["--prompts", "held-out"]), p)) == 9
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"a": ""}))
    with pytest.raises(SystemExit) as e:
        common.prompts_of(p.parse_args(["--prompts-json", str(bad)]), p)
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        f"--prompts-json {bad}: expected a JSON object of non-empty prompt strings")


def test_the_command_a_record_states_names_a_benchmark_as_python_m_does():
    path = str(common.ROOT / "benchmarks" / "bench_mtp.py")
    assert common.command_line([path, "--model", "a b"]) == \
        "python -m benchmarks.bench_mtp --model 'a b'"
    assert common.command_line(["/elsewhere/x.py", "-q"]) == "/elsewhere/x.py -q"


def test_a_repetition_penalty_runs_on_both_arms_and_keeps_identity(tmp_path):
    """The demo pair's decode setting: both arms get the same processors, T=0 stays identical,
    and the record says which processors ran."""
    model = tc.write_agreeing_checkpoint(tmp_path / "pair", seed=3)
    bench_mtp.main(["--model", str(model), "--block-sizes", "3", "--pairs", "1",
                    "--max-tokens", "12", "--out", str(tmp_path / "out"), "--topic", "penalty",
                    "--repetition-penalty", "1.3", "--repetition-context-size", "8",
                    "--allow-busy", "--idle-window", "0.2", "--synced-runs", "0"])
    data = json.loads(next((tmp_path / "out").glob("penalty-*.json")).read_text())
    assert (data["repetition_penalty"], data["repetition_context_size"]) == (1.3, 8)
    assert data["rows"][0]["identical_to_classic"] is True
    text = next((tmp_path / "out").glob("penalty-*.md")).read_text()
    assert "repetition penalty 1.3 over 8 tokens" in text


def test_draft_bf16_runs_the_drafter_on_bfloat16_weights_and_the_record_says_so(tmp_path):
    model = tc.write_agreeing_checkpoint(tmp_path / "pair", seed=3)
    bench_mtp.main(["--model", str(model), "--block-sizes", "3", "--pairs", "1",
                    "--max-tokens", "10", "--out", str(tmp_path / "out"), "--topic", "bf16",
                    "--draft-bf16", "--allow-busy", "--idle-window", "0.2", "--synced-runs", "0"])
    data = json.loads(next((tmp_path / "out").glob("bf16-*.json")).read_text())
    assert data["draft_bf16"] is True
    row = data["rows"][0]
    assert row["identical_to_classic"] and row["acceptance"] > 0.5
    text = next((tmp_path / "out").glob("bf16-*.md")).read_text()
    assert "its products on bfloat16 weights (--draft-bf16)" in text
