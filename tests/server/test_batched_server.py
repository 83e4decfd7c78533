"""``python -m mlx_mtp.server --max-batch N``: requests decoded together in batched rounds, as
clients meet it. The reference for every text is the same request on a ``--max-batch 1`` server
(one request at a time, each alone)."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import mlx_mtp
from benchmarks.harness.server_process import ServerProcess
from mlx_mtp.decoding.speculation import SpeculationOptions
from mlx_mtp.server.engine import Engine

pytestmark = pytest.mark.subprocess

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

N = 16
# Sixteen different completions (the demo pair's prompts of its own kind, of several lengths).
PROMPTS = [f"def {name}(self, {arg}):\n    " + "x = 1\n    " * (i % 3)
           for i, (name, arg) in enumerate(
               (n, a) for n in ("push", "pop", "peek", "size") for a in ("item", "key", "n", "v"))]


class Server(ServerProcess):
    def __init__(self, *args, block_size="3"):
        super().__init__("--log-level", "warning", "--block-size", block_size, *args)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0,
                                    timeout=300)

    def text(self, prompt, max_tokens=N, stream=False, **kw):
        r = self.client.completions.create(model="demo", prompt=prompt, max_tokens=max_tokens,
                                           temperature=0, stream=stream, **kw)
        if not stream:
            return r.choices[0].text
        return "".join(c.choices[0].text for c in r if c.choices)


@pytest.fixture(scope="module")
def solo():
    s = Server("--max-batch", "1")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def batched():
    s = Server("--max-batch", "8", "--max-queue", "16")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def solo_texts(solo):
    return [solo.text(p) for p in PROMPTS]


def test_health_says_how_requests_are_batched(solo, batched):
    assert batched.get("/health")["batch"] == {
        "max_batch": 8, "batched": True, "reason": "up to 8 requests per round", "active": 0}
    assert solo.get("/health")["batch"] == {
        "max_batch": 1, "batched": False, "reason": "one request at a time: --max-batch 1",
        "active": 0}


def test_sixty_four_requests_from_sixteen_clients_get_their_solo_texts(batched, solo_texts):
    """The load test: every text equals the request's text served alone, byte for byte;
    streamed and whole answers alike, none lost, none another's."""
    def client(c):
        return [batched.text(PROMPTS[(c + 5 * j) % 16], stream=j % 2 == 1) for j in range(4)]

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(client, range(16)))
    for c, texts in enumerate(got):
        assert texts == [solo_texts[(c + 5 * j) % 16] for j in range(4)], c
    assert len(set(solo_texts)) > 8  # the prompts' texts differ: a swapped answer would show


def test_under_auto_concurrent_requests_get_their_solo_texts(solo_texts):
    """The server's default block size: the batch's own chooser picks every round's drafts;
    eight concurrent requests still get their solo texts."""
    server = Server("--max-batch", "8", block_size="auto")
    try:
        def one(prompt):
            return server.client.completions.create(model="demo", prompt=prompt, max_tokens=N,
                                                    temperature=0)

        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(one, PROMPTS[:8]))
        assert [r.choices[0].text for r in got] == solo_texts[:8]
        for r in got:
            mtp = r.model_extra["mtp"]
            assert mtp["block_size"] == "auto" and mtp["batched"] is True
        # the count the batch's chooser runs at each batch size it met (the demo pair drafts
        # at most 5)
        drafts = server.get("/health")["batch"]["drafts"]
        assert drafts and all(1 <= int(size) <= 8 and 0 <= k <= 5 for size, k in drafts.items())
        assert any(int(size) >= 2 for size in drafts)
    finally:
        server.stop()


