"""The Starlette app: routes, the wait for the decode thread, server-sent events, disconnects.

A request is checked (``schema``, or ``anthropic`` for ``/v1/messages``), queued as one job per
choice (429 when the queue is full), and answered once the decode thread has prefilled its
prompt: errors found there (a prompt longer than the context, a chat template that refuses the
messages) are still a 4xx. A client that goes away, while queued or mid-stream, cancels its
jobs; the decode thread stops them before the next round.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import List, Optional, Tuple

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mlx_mtp.server import anthropic, responses
from mlx_mtp.server.engine import Finished, Started
from mlx_mtp.server.output import Delta
from mlx_mtp.server.schema import Defaults, GenerationRequest, RequestError, parse
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


class _ChoiceJob(Job):
    """The job of one choice: its events go, tagged with its index, to its request's queue."""

    def __init__(self, request: GenerationRequest, loop, index: int, events: asyncio.Queue):
        super().__init__(request, loop)
        self.index = index
        self.events = events  # shared by the request's jobs

    def emit(self, event) -> None:
        super().emit((self.index, event))


def choice_seed(seed: Optional[int], index: int) -> Optional[int]:
    """Choice i of a seeded request draws with seed + i (an unseeded one, with fresh draws)."""
    return None if seed is None else seed + index


class _Events:
    """A request's ``(choice, event)`` pairs as its handler awaits them, checking every
    ``DISCONNECT_POLL_S`` whether the client is still there (while queued, and while a
    non-streamed answer is generated)."""

    def __init__(self, queue: asyncio.Queue, request: Request):
        self.queue = queue
        self.request = request
        self.checked = time.monotonic()

    async def next(self) -> Tuple[int, object]:
        while True:
            if time.monotonic() - self.checked >= DISCONNECT_POLL_S:
                self.checked = time.monotonic()
                if await self.request.is_disconnected():
                    raise ClientGone()
            try:
                return await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                pass


class _JobStream(StreamingResponse):
    """A stream that cancels its jobs however it ends (finished, disconnected, failed)."""

    def __init__(self, jobs: List[Job], content):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.jobs = jobs

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            for job in self.jobs:
                job.cancel()


class Reply:
    """How one API shapes its answers: a whole body, a stream, an error (OpenAI's here;
    ``anthropic.Reply`` for the Messages API)."""

    def __init__(self, req: GenerationRequest):
        self.req = req
        self.ids = responses.ResponseIds(req)

    def error(self, message: str, status: int, param=None, headers=None) -> Response:
        return _error(message, status, param, headers)

    def choice(self, index: int) -> responses.Choice:
        """What gathers one choice's events for ``whole``."""
        return responses.Choice(index, self.ids.chat)

    def whole(self, choices: List[responses.Choice]) -> dict:
        return self.ids.complete(choices)

    async def stream(self, first, events: asyncio.Queue):
        """Each delta as a server-sent event, each choice's finish, the usage when asked for,
        then ``[DONE]``; a failure after the first token ends it with an error event."""
        n = self.req.n
        choices = [responses.Choice(i, self.ids.chat) for i in range(n)]
        dones: List[Optional[Finished]] = [None] * n
        pending = first
        while True:
            index, event = pending if pending is not None else await events.get()
            pending = None
            if isinstance(event, Delta):
                yield responses.sse(self.ids.chunk(choices[index], event))
            elif isinstance(event, Finished):
                yield responses.sse(self.ids.chunk(choices[index], done=event))
                dones[index] = event
                if all(d is not None for d in dones):
                    if self.req.include_usage:
                        yield responses.sse(self.ids.usage_chunk(dones))
                    yield responses.SSE_DONE
                    return
            elif isinstance(event, Exception):  # failed after the first token
                yield responses.sse(responses.error(str(event), 500))
                return


def _refusal(first, reply: Reply) -> Optional[Response]:
    """The error answer when a job's first event is not ``Started`` (its prompt was refused,
    or the decode thread failed), else None."""
    if isinstance(first, RequestError):
        return reply.error(str(first), first.status, first.param)
    if isinstance(first, ServerError):
        return reply.error(str(first), 500)
    if not isinstance(first, Started):
        return reply.error(f"unexpected first event {type(first).__name__}", 500)
    return None


async def _collected(first, events: _Events, reply: Reply) -> Response:
    """A non-streamed answer: every choice's deltas, joined once they all finished."""
    choices = [reply.choice(i) for i in range(reply.req.n)]
    pending = first
    while True:
        index, event = pending if pending is not None else await events.next()
        pending = None
        if isinstance(event, Delta):
            choices[index].add(event)
        elif isinstance(event, Finished):
            choices[index].done = event
            if all(c.done is not None for c in choices):
                return JSONResponse(reply.whole(choices))
        elif isinstance(event, Started):
            continue
        else:
            return reply.error(str(event), event.status if isinstance(event, RequestError)
                               else 500)


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
        try:
            req = parse(await _read_body(request), kind, self.defaults)
        except RequestError as e:
            return _error(str(e), e.status, e.param)
        return await self.answer(request, req, Reply(req))

    async def answer(self, request: Request, req: GenerationRequest, reply: Reply) -> Response:
        """Queue the request's jobs (one per choice), wait until the first prompt is
        prefilled, then answer (streamed or whole); a client gone meanwhile cancels them."""
        if req.n > self.worker.max_queue:
            return reply.error(f"n must be at most {self.worker.max_queue} (--max-queue), got "
                               f"{req.n}", 400, "n")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        jobs = [_ChoiceJob(replace(req, seed=choice_seed(req.seed, i)), loop, i, queue)
                for i in range(req.n)]
        try:
            for job in jobs:
                self.worker.submit(job)
        except QueueFull as e:
            for job in jobs:
                job.cancel()
            return reply.error(str(e), 429, headers={"Retry-After": "1"})
        events = _Events(queue, request)
        try:
            first = await events.next()
            refused = _refusal(first[1], reply)
            if refused is not None:
                for job in jobs:
                    job.cancel()
                return refused
            if req.stream:
                return _JobStream(jobs, reply.stream(first, queue))
            return await _collected(first, events, reply)
        except ClientGone:  # nobody to answer; 499 is what proxies log for this
            for job in jobs:
                job.cancel()
            return Response(status_code=499)
        except BaseException:
            for job in jobs:
                job.cancel()
            raise

    async def chat_completions(self, request: Request) -> Response:
        return await self.complete(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self.complete(request, "text")

    async def messages(self, request: Request) -> Response:
        """Anthropic's Messages API over the same jobs."""
        try:
            req = anthropic.parse(await _read_body(request), self.defaults)
        except RequestError as e:
            return anthropic.error_response(str(e), e.status)
        return await self.answer(request, req, anthropic.Reply(req))

    def _model(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created,
                "owned_by": "mlx_mtp"}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model()]})

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{id}``: the served model, or OpenAI's 404 for any other id."""
        asked = request.path_params["model_id"]
        if asked != self.model_id:  # OpenAI's answer for a model it does not have
            return JSONResponse({"error": {
                "message": f"The model `{asked}` does not exist: this server serves "
                           f"`{self.model_id}`", "type": "invalid_request_error",
                "param": None, "code": "model_not_found"}}, status_code=404)
        return JSONResponse(self._model())

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
        Route("/v1/messages", routes.messages, methods=["POST"]),
        Route("/v1/models", routes.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", routes.model, methods=["GET"]),
        Route("/health", routes.health, methods=["GET"]),
    ])
