"""The server as a newcomer meets it: ``python -m mlx_mtp.server`` with no ``--model`` (the demo
pair), the README's and docs/server.md's examples run as written (the server's port aside), a
chat request through the ``openai`` client, and what the server logs."""

import json
import os
import shlex
import subprocess
import sys

import pytest
from support.doc_blocks import assert_code_like, the_block

from benchmarks.common import distinct_ngram_share
from benchmarks.harness.server_process import ServerProcess
from mlx_mtp.demo import DEMO_DECODE, DEMO_MODEL_ID

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

# A chat framing that leads the demo pair to code.
CHAT = "Write a Python class for a stack."
DOC_PORT = "127.0.0.1:8080"  # the port the examples use; the tests' server has its own


@pytest.fixture(scope="module")
def server():
    with ServerProcess() as s:
        s.client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0,
                                 timeout=300)
        yield s


@pytest.fixture(scope="module")
def demo_tokenizer():
    import mlx_mtp
    from mlx_mtp.demo import demo_path

    return mlx_mtp.load(str(demo_path()))[1]


def on_the_test_port(text: str, server) -> str:
    assert DOC_PORT in text
    return text.replace(DOC_PORT, f"127.0.0.1:{server.port}")


def test_the_readme_server_command_is_the_one_the_tests_start():
    words = shlex.split(the_block("README.md", "bash", "mlx_mtp.server").strip())
    assert words == ["python", "-m", "mlx_mtp.server", "--port", "8080"]  # the fixture's server


def test_the_readme_openai_example_prints_code(server, tmp_path):
    block = on_the_test_port(the_block("README.md", "python", "OpenAI("), server)
    (tmp_path / "example.py").write_text(block)
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    text, tokens_per_round = r.stdout.rstrip("\n").rsplit("\n", 1)
    assert_code_like(text)
    assert float(tokens_per_round) >= 1.0


def test_the_curl_example_of_docs_server_gets_code(server):
    command = on_the_test_port(the_block("docs/server.md", "bash", "curl "), server)
    r = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["usage"]["completion_tokens"] > 0
    assert_code_like(out["choices"][0]["text"])


def test_a_chat_request_for_code_gets_text_that_does_not_loop(server, demo_tokenizer):
    r = server.client.chat.completions.create(
        model=DEMO_MODEL_ID, max_tokens=256, temperature=0,
        messages=[{"role": "user", "content": CHAT}])
    assert r.usage.completion_tokens == 256
    ids = demo_tokenizer.encode(r.choices[0].message.content, add_special_tokens=False)
    assert distinct_ngram_share(ids, 4) >= 0.6
    assert r.model_extra["mtp"]["mtp_enabled"] is True


def test_one_model_id_everywhere(server):
    listed = [m.id for m in server.client.models.list().data]
    assert listed == [DEMO_MODEL_ID]
    assert server.get("/health")["model"] == DEMO_MODEL_ID
    for asked in ("default_model", "anything"):  # whatever a client calls it
        r = server.client.completions.create(model=asked, prompt="def add(a, b):\n    ",
                                             max_tokens=4, temperature=0)
        assert r.model == DEMO_MODEL_ID


def test_the_demo_decode_settings_are_the_requests_defaults(server):
    """A request that leaves the penalty out gets the demo's; one that sets it gets its own: the
    two differ exactly where the penalty changes the argmax."""
    prompt = "class Stack:\n    def __init__(self):\n        "
    default = server.client.completions.create(model="x", prompt=prompt, max_tokens=48,
                                               temperature=0).choices[0].text
    explicit = server.client.completions.create(
        model="x", prompt=prompt, max_tokens=48, temperature=0,
        extra_body={"repetition_penalty": DEMO_DECODE.repetition_penalty,
                    "repetition_context_size": DEMO_DECODE.repetition_context_size}
    ).choices[0].text
    off = server.client.completions.create(model="x", prompt=prompt, max_tokens=48,
                                           temperature=0,
                                           extra_body={"repetition_penalty": 0.0}).choices[0].text
    assert default == explicit
    assert off != default


def test_the_gate_reason_is_logged_once_and_each_request_once(server):
    before = server.output()
    for _ in range(2):
        server.client.completions.create(model="x", prompt="def f(x):\n    ", max_tokens=2,
                                         temperature=0)
    log = server.output()
    reason = server.get("/health")["gate_reason"]
    assert log.count(reason) == 2  # the startup line and the gate's one log line
    new = log[len(before):]
    assert new.count('"POST /v1/completions HTTP/1.1" 200') == 2
