"""``python -m mlx_mtp.server`` on the demo pair, driven by the official ``openai`` client.

Two real server processes on free local ports: the MTP server (queue 8) and a ``--no-mtp``
server with a queue of 1 (the plain comparison arm, and the 429). References are the CLI's
``python -m mlx_mtp.generate --json`` for the same prompt and max tokens at temperature 0.
"""

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from support.processes import run_module

from benchmarks.harness.server_process import ServerProcess
from mlx_mtp.demo import DEMO_MODEL_ID
from mlx_mtp.generate import DEFAULT_PROMPT

pytestmark = pytest.mark.subprocess  # every test talks to a server process

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

N = 24  # max_tokens of the reference requests: small, the suite stays quick
# The CLI's default prompt: under the demo pair's decode settings it runs past N tokens.
CODE = DEFAULT_PROMPT
CHAT = "class Stack:"
# mlx_lm.server's conversion of one user message for a tokenizer without a chat template
# (the demo pair's): what the CLI must be given to see the same prompt.
CHAT_AS_TEXT = f"USER: {CHAT}\nASSISTANT:"
NO_MTP_REASON = "--no-mtp: mlx-lm plain decode"


# ------------------------------------------------------------------------------------ helpers


class Server(ServerProcess):
    def __init__(self, *args):
        super().__init__("--log-level", "warning", *args)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0,
                                    timeout=120)

    def post(self, path: str, body: bytes):
        """Raw POST: ``(status, parsed JSON body)``."""
        req = urllib.request.Request(self.url + path, data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def complete(self, prompt=CODE, max_tokens=N, **kw):
        return self.client.completions.create(model="demo", prompt=prompt, max_tokens=max_tokens,
                                              temperature=0, **kw)

    def wait_idle(self, timeout=60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            h = self.get("/health")
            if not h["running"] and h["queued"] == 0:
                return
            assert time.monotonic() < deadline, f"server still busy: {h}"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def server():
    s = Server("--max-queue", "8", "--block-size", "3")  # fixed: its stats match the CLI's
    yield s
    s.stop()


@pytest.fixture(scope="module")
def plain_server():
    s = Server("--no-mtp", "--max-queue", "1")
    yield s
    s.stop()


def cli_reference(prompt: str, max_tokens: int = N) -> dict:
    r = run_module("mlx_mtp.generate", "--prompt", prompt, "--max-tokens", max_tokens,
                   "--block-size", 3, "--ignore-chat-template", "--json")
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def code_ref():
    return cli_reference(CODE)


@pytest.fixture(scope="module")
def chat_ref():
    return cli_reference(CHAT_AS_TEXT)


def stream_text(stream):
    """Text, finish reason, the last chunk (usage) of a streamed completion or chat."""
    parts, finish, last = [], None, None
    for chunk in stream:
        last = chunk
        for c in chunk.choices:
            parts.append(c.text if hasattr(c, "text") else (c.delta.content or ""))
            finish = c.finish_reason or finish
    return "".join(parts), finish, last


def assert_mtp_matches(mtp: dict, ref: dict):
    """The response's ``mtp`` object is the CLI's run: same gate, same rounds (T=0 is
    deterministic), hence the same acceptance numbers."""
    assert mtp["mtp_enabled"] is True and ref["mtp_enabled"] is True
    assert mtp["gate_reason"] == ref["gate_reason"]
    assert (mtp["block_size"], mtp["rounds"]) == (ref["block_size"], ref["rounds"])
    assert mtp["block_sizes"] == ref["block_sizes"]
    assert mtp["acceptance_rate"] == ref["acceptance_rate"]
    assert mtp["tokens_per_round"] == ref["tokens_per_round"]
    assert mtp["per_position_acceptance"] == ref["per_position_acceptance"]
    assert mtp["acceptance_rule"] == "greedy" and mtp["generation_tps"] > 0


# -------------------------------------------------------------------------------------- tests


def test_completion_equals_the_cli(server, code_ref):
    r = server.complete()
    assert r.choices[0].text == code_ref["text"]
    assert r.choices[0].finish_reason == "length" and len(code_ref["tokens"]) == N
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (code_ref["prompt_tokens"], N)
    assert r.usage.total_tokens == code_ref["prompt_tokens"] + N
    assert r.object == "text_completion" and r.model == DEMO_MODEL_ID  # the served id
    assert_mtp_matches(r.model_extra["mtp"], code_ref)


def test_streamed_completion_equals_the_cli_and_reports_usage(server, code_ref):
    stream = server.complete(stream=True, stream_options={"include_usage": True})
    text, finish, last = stream_text(stream)
    assert text == code_ref["text"] and finish == "length"
    assert last.choices == [] and last.usage.completion_tokens == N
    assert_mtp_matches(last.model_extra["mtp"], code_ref)


def test_chat_equals_the_cli(server, chat_ref):
    messages = [{"role": "user", "content": CHAT}]
    r = server.client.chat.completions.create(model="demo", messages=messages, max_tokens=N,
                                              temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == chat_ref["text"]
    assert r.usage.prompt_tokens == chat_ref["prompt_tokens"]
    assert_mtp_matches(r.model_extra["mtp"], chat_ref)
    # Text parts are joined into one string, as mlx_lm.server does.
    parts = [{"role": "user", "content": [{"type": "text", "text": "class "},
                                          {"type": "text", "text": "Stack:"}]}]
    stream = server.client.chat.completions.create(
        model="demo", messages=parts, max_completion_tokens=N, temperature=0, stream=True,
        stream_options={"include_usage": True})
    text, finish, last = stream_text(stream)
    assert text == chat_ref["text"] and finish == "length"
    assert last.usage.prompt_tokens == chat_ref["prompt_tokens"]
    assert_mtp_matches(last.model_extra["mtp"], chat_ref)


def stop_string_in(ref: dict):
    """A stop string from the reference's own tokens: the text of one token that encodes back to
    that token alone (mlx-lm matches stop strings by their token ids) and that first appears in
    the text where that token starts. Returns (stop, the text before it, tokens up to it)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlx_mtp.demo import DEMO_DIR

    tok = load_tokenizer(DEMO_DIR)
    text, ids = ref["text"], ref["tokens"]

    def detokenized(tokens):  # as stream_generate builds the text
        d = tok.detokenizer
        d.reset()
        for t in tokens:
            d.add_token(t)
        d.finalize()
        return d.text

    for i in range(1, len(ids)):
        stop = tok.decode([ids[i]])
        before = detokenized(ids[:i])
        if (stop.strip() and tok.encode(stop, add_special_tokens=False) == [ids[i]]
                and text.find(stop) == len(before) and text.startswith(before)):
            return stop, before, i + 1
    raise AssertionError(f"no usable stop string in {text!r}")


def test_a_stop_string_ends_the_text_before_it(server, code_ref):
    stop, before, n = stop_string_in(code_ref)
    r = server.complete(stop=[stop, "never appears"])
    assert r.choices[0].text == before
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == n  # the stop string's token is counted, as mlx_lm.server


def test_models_and_health(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == ["mlx_mtp-demo-pair"]
    assert server.post("/v1/nope", b"{}") == (404, {"error": {
        "message": "POST /v1/nope: Not Found", "type": "not_found_error", "param": None,
        "code": None}})
    model = server.get("/v1/models/mlx_mtp-demo-pair")
    assert model == {"id": "mlx_mtp-demo-pair", "object": "model", "owned_by": "mlx_mtp",
                     "created": models.data[0].created}
    assert server.client.models.retrieve("mlx_mtp-demo-pair").id == "mlx_mtp-demo-pair"
    with pytest.raises(openai.NotFoundError) as e:
        server.client.models.retrieve("gpt-4o")
    assert e.value.body == {"message": "The model `gpt-4o` does not exist: this server serves "
                                       "`mlx_mtp-demo-pair`", "type": "invalid_request_error",
                            "param": None, "code": "model_not_found"}
    h = server.get("/health")
    assert h["status"] == "ok" and h["mtp_enabled"] is True and h["max_queue"] == 8
    assert h["draft_topk"] == 1  # chains
    assert h["gate_reason"].startswith("exactness probe on cpu")


def test_eight_concurrent_clients_get_complete_correct_answers(server, code_ref, chat_ref):
    def one(i):
        if i % 2:
            return server.complete().choices[0].text
        msgs = [{"role": "user", "content": CHAT}]
        stream = server.client.chat.completions.create(model="demo", messages=msgs, max_tokens=N,
                                                       temperature=0, stream=True)
        return stream_text(stream)[0]

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(one, range(8)))
    assert texts == [code_ref["text"] if i % 2 else chat_ref["text"] for i in range(8)]


def test_a_client_that_drops_mid_stream_frees_the_worker(server, code_ref):
    stream = server.complete(max_tokens=3000, stream=True)
    chunks = iter(stream)
    next(chunks), next(chunks)
    assert server.get("/health")["running"] is True
    stream.close()  # the connection goes away mid-generation
    server.wait_idle()  # long before 3000 tokens: the job was stopped, not run to the end
    r = server.complete()
    assert r.choices[0].text == code_ref["text"]


def test_a_client_that_drops_a_non_streamed_request_frees_the_worker(server, code_ref):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(
        {"prompt": CODE, "max_tokens": 3000, "temperature": 0}).encode(),
        {"Content-Type": "application/json"})
    deadline = time.monotonic() + 60
    while not server.get("/health")["running"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    conn.close()  # gone while its answer is being generated
    server.wait_idle()
    assert server.complete().choices[0].text == code_ref["text"]


def test_a_client_that_drops_while_queued_is_skipped(server, code_ref):
    import http.client

    running = server.complete(max_tokens=3000, stream=True)
    next(iter(running))
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(
        {"prompt": CODE, "max_tokens": 3000, "temperature": 0}).encode(),
        {"Content-Type": "application/json"})
    deadline = time.monotonic() + 60
    while server.get("/health")["queued"] != 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    conn.close()  # gone while waiting for its turn
    time.sleep(1.5)  # the handler notices within DISCONNECT_POLL_S and cancels the queued job
    running.close()
    server.wait_idle()  # neither 3000-token request ran to the end
    assert server.complete().choices[0].text == code_ref["text"]


BAD = [
    (b'{"prompt": ', "invalid JSON in the request body: Expecting value: line 1 column 12 "
                     "(char 11)"),
    (b'["a list"]', 'the request body must be a JSON object, got ["a list"]'),
    (b'{"max_tokens": 4}', "prompt must be a string, got null"),
    (b'{"prompt": "x", "max_tokens": "ten"}', 'max_tokens must be an integer, got "ten"'),
    (b'{"prompt": "x", "max_tokens": -5}', "max_tokens must be >= 1, got -5"),
    (b'{"prompt": "x", "max_tokens": 2.5}', "max_tokens must be an integer, got 2.5"),
    (b'{"prompt": "x", "temperature": -0.5}', "temperature must be >= 0, got -0.5"),
    (b'{"prompt": "x", "temperature": "hot"}', 'temperature must be a number, got "hot"'),
    (b'{"prompt": "x", "top_p": 2}', "top_p must be between 0 and 1, got 2"),
    (b'{"prompt": "x", "stream": "yes"}', 'stream must be true or false, got "yes"'),
    (b'{"prompt": "x", "stop": [1]}', "stop must be a non-empty string or a list of them, "
                                      "got [1]"),
    (b'{"prompt": "x", "seed": "s"}', 'seed must be an integer, got "s"'),
    (b'{"prompt": "x", "n": 0}', "n must be between 1 and 128, got 0"),
    (b'{"prompt": "x", "n": 9}', "n must be at most 8 (--max-queue), got 9"),
    (b'{"prompt": "", "max_tokens": 2}', "prompt is empty: it encodes to no tokens"),
    (b'{"prompt": "x", "temperature": 1, "top_k": 8192}',
     "top_k (--top-k) must be below the vocabulary size 8192, got 8192"),
]
BAD_CHAT = [
    (b'{"messages": []}', "messages must be a non-empty list of {role, content} objects, got []"),
    (b'{"max_tokens": 2}', "messages is required: a non-empty list of {role, content} objects"),
    (b'{"messages": [{"content": "hi"}]}',
     'messages[0] must be an object with a string role, got {"content": "hi"}'),
    (b'{"messages": [{"role": "user", "content": 5}]}',
     "messages[0].content must be a string or a list of text parts, got 5"),
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
     'messages[0].content: only text parts ({"type": "text", "text": ...}) are supported'),
]


@pytest.mark.parametrize("path,body,message",
                         [("/v1/completions", b, m) for b, m in BAD]
                         + [("/v1/chat/completions", b, m) for b, m in BAD_CHAT])
def test_bad_input_is_a_400_and_the_server_keeps_serving(server, path, body, message):
    status, out = server.post(path, body)
    assert (status, out["error"]["message"]) == (400, message)
    assert out["error"]["type"] == "invalid_request_error"
    r = server.complete(max_tokens=2)
    assert len(r.choices[0].text) > 0 and r.usage.completion_tokens == 2


def test_a_body_over_16_mib_is_a_413_before_it_is_read(server):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(16 * 2**20 + 1))
    conn.endheaders()  # no body sent: the answer comes from the header alone
    r = conn.getresponse()
    assert (r.status, json.loads(r.read())["error"]["message"]) == (
        413, "the request body is larger than 16777216 bytes")
    conn.close()
    assert server.complete(max_tokens=2).usage.completion_tokens == 2


def test_a_prompt_longer_than_the_context_is_a_400(server):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlx_mtp.demo import DEMO_DIR

    prompt = "x = 1\n" * 1500
    n = len(load_tokenizer(DEMO_DIR).encode(prompt))
    assert n >= 4096
    with pytest.raises(openai.BadRequestError) as e:
        server.complete(prompt=prompt, max_tokens=2)
    assert e.value.status_code == 400
    assert e.value.body["message"] == (
        f"the prompt is {n} tokens: the model's context is 4096 tokens, with room needed for at "
        "least one generated token")
    assert server.complete(max_tokens=2).usage.completion_tokens == 2


def test_no_mtp_server_gives_the_same_text_and_says_so(plain_server, code_ref):
    r = plain_server.complete()
    assert r.choices[0].text == code_ref["text"]
    mtp = r.model_extra["mtp"]
    assert (mtp["mtp_enabled"], mtp["gate_reason"]) == (False, NO_MTP_REASON)
    assert mtp["acceptance_rate"] is None and mtp["tokens_per_round"] is None
    assert mtp["rounds"] == 0 and mtp["generation_tps"] > 0
    assert plain_server.get("/health")["mtp_enabled"] is False


def test_past_the_queue_a_429_then_the_queued_request_completes(plain_server, code_ref):
    running = plain_server.complete(max_tokens=3000, stream=True)
    chunks = iter(running)
    next(chunks)
    queued = {}
    t = threading.Thread(target=lambda: queued.setdefault("r", plain_server.complete()))
    t.start()
    deadline = time.monotonic() + 60
    while plain_server.get("/health")["queued"] != 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(openai.RateLimitError) as e:
        plain_server.complete(max_tokens=2)
    assert e.value.status_code == 429
    assert e.value.body["message"] == ("server busy: 1 requests are already waiting for the model "
                                       "(--max-queue 1); retry later")
    running.close()
    t.join(timeout=120)
    assert queued["r"].choices[0].text == code_ref["text"]


TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}"
            "{{ raise_exception('this template has no system role') }}{% endif %}"
            "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def templated(tmp_path_factory):
    """A tiny checkpoint whose tokenizer has a chat template, served with --block-size 4."""
    from support import tiny_checkpoints as tc

    path = tc.write_raw_hf(tmp_path_factory.mktemp("chat") / "ckpt", seed=0)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    s = Server("--model", str(path), "--block-size", "4")
    yield path, s
    s.stop()


def test_chat_goes_through_the_tokenizers_template_like_the_cli(templated):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    path, s = templated
    ref = json.loads(run_module("mlx_mtp.generate", "--model", path, "--prompt", "def add",
                                "--max-tokens", 12, "--block-size", 4, "--json").stdout)
    r = s.client.chat.completions.create(model="tiny", max_tokens=12, temperature=0,
                                         messages=[{"role": "user", "content": "def add"}])
    assert r.choices[0].message.content == ref["text"]
    tok = load_tokenizer(path)
    templated_ids = tok.apply_chat_template([{"role": "user", "content": "def add"}],
                                            add_generation_prompt=True, tokenize=True)
    assert r.usage.prompt_tokens == ref["prompt_tokens"] == len(templated_ids)
    assert len(templated_ids) > len(tok.encode("def add"))
    mtp = r.model_extra["mtp"]
    assert (mtp["block_size"], mtp["rounds"], mtp["per_position_acceptance"]) == (
        4, ref["rounds"], ref["per_position_acceptance"])
    status, out = s.post("/v1/chat/completions", json.dumps(
        {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]}
    ).encode())
    assert (status, out["error"]["message"]) == (
        400, "messages: the chat template refused them: this template has no system role")
    assert s.client.chat.completions.create(
        model="tiny", max_tokens=2, messages=[{"role": "user", "content": "y"}]
    ).usage.completion_tokens == 2


@pytest.mark.parametrize("args,code,message", [
    (["--max-queue", "0"], 2, "error: argument --max-queue: must be at least 1, got 0"),
    (["--port", "x"], 2, "error: argument --port: expected an integer, got 'x'"),
    (["--model", "/no/such/dir"], 1, "error: model path /no/such/dir does not exist"),
    (["--drafter", "/some/head"], 1,
     "error: --drafter needs --model: the embedded demo pair has its own head"),
    (["--block-size", "40"], 2,
     "error: argument --block-size: must be between 1 and 16, got 40"),
    (["--draft-topk", "9"], 2, "error: argument --draft-topk: must be between 1 and 8, got 9"),
    (["--draft-topk", "2", "--draft-tokens", "3"], 1,
     "error: --draft-tokens must be an integer from the tree's depth (--block-size less one: "
     "5) to 15, got 3"),
    (["--block-size", "3", "--draft-topk", "2", "--draft-tokens", "20"], 1,
     "error: --draft-tokens must be an integer from the tree's depth (--block-size less one: "
     "2) to 15, got 20"),
    (["--draft-bits", "3"], 2, "error: argument --draft-bits: invalid choice: 3 (choose from 4, 8)"),
    (["--draft-bf16", "--draft-bits", "8"], 1,
     "error: bf16=True (--draft-bf16) and --draft-bits both set the head's weights: pick one"),
])
def test_bad_flags_are_one_line_and_nonzero(args, code, message):
    r = run_module("mlx_mtp.server", *args, check=False)
    assert (r.returncode, r.stderr.strip().splitlines()[-1]) == (code, message)
    assert "Traceback" not in r.stderr


def test_a_tree_server_answers_as_the_cli_drafting_trees():
    """``--draft-topk 2``: every request drafts trees; the text and the acceptance numbers are
    the CLI's with the same flags, and /health and the response say trees ran."""
    s = Server("--block-size", "3", "--draft-topk", "2", "--draft-tokens", "3")
    try:
        ref = json.loads(run_module("mlx_mtp.generate", "--prompt", CODE, "--max-tokens", N,
                                    "--block-size", 3, "--draft-topk", 2, "--draft-tokens", 3,
                                    "--ignore-chat-template", "--json").stdout)
        r = s.complete()
        assert r.choices[0].text == ref["text"]
        mtp = r.model_extra["mtp"]
        assert_mtp_matches(mtp, ref)
        assert mtp["draft_topk"] == 2 and ref["draft_topk"] == 2
        assert mtp["tree_nodes_per_round"] == ref["tree_nodes_per_round"] > 0
        assert mtp["accepted_by_sibling_rank"] == ref["accepted_by_sibling_rank"]
        assert s.get("/health")["draft_topk"] == 2
    finally:
        s.stop()
