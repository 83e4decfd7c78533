"""Reduced draft vocabulary: the drafter projects only the most frequent target ids, from a sidecar
folder (``draft_vocab.safetensors``: the sorted ``ids`` and EAGLE-3's ``d2t``, target id = draft
index + d2t[draft index]; ``draft_vocab.json``: sizes, the tokenizer vocabulary's sha256, the LM
head's fingerprint) that ``python -m mlx_mtp.draft_vocab build`` writes. A draft can only be
rejected, so it costs acceptance, never exactness. docs/models.md, "Reduced draft vocabulary"."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Dict, Iterable, List, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step

from mlx_mtp.errors import MTPError
from mlx_mtp.models.qwen3_5.lm_head import HeadTensors

FORMAT = "mlx_mtp.draft_vocab"
VERSION = 1
META_FILE = "draft_vocab.json"
TENSOR_FILE = "draft_vocab.safetensors"
FINGERPRINT_ROWS = 256
# The size when none is asked: 32768 ids (at most a quarter of the vocabulary). On a realistic
# pair with Zipf token statistics and a 128k vocabulary it drafted fastest of 8k-64k at blocks 3
# and 4 (docs/models.md, "Reduced draft vocabulary").
DEFAULT_SIZE = 32768


def default_size(vocab: int) -> int:
    return max(1, min(DEFAULT_SIZE, vocab // 4))
PROMPT_TOKENS = 64  # corpus paragraphs are cut to this many tokens as generation prompts

logger = logging.getLogger("mlx_mtp")


# ------------------------------------------------------------------------------- fingerprints


def tokenizer_sha256(tokenizer) -> str:
    """sha256 of the vocabulary (token -> id, ordered by id)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def head_sha256(target) -> str:
    """sha256 of the LM head's shape and of 256 evenly spaced rows as float32 (dequantized if
    quantized): tells heads apart without reading gigabytes, and is the same for a bf16 head
    whether it is loaded as bf16 or cast to float32."""
    t = HeadTensors.of(target.lm_head_module)
    rows = mx.array(np.unique(np.linspace(0, t.rows - 1, FINGERPRINT_ROWS).astype(np.int64)))
    w = t.weight[rows]
    if t.scales is not None:
        w = mx.dequantize(w, t.scales[rows], None if t.biases is None else t.biases[rows],
                          group_size=t.group_size, bits=t.bits, mode=t.mode)
    w = w.astype(mx.float32)
    h = hashlib.sha256(json.dumps([t.rows, int(w.shape[-1])]).encode())
    h.update(bytes(memoryview(w)))
    return h.hexdigest()


# ---------------------------------------------------------------------------------- building


def read_corpus(files: Iterable[Path]) -> Dict[Path, str]:
    out = {}
    for f in files:
        f = Path(f)
        if not f.is_file():
            raise MTPError(f"--corpus {f} does not exist (expected a text file)")
        try:
            out[f] = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise MTPError(f"--corpus {f} is not UTF-8 text ({e})") from None
    return out


def pieces(text: str, size: int = 1 << 14) -> List[str]:
    """``text`` cut at line ends into pieces of about ``size`` characters (tokenizers warn about,
    and some models' tokenizers slow down on, megabyte-long inputs)."""
    out, cur, n = [], [], 0
    for line in text.splitlines(keepends=True):
        cur.append(line)
        n += len(line)
        if n >= size:
            out.append("".join(cur))
            cur, n = [], 0
    if cur:
        out.append("".join(cur))
    return out


def count_ids(texts: Iterable[str], tokenizer, vocab_size: int) -> np.ndarray:
    counts = np.zeros(vocab_size, dtype=np.int64)
    for text in texts:
        for piece in pieces(text):
            ids = np.asarray(tokenizer.encode(piece, add_special_tokens=False), dtype=np.int64)
            ids = ids[(ids >= 0) & (ids < vocab_size)]
            counts += np.bincount(ids, minlength=vocab_size)
    return counts


def generation_prompts(texts: Iterable[str], tokenizer, n: int) -> List[List[int]]:
    """The first ``n`` non-empty paragraphs of the corpus, cut to PROMPT_TOKENS tokens."""
    prompts = []
    for text in texts:
        for para in text.split("\n\n"):
            ids = tokenizer.encode(para, add_special_tokens=False)[:PROMPT_TOKENS]
            if ids:
                prompts.append(ids)
            if len(prompts) == n:
                return prompts
    return prompts


def generated_ids(mlx_model, prompts: List[List[int]], tokens: int) -> List[int]:
    """The target's own greedy continuations (mlx-lm's plain decode)."""
    out = []
    for p in prompts:
        out += [t for t, _ in generate_step(mx.array(p), mlx_model, max_tokens=tokens)]
    return out


def select(counts: np.ndarray, size: int, always: Iterable[int] = ()) -> np.ndarray:
    """The ``size`` most frequent ids, sorted (ties: lower id first); ``always`` (the EOS ids)
    are in regardless of their count."""
    key = counts.astype(np.float64)
    key[[i for i in always if 0 <= i < key.size]] = np.inf
    order = np.lexsort((np.arange(key.size), -key))  # by count desc, then id asc
    return np.sort(order[:size])


