"""The demo pair's weights between the trainers' PyTorch modules and the raw Hugging Face layout
that ``export`` writes: ``raw_weights`` (modules -> checkpoint tensors) and ``packaged_states``
(a written pair's ``model.safetensors`` -> the modules' state dicts, float32), so a trainer can
start from a packaged pair (``train_target --init mlx_mtp/demo_pair``); ``write_folder`` writes the
folder's files (config, weights, the tokenizer ``corpus`` wrote).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tools.demo_pair.torch_model import TEXT_CONFIG

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenization_demo_pair.py")
TARGET_PREFIX = "model.language_model."
HEAD_PREFIX = "mtp."


def raw_weights(target, head=None) -> dict:
    out = {}
    for k, v in target.state_dict().items():
        if k == "lm_head.weight":
            continue  # tied to the embedding
        assert k.startswith("model."), k
        out[TARGET_PREFIX + k[len("model."):]] = v
    for k, v in ({} if head is None else head.state_dict()).items():
        if not k.startswith("rotary."):
            out[HEAD_PREFIX + k] = v
    # Matrices in bfloat16 (half the size); vectors (norm weights, A_log, dt_bias) stay float32:
    # loaders add 1 to zero-centred norm weights in the stored dtype, and 1 + w in bfloat16
    # would move every norm weight by up to 2^-8.
    return {k: (v.detach().to(torch.bfloat16) if v.ndim > 1 else v.detach().float()).contiguous()
            for k, v in out.items()}


def packaged_states(folder: Path):
    """``(target state dict, head state dict)`` of a pair written by ``export``, in float32; the
    target's tied ``lm_head.weight`` is its embedding."""
    raw = load_file(str(Path(folder) / "model.safetensors"))
    target, head = {}, {}
    for k, v in raw.items():
        if k.startswith(TARGET_PREFIX):
            target["model." + k[len(TARGET_PREFIX):]] = v.float()
        elif k.startswith(HEAD_PREFIX):
            head[k[len(HEAD_PREFIX):]] = v.float()
        else:
            raise ValueError(f"{folder}/model.safetensors: unexpected tensor {k}")
    target["lm_head.weight"] = target["model.embed_tokens.weight"]
    return target, head


def write_folder(folder: Path, weights: dict, tokenizer_dir: Path) -> None:
    """A raw Hugging Face Qwen3.5 checkpoint: nested config, ``weights``, the tokenizer files."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "tie_word_embeddings": True, "eos_token_id": TEXT_CONFIG["eos_token_id"],
        "text_config": TEXT_CONFIG}, indent=1) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, folder / name)
