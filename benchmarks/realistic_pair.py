"""A random-weight pair of realistic size whose drafter accepts like a published MTP head.

    python -m benchmarks.realistic_pair OUT [--family qwen3_5|qwen3_next|gemma4] [--moe]
        [--hidden 1024 --layers 12 --vocab 131072]
        [--first-draft-acceptance 0.9 | --residual-scale C]

``--family qwen3_5`` (default) and ``qwen3_next`` write one folder, the target with its ``mtp.*``
head (``benchmarks.realistic_qwen``); ``--family gemma4`` writes ``OUT/target`` and
``OUT/assistant`` (``benchmarks.realistic_gemma4``; run it as ``--model OUT/target --drafter
OUT/assistant``). ``--moe`` (always for qwen3_next): the family's mixture-of-experts layout,
routed as the published models (``benchmarks.realistic_moe``).

The demo pair is small enough that a round measures per-call overhead, and its greedy text loops,
which every draft predicts. This pair is the other side: a target of realistic, memory-bound size
(by default Qwen3.5-0.8B's layer shapes at 12 layers, an untied 128k-id LM head: about 2.1 GB in
float32) whose text does not repeat, with a head whose acceptance is set to match real MTP heads
(vLLM's counters for Qwen3.6's head: 92.6 / 84.2 / 72.7 / 68.9 % at positions 1-4, about 0.9
per draft given the drafts before it).

How the head is made to agree. Every residual branch of the target (attention, GatedDeltaNet and
MLP outputs) is scaled by C, so the last hidden state is the current token's embedding plus a
context-dependent perturbation of size about C: the target mostly maps token x to
f(x) = argmax(lm_head . norm(embed(x))), a fixed random function of x, and the context changes
its choice where the perturbation flips that argmax. The head is wired to compute f exactly
(``fc`` = [I | 0] keeps the drafted token's embedding, its layer adds nothing, it borrows the
target's LM head), so a draft is accepted when the target's context does not flip its choice:
C sets the acceptance, about the same at every depth, so the per-position (cumulative) rates fall
as p, p^2, ... With ``--first-draft-acceptance`` the script finds C by bisection, measuring each
candidate's first-draft acceptance with mlx_mtp itself (block size 2, greedy, three prompts).

Why the text does not repeat: f is a random function of 128k ids, whose orbits run hundreds of
steps before they cycle, and the context's flips move the text off an orbit. The records report
each output's share of distinct 4-grams, so this is checked, not assumed.

This pair's text uses every id about equally often. ``--zipf S`` (Qwen3.5 only) gives it real
token statistics instead: ids chosen about rank^-S as often, the next token a function of the
last three (``benchmarks.realistic_zipf`` says how, and writes draft vocabularies for it).

The tokenizer is the demo pair's byte-level BPE (8k ids) extended with decode-only ids up to the
vocabulary size, so prompts are text and outputs decode (mostly to ``<x123>``-style ids).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import mlx_mtp  # noqa: F401  (before mlx.core: binds the system BLAS)
import mlx.core as mx

from benchmarks import common, realistic_gemma4, realistic_moe, realistic_qwen
from mlx_mtp.demo import demo_path

CALIBRATION_PROMPTS = ("def parse(line):\n    ", "The river rose in the night and ",
                       "1. apples\n2. pears\n3. ")
CALIBRATION_TOKENS = 64


def write_tokenizer(out: Path, vocab: int) -> None:
    """The demo pair's tokenizer with decode-only ids ``<xN>`` up to ``vocab``."""
    src = demo_path()
    tok = json.loads((src / "tokenizer.json").read_text())
    ids = tok["model"]["vocab"]
    taken = set(ids.values()) | {t["id"] for t in tok.get("added_tokens", [])}
    for i in range(max(taken) + 1, vocab):
        ids[f"<x{i}>"] = i
    (out / "tokenizer.json").write_text(json.dumps(tok))
    for name in ("tokenizer_config.json", "tokenization_demo_pair.py"):
        shutil.copy(src / name, out / name)


def folders(out: Path, family: str):
    """(target folder, drafter folder or None) of a pair written to ``out``."""
    if family == "gemma4":
        return out / "target", out / "assistant"
    return out, None


