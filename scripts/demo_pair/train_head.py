"""Step 3 of the demo pair: train the MTP head by self-distillation on the frozen target.

    python scripts/demo_pair/train_head.py --work WORK --minutes 20

The teacher is the target's own next-token distribution (KL to its softmax), so the head learns
what the target will say, not what the corpus says. Each batch trains ``--steps-ahead`` recurrent
steps exactly as drafting runs them (``MTPHead.recurrent``: step s > 1 is fed the head's own
previous output and attends to the true entries plus its own in-round entries). The head starts
from a copy of the target's last full-attention layer. Seeded and resumable like
``train_target.py``; writes ``WORK/head/{head.pt,optim.pt,state.json,log.jsonl}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_model import MTPHead, install_fast_gdn, target_config  # noqa: E402
from train_target import batch, lr_at  # noqa: E402
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM  # noqa: E402

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
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--steps", type=int, default=800, help="optimizer steps")
    ap.add_argument("--steps-ahead", type=int, default=3, help="recurrent drafting steps trained")
    ap.add_argument("--minutes", type=float, default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    install_fast_gdn()
    train = np.load(args.work / "train_ids.npy")
    val = np.load(args.work / "val_ids.npy")
    target = load_target(args.work)
    out = args.work / "head"
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    full = [i for i, t in enumerate(target.config.layer_types) if t == "full_attention"][-1]
    head = MTPHead(target.config, init_layer=target.model.layers[full])
    params = [p for n, p in head.named_parameters() if not n.startswith("rotary")]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step = 0
    if (out / "state.json").exists():
        head.load_state_dict(torch.load(out / "head.pt"))
        opt.load_state_dict(torch.load(out / "optim.pt"))
        step = json.loads((out / "state.json").read_text())["step"]
        print(f"resumed at step {step}")

    def save(final: bool):
        torch.save(head.state_dict(), out / "head.pt.tmp")
        torch.save(opt.state_dict(), out / "optim.pt.tmp")
        (out / "head.pt.tmp").replace(out / "head.pt")
        (out / "optim.pt.tmp").replace(out / "optim.pt")
        (out / "state.json").write_text(json.dumps({"step": step, "final": final,
                                                    "args": {k: str(v) for k, v in vars(args).items()}}))

    log = (out / "log.jsonl").open("a")
    t0 = time.time()
    if step == 0:
        kl, agree = evaluate(head, target, val, args.seq, args.steps_ahead)
        print(json.dumps({"step": 0, "val_kl": kl, "val_chain_agree": agree}), flush=True)
    head.train()
    while step < args.steps:
        if args.minutes is not None and time.time() - t0 > 60 * args.minutes:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        x = batch(train, args.seed, step, args.batch, args.seq + args.steps_ahead - 1)
        losses, agree = head_losses(head, target, x, args.steps_ahead)
        loss = sum(w * l for w, l in zip(STEP_WEIGHTS, losses))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        rec = {"step": step, "kl": [round(float(v), 4) for v in losses],
               "chain_agree": [round(a, 3) for a in agree], "elapsed_s": round(time.time() - t0, 1)}
        if step % args.save_every == 0 or step == args.steps:
            kl, va = evaluate(head, target, val, args.seq, args.steps_ahead)
            rec["val_kl"] = [round(v, 4) for v in kl]
            rec["val_chain_agree"] = [round(a, 3) for a in va]
            save(step == args.steps)
        if step % 10 == 0 or "val_kl" in rec:
            print(json.dumps(rec), flush=True)
        log.write(json.dumps(rec) + "\n")
        log.flush()
    save(step >= args.steps)
    print(f"stopped at step {step} after {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
