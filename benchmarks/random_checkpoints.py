"""Random-weight Qwen3.5 (and Qwen3-Next) checkpoints written on the fly: tiny ones for the tests,
larger ones of realistic proportions for benchmarks that measure cost, not acceptance
(``benchmarks.bench_drafter``'s random pair, ``benchmarks.probe_cost --synthetic``).

Same file layout and key names as the real checkpoints: raw HF (``model.language_model.*``, HF
conv1d layout, zero-centred norms, top-level ``mtp.*``, metadata ``format: pt``) and MLX
conversions made by mlx-lm's own ``convert`` (``mtp.*`` stripped). The tests import this module
(through ``tests/support/tiny_checkpoints.py``); nothing here imports the tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional

import mlx_mtp  # noqa: F401  (before mlx.core: binds the system BLAS)
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes  # mlx-lm's model classes for a config: no public name

from mlx_mtp.models.qwen3_5.drafter import MTPHead, is_zero_centred_norm

VOCAB = 320
TARGET_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight",
                ".k_norm.weight", "model.norm.weight")

CORPUS = [
    "def add(a, b):\n    return a + b\n\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "The quick brown fox jumps over the lazy dog. ",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    main()\n",
]


def qwen3_5_config(*, moe: bool = False, tied: bool = False, layers: int = 4, hidden: int = 64,
                   vocab: int = VOCAB, **text_overrides) -> dict:
    """``text_overrides`` replace ``text_config`` fields (head counts and dims, intermediate
    size ...) for checkpoints with other proportions (``benchmarks.bench_drafter``)."""
    text = {
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "attn_output_gate": True, "attention_bias": False, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "full_attention_interval": 2,
        "layer_types": ["full_attention" if (i + 1) % 2 == 0 else "linear_attention"
                        for i in range(layers)],
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
        "tie_word_embeddings": tied, "mamba_ssm_dtype": "float32",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                            "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                            "mrope_section": [2, 1, 1]},
    }
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=64, norm_topk_prob=True)
    text.update(text_overrides)
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe
                          else "Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "tie_word_embeddings": tied,
        "text_config": text,
    }


def build_target(config: dict):
    """mlx-lm's model for ``config``, randomly initialised (the mlx-side reference)."""
    model_cls, args_cls = _get_classes(config)
    return model_cls(args_cls.from_dict(json.loads(json.dumps(config))))


def _jitter_norms(params: Dict[str, mx.array], keys, rng) -> None:
    for k in list(params):
        if any(k.endswith(s) for s in keys) and params[k].ndim == 1:
            params[k] = mx.array(1.0 + 0.1 * rng.standard_normal(params[k].shape), dtype=mx.float32)


def target_to_hf(params: Dict[str, mx.array], moe: bool) -> Dict[str, mx.array]:
    """mlx-lm parameter names/layouts -> raw HF ones (inverse of ``Model.sanitize``)."""
    out = {}
    for k, v in params.items():
        if k.startswith("language_model.model."):
            k = "model.language_model." + k[len("language_model.model."):]
        elif k.startswith("language_model."):
            k = k[len("language_model."):]
        if "conv1d.weight" in k:
            v = v.moveaxis(2, 1)  # [C, K, 1] -> [C, 1, K]
        if any(k.endswith(s) for s in TARGET_NORMS) and v.ndim == 1:
            v = v - 1.0
        out[k] = v
    if moe:
        _fuse_experts(out, "model.language_model.layers.")
    return out


def _fuse_experts(weights: Dict[str, mx.array], prefix: str, per_expert: bool = False) -> None:
    for k in [k for k in weights if k.startswith(prefix) and k.endswith("switch_mlp.gate_proj.weight")]:
        base = k[: -len("switch_mlp.gate_proj.weight")]
        gate = weights.pop(k)
        up = weights.pop(base + "switch_mlp.up_proj.weight")
        down = weights.pop(base + "switch_mlp.down_proj.weight")
        if per_expert:
            for e in range(gate.shape[0]):
                weights[f"{base}experts.{e}.gate_proj.weight"] = gate[e]
                weights[f"{base}experts.{e}.up_proj.weight"] = up[e]
                weights[f"{base}experts.{e}.down_proj.weight"] = down[e]
        else:
            weights[base + "experts.gate_up_proj"] = mx.concatenate([gate, up], axis=-2)
            weights[base + "experts.down_proj"] = down


def head_to_hf(head_params: Dict[str, mx.array], moe: bool, expert_layout: str = "fused",
               prefix: str = "mtp.") -> Dict[str, mx.array]:
    """Effective head parameters -> raw HF ``mtp.*`` tensors (zero-centred norms)."""
    out = {}
    for k, v in head_params.items():
        if is_zero_centred_norm(k) and v.ndim == 1:
            v = v - 1.0
        out[prefix + k] = v
    if moe:
        _fuse_experts(out, prefix, per_expert=expert_layout == "per_expert")
    return out


