"""The exactness gate: its decision table (device generation x probe verdict x override), the
override variable, and the public paths (generate_step, stream_generate, the CLI) declining to
mlx-lm's plain decode, identical to it, when the probe fails."""

import importlib
import json
import logging

import mlx.core as mx
import pytest
from support.reference import reference_greedy
from mlx_lm.tokenizer_utils import load as load_tokenizer
from support.perturbed import BrokenVerify, PerturbedVerify
from support.processes import CHILD_PYTHONPATH

import mlx_mtp
from mlx_mtp.exactness import block_vs_chain as exactness
from mlx_mtp.exactness import gate
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.errors import MTPError
from mlx_mtp.exactness.block_vs_chain import DIVERGES, EQUAL, NOT_RUN, ProbeResult
from mlx_mtp.exactness.device import DeviceFacts
from mlx_mtp.models.model import MTPModel

ENV = "MLX_MTP_ALLOW_INEXACT"
PROMPT = "def add(a, b):\n    return"


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    exactness.clear_memo()
    yield
    exactness.clear_memo()


# ------------------------------------------------------------------------------ decision table

DEVICES = {
    "cpu": DeviceFacts("cpu", "x86_64", None),
    "cuda": DeviceFacts("cuda", "sm_90", None),
    "g13": DeviceFacts("metal", "applegpu_g13d", 13),
    "g14": DeviceFacts("metal", "applegpu_g14s", 14),
    "g15": DeviceFacts("metal", "applegpu_g15s", 15),
    "g16": DeviceFacts("metal", "applegpu_g16g", 16),
    "g17": DeviceFacts("metal", "applegpu_g17s", 17),
    "metal?": DeviceFacts("metal", "apple9", None),
}
PROBES = {
    EQUAL: [ProbeResult(2, EQUAL, total_bytes=1280), ProbeResult(3, EQUAL, total_bytes=1280)],
    DIVERGES: [ProbeResult(2, EQUAL, total_bytes=1280),
               ProbeResult(3, DIVERGES, position=1, differing_bytes=7, total_bytes=1280, draw=2)],
    NOT_RUN: [ProbeResult(2, NOT_RUN, reason="RuntimeError: no memory"),
              ProbeResult(3, NOT_RUN, reason="RuntimeError: no memory")],
}
KERNEL_NOTE = ("(on Apple GPU generation 15+ MLX reduces multi-row quantized matmuls differently "
               "from one-row decode steps")


@pytest.mark.parametrize("override", [False, True])
@pytest.mark.parametrize("verdict", [EQUAL, DIVERGES, NOT_RUN])
@pytest.mark.parametrize("device", list(DEVICES))
def test_decision_table(device, verdict, override):
    facts = DEVICES[device]
    d = gate.decide(PROBES[verdict], facts, allow_inexact=override)
    wide_kernel_gpu = facts.kind == "metal" and (facts.generation or 0) >= 15
    # Fail closed everywhere: MTP runs only on proven equality, or when the user overrides.
    assert d.mtp_enabled == (verdict == EQUAL or override)
    assert d.verdict == verdict
    assert d.override == (override and verdict != EQUAL)
    assert d.probes == PROBES[verdict] and d.device == facts
    if verdict == EQUAL:
        assert d.reason == (f"exactness probe on {facts.describe()}: verify blocks of width 2, 3 "
                            "equal the single-token chain byte for byte")
        return
    failure = ("width 3: verify block position 1 differs from the single-token chain in 7 of "
               "1280 logit bytes (draw 3 of 3)" if verdict == DIVERGES else
               "width 2: the probe could not run (RuntimeError: no memory); "
               "width 3: the probe could not run (RuntimeError: no memory)")
    assert f"exactness probe on {facts.describe()}: {failure}" in d.reason
    # The generation dimension: only Apple GPU generation 15+ names the wide-kernel cause, and
    # offers the narrow-kernel experiment only for a measured divergence.
    assert (KERNEL_NOTE in d.reason) == wide_kernel_gpu
    assert ("MLX_METAL_GPU_ARCH=applegpu_g14" in d.reason) == (wide_kernel_gpu and
                                                               verdict == DIVERGES)
    if override:
        assert d.reason.startswith("MLX_MTP_ALLOW_INEXACT=1: running MTP although the exactness "
                                   "probe on ")
        assert d.reason.endswith("; output may differ from plain decoding")
    else:
        assert d.reason.startswith("MTP declined, decoding plainly: exactness probe on ")
        assert d.reason.endswith(". Set MLX_MTP_ALLOW_INEXACT=1 to run MTP anyway (output may "
                                 "then differ from plain decoding)")


