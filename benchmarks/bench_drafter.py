"""Ablation of the drafter optimizations: all phases on, then each one off.

Same protocol as ``benchmarks.bench_mtp`` (docs/benchmarks.md): every arm runs on the same
target in one process, alternating order pair by pair, each arm warmed up once, a fixed token
budget with EOS ignored, several prompts, temperature 0, medians and min-max of per-pair ratios.
Arms, all at one block size (default 3):
  classic     mlx-lm's plain decode of the target
  all         every phase on: device ids (1), fused argmax (2a), draft vocabulary (2b), 4-bit head (3),
              compiled head step (5)
  -p1 ... -p5 all phases but one
  default     the shipping defaults (``DraftOptions()``, with the draft vocabulary the pair ships
              in its ``mtp/draft_vocab/``, if any)
  default+4bit, default+8bit   the defaults with the head quantized (``--bits 4`` / ``8``): what
              a quantized head does on top of what ships
  default+bf16  the defaults with the step's products on bfloat16 weights (``DraftOptions(bf16=True)``,
              the bf16 kernel)
  all+prof, default+prof   the same with MLX_MTP_DRAFT_PROFILE=1: the per-stage split (its syncs
              slow the step; the record quotes the unprofiled arms as the cost)
Every MTP arm waits for each phase (MLX_MTP_SYNC_PHASES=1) so the phases time their own work.
Per arm: tok/s, the drafter step (draft phase / steps) and accept hook against their bandwidth
floors (weight bytes they read / the streaming bandwidth measured in the same run), the round
split, acceptance; per prompt, the share of distinct 4-grams of the plain output. Writes
benchmark_results/<topic>-<host>-<date>.md and .json.

Without ``--model`` it first builds a random-weight qwen3_5 pair of realistic proportions (speed
does not depend on training; acceptance does, and a random head accepts nothing). With a trained
pair the same command reports the acceptance of each arm, which is the A/B phases 2b and 3 need:

    python -m benchmarks.bench_drafter                                   # random pair, built here
    python -m benchmarks.bench_drafter --model PAIR --corpus FILES       # a trained pair
    python -m benchmarks.bench_drafter --render RECORD.json              # redraw the pictures
    python -m benchmarks.bench_drafter --render RECORD.json --summary "..."   # and rewrite the .md

Beside the record's .md and .json it draws (``benchmarks.plots``, needs the ``bench`` extra)
the drafter step and accept hook per arm against their floor, and the round split per arm.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sysconfig
import time
from pathlib import Path

import mlx_mtp  # first: binds the system BLAS before mlx.core loads

from benchmarks import common
from mlx_mtp.models.qwen3_5 import vocab_reduction as draft_vocab
from mlx_mtp.decoding.rounds import SYNC_PHASES_ENV
from mlx_mtp.decoding.stats import PHASES as ROUND_PHASES
from mlx_mtp.decoding.responses import encode_prompt
from mlx_mtp.models.draft_profile import ACCEPT_STAGES, PROFILE_ENV, STAGES
from mlx_mtp.models.model import MTPModel
from mlx_mtp.models.options import DraftOptions
from mlx_mtp.models.qwen3_5.drafter import MTPHead, QwenMTPDrafter
from mlx_mtp.models.qwen3_5.head_quantization import quantize_head
from mlx_mtp.models.qwen3_5.loading import EMBEDDED_DRAFT_VOCAB

PHASES = {  # phase -> (DraftOptions field, value when on, value when off)
    "p1": ("device_ids", True, False),
    "p2a": ("fused_argmax", True, False),
    "p2b": ("vocab", True, False),
    "p3": ("bits", 4, None),
    "p5": ("compiled", True, False),
}
PHASE_NAMES = {"p1": "1 ids on device", "p2a": "2a fused LM head + argmax",
               "p2b": "2b reduced draft vocabulary", "p3": "3 4-bit head",
               "p5": "5 compiled step (lookup + head + LM head + argmax)"}
# The random pair: Qwen3.5-0.8B's proportions (3 GatedDeltaNet layers per full-attention layer,
# head_dim 128 with partial rotary 0.25, GDN key/value width 2x hidden, SwiGLU 3x), at hidden 512
# so a full ablation fits ~10 minutes on 2 cores (at hidden > 512 BLIS makes every verify layer
# row-exact, which triples the verify and the run time).
RANDOM_PAIR = dict(hidden=512, layers=12, vocab=32768, text_overrides=dict(
    intermediate_size=1536, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=8,
    linear_num_value_heads=8, full_attention_interval=4,
    layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(12)],
    rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                     "mrope_interleaved": True, "mrope_section": [6, 5, 5]}))


# ------------------------------------------------------------------------------ the pair


def stdlib_corpus(out: Path, mb: float) -> Path:
    """A calibration text from this Python's own standard library sources (code and prose)."""
    f = out / "corpus.txt"
    if f.exists():
        return f
    lib = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for p in sorted(lib.glob("*.py")):
        text = p.read_text(encoding="utf-8", errors="ignore")
        parts.append(text)
        size += len(text)
        if size > mb * 1e6:
            break
    f.write_text("\n\n".join(parts))
    return f


