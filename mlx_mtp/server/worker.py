"""The one decode thread and its bounded FIFO queue.

With ``max_batch`` above 1, where the engine could start batched rounds (``Engine.start_batch``),
up to that many requests decode together: a queued request joins between rounds, and one that
finishes or whose client went away leaves at the next round. Otherwise the model serves one
request at a time. The thread
loads the model too: on mlx 0.32 streams belong to a thread, and an array made lazily on one
thread cannot be evaluated on another ("There is no Stream(cpu, 0) in current thread"). It never
returns, it parks: a thread that has used mlx-lm and exits while the process exits makes it abort
("terminate called without an active exception") about one time in two.

Requests wait in a queue of at most ``max_queue``; past it ``submit`` raises ``QueueFull`` (the
app answers 429). Events go back to the request's event loop thread-safely; a job its client
abandoned is skipped if still queued and stopped at its next token if running.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Callable, List, Optional

from mlx_mtp import MTPError

from mlx_mtp.server.engine import Engine, Finished
from mlx_mtp.server.schema import GenerationRequest, RequestError

logger = logging.getLogger("mlx_mtp.server")


class QueueFull(Exception):
    pass


class ServerError(Exception):
    """An unexpected failure while serving one request (500); the server keeps serving."""


def answer_for(error: Exception, started: bool) -> Exception:
    """What a client gets for its request failing with ``error`` (inside the ``except``):
    a bad request is a 4xx; the library refusing the request's settings (e.g. top_k) too, unless
    tokens were already sent; anything else is logged and answered as a 500."""
    if isinstance(error, RequestError):
        return error
    if isinstance(error, MTPError):
        return RequestError(str(error)) if not started else ServerError(str(error))
    logger.exception("request failed")
    return ServerError(f"generation failed: {type(error).__name__}: {error}")


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
    # Errors after which no request can be served (a split target's lost rank): they leave _serve
    # instead of failing one request; the subclass that lists them answers every client.
    fatal: tuple = ()

    def __init__(self, make_engine: Callable[[], Engine], max_queue: int, max_batch: int = 1,
                 prompt_cache_bytes: int = 0):
        if max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {max_queue}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        if prompt_cache_bytes < 0:
            raise ValueError(f"prompt_cache_bytes must be >= 0, got {prompt_cache_bytes}")
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.prompt_cache_bytes = prompt_cache_bytes
        self.batched: List["_Member"] = []  # the requests decoding together
        self.engine: Optional[Engine] = None
        self.warm_up: Optional[Finished] = None
        self.running: Optional[Job] = None
        self._make_engine = make_engine
        self._jobs: queue.Queue = queue.Queue()  # bounded by submit (stop's sentinel always fits)
        self._submit_lock = threading.Lock()
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._finished = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="mlx_mtp-decode", daemon=True)

    def start(self) -> None:
        """Load the model on the decode thread and warm it up; re-raise a load error here."""
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel the running and queued jobs; return once the decode thread is idle for good."""
        with self._submit_lock:
            self._stopping.set()  # what runs now, or is picked up next, stops at its next token
            self._drain(lambda job: job.cancel())
            self._jobs.put(None)
        self._finished.wait(timeout)

    def _drain(self, each) -> None:
        """Take every queued job off the queue, calling ``each`` on it."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                each(job)

    @property
    def alive(self) -> bool:
        return self.warm_up is not None and not self._finished.is_set()

    @property
    def queued(self) -> int:
        return self._jobs.qsize()

    def submit(self, job: Job) -> None:
        with self._submit_lock:
            if self._jobs.qsize() >= self.max_queue:
                raise QueueFull(f"server busy: {self.max_queue} requests are already waiting "
                                f"for the model (--max-queue {self.max_queue}); retry later")
            self._jobs.put(job)

    def _run(self) -> None:
        try:
            self._load_and_serve()
        finally:
            self._finished.set()
            threading.Event().wait()  # park, never return (see the module docstring)

    def _load_and_serve(self) -> None:
        try:
            self.engine = self._make_engine()
            self.warm_up = self.run_warm_up(self.engine)
            self.engine.start_batch(self.max_batch)
            logger.info("batch: %s", self.engine.batch_reason)
            self.engine.start_prompt_cache(self.prompt_cache_bytes)  # (after the warm-up's)
            logger.info("prompt cache: %s", self.engine.prompt_cache_reason)
        except BaseException as e:  # handed to start(), which re-raises it on the main thread
            self._error = e
            return
        finally:
            self._ready.set()
        if self.engine.batch is not None:
            self._serve_batched()
            return
        while True:
            job = self._next_job()
            if job is None:  # stop()
                return
            if job.cancelled or self._stopping.is_set():
                continue
            self.running = job
            try:
                self._serve(job)
            finally:
                self.running = None

    def _next_job(self) -> Optional[Job]:
        """The next queued job; None once stopped."""
        return self._jobs.get()

    def _events(self, request: GenerationRequest, ids, stop: Callable[[], bool]):
        return self.engine.generate(request, ids, stop)

    @staticmethod
    def run_warm_up(engine: Engine) -> Finished:
        """Two tokens at startup: the exactness gate's probe and first-call costs are paid
        before the first client, and the log says whether MTP is on."""
        req = GenerationRequest(kind="text", model="", prompt="Hello", max_tokens=2)
        return list(engine.generate(req, engine.prompt_ids(req)))[-1]

    def _serve(self, job: Job) -> None:
        started = False
        try:
            ids = self.engine.prompt_ids(job.request)
            stop = lambda: job.cancelled or self._stopping.is_set()  # noqa: E731
            for event in self._events(job.request, ids, stop):
                started = True
                job.emit(event)
        except self.fatal:
            raise
        except Exception as e:
            job.emit(answer_for(e, started))

    # ------------------------------------------------------------------------- batched rounds

    @property
    def busy(self) -> bool:
        return self.running is not None or bool(self.batched)

    def _serve_batched(self) -> None:
        """Admit queued jobs while the batch has room, hand every member the tokens its
        sequence emitted, then run one round for all of them; until stopped."""
        batch = self.engine.batch
        while True:
            while len(self.batched) < batch.max_batch:
                if self.batched:
                    try:
                        job = self._jobs.get_nowait()
                    except queue.Empty:
                        break
                else:
                    job = self._next_job()
                if job is None:  # stop()
                    for member in self.batched:
                        member.close()
                    self.batched = []
                    return
                if job.cancelled or self._stopping.is_set():
                    continue
                member = self._join(job)
                if member is not None and member.advance():
                    self.batched.append(member)
            self.batched = [m for m in self.batched if m.advance()]
            if self.batched:
                try:
                    batch.round()
                except Exception as e:  # every member's round failed: answer them all
                    logger.exception("batched round failed")
                    for member in self.batched:
                        member.fail(ServerError(f"generation failed: {type(e).__name__}: {e}"))
                    self.batched = []

    def _join(self, job: Job) -> Optional["_Member"]:
        try:
            ids = self.engine.prompt_ids(job.request)
        except RequestError as e:
            job.emit(e)
            return None
        member = _Member(job, self)
        stop = lambda: job.cancelled or self._stopping.is_set()  # noqa: E731
        member.events = self.engine.generate(job.request, ids, stop, on_sequence=member.joined)
        return member


class _Member:
    """A job decoding in the batch: its events, and its sequence once it joined."""

    def __init__(self, job: Job, worker: Worker):
        self.job = job
        self.worker = worker
        self.events = None
        self.seq = None
        self.started = False

    def joined(self, seq) -> None:
        self.seq = seq

    def _pending(self) -> bool:
        """Whether reading its events now needs no round: it has not joined yet (reading
        prefills it), its sequence has tokens to read, or nothing more to emit (its budget is
        out, or its reader stopped at an EOS and it left the batch)."""
        seq = self.seq
        return seq is None or bool(seq.out) or seq.done or seq.left

    def advance(self) -> bool:
        """Emit what the job can emit without a round; False once it is over."""
        try:
            while self._pending():
                event = next(self.events)
                self.started = True
                self.job.emit(event)
                if isinstance(event, Finished):
                    self.close()
                    return False
        except StopIteration:
            self.close()
            return False
        except Exception as e:
            self.fail(answer_for(e, self.started))
            return False
        return True

    def fail(self, error: Exception) -> None:
        self.job.emit(error)
        self.close()

    def close(self) -> None:
        """Leave the batch: the events closed (the sequence with them)."""
        if self.events is not None:
            self.events.close()
        if self.seq is not None:
            self.worker.engine.batch.remove(self.seq)
