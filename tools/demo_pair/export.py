"""Step 4 of the demo pair: write the trained target + head as a raw Hugging Face Qwen3.5
checkpoint (what ``snapshot_download`` of a real one gives), and check it.

    python -m tools.demo_pair.export --work WORK --out mlx_mtp/demo_pair

Layout: ``config.json`` (nested ``qwen3_5`` config), ``model.safetensors`` (bfloat16,
``model.language_model.*`` and top-level ``mtp.*``, metadata format "pt", tied embeddings),
``tokenizer.json`` / ``tokenizer_config.json``. The check loads the folder through
``mlx_mtp.load_model`` (the path every checkpoint takes) and compares mlx-lm's target logits and
mlx_mtp's head logits with the PyTorch models' (same bf16-rounded weights, float32 compute) on a
validation window. The folder is written to a temporary name and renamed when the check passes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

import mlx_mtp  # noqa: F401  (binds the CPU BLAS before mlx.core)
import mlx.core as mx
import torch

from tools.demo_pair.checkpoint import raw_weights, write_folder
from tools.demo_pair.torch_model import MTPHead, install_fast_gdn
from tools.demo_pair.train_head import load_target

TOL = 2e-3  # max |logit difference| MLX vs PyTorch, float32 compute on identical weights


def round_to_bf16(module) -> None:
    """Give the PyTorch model the weights the export stores (for the comparison)."""
    with torch.no_grad():
        for p in module.parameters():
            if p.ndim > 1:
                p.copy_(p.to(torch.bfloat16).float())


def check(folder: Path, target, head, window: np.ndarray) -> dict:
    from mlx_mtp.models.loader import load_model

    model = load_model(folder)
    ids = torch.from_numpy(window.astype(np.int64))[None]
    with torch.no_grad():
        h_t = target.model(input_ids=ids).last_hidden_state
        logits_t = target.lm_head(h_t)
        n = ids.shape[1] - 1
        g_t, _ = head.step(target.model.embed_tokens(ids[:, 1:]), h_t[:, :n], torch.arange(n), [],
                           torch.ones(n, n, dtype=torch.bool).tril())
        head_t = target.lm_head(g_t)
    tgt = model.target
    cache = tgt.make_cache()
    h_m = tgt.hidden(mx.array(window[None].astype(np.int32)), cache)
    logits_m = np.array(tgt.logits(h_m))
    drafter = model.drafter
    drafter.reset()
    g_m = drafter.head(tgt.embed(mx.array(window[None, 1:].astype(np.int32))), h_m[:, :n],
                       drafter.cache)
    head_m = np.array(tgt.logits(g_m))
    report = {
        "target_max_abs_diff": float(np.abs(logits_m - logits_t.numpy()).max()),
        "target_argmax_agree": float((logits_m.argmax(-1) == logits_t.numpy().argmax(-1)).mean()),
        "head_max_abs_diff": float(np.abs(head_m - head_t.numpy()).max()),
        "head_argmax_agree": float((head_m.argmax(-1) == head_t.numpy().argmax(-1)).mean()),
        "tokens": int(window.size),
    }
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    install_fast_gdn()
    target = load_target(args.work)
    head = MTPHead(target.config)
    head.load_state_dict(torch.load(args.work / "head" / "head.pt"))
    head.eval()
    weights = raw_weights(target, head)
    round_to_bf16(target)
    round_to_bf16(head)
    tmp = args.out.with_name(args.out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write_folder(tmp, weights, args.work / "tokenizer")
    report = check(tmp, target, head, np.load(args.work / "val_ids.npy")[:128])
    print(json.dumps(report, indent=1))
    bad = [k for k in ("target_max_abs_diff", "head_max_abs_diff") if report[k] > TOL]
    if bad:
        shutil.rmtree(tmp)
        sys.exit(f"error: {', '.join(bad)} above {TOL}: the MLX load does not match the trainer")
    (tmp / "export_check.json").write_text(json.dumps(report, indent=1) + "\n")
    shutil.rmtree(args.out, ignore_errors=True)
    tmp.rename(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
