"""The demo pair's corpus: the Python standard library sources of the running interpreter
(offline, on every machine with Python), split by file into train and validation, and the BPE
tokenizer trained on the train split. Shared by the demo training scripts."""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path
from typing import List, Tuple

EOS = "<|endoftext|>"
SPECIALS = [EOS, "<|im_start|>", "<|im_end|>"]


def stdlib_files() -> List[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo")
    files = [p for p in sorted(root.rglob("*.py"))
             if not any(part in skip for part in p.relative_to(root).parts)]
    return files


def split(files: List[Path], val_every: int = 50) -> Tuple[List[Path], List[Path]]:
    """Deterministic split by file-name hash: about 1 file in ``val_every`` is validation."""
    train, val = [], []
    for f in files:
        h = int(hashlib.sha1(f.name.encode()).hexdigest(), 16)
        (val if h % val_every == 0 else train).append(f)
    return train, val


def read(files: List[Path]) -> List[str]:
    out = []
    for f in files:
        try:
            out.append(f.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def train_tokenizer(out_dir: Path, vocab_size: int = 8192) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    train, _ = split(stdlib_files())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(read(train), trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": None,
         "model_max_length": 4096}, indent=1))
    return out_dir / "tokenizer.json"


def encode_split(tokenizer_json: Path, which: str) -> List[int]:
    """One stream of token ids, files separated by EOS."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    eos = tok.token_to_id(EOS)
    train, val = split(stdlib_files())
    ids: List[int] = []
    for enc in tok.encode_batch(read(train if which == "train" else val)):
        ids.extend(enc.ids)
        ids.append(eos)
    return ids
