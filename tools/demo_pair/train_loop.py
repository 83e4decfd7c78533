"""What both demo trainers share: flags, the seeded batch and the schedule, and a resumable loop.

A run keeps ``OUT/{NAME.pt,optim.pt,state.json,log.jsonl}``. Every ``--save-every`` steps (and on
stopping) it validates, saves (weights and optimizer written to temporary names, then renamed) and
logs; rerunning with the same flags continues from the saved step with the same data order (batch k
is drawn by a generator seeded with (seed, k)), so a resumed run ends with the weights of an
uninterrupted one. ``--minutes`` stops early at a step boundary.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, Optional, Tuple

import numpy as np
import torch


def add_common_args(ap: argparse.ArgumentParser, *, steps: int, lr: float, warmup: int,
                    seed: int, steps_help: Optional[str] = None,
                    minutes_help: Optional[str] = None) -> None:
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--steps", type=int, default=steps, help=steps_help)
    ap.add_argument("--minutes", type=float, default=None, help=minutes_help)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=lr)
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--seed", type=int, default=seed)
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)


def batch(ids: np.ndarray, seed: int, step: int, bsz: int, seq: int) -> torch.Tensor:
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(ids) - seq - 1, size=bsz)
    return torch.from_numpy(np.stack([ids[s:s + seq + 1] for s in starts]).astype(np.int64))


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


class ResumableRun:
    """``module`` trained by ``opt`` into ``out``; resumes from ``out/state.json`` if present."""

    def __init__(self, args, out: Path, name: str, module: torch.nn.Module, opt):
        self.args, self.out, self.name, self.module, self.opt = args, out, name, module, opt
        out.mkdir(parents=True, exist_ok=True)
        self.step = 0
        if (out / "state.json").exists():
            module.load_state_dict(torch.load(out / f"{name}.pt"))
            opt.load_state_dict(torch.load(out / "optim.pt"))
            self.step = json.loads((out / "state.json").read_text())["step"]
            print(f"resumed at step {self.step}")

    def save(self, final: bool) -> None:
        out = self.out
        torch.save(self.module.state_dict(), out / f"{self.name}.pt.tmp")
        torch.save(self.opt.state_dict(), out / "optim.pt.tmp")
        (out / f"{self.name}.pt.tmp").replace(out / f"{self.name}.pt")
        (out / "optim.pt.tmp").replace(out / "optim.pt")
        (out / "state.json").write_text(json.dumps({
            "step": self.step, "final": final,
            "args": {k: str(v) for k, v in vars(self.args).items()}}))

    def train(self, train_ids: np.ndarray, seq_len: int, params: Iterable[torch.Tensor],
              loss_fn: Callable[[torch.Tensor], Tuple[torch.Tensor, Dict]],
              validate: Callable[[], Dict], on_start: Callable[[], None] = lambda: None,
              draw: Optional[Callable[[int], torch.Tensor]] = None) -> None:
        """``loss_fn(batch) -> (loss, logged metrics)``; ``validate() -> logged metrics``, run
        at every save; ``on_start`` runs once the clock has started. Batch k is
        ``draw(k)``, by default ``batch(train_ids, seed, k, --batch, seq_len)``."""
        args, params = self.args, list(params)
        log = (self.out / "log.jsonl").open("a")
        t0 = time.time()
        on_start()
        self.module.train()
        while self.step < args.steps:
            if args.minutes is not None and time.time() - t0 > 60 * args.minutes:
                break
            for group in self.opt.param_groups:
                group["lr"] = lr_at(self.step, args.steps, args.lr, args.warmup)
            x = (draw(self.step) if draw is not None
                 else batch(train_ids, args.seed, self.step, args.batch, seq_len))
            loss, metrics = loss_fn(x)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.step += 1
            rec = {"step": self.step, **metrics, "elapsed_s": round(time.time() - t0, 1)}
            validated = self.step % args.save_every == 0 or self.step == args.steps
            if validated:
                rec.update(validate())
                self.save(self.step == args.steps)
            if self.step % 10 == 0 or validated:
                print(json.dumps(rec), flush=True)
            log.write(json.dumps(rec) + "\n")
            log.flush()
        self.save(self.step >= args.steps)
        print(f"stopped at step {self.step} after {time.time() - t0:.0f} s")
