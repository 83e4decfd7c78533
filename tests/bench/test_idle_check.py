"""The benchmarks' idle check: /proc readings, the decision, and the refusal of a busy machine."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import tiny_checkpoints as tc

from benchmarks import idle as ic

ROOT = Path(__file__).resolve().parents[2]

T = ic.CLK  # ticks per second in /proc


def stat_text(user, system, idle, steal=0):
    return (f"cpu  {user} 0 {system} {idle} 0 0 0 {steal} 0 0\n"
            f"cpu0 {user} 0 {system} {idle} 0 0 0 {steal} 0 0\nintr 1 2 3\n")


def pid_text(pid, name, ppid, utime, stime=0, cutime=0, cstime=0):
    # fields 3.. : state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime ...
    return (f"{pid} ({name}) S {ppid} 1 1 0 -1 4194304 10 0 0 0 {utime} {stime} {cutime} {cstime} "
            "20 0 1 0 100 1000 100\n")


def write_proc(d: Path, cpu, pids, load="0.42 0.30 0.20 3/120 999"):
    d.mkdir(parents=True, exist_ok=True)
    (d / "stat").write_text(cpu)
    (d / "loadavg").write_text(load)
    for pid, text in pids.items():
        (d / str(pid)).mkdir(exist_ok=True)
        (d / str(pid) / "stat").write_text(text)


def test_parsers_read_proc_formats():
    assert ic.parse_pid_stat(pid_text(7, "a (weird) name", 1, 3 * T, T, 2 * T, 0)) == \
        (7, "a (weird) name", 1, 4.0, 2.0)
    cpu = ic.parse_cpu_line(stat_text(5 * T, 2 * T, 10 * T, steal=T))
    assert (cpu["user"], cpu["system"], cpu["idle"], cpu["steal"]) == (5.0, 2.0, 10.0, 1.0)
    assert ic.parse_loadavg("1.50 0.75 0.25 2/301 4242\n") == ((1.5, 0.75, 0.25), 2)


def test_others_are_the_machine_busy_time_minus_our_tree(tmp_path):
    """Our process (100) and its child (101) used 3 of the machine's 4.5 busy CPU-seconds over
    2 s; a neighbour (200) used 1.5 and is named; a kernel thread's tick of noise is not."""
    a, b = tmp_path / "a", tmp_path / "b"
    write_proc(a, stat_text(10 * T, 0, 100 * T), {
        100: pid_text(100, "bench", 1, 5 * T), 101: pid_text(101, "child", 100, 1 * T),
        200: pid_text(200, "burner", 1, 7 * T), 300: pid_text(300, "kworker", 2, 0), 1: pid_text(1, "init", 0, 0)})
    write_proc(b, stat_text(10 * T + int(4.5 * T), 0, 100 * T + T // 2, steal=T // 5), {
        100: pid_text(100, "bench", 1, 7 * T), 101: pid_text(101, "child", 100, 2 * T),
        200: pid_text(200, "burner", 1, int(8.5 * T)), 300: pid_text(300, "kworker", 2, 1),
        1: pid_text(1, "init", 0, 0)})
    ra, rb = ic.read_proc(root=100, proc=a), ic.read_proc(root=100, proc=b)
    assert rb.own == {100, 101} and rb.loadavg == (0.42, 0.30, 0.20) and rb.running == 3
    rb.t = ra.t + 2.0
    iv = ic.interval(ra, rb)
    assert iv["own_cores"] == pytest.approx(1.5) and iv["others_cores"] == pytest.approx(0.75)
    assert iv["steal_cores"] == pytest.approx(0.1)
    assert iv["competitors"] == [{"pid": 200, "name": "burner", "cores": 0.75}]


def quiet(others=0.0, steal=0.0, competitors=()):
    return {"wall_s": 2.0, "others_cores": others, "steal_cores": steal, "own_cores": 0.0,
            "competitors": list(competitors)}


def run_total(others, samples, steal=0.0, competitors=()):
    return {"total": quiet(others, steal, competitors), "sample_s": 2.0, "samples": samples}


