"""A random-weight pair of realistic size whose drafter accepts like a published MTP head.

    python -m benchmarks.realistic_pair OUT [--family qwen3_5|gemma4] [--hidden 1024 --layers 12
        --vocab 131072] [--first-draft-acceptance 0.9 | --residual-scale C]

``--family qwen3_5`` (default) writes one folder, the target with its ``mtp.*`` head;
``--family gemma4`` writes ``OUT/target`` and ``OUT/assistant`` (see ``benchmarks.realistic_gemma4``;
run it as ``--model OUT/target --drafter OUT/assistant``).

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
from typing import Dict

import mlx_mtp  # noqa: F401  (before mlx.core: binds the system BLAS)
import mlx.core as mx

from benchmarks import common, realistic_gemma4, realistic_zipf
from mlx_mtp.demo import demo_path

CALIBRATION_PROMPTS = ("def parse(line):\n    ", "The river rose in the night and ",
                       "1. apples\n2. pears\n3. ")
CALIBRATION_TOKENS = 64


def text_config(a) -> dict:
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                   for i in range(a.layers)]
    return {
        "model_type": "qwen3_5_text", "vocab_size": a.vocab, "hidden_size": a.hidden,
        "intermediate_size": a.intermediate, "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads, "head_dim": a.head_dim,
        "attn_output_gate": True, "attention_bias": False, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": a.linear_key_dim, "linear_value_head_dim": a.linear_value_dim,
        "linear_num_key_heads": a.linear_key_heads, "linear_num_value_heads": a.linear_value_heads,
        "full_attention_interval": 4, "layer_types": layer_types, "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False, "tie_word_embeddings": False,
        "mamba_ssm_dtype": "float32",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                            "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                            "mrope_section": [11, 11, 10]},
    }


class _Weights:
    """Random float32 tensors in the raw Hugging Face layout, from one seed."""

    def __init__(self, a, scale: float):
        self.a, self.c = a, scale
        self.key = mx.random.key(a.seed)
        self.w: Dict[str, mx.array] = {}

    def normal(self, shape, std):
        self.key, k = mx.random.split(self.key)
        return mx.random.normal(shape, key=k) * std

    def linear(self, name, out_features, in_features, mult=1.0):
        self.w[name] = self.normal((out_features, in_features), mult / math.sqrt(in_features))

    def zeros(self, name, n):  # a zero-centred norm's stored weight: gamma 1
        self.w[name] = mx.zeros((n,))

    def attention(self, p, out_mult):
        a = self.a
        self.linear(p + "self_attn.q_proj.weight", 2 * a.heads * a.head_dim, a.hidden)
        self.linear(p + "self_attn.k_proj.weight", a.kv_heads * a.head_dim, a.hidden)
        self.linear(p + "self_attn.v_proj.weight", a.kv_heads * a.head_dim, a.hidden)
        self.linear(p + "self_attn.o_proj.weight", a.hidden, a.heads * a.head_dim, out_mult)
        self.zeros(p + "self_attn.q_norm.weight", a.head_dim)
        self.zeros(p + "self_attn.k_norm.weight", a.head_dim)

    def gated_delta_net(self, p):
        a = self.a
        kd, vd = a.linear_key_heads * a.linear_key_dim, a.linear_value_heads * a.linear_value_dim
        self.linear(p + "linear_attn.in_proj_qkv.weight", 2 * kd + vd, a.hidden)
        self.linear(p + "linear_attn.in_proj_z.weight", vd, a.hidden)
        self.linear(p + "linear_attn.in_proj_b.weight", a.linear_value_heads, a.hidden)
        self.linear(p + "linear_attn.in_proj_a.weight", a.linear_value_heads, a.hidden)
        self.w[p + "linear_attn.conv1d.weight"] = self.normal((2 * kd + vd, 1, 4), 0.3)
        self.key, k = mx.random.split(self.key)
        self.w[p + "linear_attn.A_log"] = mx.log(
            mx.random.uniform(1, 16, (a.linear_value_heads,), key=k))
        self.w[p + "linear_attn.dt_bias"] = mx.ones((a.linear_value_heads,))
        self.w[p + "linear_attn.norm.weight"] = mx.ones((a.linear_value_dim,))
        self.linear(p + "linear_attn.out_proj.weight", a.hidden, vd, self.c)

    def mlp(self, p, out_mult):
        a = self.a
        self.linear(p + "mlp.gate_proj.weight", a.intermediate, a.hidden)
        self.linear(p + "mlp.up_proj.weight", a.intermediate, a.hidden)
        self.linear(p + "mlp.down_proj.weight", a.hidden, a.intermediate, out_mult)

    def build(self, layer_types) -> Dict[str, mx.array]:
        a, c = self.a, self.c
        self.w["model.language_model.embed_tokens.weight"] = self.normal((a.vocab, a.hidden), 1.0)
        for i, kind in enumerate(layer_types):
            p = f"model.language_model.layers.{i}."
            self.zeros(p + "input_layernorm.weight", a.hidden)
            self.zeros(p + "post_attention_layernorm.weight", a.hidden)
            if kind == "full_attention":
                self.attention(p, c)
            else:
                self.gated_delta_net(p)
            self.mlp(p, c)
            mx.eval(self.w)
        self.zeros("model.language_model.norm.weight", a.hidden)
        self.linear("lm_head.weight", a.vocab, a.hidden)
        # The head computes f(x): fc keeps the drafted token's embedding, its layer adds nothing.
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            self.zeros(f"mtp.{n}.weight", a.hidden)
        self.w["mtp.fc.weight"] = mx.concatenate(
            [mx.eye(a.hidden), mx.zeros((a.hidden, a.hidden))], axis=1)
        p = "mtp.layers.0."
        self.zeros(p + "input_layernorm.weight", a.hidden)
        self.zeros(p + "post_attention_layernorm.weight", a.hidden)
        self.attention(p, 0.0)
        self.mlp(p, 0.0)
        mx.eval(self.w)
        if a.zipf is not None:
            self.key, k = mx.random.split(self.key)
            realistic_zipf.apply(self.w, a, layer_types, a.zipf, k)
        return self.w


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
        text = text_config(a)
        weights = _Weights(a, scale).build(text["layer_types"])
        config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                  "tie_word_embeddings": False, "eos_token_id": 0, "text_config": text}
        (out / "config.json").write_text(json.dumps(config, indent=1))
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    write_tokenizer(folders(out, a.family)[0], a.vocab)
    n = sum(v.size for v in weights.values())
    (out / "realistic_pair.json").write_text(json.dumps(
        {"family": a.family, "residual_scale": scale, "seed": a.seed, "parameters": n,
         "zipf": a.zipf,
         "command": common.command_line()}, indent=1))
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
    from mlx_mtp.generate import encode_prompt

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
    p.add_argument("--family", choices=("qwen3_5", "gemma4"), default="qwen3_5",
                   help="qwen3_5: a target with its MTP head (default); gemma4: a target and an "
                        "assistant")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=131072)
    p.add_argument("--intermediate", type=int, default=3584)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--linear-key-heads", type=int, default=16)
    p.add_argument("--linear-value-heads", type=int, default=16)
    p.add_argument("--linear-key-dim", type=int, default=128)
    p.add_argument("--linear-value-dim", type=int, default=128)
    p.add_argument("--sliding-window", type=int, default=512, help="gemma4 only")
    p.add_argument("--assistant-intermediate", type=int, default=2048, help="gemma4 only")
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
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.vocab < 8192:
        sys.exit("error: --vocab must be at least 8192 (the demo tokenizer's ids)")
    if a.zipf is not None and (a.family != "qwen3_5" or a.zipf <= 0 or a.layers < 8):
        sys.exit("error: --zipf takes an exponent > 0, with --family qwen3_5 and --layers of at "
                 "least 8 (it rewrites the first two full-attention layers)")
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
