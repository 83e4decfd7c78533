"""Where a drafter step's time goes, stage by stage.

MLX is lazy: an unforced timer around a stage measures graph building, and the whole step lands
wherever the first evaluation happens. So the split is opt-in: ``MLX_MTP_DRAFT_PROFILE=1`` makes
the drafter evaluate after every stage of a step (ids: id upload + embedding; layers: the head's
norms, fc, decoder layer(s), final norm; lm_head: the projection, or projection + argmax when
fused; sample: argmax / sampler; readback: the drafted id's trip to the host, which only happens
with device ids off). The syncs break pipelining, so the profiled step is slower than the real
one: quote the unprofiled ``step_ms`` (draft phase wall / steps) as the cost and the profiled
split only for attribution. Without the variable only the per-step total is reported and the
split is ``unattributed``.

The accept hook (consume the verified pairs, compute the next round's first draft) is a second
head forward per round; it is reported on its own, with the same stages when profiled.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Dict, Optional

import mlx.core as mx

from mlx_mtp import config as env

PROFILE_ENV = "MLX_MTP_DRAFT_PROFILE"
STAGES = ("ids", "layers", "lm_head", "sample", "readback")
ACCEPT_STAGES = ("ids", "layers", "lm_head", "sample")


class _Bucket:
    def __init__(self):
        self.count = 0
        self.wall = 0.0
        self.stage_s: Dict[str, float] = {s: 0.0 for s in STAGES}


class DraftProfiler:
    """Per-stage timers for a drafter. ``synchronized`` False: stages are not timed (nothing is
    forced), only steps are counted."""

    def __init__(self, synchronized: bool = False):
        self.synchronized = synchronized
        self.buckets = {"draft": _Bucket(), "accept": _Bucket()}
        self._active: Optional[_Bucket] = None
        self._t = 0.0

    @contextmanager
    def step(self, bucket: str):
        """One drafter step (``draft``) or one accept hook (``accept``)."""
        b = self.buckets[bucket]
        b.count += 1
        if not self.synchronized:
            yield
            return
        self._active, t0 = b, time.perf_counter()
        self._t = t0
        try:
            yield
        finally:
            b.wall += time.perf_counter() - t0
            self._active = None

    def stage(self, name: str, *arrays) -> None:
        """End stage ``name`` of the current step: evaluate its output, charge the time since the
        previous stage ended. A no-op unless synchronized and inside a step."""
        b = self._active
        if b is None:
            return
        if arrays:
            mx.eval(*arrays)
        now = time.perf_counter()
        b.stage_s[name] += now - self._t
        self._t = now

    def report(self, phase_s: Dict[str, float], rounds: int) -> dict:
        """``draft_profile``: per-step ms of each stage (profiled) and the step total; the accept
        hook's ms per call. ``phase_s`` are the round loop's phase walls (unprofiled totals)."""
        d, a = self.buckets["draft"], self.buckets["accept"]
        out = {"synchronized": self.synchronized, "steps": d.count, "rounds": rounds,
               # the draft phase's wall per step: the cost (with syncs when synchronized)
               "phase_step_ms": 1e3 * phase_s.get("draft", 0.0) / d.count if d.count else None}
        out.update(_split(d, STAGES, self.synchronized, phase_s.get("draft", 0.0)))
        accept = {"calls": a.count}
        accept.update(_split(a, ACCEPT_STAGES, self.synchronized, phase_s.get("accept", 0.0)))
        out["accept"] = accept
        return out


def _split(b: _Bucket, stages, synchronized: bool, phase_s: float) -> dict:
    n = b.count
    if not synchronized:
        out = {f"{s}_ms": None for s in stages}
        out["step_ms"] = 1e3 * phase_s / n if n else None
        out["dominant"] = "unattributed"
        return out
    out = {f"{s}_ms": 1e3 * b.stage_s[s] / n if n else None for s in stages}
    out["step_ms"] = 1e3 * b.wall / n if n else None
    out["dominant"] = max(stages, key=lambda s: b.stage_s[s]) if n else None
    return out


def attach(drafter) -> DraftProfiler:
    """A profiler for this run, installed on ``drafter`` when it can be profiled (it has a
    ``profiler``). ``MLX_MTP_DRAFT_PROFILE`` decides whether stages are forced."""
    wanted = env.flag(PROFILE_ENV)
    can = drafter is not None and drafter.profiler is not None
    profiler = DraftProfiler(synchronized=wanted and can)
    if can:
        drafter.profiler = profiler
    return profiler


def profile_rows(profile: Optional[dict]) -> list:
    """Rows for the CLI's stats table."""
    rows = []
    if not profile:
        return rows
    for what, p, stages in (("drafter step", profile, STAGES),
                            ("accept hook", profile["accept"], ACCEPT_STAGES)):
        n = p.get("steps", p.get("calls"))
        if not n:
            continue
        rows.append((f"{what} ms ({n}x)", f"{p['step_ms']:.2f}"))
        split = ("unattributed (MLX_MTP_DRAFT_PROFILE=1 splits it)" if p["dominant"] == "unattributed"
                 else " / ".join(f"{s} {p[s + '_ms']:.2f}" for s in stages))
        rows.append((f"{what} split (ms)", split))
    return rows
