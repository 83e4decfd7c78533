"""``python -m mlx_mtp.server``'s prompt cache across requests, as chat apps meet it: the ``openai``
client resends the whole conversation every turn. The reference for every text is a server with
the cache off (``--prompt-cache-bytes 0``), which prefills every prompt in full; each response
says how many prompt tokens came from the cache (``usage.prompt_tokens_details.cached_tokens``)
and the round loop's own count of the tokens it prefilled (``mtp.prefilled_tokens``)."""

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from support.processes import run_module

import mlx_mtp
from benchmarks.harness.server_process import ServerProcess
from mlx_mtp.demo import demo_path
from mlx_mtp.server.engine import Engine
from mlx_mtp.server.prompt_reuse import shared_length

pytestmark = pytest.mark.subprocess

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

SYSTEM = ("You are a senior Python engineer pairing with a colleague. Answer with short, working "
          "code and no prose. Prefer the standard library, type hints and small functions. "
          "Keep every answer under twenty lines.")
USERS = ["Write a stack class.", "Add a size method.", "Now a queue class.", "Add a peek method.",
         "Make both generic.", "Write a test for the stack.", "Write a test for the queue.",
         "Add docstrings.", "Add a clear method to both.", "Show a short usage example."]
ANSWER_TOKENS = 24
TEXT = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"


class Server(ServerProcess):
    def __init__(self, *args):
        super().__init__("--log-level", "warning", *args)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0,
                                    timeout=300)

    def chat(self, messages, stream=False, max_tokens=ANSWER_TOKENS):
        """``(text, usage, mtp)`` of one chat completion at T=0 (streamed: from its chunks and
        its usage chunk)."""
        r = self.client.chat.completions.create(
            model="demo", messages=messages, max_tokens=max_tokens, temperature=0, stream=stream,
            **({"stream_options": {"include_usage": True}} if stream else {}))
        if not stream:
            return r.choices[0].message.content, r.usage, r.model_extra["mtp"]
        parts, last = [], None
        for chunk in r:
            last = chunk
            parts += [c.delta.content or "" for c in chunk.choices]
        return "".join(parts), last.usage, last.model_extra["mtp"]

    def complete(self, prompt, max_tokens=8):
        r = self.client.completions.create(model="demo", prompt=prompt, max_tokens=max_tokens,
                                           temperature=0)
        return r.choices[0].text, r.usage, r.model_extra["mtp"]


@pytest.fixture(scope="module")
def cached():
    """The default server: the cache on, requests decoded in batched rounds."""
    s = Server()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cold():
    s = Server("--prompt-cache-bytes", "0")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def render():
    """The server's own rendering of chat messages into prompt ids (the demo pair's tokenizer)."""
    tok = mlx_mtp.load(str(demo_path()))[1]
    return Engine(SimpleNamespace(config={}), tok)._render_chat


def cached_of(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def conversation(server, users, stream_every=2):
    """Each turn resends the system message, every user message so far and the server's own
    earlier answers; every ``stream_every``-th turn streams. Per turn ``(text, usage, mtp)``."""
    messages, turns = [{"role": "system", "content": SYSTEM}], []
    for i, user in enumerate(users):
        messages.append({"role": "user", "content": user})
        turns.append(server.chat(messages, stream=i % stream_every == 1))
        messages.append({"role": "assistant", "content": turns[-1][0]})
    return turns


def test_a_ten_turn_chat_reuses_its_history_and_says_the_same(cached, cold):
    """Every turn's text is the cold server's; each later turn prefills only what follows the
    previous turn's prompt (the round loop's own count: cached + prefilled = the prompt), from
    the fifth turn on at least 90% of the prompt comes from the cache; the cold server reports
    none cached and prefills everything."""
    got = conversation(cached, USERS)
    want = conversation(cold, USERS)
    assert [t[0] for t in got] == [t[0] for t in want]
    assert len({t[0] for t in got}) > 5  # the turns' answers differ
    for (_, usage, mtp), (_, cold_usage, cold_mtp) in zip(got, want):
        assert usage.prompt_tokens == cold_usage.prompt_tokens
        assert cached_of(usage) + mtp["prefilled_tokens"] == usage.prompt_tokens
        assert (cached_of(cold_usage), cold_mtp["prefilled_tokens"]) == (0, usage.prompt_tokens)
        assert mtp["mtp_enabled"] and mtp["batched"]
    usages = [u for _, u, _ in got]
    assert cached_of(usages[0]) == 0
    for before, now in zip(usages, usages[1:]):
        assert cached_of(now) >= before.prompt_tokens - 1, (before, now)
    # An answer that begins with a newline is re-rendered merged with the template's newline, so
    # the next turn reuses only the prompt before it (the demo pair's third answer does)
    assert all(cached_of(u) >= 0.9 * u.prompt_tokens for u in usages[4:]), usages
    assert usages[-1].prompt_tokens > 400


def test_concurrent_conversations_in_batched_rounds(cached, cold, render):
    """Four conversations with one system message, their turns in the same batched rounds: each
    text is the cold server's; each later turn reuses its own history, and a conversation's first
    turn reuses the system message another one left (its checkpoint)."""
    users = [[f"Write a {name} class.", "Add a size method.", "Add a clear method."]
             for name in ("stack", "queue", "deque", "heap")]
    first = conversation(cached, users[0][:1])  # alone, so its system checkpoint is kept first
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda u: conversation(cached, u, stream_every=3), users[1:]))
    want = [conversation(cold, u) for u in users]
    assert [t[0] for t in first] == [t[0] for t in want[0][:1]]
    assert [[t[0] for t in c] for c in got] == [[t[0] for t in c] for c in want[1:]]
    system_point = shared_length(
        render([{"role": "system", "content": SYSTEM}, {"role": "user", "content": users[1][0]}]),
        render([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}]))
    for c in got:
        usages = [u for _, u, _ in c]
        assert cached_of(usages[0]) == system_point - 1
        for before, now in zip(usages, usages[1:]):
            assert cached_of(now) >= before.prompt_tokens - 1
        assert all(m["batched"] for _, _, m in c)
    # the batch's chooser measured rounds of several sequences: they were verified together
    assert any(int(size) >= 2 for size in cached.get("/health")["batch"]["drafts"])


