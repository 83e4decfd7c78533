"""A target split across processes with ``mx.distributed`` (started by ``mlx.launch``), by
mlx-lm's own ``pipeline`` or ``shard``. Every rank keeps the embeddings, final norm, LM head and
its own MTP head, so only the target's forward crosses ranks. ``Split.step`` and ``guard`` turn
a lost peer into one ``SplitFailed`` line, and a watchdog ends a rank whose step waits longer
than ``timeout_s``. docs/server.md, "One target over several machines"."""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional

import mlx.core as mx
import numpy as np

from mlx_mtp import config
from mlx_mtp.errors import MTPError

SPLITS = ("pipeline", "tensor")
TIMEOUT_ENV = "MLX_MTP_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = config.setting(TIMEOUT_ENV).default  # 120 s
CACHE_LOG_ENV = "MLX_MTP_DIST_CACHE_LOG"  # test hook: per-round cache hashes, one file per rank
WATCHDOG_EXIT = 3
_BACKEND_PREFIXES = ("[ring]", "[mpi]", "[jaccl]", "[nccl]")  # mx.distributed's error messages


class SplitFailed(MTPError):
    """Another rank died: this split cannot go on (a server stops, not just the request)."""


def timeout_from_env(environ=None) -> float:
    return config.seconds(TIMEOUT_ENV, environ)


class CollectiveCounter:
    """Counts the collectives this rank adds to its graphs and their payload bytes (the array
    each one is given: what this rank puts on the wire). Counted when the op is built, so no
    sync; installed on ``mx.distributed`` (mlx-lm and ``mlx.nn`` look the functions up there)."""

    NAMES = ("all_sum", "all_gather", "send", "recv_like", "recv", "all_max", "all_min",
             "sum_scatter")

    def __init__(self):
        self.messages = 0
        self.bytes = 0
        self._installed = False

    def install(self) -> None:
        if self._installed or getattr(mx.distributed, "_mlx_mtp_counted", False):
            return
        for name in self.NAMES:
            fn = getattr(mx.distributed, name, None)
            if fn is not None:
                setattr(mx.distributed, name, self._wrap(name, fn))
        mx.distributed._mlx_mtp_counted = True
        self._installed = True

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            out = fn(*args, **kwargs)
            payload = out if name in ("recv", "recv_like") else args[0] if args else kwargs["x"]
            self.messages += 1
            self.bytes += payload.nbytes
            return out
        counted.__wrapped__ = fn
        return counted

    def snapshot(self):
        return self.messages, self.bytes


@dataclass
class Split:
    kind: str  # "pipeline" or "tensor"
    group: object  # mx.distributed.Group
    timeout_s: float = DEFAULT_TIMEOUT_S
    counter: CollectiveCounter = field(default_factory=CollectiveCounter)
    cache_log: Optional[str] = None
    # Called by the watchdog with its message before it ends the process (a server answers the
    # requests it holds); must return within a few seconds.
    on_stall: Optional[Callable[[str], None]] = None
    _dog: Optional["_Watchdog"] = field(default=None, repr=False)

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    def describe(self) -> str:
        return f"{self.kind} over {self.size} ranks"

    @contextmanager
    def step(self, what: str):
        """A step every rank must take together, bounded by ``timeout_s``; a lost peer is one
        ``SplitFailed`` line. Steps may nest (the outer one stays bounded from its start)."""
        if self._dog is None:
            self._dog = _Watchdog(self)
        self._dog.arm(what)
        try:
            yield
        except RuntimeError as e:  # the backend saw a peer go: one clear line
            if not str(e).startswith(_BACKEND_PREFIXES):
                raise
            raise SplitFailed(f"rank {self.rank} of {self.size} ({self.kind} split): "
                              f"{what} failed, another rank died ({e})") from None
        finally:
            self._dog.disarm()

    def guard(self, steps: Iterator, what: str = "generation") -> Iterator:
        """``steps`` with every ``next`` a ``step`` (see the module doc), and its close too
        (``steps`` is closed when this generator is)."""
        try:
            while True:
                with self.step(what):
                    try:
                        item = next(steps)
                    except StopIteration:
                        return
                yield item
        finally:
            if hasattr(steps, "close"):
                with self.step(what):
                    steps.close()

    def barrier(self, what: str) -> None:
        """One all-sum every rank must reach, bounded by the watchdog."""
        with self.step(what):
            mx.eval(mx.distributed.all_sum(mx.array(1.0), group=self.group, stream=mx.cpu))

    def from_rank0(self, value: int) -> int:
        """Rank 0's ``value`` on every rank (one all-sum): for choices a rank makes from its own
        timings, such as ``--block-size auto``'s drafts per round, which all ranks must share."""
        mine = mx.array(value if self.rank == 0 else 0)
        return int(mx.distributed.all_sum(mine, group=self.group, stream=mx.cpu).item())

    def shared_seed(self) -> int:
        """A seed drawn on rank 0 and given to every rank: sampling at temperature > 0 must draw
        the same tokens on every rank (each rank feeds its own draw to its layers)."""
        return self.from_rank0(mx.random.randint(0, 2**31 - 1).item() if self.rank == 0 else 0)

    def bytes_from_rank0(self, data: bytes = b"") -> bytes:
        """Rank 0's ``data`` on every rank (the others pass nothing): its length, then its bytes
        as int32 words summed with the others' zeros (exact), two all-sums."""
        n = self.from_rank0(len(data))
        if n == 0:
            return b""
        words = (n + 3) // 4
        mine = (np.frombuffer(data.ljust(4 * words, b"\0"), np.int32) if self.rank == 0
                else np.zeros(words, np.int32))
        out = mx.distributed.all_sum(mx.array(mine), group=self.group, stream=mx.cpu)
        return np.array(out, dtype=np.int32).tobytes()[:n]

    def log_cache(self, target, cache, committed: int) -> None:
        """Test hook (``MLX_MTP_DIST_CACHE_LOG``): append ``committed <sha256 of this rank's
        cache state>`` after each round."""
        if not self.cache_log:
            return
        h = hashlib.sha256()
        for a in target.cache_state(cache):
            h.update(np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a).tobytes())
        with open(f"{self.cache_log}.rank{self.rank}", "a") as f:
            f.write(f"{committed} {h.hexdigest()}\n")


