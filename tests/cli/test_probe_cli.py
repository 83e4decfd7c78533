"""``python -m mlx_mtp.probe``: the per-width report, its JSON, and one-line errors."""

import json
from pathlib import Path

import mlx.core as mx
import pytest
from support.processes import run_module
from support.perturbed import PerturbedVerify

from mlx_mtp.exactness import block_vs_chain as exactness
from mlx_mtp.models.model import MTPModel

ROOT = Path(__file__).resolve().parents[2]


def probe_cli(*args, check=True):
    return run_module("mlx_mtp.probe", *args, check=check)


@pytest.mark.subprocess
def test_json_report_per_width(dense_dir):
    out = json.loads(probe_cli("--model", dense_dir, "--block-sizes", "4,2,3", "--json").stdout)
    assert out["verdict"] == "equal"
    assert (out["device"], out["gpu_generation"], out["dtype"], out["draws"]) == \
        ("cpu", None, "float32", 3)
    assert out["mlx_version"] == mx.__version__
    assert [(w["width"], w["verdict"], w["position"], w["differing_bytes"], w["total_bytes"])
            for w in out["widths"]] == [(2, "equal", None, 0, 1280), (3, "equal", None, 0, 1280),
                                        (4, "equal", None, 0, 1280)]


@pytest.mark.subprocess
def test_text_report(dense_dir, mlx_dir):
    # a head-less MLX conversion probes fine: the probe needs only the target
    lines = probe_cli("--model", mlx_dir, "--block-sizes", "2,5").stdout.splitlines()
    assert lines[0] == f"model {mlx_dir} (float32) on cpu ({mx.device_info(mx.cpu)['architecture']}), MLX {mx.__version__}"
    assert lines[1].split() == ["width", "verdict", "first", "differing", "position", "bytes",
                                "differing", "why", "not", "run"]
    assert lines[3].split() == ["2", "equal", "-", "0", "of", "1280", "-"]
    assert lines[4].split() == ["5", "equal", "-", "0", "of", "1280", "-"]
    assert lines[5].startswith("verdict: equal (3 draws per width, ")


@pytest.mark.subprocess
def test_default_widths_and_drafter(dense_dir, mlx_dir):
    out = json.loads(probe_cli("--model", mlx_dir, "--drafter", dense_dir, "--json").stdout)
    assert [w["width"] for w in out["widths"]] == [2, 3, 4]
    assert out["drafter"] == str(dense_dir)


def test_a_diverging_target_is_reported_with_position_and_bytes(dense_dir, monkeypatch, capsys):
    from mlx_mtp.models import loader
    from mlx_mtp import probe

    real = loader.load_model

    def load_perturbed(*a, **kw):
        m = real(*a, **kw)
        return MTPModel(m.mlx_model, PerturbedVerify(m.target, position=1), m.drafter)

    monkeypatch.setattr(loader, "load_model", load_perturbed)
    exactness.clear_memo()
    assert probe.main(["--model", str(dense_dir), "--block-sizes", "2,3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == "diverges"
    (w2, w3) = out["widths"]
    assert (w2["verdict"], w2["position"], w2["draw"], w2["total_bytes"]) == ("diverges", 1, 0, 1280)
    assert 0 < w2["differing_bytes"] < 1280 and w3["differing_bytes"] == w2["differing_bytes"]
    assert probe.main(["--model", str(dense_dir), "--block-sizes", "2"]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[3].split() == ["2", "diverges", "1", str(w2["differing_bytes"]), "of", "1280", "-"]
    assert text[4].startswith("verdict: diverges")


@pytest.mark.subprocess
@pytest.mark.parametrize("args,message", [
    (["--model", "/no/such/dir"], "error: model path /no/such/dir does not exist"),
    (["--model", "x", "--block-sizes", "1,2"],
     "error: argument --block-sizes: expected comma-separated block sizes between 2 and 16 "
     "(block size 1 has no verify block), got '1,2'"),
    (["--model", "x", "--block-sizes", "2,x"],
     "error: argument --block-sizes: expected comma-separated block sizes between 2 and 16 "
     "(block size 1 has no verify block), got '2,x'"),
    (["--model", "x", "--block-sizes", "17"],
     "error: argument --block-sizes: expected comma-separated block sizes between 2 and 16 "
     "(block size 1 has no verify block), got '17'"),
])
def test_bad_input_is_one_line_and_nonzero(args, message):
    r = probe_cli(*args, check=False)
    assert r.returncode != 0
    assert r.stderr.strip() == message
    assert "Traceback" not in r.stderr


@pytest.mark.subprocess
def test_without_model_probes_the_demo_pair():
    from mlx_mtp.demo import demo_path

    out = json.loads(probe_cli("--block-sizes", "2", "--json").stdout)
    assert out["model"] == str(demo_path())
    assert [(w["width"], w["verdict"]) for w in out["widths"]] == [(2, "equal")]
    assert out["verdict"] == "equal"


@pytest.mark.subprocess
def test_drafter_without_model_is_refused(dense_dir):
    r = probe_cli("--drafter", dense_dir, check=False)
    assert r.returncode != 0
    assert r.stderr.strip() == "error: --drafter needs --model: the embedded demo pair has its own head"
