"""What a trained head would keep at a fixed block size, drafting as the demo decodes.

The demo decodes with mlx-lm's repetition penalty; a drafter that applies the request's logits
processors to its own logits drafts argmax(penalty(head logits)) over the history the target's
row sees (the drafts before it included). This replays that on texts the target wrote under the
same decode (``demo_texts``): the target's true hidden states, the head's chained steps
(``MTPHead.recurrent``, fed the text's tokens: a chain is only judged while its drafts equal
them), the penalty, the argmax over the draft vocabulary, then rounds as the loop runs them from
the prompt's end (a round keeps its drafts up to the first one that differs from the text and
emits one token more). Returns first-position acceptance over the rounds and tokens per round.
``penalized=False`` drafts the head's own argmax, as a drafter without the processors does.

    python -m tools.demo_pair.drafting_sim --pair mlx_mtp/demo_pair --texts WORK/demo_val.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from mlx_mtp.demo import DEMO_DECODE


def penalize(logits: torch.Tensor, history: torch.Tensor, penalty: float) -> torch.Tensor:
    """mlx-lm's repetition penalty per row: ``logits`` [..., V], ``history`` [..., C] ids."""
    picked = logits.gather(-1, history)
    picked = torch.where(picked < 0, picked * penalty, picked / penalty)
    return logits.scatter(-1, history, picked)


def histories(ids: torch.Tensor, last: torch.Tensor, context: int) -> torch.Tensor:
    """[..., len(last), context]: ``ids[..., q - context + 1 .. q]`` for each q in ``last``; before
    the text's start, ``ids[..., 0]`` again (already in the history: penalizing it changes
    nothing)."""
    idx = (last[:, None] - torch.arange(context)[None, :]).clamp(min=0)
    return ids[..., idx]


@torch.no_grad()
def record_lengths(head, target, ids: np.ndarray, prompt_len: int, drafts: int,
                   vocab: Optional[torch.Tensor], penalized: bool = True) -> list:
    """L(p) for each round base p from ``prompt_len - 1``: drafts kept out of ``drafts``."""
    x = torch.from_numpy(np.asarray(ids, dtype=np.int64))
    n = x.numel() - drafts - 1  # bases whose drafts all have a text token to meet
    if n < prompt_len:
        return []
    h = target.model(input_ids=x[None]).last_hidden_state
    outs = head.recurrent(target.model.embed_tokens, h[:, :n], x[None, :n + drafts], drafts)
    base = torch.arange(prompt_len - 1, n)
    ok = torch.ones(base.numel(), dtype=torch.bool)
    kept = torch.zeros(base.numel(), dtype=torch.long)
    for s, g in enumerate(outs, start=1):
        logits = target.lm_head(g[0, base])
        if penalized:
            logits = penalize(logits, histories(x, base + s, DEMO_DECODE.repetition_context_size),
                              DEMO_DECODE.repetition_penalty)
        if vocab is not None:
            draft = vocab[logits[:, vocab].argmax(-1)]
        else:
            draft = logits.argmax(-1)
        ok = ok & (draft == x[base + s + 1])
        kept += ok.long()
    return kept.tolist()


def rounds(lengths: list, drafts: int) -> list:
    """The drafts kept by each round of a run of ``drafts`` drafts per round."""
    out, p = [], 0
    while p < len(lengths):
        out.append(min(lengths[p], drafts))
        p += out[-1] + 1
    return out


def simulate(head, target, records, block: int = 3, vocab: Optional[torch.Tensor] = None,
             penalized: bool = True) -> dict:
    """First-position acceptance and tokens per round at ``block`` over ``records`` (dicts with
    ``ids`` and ``prompt_len``), and the share of every position's first draft kept."""
    drafts = block - 1
    kept, every = [], []
    for r in records:
        lengths = record_lengths(head, target, r["ids"], r["prompt_len"], drafts, vocab,
                                 penalized)
        kept += rounds(lengths, drafts)
        every += [min(v, 1) for v in lengths]
    kept = np.asarray(kept)
    return {"block": block, "rounds": int(kept.size),
            "accept": [round(float((kept >= i).mean()), 4) for i in range(1, drafts + 1)],
            "tokens_per_round": round(float(kept.mean() + 1), 4),
            "first_every_position": round(float(np.mean(every)), 4)}


def read_records(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def draft_vocab_ids(pair: Path) -> Optional[torch.Tensor]:
    """The pair's shipped draft vocabulary (``mtp/draft_vocab``), or None."""
    from safetensors.numpy import load_file

    f = pair / "mtp" / "draft_vocab" / "draft_vocab.safetensors"
    return torch.from_numpy(load_file(str(f))["ids"].astype(np.int64)) if f.is_file() else None


def main(argv=None) -> int:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    from tools.demo_pair.checkpoint import packaged_states
    from tools.demo_pair.torch_model import MTPHead, install_fast_gdn, target_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", required=True, type=Path, help="a packaged pair's folder")
    ap.add_argument("--texts", required=True, type=Path, help="demo_texts' JSON lines")
    ap.add_argument("--block", type=int, default=3)
    ap.add_argument("--full-vocab", action="store_true",
                    help="argmax over every id, not the pair's draft vocabulary")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    install_fast_gdn()
    target_state, head_state = packaged_states(args.pair)
    target = Qwen3_5ForCausalLM(target_config())
    target.load_state_dict(target_state)
    head = MTPHead(target.config)
    missing, unexpected = head.load_state_dict(head_state, strict=False)
    if unexpected or any(not k.startswith("rotary.") for k in missing):  # rotary: not stored
        sys.exit(f"error: --pair {args.pair}: head tensors differ ({missing}, {unexpected})")
    target.eval()
    head.eval()
    records = read_records(args.texts)
    vocab = None if args.full_vocab else draft_vocab_ids(args.pair)
    out = {mode: simulate(head, target, records, args.block, vocab, mode == "penalized")
           for mode in ("penalized", "unpenalized")}
    print(json.dumps({"pair": str(args.pair), "texts": str(args.texts),
                      "draft_vocab": None if vocab is None else int(vocab.numel()), **out},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