class _Watchdog:
    """One daemon thread per split, armed around each step (a stack: steps may nest)."""

    def __init__(self, split: Split):
        self.split = split
        self.armed: List[tuple] = []  # (deadline, what), innermost last
        self.thread = threading.Thread(target=self._run, name="mlx_mtp-split-watchdog",
                                       daemon=True)
        self.thread.start()

    def arm(self, what: str):
        self.armed.append((time.monotonic() + self.split.timeout_s, what))

    def disarm(self):
        self.armed.pop()

    def _run(self):
        while True:
            time.sleep(0.2)
            armed = list(self.armed)
            late = [what for deadline, what in armed if time.monotonic() > deadline]
            if late:
                s = self.split
                message = (f"rank {s.rank} of {s.size} ({s.kind} split): no progress in "
                           f"{late[0]} for {s.timeout_s:g} s: another rank died or hangs "
                           f"(set {TIMEOUT_ENV} to wait longer)")
                sys.stderr.write(f"error: {message}\n")
                sys.stderr.flush()
                if s.on_stall is not None:
                    try:
                        s.on_stall(message)
                    except BaseException:  # ending the process matters more
                        pass
                # os._exit: a thread stuck in a collective cannot be interrupted otherwise (a
                # rank that hangs keeps its sockets open, so no peer-lost error comes)
                os._exit(WATCHDOG_EXIT)


def init_split(kind: str, timeout_s: Optional[float] = None,
               program: str = "mlx_mtp.generate") -> Split:
    """The process group this process was launched into, for a ``kind`` split (``program``:
    the module the error line's example launches)."""
    if kind not in SPLITS:
        raise MTPError(f"split must be one of {', '.join(SPLITS)}, got {kind!r}")
    if not mx.distributed.is_available():
        raise MTPError(f"--split {kind}: this MLX build has no distributed backend")
    group = mx.distributed.init()
    if group.size() < 2:
        raise MTPError(f"--split {kind} needs 2 or more processes: start it with mlx.launch "
                       f"(e.g. mlx.launch --backend ring -n 2 -- python -m {program} ...)")
    split = Split(kind, group, timeout_s if timeout_s is not None else timeout_from_env(),
                  cache_log=config.path(CACHE_LOG_ENV))
    split.counter.install()
    return split


def shard_model(model, split: Split, source: str) -> None:
    """Split mlx-lm's (lazily loaded) ``model`` with its own method, as ``sharded_load`` does."""
    lm = model.language_model if hasattr(model, "language_model") else model
    if split.kind == "pipeline":
        if not hasattr(lm.model, "pipeline"):
            raise MTPError(f"{source}: mlx-lm cannot split {lm.model_type if hasattr(lm, 'model_type') else type(model).__name__} "
                           "by pipeline (its model has no pipeline method)")
        n = len(lm.model.layers)
        if n < split.size:
            raise MTPError(f"{source}: {n} layers cannot be split over {split.size} ranks")
        lm.model.pipeline(split.group)
    else:
        if not hasattr(model, "shard"):
            raise MTPError(f"{source}: mlx-lm cannot split this model by tensor (no shard method)")
        try:
            model.shard(split.group)
        except AssertionError as e:  # mlx-lm asserts divisibility
            raise MTPError(f"{source}: mlx-lm cannot tensor-split it over {split.size} ranks "
                           f"({e})") from None

