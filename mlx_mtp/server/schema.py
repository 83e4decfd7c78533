"""OpenAI request bodies (chat completions, completions) -> one checked ``GenerationRequest``.

Field names, defaults and bounds follow ``mlx_lm.server`` (``validate_model_parameters``) and
OpenAI's API reference; the messages are clearer and ``bool`` is not accepted where a number is
expected. JSON ``null`` means "not given". Every field is either implemented or refused with a
400 that names it: a field this server does not implement (``NOT_IMPLEMENTED``), a value it does
not implement (``DEFAULT_ONLY``: only the value that asks for what it does anyway), and a field
no endpoint knows. ``docs/server.md`` has the table.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


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


# mlx-lm's default context of the presence and frequency penalties.
PENALTY_CONTEXT = 20
# The most alternatives a token's logprobs list (OpenAI's bound).
TOP_LOGPROBS_MAX = 20
# The most choices one request may ask for (OpenAI's bound; the queue may bound it lower).
N_MAX = 128


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
    presence_penalty: float = 0.0
    presence_context_size: int = PENALTY_CONTEXT
    frequency_penalty: float = 0.0
    frequency_context_size: int = PENALTY_CONTEXT
    logit_bias: Optional[Dict[int, float]] = None  # token id -> added to its logit
    seed: Optional[int] = None
    stop: List[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False  # each generated token's logprob
    top_logprobs: int = 0  # and this many alternatives
    n: int = 1  # choices
    tools: Optional[List[dict]] = None  # OpenAI function tools, for the chat template
    tool_choice: Optional[str] = None  # "auto" or "none"
    chat_template_kwargs: Optional[dict] = None
    role_mapping: Optional[dict] = None  # mlx-lm's layout for tokenizers without a template


# Fields of OpenAI's and mlx_lm.server's bodies this server does not implement: setting one to
# anything but null is a 400 that says so (with the reason here).
NOT_IMPLEMENTED = {
    "audio": "audio output",
    "function_call": "the deprecated functions API: use tool_choice",
    "functions": "the deprecated functions API: use tools",
    "metadata": "stored completions",
    "moderation": "moderation",
    "prediction": "predicted outputs",
    "prompt_cache_key": "prompt cache routing keys",
    "prompt_cache_options": "prompt cache options",
    "prompt_cache_retention": "prompt cache retention",
    "reasoning_effort": "reasoning effort: the chat template decides (chat_template_kwargs)",
    "safety_identifier": "safety identifiers",
    "service_tier": "service tiers",
    "user": "end-user identifiers",
    "verbosity": "verbosity",
    "web_search_options": "web search",
    "suffix": "insertion after a suffix",
    "xtc_threshold": "XTC sampling",
    "adapters": "LoRA adapters",
    "draft_model": "draft models: it drafts with the model's own MTP head (--drafter)",
    "num_draft_tokens": "a per-request draft count: the block size is --block-size",
}

# Fields implemented only at the value that asks for what the server does anyway.
DEFAULT_ONLY = {
    "store": (False, "stored completions"),
    "parallel_tool_calls": (True, "limiting a reply to one tool call"),
    "response_format": ({"type": "text"}, "structured output"),
    "modalities": (["text"], "output other than text"),
    "echo": (False, "echoing the prompt"),
    "xtc_probability": (0, "XTC sampling"),
}

_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
           "stream", "stream_options", "n", "logprobs", "top_logprobs", "logit_bias",
           "presence_penalty", "presence_context_size", "frequency_penalty",
           "frequency_context_size", "repetition_penalty", "repetition_context_size"}
IMPLEMENTED = {
    "chat": _COMMON | {"messages", "max_completion_tokens", "tools", "tool_choice",
                       "chat_template_kwargs", "role_mapping"},
    "text": _COMMON | {"prompt", "best_of"},
}
ENDPOINTS = {"chat": "POST /v1/chat/completions", "text": "POST /v1/completions"}


def show(value: Any) -> str:
    return json.dumps(value)[:80]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class Body:
    """A request body's fields, read with their checks (one-line errors naming the field)."""

    def __init__(self, body: dict):
        self.body = body

    def given(self, name: str) -> bool:
        return self.body.get(name) is not None

    def get(self, name: str, default=None):
        v = self.body.get(name)
        return default if v is None else v

    def integer(self, name: str, default, lo=None, hi=None):
        v = self.get(name, default)
        if v is None:
            return None
        if not _is_int(v):
            raise RequestError(f"{name} must be an integer, got {show(v)}", param=name)
        self.bounds(name, v, lo, hi)
        return v

    def number(self, name: str, default, lo=None, hi=None) -> float:
        v = self.get(name, default)
        if not _is_number(v):
            raise RequestError(f"{name} must be a number, got {show(v)}", param=name)
        self.bounds(name, v, lo, hi)
        return float(v)

    def boolean(self, name: str, default: bool) -> bool:
        v = self.get(name, default)
        if not isinstance(v, bool):
            raise RequestError(f"{name} must be true or false, got {show(v)}", param=name)
        return v

    def mapping(self, name: str) -> Optional[dict]:
        v = self.get(name)
        if v is not None and not isinstance(v, dict):
            raise RequestError(f"{name} must be an object, got {show(v)}", param=name)
        return v

    @staticmethod
    def bounds(name, v, lo, hi):
        if hi is not None and not lo <= v <= hi:
            raise RequestError(f"{name} must be between {lo} and {hi}, got {v}", param=name)
        if lo is not None and v < lo:
            raise RequestError(f"{name} must be >= {lo}, got {v}", param=name)


