"""Step 5 of the demo pair: train the MTP head by self-distillation on the frozen target.

    python -m tools.demo_pair.train_head --work WORK --steps 400

The teacher is the target's own next-token distribution (KL to its softmax), so the head learns
what the target will say, not what the corpus says. A ``--demo-share`` of each batch's rows are
windows of the target's own text under the demo's decode (``demo_texts``: WORK/demo_train.jsonl,
prompt then continuation, one after another), the rest corpus windows: the head drafts where the
demo writes. Each batch trains ``--steps-ahead`` recurrent steps exactly as drafting runs them
(``MTPHead.recurrent``: step s > 1 is fed the head's own previous output and attends to the true
entries plus its own in-round entries). The head starts from a copy of the target's last
full-attention layer. Every validation also replays drafting on the held-out demo texts
(``drafting_sim``: the penalty on the head's logits, block 3). Seeded and resumable
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

from tools.demo_pair import drafting_sim
from tools.demo_pair.torch_model import TEXT_CONFIG, MTPHead, install_fast_gdn, target_config
from tools.demo_pair.train_loop import ResumableRun, add_common_args, batch

SHIPPED_PAIR = Path(__file__).resolve().parents[2] / "mlx_mtp" / "demo_pair"


def load_target(work: Path):
    model = Qwen3_5ForCausalLM(target_config())
    model.load_state_dict(torch.load(work / "target" / "model.pt"))
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def demo_stream(path: Path, eos: int) -> np.ndarray:
    """``demo_texts``' records (prompt, continuation) one after another, each ended by ``eos``."""
    ids = []
    for r in drafting_sim.read_records(path):
        ids.extend(r["ids"])
        ids.append(eos)
    return np.asarray(ids, dtype=np.uint16)


def mixed_batch(corpus: np.ndarray, demo: np.ndarray, share: float, seed: int, step: int,
                bsz: int, seq: int) -> torch.Tensor:
    """``round(share * bsz)`` rows from the demo texts, the rest from the corpus."""
    n_demo = round(share * bsz)
    parts = [batch(demo, seed, step, n_demo, seq)] if n_demo else []
    if bsz - n_demo:
        parts.append(batch(corpus, seed + 1000, step, bsz - n_demo, seq))
    return torch.cat(parts)


def kl(student_logits, teacher_log_probs):
    student = F.log_softmax(student_logits, dim=-1)
    return F.kl_div(student, teacher_log_probs, log_target=True, reduction="none").sum(-1).mean()


def head_losses(head, target, x, steps, penalized: float = 0.0):
    """x [B, N + steps]. Returns (per-step KL losses, per-step chained argmax agreement).
    ``penalized``: the weight of a second KL between both distributions after the demo's
    repetition penalty over each position's history in the window (what a drafter that applies
    it argmaxes); the plain KL weighs ``1 - penalized``."""
    N = x.shape[1] - steps
    with torch.no_grad():
        h = target.model(input_ids=x).last_hidden_state
        raw = target.lm_head(h)
        teacher = F.log_softmax(raw, dim=-1)
    outs = head.recurrent(target.model.embed_tokens, h[:, :N], x, steps)
    losses, agree = [], []
    chain = torch.ones(x.shape[0], N, dtype=torch.bool)
    context = drafting_sim.DEMO_DECODE.repetition_context_size
    for s, g in enumerate(outs, start=1):
        logits = target.lm_head(g)
        t = teacher[:, s:s + N]
        loss = kl(logits, t)
        if penalized:
            hist = drafting_sim.histories(x, torch.arange(N) + s, context)
            pen = drafting_sim.DEMO_DECODE.repetition_penalty
            with torch.no_grad():
                t_pen = F.log_softmax(drafting_sim.penalize(raw[:, s:s + N], hist, pen), dim=-1)
            loss = ((1 - penalized) * loss
                    + penalized * kl(drafting_sim.penalize(logits, hist, pen), t_pen))
        losses.append(loss)
        chain = chain & (logits.argmax(-1) == t.argmax(-1))
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
    ap.add_argument("--step-weights", type=float, nargs="+", default=[1.0, 0.7, 0.5, 0.4, 0.3],
                    help="loss weight of each recurrent step")
    ap.add_argument("--demo-share", type=float, default=0.75,
                    help="share of each batch's rows from WORK/demo_train.jsonl (0: corpus only)")
    ap.add_argument("--penalized", type=float, default=0.0,
                    help="weight of the KL after the demo's repetition penalty (0..1)")
    ap.add_argument("--sim-vocab", type=Path, default=SHIPPED_PAIR,
                    help="pair whose mtp/draft_vocab the drafting replay argmaxes over")
    args = ap.parse_args(argv)
    if len(args.step_weights) < args.steps_ahead:
        sys.exit(f"error: --step-weights needs {args.steps_ahead} weights (--steps-ahead), "
                 f"got {len(args.step_weights)}")
    if not 0 <= args.demo_share <= 1:
        sys.exit(f"error: --demo-share must be in [0, 1], got {args.demo_share}")
    torch.set_num_threads(args.threads)
    install_fast_gdn()
    train = np.load(args.work / "train_ids.npy")
    val = np.load(args.work / "val_ids.npy")
    demo = (demo_stream(args.work / "demo_train.jsonl", TEXT_CONFIG["eos_token_id"])
            if args.demo_share else None)
    demo_val = drafting_sim.read_records(args.work / "demo_val.jsonl")
    vocab = drafting_sim.draft_vocab_ids(args.sim_vocab)
    target = load_target(args.work)
    torch.manual_seed(args.seed)
    full = [i for i, t in enumerate(target.config.layer_types) if t == "full_attention"][-1]
    head = MTPHead(target.config, init_layer=target.model.layers[full])
    params = [p for n, p in head.named_parameters() if not n.startswith("rotary")]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    run = ResumableRun(args, args.work / "head", "head", head, opt)

    seq_len = args.seq + args.steps_ahead - 1

    def draw(step):
        if demo is None:
            return batch(train, args.seed, step, args.batch, seq_len)
        return mixed_batch(train, demo, args.demo_share, args.seed, step, args.batch, seq_len)

    def on_start():
        if run.step == 0:
            print(json.dumps({"step": 0, **validate()}), flush=True)

    def loss_fn(x):
        losses, agree = head_losses(head, target, x, args.steps_ahead, args.penalized)
        loss = sum(w * l for w, l in zip(args.step_weights, losses))
        return loss, {"kl": [round(float(v), 4) for v in losses],
                      "chain_agree": [round(a, 3) for a in agree]}

    def validate():
        kl, va = evaluate(head, target, val, args.seq, args.steps_ahead)
        head.eval()
        sim = drafting_sim.simulate(head, target, demo_val, 3, vocab)
        head.train()
        return {"val_kl": [round(v, 4) for v in kl], "val_chain_agree": [round(a, 3) for a in va],
                "sim_block3": sim}

    run.train(train, seq_len, params, loss_fn, validate, on_start, draw)
    return 0

if __name__ == "__main__":
    sys.exit(main())
