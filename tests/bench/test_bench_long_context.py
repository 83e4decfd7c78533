"""benchmarks/bench_long_context.py on tiny pairs (a smoke test: the record's fields, not its
speeds): text prompts of each length, the arms at each temperature with MTP identical to plain at
T=0, prefill rates, the synced verify per width (on Gemma 4 through the kernel and by rows, each
counted), the KV bytes a step reads growing with the prompt, the pictures; and the flags it
refuses."""

import json

import pytest
from support.tiny_gemma4 import WINDOW, Checkpoints

from benchmarks import bench_long_context
from benchmarks.plots import available as plots_available
from mlx_lm.utils import load_tokenizer

SMOKE = ["--pairs", "1", "--max-tokens", "8", "--allow-busy", "--idle-window", "0.2"]


def test_text_prompts_have_the_length_and_differ(dense_dir):
    tok = load_tokenizer(dense_dir)
    prompts = bench_long_context.text_prompts(tok, 300, 3, seed=0)
    assert list(prompts) == ["docs 1", "docs 2", "docs 3"]
    assert all(len(p) == 300 for p in prompts.values())
    assert len({tuple(p) for p in prompts.values()}) == 3
    assert all(len(set(p)) > 20 for p in prompts.values())  # text, not one repeated token
    assert prompts == bench_long_context.text_prompts(tok, 300, 3, seed=0)  # seeded


@pytest.mark.slow
def test_a_gemma_smoke_run_writes_the_record(tmp_path_factory, tmp_path):
    ckpts = Checkpoints(tmp_path_factory)
    lengths = [12, WINDOW + 24]
    result = bench_long_context.main([
        "--model", str(ckpts.target("e2b")), "--drafter", str(ckpts.assistant("e2b")),
        "--lengths", ",".join(map(str, lengths)), "--temps", "0,0.6", "--block-sizes", "2,3",
        "--prompts-per-length", "2,1", "--out", str(tmp_path), "--summary", "smoke", *SMOKE])
    assert result["prompts_per_length"] == [2, 1]
    assert [len({r["prompt"] for r in run["raw"]["classic"]}) for run in
            result["runs"].values()] == [2, 2, 1, 1]
    assert [(r["prompt_tokens"], r["temperature"], r["block_size"]) for r in result["rows"]] == [
        (n, t, b) for n in lengths for t in (0.0, 0.6) for b in (2, 3)]
    for row in result["rows"]:
        assert row["identical_to_classic"] is (True if row["temperature"] == 0 else None)
        assert row["mtp_tps"] > 0 and row["plain_prefill_tps"] > 0 and row["mtp_prefill_tps"] > 0
        assert len(row["per_position_acceptance"]) == row["block_size"] - 1
    assert set(result["runs"]) == {f"{n}@{t}" for n in lengths for t in ("0", "0.6")}
    kv = [result["verify"][str(n)]["kv_bytes_per_row"] for n in lengths]
    assert 0 < kv[0] < kv[1]
    for n in lengths:
        v = result["verify"][str(n)]
        assert {(w["mode"], w["width"]) for w in v["widths"]} >= {
            (m, w) for m in ("kernel", "by rows") for w in (2, 3)}
        assert all(w["verify_ms"] > 0 and w["over_step"] > 0 for w in v["widths"])
        # each mode ran the way it names: the kernel on, then off
        assert v["attention"]["kernel"]["kernel"] > 0 and v["attention"]["kernel"]["rows"] == 0
        assert v["attention"]["by rows"]["kernel"] == 0 and v["attention"]["by rows"]["rows"] > 0
    record = next(tmp_path.glob("long-context-*.json"))
    assert json.loads(record.read_text())["verify"]
    md = record.with_suffix(".md").read_text()
    assert "## The verify's cost by width (T=0, synced)" in md and "| kernel | 2 |" in md
    if plots_available():
        assert len(list(tmp_path.glob("long-context-*.png"))) == 2
        rendered = bench_long_context.main(["--render", str(record)])
        assert rendered["rows"] == json.loads(record.read_text())["rows"]


@pytest.mark.slow
def test_a_qwen_target_verifies_through_the_kernel_and_by_rows(dense_dir, tmp_path):
    result = bench_long_context.main([
        "--model", str(dense_dir), "--lengths", "40", "--temps", "0", "--block-sizes", "2",
        "--prompts-per-length", "1", "--out", str(tmp_path), *SMOKE])
    v = result["verify"]["40"]
    assert {w["mode"] for w in v["widths"]} == {"kernel", "by rows"} and v["kv_bytes_per_row"] > 0
    assert v["attention"]["by rows"]["kernel"] == 0 and v["attention"]["by rows"]["rows"] > 0
    assert v["attention"]["kernel"]["kernel"] + v["attention"]["kernel"]["rows"] > 0
    assert result["rows"][0]["identical_to_classic"] is True


@pytest.mark.parametrize("flags,message", [
    (["--block-sizes", "1,2"], "--block-sizes 2 or more"),
    (["--lengths", "4"], "--lengths must be 8 tokens or more"),
    (["--lengths", "1k"], "expected comma-separated numbers"),
    (["--pairs", "0"], "--pairs, --prompts-per-length and --synced-runs must be >= 1"),
    (["--prompts-per-length", "1,2"], "--prompts-per-length: one count or one per length (3)"),
])
def test_flags_it_refuses(flags, message, capsys):
    with pytest.raises(SystemExit):
        bench_long_context.main(["--model", "somewhere", *flags, "--allow-busy"])
    assert message in capsys.readouterr().err