def build_random_pair(out: Path) -> tuple:
    from benchmarks import random_checkpoints as tc

    corpus = stdlib_corpus(out, mb=4)
    pair = out / "pair"
    if not (pair / "config.json").exists():
        t0 = time.perf_counter()
        text = corpus.read_text()
        chunks = [text[i:i + 4096] for i in range(0, len(text), 4096)]
        tc.write_raw_hf(pair, seed=0, tokenizer_corpus=chunks, **RANDOM_PAIR)
        print(f"built the random pair in {time.perf_counter() - t0:.0f} s", flush=True)
    return pair, [corpus]


# ------------------------------------------------------------------------------ the arms


def quantized_copy(head: MTPHead, args, bits: int, group_size: int) -> MTPHead:
    q = MTPHead(args, num_layers=len(head.layers))
    q.update(head.parameters())
    quantize_head(q, bits=bits, group_size=group_size)
    return q


HEAD_BITS = (4, 8)  # the default+Nbit arms


def arm_options(off: str = None, profiled: bool = False, default: bool = False,
                bits: int = None, bf16: bool = False) -> dict:
    """An arm's switches; ``vocab``: True (the ablation's draft vocabulary), False (the full
    head) or ``"shipped"`` (the default arm: what the pair loads with, its own sidecar or none).
    ``bits``: the default arm with its head quantized; ``bf16``: with its products on bfloat16
    weights."""
    if default:
        opts = {"device_ids": DraftOptions().device_ids, "fused_argmax": DraftOptions().fused_argmax,
                "vocab": "shipped", "bits": bits or DraftOptions().bits,
                "compiled": DraftOptions().compiled, "bf16": bf16 or DraftOptions().bf16}
    else:
        opts = {field: on for field, on, _ in PHASES.values()}
        opts["bf16"] = False
        if off:
            field, _, value = PHASES[off]
            opts[field] = value
    return {**opts, "profiled": profiled}


def make_arms(base, vocab_ids, group_size: int, shipped_ids=None) -> dict:
    heads = {None: base.drafter.head, **{b: quantized_copy(base.drafter.head, base.target.args,
                                                           b, group_size) for b in HEAD_BITS}}
    specs = {"all": arm_options(), **{f"-{p}": arm_options(off=p) for p in PHASES},
             "default": arm_options(default=True),
             **{f"default+{b}bit": arm_options(default=True, bits=b) for b in HEAD_BITS},
             "default+bf16": arm_options(default=True, bf16=True),
             "all+prof": arm_options(profiled=True), "default+prof": arm_options(default=True,
                                                                                  profiled=True)}
    arms = {}
    for name, o in specs.items():
        options = DraftOptions(device_ids=o["device_ids"], fused_argmax=o["fused_argmax"],
                               bits=o["bits"], group_size=group_size, compiled=o["compiled"],
                               bf16=o["bf16"])
        ids = shipped_ids if o["vocab"] == "shipped" else vocab_ids if o["vocab"] else None
        drafter = QwenMTPDrafter(heads[o["bits"]], base.target, options, ids)
        arms[name] = (MTPModel(base.mlx_model, base.target, drafter), o)
    return arms


