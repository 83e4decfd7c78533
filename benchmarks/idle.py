"""Was the machine idle while a benchmark ran? Checked before, during and after; written into the record.

On 2 cores a busy neighbour halves plain decode and collapses multi-threaded BLAS, so a record taken
beside one is not a result (docs/benchmarks.md). What is looked at:
- CPU time of other processes, from /proc: the machine's busy time (/proc/stat) minus what this
  process and its children used, sampled every couple of seconds while the benchmark runs, and in
  a short window before and after it; the processes that used the most are named.
- steal time (/proc/stat): another virtual machine took our CPUs.
- a short streaming-read bandwidth probe (numpy, one thread, no BLAS) before and after, against this
  machine's idle figure (``python -m benchmarks.idle --calibrate`` on an idle machine writes it to
  ``benchmark_results/idle-baseline-<host>.json``).
- the load average, recorded only: it lags by a minute and counts the benchmark itself (and the
  previous one when records are taken back to back), so it cannot decide.

The benchmarks use ``Watch`` around their run (``benchmarks.common.watch`` / ``finish``) and
refuse to write a record when the machine was not idle, unless ``--allow-busy``, which labels the
record "contended: not a result".

On a virtual machine the neighbours come and go within minutes, so a run of several minutes is
rarely quiet from end to end. A benchmark that measures in units (``Watch.unit``: one alternating
pair of arms, one round of processes) has each unit judged on its own: the CPU time of other
processes and the steal during it, and a bandwidth probe after it. A unit that was not quiet is
measured again after a 20 s pause (at most ``--retakes`` times in a run) and the discarded
attempt's time leaves the run's figures; the record lists every retake and why. Units alternate
their arms, so dropping a whole unit favours no arm. ``--wait-idle S`` waits up to S seconds for a
quiet idle window before the run (and after it) instead of refusing at once.

    python -m benchmarks.idle --calibrate     # on an idle machine: store its idle bandwidth
    python -m benchmarks.idle                 # check now (10 s window), print the verdict
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]
BASELINE_DIR = ROOT / "benchmark_results"
CLK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
LABEL = "contended: not a result"
ALLOW_BUSY_HELP = ("write the record although the machine was not idle; it is labelled "
                   f"'{LABEL}'")
WINDOW_HELP = "seconds of the idle windows before and after the run (default 2)"
RETAKES_HELP = ("units of the run (an alternating pair, a round) measured again when the machine "
                "was not quiet during them, at most this many in the run (default 24; 0: none)")
RETAKE_PAUSE_S = 20.0  # idle seconds before a retake
WAIT_HELP = ("wait up to S seconds for a quiet idle window before the run and after it, instead "
             "of refusing at once (default 0)")


@dataclass(frozen=True)
class Limits:
    """Above these the machine was not idle (cores = CPU-seconds per second of wall time)."""
    others_mean_cores: float = 0.10  # other processes, averaged over the run
    others_peak_cores: float = 0.50  # other processes, in any sampled interval or idle window
    steal_mean_cores: float = 0.10   # the hypervisor gave our CPUs to someone else
    bandwidth_ratio: float = 0.75    # probe / this machine's idle figure, before or after


# ------------------------------------------------------------------------------ reading /proc


@dataclass
class Reading:
    """One snapshot: /proc/stat's cpu line (seconds), every process's CPU seconds, our tree."""
    t: float
    cpu: Dict[str, float]
    procs: Dict[int, Tuple[str, float, float]]  # pid -> (name, own CPU s, reaped children's)
    own: Set[int]
    loadavg: Tuple[float, float, float]
    running: int


CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
BUSY_FIELDS = ("user", "nice", "system", "irq", "softirq")  # guest time is inside user / nice


def parse_cpu_line(stat_text: str) -> Dict[str, float]:
    for line in stat_text.splitlines():
        if line.startswith("cpu "):
            vals = [int(v) for v in line.split()[1:1 + len(CPU_FIELDS)]]
            vals += [0] * (len(CPU_FIELDS) - len(vals))
            return {k: v / CLK for k, v in zip(CPU_FIELDS, vals)}
    raise ValueError("no 'cpu' line in /proc/stat")


def parse_pid_stat(text: str) -> Tuple[int, str, int, float, float]:
    """(pid, name, ppid, CPU seconds, reaped children's CPU seconds) of /proc/PID/stat:
    utime + stime (all its threads), cutime + cstime."""
    pid, rest = text.split(" (", 1)
    name, rest = rest.rsplit(") ", 1)
    f = rest.split()  # f[0] is field 3 (state)
    return (int(pid), name, int(f[1]), (int(f[11]) + int(f[12])) / CLK,
            (int(f[13]) + int(f[14])) / CLK)


def parse_loadavg(text: str) -> Tuple[Tuple[float, float, float], int]:
    f = text.split()
    return (float(f[0]), float(f[1]), float(f[2])), int(f[3].split("/")[0])


def tree(parents: Dict[int, int], root: int) -> Set[int]:
    """root and every process descended from it."""
    out, grew = {root}, True
    while grew:
        grew = False
        for pid, ppid in parents.items():
            if ppid in out and pid not in out:
                out.add(pid)
                grew = True
    return out


def read_proc(root: Optional[int] = None, proc: Path = Path("/proc")) -> Reading:
    procs, parents = {}, {}
    for d in os.listdir(proc):
        if not d.isdigit():
            continue
        try:
            pid, name, ppid, cpu, children = parse_pid_stat((proc / d / "stat").read_text())
        except (OSError, ValueError, IndexError):
            continue  # it exited while we looked
        procs[pid], parents[pid] = (name, cpu, children), ppid
    load, running = parse_loadavg((proc / "loadavg").read_text())
    return Reading(time.monotonic(), parse_cpu_line((proc / "stat").read_text()), procs,
                   tree(parents, os.getpid() if root is None else root), load, running)


def interval(a: Reading, b: Reading, top: int = 5) -> dict:
    """What the machine did between two readings, in cores (CPU-seconds per wall second)."""
    wall = max(b.t - a.t, 1e-9)
    busy = sum(b.cpu[k] - a.cpu[k] for k in BUSY_FIELDS)
    steal = b.cpu["steal"] - a.cpu["steal"]
    # Our own tree: a pid new since `a` counts whole; a child reaped in between is in its
    # parent's cutime / cstime (a slight over-count of what it used before `a`).
    own = sum(sum(b.procs[p][1:]) - (sum(a.procs[p][1:]) if p in a.procs else 0.0)
              for p in b.own if p in b.procs)
    others = max(busy - own, 0.0)
    # Named competitors: their own time only (a reaped child's whole life lands in cutime at once).
    comp = [(p, name, (cpu - a.procs[p][1]) / wall) for p, (name, cpu, _) in b.procs.items()
            if p not in b.own and p not in a.own and p in a.procs]
    comp = sorted((c for c in comp if c[2] >= 0.02), key=lambda c: -c[2])[:top]
    return {"wall_s": round(wall, 3), "others_cores": round(others / wall, 4),
            "steal_cores": round(max(steal, 0.0) / wall, 4), "own_cores": round(own / wall, 4),
            "competitors": [{"pid": p, "name": n, "cores": round(c, 3)} for p, n, c in comp]}


# ------------------------------------------------------------------------------ bandwidth


def bandwidth_probe(mb: int = 128, repeats: int = 5) -> float:
    """Streaming-read GB/s of one thread (numpy sum; best of ``repeats``)."""
    import numpy as np

    a = np.ones(mb * 2**20 // 4, dtype=np.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best / 1e9


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what ``platform`` knows of it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key() -> dict:
    return {"host": socket.gethostname(), "cpu": cpu_model(), "cores": os.cpu_count()}


def baseline_path(out: Path = BASELINE_DIR) -> Path:
    return out / f"idle-baseline-{socket.gethostname()}.json"


def idle_bandwidth(path: Optional[Path] = None) -> Optional[float]:
    """This machine's idle probe figure, if one was calibrated on the same CPU model and cores."""
    path = path or baseline_path()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data.get("bandwidth_gbs") if data.get("machine") == machine_key() else None


# ------------------------------------------------------------------------------ the decision


def _top(iv: dict) -> str:
    c = iv.get("competitors") or []
    return f" (top: {c[0]['name']}[{c[0]['pid']}] {c[0]['cores']:.2f})" if c else ""


def window_reasons(name: str, iv: dict, bw: Optional[float], idle_gbs: Optional[float],
                   limits: Limits = Limits()) -> List[str]:
    """Reasons from an idle window ``name`` ("before" / "after" the run) and its probe."""
    reasons = []
    if iv["others_cores"] > limits.others_peak_cores:
        reasons.append(f"other processes used {iv['others_cores']:.2f} cores {name} the run"
                       + _top(iv))
    return reasons + _low_bandwidth(f"{name} the run", bw, idle_gbs, limits)


def _low_bandwidth(when: str, bw: Optional[float], idle_gbs: Optional[float],
                   limits: Limits) -> List[str]:
    """The reason a probe ``bw`` taken ``when`` says the machine was busy, if it does."""
    if idle_gbs and bw is not None and bw < limits.bandwidth_ratio * idle_gbs:
        return [f"memory bandwidth {when} was {bw:.1f} GB/s, under "
                f"{limits.bandwidth_ratio:.0%} of this machine's idle {idle_gbs:.1f} GB/s"]
    return []


def unit_reasons(iv: dict, bw: Optional[float], idle_gbs: Optional[float],
                 limits: Limits = Limits(), peak: Optional[float] = None,
                 sample_s: float = 2.0) -> List[str]:
    """Reasons one unit of a run (``iv``: its ``interval()``; ``bw``: the probe after it; ``peak``:
    the busiest sampled interval inside it) was not quiet (empty: keep it): the run's limits,
    mean and peak, applied to the unit alone, so a burst too short to move the unit's mean is
    retaken here rather than failing the whole run at the end."""
    reasons = []
    if iv["others_cores"] > limits.others_mean_cores:
        reasons.append(f"other processes used {iv['others_cores']:.2f} cores" + _top(iv))
    if peak is not None and peak > limits.others_peak_cores:
        reasons.append(f"other processes used {peak:.2f} cores in a {sample_s:g} s interval")
    if iv["steal_cores"] > limits.steal_mean_cores:
        reasons.append(f"the hypervisor stole {iv['steal_cores']:.2f} cores")
    return reasons + _low_bandwidth("after it", bw, idle_gbs, limits)


def without(total: dict, dropped: List[dict]) -> dict:
    """``total`` (an ``interval()`` of the run) less the ``dropped`` intervals inside it: the
    cores averaged over the time that remains."""
    wall = total["wall_s"] - sum(d["wall_s"] for d in dropped)
    if wall <= 0:
        return {**total, "wall_s": 0.0}
    out = {**total, "wall_s": round(wall, 3)}
    for k in ("others_cores", "steal_cores", "own_cores"):
        used = total[k] * total["wall_s"] - sum(d[k] * d["wall_s"] for d in dropped)
        out[k] = round(max(used, 0.0) / wall, 4)
    return out


def decide(before: dict, during: dict, after: dict, bw_before: Optional[float],
           bw_after: Optional[float], idle_gbs: Optional[float],
           limits: Limits = Limits()) -> List[str]:
    """Reasons the machine was not idle (empty: idle). ``before`` / ``after`` are ``interval()``s
    of the idle windows; ``during`` has the run's ``interval()`` under "total" (and, where units
    were retaken, the run without the discarded attempts under "kept", which is then judged) and
    the sampled intervals' ``others_cores`` under "samples"."""
    reasons = []
    total = during.get("kept") or during["total"]
    if total["others_cores"] > limits.others_mean_cores:
        reasons.append(f"other processes used {total['others_cores']:.2f} cores on average during "
                       f"the run{_top(total)}")
    peak = max(during.get("samples") or [0.0])
    if peak > limits.others_peak_cores:
        reasons.append(f"other processes used {peak:.2f} cores in a {during['sample_s']:g} s "
                       "interval of the run")
    if total["steal_cores"] > limits.steal_mean_cores:
        reasons.append(f"the hypervisor stole {total['steal_cores']:.2f} cores during the run")
    return (window_reasons("before", before, bw_before, idle_gbs, limits) + reasons
            + window_reasons("after", after, bw_after, idle_gbs, limits))


# ------------------------------------------------------------------------------ the watch


class Watch:
    """Start before the run (idle window + bandwidth probe, then a sampler thread), ``finish()``
    after it (bandwidth probe + idle window): the record's ``idle_check`` dict."""

    def __init__(self, window_s: float = 2.0, allow_busy: bool = False, sample_s: float = 2.0,
                 limits: Limits = Limits(), probe: bool = True, baseline: Optional[Path] = None,
                 retakes: int = 0, wait_s: float = 0.0):
        self.window_s, self.sample_s, self.limits, self.probe = window_s, sample_s, limits, probe
        self.allow_busy, self.retakes, self.wait_s = allow_busy, retakes, wait_s
        self.idle_gbs = idle_bandwidth(baseline)
        self.waits: List[dict] = []  # idle windows that were not quiet, waited out
        self.before, b, self.bw_before, early = self._window("before")
        self.load_before = {"loadavg": list(b.loadavg), "running": b.running}
        if early and not allow_busy:  # no point running: refuse now
            settle({"verdict": "contended", "reasons": early}, allow_busy=False)
        self.units: List[dict] = []  # every unit judged (``unit``), retaken or kept
        self._dropped: List[Tuple[float, float, dict]] = []  # (start, end, interval) retaken
        self.samples: List[Tuple[float, float, float]] = []  # (start, end, others' cores)
        self._stop = threading.Event()
        self._start = read_proc()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _window(self, name: str):
        """An idle window and its probe; while not quiet, again every 15 s for up to ``wait_s``
        seconds: (interval, last reading, probe GB/s, reasons of the last window)."""
        deadline = time.monotonic() + self.wait_s
        while True:
            a = read_proc()
            time.sleep(self.window_s)
            b = read_proc()
            iv = interval(a, b)
            bw = bandwidth_probe() if self.probe else None
            reasons = window_reasons(name, iv, bw, self.idle_gbs, self.limits)
            if not reasons or self.allow_busy or time.monotonic() >= deadline:
                return iv, b, bw, reasons
            self.waits.append({"window": name, "reasons": reasons})
            print(f"waiting for an idle machine ({'; '.join(reasons)})", flush=True)
            time.sleep(min(15.0, max(deadline - time.monotonic(), 0.0)))

    def unit(self, label: str, measure):
        """``measure()`` as one unit of the run, judged on its own (``unit_reasons``): one that
        was not quiet is measured again while the run has retakes left (``--retakes``), and the
        discarded attempt's time leaves the run's figures (never with ``--allow-busy``, which
        keeps everything). Returns the kept attempt's result."""
        while True:
            a = read_proc()
            out = measure()
            b = read_proc()
            iv = interval(a, b, top=3)
            bw = bandwidth_probe() if self.probe else None
            reasons = unit_reasons(iv, bw, self.idle_gbs, self.limits,
                                   self._peak_within(a.t, b.t), self.sample_s)
            retake = bool(reasons) and not self.allow_busy and self.retakes > 0
            self.units.append({"unit": label, "wall_s": iv["wall_s"],
                               "others_cores": iv["others_cores"],
                               "steal_cores": iv["steal_cores"], "bandwidth_gbs": bw,
                               "reasons": reasons, "retaken": retake})
            if not retake:
                return out
            self.retakes -= 1
            print(f"retaking {label} in {RETAKE_PAUSE_S:g} s: {'; '.join(reasons)}", flush=True)
            time.sleep(RETAKE_PAUSE_S)  # a busy stretch lasts minutes: let it pass, not the budget
            c = read_proc()  # the pause is dropped with the attempt (its idle time would dilute)
            self._dropped.append((a.t, c.t, interval(a, c, top=0)))

    @staticmethod
    def runner(watch: Optional["Watch"]):
        """``watch.unit``, or with no watch (a run that writes no record) a plain call."""
        return watch.unit if watch is not None else (lambda label, measure: measure())

    def _sample(self):
        last = self._start
        while not self._stop.wait(self.sample_s):
            now = read_proc()
            self.samples.append((last.t, now.t, interval(last, now, top=0)["others_cores"]))
            last = now

    def _peak_within(self, t0: float, t1: float) -> Optional[float]:
        """Others' cores in the busiest sampled interval mostly inside ``[t0, t1]`` (None: none)."""
        inside = [v for s, e, v in list(self.samples)
                  if max(0.0, min(t1, e) - max(t0, s)) > 0.5 * (e - s)]
        return max(inside) if inside else None

    def _kept_samples(self) -> List[float]:
        """The sampled intervals less those mostly inside a retaken unit's attempt."""
        def dropped(t0, t1):
            inside = sum(max(0.0, min(t1, e) - max(t0, s)) for s, e, _ in self._dropped)
            return inside > 0.5 * (t1 - t0)
        return [v for t0, t1, v in self.samples if not dropped(t0, t1)]

    def finish(self) -> dict:
        self._stop.set()
        self._thread.join()
        end = read_proc()
        total = interval(self._start, end)
        after, b, bw_after, _ = self._window("after")
        during = {"total": total, "sample_s": self.sample_s,
                  "samples": [round(s, 3) for s in self._kept_samples()],
                  "units": self.units, "retaken": len(self._dropped)}
        if self._dropped:
            during["kept"] = without(total, [iv for _, _, iv in self._dropped])
        reasons = decide(self.before, during, after, self.bw_before, bw_after, self.idle_gbs,
                         self.limits)
        return {
            "verdict": "contended" if reasons else "idle", "reasons": reasons,
            "limits": asdict(self.limits),
            "before": {**self.before, **self.load_before, "bandwidth_gbs": self.bw_before},
            "during": during,
            "after": {**after, "loadavg": list(b.loadavg), "running": b.running,
                      "bandwidth_gbs": bw_after},
            "idle_bandwidth_gbs": self.idle_gbs,
            "waits": self.waits,
        }


def settle(check: dict, allow_busy: bool) -> dict:
    """Refuse (exit 1, one line) when the machine was not idle, unless ``allow_busy``: then the
    check is labelled and the record goes out as 'contended: not a result'."""
    if check["verdict"] == "idle":
        return check
    if not allow_busy:
        sys.exit(f"error: the machine was not idle: {'; '.join(check['reasons'])}. No record "
                 "written; rerun on an idle machine (or pass --allow-busy to keep it, labelled "
                 f"'{LABEL}')")
    check["label"] = LABEL
    return check


def attach(result: dict, watch: "Watch", allow_busy: bool) -> dict:
    """Finish ``watch``, refuse or label (``settle``), and put the check into ``result``."""
    check = settle(watch.finish(), allow_busy)
    result["idle_check"] = check
    if "label" in check:
        result["label"] = check["label"]
    return result


def is_contended(result: dict) -> bool:
    return (result.get("idle_check") or {}).get("verdict") == "contended"


def markdown(check: Optional[dict]) -> List[str]:
    """The record's '## Idle check' section."""
    if not check:
        return ["## Idle check", "", "- not checked (a record from before the idle check)", ""]
    lim = check["limits"]
    d = check["during"]["total"]
    samples = check["during"]["samples"]

    def window(name, w):
        bw = f", probe {w['bandwidth_gbs']:.1f} GB/s" if w.get("bandwidth_gbs") else ""
        comp = ", ".join(f"{c['name']}[{c['pid']}] {c['cores']:.2f}" for c in w["competitors"])
        return (f"- {name} ({w['wall_s']:.0f} s): others {w['others_cores']:.2f} cores, steal "
                f"{w['steal_cores']:.2f}; load average {w['loadavg'][0]:.2f}, "
                f"{w['running']} running{bw}" + (f"; top: {comp}" if comp else ""))

    comp = ", ".join(f"{c['name']}[{c['pid']}] {c['cores']:.2f}" for c in d["competitors"])
    idle = check.get("idle_bandwidth_gbs")
    lines = [
        "## Idle check", "",
        f"- Verdict: **{check['verdict']}**" + (f" ({LABEL}): " + "; ".join(check["reasons"])
                                                if check["verdict"] != "idle" else ""),
        window("Before", check["before"]),
        f"- During ({d['wall_s']:.0f} s): others {d['others_cores']:.2f} cores on average, at most "
        f"{max(samples or [0.0]):.2f} in a {check['during']['sample_s']:g} s interval "
        f"({len(samples)} intervals); steal {d['steal_cores']:.2f}; this run "
        f"{d['own_cores']:.2f} cores" + (f"; top others: {comp}" if comp else ""),
        *_retake_lines(check),
        window("After", check["after"]),
        f"- Idle figure: {f'{idle:.1f} GB/s' if idle else 'none for this machine (not compared)'}; "
        f"limits: others {lim['others_mean_cores']} cores mean / {lim['others_peak_cores']} peak, "
        f"steal {lim['steal_mean_cores']}, bandwidth >= {lim['bandwidth_ratio']:.0%} of idle",
        "",
    ]
    return lines


def _retake_lines(check: dict) -> List[str]:
    """The units retaken and the idle windows waited out, if any (records before these had
    neither)."""
    during = check["during"]
    units = during.get("units") or []
    lines = []
    if units:
        retaken = [u for u in units if u["retaken"]]
        lines.append(f"- Units judged on their own: {len(units) - len(retaken)} kept, "
                     f"{len(retaken)} retaken (not quiet: measured again, the attempt dropped)")
        lines += [f"  - retaken: {u['unit']} ({u['wall_s']:.0f} s): {'; '.join(u['reasons'])}"
                  for u in retaken]
        unquiet_kept = [u for u in units if u["reasons"] and not u["retaken"]]
        lines += [f"  - kept although not quiet (no retakes left, or --allow-busy): {u['unit']}: "
                  f"{'; '.join(u['reasons'])}" for u in unquiet_kept]
    kept = during.get("kept")
    if kept:
        lines.append(f"- During, without the retaken attempts ({kept['wall_s']:.0f} s): others "
                     f"{kept['others_cores']:.2f} cores on average; steal {kept['steal_cores']:.2f}"
                     " (what the verdict judges)")
    lines += [f"- Waited for an idle machine {w['window']} the run: {'; '.join(w['reasons'])}"
              for w in check.get("waits") or []]
    return lines


def annotate(md: str, check: Optional[dict]) -> str:
    """A rendered record with the idle check in it: a label under the title when contended, and
    the '## Idle check' section before '## What it says' (or at the end)."""
    lines = md.split("\n")
    if check and check["verdict"] != "idle":
        lines[1:1] = ["", f"**{LABEL.upper()}**: {'; '.join(check['reasons'])}"]
    section = markdown(check)
    at = next((i for i, line in enumerate(lines) if line.startswith("## What it says")), len(lines))
    lines[at:at] = section
    return "\n".join(lines)


# ------------------------------------------------------------------------------ the CLI


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calibrate", action="store_true",
                   help=f"store this idle machine's bandwidth figure in {baseline_path()}")
    p.add_argument("--seconds", type=float, default=10.0, help="how long to watch")
    p.add_argument("--out", type=Path, default=BASELINE_DIR)
    args = p.parse_args(argv)
    watch = Watch(window_s=1.0, allow_busy=True, baseline=baseline_path(args.out))
    probes = [bandwidth_probe() for _ in range(3)] if args.calibrate else []
    time.sleep(max(args.seconds - 2.0, 0.0))
    check = watch.finish()
    print(json.dumps({k: check[k] for k in ("verdict", "reasons")}, indent=1))
    if not args.calibrate:
        return 0 if check["verdict"] == "idle" else 1
    bws = probes + [check["before"]["bandwidth_gbs"], check["after"]["bandwidth_gbs"]]
    # The idle-ness of the calibration itself is judged without a bandwidth figure.
    reasons = decide(check["before"], check["during"], check["after"], None, None, None)
    if reasons:
        sys.exit("error: the machine is not idle, so its idle bandwidth cannot be measured now: "
                 + "; ".join(reasons))
    path = baseline_path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine_key(), "bandwidth_gbs": max(bws),
                                "probes_gbs": bws, "date": time.strftime("%Y-%m-%d")}, indent=1))
    print(f"wrote {path}: idle bandwidth {max(bws):.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