def test_requests_of_every_setting_share_a_batch(batched, solo, solo_texts):
    """Greedy requests beside sampled ones, stop strings and different budgets: the greedy
    ones keep their solo texts, the others get what they asked for."""
    def stopped(server, stop):
        r = server.client.completions.create(model="demo", prompt=PROMPTS[3], max_tokens=40,
                                             temperature=0, stop=[stop])
        return r.choices[0].text, r.choices[0].finish_reason

    # a stop string the solo answer meets (mlx-lm matches stop strings by their token ids)
    stop, (stop_text, _) = next((s, stopped(solo, s)) for s in ("(", ":", "self", "\n")
                                if stopped(solo, s)[1] == "stop")

    def one(i):
        if i % 4 == 0:
            return batched.client.completions.create(
                model="demo", prompt=PROMPTS[i], max_tokens=N, temperature=0.9, seed=i)
        if i % 4 == 1:
            return stopped(batched, stop)
        if i % 4 == 2:
            return batched.text(PROMPTS[i], max_tokens=5)
        return batched.text(PROMPTS[i])

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, range(8)))
    for i, r in enumerate(got):
        if i % 4 == 0:
            assert r.usage.completion_tokens == N and r.choices[0].finish_reason == "length"
            mtp = r.model_extra["mtp"]
            assert mtp["acceptance_rule"] == "speculative-sampling"
            assert mtp["batched"] is True and mtp["batch_reason"] == "up to 8 requests per round"
        elif i % 4 == 1:
            assert r == (stop_text, "stop")
        elif i % 4 == 2:
            assert r == solo.text(PROMPTS[i], max_tokens=5)
        else:
            assert r == solo_texts[i]


def test_a_dropped_stream_frees_its_slot(batched, solo_texts):
    stream = batched.client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=3000,
                                               temperature=0, stream=True)
    chunks = iter(stream)
    next(chunks), next(chunks)
    assert batched.get("/health")["batch"]["active"] == 1
    stream.close()
    deadline = time.monotonic() + 60
    while batched.get("/health")["batch"]["active"] or batched.get("/health")["running"]:
        assert time.monotonic() < deadline, "the dropped request still decodes"
        time.sleep(0.1)
    assert batched.text(PROMPTS[1]) == solo_texts[1]


def test_a_device_where_the_batch_probe_fails_serves_one_at_a_time(monkeypatch):
    """In process: the engine's batch declines with the probe's reason (what /health says)."""
    from mlx_mtp.decoding import batch_rounds
    from mlx_mtp.demo import demo_path

    monkeypatch.setattr(batch_rounds, "probe_batch", lambda *a: "sequence 2 of 2: skewed")
    model, tok = mlx_mtp.load(str(demo_path()))
    engine = Engine(model, tok, speculation=SpeculationOptions(block_size=3))
    engine.start_batch(4)
    assert engine.batch is None
    assert engine.batch_summary() == {
        "max_batch": 4, "batched": False, "active": 0,
        "reason": "one request at a time: batched rounds declined: batch-vs-alone probe: "
                  "sequence 2 of 2: skewed"}


def test_a_request_that_ends_at_its_eos_leaves_the_batch(ckpt_root):
    """A reader that stops at an EOS leaves the batch at once: its answer ends ("stop"), the
    other request in the batch finishes too, and the server is idle again."""
    from support import tiny_checkpoints as tc

    from benchmarks.bench_concurrency import prompts_for

    model = tc.write_agreeing_checkpoint(ckpt_root / "agreeing-eos", seed=3)
    s = Server("--model", str(model), "--max-batch", "2")
    try:
        ends, other = prompts_for(2)  # the first ends at an EOS within 6 tokens here

        def one(prompt):
            return s.client.completions.create(model="m", prompt=prompt, max_tokens=6,
                                               temperature=0).choices[0]

        with ThreadPoolExecutor(2) as pool:
            first, second = pool.map(one, (ends, other))
        assert first.finish_reason == "stop" and second.finish_reason == "length"
        h = s.get("/health")
        assert h["batch"]["active"] == 0 and h["running"] is False
    finally:
        s.stop()