def run_arm(model, prompt, n, block_size, profiled: bool):
    # The drafter step and accept hook are timed as phases: each must wait for its own device
    # work (by default the round queues them and the verify waits).
    os.environ[PROFILE_ENV] = "1" if profiled else "0"
    os.environ[SYNC_PHASES_ENV] = "1"
    try:
        return common.mtp_decode(model, prompt, n, block_size)
    finally:
        os.environ.pop(PROFILE_ENV, None)
        os.environ.pop(SYNC_PHASES_ENV, None)


# ------------------------------------------------------------------------------ the run


def run(args) -> dict:
    base, tokenizer = mlx_mtp.load(args.model)
    vocab_ids, vocab_meta = None, None
    shipped = base.drafter.lm.ids  # the pair's own sidecar (mtp/draft_vocab/), loaded by default
    if args.draft_vocab:
        vocab_ids = draft_vocab.load_ids(args.draft_vocab, tokenizer, base.target)
        vocab_meta = json.loads((Path(args.draft_vocab) / draft_vocab.META_FILE).read_text())
    elif args.corpus:
        out = args.work / "draft_vocab"
        vocab_meta = draft_vocab.build(base, tokenizer, size=args.draft_vocab_size,
                                       corpus=args.corpus, out=out)
        vocab_ids = draft_vocab.load_ids(out, tokenizer, base.target)
    elif shipped is not None:
        vocab_ids = shipped
        vocab_meta = json.loads((Path(base.path) / EMBEDDED_DRAFT_VOCAB /
                                 draft_vocab.META_FILE).read_text())
    if vocab_ids is None:
        raise SystemExit("error: phase 2b needs a draft vocabulary: --draft-vocab DIR, --corpus "
                         "FILES, or a pair that ships one (mtp/draft_vocab/)")
    arms = make_arms(base, vocab_ids, args.group_size, shipped)
    prompts = {k: encode_prompt(tokenizer, v) for k, v in args.prompts.items()}
    n, bs = args.max_tokens, args.block_size
    warm = next(iter(prompts.values()))
    common.plain_decode(base.mlx_model, warm, 8)
    for name, (model, o) in arms.items():
        run_arm(model, warm, 8, bs, o["profiled"])

    raw = {name: [] for name in ["classic", *arms]}
    for pair in range(args.pairs):
        for pname, prompt in prompts.items():
            order = ["classic", *arms]
            if pair % 2:
                order.reverse()
            results = {}
            for name in order:
                if name == "classic":
                    toks, ps, gs = common.plain_decode(base.mlx_model, prompt, n)
                    results[name] = {"tokens": toks, "gen_s": gs}
                else:
                    model, o = arms[name]
                    toks, ps, gs, st = run_arm(model, prompt, n, bs, o["profiled"])
                    results[name] = {"tokens": toks, "gen_s": gs, "stats": st.to_dict()}
            for name, r in results.items():
                r["tps"] = (len(r["tokens"]) - 1) / r["gen_s"]
                r["identical_to_classic"] = r["tokens"] == results["classic"]["tokens"]
                r["distinct_4gram_share"] = common.distinct_ngram_share(r["tokens"])
                raw[name].append({"pair": pair, "prompt": pname,
                                  **{k: v for k, v in r.items() if k != "tokens"}})
            print(f"pair {pair} {pname}: " + ", ".join(
                f"{a} {results[a]['tps']:.2f}" for a in ["classic", *arms]), flush=True)
    bw = common.bandwidth_gbs()
    return summarize(args, base, arms, raw, bw, vocab_meta)


