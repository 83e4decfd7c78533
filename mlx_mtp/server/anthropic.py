"""Anthropic's Messages API (``POST /v1/messages``) over the same jobs as the OpenAI routes.

``parse``: a Messages body -> a ``GenerationRequest`` whose messages and tools are the OpenAI
shapes the chat template takes (``system`` first; ``tool_result`` blocks -> ``tool`` messages;
``tool_use`` blocks -> an assistant's ``tool_calls``; ``thinking`` blocks -> its
``reasoning_content``). ``Reply``: the answer as content blocks (``thinking``, ``text``,
``tool_use``) in the order the model wrote them, whole or as Anthropic's stream events, with
``stop_reason`` and ``usage`` (and the ``mtp`` object beside them). Fields it does not implement
are refused with a 400 naming them, as on the OpenAI routes.
"""

from __future__ import annotations

import json
import uuid
from typing import List, Optional

from starlette.responses import JSONResponse, Response

from mlx_mtp.server.engine import Finished, Started
from mlx_mtp.server.output import Delta
from mlx_mtp.server.schema import (Body, Defaults, GenerationRequest, RequestError, check_tools,
                                   load_json, penalty_fields, refuse_unimplemented,
                                   sampling_fields, served_model, show, stop_list)

ENDPOINT = "POST /v1/messages"
IMPLEMENTED = {"model", "max_tokens", "messages", "system", "stop_sequences", "stream",
               "temperature", "top_p", "top_k", "tools", "tool_choice",
               # mlx_lm.server's fields, as on the OpenAI routes
               "min_p", "seed", "repetition_penalty", "repetition_context_size",
               "presence_penalty", "presence_context_size", "frequency_penalty",
               "frequency_context_size", "logit_bias", "chat_template_kwargs",
               # accepted with no effect on the answer, as agents send them
               "cache_control", "metadata"}
NOT_IMPLEMENTED = {
    "container": "containers",
    "context_management": "context management",
    "diagnostics": "diagnostics",
    "inference_geo": "inference regions",
    "mcp_servers": "MCP servers",
    "output_config": "output configuration",
    "service_tier": "service tiers",
    "speed": "speed tiers",
    "thinking": "thinking budgets: the chat template decides (chat_template_kwargs)",
    "user_profile_id": "user profiles",
    "workspace_id": "workspaces",
}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "cancelled": "end_turn"}
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def error_body(message: str, status: int) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "invalid_request_error"),
                                       "message": message}}


def error_response(message: str, status: int, headers=None) -> JSONResponse:
    return JSONResponse(error_body(message, status), status_code=status, headers=headers)


# ------------------------------------------------------------------------------------ requests


def _text(content, where: str) -> str:
    """A string, or a list of text blocks joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of text blocks, got "
                           f"{show(content)}", param="messages")
    parts = []
    for j, block in enumerate(content):
        _known_keys(block, {"type", "text", "cache_control"}, f"{where}[{j}]")
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise RequestError(f"{where}[{j}]: only text blocks ({{\"type\": \"text\", "
                               f"\"text\": ...}}) are supported here, got {show(block)}",
                               param="messages")
        parts.append(block["text"])
    return "".join(parts)


def _known_keys(block, keys, where: str) -> None:
    if not isinstance(block, dict):
        raise RequestError(f"{where} must be a content block object, got {show(block)}",
                           param="messages")
    for key, value in block.items():
        if key not in keys and value is not None:
            raise RequestError(f"{where}.{key} is not supported by mlx_mtp.server",
                               param="messages")
        if key == "cache_control":
            check_cache_control(value, f"{where}.cache_control")


def check_cache_control(value, where: str) -> None:
    """A cache breakpoint (``{"type": "ephemeral"}``, optionally a ``ttl``) is accepted and
    changes nothing: the server's prompt cache keeps every prompt's prefix unasked."""
    if value is None:
        return
    if (not isinstance(value, dict) or value.get("type") != "ephemeral"
            or not set(value) <= {"type", "ttl"}
            or not isinstance(value.get("ttl", ""), str)):
        raise RequestError(f"{where} must be {{\"type\": \"ephemeral\"}} (optionally with a "
                           f"\"ttl\" string), got {show(value)}", param="cache_control")


def check_metadata(value) -> None:
    """``metadata.user_id`` names the caller in Anthropic's API; it does not change the answer
    there or here."""
    if value is None:
        return
    if (not isinstance(value, dict) or not set(value) <= {"user_id"}
            or not isinstance(value.get("user_id", ""), (str, type(None)))):
        raise RequestError(f"metadata must be an object with at most a \"user_id\" string, got "
                           f"{show(value)}", param="metadata")


BLOCK_KEYS = {
    "text": {"type", "text", "cache_control"},
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
    "tool_use": {"type", "id", "name", "input", "cache_control"},
    "thinking": {"type", "thinking", "signature"},
}


def _user(i: int, content) -> List[dict]:
    """A user turn: its tool results as ``tool`` messages (``is_error`` rides along as the
    message's key), then its text as one user message."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out, texts = [], []
    for j, block in enumerate(_blocks(i, content, ("text", "tool_result"))):
        if block["type"] == "text":
            texts.append(block)
            continue
        if not isinstance(block.get("tool_use_id"), str):
            raise RequestError(f"messages[{i}].content[{j}].tool_use_id must be a string",
                               param="messages")
        message = {"role": "tool", "tool_call_id": block["tool_use_id"],
                   "content": _text(block.get("content", ""), f"messages[{i}].content[{j}]"
                                                              f".content")}
        if block.get("is_error") is not None:
            message["is_error"] = block["is_error"]
        out.append(message)
    if texts:
        out.append({"role": "user", "content": _text(texts, f"messages[{i}].content")})
    return out


def _assistant(i: int, content) -> List[dict]:
    if isinstance(content, str):
        return [{"role": "assistant", "content": content}]
    message = {"role": "assistant", "content": ""}
    calls, thinking = [], []
    for j, block in enumerate(_blocks(i, content, ("text", "tool_use", "thinking"))):
        if block["type"] == "text":
            message["content"] += block.get("text") or ""
        elif block["type"] == "thinking":
            thinking.append(block.get("thinking") or "")
        else:
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input"),
                                                                         dict):
                raise RequestError(f"messages[{i}].content[{j}]: a tool_use block needs a "
                                   f"name and an input object, got {show(block)}",
                                   param="messages")
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block["name"], "arguments": block["input"]}})
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return [message]