def test_decision_on_fabricated_readings():
    assert ic.decide(quiet(0.03), run_total(0.05, [0.02, 0.3, 0.08]), quiet(0.01), 9.0, 8.0,
                     10.0) == []
    burner = [{"pid": 4242, "name": "python", "cores": 0.97}]
    assert ic.decide(quiet(0.98, competitors=burner), run_total(0.2, [0.1, 0.6]), quiet(0.0),
                     None, None, None) == [
        "other processes used 0.98 cores before the run (top: python[4242] 0.97)",
        "other processes used 0.20 cores on average during the run",
        "other processes used 0.60 cores in a 2 s interval of the run"]
    assert ic.decide(quiet(), run_total(0.0, [], steal=0.3), quiet(), 5.0, 9.9, 10.0) == [
        "memory bandwidth before the run was 5.0 GB/s, under 75% of this machine's idle 10.0 GB/s",
        "the hypervisor stole 0.30 cores during the run"]
    # No idle figure for this machine: the bandwidth is recorded, not judged.
    assert ic.decide(quiet(), run_total(0.0, []), quiet(), 1.0, 1.0, None) == []


def test_refusal_is_one_line_and_allow_busy_labels():
    check = {"verdict": "contended", "reasons": ["a", "b"]}
    with pytest.raises(SystemExit) as e:
        ic.settle(dict(check), allow_busy=False)
    assert e.value.code == ("error: the machine was not idle: a; b. No record written; rerun on an "
                            "idle machine (or pass --allow-busy to keep it, labelled 'contended: "
                            "not a result')")
    assert ic.settle(dict(check), allow_busy=True)["label"] == "contended: not a result"
    assert ic.settle({"verdict": "idle", "reasons": []}, allow_busy=False) == \
        {"verdict": "idle", "reasons": []}


def bench(args, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args, "--out", str(tmp_path / "out"),
                           "--idle-window", "1.5"], capture_output=True, text=True, env=env,
                          timeout=600, cwd=ROOT)


@pytest.fixture
def burner():
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(0.5)
    yield p
    p.kill()
    p.wait()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("idle")
    model = tc.write_agreeing_checkpoint(d / "pair", seed=3)
    (d / "corpus.txt").write_text("\n\n".join(tc.CORPUS))
    (d / "prompts.json").write_text(json.dumps({"code": "def add(a, b):"}))
    return d, model


# Every benchmark that writes a record: the check refuses before the run starts.
@pytest.mark.parametrize("script", ["bench_mtp", "bench_drafter", "bench_convert",
                                    "bench_server", "bench_split", "blas_spread",
                                    "probe_cost", "cli_pairs"])
def test_a_cpu_burning_neighbour_is_refused(script, pair, burner, tmp_path):
    d, model = pair
    m = ["--model", str(model)]
    args = {"bench_mtp": m + ["--block-sizes", "1", "--pairs", "1", "--max-tokens", "4"],
            "bench_drafter": m + ["--corpus", str(d / "corpus.txt"), "--draft-vocab-size",
                                     "128", "--pairs", "1", "--max-tokens", "4", "--prompts-json",
                                     str(d / "prompts.json"), "--work", str(tmp_path / "work")],
            "bench_convert": m + ["--arms", "8:none", "--group-size", "32", "--pairs", "1",
                                     "--max-tokens", "4"],
            "bench_server": m + ["--pairs", "1", "--max-tokens", "4", "--clients", "1",
                                    "--requests", "1"],
            "bench_split": m + ["--splits", "pipeline", "--pairs", "1", "--max-tokens", "4"],
            "blas_spread": ["--processes", "2", "--arms", "default", "--max-tokens", "4"],
            "probe_cost": m + ["--repeats", "1", "--record"],
            "cli_pairs": ["--pairs", "1", "--cli-args=--max-tokens 4"]}[script]
    r = bench(["-m", f"benchmarks.{script}", *args], tmp_path)
    assert r.returncode == 1, r.stderr
    line = r.stderr.strip().splitlines()
    assert len(line) == 1 and line[0].startswith("error: the machine was not idle: other processes "
                                                 "used "), r.stderr
    assert line[0].endswith("labelled 'contended: not a result')")
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_allow_busy_writes_a_labelled_record_naming_the_neighbour(pair, burner, tmp_path):
    _, model = pair
    r = bench(["-m", "benchmarks.bench_mtp", "--model", str(model), "--block-sizes", "1", "--pairs", "1",
               "--max-tokens", "4", "--topic", "busy", "--allow-busy"], tmp_path)
    assert r.returncode == 0, r.stderr
    js = list((tmp_path / "out").glob("busy-*-contended.json"))
    assert len(js) == 1
    data = json.loads(js[0].read_text())
    check = data["idle_check"]
    assert data["label"] == check["label"] == "contended: not a result"
    assert check["verdict"] == "contended" and check["before"]["others_cores"] > 0.5
    named = {c["pid"] for w in (check["before"], check["after"], check["during"]["total"])
             for c in w["competitors"]}
    assert burner.pid in named
    md = js[0].with_suffix(".md").read_text()
    reasons = "; ".join(check["reasons"])
    assert md.split("\n")[2] == f"**{ic.LABEL.upper()}**: {reasons}"
    assert "## Idle check" in md and f"- Verdict: **contended** ({ic.LABEL}): {reasons}" in md