def floors(base, drafter, bw: float) -> dict:
    """Weight bytes one drafter step reads (the head + the rows of the LM head it projects);
    with ``bf16`` the head's matrices are read as bfloat16 copies (its norms as they are)."""
    head = common.nbytes(drafter.head)
    if drafter.bf16:
        from mlx.utils import tree_flatten

        head = sum(v.size * 2 if v.ndim == 2 else v.nbytes
                   for _, v in tree_flatten(drafter.head.parameters()))
    lm = drafter.lm.tensors.nbytes
    return {"head_bytes": head, "lm_head_bytes": lm, "step_bytes": head + lm,
            "step_floor_ms": (head + lm) / bw / 1e6}


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(args, base, arms, raw, bw, vocab_meta) -> dict:
    classic = {(r["pair"], r["prompt"]): r for r in raw["classic"]}
    all_on = {(r["pair"], r["prompt"]): r for r in raw["all"]}
    rows = []
    for name, (model, o) in arms.items():
        runs = raw[name]
        st = [r["stats"] for r in runs]
        rounds = sum(s["rounds"] for s in st)
        split = {p: sum(s["phase_ms"][p] for s in st) / max(rounds, 1)
                 for p in ROUND_PHASES}
        profs = [s["draft_profile"] for s in st]
        drafted = sum(s["drafted"] for s in st)
        row = {
            "arm": name, "options": o, "draft": model.drafter.describe(),
            "tps": statistics.median(r["tps"] for r in runs),
            "vs_classic": [r["tps"] / classic[(r["pair"], r["prompt"])]["tps"] for r in runs],
            "vs_all": [r["tps"] / all_on[(r["pair"], r["prompt"])]["tps"] for r in runs],
            "identical_to_classic": all(r["identical_to_classic"] for r in runs),
            "mtp_enabled": all(s["mtp_enabled"] for s in st),
            "acceptance": sum(s["accepted"] for s in st) / drafted if drafted else 0.0,
            "tokens_per_round": sum(s["accepted"] + s["rounds"] for s in st) / max(rounds, 1),
            "round_ms": split,
            "step_ms": _median(p["step_ms"] for p in profs),
            "phase_step_ms": _median(p["phase_step_ms"] for p in profs),
            "accept_ms": _median(p["accept"]["step_ms"] for p in profs),
            "draft_syncs_per_round": _median(s["draft_syncs_per_round"] for s in st),
            **floors(base, model.drafter, bw),
        }
        if o["profiled"]:
            row["stages_ms"] = {s: _median(p[f"{s}_ms"] for p in profs) for s in STAGES}
            row["accept_stages_ms"] = {s: _median(p["accept"][f"{s}_ms"] for p in profs)
                                       for s in ACCEPT_STAGES}
        rows.append(row)
    target_bytes = common.step_bytes(base)["target_step_bytes"]
    shares = {name: [r["distinct_4gram_share"] for r in raw["classic"] if r["prompt"] == name
                     and r.get("distinct_4gram_share") is not None] for name in args.prompts}
    return {
        **common.record_setup(args.topic),
        "model": str(args.model), "random_pair": args.random_pair,
        "pair_config": base.config.get("text_config", base.config),
        "target_dtype": str(base.target.dtype), "prompts": args.prompts,
        # per prompt, the median over the plain arm's runs (every exact arm emits that text)
        "distinct_4gram_share": {name: statistics.median(v) if v else None
                                 for name, v in shares.items()},
        "max_tokens": args.max_tokens, "pairs": args.pairs, "block_size": args.block_size,
        "temperature": 0.0, "group_size": args.group_size, "draft_vocab": vocab_meta,
        "exactness": raw["all"][0]["stats"]["exactness"], "gate_reason":
            raw["all"][0]["stats"]["gate_reason"],
        "bandwidth_gbs": bw, "target_step_bytes": target_bytes,
        "target_step_floor_ms": target_bytes / bw / 1e6,
        "classic_step_ms": statistics.median(1e3 / r["tps"] for r in raw["classic"]),
        "classic_tps": statistics.median(r["tps"] for r in raw["classic"]),
        "rows": rows, "raw": raw,
    }


# ------------------------------------------------------------------------------ the record


