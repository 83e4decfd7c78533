"""Request bodies of the OpenAI-compatible endpoints -> one checked ``GenerationRequest``.

Field names, defaults and bounds follow ``mlx_lm.server``
(``APIHandler.validate_model_parameters``); the messages are clearer and ``bool`` is not accepted
where a number is expected. JSON ``null`` means "not given". Fields this server does not
implement are refused (400) rather than ignored when ignoring them would change the answer
(``n`` > 1, ``logprobs``, ``tools``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, List, Optional


class RequestError(Exception):
    """A client error: ``status`` (4xx) and a one-line message naming the field."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass(frozen=True)
class Defaults:
    """What a request gets for a field it leaves out (the server's flags, as in mlx_lm.server)."""

    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 0.0  # 0: off (mlx_lm.server's default)
    repetition_context_size: int = 20
    model: str = "default_model"  # the id every response names, as /v1/models does


@dataclass
class GenerationRequest:
    kind: str  # "chat" (messages) or "text" (prompt)
    model: str
    messages: Optional[List[dict]] = None
    prompt: Optional[str] = None
    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 0.0  # 0: off (mlx_lm.server's default)
    repetition_context_size: int = 20
    seed: Optional[int] = None
    stop: List[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False


def _show(value: Any) -> str:
    return json.dumps(value)[:80]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class _Body:
    def __init__(self, body: dict):
        self.body = body

    def get(self, name: str, default=None):
        v = self.body.get(name)
        return default if v is None else v

    def integer(self, name: str, default, lo=None, hi=None):
        v = self.get(name, default)
        if v is None:
            return None
        if not _is_int(v):
            raise RequestError(f"{name} must be an integer, got {_show(v)}", param=name)
        self._bounds(name, v, lo, hi)
        return v

    def number(self, name: str, default, lo=None, hi=None) -> float:
        v = self.get(name, default)
        if not _is_number(v):
            raise RequestError(f"{name} must be a number, got {_show(v)}", param=name)
        self._bounds(name, v, lo, hi)
        return float(v)

    def boolean(self, name: str, default: bool) -> bool:
        v = self.get(name, default)
        if not isinstance(v, bool):
            raise RequestError(f"{name} must be true or false, got {_show(v)}", param=name)
        return v

    @staticmethod
    def _bounds(name, v, lo, hi):
        if hi is not None and not lo <= v <= hi:
            raise RequestError(f"{name} must be between {lo} and {hi}, got {v}", param=name)
        if lo is not None and v < lo:
            raise RequestError(f"{name} must be >= {lo}, got {v}", param=name)


def _messages(body: _Body) -> List[dict]:
    messages = body.body.get("messages")
    if messages is None:
        raise RequestError("messages is required: a non-empty list of {role, content} objects",
                           param="messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"messages must be a non-empty list of {{role, content}} objects, "
                           f"got {_show(messages)}", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string role, "
                               f"got {_show(m)}", param="messages")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise RequestError(f"messages[{i}].content must be a string or a list of text "
                               f"parts, got {_show(content)}", param="messages")
        if isinstance(content, list) and not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content):
            raise RequestError(f"messages[{i}].content: only text parts "
                               f"({{\"type\": \"text\", \"text\": ...}}) are supported",
                               param="messages")
    return messages


def _stop(body: _Body) -> List[str]:
    stop = body.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(f"stop must be a non-empty string or a list of them, got "
                           f"{_show(body.body.get('stop'))}", param="stop")
    return stop


def _refuse_unsupported(body: _Body) -> None:
    n = body.integer("n", 1)
    if n != 1:
        raise RequestError(f"n must be 1 (one decode at a time), got {n}", param="n")
    if body.get("logprobs", False) not in (False, 0):
        raise RequestError("logprobs is not supported by mlx_mtp.server", param="logprobs")
    if body.get("tools"):
        raise RequestError("tools are not supported by mlx_mtp.server", param="tools")


def parse(raw: bytes, kind: str, defaults: Defaults) -> GenerationRequest:
    """``raw`` body of a ``kind`` ("chat" or "text") request -> ``GenerationRequest``;
    ``RequestError`` (400) for anything malformed."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"invalid JSON in the request body: {e}") from None
    if not isinstance(data, dict):
        raise RequestError(f"the request body must be a JSON object, got {_show(data)}")
    body = _Body(data)
    _refuse_unsupported(body)
    model = body.get("model", defaults.model)
    if not isinstance(model, str):
        raise RequestError(f"model must be a string, got {_show(model)}", param="model")
    # One model is served: responses name it whatever id the request used.
    req = GenerationRequest(kind=kind, model=defaults.model)
    if kind == "chat":
        req.messages = _messages(body)
    else:
        prompt = data.get("prompt")
        if not isinstance(prompt, str):
            raise RequestError(f"prompt must be a string, got {_show(prompt)}", param="prompt")
        req.prompt = prompt
    # max_completion_tokens wins over max_tokens, as in mlx_lm.server.
    name = ("max_completion_tokens" if body.get("max_completion_tokens") is not None
            else "max_tokens")
    req.max_tokens = body.integer(name, defaults.max_tokens, lo=1)
    req.temperature = body.number("temperature", defaults.temperature, lo=0)
    req.top_p = body.number("top_p", defaults.top_p, lo=0, hi=1)
    req.top_k = body.integer("top_k", defaults.top_k, lo=0)
    req.min_p = body.number("min_p", defaults.min_p, lo=0, hi=1)
    req.repetition_penalty = body.number("repetition_penalty", defaults.repetition_penalty, lo=0)
    req.repetition_context_size = body.integer("repetition_context_size",
                                               defaults.repetition_context_size, lo=1)
    req.seed = body.integer("seed", None)
    req.stop = _stop(body)
    req.stream = body.boolean("stream", False)
    options = body.get("stream_options", {})
    if not isinstance(options, dict):
        raise RequestError(f"stream_options must be an object, got {_show(options)}",
                           param="stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise RequestError(f"stream_options.include_usage must be true or false, got "
                           f"{_show(include)}", param="stream_options")
    req.include_usage = include
    return req
