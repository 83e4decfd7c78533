"""Every field of a request body, one at a time: honoured (its effect asserted) or refused with a
400 that names it; none comes back 200 unchanged.

The field lists are derived, so they cannot drift: OpenAI's chat and completions bodies from the
``openai`` package's typed params, mlx_lm.server's from the fields its handler reads, Anthropic's
Messages body from the ``anthropic`` package's params. A field in a list that no table here
decides fails its test. Two demo-pair servers: MTP (``--block-size 3``, batched) and
``--no-mtp`` (mlx-lm's plain decode, one request at a time): a field that changes the text gives
the same text, and the same logprobs, on both.
"""

import inspect
import json
import re
import urllib.error
import urllib.request

import pytest

from benchmarks.harness.server_process import ServerProcess
from mlx_mtp.demo import DEMO_MODEL_ID
from mlx_mtp.generate import DEFAULT_PROMPT
from mlx_mtp.server.schema import DEFAULT_ONLY

pytestmark = pytest.mark.subprocess

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

N = 16
CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
MESSAGES = "/v1/messages"
BASE = {CHAT: {"messages": [{"role": "user", "content": "class Stack:"}], "max_tokens": N,
               "temperature": 0},
        TEXT: {"prompt": DEFAULT_PROMPT, "max_tokens": N, "temperature": 0},
        MESSAGES: {"model": "m", "messages": [{"role": "user", "content": "class Stack:"}],
                   "max_tokens": N, "temperature": 0}}


def openai_fields(module) -> list:
    return sorted(set(module.CompletionCreateParamsNonStreaming.__annotations__)
                  | set(module.CompletionCreateParamsStreaming.__annotations__))


def mlx_lm_fields() -> list:
    """The fields mlx_lm.server's handler reads from a body."""
    import mlx_lm.server

    return sorted(set(re.findall(r'body\.get\(\s*"(\w+)"',
                                 inspect.getsource(mlx_lm.server.APIHandler))))


def anthropic_fields() -> list:
    from anthropic.types import message_create_params as m

    return sorted(set(m.MessageCreateParamsNonStreaming.__annotations__)
                  | set(m.MessageCreateParamsStreaming.__annotations__))


class Server(ServerProcess):
    def __init__(self, *args):
        super().__init__("--log-level", "warning", "--max-queue", "8", *args)

    def raw(self, path: str, body: dict):
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def ask(self, path: str, **fields) -> dict:
        """A 200's body for the path's base request with ``fields``."""
        status, raw = self.raw(path, {**BASE[path], **fields})
        assert status == 200, raw
        return json.loads(raw)

    def events(self, path: str, **fields) -> list:
        """A streamed answer's data events, parsed."""
        status, raw = self.raw(path, {**BASE[path], "stream": True, **fields})
        assert status == 200, raw
        lines = [line[len("data: "):] for line in raw.decode().split("\n")
                 if line.startswith("data: ")]
        return [json.loads(line) for line in lines if line != "[DONE]"]


@pytest.fixture(scope="module")
def mtp():
    s = Server("--block-size", "3")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def plain():
    s = Server("--no-mtp")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tok():
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlx_mtp.demo import DEMO_DIR

    return load_tokenizer(DEMO_DIR)


def text(body: dict) -> str:
    if body.get("type") == "message":
        return "".join(b["text"] for b in body["content"] if b["type"] == "text")
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


