"""The Starlette app: routes, the wait for the decode thread, server-sent events, disconnects.

A request is checked (``schema``), queued (429 when the queue is full), and answered once the
decode thread has prefilled its prompt: errors found there (a prompt longer than the context, a
chat template that refuses the messages) are still a 4xx. A client that goes away, while queued
or mid-stream, cancels its job; the decode thread stops it before the next round.
"""

from __future__ import annotations

import asyncio
import time
from typing import Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mlx_mtp.server import responses
from mlx_mtp.server.engine import Delta, Finished, Started
from mlx_mtp.server.schema import Defaults, RequestError, parse
from mlx_mtp.server.worker import Job, QueueFull, ServerError, Worker

DISCONNECT_POLL_S = 0.5
# Far above any prompt a model's context can hold; a bigger body is refused before it is read.
MAX_BODY_BYTES = 16 * 2**20


class ClientGone(Exception):
    pass


def _error(message: str, status: int, param=None, headers=None) -> JSONResponse:
    return JSONResponse(responses.error(message, status, param), status_code=status,
                        headers=headers)


async def _read_body(request: Request) -> bytes:
    too_big = RequestError(f"the request body is larger than {MAX_BODY_BYTES} bytes", status=413)
    if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        raise too_big
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            raise too_big
    return bytes(body)


class _Events:
    """A job's events as its handler awaits them, checking every ``DISCONNECT_POLL_S`` whether
    the client is still there (while queued, and while a non-streamed answer is generated)."""

    def __init__(self, job: Job, request: Request):
        self.job = job
        self.request = request
        self.checked = time.monotonic()

    async def next(self):
        while True:
            if time.monotonic() - self.checked >= DISCONNECT_POLL_S:
                self.checked = time.monotonic()
                if await self.request.is_disconnected():
                    raise ClientGone()
            try:
                return await asyncio.wait_for(self.job.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                pass


class _JobStream(StreamingResponse):
    """A stream that cancels its job however it ends (finished, disconnected, failed)."""

    def __init__(self, job: Job, content):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


async def _stream_events(job: Job, ids: responses.ResponseIds):
    """A streamed answer: each delta as a server-sent event, then the finish (and usage when
    asked for) and ``[DONE]``; a failure after the first token ends it with an error event."""
    req = job.request
    try:
        while True:
            event = await job.events.get()
            if isinstance(event, Delta):
                yield responses.sse(ids.chunk(event.content, event.reasoning))
            elif isinstance(event, Finished):
                yield responses.sse(ids.chunk(done=event))
                if req.include_usage:
                    yield responses.sse(ids.usage_chunk(event))
                yield responses.SSE_DONE
                return
            elif isinstance(event, Exception):  # failed after the first token
                yield responses.sse(responses.error(str(event), 500))
                return
    finally:
        job.cancel()


def _refusal(first) -> Optional[Response]:
    """The error answer when a job's first event is not ``Started`` (its prompt was refused,
    or the decode thread failed), else None."""
    if isinstance(first, RequestError):
        return _error(str(first), first.status, first.param)
    if isinstance(first, ServerError):
        return _error(str(first), 500)
    if not isinstance(first, Started):
        return _error(f"unexpected first event {type(first).__name__}", 500)
    return None


async def _collected(events: _Events, ids: responses.ResponseIds) -> Response:
    """A non-streamed answer: the job's deltas joined once it finishes."""
    content, reasoning = [], []
    while True:
        event = await events.next()
        if isinstance(event, Delta):
            content.append(event.content)
            reasoning.append(event.reasoning)
        elif isinstance(event, Finished):
            return JSONResponse(ids.complete("".join(content), "".join(reasoning), event))
        else:
            return _error(str(event), 500)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    # Unknown paths and wrong methods answer in the same JSON shape as everything else.
    return _error(f"{request.method} {request.url.path}: {exc.detail}", exc.status_code,
                  headers=exc.headers)


class _Routes:
    """The route handlers of one app, over its worker."""

    def __init__(self, worker: Worker, model_id: str, defaults: Defaults):
        self.worker = worker
        self.model_id = model_id
        self.defaults = defaults
        self.created = int(time.time())

    async def complete(self, request: Request, kind: str) -> Response:
        """Check and queue the request, wait until its prompt is prefilled, then answer it
        (streamed or whole); a client gone meanwhile cancels the job."""
        try:
            req = parse(await _read_body(request), kind, self.defaults)
        except RequestError as e:
            return _error(str(e), e.status, e.param)
        job = Job(req, asyncio.get_running_loop())
        try:
            self.worker.submit(job)
        except QueueFull as e:
            return _error(str(e), 429, headers={"Retry-After": "1"})
        events = _Events(job, request)
        try:
            refused = _refusal(await events.next())
            if refused is not None:
                return refused
            ids = responses.ResponseIds(req)
            if req.stream:
                return _JobStream(job, _stream_events(job, ids))
            return await _collected(events, ids)
        except ClientGone:  # nobody to answer; 499 is what proxies log for this
            job.cancel()
            return Response(status_code=499)
        except BaseException:
            job.cancel()
            raise

    async def chat_completions(self, request: Request) -> Response:
        return await self.complete(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self.complete(request, "text")

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.created,
             "owned_by": "mlx_mtp"}]})

    async def health(self, request: Request) -> Response:
        worker = self.worker
        ok = worker.alive
        warm = worker.warm_up
        return JSONResponse({
            "status": "ok" if ok else "unavailable", "model": self.model_id,
            # temperature 0: the probe's decision (the warm-up's); above 0: no probe decides
            "mtp_enabled": warm.mtp["mtp_enabled"] if warm else None,
            "gate_reason": warm.mtp["gate_reason"] if warm else None,
            "draft_topk": warm.mtp["draft_topk"] if warm else None,
            "draft": worker.engine.draft_summary() if warm else None,
            "sampling": worker.engine.sampling_gate() if warm else None,
            "batch": worker.engine.batch_summary() if warm else None,
            "prompt_cache": worker.engine.prompt_cache_summary() if warm else None,
            "running": worker.busy, "queued": worker.queued,
            "max_queue": worker.max_queue}, status_code=200 if ok else 503)


def build_app(worker: Worker, model_id: str, defaults: Defaults = Defaults()) -> Starlette:
    routes = _Routes(worker, model_id, defaults)
    return Starlette(exception_handlers={HTTPException: _http_error}, routes=[
        Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
        Route("/chat/completions", routes.chat_completions, methods=["POST"]),
        Route("/v1/completions", routes.completions, methods=["POST"]),
        Route("/v1/models", routes.models, methods=["GET"]),
        Route("/health", routes.health, methods=["GET"]),
    ])
