"""``mlx.launch --backend ring -n 2 -- python -m mlx_mtp.server --split ...`` as a user meets it:
the real server on 2 local ranks (a tiny checkpoint whose head agrees with its target), talked to
with the ``openai`` client. Rank 0 serves; rank 1 follows it request by request.

The reference is one unsplit process's CLI (``python -m mlx_mtp.generate --json``, block 3, T=0):
the split server's gate must say its probe found the split target equal to the single-token
chain, and then its text is the CLI's. Then: the same prompt again, streamed, gives the same text
from every rank's prompt cache; a chat reuses its history on both ranks and says what one
process says; a client gone mid-stream stops both ranks and the next request is still exact;
SIGTERM to rank 0 ends every rank with exit 0; a killed rank 1 gives the client an error
response and ends the launch; a stopped (hung) rank 1 gives the client the watchdog's error in
bounded time.
"""

import json
import os
import re
import signal
import time

import pytest
from support.processes import run_module

from support import tiny_checkpoints as tc
from benchmarks.harness.server_process import ServerProcess

pytestmark = pytest.mark.subprocess  # every test runs rank processes (mlx.launch or by hand)

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

N = 16
CODE = "def add(a, b):\n    return"
TIMEOUT_S = 10  # MLX_MTP_DIST_TIMEOUT of the hung-rank test's server: the watchdog's bound
EQUAL = "equal the single-token chain byte for byte"


class SplitServer(ServerProcess):
    def __init__(self, model, split, **env):
        super().__init__("--model", model, "--block-size", 3, "--log-level", "warning",
                         split=split, env=dict(os.environ, **env))
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0,
                                    timeout=120)

    def complete(self, prompt=CODE, max_tokens=N, **kw):
        return self.client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens,
                                              temperature=0, **kw)

    def stream_first_chunk(self, max_tokens):
        """A long streamed request, once its first chunk arrived: the ranks are mid-decode."""
        stream = self.complete(max_tokens=max_tokens, stream=True)
        next(iter(stream))
        return stream


@pytest.fixture(scope="module")
def agree_dir(tmp_path_factory):
    return tc.write_agreeing_checkpoint(tmp_path_factory.mktemp("split_server") / "agree")


@pytest.fixture(scope="module")
def reference(agree_dir):
    r = run_module("mlx_mtp.generate", "--model", agree_dir, "--prompt", CODE, "--max-tokens",
                   N, "--block-size", 3, "--ignore-chat-template", "--json")
    return json.loads(r.stdout)


def _server(agree_dir, split):
    s = SplitServer(agree_dir, split)
    yield s
    if s.stop() is None:  # it had to be killed: say so after the test's own failure, if any
        pytest.fail(f"the {split} server did not stop within 30 s:\n{s.output()[-3000:]}")


@pytest.fixture(scope="module")
def pipeline_server(agree_dir):
    yield from _server(agree_dir, "pipeline")


@pytest.fixture(scope="module")
def tensor_server(agree_dir):
    yield from _server(agree_dir, "tensor")


def _assert_as_reference(text, mtp, reference, split):
    assert mtp["split"] == f"{split} over 2 ranks"
    assert mtp["mtp_enabled"] and EQUAL in mtp["gate_reason"]
    assert text == reference["text"]
    assert (mtp["rounds"], mtp["acceptance_rate"]) == (reference["rounds"],
                                                        reference["acceptance_rate"])
    # Rank 0's collectives: 2 per pipeline forward (the prefill's steps, 2 for the whole prompt
    # and 1 for its last token after the prompt cache, then one per round) plus one stop
    # exchange per round; a tensor forward has many.
    prefill_steps = 2 if mtp["prefilled_tokens"] > 1 else 1
    if split == "pipeline":
        assert mtp["split_messages_per_token"] == (
            2 * (prefill_steps + mtp["rounds"]) + mtp["rounds"]) / N


def _answers_as_one_process(server, reference):
    assert set(server.rank_pids()) == {0, 1}
    r = server.complete()
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == N
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    _assert_as_reference(r.choices[0].text, r.model_extra["mtp"], reference, server.split)
    # The same prompt streamed next, through the same ranks in the same order: every rank
    # starts from its prompt cache (all but the prompt's last token).
    chunks = list(server.complete(stream=True, stream_options={"include_usage": True}))
    text = "".join(c.text for ch in chunks for c in ch.choices)
    assert [c.finish_reason for ch in chunks for c in ch.choices][-1] == "length"
    usage, mtp = chunks[-1].usage, chunks[-1].model_extra["mtp"]
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    assert mtp["prefilled_tokens"] == 1
    _assert_as_reference(text, mtp, reference, server.split)


def test_pipeline_server_answers_as_one_process(pipeline_server, reference):
    _answers_as_one_process(pipeline_server, reference)


def test_tensor_server_answers_as_one_process(tensor_server, reference):
    _answers_as_one_process(tensor_server, reference)


