"""OpenAI response bodies (chat.completion, text_completion, their stream chunks, errors).

Every body that ends a request carries ``usage`` where OpenAI has it and an ``mtp`` object beside
it (``engine.mtp_summary``): whether MTP ran, the exactness gate's reason, acceptance rate,
tokens per round, per-position acceptance and generation tok/s.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Optional

from mlx_mtp.server.engine import Finished
from mlx_mtp.server.schema import GenerationRequest


class ResponseIds:
    """The id, object types and creation time one request's bodies share."""

    def __init__(self, req: GenerationRequest):
        self.req = req
        self.chat = req.kind == "chat"
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4()}"
        self.created = int(time.time())

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.req.model}

    def complete(self, content: str, reasoning: str, done: Finished) -> dict:
        body = self._base("chat.completion" if self.chat else "text_completion")
        if self.chat:
            message = {"role": "assistant", "content": content or None}
            if reasoning:
                message["reasoning"] = reasoning
            choice = {"index": 0, "message": message}
        else:
            choice = {"index": 0, "text": content, "logprobs": None}
        choice["finish_reason"] = done.finish_reason
        body["choices"] = [choice]
        body["usage"] = usage(done)
        body["mtp"] = done.mtp
        return body

    def chunk(self, content: str = "", reasoning: str = "",
              done: Optional[Finished] = None) -> dict:
        body = self._base("chat.completion.chunk" if self.chat else "text_completion")
        if self.chat:
            delta = {"role": "assistant"}
            if content:
                delta["content"] = content
            if reasoning:
                delta["reasoning"] = reasoning
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": content, "logprobs": None}
        choice["finish_reason"] = done.finish_reason if done else None
        body["choices"] = [choice]
        if done is not None:
            body["mtp"] = done.mtp
        return body

    def usage_chunk(self, done: Finished) -> dict:
        """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
        body = self._base("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage(done)
        body["mtp"] = done.mtp
        return body


def usage(done: Finished) -> dict:
    """OpenAI's usage; ``prompt_tokens_details.cached_tokens``: the prompt tokens taken from the
    prompt cache."""
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}


ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
               429: "rate_limit_error",
               500: "server_error", 503: "server_error"}


def error(message: str, status: int, param: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": None}}


def sse(body) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"
