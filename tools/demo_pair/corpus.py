"""Step 1 of the demo pair: a BPE tokenizer and token-id arrays from the Python standard library.

    python -m tools.demo_pair.corpus --out WORK

The corpus is every ``.py`` file of this interpreter's standard library (no site-packages, no test
suites, no idlelib / lib2to3 / turtledemo), files in sorted path order, each followed by
``<|endoftext|>``. A file goes to validation when sha1(relative path) % 50 == 0. Writes
``WORK/tokenizer/{tokenizer.json,tokenizer_config.json,tokenization_demo_pair.py}``,
``WORK/train_ids.npy``, ``WORK/val_ids.npy`` (uint16) and ``WORK/corpus.json`` (what went where).

``train_cut_ids.npy`` / ``val_cut_ids.npy`` hold the same files cut at a random ``--line-cuts``
share of their line ends, each piece tokenized alone. The tokenizer merges a newline with the next
line's indent, so uncut text has a bare newline token mainly before unindented lines and at a
file's end (then ``<|endoftext|>``); a prompt that ends in a newline ends in that bare token.
The cuts make "bare newline, then an indent token" common (``train_target --data train_cut``).
About a minute here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import sys
import sysconfig
from pathlib import Path

import numpy as np

SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo"}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS = SPECIALS[0]
TOKENIZER_MODULE = (Path(__file__).resolve().parents[2] / "mlx_mtp" / "demo_pair"
                    / "tokenization_demo_pair.py")


def stdlib_files(root: Path):
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_DIRS.intersection(rel.parts[:-1]):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield rel.as_posix(), text


def is_val(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 50 == 0


def line_cut_pieces(text: str, rate: float, rng: np.random.Generator):
    """``text`` cut after a random ``rate`` share of its newlines (never at its end)."""
    ends = [m.end() for m in re.finditer("\n", text) if m.end() < len(text)]
    cuts = [e for e, keep in zip(ends, rng.random(len(ends)) < rate) if keep]
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def train_tokenizer(texts, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--line-cuts", type=float, default=0.1,
                    help="share of line ends cut in the *_cut_ids.npy arrays (0..1)")
    ap.add_argument("--seed", type=int, default=0, help="where the line cuts fall")
    ap.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    args = ap.parse_args(argv)
    if not 0 <= args.line_cuts <= 1:
        sys.exit(f"error: --line-cuts must be in [0, 1], got {args.line_cuts}")
    files = list(stdlib_files(args.stdlib))
    if not files:
        sys.exit(f"error: --stdlib {args.stdlib}: no .py files found")
    train = [(r, t) for r, t in files if not is_val(r)]
    val = [(r, t) for r, t in files if is_val(r)]
    tok = train_tokenizer((t for _, t in train), args.vocab_size)
    tdir = args.out / "tokenizer"
    tdir.mkdir(parents=True, exist_ok=True)
    tok.save(str(tdir / "tokenizer.json"))
    # auto_map keeps transformers >= 5.2x from swapping in its Qwen3.5 tokenizer class, which
    # rebuilds the pre-tokenizer (see the module's docstring); the class is a plain fast tokenizer.
    (tdir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "auto_map": {"AutoTokenizer": [None, f"{TOKENIZER_MODULE.stem}.DemoPairTokenizer"]},
        "eos_token": EOS, "bos_token": None, "model_max_length": 4096}, indent=1))
    shutil.copy(TOKENIZER_MODULE, tdir / TOKENIZER_MODULE.name)
    eos = tok.token_to_id(EOS)
    for name, part in (("train", train), ("val", val)):
        ids = []
        for enc in tok.encode_batch([t for _, t in part]):
            ids.extend(enc.ids)
            ids.append(eos)
        np.save(args.out / f"{name}_ids.npy", np.asarray(ids, dtype=np.uint16))
        print(f"{name}: {len(part)} files, {len(ids)} tokens")
        cut = []
        for i, (_, text) in enumerate(part):
            rng = np.random.default_rng([args.seed, i])
            for enc in tok.encode_batch(line_cut_pieces(text, args.line_cuts, rng)):
                cut.extend(enc.ids)
            cut.append(eos)
        np.save(args.out / f"{name}_cut_ids.npy", np.asarray(cut, dtype=np.uint16))
        print(f"{name}_cut: {len(cut)} tokens")
    (args.out / "corpus.json").write_text(json.dumps({
        "python": sys.version.split()[0], "stdlib": str(args.stdlib), "vocab_size": args.vocab_size,
        "line_cuts": args.line_cuts, "seed": args.seed,
        "train_files": [r for r, _ in train], "val_files": [r for r, _ in val]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
