"""Tool calls through the server, with the openai and the anthropic clients, on an oracle target.

The target is ``support.scripted_target``'s: a tiny checkpoint whose greedy output after a chat
prompt is a given script, its tokenizer carrying Qwen3-4B's published chat template
(``tests/data/qwen3_4b_chat_template.json``), for which mlx-lm picks its ``json_tools`` parser.
The script thinks, says a word, then calls a tool; the server decodes it with MTP (drafts
accepted), and the clients get the call parsed: ``tool_calls`` (OpenAI), a ``tool_use`` block
(Anthropic), whole and streamed. Tool results and earlier calls go back through the template.
"""

import json
from pathlib import Path

import pytest
from support.scripted_target import write_scripted_checkpoint

from benchmarks.harness.server_process import ServerProcess

pytestmark = pytest.mark.subprocess

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

TEMPLATE = json.loads((Path(__file__).parents[1] / "data" / "qwen3_4b_chat_template.json")
                      .read_text())
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
THOUGHT, SAID = "Weather needed.", "Checking."
SCRIPT = [THOUGHT, "</think>", SAID, "<tool_call>", json.dumps(CALL), "</tool_call>"]
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("scripted") / "qwen3-tools"
    write_scripted_checkpoint(path, SCRIPT, TEMPLATE["chat_template"], TEMPLATE["eos_token"])
    return path


@pytest.fixture(scope="module")
def tok(checkpoint):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    t = load_tokenizer(checkpoint)
    assert t.has_tool_calling and t.tool_call_start == "<tool_call>"
    return t


@pytest.fixture(scope="module")
def server(checkpoint):
    s = ServerProcess("--model", str(checkpoint), "--block-size", "3", "--log-level",
                      "warning")
    s.openai = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0,
                             timeout=120)
    s.anthropic = anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0,
                                      timeout=120)
    yield s
    s.stop()


def render(tok, messages, tools=None) -> list:
    ids = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                  tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def prompt_tokens(tok, messages, tools=None) -> int:
    return len(render(tok, messages, tools))


def templated(messages) -> list:
    """The messages as the template gets them: tool-call arguments parsed (mlx_lm.server)."""
    return [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(
        c["function"]["arguments"])}} for c in m["tool_calls"]]} if m.get("tool_calls") else m
        for m in messages]


# ------------------------------------------------------------------------------------ OpenAI


def test_a_call_comes_back_as_tool_calls(server, tok):
    r = server.openai.chat.completions.create(model="m", messages=ASK, tools=[TOOL],
                                              max_tokens=32)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == SAID
    assert choice.message.model_extra["reasoning"] == THOUGHT
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == (
        CALL["name"], CALL["arguments"])
    # the tools reached the template; every script token was generated, with drafts accepted
    assert r.usage.prompt_tokens == prompt_tokens(tok, ASK, [TOOL])
    assert r.usage.completion_tokens == len(SCRIPT) + 1  # and EOS
    assert r.model_extra["mtp"]["mtp_enabled"] and r.model_extra["mtp"]["acceptance_rate"] > 0


