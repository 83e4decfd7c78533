"""The conversation benchmark writes a complete record (smoke run: three servers on a tiny
checkpoint whose head agrees with its target, three short turns, each resending the whole chat
in ChatML with answers biased to whole words, so each answer comes back from the cache)."""

import json
import re

import pytest
from support import tiny_checkpoints as tc

pytest.importorskip("openai")
pytest.importorskip("uvicorn")
from benchmarks import bench_conversation  # noqa: E402

pytestmark = pytest.mark.subprocess


def test_bench_conversation_writes_the_record(tmp_path, ckpt_root):
    model = tc.write_agreeing_checkpoint(ckpt_root / "agreeing-conversation", seed=3)
    out = tmp_path / "records"
    result = bench_conversation.main(["--model", str(model), "--turns", "3", "--paste-lines", "2",
                                      "--max-tokens", "6", "--block-size", "3", "--out", str(out),
                                      "--topic", "smoke", "--allow-busy", "--idle-window", "0.2"])
    data = json.loads(next(out.glob("smoke-*.json")).read_text())
    assert data["rows"] == result["rows"]
    assert [(r["turn"], r["arm"]) for r in data["rows"]] == [
        (t, a) for t in (1, 2, 3) for a in bench_conversation.ARMS]
    turns = data["raw"][0]
    assert [[t["turn"] for t in turns[arm]] for arm in bench_conversation.ARMS] == [[1, 2, 3]] * 3
    cached, cold = turns["cached"], turns["cold"]
    # T=0: the cached server says what the cold one says, and mlx-lm's plain decode too (its
    # text a prefix: it drops a last partial character)
    assert [t["text"] for t in cached] == [t["text"] for t in cold]
    assert all(r["same_text_as_cold"] for r in data["rows"])
    prompts = [t["prompt_tokens"] for t in cold]
    assert prompts == [t["prompt_tokens"] for t in cached] and prompts[0] < prompts[1] < prompts[2]
    # the cold server prefills every prompt in full; the cached one only what is not cached,
    # and from the second turn on it serves at least the previous turn's prompt from the cache
    assert [(t["cached_tokens"], t["prefilled_tokens"]) for t in cold] == [(0, n) for n in prompts]
    assert [t["cached_tokens"] + t["prefilled_tokens"] for t in cached] == prompts
    assert cached[0]["cached_tokens"] == 0
    # the answers are words, which ChatML renders back as the ids written: the cache serves
    # the previous prompt and its answer (all but its last token, at least)
    assert data["template"] == "chatml" and data["answers"] == "words" and data["word_tokens"] > 0
    # (the first word's space is dropped by the detokenizer; the template puts it back)
    assert all(re.fullmatch(r"[A-Za-z]+( [A-Za-z]+)*", t["text"]) for t in cached)
    assert all(cached[i]["cached_tokens"]
               >= prompts[i - 1] + cached[i - 1]["completion_tokens"] - 1 for i in (1, 2))
    # mlx_lm.server reports its own cache's count and no mtp statistics
    assert all(t["cached_tokens"] is not None and t["prefilled_tokens"] is None
               for t in turns["mlx_lm"])
    assert all(0 < t["completion_tokens"] <= 6 and t["ttft_ms"] > 0
               for arm in bench_conversation.ARMS for t in turns[arm])
    # every user message pastes the next two lines of the source file
    lines = bench_conversation.source_lines()
    assert [u.split("```python\n")[1] for u in data["users"]] == [
        "\n".join(lines[2 * i:2 * i + 2]) + "\n```" for i in range(3)]
    text = next(out.glob("smoke-*.md")).read_text()
    for section in ("## Per turn", "| 3 | ", "## Time to first token", "- CHATML: ",
                    "| mlx_mtp.server --prompt-cache-bytes 0 | ", "| mlx_lm.server | ",
                    "## What it says"):
        assert section in text
    rows = {(r["turn"], r["arm"]): r["ttft_ms"] for r in data["rows"]}
    ratio = rows[(3, "cached")] / rows[(3, "cold")]
    assert (f"Turn 3's time to first token with the prompt cache is {ratio:.2f}x the cold "
            f"server's: the goal of at most 0.2x is {'met' if ratio <= 0.2 else 'NOT met'}."
            ) in text
    share = min(cached[i]["cached_tokens"] / prompts[i] for i in (1, 2))
    assert f"Turns 2-3 take {share:.0%} to " in text


def test_bad_counts_are_one_line_errors(capsys):
    with pytest.raises(SystemExit) as e:
        bench_conversation.main(["--model", "x", "--turns", "0"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("error: --turns must be >= 1, got 0")