def test_decision_reasons_verbatim():
    d = gate.decide(PROBES[DIVERGES], DEVICES["cpu"], allow_inexact=False)
    assert d.reason == (
        "MTP declined, decoding plainly: exactness probe on cpu (x86_64): width 3: verify block "
        "position 1 differs from the single-token chain in 7 of 1280 logit bytes (draw 3 of 3). "
        "Set MLX_MTP_ALLOW_INEXACT=1 to run MTP anyway (output may then differ from plain "
        "decoding)")
    d = gate.decide(PROBES[DIVERGES], DEVICES["g15"], allow_inexact=False)
    assert d.reason == (
        "MTP declined, decoding plainly: exactness probe on metal (applegpu_g15s: Apple GPU "
        "generation 15, M3): width 3: verify block position 1 differs from the single-token "
        "chain in 7 of 1280 logit bytes (draw 3 of 3) (on Apple GPU generation 15+ MLX reduces "
        "multi-row quantized matmuls differently from one-row decode steps; "
        "MLX_METAL_GPU_ARCH=applegpu_g14s set before Python starts may restore the one-row "
        "kernel: check with python -m mlx_mtp.probe). Set MLX_MTP_ALLOW_INEXACT=1 to run MTP "
        "anyway (output may then differ from plain decoding)")
    d = gate.decide([], DEVICES["g17"], allow_inexact=False)
    assert (d.mtp_enabled, d.verdict, d.reason, d.override) == (
        True, "not_needed", "block size 1: no verify block, nothing to probe", False)


@pytest.mark.parametrize("value,allowed", [(None, False), ("", False), ("0", False), ("1", True),
                                           (" 1 ", True)])
def test_allow_inexact_values(value, allowed):
    environ = {} if value is None else {ENV: value}
    assert gate.allow_inexact_from_env(environ) is allowed


@pytest.mark.parametrize("value", ["yes", "true", "2", "-1"])
def test_allow_inexact_bad_values_are_one_line_errors(value):
    with pytest.raises(MTPError) as e:
        gate.allow_inexact_from_env({ENV: value})
    assert str(e.value) == f"environment variable MLX_MTP_ALLOW_INEXACT must be 0 or 1, got {value!r}"


def test_session_widths():
    assert gate.session_widths(1) == []
    assert gate.session_widths(2) == [2]
    assert gate.session_widths(5) == [2, 3, 4, 5]


# ------------------------------------------------------------------------------ with a real probe


def test_check_with_the_real_probe_on_a_generation_15_device(dense_dir):
    model = mlx_mtp.load_model(dense_dir)
    d = gate.check(model, 4, device=DEVICES["g15"])
    assert (d.mtp_enabled, d.verdict, [p.width for p in d.probes]) == (True, EQUAL, [2, 3, 4])
    broken = MTPModel(model.mlx_model, BrokenVerify(model.target), model.drafter)
    d = gate.check(broken, 3, device=DEVICES["g15"])
    assert (d.mtp_enabled, d.verdict) == (False, NOT_RUN)
    assert "width 2: the probe could not run (RuntimeError: verify is broken)" in d.reason
    assert KERNEL_NOTE in d.reason and "MLX_METAL_GPU_ARCH" not in d.reason


def _run(model, prompt, block_size, n, stats):
    return [t for t, _ in mlx_mtp.generate_step(mx.array(prompt), model, max_tokens=n,
                                                block_size=block_size, stats=stats)]


def _gate_records(caplog):
    """The gate's warnings (not other mlx_mtp warnings, e.g. a first build of the C kernels)."""
    return [r for r in caplog.records if r.name == "mlx_mtp" and r.module == "gate"
            and r.levelno >= logging.WARNING]