class Sweep:
    """One endpoint's checks over both servers."""

    def __init__(self, path, mtp, plain, tok):
        self.path, self.mtp, self.plain, self.tok = path, mtp, plain, tok
        self.base = mtp.ask(path)
        self.baseline = text(self.base)
        assert self.baseline and self.base["mtp"]["mtp_enabled"] is True

    def ask(self, **fields) -> dict:
        return self.mtp.ask(self.path, **fields)

    def refused(self, name, value, message=None):
        status, raw = self.mtp.raw(self.path, {**BASE[self.path], name: value})
        error = json.loads(raw)["error"]
        assert status == 400, (name, raw)
        if self.path == MESSAGES:
            assert error["type"] == "invalid_request_error"
        else:
            assert error["param"] == name
        assert error["message"].startswith(name), error["message"]
        if message is not None:
            assert error["message"] == message

    def changes_text(self, control=None, **fields) -> dict:
        """The text differs from the base request's (or ``control``'s: the same without what is
        tested), and is plain decode's."""
        got = self.ask(**fields)
        assert text(got) != (self.baseline if control is None else text(self.ask(**control)))
        assert text(got) == text(self.plain.ask(self.path, **fields)), fields
        assert got["mtp"]["mtp_enabled"] is True
        return got

    def same_text(self, **fields) -> dict:
        got = self.ask(**fields)
        assert text(got) == self.baseline, fields
        return got

    def sampled(self, seeds=range(4), **fields) -> list:
        return [text(self.ask(temperature=1.0, seed=seed, **fields)) for seed in seeds]


# --------------------------------------------------------------------------- what each field does


def check_baseline(s: Sweep):
    assert s.baseline == text(s.plain.ask(s.path))
    usage = s.base["usage"]
    assert usage.get("completion_tokens", usage.get("output_tokens")) == N


def check_model(s: Sweep):  # any name gets the one served model, and the answer names it
    got = s.same_text(model="gpt-4o")
    assert got["model"] == DEMO_MODEL_ID


def check_max_tokens(s: Sweep, name="max_tokens"):
    got = s.ask(**{name: 5})
    usage = got["usage"]
    assert usage.get("completion_tokens", usage.get("output_tokens")) == 5
    assert s.baseline.startswith(text(got)) and len(text(got)) < len(s.baseline)


def check_bias(s: Sweep):
    x = s.tok.encode("x", add_special_tokens=False)
    assert len(x) == 1
    got = s.changes_text(logit_bias={str(x[0]): 100})
    assert text(got) == "x" * N


def check_seed(s: Sweep):
    texts = s.sampled()
    assert s.sampled(seeds=[2]) == texts[2:3]  # the same seed, the same text
    assert len(set(texts)) > 1


def check_temperature(s: Sweep):
    assert any(t != s.baseline for t in s.sampled())


def check_greedy_filter(name, value):
    def check(s: Sweep):  # at T=1 the filter leaves one token: the greedy text
        assert s.sampled(**{name: value}) == [s.baseline] * 4
    return check


STOPS = ("(", "self", ":", " class", " current", " is", " the")


def check_stop(s: Sweep):
    """A stop string met in the text (one token's text; mlx-lm matches stop strings by their
    ids): the text ends before it."""
    for stop in STOPS:
        got = s.ask(stop=[stop, "never appears"])
        if got["choices"][0]["finish_reason"] == "stop":
            assert s.baseline.startswith(text(got) + stop)
            assert got["usage"]["completion_tokens"] < N
            return
    raise AssertionError(f"no stop string met in {s.baseline!r}")


def check_stream(s: Sweep):
    chunks = s.mtp.events(s.path)
    parts = [c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or ""
             for c in chunks]
    assert "".join(parts) == s.baseline
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def check_stream_options(s: Sweep):
    chunks = s.mtp.events(s.path, stream_options={"include_usage": True})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == N
    assert chunks[-1]["mtp"]["mtp_enabled"] is True
    assert "usage" not in chunks[-2]
    s.refused("stream_options", {"include_usage": True},
              "stream_options.include_usage needs stream: true")


def check_n(s: Sweep):
    got = s.ask(n=2)
    assert [c["index"] for c in got["choices"]] == [0, 1]
    assert [text({"choices": [c]}) for c in got["choices"]] == [s.baseline] * 2
    assert got["usage"]["completion_tokens"] == 2 * N
    assert [m["batched"] for m in got["mtp"]] == [True, True]


def check_chat_logprobs(s: Sweep):
    got = s.ask(logprobs=True)
    entries = got["choices"][0]["logprobs"]["content"]
    assert len(entries) == N and all(e["logprob"] <= 0 and e["top_logprobs"] == []
                                     for e in entries)
    assert "".join(e["token"] for e in entries) in (s.baseline, " " + s.baseline)
    assert got["choices"][0]["logprobs"] == s.plain.ask(s.path, logprobs=True)["choices"][0][
        "logprobs"]