def random_head_params(target_model, seed: int) -> Dict[str, mx.array]:
    mx.random.seed(seed)
    head = MTPHead(target_model.language_model.args)
    params = dict(tree_flatten(head.parameters()))
    _jitter_norms(params, ("norm.weight",), np.random.default_rng(seed))
    return params


def write_tokenizer(path: Path, corpus=None, vocab_size: int = 300) -> None:
    """A byte-level BPE tokenizer trained on ``corpus`` (an iterable of texts; default: CORPUS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4 if corpus is None else corpus, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
         "model_max_length": 4096}))


def save_safetensors(path: Path, weights: Dict[str, mx.array], fmt: str = "pt", shards: int = 1) -> None:
    keys = sorted(weights)
    if shards == 1:
        mx.save_safetensors(str(path / "model.safetensors"), {k: weights[k] for k in keys},
                            metadata={"format": fmt})
        return
    index = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: weights[k] for k in keys[i::shards]}
        mx.save_safetensors(str(path / name), part, metadata={"format": fmt})
        index.update({k: name for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))


def write_raw_hf(path: Path, *, moe: bool = False, tied: bool = False, seed: int = 0,
                 with_mtp: bool = True, expert_layout: str = "fused", layers: int = 4,
                 shards: int = 1, target_params: Optional[Dict[str, mx.array]] = None,
                 head_params: Optional[Dict[str, mx.array]] = None, hidden: int = 64,
                 vocab: int = VOCAB, text_overrides: Optional[dict] = None,
                 tokenizer_corpus=None) -> Path:
    """A raw Hugging Face Qwen3.5 checkpoint folder (what ``snapshot_download`` would give)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = qwen3_5_config(moe=moe, tied=tied, layers=layers, hidden=hidden, vocab=vocab,
                            **(text_overrides or {}))
    mx.random.seed(seed)
    model = build_target(config)
    if target_params is None:
        target_params = dict(tree_flatten(model.parameters()))
        _jitter_norms(target_params, TARGET_NORMS, np.random.default_rng(seed))
    weights = target_to_hf(target_params, moe)
    if with_mtp:
        if head_params is None:
            head_params = random_head_params(model, seed + 1)
        weights.update(head_to_hf(head_params, moe, expert_layout))
    save_safetensors(path, weights, "pt", shards)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(path, tokenizer_corpus, vocab_size=300 if tokenizer_corpus is None else vocab)
    return path


def write_mlx_converted(raw: Path, out: Path, *, quantize: bool = False) -> Path:
    """What ``mlx_lm.convert`` makes of ``raw`` (it strips every ``mtp.*`` tensor)."""
    from mlx_lm.convert import convert

    convert(str(raw), str(out), quantize=quantize, q_group_size=32, q_bits=4, dtype="float32")
    return Path(out)