@pytest.mark.parametrize("kind", ["dense", "next"])
def test_a_failing_probe_declines_to_plain_decode_identical_to_mlx_lm(kind, request, caplog):
    path = request.getfixturevalue(f"{kind}_dir")
    model = mlx_mtp.load_model(path)
    wrapped = PerturbedVerify(model.target, position=0)
    prompt = load_tokenizer(path).encode(PROMPT)
    stats = RunStats()
    out = _run(MTPModel(model.mlx_model, wrapped, model.drafter), prompt, 3, 20, stats)
    assert out == reference_greedy(path, prompt, 20)
    assert (stats.mtp_enabled, stats.rounds, stats.drafted) == (False, 0, 0)
    assert (stats.prompt_tokens, stats.generation_tokens) == (len(prompt), 20)
    assert wrapped.verify_calls == 2  # the probe's two block arms; the round loop never ran
    ex = stats.exactness
    assert (ex["verdict"], ex["override"], ex["device"]) == (DIVERGES, False, "cpu")
    assert [(w["width"], w["verdict"], w["position"], w["total_bytes"]) for w in ex["widths"]] == \
        [(2, DIVERGES, 0, 1280), (3, DIVERGES, 0, 1280)]
    assert all(w["differing_bytes"] > 0 for w in ex["widths"])
    assert stats.gate_reason.startswith("MTP declined, decoding plainly: exactness probe on cpu")
    assert f"{ex['widths'][0]['differing_bytes']} of 1280 logit bytes" in stats.gate_reason
    records = _gate_records(caplog)
    assert [r.getMessage() for r in records] == [stats.gate_reason]  # one logged reason
    d = stats.to_dict()
    assert (d["mtp_enabled"], d["gate_reason"], d["exactness"]) == (False, stats.gate_reason, ex)


def test_the_override_runs_mtp_with_a_loud_warning_recorded_in_stats(dense_dir, monkeypatch,
                                                                      caplog):
    monkeypatch.setenv(ENV, "1")
    model = mlx_mtp.load_model(dense_dir)
    wrapped = PerturbedVerify(model.target, position=0)
    stats = RunStats()
    out = _run(MTPModel(model.mlx_model, wrapped, model.drafter), [1, 2, 3], 3, 12, stats)
    assert len(out) == 12
    # Two probe block arms, then one verify per round that has drafts (a one-token round is a
    # plain step).
    block_rounds = sum(n for w, (_, n) in stats.verify_by_width.items() if w > 1)
    assert stats.mtp_enabled and block_rounds > 0 and wrapped.verify_calls == 2 + block_rounds
    assert (stats.exactness["verdict"], stats.exactness["override"]) == (DIVERGES, True)
    assert model.target.exact is False  # the session verified without the exactness fallbacks
    assert stats.gate_reason.startswith("MLX_MTP_ALLOW_INEXACT=1: running MTP although the "
                                        "exactness probe on cpu (x86_64): width 2: verify block "
                                        "position 0 differs")
    (record,) = _gate_records(caplog)
    assert record.getMessage() == ("WARNING: MTP output is NOT guaranteed to equal plain "
                                   f"decoding. {stats.gate_reason}")


def test_an_equal_probe_runs_mtp_and_is_memoized_across_sessions(dense_dir, caplog):
    model = mlx_mtp.load_model(dense_dir)
    prompt = load_tokenizer(dense_dir).encode(PROMPT)
    ref = reference_greedy(dense_dir, prompt, 16)
    for i in range(2):
        stats = RunStats()
        assert _run(model, prompt, 4, 16, stats) == ref
        assert stats.mtp_enabled and stats.rounds > 0
        assert stats.exactness["verdict"] == EQUAL
        assert [(w["width"], w["cached"]) for w in stats.exactness["widths"]] == \
            [(2, i == 1), (3, i == 1), (4, i == 1)]
    assert _gate_records(caplog) == []


