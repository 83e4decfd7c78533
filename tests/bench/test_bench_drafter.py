"""The drafter ablation writes a complete record (smoke run on a tiny head-agreeing pair)."""

import json
import os

from benchmarks import bench_drafter
from support import tiny_checkpoints as tc


def test_bench_drafter_writes_the_ablation_record(tmp_path):
    model = tc.write_agreeing_checkpoint(tmp_path / "pair", seed=3)
    (tmp_path / "corpus.txt").write_text("\n\n".join(tc.CORPUS))
    (tmp_path / "prompts.json").write_text(json.dumps({"code": "def add(a, b):"}))
    bench_drafter.main([
        "--model", str(model), "--corpus", str(tmp_path / "corpus.txt"), "--draft-vocab-size",
        "128", "--pairs", "2", "--max-tokens", "10", "--prompts-json", str(tmp_path / "prompts.json"),
        "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"), "--topic", "smoke",
        "--allow-busy", "--idle-window", "0.2"])
    md = list((tmp_path / "out").glob("smoke-*.md"))
    js = list((tmp_path / "out").glob("smoke-*.json"))
    assert len(md) == 1 and len(js) == 1
    data = json.loads(js[0].read_text())
    rows = {r["arm"]: r for r in data["rows"]}
    assert list(rows) == ["all", "-p1", "-p2a", "-p2b", "-p3", "-p5", "default", "default+4bit",
                          "default+8bit", "default+bf16", "all+prof", "default+prof"]
    assert all(r["identical_to_classic"] and r["mtp_enabled"] for r in rows.values())
    assert len(data["raw"]["classic"]) == 2 and len(data["raw"]["all"]) == 2
    # The drafter's phases are timed on their own work: every MTP run waited for each phase.
    assert all(r["stats"]["phases_synced"] for name in rows for r in data["raw"][name])
    assert "MLX_MTP_SYNC_PHASES" not in os.environ
    # Each arm runs what it says.
    # (a quantized head runs unmerged: mlx_mtp.models.qwen3_5.fused_head merges plain products only)
    assert rows["all"]["draft"] == {"device_ids": True, "compiled": True, "merged": False,
                                    "row_kernel": False, "bf16": False,
                                    "expert_kernel_layers": 0, "fused_argmax": True,
                                    "vocab_size": 128,
                                    "reduced_vocab": True, "quantized_layers": 7, "bits": [4],
                                    "group_size": [64], "fc_quantized": False}
    assert rows["-p1"]["draft"]["device_ids"] is False
    assert rows["-p2a"]["draft"]["fused_argmax"] is False
    assert rows["-p2b"]["draft"]["vocab_size"] == 320
    assert rows["-p3"]["draft"]["bits"] == []
    assert rows["-p5"]["draft"]["compiled"] is False and rows["default"]["draft"]["compiled"]
    assert rows["default"]["draft"]["vocab_size"] == 320 and not rows["default"]["draft"]["bits"]
    for b in (4, 8):  # the defaults with the head quantized
        assert rows[f"default+{b}bit"]["draft"] == {**rows["default"]["draft"], "bits": [b],
                                                    "group_size": [64], "quantized_layers": 7,
                                                    "merged": False}
    assert rows["default+bf16"]["draft"] == {**rows["default"]["draft"], "bf16": True}
    # its floor: the head's matrices as bfloat16 (half their float32 bytes), the LM head's too
    assert rows["default+bf16"]["lm_head_bytes"] * 2 == rows["default"]["lm_head_bytes"]
    assert rows["default"]["head_bytes"] / 2 < rows["default+bf16"]["head_bytes"] < \
        rows["default"]["head_bytes"] * 0.51
    assert rows["-p1"]["draft_syncs_per_round"] > rows["all"]["draft_syncs_per_round"]
    assert rows["all+prof"]["stages_ms"]["layers"] > 0 and "stages_ms" not in rows["all"]
    assert rows["-p2b"]["lm_head_bytes"] == 320 * 64 * 4 and rows["all"]["lm_head_bytes"] == 128 * 64 * 4
    assert rows["default"]["acceptance"] > 0.9  # the agreeing head, full vocabulary, f32
    text = md[0].read_text()
    for section in ("## Setup", "## Results", "## Per phase", "## Quantized or bf16 head on top "
                    "of the defaults", "| bf16 kernel |", "## Round split", "## Attribution",
                    "## The floor", "## Idle check", "## What it says"):
        assert section in text
    assert "Acceptance is not measured here" not in text  # a given pair: acceptance is measured
    share = data["distinct_4gram_share"]["code"]  # the plain output's, per prompt
    assert 0 < share <= 1 and f"code {share:.2f}" in text
    stem = md[0].stem
    assert sorted(p.name for p in (tmp_path / "out").glob("*.png")) == [f"{stem}-rounds.png",
                                                                        f"{stem}-step.png"]
    assert f"]({stem}-step.png)" in text and f"]({stem}-rounds.png)" in text
    again = bench_drafter.main(["--render", str(js[0]), "--summary", "smoke summary"])
    assert again["summary"] == "smoke summary" and "smoke summary" in md[0].read_text()


def test_the_default_arm_runs_the_pairs_own_draft_vocabulary():
    """A pair that ships a sidecar (the demo pair): the default arm drafts on it, the ablation's
    2b arms on the vocabulary given to the bench, the others on the full head."""
    import mlx.core as mx

    import mlx_mtp

    base, _ = mlx_mtp.load("mlx_mtp/demo_pair")
    shipped = base.drafter.lm.ids
    assert shipped is not None and shipped.size == 4096
    other = mx.arange(0, 8192, 4, dtype=mx.uint32)
    arms = bench_drafter.make_arms(base, other, 64, shipped)
    size = {name: model.drafter.describe()["vocab_size"] for name, (model, _) in arms.items()}
    assert size == {"all": 2048, "-p1": 2048, "-p2a": 2048, "-p2b": 8192, "-p3": 2048,
                    "-p5": 2048, "default": 4096, "default+4bit": 4096, "default+8bit": 4096,
                    "default+bf16": 4096, "all+prof": 2048, "default+prof": 4096}
    assert arms["default"][0].drafter.lm.ids.tolist() == shipped.tolist()
    assert arms["default"][0].drafter.whole_step and not arms["-p5"][0].drafter.whole_step