def write_sidecar(out: Path, ids: np.ndarray, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    ids = np.asarray(ids, dtype=np.uint32)
    d2t = ids.astype(np.int64) - np.arange(ids.size)
    mx.save_safetensors(str(out / TENSOR_FILE), {"ids": mx.array(ids),
                                                  "d2t": mx.array(d2t.astype(np.int32))},
                        metadata={"format": FORMAT})
    (out / META_FILE).write_text(json.dumps({"format": FORMAT, "version": VERSION, **meta},
                                            indent=1))


def build(model, tokenizer, *, size: Optional[int], corpus: List[Path], out: Path,
          generate_tokens: int = 0, generate_prompts: int = 8) -> dict:
    """Count the corpus (and the target's generations) and write the ``size`` most frequent
    ids (None: ``default_size``) as a sidecar in ``out``."""
    vocab = model.target.vocab_size
    if size is None:
        size = default_size(vocab)
    if not 1 <= size < vocab:
        raise MTPError(f"--size must be between 1 and {vocab - 1} (the target's vocabulary has "
                       f"{vocab} ids), got {size}")
    texts = read_corpus(corpus)
    counts = count_ids(texts.values(), tokenizer, vocab)
    corpus_tokens = int(counts.sum())
    if corpus_tokens == 0:
        raise MTPError("--corpus: the files hold no tokens")
    generated = 0
    if generate_tokens > 0:
        prompts = generation_prompts(texts.values(), tokenizer, generate_prompts)
        gen = generated_ids(model.mlx_model, prompts, generate_tokens)
        counts += np.bincount(np.asarray(gen, dtype=np.int64), minlength=vocab)[:vocab]
        generated = len(gen)
    return write_counted(model, tokenizer, counts, size=size, out=out,
                         corpus={str(f): len(t) for f, t in texts.items()},
                         corpus_tokens=corpus_tokens, generated_tokens=generated)


def write_counted(model, tokenizer, counts: np.ndarray, *, size: int, out: Path, corpus,
                  corpus_tokens: int, generated_tokens: int = 0) -> dict:
    """The sidecar of the ``size`` most frequent ids of ``counts`` (per target id) and the EOS
    ids, with its fingerprints and ``corpus`` (what was counted) in its metadata."""
    ids = select(counts, size, always=getattr(tokenizer, "eos_token_ids", ()) or ())
    meta = {
        "size": int(size), "vocab_size": int(model.target.vocab_size),
        "tokenizer_sha256": tokenizer_sha256(tokenizer), "head_sha256": head_sha256(model.target),
        "model": str(model.path), "corpus": corpus,
        "corpus_tokens": int(corpus_tokens), "generated_tokens": int(generated_tokens),
        # share of the counted tokens (corpus + generations) whose id is in the subset
        "coverage": float(counts[ids].sum() / counts.sum()),
    }
    write_sidecar(Path(out), ids, meta)
    return {"out": str(out), **meta}


# ----------------------------------------------------------------------------------- loading


def _fallback(why: str) -> None:
    logger.warning("draft vocabulary %s: drafting over the full vocabulary", why)
    return None


def load_ids(folder, tokenizer, target) -> Optional[mx.array]:
    """The sidecar's sorted target ids for this target and tokenizer, or None (full head) with
    one warning when it is absent or was built for another tokenizer, vocabulary or LM head.
    A sidecar that is there but unreadable is an error."""
    folder = Path(folder)
    meta_f, tensor_f = folder / META_FILE, folder / TENSOR_FILE
    if not meta_f.is_file() or not tensor_f.is_file():
        return _fallback(f"sidecar {folder} not found (expected {META_FILE} and {TENSOR_FILE})")
    try:
        meta = json.loads(meta_f.read_text())
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"format is not {FORMAT!r}")
        tensors = mx.load(str(tensor_f))
        ids, d2t = tensors["ids"], tensors["d2t"]
    except (ValueError, KeyError, RuntimeError, UnicodeDecodeError) as e:
        raise MTPError(f"draft vocabulary {folder}: unreadable sidecar ({e})") from None
    vocab = target.vocab_size
    if meta.get("vocab_size") != vocab:
        return _fallback(f"{folder} was built for a vocabulary of {meta.get('vocab_size')} ids, "
                         f"the target has {vocab}")
    if meta.get("tokenizer_sha256") != tokenizer_sha256(tokenizer):
        return _fallback(f"{folder} was built for another tokenizer (vocabulary hash differs)")
    if meta.get("head_sha256") != head_sha256(target):
        return _fallback(f"{folder} was built for another LM head (head fingerprint differs)")
    host = np.asarray(ids).astype(np.int64)
    if (ids.ndim != 1 or host.size == 0 or np.any(np.diff(host) <= 0) or host[0] < 0
            or host[-1] >= vocab or host.size != meta.get("size")
            or not np.array_equal(np.asarray(d2t), host - np.arange(host.size))):
        raise MTPError(f"draft vocabulary {folder}: ids must be {meta.get('size')} sorted, distinct "
                       f"target ids below {vocab} with d2t = ids - index")
    return ids.astype(mx.uint32)