def test_an_edited_message_reuses_what_comes_before_it(cached, cold, render):
    """A client that edits an earlier message: the prompt diverges inside the history, and the
    cache serves the longest kept point before the divergence (never past it)."""
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Write a linked list class."}]
    a1 = cached.chat(messages)[0]
    messages += [{"role": "assistant", "content": a1}, {"role": "user", "content": "Add len."}]
    turn2 = render(messages)
    cached.chat(messages)
    messages[-1] = {"role": "user", "content": "Add a reverse method instead."}
    edited = render(messages)
    text, usage, mtp = cached.chat(messages)
    assert text == cold.chat(messages)[0]
    first_prompt = render(messages[:2])
    assert len(first_prompt) - 1 <= cached_of(usage) <= shared_length(turn2, edited)
    assert cached_of(usage) + mtp["prefilled_tokens"] == usage.prompt_tokens == len(edited)


def test_a_prompt_that_diverges_inside_a_kept_one_prefills_in_full(cached, cold):
    """The demo pair's GatedDeltaNet layers keep one state: a kept cache cannot be cut back to
    where a new prompt leaves it, so a prompt that shares only the first half of a kept prompt
    (no checkpoint there) prefills in full."""
    head = "import os\nimport sys\n\n\ndef main(argv):\n    "
    cached.complete(head + "print(argv)\n")
    text, usage, mtp = cached.complete(head + "return len(argv)\n")
    assert (cached_of(usage), mtp["prefilled_tokens"]) == (0, usage.prompt_tokens)
    assert text == cold.complete(head + "return len(argv)\n")[0]
    again = cached.complete(head + "return len(argv)\n")[1]  # the same prompt: all but one
    assert cached_of(again) == again.prompt_tokens - 1


def test_entries_past_the_byte_bound_are_evicted():
    """Room for two entries (a checkpoint and a finished request of a short prompt): a second
    prompt pushes the first one's out, and the first prompt then prefills in full; one request
    at a time (the cache without batched rounds)."""
    with Server("--prompt-cache-bytes", "5M", "--max-batch", "1") as s:
        text, usage, _ = s.complete(TEXT)
        entries = s.get("/health")["prompt_cache"]["entries"]
        n = usage.prompt_tokens
        assert [e["tokens"] for e in entries] == [n - 1, n + usage.completion_tokens]
        assert sum(e["bytes"] for e in entries) <= 5 * 10**6 < 3 * min(e["bytes"] for e in entries)
        again = s.complete(TEXT)
        assert again[0] == text and cached_of(again[1]) == n - 1
        other = s.complete("class Matrix:\n    def __init__(self, rows):\n")[1]
        assert cached_of(other) == 0
        health = s.get("/health")["prompt_cache"]
        assert [e["tokens"] for e in health["entries"]] == [
            other.prompt_tokens - 1, other.prompt_tokens + other.completion_tokens]
        assert health["bytes"] <= health["max_bytes"] == 5 * 10**6
        third, usage, mtp = s.complete(TEXT)
        assert (cached_of(usage), mtp["prefilled_tokens"]) == (0, n) and third == text
        assert mtp["batched"] is False


def test_the_cold_server_says_why_it_keeps_nothing(cold):
    assert cold.get("/health")["prompt_cache"] == {"enabled": False,
                                                   "reason": "off: --prompt-cache-bytes 0"}


@pytest.mark.parametrize("args, message", [
    (["--prompt-cache-bytes", "lots"], "error: argument --prompt-cache-bytes: expected a size in "
                                       "bytes such as 512M or 8G (0: none), got 'lots'"),
    (["--prompt-cache-bytes", "-1"], "error: argument --prompt-cache-bytes: expected a size in "
                                     "bytes such as 512M or 8G (0: none), got '-1'"),
    (["--no-mtp", "--prompt-cache-bytes", "1G"],
     "error: --prompt-cache-bytes: --no-mtp serves without a prompt cache (every prompt is "
     "prefilled in full); leave the flag out or pass 0"),
])
def test_bad_flag_values_are_one_line_errors(args, message):
    r = run_module("mlx_mtp.server", *args, check=False)
    assert r.returncode != 0 and r.stderr == message + "\n"