def test_a_unit_of_the_run_is_judged_alone():
    assert ic.unit_reasons(quiet(0.05, 0.08), 12.0, 14.0) == []
    assert ic.unit_reasons(quiet(0.2, 0.3, [{"pid": 9, "name": "cc1", "cores": 0.2}]), 9.0,
                           14.0) == [
        "other processes used 0.20 cores (top: cc1[9] 0.20)",
        "the hypervisor stole 0.30 cores",
        "memory bandwidth after it was 9.0 GB/s, under 75% of this machine's idle 14.0 GB/s"]
    # A burst too short to move the unit's mean still has it retaken (the run's peak limit).
    assert ic.unit_reasons(quiet(0.05, 0.0), None, None, peak=0.98, sample_s=2.0) == [
        "other processes used 0.98 cores in a 2 s interval"]
    assert ic.unit_reasons(quiet(0.05, 0.0), None, None, peak=0.4) == []
    # 100 s at 0.1 steal and 0.05 others, less a 20 s attempt at 0.4 steal and 0.1 others:
    # 10 - 8 = 2 steal-seconds and 5 - 2 = 3 others-seconds over 80 s.
    total = {**quiet(0.05, 0.1), "wall_s": 100.0}
    kept = ic.without(total, [{**quiet(0.1, 0.4), "wall_s": 20.0}])
    assert kept["wall_s"] == 80.0 and kept["steal_cores"] == pytest.approx(0.025)
    assert kept["others_cores"] == pytest.approx(0.0375)
    # "kept" is what the verdict judges where units were retaken.
    run = {**run_total(0.0, [], steal=0.3), "kept": quiet(0.0, 0.02)}
    assert ic.decide(quiet(), run, quiet(), None, None, None) == []


class FakeProc:
    """/proc as the Watch reads it: a clock, the machine's steal and a neighbour's CPU time
    (``busy_until``: it uses a whole core until then), moved by the test and by ``sleep``."""

    def __init__(self, busy_until=0.0):
        self.t, self.steal, self.user, self.busy_until = 0.0, 0.0, 0.0, busy_until

    def read(self, root=None, proc=None):
        cpu = {k: 0.0 for k in ic.CPU_FIELDS}
        cpu["steal"], cpu["user"] = self.steal, self.user
        return ic.Reading(self.t, cpu, {}, set(), (0.0, 0.0, 0.0), 1)

    def sleep(self, s):
        self.user += max(0.0, min(self.t + s, self.busy_until) - self.t)
        self.t += s