def refuse_unimplemented(body: Body, implemented, endpoint: str,
                         not_implemented: Dict[str, str],
                         default_only: Dict[str, tuple]) -> None:
    """A 400 for the first field set that is not implemented (or not at that value), or that
    ``endpoint`` does not know."""
    for name, value in body.body.items():
        if value is None or name in implemented:
            continue
        if name in not_implemented:
            raise RequestError(f"{name} is not supported by mlx_mtp.server "
                               f"({not_implemented[name]})", param=name)
        if name in default_only:
            accepted, what = default_only[name]
            if value != accepted or isinstance(value, bool) != isinstance(accepted, bool):
                raise RequestError(f"{name} must be {show(accepted)}: mlx_mtp.server does not "
                                   f"implement {what}, got {show(value)}", param=name)
            continue
        raise RequestError(f"{name} is not a field of {endpoint}", param=name)


def sampling_fields(body: Body, req: GenerationRequest, defaults: Defaults) -> None:
    """The sampling fields both APIs share (temperature, top_p, top_k, min_p, seed) with the
    server's defaults."""
    req.temperature = body.number("temperature", defaults.temperature, lo=0)
    req.top_p = body.number("top_p", defaults.top_p, lo=0, hi=1)
    req.top_k = body.integer("top_k", defaults.top_k, lo=0)
    req.min_p = body.number("min_p", defaults.min_p, lo=0, hi=1)
    req.seed = body.integer("seed", None)


def check_tools(tools, name: str = "tools") -> List[dict]:
    """OpenAI function tools: ``[{"type": "function", "function": {"name": ..., ...}}]``."""
    if not isinstance(tools, list):
        raise RequestError(f"{name} must be a list of function tools, got {show(tools)}",
                           param=name)
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(tool, dict) or tool.get("type") != "function"
                or not isinstance(fn, dict) or not isinstance(fn.get("name"), str)
                or not fn["name"]):
            raise RequestError(f"{name}[{i}] must be {{\"type\": \"function\", \"function\": "
                               f"{{\"name\": ..., \"parameters\": ...}}}}, got {show(tool)}",
                               param=name)
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise RequestError(f"{name}[{i}].function.parameters must be a JSON schema object, "
                               f"got {show(fn['parameters'])}", param=name)
    return tools


def tool_choice(body: Body, has_tools: bool) -> Optional[str]:
    """``"auto"`` (the default with tools) or ``"none"``; nothing here can force a call."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if has_tools else None
    if not has_tools:
        raise RequestError("tool_choice needs tools", param="tool_choice")
    if choice not in ("auto", "none"):
        raise RequestError(f"tool_choice must be \"auto\" or \"none\" (mlx_mtp.server cannot "
                           f"force a tool call), got {show(choice)}", param="tool_choice")
    return choice


def _messages(body: Body) -> List[dict]:
    messages = body.body.get("messages")
    if messages is None:
        raise RequestError("messages is required: a non-empty list of {role, content} objects",
                           param="messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"messages must be a non-empty list of {{role, content}} objects, "
                           f"got {show(messages)}", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string role, "
                               f"got {show(m)}", param="messages")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise RequestError(f"messages[{i}].content must be a string or a list of text "
                               f"parts, got {show(content)}", param="messages")
        if isinstance(content, list) and not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content):
            raise RequestError(f"messages[{i}].content: only text parts "
                               f"({{\"type\": \"text\", \"text\": ...}}) are supported",
                               param="messages")
        _tool_calls(m.get("tool_calls"), i)
    return messages


def _tool_calls(calls, i: int) -> None:
    """An assistant message's ``tool_calls``: function calls whose arguments are a JSON object
    (or its text), as the chat template takes them back."""
    if calls is None:
        return
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise RequestError(f"{where} must be a list, got {show(calls)}", param="messages")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"{where}[{j}] must be {{\"type\": \"function\", \"function\": "
                               f"{{\"name\": ..., \"arguments\": ...}}}}, got {show(call)}",
                               param="messages")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise RequestError(f"{where}[{j}].function.arguments is not JSON: {e}",
                                   param="messages") from None
        if args is not None and not isinstance(args, dict):
            raise RequestError(f"{where}[{j}].function.arguments must be a JSON object, got "
                               f"{show(args)}", param="messages")


def stop_list(body: Body, name: str = "stop") -> List[str]:
    stop = body.get(name, [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(f"{name} must be a non-empty string or a list of them, got "
                           f"{show(body.body.get(name))}", param=name)
    return stop


def penalty_fields(body: Body, req: GenerationRequest, defaults: Defaults) -> None:
    """mlx-lm's logits processors: repetition, presence and frequency penalties, logit bias."""
    req.repetition_penalty = body.number("repetition_penalty", defaults.repetition_penalty, lo=0)
    req.repetition_context_size = body.integer("repetition_context_size",
                                               defaults.repetition_context_size, lo=1)
    req.presence_penalty = body.number("presence_penalty", 0.0)
    req.presence_context_size = body.integer("presence_context_size", PENALTY_CONTEXT, lo=1)
    req.frequency_penalty = body.number("frequency_penalty", 0.0)
    req.frequency_context_size = body.integer("frequency_context_size", PENALTY_CONTEXT, lo=1)
    bias = body.mapping("logit_bias")
    if bias is not None:
        req.logit_bias = {}
        for k, v in bias.items():
            try:
                token = int(k)
            except ValueError:
                token = None
            if token is None or token < 0 or not _is_number(v):
                raise RequestError(f"logit_bias must map token ids to numbers, got "
                                   f"{show({k: v})}", param="logit_bias")
            req.logit_bias[token] = float(v)