def check_chat_top_logprobs(s: Sweep):
    got = s.ask(logprobs=True, top_logprobs=3)
    for e in got["choices"][0]["logprobs"]["content"]:
        top = e["top_logprobs"]
        assert len(top) == 3 and [t["logprob"] for t in top] == sorted(
            [t["logprob"] for t in top], reverse=True)
        assert (top[0]["id"], top[0]["logprob"]) == (e["id"], e["logprob"])  # greedy: the top
    assert got["choices"][0]["logprobs"] == s.plain.ask(
        s.path, logprobs=True, top_logprobs=3)["choices"][0]["logprobs"]


def check_text_logprobs(s: Sweep):
    got = s.ask(logprobs=2)["choices"][0]["logprobs"]
    # the tokens' texts make the text (the detokenizer drops a leading space, as mlx-lm's)
    assert len(got["tokens"]) == N and "".join(got["tokens"]) in (s.baseline, " " + s.baseline)
    assert got["text_offset"] == [len("".join(got["tokens"][:i])) for i in range(N)]
    for lp, top in zip(got["token_logprobs"], got["top_logprobs"]):
        assert len(top) <= 2 and lp == max(top.values())
    assert got == s.plain.ask(s.path, logprobs=2)["choices"][0]["logprobs"]


# Negative: the demo pair's 16-token answers here repeat no token, so only a penalty that favours
# the tokens already there changes them
PENALTY = -2.0


def check_context_size(penalty, name):
    def check(s: Sweep):
        s.changes_text(control={penalty: PENALTY}, **{penalty: PENALTY, name: 1})
    return check


REFUSE_ANY = {  # a value for each field the server does not implement
    "audio": {"voice": "alloy", "format": "wav"}, "function_call": "auto",
    "functions": [{"name": "f", "parameters": {}}], "metadata": {"k": "v"},
    "moderation": {"enabled": True}, "prediction": {"type": "content", "content": "x"},
    "prompt_cache_key": "k", "prompt_cache_options": {"ttl": 60},
    "prompt_cache_retention": "24h", "reasoning_effort": "low", "safety_identifier": "u1",
    "service_tier": "flex", "user": "u1", "verbosity": "low", "web_search_options": {},
    "suffix": "\n", "xtc_threshold": 0.2, "adapters": "lora", "draft_model": "small",
    "num_draft_tokens": 3,
    # implemented only at the value that asks for the default
    "store": True, "parallel_tool_calls": False, "response_format": {"type": "json_object"},
    "modalities": ["text", "audio"], "echo": True, "xtc_probability": 0.5, "best_of": 3,
    # the demo pair's tokenizer has no chat template: test_tool_calls.py honours these
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "tool_choice": "auto", "chat_template_kwargs": {"enable_thinking": False},
}

HONOURED = {
    "messages": check_baseline, "prompt": check_baseline, "model": check_model,
    "max_tokens": check_max_tokens,
    "max_completion_tokens": lambda s: check_max_tokens(s, "max_completion_tokens"),
    "frequency_penalty": lambda s: s.changes_text(frequency_penalty=PENALTY),
    "presence_penalty": lambda s: s.changes_text(presence_penalty=PENALTY),
    "repetition_penalty": lambda s: s.changes_text(repetition_penalty=0.0),  # the demo's is 1.3
    "repetition_context_size": lambda s: s.changes_text(repetition_context_size=1),
    "presence_context_size": check_context_size("presence_penalty", "presence_context_size"),
    "frequency_context_size": check_context_size("frequency_penalty", "frequency_context_size"),
    "logit_bias": check_bias, "seed": check_seed, "temperature": check_temperature,
    "top_p": check_greedy_filter("top_p", 1e-9), "top_k": check_greedy_filter("top_k", 1),
    "min_p": check_greedy_filter("min_p", 1.0), "stop": check_stop, "stream": check_stream,
    "stream_options": check_stream_options, "n": check_n,
}
HONOURED_CHAT = {"logprobs": check_chat_logprobs, "top_logprobs": check_chat_top_logprobs,
                 "role_mapping": lambda s: s.changes_text(
                     role_mapping={"user": "Q: ", "assistant": "A: ", "stop": "\n"})}