@pytest.mark.parametrize("retakes, allow_busy", [(1, False), (0, False), (3, True)])
def test_a_unit_the_hypervisor_stole_from_is_measured_again(monkeypatch, retakes, allow_busy):
    fake = FakeProc()
    monkeypatch.setattr(ic, "read_proc", fake.read)
    monkeypatch.setattr(ic.time, "sleep", fake.sleep)  # the pause before a retake
    attempts = []

    def measure():  # 10 s; the first attempt loses 3 s to the hypervisor (0.3 cores)
        attempts.append(len(attempts))
        fake.t += 10.0
        fake.steal += 3.0 if len(attempts) == 1 else 0.0
        return f"attempt {len(attempts)}"

    w = ic.Watch(window_s=0.0, sample_s=1000.0, probe=False, retakes=retakes,
                 allow_busy=allow_busy)
    got = w.unit("pair 0 code", measure)
    check = w.finish()
    units = check["during"]["units"]
    if retakes and not allow_busy:
        assert got == "attempt 2" and attempts == [0, 1] and w.retakes == 0
        assert [(u["unit"], u["reasons"], u["retaken"]) for u in units] == [
            ("pair 0 code", ["the hypervisor stole 0.30 cores"], True), ("pair 0 code", [], False)]
        # the run: 10 s attempt + 20 s pause + 10 s attempt; 3 steal-seconds, all in the first
        assert check["during"]["retaken"] == 1 and check["during"]["total"]["wall_s"] == 40.0
        assert check["during"]["total"]["steal_cores"] == 0.075
        # kept: the second attempt alone (the pause goes with the dropped attempt)
        assert check["during"]["kept"] == {**check["during"]["total"], "wall_s": 10.0,
                                           "steal_cores": 0.0}
        assert check["verdict"] == "idle"
        lines = ic.markdown(check)
        at = next(i for i, line in enumerate(lines) if line.startswith("- Units judged"))
        assert "1 kept, 1 retaken" in lines[at]
        assert lines[at + 1] == f"  - retaken: pair 0 code (10 s): {units[0]['reasons'][0]}"
        assert "(10 s)" in lines[at + 2] and "others 0.00" in lines[at + 2] \
            and "steal 0.00" in lines[at + 2]
    else:  # no retakes left, or --allow-busy: the attempt is kept and the run judged with it
        assert got == "attempt 1" and attempts == [0]
        assert [u["retaken"] for u in units] == [False] and "kept" not in check["during"]
        assert check["verdict"] == "contended"
        assert check["reasons"] == ["the hypervisor stole 0.30 cores during the run"]
        assert any(line.startswith("  - kept although not quiet") and
                   line.endswith(f": pair 0 code: {units[0]['reasons'][0]}")
                   for line in ic.markdown(check))


def test_retakes_and_wait_idle_must_not_be_negative(tmp_path):
    r = bench(["-m", "benchmarks.cli_pairs", "--pairs", "1", "--retakes", "-1"], tmp_path)
    assert r.returncode == 1
    assert r.stderr.strip() == "error: --retakes and --wait-idle must be >= 0, got -1 and 0"


def test_wait_idle_waits_out_a_busy_window(monkeypatch):
    """A neighbour busy for the first 20 s: with --wait-idle 60 the before window is tried
    again every 15 s until quiet; with 0 the run is refused at once."""
    fake = FakeProc(busy_until=20.0)
    monkeypatch.setattr(ic, "read_proc", fake.read)
    monkeypatch.setattr(ic.time, "sleep", fake.sleep)
    monkeypatch.setattr(ic.time, "monotonic", lambda: fake.t)
    w = ic.Watch(window_s=2.0, sample_s=1000.0, probe=False, wait_s=60.0)
    assert fake.t == 36.0  # windows at 0, 17 (busy), 34 (quiet)
    assert [x["window"] for x in w.waits] == ["before", "before"]
    assert w.waits[0]["reasons"] == ["other processes used 1.00 cores before the run"]
    check = w.finish()
    assert check["verdict"] == "idle" and len(check["waits"]) == 2
    waited = [line for line in ic.markdown(check) if line.startswith("- Waited")]
    assert len(waited) == 2 and all(line.endswith(f"before the run: {'; '.join(x['reasons'])}")
                                    for line, x in zip(waited, w.waits))
    fake2 = FakeProc(busy_until=20.0)
    monkeypatch.setattr(ic, "read_proc", fake2.read)
    monkeypatch.setattr(ic.time, "sleep", fake2.sleep)
    monkeypatch.setattr(ic.time, "monotonic", lambda: fake2.t)
    with pytest.raises(SystemExit) as e:
        ic.Watch(window_s=2.0, sample_s=1000.0, probe=False, wait_s=0.0)
    assert str(e.value.code).startswith("error: the machine was not idle: other processes used "
                                        "1.00 cores before the run. No record written")
