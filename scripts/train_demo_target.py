"""Train the demo pair's target: a small Qwen3.5-architecture model (GatedDeltaNet + gated full
attention, the real ``qwen3_5`` config) on the Python standard library sources.

PyTorch on CPU (the `train` extra: torch, transformers, tokenizers) trains it ~5x faster than MLX
here (see issue 3); what ships is the raw Hugging Face layout that mlx-lm and mlx_mtp load.
Seeded and resumable: state goes to OUT/ckpt.pt every few minutes; rerunning continues.

    python scripts/train_demo_target.py --out work/demo --minutes 60
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo_corpus  # noqa: E402

HIDDEN, LAYERS, VOCAB = 256, 20, 8192


def text_config() -> dict:
    """Deep and narrow, with every matmul input dim <= 512 and output dims multiples of 8 (so a
    BLIS verify block stays row-invariant, see README 'Exactness with a fast BLAS')."""
    return {
        "model_type": "qwen3_5_text", "vocab_size": VOCAB, "hidden_size": HIDDEN,
        "intermediate_size": 512, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "attn_output_gate": True,
        "attention_bias": False, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 64,
        "linear_value_head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 8,
        "full_attention_interval": 4,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                        for i in range(LAYERS)],
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
        "tie_word_embeddings": True, "mamba_ssm_dtype": "float32",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                            "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                            "mrope_section": [4, 2, 2]},
    }


def hf_config() -> dict:
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
            "tie_word_embeddings": True, "text_config": text_config()}


def build_model():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = dict(text_config())
    cfg.pop("model_type")
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**cfg))


def batches(ids: np.ndarray, batch: int, seq: int, rng: np.random.Generator):
    while True:
        starts = rng.integers(0, len(ids) - seq - 1, size=batch)
        x = np.stack([ids[s : s + seq + 1] for s in starts]).astype(np.int64)
        yield torch.from_numpy(x)


@torch.no_grad()
def evaluate(model, val: np.ndarray, seq: int, n: int = 24) -> float:
    model.eval()
    losses = []
    for i in range(n):
        s = (len(val) - seq - 1) * i // n
        x = torch.from_numpy(val[s : s + seq + 1].astype(np.int64))[None]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x[:, :-1], labels=x[:, :-1].clone())
        logits = out.logits.float()
        losses.append(torch.nn.functional.cross_entropy(logits[0], x[0, 1:]).item())
    model.train()
    return float(np.mean(losses))


def prepare_data(out: Path):
    tok_dir = out / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        demo_corpus.train_tokenizer(tok_dir, VOCAB)
    for which in ("train", "val"):
        f = out / f"{which}_ids.npy"
        if not f.exists():
            np.save(f, np.array(demo_corpus.encode_split(tok_dir / "tokenizer.json", which),
                                dtype=np.uint16))
    return np.load(out / "train_ids.npy"), np.load(out / "val_ids.npy")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--minutes", type=float, default=60.0, help="wall-clock budget of this run")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--total-steps", type=int, default=6000, help="length of the LR schedule")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    train, val = prepare_data(args.out)
    torch.manual_seed(args.seed)
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    step, rng = 0, np.random.default_rng(args.seed)
    ckpt = args.out / "ckpt.pt"
    log = args.out / "train_log.jsonl"
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        rng.bit_generator.state = state["rng"]
        print(f"resumed at step {step}")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params / 1e6:.1f}M parameters, {len(train)} train tokens, {len(val)} val tokens")
    model.train()
    data = batches(train, args.batch, args.seq, rng)
    t_end = time.time() + 60 * args.minutes
    t_save = time.time()
    t0, tokens = time.time(), 0
    while time.time() < t_end and step < args.total_steps:
        warm = 200
        lr = args.lr * min(1.0, (step + 1) / warm) * (
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(step, args.total_steps) / args.total_steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        x = next(data)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x[:, :-1].numel()
        if step % 10 == 0:
            rate = tokens / (time.time() - t0)
            print(f"step {step} loss {loss.item():.3f} lr {lr:.2e} {rate:.0f} tok/s", flush=True)
        if time.time() - t_save > 300 or step == args.total_steps or time.time() >= t_end:
            v = evaluate(model, val, args.seq) if (step % 500 == 0 or time.time() >= t_end
                                                   or step == args.total_steps) else None
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                        "rng": rng.bit_generator.state}, ckpt)
            with open(log, "a") as f:
                f.write(json.dumps({"step": step, "loss": loss.item(), "val_loss": v,
                                    "val_ppl": math.exp(v) if v else None,
                                    "time": time.time()}) + "\n")
            if v:
                print(f"step {step} val loss {v:.3f} ppl {math.exp(v):.1f}", flush=True)
            t_save = time.time()
    v = evaluate(model, val, args.seq)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                "rng": rng.bit_generator.state}, ckpt)
    with open(log, "a") as f:
        f.write(json.dumps({"step": step, "val_loss": v, "val_ppl": math.exp(v),
                            "time": time.time(), "final": True}) + "\n")
    print(f"done at step {step}: val loss {v:.3f} ppl {math.exp(v):.1f}")


if __name__ == "__main__":
    main()
