"""The one decode thread and its bounded FIFO queue.

A speculative round is not batched, so the model serves one request at a time. The thread also
loads the model, so every MLX array the server uses is made and evaluated on it. Requests wait
in a queue of at most ``max_queue``; past it ``submit`` raises ``QueueFull`` (the app answers 429).
Events go back to the request's event loop thread-safely; a job its client abandoned is skipped
if still queued and stopped at its next token if running.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Callable, Optional

from mlx_mtp import MTPError

from .engine import Engine, Finished
from .schema import GenerationRequest, RequestError

logger = logging.getLogger("mlx_mtp.server")


class QueueFull(Exception):
    pass


class ServerError(Exception):
    """An unexpected failure while serving one request (500); the server keeps serving."""


class Job:
    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.events: asyncio.Queue = asyncio.Queue()
        self._loop = loop
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def emit(self, event) -> None:
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass


class Worker:
    def __init__(self, make_engine: Callable[[], Engine], max_queue: int):
        if max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {max_queue}")
        self.max_queue = max_queue
        self.engine: Optional[Engine] = None
        self.warm_up: Optional[Finished] = None
        self.running: Optional[Job] = None
        self._make_engine = make_engine
        self._jobs: queue.Queue = queue.Queue(maxsize=max_queue)
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="mlx_mtp-decode", daemon=True)

    def start(self) -> None:
        """Load the model on the decode thread, warm it up; re-raise a load error here."""
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.engine is not None

    @property
    def queued(self) -> int:
        return self._jobs.qsize()

    def submit(self, job: Job) -> None:
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"server busy: {self.max_queue} requests are already waiting for "
                            f"the model (--max-queue {self.max_queue}); retry later") from None

    def _run(self) -> None:
        try:
            self.engine = self._make_engine()
            self.warm_up = self._warm_up(self.engine)
        except BaseException as e:  # handed to start(), which re-raises it on the main thread
            self._error = e
            self.engine = None
            return
        finally:
            self._ready.set()
        while True:
            job = self._jobs.get()
            if job.cancelled:
                continue
            self.running = job
            try:
                self._serve(job)
            finally:
                self.running = None

    @staticmethod
    def _warm_up(engine: Engine) -> Finished:
        """Two tokens at startup: the exactness gate's probe and first-call costs are paid
        before the first client, and the log says whether MTP is on."""
        req = GenerationRequest(kind="text", model="", prompt="Hello", max_tokens=2)
        return list(engine.generate(req, engine.prompt_ids(req)))[-1]

    def _serve(self, job: Job) -> None:
        started = False
        try:
            ids = self.engine.prompt_ids(job.request)
            for event in self.engine.generate(job.request, ids, lambda: job.cancelled):
                started = True
                job.emit(event)
        except RequestError as e:
            job.emit(e)
        except MTPError as e:  # the library refused the request's settings (e.g. top_k)
            job.emit(RequestError(str(e)) if not started else ServerError(str(e)))
        except Exception as e:
            logger.exception("request failed")
            job.emit(ServerError(f"generation failed: {type(e).__name__}: {e}"))
