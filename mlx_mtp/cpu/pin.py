"""Run a verify with every thread of the process on one CPU core (Linux, CPU backend).

A verify that uses the eager C kernels (``mlx_mtp.cpu.row_kernel``,
``mlx_mtp.models.qwen3_5.gdn_kernel``) hands its input from MLX's CPU stream thread to the Python
thread and back dozens of times (one host sync per distinct kernel input), while a plain decode
step makes one such sync. Between threads on two cores each hand-off wakes the other core (an
inter-processor interrupt; expensive in a VM), several times dearer than a hand-off on one core.
Once such a verify has made its first kernel call, the Python thread mostly waits for the stream
thread, so putting them on one core costs little parallel work; pinning earlier (from the start
of the verify) would keep the queued draft and accept hook from computing on another core while
Python builds the verify graph. So the loop pins at a verify's first kernel call
(``on_first_sync`` / ``hold``) and undoes it after the verify.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Dict, Optional, Set

from mlx_mtp import config as env

ENV = "MLX_MTP_PIN_VERIFY"  # 0 = never pin


def _threads():
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return []


def current_cpu() -> Optional[int]:
    """The core the calling thread runs on now (field 39 of /proc/thread-self/stat), or None."""
    try:
        with open("/proc/thread-self/stat") as f:
            stat = f.read()
        return int(stat[stat.rindex(")") + 2 :].split()[36])
    except (OSError, ValueError, IndexError):
        return None


def enabled(environ=None) -> bool:
    """Pinning is possible here (Linux affinity calls) and not switched off (``MLX_MTP_PIN_VERIFY=0``)."""
    return hasattr(os, "sched_setaffinity") and env.flag(ENV, environ)


def _pin() -> Dict[int, Set[int]]:
    """Every thread of the process on the caller's core; returns each changed thread's mask
    (empty when nothing was pinned)."""
    cpu = current_cpu()
    saved: Dict[int, Set[int]] = {}
    if cpu is None:
        return saved
    for tid in _threads():
        try:
            mask = os.sched_getaffinity(tid)
            if cpu in mask and len(mask) > 1:
                saved[tid] = mask
                os.sched_setaffinity(tid, {cpu})
        except OSError:  # the thread ended meanwhile, or we may not change it: leave it
            pass
    return saved


def _restore(saved: Dict[int, Set[int]]) -> None:
    """Each thread's mask back; threads started while pinned get the caller's."""
    if not saved:
        return
    caller = saved.get(threading.get_native_id())
    for tid in _threads():
        mask = saved.get(tid, caller)
        if mask is None:
            continue
        try:
            if os.sched_getaffinity(tid) != mask:
                os.sched_setaffinity(tid, mask)
        except OSError:
            pass


@contextmanager
def one_core():
    """Every thread of the process on the core the caller runs on, for the body; each thread's
    own affinity back afterwards (threads started inside the body get the caller's)."""
    saved = _pin() if enabled() else {}
    try:
        yield
    finally:
        _restore(saved)


# The open ``on_first_sync`` body's state (one generation at a time); module state because
# ``hold`` is called from inside the kernels, which are handed no generation.
_armed: Optional[dict] = None


@contextmanager
def on_first_sync():
    """``one_core`` from the body's first eager kernel call (``hold``) to the body's end; nothing
    where the body makes none. Until that call the work queued before the body (draft, accept
    hook) computes on another core while Python builds the graph; the call waits for all of it."""
    global _armed
    if not enabled():
        yield
        return
    state, outer = {"saved": None}, _armed
    _armed = state
    try:
        yield
    finally:
        _armed = outer
        if state["saved"]:
            _restore(state["saved"])


def hold() -> None:
    """Called by an eager C kernel before it syncs: pin now if an ``on_first_sync`` body is open
    and has not pinned yet."""
    if _armed is not None and _armed["saved"] is None:
        _armed["saved"] = _pin()
