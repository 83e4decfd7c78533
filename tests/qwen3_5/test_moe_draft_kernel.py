"""The MTP head's own MoE layer drafts through the expert kernel
(``mlx_mtp.models.qwen3_5.drafter_products.KernelSwitchGLU``): switched where the kernel runs, on
bfloat16 copies of the stacks where the drafter runs in bfloat16, its drafts mlx-lm's where the
bound BLAS reduces one row in the kernel's order, the output greedy either way."""

import mlx.core as mx
import pytest
from support.head_round_trip import draft_accept_draft
from support.reference import CODE_PROMPT, reference_greedy
from mlx_lm.models.switch_layers import SwitchGLU
from mlx_lm.tokenizer_utils import load as load_tokenizer
from support import tiny_checkpoints as tc
from support.native_support import one_row_products_in_kernel_order, require_lazy

import mlx_mtp
from mlx_mtp.models.options import DraftOptions
from mlx_mtp.models.qwen3_5.drafter_products import KernelSwitchGLU


@pytest.fixture(autouse=True)
def lazy():
    require_lazy()


@pytest.fixture(scope="module")
def wide_moe_dir(tmp_path_factory):
    return tc.write_raw_hf(tmp_path_factory.mktemp("wide_moe_head"), moe=True, seed=71,
                           hidden=576, text_overrides={"num_experts": 8,
                                                       "num_experts_per_tok": 3,
                                                       "moe_intermediate_size": 64,
                                                       "shared_expert_intermediate_size": 128})


def head_moe(model):
    return model.drafter.head.layers[0].mlp.switch_mlp


def drafts(model, prompt):
    target = model.target
    cache = target.make_cache()
    hidden = target.hidden(mx.array(prompt)[None, :-1], cache)
    model.drafter.reset()
    return draft_accept_draft(model.drafter, hidden, mx.array(prompt))


def test_the_head_drafts_through_the_kernel_as_mlx_lm_would(wide_moe_dir):
    model = mlx_mtp.load_model(wide_moe_dir)
    assert type(head_moe(model)) is KernelSwitchGLU
    assert model.drafter.describe()["expert_kernel_layers"] == 1
    prompt = load_tokenizer(wide_moe_dir).encode(CODE_PROMPT)[:12]
    kernel = drafts(model, prompt)
    plain = mlx_mtp.load_model(wide_moe_dir)
    head_moe(plain).__class__ = SwitchGLU  # mlx-lm's gather_mm, one call per (row, expert)
    plain.drafter.compiled._fns.clear()  # traced anew with mlx-lm's layer
    if one_row_products_in_kernel_order():
        assert kernel == drafts(plain, prompt)
    ids = [t for t, _ in mlx_mtp.generate_step(mx.array(prompt), model, max_tokens=16,
                                               block_size=4)]
    assert ids == reference_greedy(wide_moe_dir, prompt, 16)


def test_a_bfloat16_head_reads_bfloat16_copies_of_its_experts(tmp_path):
    path = tc.write_raw_hf(tmp_path / "bf16", moe=True, seed=72)
    model = mlx_mtp.load_model(path)
    for p in (head_moe(model).up_proj, head_moe(model).gate_proj, head_moe(model).down_proj):
        p.weight = p.weight.astype(mx.bfloat16).astype(mx.float32)  # bfloat16 values
    for layer in model.drafter.head.modules():
        if hasattr(layer, "weight") and layer.weight.ndim == 2:
            layer.weight = layer.weight.astype(mx.bfloat16).astype(mx.float32)
    lm = model.target.lm_head_module
    lm.weight = lm.weight.astype(mx.bfloat16).astype(mx.float32)
    from mlx_mtp.models.qwen3_5.drafter import QwenMTPDrafter

    head_moe(model).__class__ = SwitchGLU
    drafter = QwenMTPDrafter(model.drafter.head, model.target, DraftOptions())
    assert drafter.bf16 and drafter.describe()["expert_kernel_layers"] == 1
    stacks = head_moe(model).__dict__["kernel_stacks"]
    assert [s.dtype for s in stacks] == [mx.bfloat16] * 3
    assert mx.array_equal(stacks[0].astype(mx.float32), head_moe(model).up_proj.weight).item()


def test_without_the_compiled_step_the_head_keeps_mlx_lms_layer(wide_moe_dir):
    model = mlx_mtp.load_model(wide_moe_dir, draft_options=DraftOptions(compiled=False))
    assert type(head_moe(model)) is SwitchGLU
    assert model.drafter.describe()["expert_kernel_layers"] == 0
