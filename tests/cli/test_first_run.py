"""What a newcomer meets first: ``python -m mlx_mtp.generate`` with no arguments, run as a user
runs it (a fresh interpreter), and its rough edges: where the statistics go, help texts, an empty
prompt, a one-token run."""

import json
import re
import shutil

import pytest
from support.processes import cli

from benchmarks.common import distinct_ngram_share
from mlx_mtp.cpu import native
from mlx_mtp.demo import DEMO_DECODE

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]


def test_the_default_run_writes_text_that_does_not_loop_and_equals_plain_decode():
    mtp = json.loads(cli("--json").stdout)
    plain = json.loads(cli("--json", "--no-mtp").stdout)
    assert mtp["tokens"] == plain["tokens"]
    assert len(mtp["tokens"]) == 256
    assert distinct_ngram_share(mtp["tokens"], 4) >= 0.6
    # the demo's decode settings are applied and reported
    assert mtp["repetition_penalty"] == DEMO_DECODE.repetition_penalty
    assert mtp["repetition_context_size"] == DEMO_DECODE.repetition_context_size
    assert mtp["mtp_enabled"] and mtp["rounds"] > 0
    # a plain install brings what the lazy kernels need (nanobind, cmake; a C++ compiler here)
    if native.cpu_problem() is None and shutil.which("c++"):
        assert mtp["cpu_kernels"] == "lazy"


def test_the_text_goes_to_stdout_and_the_statistics_to_stderr():
    r = cli("--max-tokens", "12")
    assert "statistic" not in r.stdout and "tok/s" not in r.stdout
    assert "statistic" in r.stderr and "tokens per round" in r.stderr
    text = json.loads(cli("--max-tokens", "12", "--json").stdout)["text"]
    assert r.stdout == text + "\n"
    quiet = cli("--max-tokens", "12", "--verbose", "False")
    assert quiet.stdout == r.stdout
    assert "statistic" not in quiet.stderr


def test_a_bad_verbose_value_is_one_line_naming_the_flag():
    r = cli("--verbose", "maybe", check=False)
    assert r.returncode == 2
    assert r.stderr.strip() == "error: argument --verbose: expected True or False, got 'maybe'"


def test_an_empty_prompt_is_refused_in_cli_terms():
    r = cli("--prompt", "", check=False)
    assert r.returncode == 2
    assert r.stderr.strip() == ("error: argument --prompt: expected some text to continue, got "
                                "an empty string")


def test_a_one_token_run_shows_no_rate_it_could_not_measure():
    r = cli("--max-tokens", "1")
    line = next(l for l in r.stderr.splitlines() if l.startswith("generation"))
    assert line.split()[1:] == ["1", "tokens,", "n/a", "tok/s"]


def option_help(out: str, flag: str) -> str:
    """The help entry of ``flag`` (``FLAG METAVAR text``, up to the next option) in ``--help``
    output with its whitespace collapsed."""
    m = re.search(rf" {re.escape(flag)} [A-Z_]+ (.*?)(?= --?[a-z]|$)", out)
    assert m, flag
    return m.group(1)


def test_help_shows_the_defaults_and_names_every_acceptance_rule():
    out = " ".join(cli("--help").stdout.split())
    assert "(default 256)" in option_help(out, "--max-tokens")
    assert "(default 0" in option_help(out, "--temp")  # greedy
    for rule in ("greedy", "point-mass", "speculative-sampling", "gumbel-coupled"):
        assert rule in out
    assert str(DEMO_DECODE.repetition_penalty) in option_help(out, "--repetition-penalty")


def test_a_repetition_penalty_given_replaces_the_demo_setting():
    r = json.loads(cli("--max-tokens", "8", "--repetition-penalty", "1.0", "--json").stdout)
    assert r["repetition_penalty"] == 1.0
    assert r["repetition_context_size"] == 20  # mlx-lm's default, not the demo's