def test_block_size_1_needs_no_probe(dense_dir):
    model = mlx_mtp.load_model(dense_dir)
    wrapped = PerturbedVerify(model.target, position=0)  # a width-1 verify has no row to break
    stats = RunStats()
    prompt = [5, 6, 7]
    out = _run(MTPModel(model.mlx_model, wrapped, None), prompt, 1, 10, stats)
    assert out == reference_greedy(dense_dir, prompt, 10)
    assert stats.mtp_enabled and stats.rounds == 9
    assert stats.exactness["verdict"] == "not_needed" and stats.exactness["widths"] == []
    assert wrapped.verify_calls == 0  # no probe, and block size 1 decodes with plain steps
    assert stats.host_syncs == 9  # one read per generated token after the prefill's, as mlx-lm


def test_a_bad_override_value_fails_before_any_work(dense_dir, monkeypatch):
    monkeypatch.setenv(ENV, "yes")
    model = mlx_mtp.load_model(dense_dir)
    wrapped = PerturbedVerify(model.target)
    with pytest.raises(MTPError, match="must be 0 or 1, got 'yes'"):
        _run(MTPModel(model.mlx_model, wrapped, model.drafter), [1, 2], 3, 4, RunStats())
    assert wrapped.verify_calls == 0


def test_stream_generate_declines_too(dense_dir):
    from mlx_lm.generate import stream_generate as mlx_stream_generate
    from mlx_lm.utils import load_model as mlx_load_model

    model, tok = mlx_mtp.load(dense_dir)
    declined = MTPModel(model.mlx_model, PerturbedVerify(model.target), model.drafter)
    responses = list(mlx_mtp.stream_generate(declined, tok, PROMPT, max_tokens=12, block_size=3))
    ref = list(mlx_stream_generate(mlx_load_model(dense_dir)[0], tok, PROMPT, max_tokens=12))
    assert [r.token for r in responses] == [r.token for r in ref]
    assert "".join(r.text for r in responses) == "".join(r.text for r in ref)
    stats = responses[-1].stats
    assert stats.mtp_enabled is False and stats.exactness["verdict"] == DIVERGES


# ------------------------------------------------------------------------------ the generate CLI


def _cli_in_process(argv, capsys):
    generate = importlib.import_module("mlx_mtp.generate")  # the CLI module (mlx_mtp.generate is also the function)

    rc = generate.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_json_and_table_carry_the_verdict(dense_dir, capsys):
    args = ["--model", str(dense_dir), "--prompt", PROMPT, "--max-tokens", "10",
            "--block-size", "3", "--ignore-chat-template"]
    rc, out, _ = _cli_in_process(args + ["--json"], capsys)
    result = json.loads(out)
    assert rc == 0 and result["mtp_enabled"] is True
    assert result["exactness"]["verdict"] == EQUAL
    assert [w["width"] for w in result["exactness"]["widths"]] == [2, 3]
    assert result["gate_reason"] == ("exactness probe on cpu (x86_64): verify blocks of width 2, "
                                     "3 equal the single-token chain byte for byte")
    # the stats table goes to stderr; the probe's row is in the full table
    rc, _, err = _cli_in_process(args + ["--stats", "full"], capsys)
    table = err.split("=" * 40 + "\n", 1)[1].splitlines()
    assert any(line.split() == ["mtp", "on"] for line in table)
    assert any(line.split() == ["exactness", "probe", "equal", "(width", "2,", "3)"]
               for line in table)
    # How the verify stays exact: the row-exact layers by method, and the row kernel.
    from mlx_mtp.cpu import lazy_ops as lazy_kernels
    from mlx_mtp.cpu import row_kernel

    info = result["exactness"]["row_exact"]
    used = info["layers"].get("kernel")  # how the kernel runs is said where a layer uses it
    kernel = ((f"available, {lazy_kernels.mode()}" if used else "available")
              if row_kernel.available() else f"unavailable ({row_kernel.reason()})")
    assert info["kernel"] == kernel and set(info["layers"]) <= {"kernel", "blocked", "rows"}
    row = next(line for line in table if line.startswith("row-exact layers"))
    assert row.rstrip().endswith(f"; row kernel {kernel}")
    # How the verifies computed their attention rows, counted per run: all through the
    # attention kernel where it runs and its checks passed.
    from mlx_mtp.cpu import attention_kernel

    verifies = info["attention"]["verifies"]
    assert verifies["kernel"] + verifies["rows"] > 0
    checked = info["attention"].get("checked", {})
    if attention_kernel.problem() is None and all(v.startswith("equal") for v in checked.values()):
        assert checked and verifies["rows"] == 0
    row = next(line for line in table if line.startswith("verify attention"))
    assert f"kernel {verifies['kernel']}, by rows {verifies['rows']}" in row
    rc, out, _ = _cli_in_process(args + ["--block-size", "1", "--json"], capsys)
    assert json.loads(out)["exactness"]["verdict"] == "not_needed"
    rc, out, _ = _cli_in_process(args + ["--no-mtp", "--json"], capsys)
    result = json.loads(out)
    assert (result["mtp_enabled"], result["gate_reason"], result["exactness"]) == \
        (False, "--no-mtp: mlx-lm plain decode", {})