def write_drafter_folder(path: Path, head_params: Dict[str, mx.array], config: dict, *,
                         raw_prefix: bool = False, moe: bool = False) -> Path:
    """A standalone ``qwen3_5_mtp`` drafter folder.

    ``raw_prefix=False``: mlx-vlm's layout (prefix-stripped keys, norms already shifted, format mlx).
    ``raw_prefix=True``: the raw HF ``mtp.*`` tensors copied out of a checkpoint (format pt).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if raw_prefix:
        weights, fmt = head_to_hf(head_params, moe), "pt"
    else:
        weights, fmt = dict(head_params), "mlx"
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": fmt})
    (path / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_5_mtp", "text_config": config["text_config"], "block_size": 3}))
    return path


def write_agreeing_checkpoint(path: Path, seed: int = 0, lm_scale: float = 1.0,
                              layers: int = 4, moe: bool = False,
                              successor: Optional[np.ndarray] = None) -> Path:
    """A raw HF checkpoint whose MTP head is built to agree with its target.

    The target mostly maps token x to f(x) for a fixed permutation f (its layers only perturb the
    embedding slightly, and lm_head rows are the embeddings permuted by f). The head sees
    ``[norm_e(embed(x_{p+1})), norm_h(h_p)]`` with fc = [I | 10 P], P a permutation of the hidden
    dims, and effective gammas 1.0 / 0.1: it predicts f(x_{p+1}) = x_{p+2} only when the concat
    order is embedding-first and every zero-centred norm is shifted exactly once (unshifted, the
    embedding path is zeroed; shifted twice, the scrambled hidden path drowns it; swapped, the
    embedding lands in the scrambled slot).

    ``lm_scale`` < 1 shrinks the (shared) LM head so both distributions are soft: the head then
    agrees with the target in its mode but not in every probability (for sampling tests).
    ``moe``: the Qwen3.5-MoE layout (the target's and the head's experts perturb as the MLPs do).
    ``successor``: f itself (a permutation of the vocabulary; default: a random one).
    """
    rng = np.random.default_rng(seed)
    config = qwen3_5_config(layers=layers, moe=moe)
    mx.random.seed(seed)
    model = build_target(config)
    params = dict(tree_flatten(model.parameters()))
    H, V = config["text_config"]["hidden_size"], config["text_config"]["vocab_size"]
    E = rng.standard_normal((V, H)).astype(np.float32)
    f = rng.permutation(V) if successor is None else np.asarray(successor)
    finv = np.argsort(f)
    params["language_model.model.embed_tokens.weight"] = mx.array(E)
    params["language_model.lm_head.weight"] = mx.array(lm_scale * E[finv])
    for k in params:
        if k.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            params[k] = params[k] * 0.05
    head = random_head_params(model, seed + 1)
    P = np.eye(H, dtype=np.float32)[rng.permutation(H)]
    head["fc.weight"] = mx.array(np.concatenate([np.eye(H, dtype=np.float32), 10 * P], axis=1))
    for k in head:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            head[k] = head[k] * 0.05
        elif head[k].ndim == 1 and is_zero_centred_norm(k):
            head[k] = mx.ones_like(head[k])
    head["pre_fc_norm_hidden.weight"] = mx.full((H,), 0.1)
    return write_raw_hf(path, seed=seed, layers=layers, target_params=params, head_params=head,
                        moe=moe)


def write_mirroring_checkpoint(path: Path, seed: int = 0, layers: int = 4,
                               bf16_values: bool = False) -> Path:
    """A raw HF checkpoint whose MTP head computes its target's next-token logits.

    Every residual branch of the target (attention, GatedDeltaNet, MLP) outputs zeros, so its
    logits at a position are ``lm_head . norm(embed(x))`` of the current token x alone; the head
    keeps the drafted token's embedding (``fc`` = [I | 0], gammas 1) and its layer adds nothing,
    so its logits are the same up to rounding. A draft then equals the target's pick at its row
    whenever both see the same processing: the logits processors over the same history.
    ``bf16_values``: every matrix holds bfloat16 values (stored as float32), as a bfloat16
    checkpoint cast on load does."""
    config = qwen3_5_config(layers=layers)
    mx.random.seed(seed)
    model = build_target(config)
    params = dict(tree_flatten(model.parameters()))
    for k in params:
        if k.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            params[k] = mx.zeros_like(params[k])
    head = random_head_params(model, seed + 1)
    H = config["text_config"]["hidden_size"]
    head["fc.weight"] = mx.concatenate([mx.eye(H), mx.zeros((H, H))], axis=1)
    for k in head:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            head[k] = mx.zeros_like(head[k])
        elif head[k].ndim == 1 and is_zero_centred_norm(k):
            head[k] = mx.ones_like(head[k])
    if bf16_values:
        for weights in (params, head):
            for k, v in weights.items():
                if v.ndim == 2:
                    weights[k] = v.astype(mx.bfloat16).astype(mx.float32)
    return write_raw_hf(path, seed=seed, layers=layers, target_params=params, head_params=head)


def qwen3_next_config(layers: int = 4, hidden: int = 64, vocab: int = VOCAB) -> dict:
    """A flat ``qwen3_next`` config (Qwen3-Next-80B-A3B's shape, scaled down; MoE everywhere)."""
    return {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": 2 * hidden,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "num_experts": 4,
        "num_experts_per_tok": 2, "decoder_sparse_step": 1, "shared_expert_intermediate_size": 64,
        "mlp_only_layers": [], "moe_intermediate_size": 32, "rms_norm_eps": 1e-6,
        "vocab_size": vocab, "rope_theta": 5000000, "partial_rotary_factor": 0.25,
        "max_position_embeddings": 4096, "norm_topk_prob": True, "tie_word_embeddings": False,
        "full_attention_interval": 2,
    }


def write_raw_hf_qwen3_next(path: Path, seed: int = 0) -> Path:
    """Raw HF Qwen3-Next layout: ``model.layers.*`` with per-expert keys, top-level ``mtp.*``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = qwen3_next_config()
    mx.random.seed(seed)
    model = build_target(config)
    rng = np.random.default_rng(seed)
    params = dict(tree_flatten(model.parameters()))
    _jitter_norms(params, TARGET_NORMS, rng)
    weights = {}
    for k, v in params.items():
        if "conv1d.weight" in k:
            v = v.moveaxis(2, 1)
        if any(k.endswith(s) for s in TARGET_NORMS) and v.ndim == 1:
            v = v - 1.0
        weights[k] = v
    _fuse_experts(weights, "model.layers.", per_expert=True)
    mx.random.seed(seed + 1)
    head = dict(tree_flatten(MTPHead(model.args).parameters()))
    _jitter_norms(head, ("norm.weight",), rng)
    weights.update(head_to_hf(head, moe=True, expert_layout="per_expert"))
    save_safetensors(path, weights, "pt")
    (path / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(path)
    return path