def _blocks(i: int, content, types) -> list:
    if not isinstance(content, list):
        raise RequestError(f"messages[{i}].content must be a string or a list of content "
                           f"blocks, got {show(content)}", param="messages")
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in types:
            raise RequestError(f"messages[{i}].content[{j}]: {show(kind)} blocks are not "
                               f"supported here (only {', '.join(types)})", param="messages")
        _known_keys(block, BLOCK_KEYS[kind], f"messages[{i}].content[{j}]")
    return content


def _messages(body: Body) -> List[dict]:
    messages = body.body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"messages must be a non-empty list of {{role, content}} objects, "
                           f"got {show(messages)}", param="messages")
    out = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text(system, "system")})
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise RequestError(f"messages[{i}] must be an object with role \"user\" or "
                               f"\"assistant\", got {show(m)}", param="messages")
        _known_keys(m, {"role", "content"}, f"messages[{i}]")
        out.extend((_user if role == "user" else _assistant)(i, m.get("content")))
    return out


def _tools(body: Body) -> Optional[List[dict]]:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError(f"tools must be a list of tools, got {show(tools)}", param="tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
            raise RequestError(f"tools[{i}]: only custom tools ({{\"name\", \"description\", "
                               f"\"input_schema\"}}) are supported, got {show(tool)}",
                               param="tools")
        for key, value in tool.items():
            if key not in ("type", "name", "description", "input_schema",
                           "cache_control") and value is not None:
                raise RequestError(f"tools[{i}].{key} is not supported by mlx_mtp.server",
                                   param="tools")
        check_cache_control(tool.get("cache_control"), f"tools[{i}].cache_control")
        fn = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return check_tools(out)


def _tool_choice(body: Body, has_tools: bool) -> Optional[str]:
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if has_tools else None
    if not has_tools:
        raise RequestError("tool_choice needs tools", param="tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "none"):
        raise RequestError(f"tool_choice must be {{\"type\": \"auto\"}} or {{\"type\": "
                           f"\"none\"}} (mlx_mtp.server cannot force a tool call), got "
                           f"{show(choice)}", param="tool_choice")
    if choice.get("disable_parallel_tool_use"):
        raise RequestError("tool_choice.disable_parallel_tool_use is not supported by "
                           "mlx_mtp.server (limiting a reply to one tool call)",
                           param="tool_choice")
    return kind


def parse(raw: bytes, defaults: Defaults) -> GenerationRequest:
    """A Messages request body -> ``GenerationRequest``; ``RequestError`` (400) for anything
    malformed or not implemented."""
    body = Body(load_json(raw))
    refuse_unimplemented(body, IMPLEMENTED, ENDPOINT, NOT_IMPLEMENTED, {})
    req = GenerationRequest(kind="chat", model=served_model(body, defaults))
    check_cache_control(body.get("cache_control"), "cache_control")
    check_metadata(body.get("metadata"))
    if body.get("max_tokens") is None:
        raise RequestError("max_tokens is required", param="max_tokens")
    req.max_tokens = body.integer("max_tokens", None, lo=1)
    req.messages = _messages(body)
    req.tools = _tools(body)
    req.tool_choice = _tool_choice(body, req.tools is not None)
    req.chat_template_kwargs = body.mapping("chat_template_kwargs")
    sampling_fields(body, req, defaults)
    penalty_fields(body, req, defaults)
    req.stop = stop_list(body, "stop_sequences")
    req.stream = body.boolean("stream", False)
    return req


# ------------------------------------------------------------------------------------- answers


def stop_reason(done: Finished) -> str:
    if done.finish_reason == "stop":
        return "stop_sequence" if done.stop_sequence is not None else "end_turn"
    return STOP_REASONS[done.finish_reason]


class Blocks:
    """One answer's content blocks in the order the model wrote them: thinking, text and
    tool_use; a block grows while the same kind of text continues."""

    def __init__(self):
        self.blocks: List[dict] = []
        self.done: Optional[Finished] = None

    def add(self, delta: Delta) -> List[tuple]:
        """Gather ``delta``; the stream events it makes: ("start", i, block), ("delta", i,
        delta), ("stop", i)."""
        events = []
        for kind, text in (("thinking", delta.reasoning), ("text", delta.content)):
            if text:
                events += self._grow(kind, text)
        for call in delta.tool_calls:
            events += self._close()
            block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
            self.blocks.append(block)
            i = len(self.blocks) - 1
            events += [("start", i, dict(block)),
                       ("delta", i, {"type": "input_json_delta",
                                     "partial_json": json.dumps(call.arguments)}),
                       ("stop", i)]
            block["input"] = call.arguments
        return events

    def _grow(self, kind: str, text: str) -> List[tuple]:
        events = []
        last = self.blocks[-1] if self.blocks else None
        if last is None or last["type"] != kind or last.get("closed"):
            events += self._close()
            block = ({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                     else {"type": "text", "text": ""})
            self.blocks.append(block)
            events.append(("start", len(self.blocks) - 1, dict(block)))
            last = block
        last[kind] += text
        events.append(("delta", len(self.blocks) - 1, {"type": f"{kind}_delta", kind: text}))
        return events

    def _close(self) -> List[tuple]:
        last = self.blocks[-1] if self.blocks else None
        if last is None or last["type"] == "tool_use" or last.get("closed"):
            return []
        last["closed"] = True
        return [("stop", len(self.blocks) - 1)]

    def finish(self) -> List[tuple]:
        return self._close()

    def content(self) -> List[dict]:
        return [{k: v for k, v in b.items() if k != "closed"} for b in self.blocks]


def _event(kind: str, body: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body})}\n\n".encode()


class Reply:
    """The Messages API's answers for one request (it has one choice)."""

    def __init__(self, req: GenerationRequest):
        self.req = req
        self.id = f"msg_{uuid.uuid4().hex}"

    def error(self, message: str, status: int, param=None, headers=None) -> Response:
        return error_response(message, status, headers)

    def choice(self, index: int) -> Blocks:
        return Blocks()

    def _message(self, content: List[dict], done: Optional[Finished], started: Started):
        """A message; its usage as Anthropic counts it: ``input_tokens`` the prompt tokens
        prefilled, ``cache_read_input_tokens`` those taken from the prompt cache."""
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.req.model,
                "content": content,
                "stop_reason": stop_reason(done) if done else None,
                "stop_sequence": done.stop_sequence if done else None,
                "usage": {"input_tokens": started.prompt_tokens - started.cached_tokens,
                          "cache_creation_input_tokens": 0,
                          "cache_read_input_tokens": started.cached_tokens,
                          "output_tokens": done.completion_tokens if done else 0}}

    def whole(self, choices: List[Blocks]) -> dict:
        blocks = choices[0]
        done = blocks.done
        body = self._message(blocks.content(), done,
                             Started(done.prompt_tokens, done.cached_tokens))
        body["mtp"] = blocks.done.mtp
        return body

    async def stream(self, first, events):
        """``message_start``, each block's ``content_block_start`` / ``_delta`` / ``_stop``,
        then ``message_delta`` (stop reason, usage) and ``message_stop``; a failure after the
        first token ends it with an ``error`` event."""
        blocks = Blocks()
        pending = first
        while True:
            _, event = pending if pending is not None else await events.get()
            pending = None
            if isinstance(event, Started):
                yield _event("message_start",
                             {"message": self._message([], None, event)})
            elif isinstance(event, Delta):
                for item in blocks.add(event):
                    yield self._block_event(item)
            elif isinstance(event, Finished):
                for item in blocks.finish():
                    yield self._block_event(item)
                yield _event("message_delta", {
                    "delta": {"stop_reason": stop_reason(event),
                              "stop_sequence": event.stop_sequence},
                    "usage": {"output_tokens": event.completion_tokens}, "mtp": event.mtp})
                yield _event("message_stop", {})
                return
            elif isinstance(event, Exception):  # failed after the first token
                yield _event("error", error_body(str(event), 500))
                return

    @staticmethod
    def _block_event(item: tuple) -> bytes:
        if item[0] == "start":
            return _event("content_block_start", {"index": item[1], "content_block": item[2]})
        if item[0] == "delta":
            return _event("content_block_delta", {"index": item[1], "delta": item[2]})
        return _event("content_block_stop", {"index": item[1]})