def test_cli_reports_a_decline(dense_dir, capsys, monkeypatch, caplog):
    from mlx_mtp.models import loader

    real_load = loader.load

    def load_perturbed(*a, **kw):
        model, tok = real_load(*a, **kw)
        return MTPModel(model.mlx_model, PerturbedVerify(model.target), model.drafter), tok

    args = ["--model", str(dense_dir), "--prompt", PROMPT, "--max-tokens", "10",
            "--block-size", "3", "--ignore-chat-template"]
    rc, out, _ = _cli_in_process(args + ["--no-mtp", "--json"], capsys)
    plain = json.loads(out)
    monkeypatch.setattr(loader, "load", load_perturbed)
    rc, out, err = _cli_in_process(args + ["--json"], capsys)
    result = json.loads(out)
    assert rc == 0 and result["mtp_enabled"] is False and result["rounds"] == 0
    assert result["tokens"] == plain["tokens"] and result["text"] == plain["text"]
    assert result["exactness"]["verdict"] == DIVERGES
    assert [r.getMessage() for r in _gate_records(caplog)] == [result["gate_reason"]]
    n = result["exactness"]["widths"][0]["differing_bytes"]
    rc, _, err = _cli_in_process(args, capsys)  # the stats table goes to stderr
    table = err.split("=" * 40 + "\n", 1)[1]
    assert "off (declined by the exactness gate: mlx-lm plain decode)" in table
    assert f"diverges (width 2, 3; width 2 position 0: {n} of 1280 bytes differ)" in table
    assert "acceptance rate" not in table

    monkeypatch.setenv(ENV, "1")
    rc, _, err = _cli_in_process(args, capsys)  # the stats table goes to stderr
    table = err.split("=" * 40 + "\n", 1)[1]
    assert "on, NOT exact (MLX_MTP_ALLOW_INEXACT=1)" in table
    assert "overridden by MLX_MTP_ALLOW_INEXACT=1" in table

    monkeypatch.setenv(ENV, "maybe")
    rc, out, err = _cli_in_process(args, capsys)
    assert rc == 1 and out == ""
    assert err == ("error: environment variable MLX_MTP_ALLOW_INEXACT must be 0 or 1, "
                   "got 'maybe'\n")


DECLINING_CLI = """
import importlib
import sys
generate = importlib.import_module("mlx_mtp.generate")  # the CLI module (mlx_mtp.generate is also the function)
from mlx_mtp.models import loader
from support.perturbed import PerturbedVerify
from mlx_mtp.models.model import MTPModel

real_load = loader.load

def load_perturbed(*a, **kw):
    model, tok = real_load(*a, **kw)
    return MTPModel(model.mlx_model, PerturbedVerify(model.target), model.drafter), tok

loader.load = load_perturbed
sys.exit(generate.main(sys.argv[1:]))
"""


@pytest.mark.subprocess
def test_cli_logs_the_decline_as_one_stderr_line(dense_dir):
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=CHILD_PYTHONPATH)
    env.pop(ENV, None)
    r = subprocess.run([sys.executable, "-c", DECLINING_CLI, "--model",
                        str(dense_dir), "--max-tokens", "6", "--json"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["mtp_enabled"] is False
    assert r.stderr == result["gate_reason"] + "\n"
