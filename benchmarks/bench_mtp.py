"""MTP speculative decoding against mlx-lm's plain decode of the same target, paired and alternating.

Protocol (docs/benchmarks.md): paired and alternating arms in one process, each arm warmed up once,
a fixed token budget with EOS ignored, several prompts, temperature 0 unless ``--temp``; medians of
the per-pair tok/s and the min-max of the per-pair ratios; the share of distinct 4-grams of each
prompt's output (a loop lifts acceptance and tok/s far above what the pair does on text); the
machine's memory bandwidth measured in the same run, and each decode step reported as a multiple
of its floor (bytes it must read / bandwidth). Writes benchmark_results/<topic>-<host>-<date>.md and
.json, and beside them the record's pictures (``benchmarks.plots``; needs the ``bench`` extra, else
they are skipped with one line): tok/s per block size, per-position acceptance, the round split.

    python -m benchmarks.bench_mtp --model PATH [--drafter D] --block-sizes 1,2,3,4,5 --pairs 5
    python -m benchmarks.bench_mtp --model PATH --block-sizes 1,3,5,auto --max-block-size 6
    python -m benchmarks.bench_mtp --model PATH --prompts code     # another prompt set
    python -m benchmarks.bench_mtp --render RECORD.json    # redraw a record's pictures, no run

``auto`` is an arm like a block size (``--block-size auto``, widths up to ``--max-block-size``);
with it the record adds a per-prompt table: auto against the best fixed block size and against
plain decode on each prompt, and the widths auto chose; and auto against every fixed block pair
by pair (median and min-max over pairs of the ratio within a pair), which tells a loss from the
noise that lifts the best of the fixed arms' medians (a record without these fields gets them from
its raw runs when ``--render --summary`` rewrites its .md).

With ``--temp > 0`` both arms sample (mlx_mtp's ``make_sampler``, mlx-lm semantics; the plain arm is
still mlx-lm's own ``generate_step``), each run seeded with ``--seed`` + run index, and the record
states the acceptance rule; token identity is then not expected and is reported as "n/a".
"""

from __future__ import annotations

import argparse
import math
import statistics

import mlx_mtp  # first: binds the system BLAS before mlx.core loads
import mlx.core as mx

from benchmarks import common
from benchmarks.common import mtp_decode, plain_decode
from mlx_lm.sample_utils import make_logits_processors

from mlx_mtp.decoding.acceptance import REQUESTABLE_RULES
from mlx_mtp.decoding.rounds import SYNC_PHASES_ENV
from mlx_mtp.decoding.sampling import make_sampler
from mlx_mtp.decoding.stats import PHASES
from mlx_mtp.decoding.responses import encode_prompt
from mlx_mtp.models.options import DraftOptions

AUTO = "auto"


# ------------------------------------------------------------------------------ the run