HONOURED_TEXT = {"logprobs": check_text_logprobs}


def decide(path, name, sweep_of):
    honoured = {**HONOURED, **(HONOURED_CHAT if path == CHAT else HONOURED_TEXT)}
    assert (name in honoured) != (name in REFUSE_ANY), f"{name}: no decision, or two"
    s = sweep_of(path)
    if name in honoured:
        honoured[name](s)
    else:
        s.refused(name, REFUSE_ANY[name])


@pytest.fixture(scope="module")
def sweep_of(mtp, plain, tok):
    sweeps = {}

    def get(path):
        if path not in sweeps:
            sweeps[path] = Sweep(path, mtp, plain, tok)
        return sweeps[path]
    return get


@pytest.mark.parametrize("name", openai_fields(
    pytest.importorskip("openai.types.chat.completion_create_params")))
def test_every_openai_chat_field_is_honoured_or_refused(sweep_of, name):
    decide(CHAT, name, sweep_of)


@pytest.mark.parametrize("name", openai_fields(
    pytest.importorskip("openai.types.completion_create_params")))
def test_every_openai_completions_field_is_honoured_or_refused(sweep_of, name):
    decide(TEXT, name, sweep_of)


@pytest.mark.parametrize("name", mlx_lm_fields())
def test_every_mlx_lm_server_field_is_honoured_or_refused(sweep_of, name):
    decide(CHAT, name, sweep_of)


def test_a_field_no_endpoint_knows_is_refused(sweep_of):
    sweep_of(CHAT).refused("tempreature", 0.5,
                           "tempreature is not a field of POST /v1/chat/completions")
    sweep_of(TEXT).refused("messages", [], "messages is not a field of POST /v1/completions")


@pytest.mark.parametrize("name", sorted(DEFAULT_ONLY))
def test_a_default_only_field_at_its_default_is_the_default(sweep_of, name):
    sweep_of(CHAT).same_text(**{name: DEFAULT_ONLY[name][0]})


def test_seeded_choices_are_the_seeds_one_after_another(plain):
    """n sequential generations on a server that decodes one request at a time: choice i is the
    request with seed + i."""
    got = plain.ask(TEXT, n=3, seed=5, temperature=1.0)
    alone = [text(plain.ask(TEXT, seed=5 + i, temperature=1.0)) for i in range(3)]
    assert [text({"choices": [c]}) for c in got["choices"]] == alone
    assert len(set(alone)) > 1


def test_n_choices_stream_each_under_its_index(mtp):
    chunks = mtp.events(CHAT, n=3, seed=1, temperature=1.0,
                        stream_options={"include_usage": True})
    texts, finished = ["", "", ""], [None] * 3
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        texts[choice["index"]] += choice["delta"].get("content") or ""
        finished[choice["index"]] = choice["finish_reason"] or finished[choice["index"]]
    assert finished == ["length"] * 3 and all(texts)
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 3 * N and len(chunks[-1]["mtp"]) == 3


# ------------------------------------------------------------------------------ Anthropic's


ANTHROPIC_REFUSE = {
    "container": "c1", "diagnostics": {},
    "inference_geo": "us", "output_config": {"effort": "low"},
    "service_tier": "auto", "speed": "fast", "thinking": {"type": "enabled",
                                                          "budget_tokens": 1024},
    "user_profile_id": "p1", "workspace_id": "w1",
    # the demo pair's tokenizer has no tool format: test_tool_calls.py honours these
    "tools": [{"name": "f", "input_schema": {"type": "object"}}],
    "tool_choice": {"type": "auto"},
}


def messages_prompt(body: dict) -> int:
    """A Messages answer's prompt tokens: those prefilled and those read from the cache."""
    return body["usage"]["input_tokens"] + body["usage"]["cache_read_input_tokens"]


