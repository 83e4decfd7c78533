"""``python -m mlx_mtp.convert``: every checkpoint layout converted (unquantized, 4- and 8-bit),
loaded by mlx-lm alone and by ``mlx_mtp.load`` with its embedded drafter, T=0 output equal to
mlx-lm's plain decode of the converted target; FP8 block-quantized checkpoints dequantized
exactly; safe writes."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from support import tiny_checkpoints as tc
from support import tiny_fp8 as tf
from support.processes import run_module
from mlx.utils import tree_flatten
from mlx_lm.convert import convert as mlx_lm_convert
from mlx_lm.generate import generate_step as mlx_generate_step
from mlx_lm.utils import load_model as mlx_load_model
from support.tiny_gemma4 import Checkpoints

import mlx_mtp
from mlx_mtp import MTPError
from mlx_mtp import convert as conversion

PROMPT = [5, 17, 3, 99, 42]
ROOT = Path(__file__).resolve().parents[2]


def convert_cli(src, out, *args):
    r = run_module("mlx_mtp.convert", "--hf-path", src, "--mlx-path", out, "--quiet", "--json",
                   *args)
    return json.loads(r.stdout)


def plain_greedy(model, n):
    return [t for t, _ in mlx_generate_step(mx.array(PROMPT), model, max_tokens=n)]


def mtp_greedy(model, n, block_size=3):
    return [t for t, _ in mlx_mtp.generate_step(mx.array(PROMPT), model, max_tokens=n,
                                                block_size=block_size)]


def check_converted(out, bits=None, n=12):
    """mlx-lm alone loads OUT (quantized as asked); ``mlx_mtp.load_model(OUT)`` finds the drafter;
    its T=0 tokens are mlx-lm's plain greedy tokens of the converted target."""
    plain, config = mlx_load_model(Path(out))
    quantized = {type(m).__name__ for _, m in plain.named_modules() if hasattr(m, "bits")}
    if bits is None:
        assert "quantization" not in config and not quantized
    else:
        assert config["quantization"]["bits"] == bits and "QuantizedLinear" in quantized
    model = mlx_mtp.load_model(out)
    assert model.drafter is not None
    assert mtp_greedy(model, n) == plain_greedy(plain, n)
    return model


def params(module):
    return {k: np.asarray(v) for k, v in tree_flatten(module.parameters())}


def assert_same_params(a, b):
    pa, pb = params(a), params(b)
    assert sorted(pa) == sorted(pb)
    for k in pa:
        assert pa[k].dtype == pb[k].dtype and np.array_equal(pa[k], pb[k]), k


# --------------------------------------------------------------------------- Qwen layouts


@pytest.mark.subprocess
@pytest.mark.parametrize("bits", [None, 4, 8])
def test_dense(dense_dir, tmp_path, bits):
    out = tmp_path / "out"
    q = [] if bits is None else ["-q", "--q-bits", bits, "--q-group-size", 32]
    r = convert_cli(dense_dir, out, *q)
    assert r["out"] == str(out) and r["quantized"] == (bits is not None)
    assert sorted(p.name for p in (out / "mtp").iterdir()) == ["config.json", "model.safetensors"]
    model = check_converted(out, bits)
    # the embedded head is the checkpoint's own (norms shifted once, not twice)
    assert_same_params(model.drafter.head, mlx_mtp.load_model(dense_dir).drafter.head)
    assert "quantization" not in json.loads((out / "mtp" / "config.json").read_text())