def run(args, watch=None) -> dict:
    model, tokenizer = mlx_mtp.load(args.model, drafter=args.drafter,
                                    require_head=max(_widest(b, args)
                                                     for b in args.block_sizes) > 1,
                                    draft_options=DraftOptions(bf16=args.draft_bf16 or None))
    prompts = {k: encode_prompt(tokenizer, v) for k, v in args.prompts.items()}
    n = args.max_tokens
    sampler = make_sampler(temp=args.temp, top_p=args.top_p, top_k=args.top_k)
    args.processors = make_logits_processors(repetition_penalty=args.repetition_penalty,
                                             repetition_context_size=args.repetition_context_size)
    # Warm-up: each arm once (first-call compilation and allocation stay out), on the first
    # prompt unless the caller names a shorter one (``warm_prompt``: a long prompt's prefill).
    warm = getattr(args, "warm_prompt", None)
    warm = next(iter(prompts.values())) if warm is None else encode_prompt(tokenizer, warm)
    plain_decode(model.mlx_model, warm, 8, sampler, args.processors)
    for bs in args.block_sizes:
        mtp_decode(model, warm, 8, bs, sampler, args.acceptance, args.seed, args.max_block_size,
                   args.processors)
    unit = common.idle.Watch.runner(watch)

    raw = {"classic": [], **{_arm(bs): [] for bs in args.block_sizes}}
    exact = {bs: True for bs in args.block_sizes}
    for pair in range(args.pairs):
        for p_index, (name, prompt) in enumerate(prompts.items()):
            order = args.block_sizes if pair % 2 == 0 else list(reversed(args.block_sizes))
            arms = [("classic", None)] + [(_arm(bs), bs) for bs in order]
            if pair % 2:
                arms = arms[1:] + arms[:1]  # alternate which arm goes first
            # run i of the whole record (from 1) seeds with seed + i; a retaken pair reuses its own
            first = (pair * len(prompts) + p_index) * len(arms) + 1

            def measure():
                results = {}
                for i, (arm, bs) in enumerate(arms):
                    seed = args.seed + first + i
                    mx.random.seed(seed)  # the plain arm draws from the global stream
                    if bs is None:
                        toks, ps, gs = plain_decode(model.mlx_model, prompt, n, sampler,
                                                    args.processors)
                        results[arm] = {"tokens": toks, "prompt_s": ps, "gen_s": gs}
                    else:
                        toks, ps, gs, st = mtp_decode(model, prompt, n, bs, sampler,
                                                      args.acceptance, seed, args.max_block_size,
                                                      args.processors)
                        results[arm] = {"tokens": toks, "prompt_s": ps, "gen_s": gs,
                                        "stats": st.to_dict()}
                return results

            results = unit(f"pair {pair} {name}", measure)
            for arm, bs in arms:
                r = results[arm]
                r["tps"] = (len(r["tokens"]) - 1) / r["gen_s"]
                r["distinct_4gram_share"] = common.distinct_ngram_share(r["tokens"])
                if bs is not None:
                    exact[bs] &= r["tokens"] == results["classic"]["tokens"]
                raw[arm].append({"pair": pair, "prompt": name, **{k: v for k, v in r.items()
                                                                   if k != "tokens"}})
            print(f"pair {pair} {name}: " + ", ".join(
                f"{a} {results[a]['tps']:.1f}" for a, _ in arms), flush=True)
    synced = synced_pass(args, model, prompts, sampler, unit)
    bw = common.bandwidth_gbs()
    return summarize(args, model, raw, exact, bw, synced)


def synced_pass(args, model, prompts: dict, sampler, unit) -> list:
    """After the pairs, ``--synced-runs`` runs per prompt of the plain arm and of each MTP arm
    with ``MLX_MTP_SYNC_PHASES=1``: each phase then waits for its own device work, so the split
    says what the verify alone costs and what the draft and accept hook cost, which the queued
    (default) runs fold into the verify. These runs are not in the tok/s above (the syncs cost
    time); their plain runs give the step the verify is divided by. Each prompt's runs are one
    unit of the idle check (``unit``: ``Watch.runner``)."""
    out = []
    with common.environment(SYNC_PHASES_ENV, "1"):
        for rep in range(args.synced_runs):
            for name, prompt in prompts.items():
                def measure():
                    toks, _, gs = plain_decode(model.mlx_model, prompt, args.max_tokens, sampler,
                                              args.processors)
                    rows = [{"arm": "classic", "prompt": name, "tps": (len(toks) - 1) / gs}]
                    for bs in args.block_sizes:
                        t, _, g, st = mtp_decode(model, prompt, args.max_tokens, bs, sampler,
                                                 args.acceptance, args.seed + rep,
                                                 args.max_block_size, args.processors)
                        rows.append({"arm": _arm(bs), "prompt": name, "tps": (len(t) - 1) / g,
                                     "identical": t == toks, "stats": st.to_dict()})
                    return rows

                out += unit(f"synced {rep} {name}", measure)
    return out


def round_split(stats: list) -> dict:
    """Mean ms per round of each phase over runs' ``RunStats.to_dict()``."""
    rounds = sum(s["rounds"] for s in stats)
    return {p: sum(s["phase_ms"][p] for s in stats) / max(rounds, 1) for p in PHASES}


