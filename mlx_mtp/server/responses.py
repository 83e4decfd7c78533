"""OpenAI response bodies (chat.completion, text_completion, their stream chunks, errors).

Every body that ends a request carries ``usage`` where OpenAI has it and an ``mtp`` object beside
it (``engine.mtp_summary``): whether MTP ran, the exactness gate's reason, acceptance rate,
tokens per round, per-position acceptance and generation tok/s; with ``n`` > 1 a list of them,
one per choice. Tool calls and logprobs take OpenAI's shapes; a logprob entry also carries the
token ``id``, as mlx_lm.server's.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import List, Optional

from mlx_mtp.server.engine import Finished
from mlx_mtp.server.output import Delta, TokenLogprob, ToolCall
from mlx_mtp.server.schema import GenerationRequest


def tool_call(call: ToolCall, index: Optional[int] = None) -> dict:
    out = {"id": call.id, "type": "function",
           "function": {"name": call.name,
                        "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
    if index is not None:  # a stream's calls are numbered
        out["index"] = index
    return out


def _entry(token_id: int, text: str, logprob: float) -> dict:
    return {"id": token_id, "token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(entries: List[TokenLogprob]) -> dict:
    return {"content": [dict(_entry(e.token, e.text, e.logprob),
                             top_logprobs=[_entry(*t) for t in e.top]) for e in entries],
            "refusal": None}


class Choice:
    """One choice of a response: its events as they come, in the shapes OpenAI gives them."""

    def __init__(self, index: int, chat: bool):
        self.index = index
        self.chat = chat
        self.content: List[str] = []
        self.reasoning: List[str] = []
        self.tool_calls: List[ToolCall] = []
        self.logprobs: List[TokenLogprob] = []
        self.offset = 0  # completions' text_offset of the next token
        self.done: Optional[Finished] = None

    def add(self, delta: Delta) -> None:
        self.content.append(delta.content)
        self.reasoning.append(delta.reasoning)
        self.tool_calls.extend(delta.tool_calls)
        self.logprobs.extend(delta.logprobs)

    def _text_logprobs(self, entries: List[TokenLogprob]) -> dict:
        offsets = []
        for e in entries:
            offsets.append(self.offset)
            self.offset += len(e.text)
        return {"tokens": [e.text for e in entries],
                "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{text: lp for _, text, lp in e.top} for e in entries],
                "text_offset": offsets}

    def whole(self, want_logprobs: bool) -> dict:
        """The choice of a non-streamed body."""
        content, reasoning = "".join(self.content), "".join(self.reasoning)
        if self.chat:
            message = {"role": "assistant", "content": content or None}
            if reasoning:
                message["reasoning"] = reasoning
            if self.tool_calls:
                message["tool_calls"] = [tool_call(c) for c in self.tool_calls]
            choice = {"index": self.index, "message": message,
                      "logprobs": chat_logprobs(self.logprobs) if want_logprobs else None}
        else:
            choice = {"index": self.index, "text": content,
                      "logprobs": self._text_logprobs(self.logprobs) if want_logprobs else None}
        choice["finish_reason"] = self.done.finish_reason
        return choice

    def part(self, delta: Optional[Delta], want_logprobs: bool,
             done: Optional[Finished] = None) -> dict:
        """The choice of one stream chunk: ``delta``'s parts, or the finish."""
        delta = delta or Delta()
        logprobs = None
        if self.chat:
            body = {"role": "assistant"}
            if delta.content:
                body["content"] = delta.content
            if delta.reasoning:
                body["reasoning"] = delta.reasoning
            if delta.tool_calls:
                first = len(self.tool_calls)
                body["tool_calls"] = [tool_call(c, first + i)
                                      for i, c in enumerate(delta.tool_calls)]
            if want_logprobs and delta.logprobs:
                logprobs = chat_logprobs(delta.logprobs)
            choice = {"index": self.index, "delta": body, "logprobs": logprobs}
        else:
            if want_logprobs and delta.logprobs:
                logprobs = self._text_logprobs(delta.logprobs)
            choice = {"index": self.index, "text": delta.content, "logprobs": logprobs}
        self.tool_calls.extend(delta.tool_calls)
        choice["finish_reason"] = done.finish_reason if done else None
        return choice


class ResponseIds:
    """The id, object types and creation time one request's bodies share."""

    def __init__(self, req: GenerationRequest):
        self.req = req
        self.chat = req.kind == "chat"
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4()}"
        self.created = int(time.time())

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.req.model}

    def complete(self, choices: List[Choice]) -> dict:
        body = self._base("chat.completion" if self.chat else "text_completion")
        body["choices"] = [c.whole(self.req.logprobs) for c in choices]
        dones = [c.done for c in choices]
        body["usage"] = usage(dones)
        body["mtp"] = mtp(dones)
        return body

    def chunk(self, choice: Choice, delta: Optional[Delta] = None,
              done: Optional[Finished] = None) -> dict:
        body = self._base("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = [choice.part(delta, self.req.logprobs, done)]
        if done is not None:
            body["mtp"] = done.mtp
        return body

    def usage_chunk(self, dones: List[Finished]) -> dict:
        """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
        body = self._base("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage(dones)
        body["mtp"] = mtp(dones)
        return body


def usage(dones: List[Finished]) -> dict:
    """OpenAI's usage: the prompt once, every choice's tokens; ``prompt_tokens_details.
    cached_tokens``: the prompt tokens taken from the prompt cache (with ``n`` > 1, the fewest
    any choice took)."""
    prompt = dones[0].prompt_tokens
    completion = sum(d.completion_tokens for d in dones)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": min(d.cached_tokens for d in dones)}}


def mtp(dones: List[Finished]):
    return dones[0].mtp if len(dones) == 1 else [d.mtp for d in dones]


ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
               429: "rate_limit_error",
               500: "server_error", 503: "server_error"}


def error(message: str, status: int, param: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": None}}


def sse(body) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"
