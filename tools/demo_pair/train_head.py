"""Step 3 of the demo pair: train the MTP head by self-distillation on the frozen target.

    python -m tools.demo_pair.train_head --work WORK --minutes 20

The teacher is the target's own next-token distribution (KL to its softmax), so the head learns
what the target will say, not what the corpus says. Each batch trains ``--steps-ahead`` recurrent
steps exactly as drafting runs them (``MTPHead.recurrent``: step s > 1 is fed the head's own
previous output and attends to the true entries plus its own in-round entries). The head starts
from a copy of the target's last full-attention layer. Seeded and resumable
(``train_loop.ResumableRun``); writes ``WORK/head/{head.pt,optim.pt,state.json,log.jsonl}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

from tools.demo_pair.torch_model import MTPHead, install_fast_gdn, target_config
from tools.demo_pair.train_loop import ResumableRun, add_common_args

STEP_WEIGHTS = (1.0, 0.7, 0.5, 0.4, 0.3)


def load_target(work: Path):
    model = Qwen3_5ForCausalLM(target_config())
    model.load_state_dict(torch.load(work / "target" / "model.pt"))
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def head_losses(head, target, x, steps):
    """x [B, N + steps]. Returns (per-step KL losses, per-step chained argmax agreement)."""
    N = x.shape[1] - steps
    with torch.no_grad():
        h = target.model(input_ids=x).last_hidden_state
        teacher = F.log_softmax(target.lm_head(h), dim=-1)
    outs = head.recurrent(target.model.embed_tokens, h[:, :N], x, steps)
    losses, agree = [], []
    chain = torch.ones(x.shape[0], N, dtype=torch.bool)
    for s, g in enumerate(outs, start=1):
        student = F.log_softmax(target.lm_head(g), dim=-1)
        t = teacher[:, s:s + N]
        losses.append(F.kl_div(student, t, log_target=True, reduction="none").sum(-1).mean())
        chain = chain & (student.argmax(-1) == t.argmax(-1))
        agree.append(float(chain.float().mean()))
    return losses, agree


@torch.no_grad()
def evaluate(head, target, val: np.ndarray, seq: int, steps: int, limit: int = 24):
    head.eval()
    n = min(limit, (len(val) - 1) // (seq + steps))
    x = torch.from_numpy(np.stack([val[j * (seq + steps):(j + 1) * (seq + steps)]
                                   for j in range(n)]).astype(np.int64))
    res = [head_losses(head, target, x[i:i + 8], steps) for i in range(0, n, 8)]
    head.train()
    kl = [float(np.mean([float(r[0][s]) for r in res])) for s in range(steps)]
    agree = [float(np.mean([r[1][s] for r in res])) for s in range(steps)]
    return kl, agree


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap, steps=800, lr=1e-3, warmup=30, seed=1, steps_help="optimizer steps")
    ap.add_argument("--steps-ahead", type=int, default=3, help="recurrent drafting steps trained")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    install_fast_gdn()
    train = np.load(args.work / "train_ids.npy")
    val = np.load(args.work / "val_ids.npy")
    target = load_target(args.work)
    torch.manual_seed(args.seed)
    full = [i for i, t in enumerate(target.config.layer_types) if t == "full_attention"][-1]
    head = MTPHead(target.config, init_layer=target.model.layers[full])
    params = [p for n, p in head.named_parameters() if not n.startswith("rotary")]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    run = ResumableRun(args, args.work / "head", "head", head, opt)

    def on_start():
        if run.step == 0:
            kl, agree = evaluate(head, target, val, args.seq, args.steps_ahead)
            print(json.dumps({"step": 0, "val_kl": kl, "val_chain_agree": agree}), flush=True)

    def loss_fn(x):
        losses, agree = head_losses(head, target, x, args.steps_ahead)
        loss = sum(w * l for w, l in zip(STEP_WEIGHTS, losses))
        return loss, {"kl": [round(float(v), 4) for v in losses],
                      "chain_agree": [round(a, 3) for a in agree]}

    def validate():
        kl, va = evaluate(head, target, val, args.seq, args.steps_ahead)
        return {"val_kl": [round(v, 4) for v in kl], "val_chain_agree": [round(a, 3) for a in va]}

    run.train(train, args.seq + args.steps_ahead - 1, params, loss_fn, validate, on_start)
    return 0

if __name__ == "__main__":
    sys.exit(main())