def summarize(args, model, raw, exact, bw, synced=()) -> dict:
    classic = raw["classic"]
    by_key = {(r["pair"], r["prompt"]): r for r in classic}
    rows = []
    floors = common.step_bytes(model)
    classic_ms = statistics.median(1e3 / r["tps"] for r in classic)
    for bs in args.block_sizes:
        arm = raw[_arm(bs)]
        ratios = [r["tps"] / by_key[(r["pair"], r["prompt"])]["tps"] for r in arm]
        st = [r["stats"] for r in arm]
        rounds = sum(s["rounds"] for s in st)
        phase = round_split(st)
        drafted = sum(s["drafted"] for s in st)
        n_pos = max((len(s["per_position_acceptance"]) for s in st), default=0)
        per_pos = []
        for j in range(n_pos):
            offered = sum(s["per_position_rounds"][j] for s in st if len(s["per_position_rounds"]) > j)
            hits = sum(s["per_position_acceptance"][j] * s["per_position_rounds"][j]
                       for s in st if len(s["per_position_rounds"]) > j)
            per_pos.append(hits / offered if offered else 0.0)
        draft_steps = sum(max(s["drafted"] - s["rounds"], 0) for s in st)
        verify_ms = verify_ms_by_width(st)
        rows.append({
            "block_size": bs,
            "classic_tps": statistics.median(r["tps"] for r in classic),
            "mtp_tps": statistics.median(r["tps"] for r in arm),
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios),
            "acceptance": sum(s["accepted"] for s in st) / drafted if drafted else 0.0,
            "tokens_per_round": sum(s["accepted"] + s["rounds"] for s in st) / max(rounds, 1),
            "per_position_acceptance": per_pos,
            "round_ms": phase,
            # Mean verify-phase ms per round by verify width, and as a multiple of the plain
            # (mlx-lm) decode step of the same run: what a verify of w tokens costs in steps.
            "verify_ms_by_width": verify_ms,
            # False: draft and accept were queued, their device work timed in the verify phase
            # (records from before the field waited for each phase).
            "phases_synced": all(s.get("phases_synced", True) for s in st),
            "verify_over_step_by_width": {w: ms / classic_ms for w, ms in verify_ms.items()},
            # how far a width's round times spread within a run (log-sd, pooled over the runs)
            "round_spread_by_width": round_spread_by_width(st),
            # (only when the draft phase waited for its device work: MLX_MTP_SYNC_PHASES=1)
            "drafter_step_ms": (sum(s["phase_ms"]["draft"] for s in st) / draft_steps
                                if draft_steps and all(s.get("phases_synced", True) for s in st)
                                else None),
            # Only meaningful at T=0; sampled runs are not expected to match token for token.
            "identical_to_classic": exact[bs] if args.temp == 0 else None,
            "acceptance_rule": st[0]["acceptance_rule"] if st else None,
            # The exactness gate's decision for this arm (same for every run of the arm).
            "mtp_enabled": all(s["mtp_enabled"] for s in st),
            "gate_reason": st[0]["gate_reason"] if st else "",
            "exactness": st[0]["exactness"] if st else {},
            # rounds per verify width, summed over the arm's runs
            "block_sizes": _sum_widths(s.get("block_sizes", {}) for s in st),
            **synced_summary(synced, bs, args.temp),
        })
    result = {
        **common.record_setup(args.topic),
        "model": str(args.model), "drafter": args.drafter, "draft_bf16": args.draft_bf16,
        "target_dtype": str(model.target.dtype), "prompts": args.prompts,
        "max_tokens": args.max_tokens, "pairs": args.pairs, "temperature": args.temp,
        "repetition_penalty": args.repetition_penalty,
        "repetition_context_size": args.repetition_context_size,
        "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed, "acceptance": args.acceptance,
        "bandwidth_gbs": bw, **floors,
        "target_step_floor_ms": floors["target_step_bytes"] / bw / 1e6,
        "classic_step_ms": classic_ms,
        "drafter_step_floor_ms": (floors["drafter_step_bytes"] / bw / 1e6
                                  if "drafter_step_bytes" in floors else None),
        "max_block_size": args.max_block_size if AUTO in args.block_sizes else None,
        "synced_runs": args.synced_runs,
        "rows": rows, "per_prompt": per_prompt(args, raw), "raw": raw, "synced": list(synced),
    }
    return result


def synced_summary(synced: list, bs, temp: float) -> dict:
    """The synced pass's split for one arm: ms per round of each phase, the non-verify share,
    and the verify alone per width over the plain step of the same pass."""
    st = [r["stats"] for r in synced if r["arm"] == _arm(bs)]
    if not st:
        return {}
    step_ms = statistics.median(1e3 / r["tps"] for r in synced if r["arm"] == "classic")
    split = round_split(st)
    verify = verify_ms_by_width(st)
    return {
        "synced_runs": len(st),
        "synced_round_ms": split,
        "synced_non_verify_share": 1 - split["verify"] / (sum(split.values()) or 1.0),
        "synced_step_ms": step_ms,
        "synced_verify_ms_by_width": verify,
        "synced_verify_over_step_by_width": {w: ms / step_ms for w, ms in verify.items()},
        "synced_identical": (all(r["identical"] for r in synced if r["arm"] == _arm(bs))
                             if temp == 0 else None),
    }


