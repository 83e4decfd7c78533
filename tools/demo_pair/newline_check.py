"""How often a pair ends the text at once after a prompt that ends in a newline.

Cuts prompts of whole lines (up to ``--chars`` characters, ending after a non-blank line) from the
held-out files that ``corpus`` listed, and counts those whose first token under the demo's decode
(mlx-lm's greedy decode with the repetition penalty) is end of text. The model card's count:

    python -m tools.demo_pair.newline_check --pair mlx_mtp/demo_pair --work WORK
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

import mlx_mtp  # noqa: F401  (binds the CPU BLAS before mlx.core)
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.utils import load_model

from mlx_mtp.demo import DEMO_DECODE


def newline_prompt(text: str, rng: np.random.Generator, chars: int):
    """The whole lines of ``text`` that end with a random non-blank line, at most ``chars``
    characters (the last line alone if it is longer); None for a text without such a line."""
    lines = text.splitlines(keepends=True)
    rows = [i for i, s in enumerate(lines) if s.strip() and s.endswith("\n")]
    if not rows:
        return None
    i = rows[rng.integers(len(rows))]
    j = i
    while j > 0 and sum(len(s) for s in lines[j - 1:i + 1]) <= chars:
        j -= 1
    return "".join(lines[j:i + 1])


def newline_prompts(files: list, n: int, seed: int, chars: int) -> list:
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        _, text = files[rng.integers(len(files))]
        prompt = newline_prompt(text, rng, chars)
        if prompt is not None:
            out.append(prompt)
    return out


def first_tokens(pair: Path, prompts: list) -> list:
    """The demo decode's first token after each prompt."""
    tok = load_tokenizer(pair)
    model, _ = load_model(pair)
    out = []
    for p in prompts:
        processors = make_logits_processors(
            repetition_penalty=DEMO_DECODE.repetition_penalty,
            repetition_context_size=DEMO_DECODE.repetition_context_size)
        t, _ = next(generate_step(mx.array(tok.encode(p)), model, max_tokens=1,
                                  logits_processors=processors))
        out.append(int(t))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", required=True, type=Path, help="a packaged pair's folder")
    ap.add_argument("--work", required=True, type=Path, help="the work folder corpus wrote")
    ap.add_argument("--prompts", type=int, default=150)
    ap.add_argument("--chars", type=int, default=1500, help="longest prompt, characters")
    ap.add_argument("--seed", type=int, default=123)
    args = ap.parse_args(argv)
    corpus = json.loads((args.work / "corpus.json").read_text())
    root = Path(corpus["stdlib"])
    files = [(f, (root / f).read_text()) for f in corpus["val_files"]]
    prompts = newline_prompts(files, args.prompts, args.seed, args.chars)
    eos = load_tokenizer(args.pair).eos_token_ids
    ends = sum(t in eos for t in first_tokens(args.pair, prompts))
    print(json.dumps({"pair": str(args.pair), "prompts": len(prompts), "chars": args.chars,
                      "first_token_end_of_text": ends}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
