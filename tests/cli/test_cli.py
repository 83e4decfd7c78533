"""``python -m mlx_mtp.generate``: output, JSON fields, and one-line errors without tracebacks."""

import json
import re
from pathlib import Path

import pytest
from support.processes import cli
from support.reference import reference_greedy
from mlx_lm.tokenizer_utils import load as load_tokenizer

import mlx_mtp
from mlx_mtp.decoding.stats import RunStats

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "def add(a, b):\n    return"


def mlx_stream(path, tok, prompt, n):
    """mlx-lm's own stream_generate on a pristine copy of the target."""
    from mlx_lm.generate import stream_generate
    from mlx_lm.utils import load_model

    return list(stream_generate(load_model(Path(path))[0], tok, prompt, max_tokens=n))


@pytest.mark.subprocess
def test_json_output_has_the_documented_fields(dense_dir):
    r = cli("--model", dense_dir, "--prompt", PROMPT, "--max-tokens", 16, "--block-size", 3,
            "--ignore-chat-template", "--json")
    out = json.loads(r.stdout)
    for key in ("text", "prompt_tps", "generation_tps", "acceptance_rate", "tokens_per_round",
                "per_position_acceptance", "phase_ms", "mtp_enabled", "peak_memory_gb"):
        assert key in out, key
    assert out["mtp_enabled"] is True
    assert set(out["phase_ms"]) == {"verify", "draft", "accept", "finalize", "residual"}
    assert len(out["per_position_acceptance"]) == 2
    assert out["host_syncs_per_round"] == 1.0
    tok = load_tokenizer(dense_dir)
    ref = reference_greedy(dense_dir, tok.encode(PROMPT), 16)
    eos = tok.eos_token_ids
    ref = ref[: next((i for i, t in enumerate(ref) if t in eos), len(ref))]
    assert out["tokens"] == ref
    assert out["text"] == "".join(r.text for r in mlx_stream(dense_dir, tok, PROMPT, 16))


@pytest.mark.subprocess
def test_no_mtp_runs_mlx_lm_plain_decode_with_the_same_text(dense_dir):
    args = ["--model", dense_dir, "--prompt", PROMPT, "--max-tokens", 16, "--json"]
    plain = json.loads(cli(*args, "--no-mtp").stdout)
    mtp = json.loads(cli(*args, "--block-size", 4).stdout)
    assert plain["mtp_enabled"] is False
    assert plain["tokens"] == mtp["tokens"] and len(plain["tokens"]) > 0
    assert plain["text"] == mtp["text"]


@pytest.mark.subprocess
def test_no_mtp_needs_no_head(mlx_dir):
    out = json.loads(cli("--model", mlx_dir, "--max-tokens", 4, "--no-mtp", "--json").stdout)
    assert out["mtp_enabled"] is False


def table(stderr: str) -> dict:
    """The stats table after the ``=`` line: label -> value."""
    lines = stderr.splitlines()
    rows = lines[lines.index("=" * 40) + 3:]  # after the header and its rule
    return dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in rows)


SHORT = ["mtp", "exactness", "prompt", "generation", "tokens per round", "block size",
         "block sizes used (width: rounds)", "draft 1 accepted", "draft 2 accepted",
         "peak memory"]
FULL_ONLY = ["exactness probe", "row-exact layers", "verify attention", "acceptance rule", "rounds",
             "drafted / accepted", "acceptance rate", "verify ms/round", "draft ms/round",
             "accept ms/round", "finalize ms/round", "residual ms/round", "drafter step ms (Nx)",
             "drafter step split (ms)", "accept hook ms (Nx)", "accept hook split (ms)",
             "cpu blas", "C kernels"]


@pytest.mark.subprocess
def test_human_output_is_text_then_one_short_table_and_full_adds_the_internals(dense_dir):
    args = ["--model", dense_dir, "--prompt", PROMPT, "--max-tokens", 8, "--block-size", 3]
    r = cli(*args)
    assert "=" * 40 not in r.stdout  # the text alone on stdout, the statistics on stderr
    short = table(r.stderr)
    assert list(short) == SHORT
    assert short["mtp"] == "on"
    assert short["exactness"] == ("the same tokens as plain greedy decode (the probe checked "
                                  "this device)")
    assert short["block size"] == "3"
    out = json.loads(cli(*args, "--json").stdout)
    assert short["tokens per round"] == f"{out['tokens_per_round']:.3f}"
    assert short["draft 1 accepted"] == (f"{out['per_position_acceptance'][0]:.3f} "
                                         f"(of {out['per_position_rounds'][0]} rounds)")
    full = table(cli(*args, "--stats", "full").stderr)
    assert {re.sub(r"\(\d+x\)", "(Nx)", label) for label in full} == set(SHORT) | set(FULL_ONLY)
    assert full["exactness probe"] == "equal (width 2, 3)"
    assert full["acceptance rule"] == "greedy"


@pytest.mark.subprocess
def test_the_short_table_names_the_rule_when_sampling_and_why_mtp_is_off(dense_dir):
    args = ["--model", dense_dir, "--prompt", PROMPT, "--max-tokens", 8]
    sampled = table(cli(*args, "--temp", "0.7", "--seed", "3").stderr)
    assert sampled["exactness"] == "the same distribution as plain sampling"
    assert sampled["acceptance rule"] == "gumbel-coupled"
    assert "exactness probe" not in sampled
    plain = table(cli(*args, "--no-mtp").stderr)
    assert list(plain) == ["mtp", "prompt", "generation", "peak memory"]
    assert plain["mtp"] == "off (--no-mtp: mlx-lm plain decode)"


@pytest.mark.subprocess
@pytest.mark.parametrize("args,message", [
    (["--model", "/no/such/dir"], "error: model path /no/such/dir does not exist"),
    (["--max-tokens", "0"], "error: argument --max-tokens: must be at least 1, got 0"),
    (["--block-size", "0"], "error: argument --block-size: must be between 1 and 16, got 0"),
    (["--block-size", "100"], "error: argument --block-size: must be between 1 and 16, got 100"),
    (["--temp", "-1"], "error: argument --temp: must be >= 0, got -1"),
    (["--stats", "verbose"],
     "error: argument --stats: invalid choice: 'verbose' (choose from 'short', 'full')"),
])
def test_bad_input_is_one_line_and_nonzero(args, message):
    r = cli(*args, check=False)
    assert r.returncode != 0
    assert r.stderr.strip() == message
    assert "Traceback" not in r.stderr


@pytest.mark.subprocess
def test_checkpoint_errors_reach_the_cli_as_one_line(mlx_dir, tmp_path):
    r = cli("--model", mlx_dir, "--max-tokens", 4, check=False)
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "has no MTP head weights" in r.stderr
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))
    r = cli("--model", tmp_path, check=False)
    assert r.returncode == 1 and r.stderr.strip().endswith("no model*.safetensors weight files found")


def test_stream_generate_last_response_carries_stats(dense_dir):
    model, tok = mlx_mtp.load(dense_dir)
    responses = list(mlx_mtp.stream_generate(model, tok, PROMPT, max_tokens=10, block_size=3))
    last = responses[-1]
    assert isinstance(last.stats, RunStats)
    assert all(r.stats is None for r in responses[:-1])
    assert last.finish_reason in ("length", "stop")
    assert last.stats.prompt_tokens == len(tok.encode(PROMPT))
    assert last.stats.rounds >= 1
    assert [r.token for r in responses] == [r.token for r in mlx_stream(dense_dir, tok, PROMPT, 10)]
    assert "".join(r.text for r in responses) == "".join(
        r.text for r in mlx_stream(dense_dir, tok, PROMPT, 10))
