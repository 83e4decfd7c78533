"""The fenced code blocks of the repository's Markdown files, for tests that run the documented
examples as a reader copies them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[2]


def code_blocks(doc: str, lang: str) -> List[str]:
    """The ```lang blocks of ``doc`` (a path relative to the repository root), in order."""
    text = (ROOT / doc).read_text()
    return re.findall(rf"^```{re.escape(lang)}\n(.*?)^```$", text, flags=re.S | re.M)


def the_block(doc: str, lang: str, containing: str) -> str:
    """The one ```lang block of ``doc`` that contains ``containing``."""
    found = [b for b in code_blocks(doc, lang) if containing in b]
    assert len(found) == 1, f"{doc}: {len(found)} {lang} blocks contain {containing!r}"
    return found[0]


# Words that mark Python source rather than prose (English has "if", "for", "in", "not" too).
CODE_WORDS = {"self", "def", "return", "None", "True", "False", "elif", "raise", "import",
              "lambda", "isinstance", "len", "args", "kwargs", "cls", "except"}


def code_signs(text: str) -> list:
    """What makes ``text`` read as Python: the code words it uses, a call, an attribute."""
    signs = sorted(set(re.findall(r"[A-Za-z_]\w*", text)) & CODE_WORDS)
    if re.search(r"\w\(.*\)", text):
        signs.append("a call")
    if re.search(r"[A-Za-z_]\w*\.[A-Za-z_]\w*", text):
        signs.append("an attribute")
    return signs


def assert_code_like(text: str) -> None:
    signs = code_signs(text)
    assert len(signs) >= 3, f"not code-like ({signs}): {text!r}"
