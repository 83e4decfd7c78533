"""The demo pair's tokenizer files load through mlx-lm / transformers and split text exactly as the
raw ``tokenizers.Tokenizer`` the pair was trained with (tools/demo_pair/corpus.py) does."""

import sysconfig
import unicodedata
from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers
from transformers import AutoTokenizer

import mlx_mtp
from mlx_mtp import demo
from mlx_mtp.io.checkpoint import load_tokenizer
from mlx_mtp.decoding.responses import encode_prompt
from mlx_mtp.generate import DEFAULT_PROMPT, prepare_prompt
from tools.demo_pair import corpus

# Held-out text: written for this test, not from the standard library the pair was trained on.
# It has what a regex or a normalizer change splits differently: blank lines, a line ending in
# punctuation, CRLF, tabs, trailing spaces, multi-digit numbers, an identifier after an
# underscore or a parenthesis, upper-case contractions, and a decomposed accent (NFC would fuse it).
HELD_OUT = (
    "# Inventory report, generated 2031-07-14\n\n\n"
    "def restock(shelf_7, threshold=1250):\n"
    "    \"\"\"Return the bins under THRESHOLD; DON'T touch the café's (cafe\u0301) stock.\"\"\"\n\n"
    "    low = {bin_id: qty for bin_id, qty in shelf_7.items() if qty < threshold}:\n"
    "\tif not low:   \n"
    "\t\treturn []\r\n"
    "    return sorted(low, key=low.get)  # 3 passes, 42ms each...\n\n"
    "The warehouse robot (model RX-9000) said: \"I'll restock 12,345 units by 06:30.\"\n"
)


def trained(text: str) -> list:
    return Tokenizer.from_file(str(demo.DEMO_DIR / "tokenizer.json")).encode(text).ids


def held_out_stdlib_file() -> str:
    """The first file the pair held out from training (corpus.is_val), as the trainer read it."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for rel, text in corpus.stdlib_files(root):
        if corpus.is_val(rel) and len(text) > 2000:
            return text
    raise AssertionError(f"no held-out file of more than 2000 characters under {root}")


SAMPLES = {"written": HELD_OUT, "held-out stdlib file": held_out_stdlib_file()}


def test_the_sample_tells_the_two_splits_apart():
    """The check below can fail: the Qwen3.5 pipeline transformers >= 5.2x builds for a qwen3_5
    checkpoint (NFC + its regex) encodes this text differently from the trainer."""
    qwen = Tokenizer.from_file(str(demo.DEMO_DIR / "tokenizer.json"))
    qwen.normalizer = normalizers.NFC()
    qwen.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+"
                                   r"|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
                             behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    assert unicodedata.normalize("NFC", HELD_OUT) != HELD_OUT
    for name, text in SAMPLES.items():
        assert qwen.encode(text).ids != trained(text), name


@pytest.mark.parametrize("name", list(SAMPLES))
def test_mlx_mtp_load_encodes_as_in_training(name):
    text = SAMPLES[name]
    _, tok = mlx_mtp.load(demo.DEMO_DIR)
    assert tok.encode(text, add_special_tokens=False) == trained(text)
    assert tok.encode(text) == trained(text)  # no BOS / post-processor either
    assert tok.decode(trained(text)) == text


@pytest.mark.parametrize("trust_remote_code", [False, True])
def test_transformers_and_mlx_lm_load_encode_as_in_training(trust_remote_code):
    tok = AutoTokenizer.from_pretrained(demo.DEMO_DIR, trust_remote_code=trust_remote_code)
    wrapped = load_tokenizer(demo.DEMO_DIR)  # mlx_lm.utils.load_tokenizer, as mlx_lm.load does
    for name, text in SAMPLES.items():
        assert tok.encode(text) == trained(text), name
        assert wrapped.encode(text) == trained(text), name
    assert tok.eos_token == "<|endoftext|>" and tok.bos_token is None


def test_the_cli_default_prompt_encodes_as_in_training():
    _, tok = mlx_mtp.load(demo.DEMO_DIR)
    prompt = prepare_prompt(tok, DEFAULT_PROMPT, ignore_chat_template=False)
    assert encode_prompt(tok, prompt).tolist() == trained(DEFAULT_PROMPT)