def test_target_is_mlx_lm_converts(dense_dir, tmp_path):
    """Same tensors, index and config as ``mlx_lm.convert`` writes for the target."""
    mlx_lm_convert(str(dense_dir), str(tmp_path / "ref"), quantize=True, q_bits=4, q_group_size=32)
    conversion.convert(dense_dir, tmp_path / "ours", quantize=True, q_bits=4, q_group_size=32,
                       quiet=True)
    ref, ours = tmp_path / "ref", tmp_path / "ours"
    a, b = mx.load(str(ref / "model.safetensors")), mx.load(str(ours / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and mx.array_equal(a[k], b[k]).item(), k
    for f in ("config.json", "model.safetensors.index.json", "tokenizer.json",
              "tokenizer_config.json"):
        assert (ref / f).read_text() == (ours / f).read_text(), f
    assert sorted(p.name for p in ours.iterdir()) == sorted([p.name for p in ref.iterdir()] + ["mtp"])


@pytest.mark.subprocess
def test_quantized_head_and_draft_vocab(dense_dir, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(tc.CORPUS) * 3)
    out = tmp_path / "out"
    r = convert_cli(dense_dir, out, "-q", "--q-bits", 8, "--q-group-size", 32, "--head-bits", 4,
                    "--head-group-size", 32, "--draft-vocab", 64, "--corpus", corpus)
    assert r["head_bits"] == 4 and r["draft_vocab"]["size"] == 64
    head_config = json.loads((out / "mtp" / "config.json").read_text())
    assert head_config["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    model = check_converted(out, bits=8)
    head = model.drafter.head
    assert head.layers[0].self_attn.q_proj.bits == 4 and type(head.fc).__name__ == "Linear"
    ids = model.drafter.lm.ids
    assert ids is not None and ids.shape == (64,)
    assert np.array_equal(np.asarray(ids), np.asarray(mx.load(str(
        out / "mtp" / "draft_vocab" / "draft_vocab.safetensors"))["ids"]))


@pytest.mark.subprocess
def test_moe_fused_experts(moe_dir, tmp_path):
    check_converted(convert_cli(moe_dir, tmp_path / "plain")["out"])
    out = tmp_path / "q4"
    convert_cli(moe_dir, out, "-q", "--q-bits", 4, "--q-group-size", 32)
    check_converted(out, bits=4)


@pytest.mark.subprocess
def test_qwen3_next(next_dir, tmp_path):
    check_converted(convert_cli(next_dir, tmp_path / "plain")["out"])
    out = tmp_path / "q8"
    convert_cli(next_dir, out, "-q", "--q-bits", 8, "--q-group-size", 32)
    check_converted(out, bits=8)


@pytest.mark.subprocess
def test_mlx_conversion_with_drafter(mlx_dir, dense_dir, tmp_path):
    """An MLX conversion has no mtp.*: --drafter names where the head comes from."""
    r = run_module("mlx_mtp.convert", "--hf-path", mlx_dir, "--mlx-path", tmp_path / "a",
                   check=False)
    assert r.returncode == 1 and "has no MTP head weights (mtp.*)" in r.stderr
    assert not (tmp_path / "a").exists()
    out = tmp_path / "b"
    convert_cli(mlx_dir, out, "--drafter", dense_dir)
    model = check_converted(out)
    assert_same_params(model.drafter.head, mlx_mtp.load_model(dense_dir).drafter.head)


# --------------------------------------------------------------------------------- Gemma 4


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return Checkpoints(tmp_path_factory)


@pytest.mark.subprocess
@pytest.mark.parametrize("bits", [None, 4])
def test_gemma4_pair(gemma, tmp_path, bits):
    out = tmp_path / "out"
    q = [] if bits is None else ["-q", "--q-bits", bits]
    r = convert_cli(gemma.target("e2b"), out, "--drafter", gemma.assistant("e2b"), *q)
    assert r["assistant"] == str(gemma.assistant("e2b"))
    model = check_converted(out, bits)
    reference = mlx_mtp.load_model(gemma.target("e2b"), drafter=gemma.assistant("e2b"))
    assert_same_params(model.drafter.assistant, reference.drafter.assistant)


@pytest.mark.subprocess
def test_gemma4_refuses_head_flags(gemma, tmp_path):
    r = run_module("mlx_mtp.convert", "--hf-path", gemma.target("e2b"), "--mlx-path",
                   tmp_path / "o", "--head-bits", "4", check=False)
    assert r.returncode == 1
    assert r.stderr == ("error: --head-bits and --draft-vocab apply to the Qwen MTP head, not to "
                        "a Gemma 4 assistant\n")


# ------------------------------------------------------------------------------------- FP8


@pytest.fixture(scope="module")
def fp8_dense(tmp_path_factory, dense_dir):
    """Blocks of 32 so the tiny projections span several blocks, with cut edge blocks."""
    return tf.write_fp8(dense_dir, tmp_path_factory.mktemp("fp8") / "dense", block=(32, 32))


@pytest.fixture(scope="module")
def fp8_moe(tmp_path_factory, moe_dir):
    """Qwen3.6-35B-A3B-FP8's layout: 128x128 blocks, bf16 scales, experts per expert."""
    return tf.write_fp8(moe_dir, tmp_path_factory.mktemp("fp8") / "moe", block=(128, 128),
                        scale_dtype="BF16")


@pytest.fixture(scope="module")
def fp8_next(tmp_path_factory, next_dir):
    """Qwen3-Next-80B-A3B-*-FP8's layout: flat ``model.layers.*`` keys, experts per expert."""
    return tf.write_fp8(next_dir, tmp_path_factory.mktemp("fp8") / "next", block=(128, 128),
                        scale_dtype="BF16")


def reference(fp8_dir):
    return np.load(fp8_dir.parent / f"{fp8_dir.name}-reference.npz")


@pytest.mark.parametrize("which", ["dense", "moe", "next"])
def test_fp8_loads_dequantized_exactly(which, fp8_dense, fp8_moe, fp8_next):
    path, block = {"dense": (fp8_dense, (32, 32)), "moe": (fp8_moe, (128, 128)),
                   "next": (fp8_next, (128, 128))}[which]
    ref = reference(path)
    model = mlx_mtp.load_model(path)  # float32 on the CPU: the product rounded once, to f32
    target, head = params(model.mlx_model), params(model.drafter.head)
    checked = 0
    for name in [k for k in ref.files if not k.endswith("_scale_inv")]:
        want = tf.reference_dequantize(ref[name], ref[name + "_scale_inv"], block)
        expert = name.split(".experts.")
        if name.startswith("mtp."):
            key, rest = name[len("mtp."):], None
            got_params = head
        else:
            key = name.replace("model.language_model.", "language_model.model.")
            got_params = target
        if len(expert) == 2:  # experts.E.gate_proj.weight -> switch_mlp.gate_proj.weight[E]
            e, rest = expert[1].split(".", 1)
            key = key.split(".experts.")[0] + ".switch_mlp." + rest
            got = got_params[key][int(e)]
        else:
            got = got_params[key]
        assert got.dtype == np.float32 and np.array_equal(got, want), name
        checked += 1
    assert checked == len(ref.files) // 2 and checked > 10
    # MTP runs from the FP8 folder itself, exactly as plain decoding of its dequantized target
    assert model.drafter is not None
    assert mtp_greedy(model, 12) == plain_greedy(model.mlx_model, 12)


@pytest.mark.subprocess
def test_fp8_generate_cli(fp8_moe):
    """The issue's report: ``generate --model FP8_DIR`` used to fail with a cut-off weight list."""
    r = run_module("mlx_mtp.generate", "--model", fp8_moe, "--prompt", "def add", "--max-tokens",
                   8, "--json")
    out = json.loads(r.stdout)
    assert out["mtp_enabled"] is True and len(out["tokens"]) == 8


def test_fp8_edge_blocks():
    """A weight whose dims are not multiples of the block: the last blocks are cut."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((2, 300, 200)).astype(np.float32)
    raw, scale = tf.quantize(w, (128, 128), "F32")
    assert scale.shape == (2, 3, 2)
    from mlx_mtp.io.fp8 import dequantize

    got = np.asarray(dequantize(mx.array(raw), mx.array(scale), (128, 128)))
    assert np.array_equal(got, tf.reference_dequantize(raw, scale, (128, 128)))
    with pytest.raises(MTPError, match=r"w_scale_inv: shape \(2, 2, 2\), expected \(2, 3, 2\)"):
        dequantize(mx.array(raw), mx.array(scale[:, :2]), (128, 128), name="w")


@pytest.mark.subprocess
@pytest.mark.parametrize("which,bits", [("dense", None), ("moe", None), ("moe", 4)])
def test_fp8_convert(which, bits, fp8_dense, fp8_moe, tmp_path):
    src = fp8_dense if which == "dense" else fp8_moe
    out = tmp_path / "out"
    q = [] if bits is None else ["-q", "--q-bits", bits, "--q-group-size", 32]
    r = convert_cli(src, out, "--dtype", "float32", *q)
    assert r["fp8_dequantized"] is True
    config = json.loads((out / "config.json").read_text())
    assert config.get("quantization_config", {}).get("quant_method") != "fp8"
    model = check_converted(out, bits)
    if bits is None:  # the same weights as loading the FP8 folder directly
        direct = mlx_mtp.load_model(src)
        assert_same_params(model.mlx_model, direct.mlx_model)
        assert_same_params(model.drafter.head, direct.drafter.head)


@pytest.mark.subprocess
def test_unsupported_quantization_is_one_line(dense_dir, tmp_path):
    bad = tmp_path / "bnb"
    bad.mkdir()
    for f in dense_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(MTPError) as e:
        mlx_mtp.load_model(bad)
    assert str(e.value) == (f"{bad / 'config.json'}: quantization_config.quant_method "
                            "'bitsandbytes' is not supported: use the BF16 checkpoint, or an MLX "
                            "conversion of it (python -m mlx_mtp.convert -q)")
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e5m2",
                                     "weight_block_size": [128, 128]}
    (bad / "config.json").write_text(json.dumps(config))
    r = run_module("mlx_mtp.generate", "--model", bad, "--max-tokens", 2, check=False)
    assert r.returncode == 1 and r.stderr == (
        f"error: {bad / 'config.json'}: FP8 format 'e5m2' is not supported (only e4m3 "
        "block-quantized checkpoints load): use the BF16 checkpoint\n")


def test_loader_error_keeps_tensor_names(dense_dir, tmp_path):
    bad = tmp_path / "extra"
    bad.mkdir()
    for f in dense_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    w = mx.load(str(bad / "model.safetensors"))
    for i in range(7):
        w[f"model.language_model.extra_{i}.weight"] = mx.zeros((2,))
    mx.save_safetensors(str(bad / "model.safetensors"), w, metadata={"format": "pt"})
    with pytest.raises(MTPError) as e:
        mlx_mtp.load_model(bad)
    names = ", ".join(f"language_model.model.extra_{i}.weight" for i in range(5))
    assert str(e.value) == (f"{bad}: weights do not match config.json (Received 7 parameters not "
                            f"in model: {names}, ... (7 in all))")


# ------------------------------------------------------------------------------ safe writes


@pytest.mark.subprocess
def test_existing_output_is_an_error(dense_dir, tmp_path):
    (tmp_path / "out").mkdir()
    r = run_module("mlx_mtp.convert", "--hf-path", dense_dir, "--mlx-path", tmp_path / "out",
                   check=False)
    assert r.returncode == 1
    assert r.stderr == (f"error: --mlx-path {tmp_path / 'out'} already exists: choose a new "
                        "folder or delete it\n")


@pytest.mark.parametrize("exc", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_failure_mid_write_leaves_nothing(dense_dir, tmp_path, monkeypatch, exc):
    """A failure after the weight shards are written, before the config: no OUT, no temp."""
    written = []

    def fail(*a, **k):
        written.extend(p.name for p in tmp_path.glob(".out.partial-*/*.safetensors"))
        raise exc

    monkeypatch.setattr(conversion.mlx_lm_utils, "save_config", fail)
    with pytest.raises(type(exc)):
        conversion.convert(dense_dir, tmp_path / "out", quiet=True)
    assert written == ["model.safetensors"]  # it failed mid-write
    assert list(tmp_path.iterdir()) == []


@pytest.mark.subprocess
def test_killed_convert_leaves_nothing_at_out(dense_dir, tmp_path):
    """SIGKILL while converting: OUT never appears (only the hidden temporary folder)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-m", "mlx_mtp.convert", "--hf-path", str(dense_dir),
                          "--mlx-path", str(tmp_path / "out"), "--quiet", "-q"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list(tmp_path.glob(".out.partial-*")) and time.time() < deadline:
        assert p.poll() is None, "finished before it could be killed"
        time.sleep(0.01)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not (tmp_path / "out").exists()
    assert [q.name.startswith(".out.partial-") for q in tmp_path.iterdir()] == [True]


@pytest.mark.subprocess
@pytest.mark.parametrize("quantize", [False, True])
def test_a_shipped_draft_vocabulary_goes_along(tmp_path, quantize, caplog):
    """The demo pair ships ``mtp/draft_vocab``: its conversion keeps it, and the converted folder
    drafts over it (a quantized head too: the sidecar's fingerprint is re-taken)."""
    from mlx_mtp.demo import demo_path

    src = demo_path() / "mtp" / "draft_vocab"
    out = tmp_path / "demo"
    r = convert_cli(demo_path(), out, *(["-q"] if quantize else []))
    shipped = json.loads((src / "draft_vocab.json").read_text())
    assert r["draft_vocab"]["size"] == shipped["size"]
    sidecar = out / "mtp" / "draft_vocab"
    assert np.array_equal(np.asarray(mx.load(str(sidecar / "draft_vocab.safetensors"))["ids"]),
                          np.asarray(mx.load(str(src / "draft_vocab.safetensors"))["ids"]))
    with caplog.at_level("WARNING", logger="mlx_mtp"):
        model, _ = mlx_mtp.load(str(out))
    assert not [m for m in caplog.messages if "draft vocabulary" in m]  # no fallback
    assert model.drafter.lm.ids is not None and model.drafter.lm.ids.shape == (shipped["size"],)