def verify_ms_by_width(stats: list) -> dict:
    """Round-weighted mean verify ms per verify width over runs' ``RunStats.to_dict()``."""
    total, rounds = {}, {}
    for s in stats:
        for w, ms in s.get("verify_ms_by_width", {}).items():
            n = s["verify_rounds_by_width"][w]
            total[w] = total.get(w, 0.0) + ms * n
            rounds[w] = rounds.get(w, 0) + n
    return {int(w): total[w] / rounds[w] for w in sorted(total, key=int) if rounds[w]}


def round_spread_by_width(stats: list) -> dict:
    """Per verify width: the rounds, and the standard deviation of log(round wall time) within
    a run pooled over runs' ``RunStats.to_dict()`` (each run's squared deviations from its own
    mean, over their degrees of freedom: the noise one run's cost estimates see, not the drift
    between runs); "all": the same pooled over every width. Runs from before the field: {}."""
    rounds: dict = {}
    dof: dict = {}
    ss: dict = {}
    for s in stats:
        for w, v in s.get("round_spread_by_width", {}).items():
            d = v["rounds"] - 1
            rounds[w] = rounds.get(w, 0) + v["rounds"]
            dof[w] = dof.get(w, 0) + d
            ss[w] = ss.get(w, 0.0) + d * v["log_sd"] ** 2
    out = {w: {"rounds": rounds[w], "log_sd": math.sqrt(ss[w] / dof[w])}
           for w in sorted(dof, key=int) if dof[w]}
    total = sum(dof.values())
    if total:
        out["all"] = {"rounds": sum(v["rounds"] for v in out.values()),
                      "log_sd": math.sqrt(sum(ss.values()) / total)}
    return out


def _arm(bs) -> str:
    return f"mtp{bs}"


def _widest(bs, args) -> int:
    return args.max_block_size if bs == AUTO else bs


def _sum_widths(dicts) -> dict:
    total = {}
    for d in dicts:
        for w, n in d.items():
            total[w] = total.get(w, 0) + n
    return {w: total[w] for w in sorted(total, key=int)}


def paired_vs_fixed(raw, prompt: str, fixed) -> dict:
    """Auto against each fixed block size on ``prompt``, pair by pair: per block, auto's tok/s
    over that block's in the same pair (the arms alternate within a pair, so the machine's drift
    and the order weigh on both alike), as the median, min and max over pairs. "auto / best
    fixed" divides auto's median by the largest of the fixed arms' medians, which noise lifts
    (the best of several noisy medians); here a range that holds 1 is within the pairs' noise,
    one wholly below 1 a loss in every pair."""
    auto = {r["pair"]: r["tps"] for r in raw[_arm(AUTO)] if r["prompt"] == prompt}
    out = {}
    for b in fixed:
        ratios = [auto[r["pair"]] / r["tps"] for r in raw[_arm(b)]
                  if r["prompt"] == prompt and r["pair"] in auto]
        if ratios:
            out[str(b)] = {"median": statistics.median(ratios), "min": min(ratios),
                           "max": max(ratios), "pairs": len(ratios)}
    return out


def held_out_vs_best(raw, prompt: str, fixed) -> dict:
    """Auto against the best fixed block size without the selection's bias: for each pair, the
    block whose median tok/s over the *other* pairs is highest, and auto's tok/s over that
    block's in this pair (leave one pair out). The best of several noisy medians, measured on
    the same runs that chose it, is lifted by their noise; chosen on other runs it is not.
    Median, min and max over pairs, and how often each block was the choice; {} with fewer than
    two pairs."""
    tps = {b: {r["pair"]: r["tps"] for r in raw[_arm(b)] if r["prompt"] == prompt}
           for b in [*fixed, AUTO]}
    pairs = sorted(set(tps[AUTO]).intersection(*(tps[b] for b in fixed)))
    if len(pairs) < 2 or not fixed:
        return {}
    ratios, chosen = [], {}
    for p in pairs:
        best = max(fixed, key=lambda b: statistics.median(v for q, v in tps[b].items()
                                                          if q != p and q in pairs))
        ratios.append(tps[AUTO][p] / tps[best][p])
        chosen[str(best)] = chosen.get(str(best), 0) + 1
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "pairs": len(ratios), "chosen": chosen}


def hardest_fixed(paired: dict) -> str:
    """The fixed block auto does worst against, pair by pair (lowest median ratio; ties: the
    first listed)."""
    return min(paired, key=lambda b: paired[b]["median"])


