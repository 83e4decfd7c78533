"""The Gemma 4 assistant on bfloat16 copies of its weights (``DraftOptions.bf16``): on by default
for a bfloat16 checkpoint, the same step as the float32 assistant's up to summation order, and
T=0 output identical to mlx-lm's with chains and trees on the MoE target."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from support.processes import cli
from support.reference import reference_greedy
from mlx_lm.tokenizer_utils import load as load_tokenizer
from support.tiny_gemma4 import (Checkpoints, assistant_config, random_assistant_weights,
                                 write_assistant)

import mlx_mtp
from mlx_mtp import MTPError
from mlx_mtp.models.gemma4.bf16_assistant import Bf16Linear, Bf16TiedHead
from mlx_mtp.models.options import DraftOptions
from mlx_mtp.models import bf16_weights

pytestmark = pytest.mark.skipif(bf16_weights.bf16_problem() is not None,
                                reason=f"bf16 kernel: {bf16_weights.bf16_problem()}")

PROMPT = [(7 * i + 3) % 300 for i in range(9)]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return Checkpoints(tmp_path_factory)


def bf16_assistant(tmp_path_factory, kind: str):
    """An assistant folder stored in bfloat16, as the released assistants are."""
    config = assistant_config(kind)
    config["dtype"] = "bfloat16"
    weights = {k: v.astype(mx.bfloat16) if mx.issubdtype(v.dtype, mx.floating) else v
               for k, v in random_assistant_weights(config, seed=100).items()}
    return write_assistant(tmp_path_factory.mktemp(f"bf16-{kind}") / "a", kind, config=config,
                           weights=weights)


@pytest.fixture(scope="module")
def moe_bf16(tmp_path_factory):
    return bf16_assistant(tmp_path_factory, "26b")


def projections(assistant):
    return [m for _, m in assistant.named_modules() if isinstance(m, (nn.Linear, Bf16Linear))]


def test_a_bfloat16_assistant_runs_on_the_bf16_kernel_by_default(ckpts, moe_bf16):
    model = mlx_mtp.load_model(ckpts.target("26b"), drafter=moe_bf16)
    a = model.drafter.assistant
    assert model.drafter.bf16 and model.drafter.describe()["bf16"] is True
    linears = projections(a)
    # pre/post projections, q/o/gate/up/down per layer, and the tied head's product
    assert len(linears) == 2 + 4 * 5 + 1
    assert all(type(m) is Bf16Linear and m.weight.dtype == mx.bfloat16 for m in linears)
    assert type(a.model.embed_tokens) is Bf16TiedHead
    assert a.model.embed_tokens.product.weight.dtype == mx.bfloat16

    off = mlx_mtp.load_model(ckpts.target("26b"), drafter=moe_bf16,
                             draft_options=DraftOptions(bf16=False))
    assert not off.drafter.bf16 and off.drafter.describe()["bf16"] is False
    assert all(type(m) is nn.Linear for m in projections(off.drafter.assistant))

    # A float32 assistant whose weights are not bfloat16 values: off unless asked for.
    f32 = mlx_mtp.load_model(ckpts.target("26b"), drafter=ckpts.assistant("26b"))
    assert not f32.drafter.bf16
    asked = mlx_mtp.load_model(ckpts.target("26b"), drafter=ckpts.assistant("26b"),
                               draft_options=DraftOptions(bf16=True))
    assert asked.drafter.bf16 and type(asked.drafter.assistant.pre_projection) is Bf16Linear


def test_the_bf16_step_computes_the_float32_step(ckpts, moe_bf16):
    """Same weights (bfloat16 values), only the order of the float32 sums differs: the state and
    the head's logits agree to float32 rounding, and the drafts are the same ids."""
    target = ckpts.target("26b")
    pairs = [mlx_mtp.load_model(target, drafter=moe_bf16, draft_options=DraftOptions(bf16=b))
             for b in (True, False)]
    outs = []
    for model in pairs:
        d = model.drafter
        cache = model.target.make_cache()
        h = model.target.prefill(mx.array([PROMPT]), cache)
        d.bind_cache(cache)
        d.prefill(h, mx.argmax(model.target.logits(h[:, -1:]), axis=-1).reshape(1))
        hn, state = d.assistant(model.target.embed(d.bonus[None]), d.hidden, d.shared_kv,
                                d.position)
        outs.append((np.array(hn), np.array(state), np.array(d.assistant.logits(hn)),
                     np.array(d.draft(5)).tolist()))
    (hn16, s16, l16, ids16), (hn32, s32, l32, ids32) = outs
    np.testing.assert_allclose(hn16, hn32, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(s16, s32, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(l16, l32, rtol=1e-4, atol=1e-4)
    assert ids16 == ids32


@pytest.mark.parametrize("block_size", [2, 4, 6])
def test_t0_identity_with_the_bf16_assistant(ckpts, moe_bf16, block_size):
    target = ckpts.target("26b")
    model = mlx_mtp.load_model(target, drafter=moe_bf16)
    assert model.drafter.bf16
    got = [t for t, _ in mlx_mtp.generate_step(mx.array(PROMPT), model, max_tokens=20,
                                               block_size=block_size)]
    assert got == reference_greedy(target, PROMPT, 20)


def test_t0_identity_with_bf16_trees(ckpts, moe_bf16):
    """A tree's deeper levels run the assistant on several rows at once through the kernel."""
    target = ckpts.target("26b")
    model = mlx_mtp.load_model(target, drafter=moe_bf16)
    got = [t for t, _ in mlx_mtp.generate_step(mx.array(PROMPT), model, max_tokens=20,
                                               block_size=4, draft_topk=2, draft_tokens=5)]
    assert got == reference_greedy(target, PROMPT, 20)


def test_the_centroid_head_keeps_its_float32_table(ckpts, tmp_path_factory):
    """E2B's centroid head gathers embedding rows: the table stays float32; the projections and
    the centroids run on bfloat16 copies, and the output is mlx-lm's."""
    folder = bf16_assistant(tmp_path_factory, "e2b")
    target = ckpts.target("e2b")
    model = mlx_mtp.load_model(target, drafter=folder)
    a = model.drafter.assistant
    assert model.drafter.bf16
    assert type(a.model.embed_tokens) is nn.Embedding
    assert a.model.embed_tokens.weight.dtype == mx.float32
    assert type(a.masked_embedding.centroids) is Bf16Linear
    got = [t for t, _ in mlx_mtp.generate_step(mx.array(PROMPT), model, max_tokens=16,
                                               block_size=3)]
    assert got == reference_greedy(target, PROMPT, 16)


def test_a_quantized_assistant_refuses_bf16(ckpts, tmp_path):
    from mlx.utils import tree_flatten

    model = mlx_mtp.load_model(ckpts.target("31b"), drafter=ckpts.assistant("31b"))
    assistant = model.drafter.assistant
    nn.quantize(assistant, group_size=32, bits=4)
    folder = tmp_path / "assistant-4bit"
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"),
                        dict(tree_flatten(assistant.parameters())), metadata={"format": "mlx"})
    cfg = json.loads((ckpts.assistant("31b") / "config.json").read_text())
    cfg["quantization"] = {"group_size": 32, "bits": 4}
    (folder / "config.json").write_text(json.dumps(cfg))
    assert not mlx_mtp.load_model(ckpts.target("31b"), drafter=folder).drafter.bf16
    with pytest.raises(MTPError) as e:
        mlx_mtp.load_model(ckpts.target("31b"), drafter=folder,
                           draft_options=DraftOptions(bf16=True))
    assert str(e.value) == (f"--draft-bf16 (DraftOptions(bf16=True)): drafter {folder} is "
                            "quantized; the bf16 kernel copies float weights")


@pytest.mark.subprocess
def test_cli_draft_bf16_with_a_gemma_pair(ckpts):
    path = ckpts.target("31b")
    r = cli("--model", path, "--drafter", ckpts.assistant("31b"), "--prompt", "def add(a, b):",
            "--max-tokens", 12, "--block-size", 3, "--ignore-chat-template", "--draft-bf16",
            "--json")
    out = json.loads(r.stdout)
    assert out["draft"]["bf16"] is True
    tok = load_tokenizer(path)
    assert out["tokens"] == reference_greedy(path, tok.encode("def add(a, b):"), 12)