def check_system(s: Sweep):
    got = s.ask(system="You write Python.")
    chat = s.mtp.ask(CHAT, messages=[{"role": "system", "content": "You write Python."},
                                     *BASE[CHAT]["messages"]])
    assert text(got) == text(chat) and messages_prompt(got) == chat["usage"][
        "prompt_tokens"] > messages_prompt(s.base)


def check_stop_sequences(s: Sweep):
    for stop in STOPS:
        got = s.ask(stop_sequences=["never appears", stop])
        if got["stop_reason"] == "stop_sequence":
            assert got["stop_sequence"] == stop and s.baseline.startswith(text(got) + stop)
            return
    raise AssertionError(f"no stop sequence met in {s.baseline!r}")


def check_anthropic_stream(s: Sweep):
    events = s.mtp.events(MESSAGES)
    kinds = [e["type"] for e in events]
    assert kinds == ["message_start", "content_block_start"] + ["content_block_delta"] * (
        len(kinds) - 5) + ["content_block_stop", "message_delta", "message_stop"]
    assert "".join(e["delta"]["text"] for e in events[2:-3]) == s.baseline
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"


def check_anthropic_messages(s: Sweep):  # the same prompt, the same text as the chat route
    check_baseline(s)
    chat = s.mtp.ask(CHAT)
    assert text(chat) == s.baseline
    assert chat["usage"]["prompt_tokens"] == messages_prompt(s.base)


EPHEMERAL = {"type": "ephemeral"}


def check_cache_control(s: Sweep):
    """Agents mark cache breakpoints on the request, the system and message blocks: accepted,
    the same answer (the prompt cache keeps every prefix unasked); a malformed mark is refused."""
    s.same_text(cache_control=EPHEMERAL)
    marked = [{"role": "user", "content": [{"type": "text", "text": "class Stack:",
                                            "cache_control": {**EPHEMERAL, "ttl": "5m"}}]}]
    system = [{"type": "text", "text": "You write Python.", "cache_control": EPHEMERAL}]
    got = s.ask(messages=marked, system=system)
    assert text(got) == text(s.ask(system="You write Python."))
    s.refused("cache_control", {"type": "persistent"},
              'cache_control must be {"type": "ephemeral"} (optionally with a "ttl" string), '
              'got {"type": "persistent"}')
    status, raw = s.mtp.raw(s.path, {**BASE[s.path], "messages": [
        {"role": "user", "content": [{"type": "text", "text": "x", "cache_control": "yes"}]}]})
    assert status == 400 and json.loads(raw)["error"]["message"].startswith(
        "messages[0].content[0].cache_control must be")


def check_metadata(s: Sweep):
    """``metadata.user_id`` names the caller: accepted, the same answer; anything else refused."""
    s.same_text(metadata={"user_id": "u1"})
    s.refused("metadata", {"tags": ["a"]})


ANTHROPIC_HONOURED = {
    "messages": check_anthropic_messages,
    "cache_control": check_cache_control, "metadata": check_metadata,
    "model": check_model, "max_tokens": check_max_tokens, "system": check_system,
    "stop_sequences": check_stop_sequences, "stream": check_anthropic_stream,
}


@pytest.mark.parametrize("name", anthropic_fields())
def test_every_anthropic_messages_field_is_honoured_or_refused(sweep_of, name):
    assert (name in ANTHROPIC_HONOURED) != (name in ANTHROPIC_REFUSE), name
    s = sweep_of(MESSAGES)
    if name in ANTHROPIC_HONOURED:
        ANTHROPIC_HONOURED[name](s)
    else:
        s.refused(name, ANTHROPIC_REFUSE[name])


@pytest.mark.parametrize("name,value", [("temperature", 1.0), ("top_p", 1e-9), ("top_k", 1)])
def test_anthropic_sampling_fields(sweep_of, name, value):
    """The anthropic client sends them through ``extra_body``: honoured as on the OpenAI
    routes."""
    s = sweep_of(MESSAGES)
    texts = s.sampled(**({} if name == "temperature" else {name: value}))
    if name == "temperature":
        assert any(t != s.baseline for t in texts)
    else:
        assert texts == [s.baseline] * 4
