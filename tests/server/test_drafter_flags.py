"""``python -m mlx_mtp.server`` takes every drafter flag the CLI takes (``--draft-vocab``,
``--draft-bits``, ``--draft-group-size``, ``--draft-quantize-fc``, ``--draft-bf16``) and
``--acceptance``: real server processes on a tiny checkpoint, whose ``/health`` ``draft`` is the
loaded drafter's ``describe()`` (the CLI's ``--json`` ``draft``)."""

import json

import pytest
from support.processes import run_module

import mlx_mtp
from benchmarks.harness.server_process import ServerProcess
from mlx_mtp import draft_vocab as draft_vocab_cli

pytestmark = pytest.mark.subprocess  # every test talks to a server process

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

SIZE = 64  # the sidecar's draft vocabulary (the tiny checkpoint's is 320)


@pytest.fixture(scope="module")
def sidecar(dense_dir, tmp_path_factory):
    from support import tiny_checkpoints as tc

    d = tmp_path_factory.mktemp("vocab")
    corpus = d / "corpus.txt"
    corpus.write_text("\n\n".join(tc.CORPUS))
    assert draft_vocab_cli.main(["build", "--model", str(dense_dir), "--size", str(SIZE),
                                 "--out", str(d / "sidecar"), "--corpus", str(corpus)]) == 0
    return d / "sidecar"


def sampled_mtp(server) -> dict:
    """The ``mtp`` object of one completion at temperature 1."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                           timeout=120)
    r = client.completions.create(model="tiny", prompt="def add", max_tokens=8, temperature=1.0,
                                  seed=3)
    return r.model_extra["mtp"]


def test_the_default_drafter(dense_dir):
    """What the flags below change: the full vocabulary, unquantized, float32 products."""
    d = mlx_mtp.load_model(dense_dir).drafter.describe()
    assert (d["reduced_vocab"], d["vocab_size"], d["bits"], d["group_size"], d["fc_quantized"],
            d["bf16"]) == (False, 320, [], [], False, False)


def test_vocab_and_quantization_flags_reach_the_servers_drafter(dense_dir, sidecar):
    """Batched (the default --max-batch): the acceptance rule reaches the batch's sequences."""
    flags = ["--draft-vocab", sidecar, "--draft-bits", 8, "--draft-group-size", 32,
             "--draft-quantize-fc"]
    with ServerProcess("--log-level", "warning", "--model", str(dense_dir), "--acceptance",
                       "point-mass", *flags) as s:
        health = s.get("/health")
        draft = health["draft"]
        assert (draft["reduced_vocab"], draft["vocab_size"], draft["bits"], draft["group_size"],
                draft["fc_quantized"]) == (True, SIZE, [8], [32], True)
        ref = json.loads(run_module("mlx_mtp.generate", "--model", dense_dir, *flags,
                                    "--max-tokens", 2, "--ignore-chat-template",
                                    "--json").stdout)
        assert draft == ref["draft"]
        assert health["batch"]["batched"] is True
        mtp = sampled_mtp(s)
        assert (mtp["batched"], mtp["acceptance_rule"]) == (True, "point-mass")


def test_bf16_flag_reaches_the_servers_drafter(dense_dir):
    """One request at a time: the acceptance rule reaches ``stream_generate``."""
    with ServerProcess("--log-level", "warning", "--model", str(dense_dir), "--draft-bf16",
                       "--max-batch", 1, "--acceptance", "point-mass") as s:
        assert s.get("/health")["draft"]["bf16"] is True
        mtp = sampled_mtp(s)
        assert (mtp["batched"], mtp["acceptance_rule"]) == (False, "point-mass")
