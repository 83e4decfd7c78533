"""Run a verify with every thread of the process on one CPU core (Linux, CPU backend).

A verify that uses the eager C kernels (``row_kernel``, ``gdn_kernel``) hands its input from
MLX's CPU stream thread to the Python thread and back about 60 times (one host sync per distinct
kernel input). Between threads on two cores each hand-off wakes the other core (an
inter-processor interrupt; expensive in a VM): measured on a 2-core x86 VM, an ``mx.eval`` of one
small op took 118 us with the threads free to run anywhere and 33 us with both on one core,
while a plain decode step makes one such sync. During such a verify the Python thread only waits
for the stream thread, so putting them on one core costs no parallel work; it is undone after
the verify, so that drafting and the next round's graph building overlap again.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Dict, Optional, Set

from . import env

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
    return hasattr(os, "sched_setaffinity") and env.flag(ENV, default=True, environ=environ)


@contextmanager
def one_core():
    """Every thread of the process on the core the caller runs on, for the body; each thread's
    own affinity back afterwards (threads started inside the body get the caller's)."""
    cpu = current_cpu() if enabled() else None
    if cpu is None:
        yield
        return
    saved: Dict[int, Set[int]] = {}
    for tid in _threads():
        try:
            saved[tid] = os.sched_getaffinity(tid)
            if cpu in saved[tid] and len(saved[tid]) > 1:
                os.sched_setaffinity(tid, {cpu})
        except OSError:  # the thread ended meanwhile, or we may not change it: leave it
            saved.pop(tid, None)
    try:
        yield
    finally:
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
