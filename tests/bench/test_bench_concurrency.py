"""The concurrency benchmark writes a complete record (smoke run: three servers on a tiny
checkpoint whose head agrees with its target, levels 1 and 2)."""

import json

import pytest
from support import tiny_checkpoints as tc

pytest.importorskip("openai")
pytest.importorskip("uvicorn")
from benchmarks import bench_concurrency  # noqa: E402

pytestmark = pytest.mark.subprocess


def test_bench_concurrency_writes_the_record(tmp_path, ckpt_root):
    model = tc.write_agreeing_checkpoint(ckpt_root / "agreeing-concurrency", seed=3)
    out = tmp_path / "records"
    result = bench_concurrency.main(["--model", str(model), "--levels", "1,2",
                                     "--max-tokens", "6", "--requests", "2", "--max-batch", "2", "--out", str(out),
                                     "--topic", "smoke", "--allow-busy", "--idle-window", "0.2"])
    data = json.loads(next(out.glob("smoke-*.json")).read_text())
    assert data["rows"] == result["rows"]
    assert [(r["clients"], r["arm"]) for r in data["rows"]] == [
        (c, a) for c in (1, 2) for a in ("batched", "serial", "mlx_lm")]
    for row in data["rows"]:  # (an EOS may end a request early, in every arm alike)
        assert 0 < row["tokens"] <= 2 * 6 * row["clients"] and row["aggregate_tps"] > 0
    # one client: every arm got the same two prompts, request by request
    assert all(data["raw"][arm]["1"]["alternating"] for arm in bench_concurrency.ARMS)
    assert [[r["prompt"] for r in data["raw"][arm]["1"]["requests"]]
            for arm in bench_concurrency.ARMS] == [bench_concurrency.prompts_for(4)[:2]] * 3
    tokens = {(r["clients"], r["arm"]): r["tokens"] for r in data["rows"]}
    assert all(tokens[(c, "batched")] == tokens[(c, "serial")] for c in (1, 2))
    # T=0: the batched server's texts and mlx-lm's plain decode equal each prompt's solo text
    assert all(r["texts_equal_solo"] for r in data["rows"])
    assert data["batch"] == {"max_batch": 2, "batched": True, "active": 0,
                             "reason": "up to 2 requests per round"}
    text = next(out.glob("smoke-*.md")).read_text()
    for section in ("## Aggregate and per-request tok/s", "## Ratios", "| 2 | mlx_lm.server |",
                    "## One client, paired by prompt", "| mlx_mtp.server (batched) | ",
                    "## What it says"):
        assert section in text
    pictures = sorted(p.name for p in out.glob("smoke-*.png"))
    assert len(pictures) == 2
    assert pictures[0].endswith("-aggregate.png") and pictures[1].endswith("-per-request.png")


class _Client:
    """An OpenAI client stand-in that logs which arm got which prompt, in order."""

    def __init__(self, arm, log):
        self.arm, self.log = arm, log
        self.completions = self

    def create(self, *, prompt, max_tokens, **_):
        self.log.append((self.arm, prompt))
        choice = type("Choice", (), {"text": prompt.upper()})
        usage = type("Usage", (), {"completion_tokens": max_tokens})
        return type("Response", (), {"choices": [choice], "usage": usage})


def test_one_client_sends_each_prompt_to_every_arm_in_turn_the_order_rotating(monkeypatch):
    log = []
    clients = {arm: _Client(arm, log) for arm in bench_concurrency.ARMS}
    raw = {arm: {"1": run} for arm, run in
           bench_concurrency.alternating(clients, ["p0", "p1", "p2", "p3"], 4, 8).items()}
    assert log == [("batched", "p0"), ("serial", "p0"), ("mlx_lm", "p0"),
                   ("serial", "p1"), ("mlx_lm", "p1"), ("batched", "p1"),
                   ("mlx_lm", "p2"), ("batched", "p2"), ("serial", "p2"),
                   ("batched", "p3"), ("serial", "p3"), ("mlx_lm", "p3")]
    for arm in bench_concurrency.ARMS:
        run = raw[arm]["1"]
        assert run["alternating"] and run["tokens"] == 32
        assert run["wall_s"] == sum(r["seconds"] for r in run["requests"])
        assert [r["text"] for r in run["requests"]] == ["P0", "P1", "P2", "P3"]
    # paired by prompt: each request's tok/s over the serial server's on the same prompt
    ratio = bench_concurrency.paired_to_serial(raw, "batched")
    per_prompt = [r["tps"] / s["tps"] for r, s in zip(raw["batched"]["1"]["requests"],
                                                      raw["serial"]["1"]["requests"])]
    assert ratio == (sorted(per_prompt)[1] / 2 + sorted(per_prompt)[2] / 2, min(per_prompt),
                     max(per_prompt))
    assert bench_concurrency.paired_to_serial({"batched": {"1": {"requests": []}},
                                               "serial": {"1": {}}}, "batched") is None
