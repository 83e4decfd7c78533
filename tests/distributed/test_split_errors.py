"""Bad split requests are one error line each, in one process (no launch needed)."""

import json

import pytest

from support import tiny_checkpoints as tc
from support import tiny_gemma4 as tg
import mlx_mtp
from mlx_mtp.models.distributed import DEFAULT_TIMEOUT_S, TIMEOUT_ENV, timeout_from_env
from mlx_mtp.errors import MTPError
from mlx_mtp.generate import main


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return tc.write_agreeing_checkpoint(tmp_path_factory.mktemp("split_err") / "agree")


def test_split_without_a_launch_is_one_line(qwen_dir, capsys):
    assert main(["--model", str(qwen_dir), "--split", "pipeline"]) == 1
    assert capsys.readouterr().err == (
        "error: --split pipeline needs 2 or more processes: start it with mlx.launch (e.g. "
        "mlx.launch --backend ring -n 2 -- python -m mlx_mtp.generate ...)\n")


def test_unknown_split_is_refused(qwen_dir, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--model", str(qwen_dir), "--split", "rows"])
    assert e.value.code == 2
    assert "argument --split: invalid choice: 'rows'" in capsys.readouterr().err
    with pytest.raises(MTPError, match=r"^split must be one of pipeline, tensor, got 'rows'$"):
        mlx_mtp.load(qwen_dir, split="rows")


def test_gemma4_cannot_be_split(tmp_path, capsys):
    import mlx_lm

    target = tg.write_target(tmp_path / "g4", "e2b")
    assistant = tg.write_assistant(tmp_path / "g4a", "e2b")
    model_type = json.loads((target / "config.json").read_text())["model_type"]
    assert main(["--model", str(target), "--drafter", str(assistant), "--split", "tensor"]) == 1
    assert capsys.readouterr().err == (
        f"error: {target}: --split tensor: mlx-lm {mlx_lm.__version__} cannot split {model_type} "
        "(no pipeline or shard method); only Qwen3.5 / 3.6 / Qwen3-Next targets can be split\n")


def test_qwen3_next_has_no_tensor_split(tmp_path, capsys):
    import mlx_lm

    target = tc.write_raw_hf_qwen3_next(tmp_path / "next")
    assert main(["--model", str(target), "--split", "tensor"]) == 1
    assert capsys.readouterr().err == (
        f"error: {target}: --split tensor: mlx-lm {mlx_lm.__version__} cannot split qwen3_next "
        "that way; use --split pipeline\n")


def test_timeout_env():
    assert timeout_from_env({}) == DEFAULT_TIMEOUT_S
    assert timeout_from_env({TIMEOUT_ENV: "2.5"}) == 2.5
    for bad in ("0", "-1", "soon"):
        with pytest.raises(MTPError, match=rf"^{TIMEOUT_ENV} must be a positive number of "
                                           rf"seconds, got '{bad}'$"):
            timeout_from_env({TIMEOUT_ENV: bad})


def test_split_server_without_a_launch_is_one_line(qwen_dir, capsys):
    pytest.importorskip("uvicorn")
    from mlx_mtp.server.__main__ import main as server_main

    assert server_main(["--model", str(qwen_dir), "--split", "tensor", "--port", "0"]) == 1
    assert capsys.readouterr().err == (
        "error: --split tensor needs 2 or more processes: start it with mlx.launch (e.g. "
        "mlx.launch --backend ring -n 2 -- python -m mlx_mtp.server ...)\n")
