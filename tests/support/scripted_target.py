"""An oracle target: a tiny Qwen3.5 checkpoint whose weights are wired so that its greedy output
after any chat prompt is a given script, with a real chat template.

Each piece of the script is one token of the tokenizer (an added token), so the script is a
chain of distinct tokens. The checkpoint is ``write_agreeing_checkpoint``'s: the target maps
token x to f(x) and its MTP head agrees, with f chosen to send the prompt's last token (the end
of the template's generation prompt) to the first piece, each piece to the next, the last to
EOS. The server then decodes it with MTP as any checkpoint, and the test asserts what it says.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Sequence

import numpy as np

from support import tiny_checkpoints as tc

# The markers of Qwen3's template and tool parser: tokens of their own, as in Qwen's vocabulary.
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
           "</tool_response>"]


def _tokenizer_files(path: Path, pieces: Sequence[str], chat_template: str, eos: str) -> dict:
    """The tiny BPE tokenizer with the markers and pieces added as tokens, and the template."""
    from tokenizers import AddedToken, Tokenizer

    tc.write_tokenizer(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t in MARKERS + [p for p in pieces if p not in MARKERS]])
    tok.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(chat_template=chat_template, eos_token=eos)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return {name: (path / name).read_bytes()
            for name in ("tokenizer.json", "tokenizer_config.json")}


def write_scripted_checkpoint(path, pieces: Sequence[str], chat_template: str,
                              eos: str = "<|im_end|>", seed: int = 0) -> List[int]:
    """Write the checkpoint to ``path``; returns the script's ids (the pieces', then EOS)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    files = _tokenizer_files(path, pieces, chat_template, eos)
    tok = load_tokenizer(path)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                     add_generation_prompt=True, tokenize=True)
    script = []
    for piece in pieces:
        ids = tok.encode(piece, add_special_tokens=False)
        assert len(ids) == 1, f"{piece!r} is not one token: {ids}"
        script.append(ids[0])
    script.append(tok.convert_tokens_to_ids(eos))
    chain = [prompt[-1]] + script
    assert len(set(chain)) == len(chain), f"the chain repeats a token: {chain}"
    vocab = tc.VOCAB
    # f: chain[i] -> chain[i + 1]; the other tokens to the unused ones, at random.
    f = np.full(vocab, -1)
    f[chain[:-1]] = chain[1:]
    rest = np.random.default_rng(seed).permutation(sorted(set(range(vocab)) - set(chain[1:])))
    f[f < 0] = rest
    tc.write_agreeing_checkpoint(path, seed=seed, successor=f)
    for name, data in files.items():  # the writer trained its own tokenizer: ours again
        (path / name).write_bytes(data)
    return script