def _share_lines(r: dict) -> list:
    """The distinct 4-grams of each prompt's plain output (records from before the field: none)."""
    shares = r.get("distinct_4gram_share")
    if not shares:
        return []
    return ["- Distinct 4-grams of each prompt's plain output: " + ", ".join(
        f"{name} {'-' if v is None else f'{v:.2f}'}" for name, v in shares.items())]


def _rng(xs):
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def _ms(x, floor=None):
    if x is None:
        return "-"
    return f"{x:.2f}" + (f" ({x / floor:.1f}x)" if floor else "")


def _per_run(raw_arm):
    """{(pair, prompt): (drafter step ms, non-verify ms per round)} of an arm's runs."""
    out = {}
    for run in raw_arm:
        st = run["stats"]
        nonverify = sum(v for k, v in st["phase_ms"].items() if k != "verify")
        out[(run["pair"], run["prompt"])] = (st["draft_profile"]["step_ms"],
                                             nonverify / max(st["rounds"], 1))
    return out


def _word(ratios) -> str:
    if min(ratios) > 1:
        return "wins"
    if max(ratios) < 1:
        return "loses"
    return "null"


def _paired(raw, slow: str, fast: str) -> dict:
    """Arms ``slow`` and ``fast`` paired run by run: the drafter step and the non-verify time per
    round of ``slow`` over ``fast``, and the tok/s of ``fast`` over ``slow`` (> 1: ``fast`` is
    faster), with a verdict for each."""
    a, b = _per_run(raw[slow]), _per_run(raw[fast])
    keys = [k for k in b if k in a]
    step = [a[k][0] / b[k][0] for k in keys]
    nonverify = [a[k][1] / b[k][1] for k in keys]
    tps_fast = {(x["pair"], x["prompt"]): x["tps"] for x in raw[fast]}
    tps = [tps_fast[(x["pair"], x["prompt"])] / x["tps"] for x in raw[slow]]
    return {"step": step, "nonverify": nonverify, "tps": tps,
            "verdict": {"drafter step": _word(step), "non-verify": _word(nonverify),
                        "tok/s": _word(tps)}}


def verdicts(r) -> list:
    """Per phase, paired run by run: all-but-this-phase over all-on for the drafter step and for
    everything but the verify forward (per round), and tok/s all-on over all-but-this-phase; a
    verdict for each (the drafter step is what a phase changes directly; the other two carry
    the finalize and target verify's noise on top)."""
    return [{"phase": p, "name": PHASE_NAMES[p], **_paired(r["raw"], f"-{p}", "all")}
            for p in PHASES]


HEAD_ARMS = {f"default+{b}bit": f"{b}-bit" for b in HEAD_BITS} | {"default+bf16": "bf16 kernel"}


def head_bits(r) -> list:
    """Per quantized-head or bf16 arm, paired run by run against the default arm: the drafter
    step and the non-verify time (default's over this arm's: > 1 means the arm helps) and tok/s
    (this arm's over default's); a verdict for each. Records without the arms: none."""
    return [{"arm": arm, "head": label, **_paired(r["raw"], "default", arm)}
            for arm, label in HEAD_ARMS.items() if arm in r["raw"]]