def write_pair(out: Path, a, scale: float) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    if a.family == "gemma4":
        weights = realistic_gemma4.write(out, a, scale)
    else:
        weights = realistic_qwen.Weights(a, scale).build()
        (out / "config.json").write_text(json.dumps(realistic_qwen.config(a), indent=1))
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    write_tokenizer(folders(out, a.family)[0], a.vocab)
    n = sum(v.size for v in weights.values())
    info = {"family": a.family, "residual_scale": scale, "seed": a.seed, "parameters": n,
            "zipf": a.zipf, "dtype": a.dtype, "command": common.command_line()}
    if a.moe:
        info["moe"] = {"experts": a.experts, "top_k": a.top_k, "expert_width": a.expert_width,
                       "shared_width": a.shared_width, "router_locality": a.router_locality}
    (out / "realistic_pair.json").write_text(json.dumps(info, indent=1))
    return out


def first_draft_acceptance(out: Path, family: str) -> float:
    """Drafts kept over drafts made at block size 2 (one draft a round), greedy, EOS ignored,
    on the pair written to ``out``."""
    target, drafter = folders(out, family)
    model, tokenizer = mlx_mtp.load(str(target), drafter=drafter and str(drafter))
    got = acceptance_of(model, tokenizer)
    del model
    mx.clear_cache()
    return got


def acceptance_of(model, tokenizer) -> float:
    from mlx_mtp.decoding.stats import RunStats
    from mlx_mtp.decoding.responses import encode_prompt

    drafted = accepted = 0
    for prompt in CALIBRATION_PROMPTS:
        stats = RunStats()
        steps = mlx_mtp.generate_step(encode_prompt(tokenizer, prompt), model,
                                      max_tokens=CALIBRATION_TOKENS, block_size=2, stats=stats)
        for _ in steps:
            pass
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    return accepted / max(drafted, 1)


def _measure(out: Path, a):
    """``scale -> first-draft acceptance``. Qwen3.5: the scale is in every branch's output
    weights, so each candidate is written and loaded. Gemma 4: it is only the post-branch norms'
    weight, so the pair is written once and the candidates are set on the loaded target."""
    if a.family != "gemma4":
        def measure(scale):
            write_pair(out, a, scale)
            return first_draft_acceptance(out, a.family)
        return measure
    write_pair(out, a, 1.0)
    target, drafter = folders(out, a.family)
    model, tokenizer = mlx_mtp.load(str(target), drafter=str(drafter))

    def measure(scale):
        realistic_gemma4.set_scale(model.mlx_model, scale)
        return acceptance_of(model, tokenizer)
    return measure