def test_a_streamed_call_comes_in_a_tool_calls_delta(server):
    chunks = list(server.openai.chat.completions.create(model="m", messages=ASK, tools=[TOOL],
                                                        max_tokens=32, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning") or ""
                        for c in chunks)
    calls = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert (content, reasoning) == (SAID, THOUGHT)
    (call,) = calls
    assert call.index == 0 and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == (
        CALL["name"], CALL["arguments"])
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"


def test_tool_choice_none_withholds_the_tools_and_leaves_the_text(server, tok):
    r = server.openai.chat.completions.create(model="m", messages=ASK, tools=[TOOL],
                                              tool_choice="none", max_tokens=32)
    (choice,) = r.choices
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content == SAID + "<tool_call>" + json.dumps(CALL) + "</tool_call>"
    assert r.usage.prompt_tokens == prompt_tokens(tok, ASK) < prompt_tokens(tok, ASK, [TOOL])


def test_calls_and_results_go_back_through_the_template(server, tok):
    """An assistant's tool_calls and the tool's answer are laid out by the template."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(CALL["arguments"])}}
    messages = ASK + [{"role": "assistant", "content": "", "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]
    server.openai.chat.completions.create(model="m", messages=ASK, tools=[TOOL], max_tokens=32)
    r = server.openai.chat.completions.create(model="m", messages=messages, tools=[TOOL],
                                              max_tokens=32)
    # The turn before (the same tools) left its prompt in the prompt cache, up to where this
    # turn renders it otherwise, less that part's last token (prompt_reuse's checkpoints).
    first, now = render(tok, ASK, [TOOL]), render(tok, templated(messages), [TOOL])
    shared = next(i for i, (a, b) in enumerate(zip(first, now)) if a != b)
    assert r.usage.prompt_tokens_details.cached_tokens == shared - 1
    text = tok.apply_chat_template(templated(messages), tools=[TOOL],
                                   add_generation_prompt=True, tokenize=False)
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in text
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert r.usage.prompt_tokens == prompt_tokens(tok, templated(messages), [TOOL])
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_tools_are_refused_when_malformed(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.openai.chat.completions.create(model="m", messages=ASK, max_tokens=4,
                                              tools=[{"type": "function", "function": {}}])
    assert e.value.body["param"] == "tools"
    assert e.value.body["message"].startswith("tools[0] must be {\"type\": \"function\"")
    with pytest.raises(openai.BadRequestError) as e:
        server.openai.chat.completions.create(model="m", messages=ASK, max_tokens=4,
                                              tools=[TOOL], tool_choice="required")
    assert e.value.body["message"] == ('tool_choice must be "auto" or "none" (mlx_mtp.server '
                                       'cannot force a tool call), got "required"')


# --------------------------------------------------------------------------------- Anthropic

ANTHROPIC_TOOL = {"name": "get_weather", "description": "The weather in a city.",
                  "input_schema": TOOL["function"]["parameters"]}


def prompt_of(usage) -> int:
    """Anthropic's count of a prompt: the tokens prefilled and those read from the cache."""
    return usage.input_tokens + usage.cache_read_input_tokens


def test_anthropic_usage_counts_the_prompt_cache_as_anthropic_does(server, tok):
    """A prompt sent again is read from the prompt cache: ``input_tokens`` counts only what
    was prefilled, as Anthropic's usage does, and the two make the prompt."""
    ask = [{"role": "user", "content": "And in Rome?"}]
    first = server.anthropic.messages.create(model="m", max_tokens=32, messages=ask,
                                             tools=[ANTHROPIC_TOOL])
    again = server.anthropic.messages.create(model="m", max_tokens=32, messages=ask,
                                             tools=[ANTHROPIC_TOOL])
    prompt = prompt_tokens(tok, ask, [TOOL])
    assert prompt_of(first.usage) == prompt_of(again.usage) == prompt
    assert again.usage.cache_read_input_tokens > first.usage.cache_read_input_tokens
    assert again.usage.input_tokens < first.usage.input_tokens
    assert again.usage.cache_creation_input_tokens == 0
    assert again.content == first.content[:2] + [again.content[2]]  # (a fresh tool_use id)


def test_anthropic_gets_a_tool_use_block(server, tok):
    m = server.anthropic.messages.create(model="m", max_tokens=32, messages=ASK,
                                         tools=[ANTHROPIC_TOOL])
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
    assert m.content[0].thinking == THOUGHT and m.content[1].text == SAID
    use = m.content[2]
    assert (use.name, use.input) == (CALL["name"], CALL["arguments"])
    assert m.stop_reason == "tool_use" and m.stop_sequence is None
    assert prompt_of(m.usage) == prompt_tokens(tok, ASK, [TOOL])
    assert m.usage.output_tokens == len(SCRIPT) + 1


def test_anthropic_tool_choice_none_ends_the_turn_with_the_text(server, tok):
    m = server.anthropic.messages.create(model="m", max_tokens=32, messages=ASK,
                                         tools=[ANTHROPIC_TOOL], tool_choice={"type": "none"})
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[1].text == SAID + "<tool_call>" + json.dumps(CALL) + "</tool_call>"
    assert m.stop_reason == "end_turn" and prompt_of(m.usage) == prompt_tokens(tok, ASK)


def test_anthropic_streams_the_same_blocks(server):
    whole = server.anthropic.messages.create(model="m", max_tokens=32, messages=ASK,
                                             tools=[ANTHROPIC_TOOL])
    with server.anthropic.messages.stream(model="m", max_tokens=32, messages=ASK,
                                          tools=[ANTHROPIC_TOOL]) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    strip = [{k: v for k, v in b.model_dump().items() if k != "id"} for b in final.content]
    assert strip == [{k: v for k, v in b.model_dump().items() if k != "id"}
                     for b in whole.content]
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == len(SCRIPT) + 1
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 3


def test_anthropic_tool_results_match_the_openai_conversation(server):
    """A tool_use block and its tool_result are the same prompt as OpenAI's tool_calls and
    tool message."""
    m = server.anthropic.messages.create(model="m", max_tokens=32, system="Be brief.", tools=[
        ANTHROPIC_TOOL], messages=ASK + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1",
                                           "name": "get_weather", "input": CALL["arguments"]}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                      "content": "Sunny, 21 C"}]}])
    r = server.openai.chat.completions.create(model="m", max_tokens=32, tools=[TOOL], messages=[
        {"role": "system", "content": "Be brief."}, *ASK,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps(CALL["arguments"])}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}])
    assert prompt_of(m.usage) == r.usage.prompt_tokens
    assert m.content[-1].type == "tool_use" and m.stop_reason == "tool_use"


def test_anthropic_refusals_name_the_field(server):
    with pytest.raises(anthropic.BadRequestError) as e:
        server.anthropic.messages.create(model="m", max_tokens=8, messages=ASK,
                                         tools=[ANTHROPIC_TOOL], tool_choice={"type": "any"})
    assert e.value.body["error"]["message"].startswith("tool_choice must be")
    with pytest.raises(anthropic.BadRequestError) as e:
        server.anthropic.messages.create(model="m", max_tokens=8, messages=ASK,
                                         thinking={"type": "enabled", "budget_tokens": 1024})
    assert e.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "thinking is not supported by "
        "mlx_mtp.server (thinking budgets: the chat template decides (chat_template_kwargs))"}}


def test_anthropic_tool_with_a_cache_breakpoint_is_the_same_tool(server):
    """Agents mark the last tool with ``cache_control``: the same prompt, the same tool call."""
    marked = {**ANTHROPIC_TOOL, "cache_control": {"type": "ephemeral"}}
    plain = server.anthropic.messages.create(model="m", max_tokens=32, messages=ASK,
                                             tools=[ANTHROPIC_TOOL])
    got = server.anthropic.messages.create(model="m", max_tokens=32, messages=ASK,
                                           tools=[marked])
    assert [b.type for b in got.content] == [b.type for b in plain.content]
    assert (got.content[2].name, got.content[2].input) == (plain.content[2].name,
                                                           plain.content[2].input)
    assert prompt_of(got.usage) == prompt_of(plain.usage)
