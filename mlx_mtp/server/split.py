"""The server on a target split over processes (``--split``, started by ``mlx.launch``): rank 0
serves HTTP and sends each request (prompt ids and settings; with a prompt cache, where to keep
checkpoints and which entries rank 0 keeps) to the other ranks, which follow it in lockstep
(``follow``) and keep the same prompt cache entries; ``SharedStop`` shares an early stop after
each forward, and an idle rank 0 sends heartbeats. A lost or stalled rank fails the waiting
requests with an error response, then ends the launch. docs/server.md, "One target over
several machines"."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import signal
import sys
import time
from typing import Callable, List, Optional

import mlx.core as mx

from mlx_mtp import MTPError
from mlx_mtp.models.distributed import Split, SplitFailed

from mlx_mtp.server.engine import Engine
from mlx_mtp.server.schema import GenerationRequest
from mlx_mtp.server.worker import Job, ServerError, Worker

logger = logging.getLogger("mlx_mtp.server")

FATAL_GRACE_S = 2.0  # rank 0 answers its clients before it ends


class SharedStop:
    """Rank 0's ``stop()`` on every rank. ``Engine.generate`` asks after every token; an answer
    only matters before the next forward, so ranks exchange one only when a collective (a
    forward) was built since the last exchange: the same tokens on every rank, since every rank
    runs the same loop."""

    def __init__(self, split: Split, stop: Callable[[], bool]):
        self.split, self.stop = split, stop
        self.seen = split.counter.messages

    def __call__(self) -> bool:
        if self.split.counter.messages == self.seen:
            return False
        with self.split.step("generation"):
            mine = int(self.split.rank == 0 and self.stop())
            stopped = bool(self.split.from_rank0(mine))
        self.seen = self.split.counter.messages
        return stopped


def _send(split: Split, message: dict) -> None:
    with split.step(f"sending rank 0's {message['kind']}"):
        split.bytes_from_rank0(json.dumps(message).encode())


def _receive(split: Split) -> dict:
    with split.step("waiting for rank 0"):
        return json.loads(split.bytes_from_rank0())


class SplitWorker(Worker):
    """Rank 0's decode thread: each request goes to the other ranks before it runs."""

    fatal = (SplitFailed,)

    def __init__(self, make_engine: Callable[[], Engine], max_queue: int, max_batch: int = 1,
                 prompt_cache_bytes: int = 0):
        # a split target decodes one request at a time (``Engine.start_batch`` says so)
        super().__init__(self._make_engine_watched, max_queue, max_batch, prompt_cache_bytes)
        self._make_split_engine = make_engine
        self._sent = time.monotonic()
        self.failed: Optional[str] = None

    @property
    def split(self) -> Split:
        return self.engine.model.split

    @property
    def alive(self) -> bool:
        return super().alive and self.failed is None

    def _make_engine_watched(self) -> Engine:
        engine = self._make_split_engine()
        engine.model.split.on_stall = self.fail_all  # a stalled rank: answer, then the dog exits
        return engine

    def _send(self, message: dict) -> None:
        try:
            _send(self.split, message)
        except SplitFailed as e:
            self._end(str(e))
        self._sent = time.monotonic()

    def _next_job(self) -> Optional[Job]:
        beat = self.split.timeout_s / 4
        while True:
            try:
                job = self._jobs.get(timeout=max(0.0, self._sent + beat - time.monotonic()))
            except queue.Empty:
                self._send({"kind": "heartbeat"})
                continue
            if job is None:
                self._send({"kind": "shutdown"})
            return job

    def _events(self, request: GenerationRequest, ids: List[int], stop: Callable[[], bool]):
        if request.temperature > 0 and request.seed is None:  # every rank must draw alike
            request = dataclasses.replace(request, seed=mx.random.randint(0, 2**31 - 1).item())
        settings = dataclasses.asdict(request)
        settings.update(messages=None, prompt=None)  # the ids carry the prompt
        message = {"kind": "request", "request": settings, "ids": ids}
        reuse, points = self.engine.prompt_cache, None
        if reuse is not None:
            # every rank keeps what rank 0 keeps, with checkpoints where rank 0 keeps them
            points = self.engine.reuse_points(request, ids)
            message.update(points=points, kept=reuse.store.digests())
        self._send(message)
        # every step a bounded split step: a lost rank is a SplitFailed wherever MLX reports it
        # (an asynchronous evaluation's error surfaces at the next synchronization)
        return self.split.guard(self.engine.generate(request, ids, SharedStop(self.split, stop),
                                                     points=points))

    def _serve(self, job: Job) -> None:
        try:
            super()._serve(job)
        except SplitFailed as e:
            self._end(str(e))

    def fail_all(self, message: str) -> None:
        """Answer the running and the queued requests with ``message``; give them time to go."""
        self.failed = message
        error = ServerError(f"{message}; the server is stopping")
        if self.running is not None:
            self.running.emit(error)
        self._drain(lambda job: job.emit(error))
        time.sleep(FATAL_GRACE_S)

    def _end(self, message: str) -> None:
        sys.stderr.write(f"error: {message}\n")
        sys.stderr.flush()
        self.fail_all(message)
        os._exit(1)


def follow(load: Callable[[], Engine], prompt_cache_bytes: int = 0) -> int:
    """Every rank but 0: load, warm up as rank 0 does (in lockstep), then run what rank 0 sends
    until it says shutdown (exit 0); a failure is one error line (exit 1). With a prompt cache
    (``prompt_cache_bytes`` > 0, rank 0's bound) each request first keeps what rank 0 keeps:
    this rank evicts only as rank 0 does."""
    # Rank 0 decides when to stop (a terminal's Ctrl-C reaches every rank of mlx.launch).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = load()
        split = engine.model.split
        Worker.run_warm_up(engine)
        if prompt_cache_bytes:
            engine.start_prompt_cache(sys.maxsize)  # (rank 0's evictions, through ``mirror``)
        print(f"mlx_mtp.server: rank {split.rank} of {split.size} ({split.kind} split, pid "
              f"{os.getpid()}) follows rank 0", flush=True)
        while True:
            message = _receive(split)
            if message["kind"] == "shutdown":
                return 0
            if message["kind"] == "request":  # else a heartbeat
                if engine.prompt_cache is not None:
                    engine.prompt_cache.store.mirror(message["kept"])
                _run(engine, GenerationRequest(**message["request"]), message["ids"],
                     message.get("points"))
    except MTPError as e:
        sys.stderr.write(f"error: {e}\n")
        return 1


def _run(engine: Engine, request: GenerationRequest, ids: List[int],
         points: Optional[List[int]]) -> None:
    try:
        split = engine.model.split
        for _ in split.guard(engine.generate(request, ids, SharedStop(split, lambda: False),
                                             points=points)):
            pass
    except SplitFailed:
        raise
    except MTPError:  # the library refused the request's settings: rank 0 says so to the client
        pass
