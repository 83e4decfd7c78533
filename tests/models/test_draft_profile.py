"""Phase 0: MLX_MTP_DRAFT_PROFILE splits the drafter step; without it the split is unattributed."""

import importlib
import json

import mlx.core as mx
import pytest
from support.reference import reference_greedy
from support.oracle import OracleDrafter

import mlx_mtp
generate = importlib.import_module("mlx_mtp.generate")  # the CLI module (mlx_mtp.generate is also the function)
from mlx_mtp import MTPError
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.models.draft_profile import ACCEPT_STAGES, PROFILE_ENV, STAGES
from mlx_mtp.models.options import DraftOptions
from mlx_mtp.models.model import MTPModel

PROMPT = [5, 17, 3, 99, 42]


def run(model, block_size, max_tokens=24):
    stats = RunStats()
    out = [t for t, _ in mlx_mtp.generate_step(mx.array(PROMPT), model, max_tokens=max_tokens,
                                               block_size=block_size, stats=stats)]
    return out, stats


def check_sums(part, stages):
    """Stages are forced one after another inside the timed step: consecutive sub-intervals of
    it, so they never sum past it (no timing tolerance: this holds on a loaded machine too)."""
    total = sum(part[f"{s}_ms"] for s in stages)
    assert part["step_ms"] > 0 and total > 0
    assert all(part[f"{s}_ms"] >= 0 for s in stages)
    assert total <= part["step_ms"] * (1 + 1e-9), (total, part["step_ms"])
    assert part["dominant"] == max(stages, key=lambda s: part[f"{s}_ms"])


@pytest.mark.parametrize("device_ids", [True, False])
def test_profiled_components_account_for_the_step(dense_dir, monkeypatch, device_ids):
    monkeypatch.setenv(PROFILE_ENV, "1")
    model = mlx_mtp.load_model(dense_dir, draft_options=DraftOptions(device_ids=device_ids))
    out, stats = run(model, block_size=4)
    assert out == reference_greedy(dense_dir, PROMPT, 24)  # profiling changes no output
    prof = stats.to_dict()["draft_profile"]
    assert prof["synchronized"] is True
    # One head step per draft after the first (the first comes from the accept hook's forward).
    assert prof["steps"] == stats.drafted - stats.offered[0] > 0
    # The accept hook feeds every drafting round but the last (no round drafts after it).
    assert prof["rounds"] == stats.rounds and prof["accept"]["calls"] == stats.offered[0] - 1
    check_sums(prof, STAGES)
    check_sums(prof["accept"], ACCEPT_STAGES)
    # Ids on device never visit the host inside a step; off, each one does.
    assert (prof["readback_ms"] == 0.0) is device_ids
    assert prof["phase_step_ms"] == pytest.approx(1e3 * stats.phase_s["draft"] / prof["steps"])


def test_unprofiled_reports_the_total_only(dense_dir, monkeypatch):
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    model = mlx_mtp.load_model(dense_dir)
    _, stats = run(model, block_size=3)
    prof = stats.to_dict()["draft_profile"]
    assert prof["synchronized"] is False and prof["dominant"] == "unattributed"
    assert all(prof[f"{s}_ms"] is None for s in STAGES)
    assert all(prof["accept"][f"{s}_ms"] is None for s in ACCEPT_STAGES)
    assert prof["steps"] == stats.drafted - stats.offered[0] > 0
    assert prof["step_ms"] == 1e3 * stats.phase_s["draft"] / prof["steps"]
    assert prof["accept"]["calls"] == stats.offered[0] - 1
    assert prof["accept"]["step_ms"] == 1e3 * stats.phase_s["accept"] / prof["accept"]["calls"]


def test_a_drafter_without_stages_is_never_synchronized(dense_dir, monkeypatch):
    monkeypatch.setenv(PROFILE_ENV, "1")
    model = mlx_mtp.load_model(dense_dir)
    ref = reference_greedy(dense_dir, PROMPT, 16)
    oracle = OracleDrafter(PROMPT + ref, schedule=[2, 0, 1], vocab_size=model.target.vocab_size)
    out, stats = run(MTPModel(model.mlx_model, model.target, oracle), 3, max_tokens=16)
    prof = stats.to_dict()["draft_profile"]
    assert out == ref
    assert prof["synchronized"] is False and prof["steps"] == 0 and prof["step_ms"] is None


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_bad_profile_values_are_one_line_errors(dense_dir, monkeypatch, value):
    monkeypatch.setenv(PROFILE_ENV, value)
    model = mlx_mtp.load_model(dense_dir)
    with pytest.raises(MTPError) as e:
        run(model, 3)
    assert str(e.value) == f"environment variable MLX_MTP_DRAFT_PROFILE must be 0 or 1, got {value!r}"


@pytest.mark.slow
def test_cli_json_carries_draft_profile(dense_dir, monkeypatch, capsys):
    args = ["--model", str(dense_dir), "--max-tokens", "12", "--block-size", "4",
            "--ignore-chat-template"]
    for value, synchronized in (("1", True), ("0", False)):
        monkeypatch.setenv(PROFILE_ENV, value)
        assert generate.main(args + ["--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        prof = out["draft_profile"]
        assert prof["synchronized"] is synchronized and prof["steps"] > 0
        assert set(prof) >= {f"{s}_ms" for s in STAGES} | {"step_ms", "steps", "accept"}
        assert out["draft"] == {"device_ids": True, "compiled": True, "merged": True,
                                "row_kernel": False, "bf16": False,
                                "expert_kernel_layers": 0, "fused_argmax": False,
                                "vocab_size": 320,
                                "reduced_vocab": False, "quantized_layers": 0, "bits": [],
                                "group_size": [], "fc_quantized": False}
    monkeypatch.setenv(PROFILE_ENV, "1")
    assert generate.main(args + ["--stats", "full"]) == 0  # the drafter's rows: the full table
    text = capsys.readouterr().err  # the stats table goes to stderr
    assert "drafter step split (ms)" in text and "ids " in text and "accept hook ms" in text
    monkeypatch.setenv(PROFILE_ENV, "0")
    assert generate.main(args + ["--stats", "full"]) == 0
    assert "unattributed (MLX_MTP_DRAFT_PROFILE=1 splits it)" in capsys.readouterr().err
