"""The embedded demo pair: what ``python -m mlx_mtp.generate`` runs without ``--model``.

A small Qwen3.5-architecture target (16 layers, hidden 256, GatedDeltaNet + gated full attention, 8k
BPE vocabulary) and its trained MTP head, stored as a raw Hugging Face checkpoint folder in the
package and loaded through the same code path as any real checkpoint. Trained on the Python standard
library's sources by ``tools/demo_pair/`` (its model card: ``mlx_mtp/demo_pair/README.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mlx_lm.sample_utils import make_logits_processors

from mlx_mtp.errors import MTPError

DEMO_DIR = Path(__file__).resolve().parent / "demo_pair"


@dataclass(frozen=True)
class DemoDecode:
    """The decode settings the CLIs and the server use for the demo pair unless told otherwise.
    The pair is small (12.7M parameters): its plain greedy text falls into loops within a few
    dozen tokens, which every draft then predicts. mlx-lm's repetition penalty keeps its text
    from looping (its share of distinct 4-token n-grams from about 0.1 to above 0.8 on code
    prompts), so that what the demo shows, and what its benchmarks measure, is text that reads as
    code. MTP applies the same logits processors as plain decode: T=0 output stays identical.

    The Python API does not apply them by itself: with the same arguments it decodes as mlx-lm
    does, so the demo's settings are passed like any others (``generation_kwargs``)."""

    repetition_penalty: float = 1.3
    repetition_context_size: int = 48

    def generation_kwargs(self) -> dict:
        """The keyword arguments that give ``generate`` / ``stream_generate`` /
        ``generate_step`` (mlx_mtp's or mlx-lm's) the demo's decode: ``logits_processors`` with
        mlx-lm's repetition penalty."""
        return {"logits_processors": make_logits_processors(
            repetition_penalty=self.repetition_penalty,
            repetition_context_size=self.repetition_context_size)}


DEMO_DECODE = DemoDecode()
REPETITION_CONTEXT_SIZE = 20  # mlx-lm's default


def repetition_settings(model, penalty, context):
    """``(penalty or None, context)`` for a CLI run or a server's request defaults: the ones
    given; for the demo pair (no ``model``) with no penalty given, the demo's (``DEMO_DECODE``);
    else no penalty and mlx-lm's context size."""
    if model is None and penalty is None:
        penalty = DEMO_DECODE.repetition_penalty
        context = DEMO_DECODE.repetition_context_size if context is None else context
    return penalty, REPETITION_CONTEXT_SIZE if context is None else context
DEMO_MODEL_ID = "mlx_mtp-demo-pair"  # what the server calls the demo pair
DEMO_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def demo_path() -> Path:
    missing = [f for f in DEMO_FILES if not (DEMO_DIR / f).is_file()]
    if missing:
        raise MTPError(f"{DEMO_DIR}: the embedded demo pair is incomplete (missing "
                       f"{', '.join(missing)}); reinstall mlx-mtp or pass --model")
    return DEMO_DIR


def model_or_demo(model, drafter=None) -> str:
    """The ``--model`` a CLI runs: the one given, or the embedded demo pair when none is."""
    if model is not None:
        return str(model)
    if drafter is not None:
        raise MTPError("--drafter needs --model: the embedded demo pair has its own head")
    return str(demo_path())
