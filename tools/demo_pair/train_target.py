"""Step 2 of the demo pair: train the Qwen3.5-architecture target (PyTorch on CPU, float32).

    python -m tools.demo_pair.train_target --work WORK --minutes 45

Seeded and resumable (``train_loop.ResumableRun``): ``WORK/RUN/{model.pt,optim.pt,state.json,
log.jsonl}`` (``--run``, default ``target``: the run ``train_head`` and ``export`` read). The
schedule is linear warm-up then cosine decay over ``--steps``; ``--minutes`` stops early at a step
boundary and the run can be resumed later. ``--init`` fine-tunes a trained target (another run's
``model.pt`` or a packaged pair's folder) instead of starting from random weights; ``--data``
names the token ids it reads (``train_cut``: the corpus cut at line ends, see ``corpus``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

from tools.demo_pair.checkpoint import packaged_states
from tools.demo_pair.torch_model import install_fast_gdn, target_config
from tools.demo_pair.train_loop import ResumableRun, add_common_args


@torch.no_grad()
def evaluate(model, val: np.ndarray, seq: int, limit: int = 40) -> float:
    model.eval()
    n = min(limit, (len(val) - 1) // seq)
    losses = []
    for i in range(0, n, 8):
        x = torch.from_numpy(np.stack([val[j * seq:j * seq + seq + 1]
                                       for j in range(i, min(n, i + 8))]).astype(np.int64))
        logits = model(input_ids=x[:, :-1]).logits
        losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)))
    model.train()
    return float(torch.stack(losses).mean())


def initial_state(path: Path) -> dict:
    """A trained target's weights: a run's ``model.pt`` or a packaged pair's folder."""
    if path.is_dir():
        return packaged_states(path)[0]
    return torch.load(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap, steps=1200, lr=2e-3, warmup=50, seed=0,
                    minutes_help="stop (resumably) after this long")
    ap.add_argument("--run", default="target", help="folder under --work the run writes")
    ap.add_argument("--init", type=Path, default=None,
                    help="start from this target: a run's model.pt or a packaged pair's folder")
    ap.add_argument("--data", choices=("train", "train_cut"), default="train",
                    help="token ids trained on: WORK/DATA_ids.npy")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    install_fast_gdn()
    train = np.load(args.work / f"{args.data}_ids.npy")
    val = np.load(args.work / "val_ids.npy")
    val_cut = np.load(args.work / "val_cut_ids.npy")
    torch.manual_seed(args.seed)
    model = Qwen3_5ForCausalLM(target_config())
    if args.init is not None:
        model.load_state_dict(initial_state(args.init))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    run = ResumableRun(args, args.work / args.run, "model", model, opt)

    def loss_fn(x):
        logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        return loss, {"loss": round(float(loss), 4)}

    def validate():
        val_loss = round(evaluate(model, val, args.seq), 4)
        cut_loss = round(evaluate(model, val_cut, args.seq), 4)
        return {"val_loss": val_loss, "val_ppl": round(math.exp(val_loss), 1),
                "val_cut_loss": cut_loss}

    def on_start():
        if run.step == 0 and args.init is not None:  # where a fine-tune starts from
            print(json.dumps({"step": 0, **validate()}), flush=True)

    run.train(train, args.seq, model.parameters(), loss_fn, validate, on_start)
    return 0

if __name__ == "__main__":
    sys.exit(main())