def _logprobs(body: Body, req: GenerationRequest) -> None:
    """Chat: ``logprobs`` true/false and ``top_logprobs`` N. Completions (OpenAI): ``logprobs``
    N, the alternatives per token; ``true`` (mlx_lm.server) is N = 0. ``top_logprobs`` (mlx-lm,
    -1: off) also asks for them."""
    value = body.get("logprobs", False)
    if req.kind == "text" and _is_int(value):
        Body.bounds("logprobs", value, 0, TOP_LOGPROBS_MAX)
        req.logprobs, top = True, value
    else:
        req.logprobs, top = body.boolean("logprobs", False), 0
    n = body.integer("top_logprobs", -1, lo=-1, hi=TOP_LOGPROBS_MAX)
    if n > 0:
        req.logprobs, top = True, n
    req.top_logprobs = top


def _stream_options(body: Body) -> bool:
    options = body.get("stream_options", {})
    if not isinstance(options, dict):
        raise RequestError(f"stream_options must be an object, got {show(options)}",
                           param="stream_options")
    for key in options:
        if key != "include_usage" and options[key] is not None:
            raise RequestError(f"stream_options.{key} is not supported by mlx_mtp.server",
                               param="stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise RequestError(f"stream_options.include_usage must be true or false, got "
                           f"{show(include)}", param="stream_options")
    return include


def load_json(raw: bytes) -> dict:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"invalid JSON in the request body: {e}") from None
    if not isinstance(data, dict):
        raise RequestError(f"the request body must be a JSON object, got {show(data)}")
    return data


def served_model(body: Body, defaults: Defaults) -> str:
    """One model is served: responses name it whatever string the request used."""
    model = body.get("model", defaults.model)
    if not isinstance(model, str):
        raise RequestError(f"model must be a string, got {show(model)}", param="model")
    return defaults.model


def parse(raw: bytes, kind: str, defaults: Defaults) -> GenerationRequest:
    """``raw`` body of a ``kind`` ("chat" or "text") request -> ``GenerationRequest``;
    ``RequestError`` (400) for anything malformed or not implemented."""
    body = Body(load_json(raw))
    refuse_unimplemented(body, IMPLEMENTED[kind], ENDPOINTS[kind], NOT_IMPLEMENTED, DEFAULT_ONLY)
    req = GenerationRequest(kind=kind, model=served_model(body, defaults))
    if kind == "chat":
        req.messages = _messages(body)
        if body.given("tools"):
            req.tools = check_tools(body.get("tools"))
        req.tool_choice = tool_choice(body, req.tools is not None)
        req.chat_template_kwargs = body.mapping("chat_template_kwargs")
        req.role_mapping = body.mapping("role_mapping")
    else:
        prompt = body.body.get("prompt")
        if not isinstance(prompt, str):
            raise RequestError(f"prompt must be a string, got {show(prompt)}", param="prompt")
        req.prompt = prompt
    # max_completion_tokens wins over max_tokens, as in mlx_lm.server.
    name = ("max_completion_tokens" if body.get("max_completion_tokens") is not None
            else "max_tokens")
    req.max_tokens = body.integer(name, defaults.max_tokens, lo=1)
    sampling_fields(body, req, defaults)
    penalty_fields(body, req, defaults)
    req.stop = stop_list(body)
    req.stream = body.boolean("stream", False)
    req.include_usage = _stream_options(body)
    if req.include_usage and not req.stream:
        raise RequestError("stream_options.include_usage needs stream: true",
                           param="stream_options")
    req.n = body.integer("n", 1, lo=1, hi=N_MAX)
    best_of = body.integer("best_of", req.n)
    if best_of != req.n:
        raise RequestError(f"best_of must equal n ({req.n}): mlx_mtp.server does not pick "
                           f"the best of several completions, got {best_of}", param="best_of")
    _logprobs(body, req)
    return req
