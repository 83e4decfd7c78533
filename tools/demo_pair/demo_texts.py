"""Step 4 of the demo pair: what the target writes under the demo's decode, for ``train_head``.

    python -m tools.demo_pair.demo_texts --work WORK --prompts 1536 --tokens 256

The demo decodes greedily with mlx-lm's repetition penalty (``mlx_mtp.demo.DEMO_DECODE``), so the
head trains on that text. Prompts are cut from the corpus files (training files for
``WORK/demo_train.jsonl``, held-out ones for ``WORK/demo_val.jsonl``): a file up to a random cut
after a newline, at a line's end, or after a word or punctuation run inside a line, tokenized alone
as a user's prompt is, its last L tokens kept (L drawn per batch, log-uniform in 8..384). The
target (``WORK/target``, written as a checkpoint to ``WORK/target_hf`` and loaded by mlx_mtp as
the CLI loads it) continues a batch of equal-length prompts at once, with mlx-lm's penalty
arithmetic; a continuation ends at ``<|endoftext|>``. ``--check`` reruns some prompts one at a
time through mlx-lm's ``generate_step`` and reports how many continuations came out the same.
Each line: ``{"file", "kind", "prompt_len", "ids"}`` (the prompt's ids, then the continuation's).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import numpy as np

import mlx_mtp  # noqa: F401  (binds the CPU BLAS before mlx.core)
import mlx.core as mx

from mlx_mtp.demo import DEMO_DECODE
from tools.demo_pair.corpus import stdlib_files

KINDS = ("newline", "line_end", "mid_line")  # where a prompt is cut
KIND_SHARE = (0.35, 0.3, 0.35)
PIECE = re.compile(r"\w+|[^\w\s]+")  # a mid-line cut falls after one of these
TEXT_BEFORE = 6000  # characters before a cut that are tokenized (ample for 384 tokens)


def cut_prompt(text: str, rng: np.random.Generator):
    """``(kind, prompt text, whether it starts at the file's start)``: ``text`` up to a random cut
    on a non-blank line; None for a file without one."""
    lines = text.splitlines(keepends=True)
    starts = np.cumsum([0] + [len(s) for s in lines])
    rows = [i for i, s in enumerate(lines) if s.strip() and s.endswith("\n")]
    if not rows:
        return None
    i = rows[rng.integers(len(rows))]
    kind = KINDS[rng.choice(len(KINDS), p=KIND_SHARE)]
    body = lines[i].rstrip("\n")
    ends = [m.end() for m in PIECE.finditer(body)][:-1]
    if kind == "mid_line" and not ends:
        kind = "line_end"
    cut = {"newline": starts[i + 1], "line_end": starts[i] + len(body),
           "mid_line": starts[i] + (ends[rng.integers(len(ends))] if ends else 0)}[kind]
    return kind, text[max(0, cut - TEXT_BEFORE):cut], cut <= TEXT_BEFORE


def sample_prompts(files, tok, n: int, length: int, rng: np.random.Generator):
    """``n`` prompts of exactly ``length`` tokens: ``(file, kind, ids)``."""
    out = []
    while len(out) < n:
        name, text = files[rng.integers(len(files))]
        cut = cut_prompt(text, rng)
        if cut is None:
            continue
        kind, prefix, whole = cut
        ids = tok.encode(prefix).ids
        if len(ids) < length + (0 if whole else 1):  # a cut prefix's first token may be partial
            continue
        out.append((name, kind, ids[-length:]))
    return out


def penalize(logits: mx.array, history: mx.array, penalty: float) -> mx.array:
    """mlx-lm's repetition penalty, row by row: ``history`` [B, C] the ids each row penalizes."""
    picked = mx.take_along_axis(logits, history, axis=-1)
    picked = mx.where(picked < 0, picked * penalty, picked / penalty)
    return mx.put_along_axis(logits, history, picked, axis=-1)


def continue_batch(model, prompts: np.ndarray, tokens: int, eos: set):
    """Greedy continuations of equal-length ``prompts`` [B, L] under the demo's decode."""
    from mlx_lm.models.cache import make_prompt_cache

    net = model.mlx_model
    cache = make_prompt_cache(net)
    seq = mx.array(prompts.astype(np.int32))
    logits = net(seq, cache=cache)[:, -1]
    context = DEMO_DECODE.repetition_context_size
    out = []
    for _ in range(tokens):
        nxt = mx.argmax(penalize(logits, seq[:, -context:], DEMO_DECODE.repetition_penalty),
                        axis=-1)
        out.append(nxt)
        seq = mx.concatenate([seq, nxt[:, None]], axis=1)
        logits = net(nxt[:, None], cache=cache)[:, -1]
        mx.eval(logits, seq)
    gen = np.array(mx.stack(out, axis=1))
    cont = []
    for row in gen.tolist():
        stop = next((j for j, t in enumerate(row) if t in eos), len(row))
        cont.append(row[:stop])
    return cont


def single_continuation(model, ids, tokens: int, eos: set):
    """The same continuation by mlx-lm's ``generate_step``, one prompt alone (the CLI's path)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors

    procs = make_logits_processors(repetition_penalty=DEMO_DECODE.repetition_penalty,
                                   repetition_context_size=DEMO_DECODE.repetition_context_size)
    out = []
    for t, _ in generate_step(mx.array(ids), model.mlx_model, max_tokens=tokens,
                              logits_processors=procs):
        if t in eos:
            break
        out.append(t)
    return out


def write_target(work: Path) -> Path:
    """``WORK/target`` as a checkpoint folder (no head) that mlx_mtp loads."""
    from tools.demo_pair.checkpoint import raw_weights, write_folder  # PyTorch: the train extra
    from tools.demo_pair.train_head import load_target

    folder = work / "target_hf"
    write_folder(folder, raw_weights(load_target(work)), work / "tokenizer")
    return folder


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--prompts", type=int, default=1536, help="prompts from the training files")
    ap.add_argument("--val-prompts", type=int, default=64, help="prompts from the held-out files")
    ap.add_argument("--tokens", type=int, default=256, help="most tokens per continuation")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=8, help="shortest prompt, tokens")
    ap.add_argument("--max-len", type=int, default=384, help="longest prompt, tokens")
    ap.add_argument("--check", type=int, default=8, help="prompts rerun one at a time")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from tokenizers import Tokenizer

    corpus = json.loads((args.work / "corpus.json").read_text())
    files = dict(stdlib_files(Path(corpus["stdlib"])))
    tok = Tokenizer.from_file(str(args.work / "tokenizer" / "tokenizer.json"))
    model, tokenizer = mlx_mtp.load(write_target(args.work), require_head=False)
    eos = set(tokenizer.eos_token_ids)
    for split, count, seed in (("val", args.val_prompts, args.seed + 1),
                               ("train", args.prompts, args.seed)):
        part = [(r, files[r]) for r in corpus[f"{split}_files"]]
        rng = np.random.default_rng(seed)
        records, t0 = [], time.time()
        while len(records) < count:
            b = min(args.batch, count - len(records))
            length = int(round(math.exp(rng.uniform(math.log(args.min_len),
                                                    math.log(args.max_len)))))
            prompts = sample_prompts(part, tok, b, length, rng)
            conts = continue_batch(model, np.array([p for _, _, p in prompts]), args.tokens, eos)
            for (name, kind, ids), cont in zip(prompts, conts):
                records.append({"file": name, "kind": kind, "prompt_len": len(ids),
                                "ids": ids + cont})
            print(f"{split}: {len(records)}/{count} prompts, "
                  f"{sum(len(r['ids']) - r['prompt_len'] for r in records)} tokens, "
                  f"{time.time() - t0:.0f} s", flush=True)
        with (args.work / f"demo_{split}.jsonl").open("w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        checked = records[: args.check]
        same = sum(single_continuation(model, r["ids"][: r["prompt_len"]], args.tokens, eos)
                   == r["ids"][r["prompt_len"]:] for r in checked)
        print(f"{split}: {same} of {len(checked)} continuations equal generate_step's",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