def per_prompt(args, raw) -> list:
    """Per prompt: the share of distinct 4-grams of its output (``distinct_4gram_share``: the
    median over the plain arm's runs; at T=0 every exact arm emits that same text), each arm's
    median tok/s and, for auto, its ratio to the best fixed block size and to plain decode
    (medians of that prompt's pairs), the same against every fixed block pair by pair
    (``paired_vs_fixed``), and the widths it chose."""
    out = []
    for name in args.prompts:
        tps = {arm: statistics.median(r["tps"] for r in runs if r["prompt"] == name)
               for arm, runs in raw.items()}
        row = {"prompt": name, "classic_tps": tps["classic"],
               "mtp_tps": {str(bs): tps[_arm(bs)] for bs in args.block_sizes}}
        shares = [r["distinct_4gram_share"] for r in raw["classic"]
                  if r["prompt"] == name and r.get("distinct_4gram_share") is not None]
        if shares:
            row["distinct_4gram_share"] = statistics.median(shares)
        fixed = [bs for bs in args.block_sizes if bs != AUTO]
        if AUTO in args.block_sizes:
            auto = tps[_arm(AUTO)]
            row["auto_vs_plain"] = auto / tps["classic"]
            if fixed:
                best = max(fixed, key=lambda b: tps[_arm(b)])
                row["best_fixed"] = best
                row["auto_vs_best_fixed"] = auto / tps[_arm(best)]
                row["auto_vs_fixed_paired"] = paired_vs_fixed(raw, name, fixed)
                row["auto_vs_best_fixed_held_out"] = held_out_vs_best(raw, name, fixed)
            row["auto_block_sizes"] = _sum_widths(
                r["stats"]["block_sizes"] for r in raw[_arm(AUTO)] if r["prompt"] == name)
        out.append(row)
    return out


# ------------------------------------------------------------------------------ the record


