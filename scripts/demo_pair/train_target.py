"""Step 2 of the demo pair: train the Qwen3.5-architecture target (PyTorch on CPU, float32).

    python scripts/demo_pair/train_target.py --work WORK --minutes 45

Seeded and resumable: every ``--save-every`` steps (and at the end) it writes
``WORK/target/{model.pt,optim.pt,state.json}``; rerunning with the same ``--work`` continues from
there (same data order: batch k is drawn by a generator seeded with (seed, k)). The schedule is
linear warm-up then cosine decay over ``--steps``; ``--minutes`` stops early at a step boundary
and the run can be resumed later. Logs ``WORK/target/log.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_model import install_fast_gdn, target_config  # noqa: E402
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM  # noqa: E402


def batch(ids: np.ndarray, seed: int, step: int, bsz: int, seq: int) -> torch.Tensor:
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(ids) - seq - 1, size=bsz)
    return torch.from_numpy(np.stack([ids[s:s + seq + 1] for s in starts]).astype(np.int64))


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


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
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--minutes", type=float, default=None, help="stop (resumably) after this long")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    install_fast_gdn()
    train = np.load(args.work / "train_ids.npy")
    val = np.load(args.work / "val_ids.npy")
    out = args.work / "target"
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    model = Qwen3_5ForCausalLM(target_config())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    step = 0
    if (out / "state.json").exists():
        model.load_state_dict(torch.load(out / "model.pt"))
        opt.load_state_dict(torch.load(out / "optim.pt"))
        step = json.loads((out / "state.json").read_text())["step"]
        print(f"resumed at step {step}")

    def save(final: bool):
        torch.save(model.state_dict(), out / "model.pt.tmp")
        torch.save(opt.state_dict(), out / "optim.pt.tmp")
        (out / "model.pt.tmp").replace(out / "model.pt")
        (out / "optim.pt.tmp").replace(out / "optim.pt")
        (out / "state.json").write_text(json.dumps({"step": step, "final": final,
                                                    "args": {k: str(v) for k, v in vars(args).items()}}))

    log = (out / "log.jsonl").open("a")
    t0 = time.time()
    model.train()
    while step < args.steps:
        if args.minutes is not None and time.time() - t0 > 60 * args.minutes:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        x = batch(train, args.seed, step, args.batch, args.seq)
        logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        rec = {"step": step, "loss": round(float(loss), 4), "elapsed_s": round(time.time() - t0, 1)}
        if step % args.save_every == 0 or step == args.steps:
            rec["val_loss"] = round(evaluate(model, val, args.seq), 4)
            rec["val_ppl"] = round(math.exp(rec["val_loss"]), 1)
            save(step == args.steps)
        if step % 10 == 0 or "val_loss" in rec:
            print(json.dumps(rec), flush=True)
        log.write(json.dumps(rec) + "\n")
        log.flush()
    save(step >= args.steps)
    print(f"stopped at step {step} after {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
