"""Step 2 of the demo pair: train the Qwen3.5-architecture target (PyTorch on CPU, float32).

    python -m tools.demo_pair.train_target --work WORK --minutes 45

Seeded and resumable (``train_loop.ResumableRun``): ``WORK/target/{model.pt,optim.pt,state.json,
log.jsonl}``. The schedule is linear warm-up then cosine decay over ``--steps``; ``--minutes``
stops early at a step boundary and the run can be resumed later.
"""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap, steps=1200, lr=2e-3, warmup=50, seed=0,
                    minutes_help="stop (resumably) after this long")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    install_fast_gdn()
    train = np.load(args.work / "train_ids.npy")
    val = np.load(args.work / "val_ids.npy")
    torch.manual_seed(args.seed)
    model = Qwen3_5ForCausalLM(target_config())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    run = ResumableRun(args, args.work / "target", "model", model, opt)

    def loss_fn(x):
        logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        return loss, {"loss": round(float(loss), 4)}

    def validate():
        val_loss = round(evaluate(model, val, args.seq), 4)
        return {"val_loss": val_loss, "val_ppl": round(math.exp(val_loss), 1)}

    run.train(train, args.seq, model.parameters(), loss_fn, validate)
    return 0

if __name__ == "__main__":
    sys.exit(main())