def render(r: dict) -> str:
    lines = common.setup_lines(r, memory=True) + [
        f"- Target: {r['model']} ({r['target_dtype']}); drafter: {r['drafter'] or 'embedded mtp.* head'}"
        + ("; its products on bfloat16 weights (--draft-bf16)" if r.get("draft_bf16") else ""),
        f"- Prompts: {', '.join(r['prompts'])}; {r['max_tokens']} tokens each, EOS ignored, "
        f"{_sampling_text(r)}; {r['pairs']} alternating pairs per prompt",
        f"- Logits processors (both arms): " + (
            f"repetition penalty {r['repetition_penalty']} over {r['repetition_context_size']} "
            f"tokens" if r.get("repetition_penalty") else "none"),
        "",
        "## Exactness gate", "",
    ]
    for row in r["rows"]:
        ex = row["exactness"]
        widths = ex.get("widths") or []
        bad = [w for w in widths if w.get("verdict") != "equal"]
        detail = "; ".join(f"width {w['width']}: {w.get('verdict')}"
                           + (f" at position {w.get('position')}, {w.get('differing_bytes')} of "
                              f"{w.get('total_bytes')} bytes" if w.get("verdict") == "diverges" else "")
                           for w in bad) or "all widths equal" if widths else "no probe needed"
        label = "MTP ran" if row["mtp_enabled"] else "MTP declined (plain decode)"
        if ex.get("override"):
            label += ": OVERRIDDEN by MLX_MTP_ALLOW_INEXACT=1, not a shipping configuration"
        lines.append(f"- block {row['block_size']}: {label}; verdict {ex.get('verdict', 'n/a')}; {detail}")
    lines += [
        "",
        "## Results (medians over pairs x prompts; ratio range = min-max of per-pair ratios)", "",
        "| block | classic tok/s | MTP tok/s | ratio | ratio range | acceptance | tokens/round "
        "| per-position acceptance | identical to classic |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        lines.append(f"| {row['block_size']} | {result_cells(row)} |")
    lines += per_prompt_lines(r)
    lines += ["", "## Round split (ms per round, share)", ""]
    if not all(row.get("phases_synced", True) for row in r["rows"]):
        lines += ["Draft and accept hook queued (the default): their device work is timed in the "
                  "verify that waits for it. `MLX_MTP_SYNC_PHASES=1` times each phase on its own.", ""]
    lines += ["| block | verify | draft | accept hook | finalize | residual |", "|---|---|---|---|---|---|"]
    for row in r["rows"]:
        tot = sum(row["round_ms"].values()) or 1.0
        cells = " | ".join(f"{row['round_ms'][p]:.2f} ({100 * row['round_ms'][p] / tot:.0f}%)"
                           for p in PHASES)
        lines.append(f"| {row['block_size']} | {cells} |")
    widest = max([int(w) for row in r["rows"] for w in row.get("verify_ms_by_width", {})] + [1])
    lines += ["", "## Verify cost per width (verify-phase ms per round / plain decode step ms)", "",
              f"Plain (mlx-lm) decode step: {r['classic_step_ms']:.2f} ms.", "",
              "| block | " + " | ".join(f"w={w}" for w in range(1, widest + 1)) + " |",
              "|---|" + "---|" * widest]
    for row in r["rows"]:
        by_w = {int(w): v for w, v in row.get("verify_over_step_by_width", {}).items()}
        ms = {int(w): v for w, v in row.get("verify_ms_by_width", {}).items()}
        cells = [f"{ms[w]:.2f} ms ({by_w[w]:.2f}x)" if w in by_w else "-"
                 for w in range(1, widest + 1)]
        lines.append(f"| {row['block_size']} | " + " | ".join(cells) + " |")
    lines += _spread_lines(r, widest)
    lines += _synced_lines(r)
    lines += ["", "## The floor", "",
              f"- Measured streaming-read bandwidth: {r['bandwidth_gbs']:.1f} GB/s",
              f"- Target step reads {r['target_step_bytes'] / 1e6:.1f} MB: floor "
              f"{r['target_step_floor_ms']:.2f} ms; classic decode step {r['classic_step_ms']:.2f} ms "
              f"({r['classic_step_ms'] / r['target_step_floor_ms']:.2f}x the floor)"]
    if r["drafter_step_floor_ms"]:
        steps = [row["drafter_step_ms"] for row in r["rows"] if row["drafter_step_ms"]]
        meas = f"; measured drafter step {statistics.median(steps):.2f} ms " \
               f"({statistics.median(steps) / r['drafter_step_floor_ms']:.2f}x the floor)" if steps else ""
        what = r.get("drafter_step_reads", "head + borrowed LM head")
        what += (f" {r['lm_head_bytes'] / 1e6:.1f} MB" if what == "head + borrowed LM head"
                 else "")
        lines.append(f"- Drafter step reads {r['drafter_step_bytes'] / 1e6:.1f} MB ({what}): floor "
                     f"{r['drafter_step_floor_ms']:.2f} ms{meas}")
    lines += common.what_it_says(r)
    return "\n".join(lines)


def _spread_lines(r: dict, widest: int) -> list:
    """How far a width's round times spread within a run (records from before the field:
    nothing)."""
    rows = [row for row in r["rows"] if row.get("round_spread_by_width")]
    if not rows:
        return []
    lines = ["", "## Round times within a run", "",
             "Standard deviation of log(round wall time) per verify width, within each run, "
             "pooled over the runs (rounds in brackets): the noise one run's cost estimates see "
             "(`python -m tools.simulate_chooser --sigma record` replays with the auto arm's, else "
             "the arms' \"all\").", "",
             "| block | " + " | ".join(f"w={w}" for w in range(1, widest + 1)) + " | all |",
             "|---|" + "---|" * (widest + 1)]
    for row in rows:
        sp = row["round_spread_by_width"]
        cells = [f"{sp[k]['log_sd']:.3f} ({sp[k]['rounds']})" if k in sp else "-"
                 for k in [str(w) for w in range(1, widest + 1)] + ["all"]]
        lines.append(f"| {row['block_size']} | " + " | ".join(cells) + " |")
    return lines


def _synced_lines(r: dict) -> list:
    """The synced pass: each phase's own cost, and the verify alone per width."""
    rows = [row for row in r["rows"] if row.get("synced_runs")]
    if not rows:
        return []
    widest = max([int(w) for row in rows for w in row["synced_verify_ms_by_width"]] + [1])
    lines = ["", "## Each phase on its own (`MLX_MTP_SYNC_PHASES=1`)", "",
             f"{r['synced_runs']} run(s) per prompt of every arm after "
             "the pairs (not in the tok/s above: the syncs cost time), each phase waiting for its "
             "own device work; the verify divided by the plain step of the same pass "
             f"({rows[0]['synced_step_ms']:.2f} ms). Non-verify = draft + accept hook + finalize "
             "+ residual.", "",
             "| block | verify | draft | accept hook | finalize | residual | non-verify share | "
             + " | ".join(f"verify w={w}" for w in range(1, widest + 1)) + " | identical |",
             "|---|" + "---|" * (6 + widest + 1)]
    for row in rows:
        split = row["synced_round_ms"]
        by_w = {int(w): v for w, v in row["synced_verify_over_step_by_width"].items()}
        ms = {int(w): v for w, v in row["synced_verify_ms_by_width"].items()}
        cells = [f"{split[p]:.2f}" for p in PHASES]
        cells.append(f"{100 * row['synced_non_verify_share']:.0f}%")
        cells += [f"{ms[w]:.2f} ms ({by_w[w]:.2f}x)" if w in by_w else "-"
                  for w in range(1, widest + 1)]
        cells.append(_identical_text(row.get("synced_identical")))
        lines.append(f"| {row['block_size']} | " + " | ".join(cells) + " |")
    return lines


def result_cells(row: dict) -> str:
    """A results row's cells after its first: plain and MTP tok/s, ratio and its range,
    acceptance, tokens per round, per-position acceptance, identical to plain decode."""
    pp = " / ".join(f"{a:.2f}" for a in row["per_position_acceptance"]) or "-"
    return (f"{row['classic_tps']:.1f} | {row['mtp_tps']:.1f} | {row['ratio_median']:.2f}x | "
            f"{row['ratio_min']:.2f}-{row['ratio_max']:.2f} | {row['acceptance']:.3f} | "
            f"{row['tokens_per_round']:.2f} | {pp} | "
            f"{_identical_text(row.get('identical_to_classic'))}")


def _stored_or_raw(r: dict, p: dict, key: str, compute) -> dict:
    """A per-prompt row's comparison ``key``: stored, or ``compute``d from the record's raw runs
    (a record from before the field); {} where neither can give it."""
    if key in p:
        return p[key]
    if "best_fixed" not in p or "raw" not in r:
        return {}
    fixed = [a for a in p["mtp_tps"] if a != AUTO]
    return compute(r["raw"], p["prompt"], [int(a) for a in fixed])


def _paired_of(r: dict, p: dict) -> dict:
    return _stored_or_raw(r, p, "auto_vs_fixed_paired", paired_vs_fixed)


def _held_out_of(r: dict, p: dict) -> dict:
    return _stored_or_raw(r, p, "auto_vs_best_fixed_held_out", held_out_vs_best)


def _ratio_range(c: dict) -> str:
    return f"{c['median']:.2f}x ({c['min']:.2f}-{c['max']:.2f})"


def per_prompt_lines(r: dict) -> list:
    rows = r.get("per_prompt") or []
    if not rows:
        return []
    arms = list(rows[0]["mtp_tps"])
    auto = "auto_vs_plain" in rows[0]
    ngrams = any("distinct_4gram_share" in p for p in rows)  # (records from before the field: no)
    paired = [_paired_of(r, p) if auto else {} for p in rows]
    head = (["prompt"] + (["distinct 4-grams"] if ngrams else []) + ["classic tok/s"]
            + [f"block {a} tok/s" for a in arms])
    held_out = [_held_out_of(r, p) if auto else {} for p in rows]
    held = any(held_out)
    if auto:
        head += ["auto / best fixed"] + (["that block, paired"] if any(paired) else []) + (
            ["auto / best fixed, held out"] if held else []) + [
            "auto / plain", "widths auto chose (width: rounds)"]
    lines = ["", "## Per prompt (medians over pairs)", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for p, pp, h in zip(rows, paired, held_out):
        share = p.get("distinct_4gram_share")
        cells = ([p["prompt"]] + ([f"{share:.2f}" if share is not None else "-"] if ngrams else [])
                 + [f"{p['classic_tps']:.1f}"] + [f"{p['mtp_tps'][a]:.1f}" for a in arms])
        if auto:
            vs_fixed = (f"{p['auto_vs_best_fixed']:.2f}x (block {p['best_fixed']})"
                        if "auto_vs_best_fixed" in p else "-")
            cells.append(vs_fixed)
            if any(paired):
                best = str(p.get("best_fixed"))
                cells.append(_ratio_range(pp[best]) if best in pp else "-")
            if held:
                cells.append(_ratio_range(h) if h else "-")
            cells += [f"{p['auto_vs_plain']:.2f}x",
                      ", ".join(f"{w}: {n}" for w, n in p["auto_block_sizes"].items())]
        lines.append("| " + " | ".join(cells) + " |")
    if held:
        lines += ["", "\"auto / best fixed, held out\": for each pair, the fixed block with the "
                  "highest median over the other pairs, and auto's tok/s over that block's in "
                  "this pair; median (min-max) over pairs. Chosen on other runs than it is "
                  "measured on, the best fixed block is not lifted by its own noise, as the "
                  "plain \"auto / best fixed\" (the best of the fixed arms' medians over auto's "
                  "median) is. Blocks so chosen: " + "; ".join(
                      f"{p['prompt']} " + ", ".join(f"{b}: {n}" for b, n in h["chosen"].items())
                      for p, h in zip(rows, held_out) if h) + "."]
    if any(paired):
        lines += _paired_lines(rows, paired)
    return lines


def _paired_lines(rows: list, paired: list) -> list:
    """The section that tells a real loss from noise: auto against every fixed block, pair by
    pair."""
    blocks = list(next(pp for pp in paired if pp))
    lines = ["", "## Auto against each fixed block, pair by pair", "",
             "Median over pairs of auto's tok/s over the block's in the same pair (the arms "
             "alternate within a pair), and the min-max over pairs. \"auto / best fixed\" "
             "above divides auto's median by the best of the fixed arms' medians, and the best "
             "of several noisy medians is lifted by their noise; here a range that holds 1.00x "
             "is within the pairs' noise, one wholly below it a loss in every pair.", "",
             "| prompt | " + " | ".join(f"vs block {b}" for b in blocks)
             + " | hardest block, paired |", "|" + "---|" * (len(blocks) + 2)]
    for p, pp in zip(rows, paired):
        if not pp:
            continue
        hard = hardest_fixed(pp)
        lines.append(f"| {p['prompt']} | " + " | ".join(
            _ratio_range(pp[b]) if b in pp else "-" for b in blocks)
            + f" | block {hard}: {_ratio_range(pp[hard])} |")
    return lines


def _sampling_text(r: dict) -> str:
    t = r.get("temperature", 0.0)
    if not t:
        return "T=0"
    rules = sorted({row.get("acceptance_rule") or "?" for row in r["rows"]})
    return (f"T={t}, top-p {r.get('top_p', 0.0)}, top-k {r.get('top_k', 0)}, seed {r.get('seed')} "
            f"(+ run index), acceptance rule {', '.join(rules)}")


def _identical_text(v) -> str:
    return "n/a (sampled)" if v is None else ("yes" if v else "NO")


def main(argv=None):
    p = argparse.ArgumentParser(description="MTP vs mlx-lm plain decode, paired and alternating")
    p.add_argument("--model", help="the target (required unless --render)")
    p.add_argument("--drafter")
    p.add_argument("--draft-bf16", action="store_true",
                   help="the drafter's products on bfloat16 weights (DraftOptions(bf16=True))")
    p.add_argument("--topic", default="mtp")
    p.add_argument("--block-sizes", default="1,2,3,4,5",
                   help="comma-separated arms: block sizes and/or auto, e.g. 1,3,5,auto")
    p.add_argument("--max-block-size", type=int, default=6,
                   help="the widest block the auto arm may choose")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=128)
    common.add_prompt_args(p)
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (both arms)")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="mlx-lm's repetition penalty on both arms (the demo pair's CLI default: "
                        "1.3 over 48 tokens; default here: none)")
    p.add_argument("--repetition-context-size", type=int, default=20)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="base seed; run i uses seed + i")
    p.add_argument("--synced-runs", type=int, default=1,
                   help="runs per prompt of every arm with each phase synced, after the pairs "
                        "(the round split's own costs; 0: none)")
    p.add_argument("--acceptance", choices=REQUESTABLE_RULES, default="auto",
                   help="acceptance rule at temperature > 0")
    common.add_render_arg(p)
    common.add_record_args(p, units=True)
    args = p.parse_args(argv)
    rendered = common.render_instead(args, p, render, "mtp")
    if rendered is not None:
        return rendered
    try:
        args.block_sizes = [b if b == AUTO else int(b) for b in args.block_sizes.split(",")]
    except ValueError:
        p.error(f"--block-sizes: expected comma-separated block sizes or auto, got "
                f"{args.block_sizes!r}")
    args.prompts = common.prompts_of(args, p)
    if (args.pairs < 1 or args.max_tokens < 2 or args.max_block_size < 1 or args.synced_runs < 0
            or any(b != AUTO and b < 1 for b in args.block_sizes)):
        p.error("--pairs >= 1, --max-tokens >= 2, --max-block-size >= 1, --synced-runs >= 0 "
                "and block sizes >= 1 are required")
    watch = common.watch(args)
    return common.finish(args, run(args, watch), watch, render, "mtp")


if __name__ == "__main__":
    main()