def calibrate(out: Path, a) -> float:
    """The residual scale whose first-draft acceptance is nearest ``a.first_draft_acceptance``:
    bisection on log C (acceptance falls as C grows)."""
    lo, hi = math.log(1e-3), math.log(1.0)
    best = None
    measure = _measure(out, a)
    for step in range(a.calibration_steps):
        scale = math.exp((lo + hi) / 2)
        got = measure(scale)
        print(f"calibration {step + 1}/{a.calibration_steps}: residual scale {scale:.4g} -> "
              f"first-draft acceptance {got:.3f}", flush=True)
        if best is None or abs(got - a.first_draft_acceptance) < abs(best[1] -
                                                                     a.first_draft_acceptance):
            best = (scale, got)
        if got > a.first_draft_acceptance:
            lo = math.log(scale)
        else:
            hi = math.log(scale)
    return best[0]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.realistic_pair", description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path, help="folder to write (raw Hugging Face layout)")
    p.add_argument("--family", choices=("qwen3_5", "qwen3_next", "gemma4"), default="qwen3_5",
                   help="qwen3_5: a target with its MTP head (default); qwen3_next: the same in "
                        "Qwen3-Next's layout (always MoE); gemma4: a target and an assistant")
    p.add_argument("--moe", action="store_true",
                   help="the family's mixture-of-experts layout (Qwen3.5/3.6-35B-A3B, Gemma 4 "
                        "26B-A4B), routed as published (benchmarks.realistic_moe)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=None,
                   help="default 12; with MoE 8 (Qwen) or 12 (Gemma 4)")
    p.add_argument("--vocab", type=int, default=None, help="default 131072; with MoE 32768")
    p.add_argument("--intermediate", type=int, default=None,
                   help="the dense MLP's width: default 3584; Gemma 4 with MoE 768")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--linear-key-heads", type=int, default=16)
    p.add_argument("--linear-value-heads", type=int, default=16)
    p.add_argument("--linear-key-dim", type=int, default=128)
    p.add_argument("--linear-value-dim", type=int, default=128)
    p.add_argument("--sliding-window", type=int, default=512, help="gemma4 only")
    moe = p.add_argument_group("mixture of experts (defaults: the family's, realistic_moe.SHAPES)")
    moe.add_argument("--experts", type=int, default=None)
    moe.add_argument("--top-k", type=int, default=None)
    moe.add_argument("--expert-width", type=int, default=None)
    moe.add_argument("--shared-width", type=int, default=None, help="Qwen only")
    moe.add_argument("--router-locality", type=float, default=realistic_moe.LOCALITY,
                     help="the topic's share of the routers' logit variance, 0-1 (default "
                          f"{realistic_moe.LOCALITY}: 4 rows touch about 2.5x one row's experts)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="the checkpoint's dtype: default float32; with MoE bfloat16, as the real "
                        "checkpoints (mlx_mtp loads either as float32 on the CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--zipf", type=float, default=None, metavar="S",
                   help="qwen3_5 only: token frequencies that fall as rank^-S, as real text's do "
                        "(about 1), the next token depending on the last two "
                        "(benchmarks.realistic_zipf); default: every id about equally often")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--first-draft-acceptance", type=float, default=0.9,
                     help="find the residual scale that gives this first-draft acceptance "
                          "(default 0.9)")
    how.add_argument("--residual-scale", type=float, default=None,
                     help="use this residual scale (no calibration)")
    p.add_argument("--calibration-steps", type=int, default=7)
    return resolve(p.parse_args(argv))


MOE_FLAGS = ("experts", "top_k", "expert_width", "shared_width")


def resolve(a):
    """The defaults that depend on the family and on MoE; bad combinations exit with one line."""
    a.moe = a.moe or a.family == "qwen3_next"
    given = [f for f in MOE_FLAGS if getattr(a, f) is not None]
    if given and not a.moe:
        sys.exit(f"error: --{given[0].replace('_', '-')} needs --moe (or --family qwen3_next)")
    if not 0.0 <= a.router_locality <= 1.0:
        sys.exit(f"error: --router-locality must be between 0 and 1, got {a.router_locality}")
    shape = realistic_moe.SHAPES[a.family] if a.moe else {}
    for f in MOE_FLAGS:
        if getattr(a, f) is None:
            setattr(a, f, shape.get(f))
    a.layers = a.layers or shape.get("layers", 12)
    a.vocab = a.vocab or shape.get("vocab", 131072)
    a.intermediate = a.intermediate or shape.get("intermediate", 3584)
    a.dtype = a.dtype or ("bfloat16" if a.moe else "float32")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.vocab < 8192:
        sys.exit("error: --vocab must be at least 8192 (the demo tokenizer's ids)")
    if a.zipf is not None and (a.family != "qwen3_5" or a.moe or a.zipf <= 0 or a.layers < 8):
        sys.exit("error: --zipf takes an exponent > 0, with --family qwen3_5 (dense) and --layers "
                 "of at least 8 (it rewrites the first two full-attention layers)")
    if a.moe and a.hidden <= realistic_moe.TOPIC_DIMS:
        sys.exit(f"error: --hidden must exceed {realistic_moe.TOPIC_DIMS} with MoE (the topics' "
                 "coordinates)")
    t0 = time.perf_counter()
    scale = a.residual_scale if a.residual_scale is not None else calibrate(a.out, a)
    write_pair(a.out, a, scale)
    got = first_draft_acceptance(a.out, a.family)
    print(f"wrote {a.out}: residual scale {scale:.4g}, first-draft acceptance {got:.3f} "
          f"({time.perf_counter() - t0:.0f} s)")
    info = json.loads((a.out / "realistic_pair.json").read_text())
    info["first_draft_acceptance"] = got
    (a.out / "realistic_pair.json").write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