def render(r: dict) -> str:
    c = r["pair_config"]
    rows = {row["arm"]: row for row in r["rows"]}
    vm = r["draft_vocab"] or {}
    lines = common.setup_lines(r, memory=True) + [
        f"- Pair: {'random weights, built by this script' if r['random_pair'] else r['model']}; "
        f"qwen3_5, hidden {c['hidden_size']}, {c['num_hidden_layers']} layers (full attention "
        f"every {c.get('full_attention_interval')}), intermediate {c['intermediate_size']}, "
        f"vocab {c['vocab_size']}, {'tied' if c.get('tie_word_embeddings') else 'untied'}, "
        f"{r['target_dtype']}; MTP head: one full-attention layer",
        f"- Draft vocabulary (2b): {vm.get('size')} of {vm.get('vocab_size')} ids, covering "
        f"{100 * vm.get('coverage', 0):.1f}% of {vm.get('corpus_tokens')} calibration tokens",
        f"- Quantized heads (phase 3 at 4 bits; default+4bit, default+8bit): affine, group "
        f"{r['group_size']}, fc unquantized"
        + ("; default+bf16: the step's products on bfloat16 copies of the head's and the draft "
           "LM head's weights (the bf16 kernel)" if "default+bf16" in r["raw"] else ""),
        f"- Prompts: {', '.join(r['prompts'])}; {r['max_tokens']} tokens each, EOS ignored, "
        f"T=0, block size {r['block_size']}; {r['pairs']} alternating pairs per prompt; every "
        "arm warmed up once",
        *_share_lines(r),
        f"- Exactness gate: verdict {r['exactness'].get('verdict')} ({r['gate_reason']}); "
        f"override {r['exactness'].get('override')}",
        "",
    ]
    if r["random_pair"]:
        lines += ["**Acceptance is not measured here.** The head has random weights and accepts "
                  "(almost) nothing, so every round verifies the full block and emits one token. "
                  "This record measures cost only; what phases 2b (draft vocabulary) and 3 (4-bit "
                  "head) do to acceptance is pending a trained pair (the same command with "
                  "`--model PAIR --corpus FILES`).", ""]
    lines += [
        "## Results (medians over pairs x prompts; ranges = min-max of per-pair ratios)", "",
        f"classic (mlx-lm plain decode): {r['classic_tps']:.2f} tok/s, "
        f"{r['classic_step_ms']:.1f} ms/token", "",
        "| arm | tok/s | vs all-on | vs classic | drafter step ms (x floor) | accept hook ms "
        "(x floor) | non-verify share | acceptance | draft syncs/round | identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        rm = row["round_ms"]
        tot = sum(rm.values()) or 1.0
        lines.append(
            f"| {row['arm']} | {row['tps']:.2f} | {_rng(row['vs_all'])} | {_rng(row['vs_classic'])} "
            f"| {_ms(row['step_ms'], row['step_floor_ms'])} "
            f"| {_ms(row['accept_ms'], row['step_floor_ms'])} "
            f"| {100 * (tot - rm['verify']) / tot:.0f}% | {row['acceptance']:.3f} "
            f"| {row['draft_syncs_per_round']:.2f} | {'yes' if row['identical_to_classic'] else 'NO'} |")
    lines += ["", "Drafter step = draft phase wall / head steps (unprofiled arms: the cost). "
              "Floor = bytes the step reads / measured bandwidth; the accept hook reads the same "
              "weights once (one head forward over the accepted rows, one LM-head row).", "",
              "## Per phase (all-on vs all-but-this-phase, paired run by run)", "",
              "Ratios > 1 mean the phase helps: cost with the phase off / cost with it on, "
              "medians (min-max) over the paired runs. Non-verify = draft + accept hook + "
              "finalize + residual per round. Verdicts (drafter step / non-verify / tok/s): "
              "*wins* / *loses* when every paired run agrees, else *null*.", "",
              "| phase | drafter step | non-verify ms per round | tok/s | verdict |",
              "|---|---|---|---|---|"]
    for v in verdicts(r):
        lines.append(f"| {v['name']} | {_rng(v['step'])} | {_rng(v['nonverify'])} | "
                     f"{_rng(v['tps'])} | {' / '.join(v['verdict'].values())} |")
    bits = head_bits(r)
    if bits:
        rows_by_arm = {row["arm"]: row for row in r["rows"]}
        lines += ["", "## Quantized or bf16 head on top of the defaults (paired run by run "
                  "against default)", "",
                  "Ratios > 1 mean the arm helps: the default arm's cost over this "
                  "arm's, and this arm's tok/s over the default arm's.", "",
                  "| head | drafter step | non-verify ms per round | tok/s | acceptance (default "
                  f"{rows_by_arm['default']['acceptance']:.3f}) | verdict |",
                  "|---|---|---|---|---|---|"]
        for v in bits:
            lines.append(f"| {v['head']} | {_rng(v['step'])} | {_rng(v['nonverify'])} | "
                         f"{_rng(v['tps'])} | {rows_by_arm[v['arm']]['acceptance']:.3f} | "
                         f"{' / '.join(v['verdict'].values())} |")
    lines += ["", "## Round split (ms per round, share)", "",
              "| arm | verify | draft | accept hook | finalize | residual |", "|---|---|---|---|---|---|"]
    for row in r["rows"]:
        rm = row["round_ms"]
        tot = sum(rm.values()) or 1.0
        cells = " | ".join(f"{rm[p]:.2f} ({100 * rm[p] / tot:.0f}%)"
                           for p in ROUND_PHASES)
        lines.append(f"| {row['arm']} | {cells} |")
    lines += ["", "## Attribution (MLX_MTP_DRAFT_PROFILE=1; forced syncs, so the profiled step "
              "is slower than the real one)", "",
              "| arm | ids | layers | lm_head | sample | readback | profiled step | unprofiled step "
              "| profiling overhead |", "|---|---|---|---|---|---|---|---|---|"]
    for name in ("all+prof", "default+prof"):
        row = rows[name]
        st = row["stages_ms"]
        real = rows[name.split("+")[0]]["step_ms"]
        tot = sum(v for v in st.values() if v is not None) or 1.0
        cells = " | ".join(f"{st[s]:.2f} ({100 * st[s] / tot:.0f}%)" for s in STAGES)
        over = f"{100 * (row['phase_step_ms'] / real - 1):+.0f}%" if real else "-"
        lines.append(f"| {name} | {cells} | {_ms(row['step_ms'])} | {_ms(real)} | {over} |")
        ast = row["accept_stages_ms"]
        lines.append(f"| {name} accept hook | " + " | ".join(
            f"{ast[s]:.2f}" for s in ACCEPT_STAGES) + f" | - | {_ms(row['accept_ms'])} | "
            f"{_ms(rows[name.split('+')[0]]['accept_ms'])} | - |")
    lines += ["", "Profiling overhead = profiled draft phase per step / the unprofiled arm's.", "",
              "## The floor", "",
              f"- Measured streaming-read bandwidth: {r['bandwidth_gbs']:.1f} GB/s",
              f"- Target step reads {r['target_step_bytes'] / 1e6:.1f} MB: floor "
              f"{r['target_step_floor_ms']:.2f} ms; classic decode step {r['classic_step_ms']:.2f} ms "
              f"({r['classic_step_ms'] / r['target_step_floor_ms']:.2f}x)"]
    for row in r["rows"]:
        if row["options"]["profiled"]:
            continue
        lines.append(f"- {row['arm']}: drafter step reads {row['step_bytes'] / 1e6:.1f} MB (head "
                     f"{row['head_bytes'] / 1e6:.1f} + LM head rows {row['lm_head_bytes'] / 1e6:.1f}): "
                     f"floor {row['step_floor_ms']:.2f} ms, measured {_ms(row['step_ms'])} ms")
    lines += common.what_it_says(r)
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description="Drafter phases ablation (paired, alternating)")
    p.add_argument("--model", help="a trained pair (default: build a random one)")
    p.add_argument("--work", type=Path, default=Path("/tmp/mlx_mtp_bench_drafter"),
                   help="where the random pair and sidecars are built (reused if there)")
    p.add_argument("--draft-vocab", help="a draft vocabulary sidecar for the pair")
    p.add_argument("--corpus", type=Path, nargs="*", help="calibration texts to build one")
    p.add_argument("--draft-vocab-size", type=int, default=4096)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--topic", default="drafter-phases")
    p.add_argument("--block-size", type=int, default=3)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=32)
    common.add_prompt_args(p)
    common.add_render_arg(p)
    common.add_record_args(p)
    args = p.parse_args(argv)
    if args.render:
        return common.rerender_record(args.render, render, "drafter", args.summary)
    args.prompts = common.prompts_of(args, p)
    args.work.mkdir(parents=True, exist_ok=True)
    args.random_pair = args.model is None
    if args.random_pair:
        args.model, corpus = build_random_pair(args.work)
        args.corpus = args.corpus or corpus
    watch = common.watch(args)
    return common.finish(args, run(args), watch, render, "drafter")


if __name__ == "__main__":
    main()