def test_a_client_gone_mid_stream_stops_every_rank(pipeline_server, reference):
    """Rank 0's early stop reaches rank 1: the ranks stay in step for the next request."""
    stream = pipeline_server.stream_first_chunk(max_tokens=3000)
    stream.close()
    deadline = time.monotonic() + 30
    while pipeline_server.get("/health")["running"]:
        assert time.monotonic() < deadline, "the abandoned decode never stopped"
        time.sleep(0.1)
    r = pipeline_server.complete()
    _assert_as_reference(r.choices[0].text, r.model_extra["mtp"], reference, "pipeline")


def test_a_chat_reuses_its_history_on_every_rank(pipeline_server, agree_dir):
    """Four turns, each resending the conversation: each later turn takes at least the previous
    prompt from the cache on both ranks, and says what one process with no cache says."""
    def chat(client, messages):
        r = client.chat.completions.create(model="m", messages=messages, max_tokens=8,
                                           temperature=0)
        return r.choices[0].message.content, r.usage, r.model_extra["mtp"]

    users = ["def add(a, b):", "def sub(a, b):", "class Stack:", "def main():"]
    with ServerProcess("--model", agree_dir, "--block-size", 3, "--prompt-cache-bytes", 0,
                       "--log-level", "warning") as cold:
        cold.client = openai.OpenAI(base_url=cold.url + "/v1", api_key="none", max_retries=0,
                                    timeout=120)
        turns = {}
        for name, server in (("split", pipeline_server), ("cold", cold)):
            messages, turns[name] = [{"role": "system", "content": "Write code."}], []
            for user in users:
                messages.append({"role": "user", "content": user})
                turns[name].append(chat(server.client, messages))
                messages.append({"role": "assistant", "content": turns[name][-1][0]})
    assert [t[0] for t in turns["split"]] == [t[0] for t in turns["cold"]]
    usages = [u for _, u, _ in turns["split"]]
    for before, now, (_, _, mtp) in zip(usages, usages[1:], turns["split"][1:]):
        cached = now.prompt_tokens_details.cached_tokens
        assert cached >= before.prompt_tokens - 1 and mtp["split"] == "pipeline over 2 ranks"
        assert cached + mtp["prefilled_tokens"] == now.prompt_tokens
    assert pipeline_server.get("/health")["prompt_cache"]["enabled"]


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_stop_reaches_every_rank(tensor_server):
    """SIGTERM to rank 0 (what Ctrl-C does): it stops serving, tells rank 1, every rank exits 0."""
    pids = tensor_server.rank_pids()
    t0 = time.monotonic()
    assert tensor_server.stop() == 0
    assert time.monotonic() - t0 < 30
    # mlx.launch exits 0 whatever its ranks do; a rank that failed or that it ended has a line.
    assert not re.search(r"Node with rank \d+ (exited|was killed)", tensor_server.output())
    assert all(_gone(pid) for pid in pids.values())


def test_a_killed_rank_gives_an_error_response(pipeline_server):
    stream = pipeline_server.stream_first_chunk(max_tokens=3000)
    t0 = time.monotonic()
    os.kill(pipeline_server.rank_pids()[1], signal.SIGKILL)
    with pytest.raises(openai.APIError, match=r"^rank 0 of 2 \(pipeline split\): generation "
                       r"failed, another rank died \(\[ring\] .*\); the server is stopping$"):
        for _ in stream:
            pass
    pipeline_server.proc.wait(timeout=30)  # mlx.launch ends: bounded, no hang
    assert time.monotonic() - t0 < 30
    out = pipeline_server.output()
    assert "error: rank 0 of 2 (pipeline split): generation failed, another rank died" in out
    assert "Node with rank 0 exited with code 1" in out  # mlx.launch itself exits 0


def test_a_hung_rank_gives_an_error_response(agree_dir):
    server = SplitServer(agree_dir, "pipeline", MLX_MTP_DIST_TIMEOUT=str(TIMEOUT_S))
    rank1 = server.rank_pids()[1]
    try:
        stream = server.stream_first_chunk(max_tokens=3000)
        t0 = time.monotonic()
        os.kill(rank1, signal.SIGSTOP)
        with pytest.raises(openai.APIError, match=(
                r"^rank 0 of 2 \(pipeline split\): no progress in generation for "
                rf"{TIMEOUT_S} s: another rank died or hangs \(set MLX_MTP_DIST_TIMEOUT to wait "
                r"longer\); the server is stopping$")):
            for _ in stream:
                pass
        # the watchdog counts from the start of the step in flight, which may precede t0 (the
        # SIGSTOP) by up to a step: 9.9998 s was seen once
        assert TIMEOUT_S - 1 <= time.monotonic() - t0 < TIMEOUT_S + 20
        deadline = time.monotonic() + 30  # rank 0 ends itself (the watchdog's exit code)
        while "Node with rank 0 exited with code 3" not in server.output():
            assert time.monotonic() < deadline, server.output()[-3000:]
            time.sleep(0.2)
    finally:
        os.kill(rank1, signal.SIGKILL)  # stopped: mlx.launch's SIGTERM would wait for a SIGCONT
        server.stop()
