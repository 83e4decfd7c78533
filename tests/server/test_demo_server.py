"""The server as a newcomer meets it: ``python -m mlx_mtp.server`` with no ``--model`` (the demo
pair), the README's chat request through the ``openai`` client, and what the server logs."""

import pytest

from benchmarks.common import distinct_ngram_share
from benchmarks.harness.server_process import ServerProcess
from mlx_mtp.demo import DEMO_DECODE, DEMO_MODEL_ID

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

# The README's chat example for the demo pair.
README_CHAT = "Write a Python class for a stack."


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


def test_the_readme_chat_request_gets_text_that_does_not_loop(server, demo_tokenizer):
    r = server.client.chat.completions.create(
        model=DEMO_MODEL_ID, max_tokens=256, temperature=0,
        messages=[{"role": "user", "content": README_CHAT}])
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
