"""MTP on a mixture-of-experts pair against mlx-lm's plain decode, and its verify against the bytes
of the experts each round touched.

    python -m benchmarks.bench_moe --model MOE_PAIR [--dense DENSE_PAIR] [--temps 0,0.6]
        [--block-sizes 1,2,3,4,5,6,auto] [--pairs 3] [--max-tokens 96]

Per temperature, ``bench_mtp``'s paired, alternating arms and its synced pass (the verify alone
per width, the draft step, the accept hook). Then at T=0 the fixed blocks' generations again,
counting the distinct experts of every verify per layer (``realistic_moe.DistinctExperts``): each
width's verify against its floor, the bytes of exactly those experts plus the dense part (every
other weight read once for all rows: attention / GatedDeltaNet, shared expert, router, LM head),
over the bandwidth measured in the same run; beside it what random routes would touch, and how
the grouped verify computed the width. The MTP head's draft step against its one-row floor.
``--dense``: the same arms at T=0 on a dense pair of the same shape, in the same record.
"""

from __future__ import annotations

import argparse
import statistics

import mlx_mtp  # first: binds the system BLAS before mlx.core loads
import mlx.core as mx

from benchmarks import bench_mtp, common, realistic_moe
from mlx_mtp.decoding.responses import encode_prompt

AUTO = bench_mtp.AUTO


def arms_args(args, model: str, temp: float) -> argparse.Namespace:
    """What ``bench_mtp.run`` reads, for ``model`` at ``temp``."""
    return argparse.Namespace(
        model=model, drafter=args.drafter, draft_bf16=False, topic=args.topic,
        block_sizes=args.block_sizes, max_block_size=args.max_block_size, pairs=args.pairs,
        max_tokens=args.max_tokens, prompts=args.prompts, temp=temp, top_p=0.0, top_k=0,
        repetition_penalty=None, repetition_context_size=20, seed=args.seed,
        synced_runs=args.synced_runs, acceptance="auto")


def expert_bytes(model) -> dict:
    """The target's weight bytes by part: one expert of each MoE layer (``per_expert``), its
    routed stacks, and the dense part a verify reads once (everything else; the input
    embedding is a row lookup unless it is the tied LM head)."""
    from mlx_lm.models.switch_layers import SwitchGLU

    target = model.target
    stacks = [m for _, m in target.model.named_modules() if isinstance(m, SwitchGLU)]
    if not stacks:
        raise SystemExit(f"error: --model {target.args.model_type}: no mixture-of-experts layers")
    emb = 0 if target.args.tie_word_embeddings else common.nbytes(target.trunk.embed_tokens)
    routed = sum(common.nbytes(m) for m in stacks)
    return {"layers": len(stacks), "experts": stacks[0].up_proj.num_experts,
            "top_k": common.experts_per_token(target.args),
            "per_expert": common.nbytes(stacks[0]) // stacks[0].up_proj.num_experts,
            "routed": routed, "dense": common.nbytes(target.model) - routed - emb}


def drafter_bytes(model) -> int:
    """Bytes a draft step of the Qwen head reads: its weights but the experts it is not routed
    to (their bfloat16 copies where the drafter reads those) and the LM head's rows it drafts
    over, as it holds them (0: no such drafter)."""
    drafter = model.drafter
    head = getattr(drafter, "head", None)
    if head is None:
        return 0
    from mlx_lm.models.switch_layers import SwitchGLU

    top_k = common.experts_per_token(model.target.args)
    half = 2 if drafter.bf16 else 1
    stacks = [m for _, m in head.named_modules() if isinstance(m, SwitchGLU)]
    routed = sum(common.nbytes(m) * min(top_k, m.up_proj.num_experts) // m.up_proj.num_experts
                 for m in stacks)
    dense = common.nbytes(head) - sum(common.nbytes(m) for m in stacks)
    return dense + routed // half + drafter.lm.tensors.nbytes  # the LM head's rows as read


def count_experts(args, model, prompts: dict) -> dict:
    """Width -> mean distinct experts per layer of the verifies of the fixed blocks' T=0
    generations (the same rounds the timed runs made), and the methods the stats name."""
    fixed = [b for b in args.block_sizes if b != AUTO and b >= 2]
    warm = next(iter(prompts.values()))
    common.mtp_decode(model, warm, 8, max(fixed))  # prepared for the widest before counting
    counter = realistic_moe.DistinctExperts().attach(model.mlx_model)
    methods = {}
    try:
        for b in fixed:
            for prompt in prompts.values():
                *_, st = common.mtp_decode(model, prompt, args.max_tokens, b)
                experts = st.exactness.get("row_exact", {}).get("experts", {})
                methods.update(experts.get("widths", {}))
    finally:
        counter.detach()
    return {"distinct": counter.by_width(), "methods": methods}


def verify_floors(args, arms: dict, model, prompts: dict, bw: float) -> dict:
    """Each width's synced verify against the distinct-expert floor (see the module's doc)."""
    parts = expert_bytes(model)
    counted = count_experts(args, model, prompts)
    E, k, L = parts["experts"], parts["top_k"], parts["layers"]
    verify = {}
    for row in arms["rows"]:
        if row["block_size"] != AUTO:
            for w, ms in row.get("synced_verify_ms_by_width", {}).items():
                if int(w) == row["block_size"]:
                    verify[int(w)] = ms
    step_ms = statistics.median(r.get("synced_step_ms", arms["classic_step_ms"])
                                for r in arms["rows"])
    step_bytes = parts["dense"] + L * k * parts["per_expert"]
    widths = []
    for w, distinct in sorted(counted["distinct"].items()):
        floor = parts["dense"] + L * distinct * parts["per_expert"]
        ms = verify.get(w)
        widths.append({
            "width": w, "verify_ms": ms, "floor_ms": floor / bw / 1e6, "floor_bytes": floor,
            "verify_over_floor": ms / (floor / bw / 1e6) if ms else None,
            "verify_over_step": ms / step_ms if ms else None,
            "floor_over_step_floor": floor / step_bytes,
            "distinct_per_layer": distinct, "over_one_row": distinct / k,
            "random_per_layer": E * (1 - (1 - k / E) ** w),
            "method": counted["methods"].get(str(w), {})})
    synced = [r["stats"] for r in arms.get("synced", []) if r["arm"] != "classic"]
    steps = sum(max(s["drafted"] - s["rounds"], 0) for s in synced)  # the accept hook drafts one
    drafter = drafter_bytes(model)
    return {"bandwidth_gbs": bw, **parts, "step_floor_ms": step_bytes / bw / 1e6,
            "synced_step_ms": step_ms, "widths": widths,
            "drafter_step_ms": (sum(s["phase_ms"]["draft"] for s in synced) / steps
                                if steps else None),
            "drafter_step_bytes": drafter,
            "drafter_step_floor_ms": drafter / bw / 1e6 if drafter else None}


def run(args, watch) -> dict:
    result = {**common.record_setup(args.topic), "model": args.model, "dense": args.dense,
              "drafter": args.drafter, "temps": args.temps, "block_sizes": args.block_sizes,
              "pairs": args.pairs, "max_tokens": args.max_tokens, "prompts": args.prompts,
              "pair_info": common.pair_info(args.model)}
    result["moe"] = {str(t): bench_mtp.run(arms_args(args, args.model, t), watch)
                     for t in args.temps}
    model, tokenizer = mlx_mtp.load(args.model, drafter=args.drafter)
    prompts = {k: encode_prompt(tokenizer, v) for k, v in args.prompts.items()}
    result["experts"] = verify_floors(args, result["moe"]["0.0"], model, prompts,
                                      common.bandwidth_gbs())
    del model
    mx.clear_cache()
    if args.dense:
        result["dense_pair"] = bench_mtp.run(arms_args(args, args.dense, 0.0), watch)
        result["dense_pair_info"] = common.pair_info(args.dense)
    return result


# ------------------------------------------------------------------------------ the record


def _arms_lines(r: dict, title: str) -> list:
    lines = ["", f"## {title}", "",
             "| arm | plain tok/s | MTP tok/s | ratio | per pair | acceptance | tokens/round | "
             "per-position acceptance | identical |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {row['block_size']} | {bench_mtp.result_cells(row)} |" for row in r["rows"]]
    lines.append("")
    lines.append("Round split (synced runs, ms per round): " + "; ".join(
        f"{row['block_size']}: " + ", ".join(f"{p} {ms:.1f}" for p, ms in
                                              row.get("synced_round_ms", {}).items())
        for row in r["rows"]))
    return lines


def _methods(counts: dict) -> str:
    """``{"kernel": 8}`` -> ``kernel (8 layers)``."""
    return ", ".join(f"{m} ({n} layers)" for m, n in sorted(counts.items())) or "-"


def render(r: dict) -> str:
    e = r["experts"]
    info = r.get("pair_info", {})
    lines = common.setup_lines(r) + [
        f"- Pair: `{r['model']}`, {info.get('moe', {})}, residual scale "
        f"{info.get('residual_scale', '?')}, first-draft acceptance "
        f"{info.get('first_draft_acceptance', '?')}",
        f"- Prompts: {', '.join(r['prompts'])}; {r['max_tokens']} tokens; {r['pairs']} pairs",
        f"- Experts: {e['layers']} MoE layers of {e['experts']}, top {e['top_k']}, "
        f"{e['per_expert'] / 1e6:.2f} MB an expert; dense part {e['dense'] / 1e6:.0f} MB",
        f"- Bandwidth {e['bandwidth_gbs']:.1f} GB/s (same run)"]
    for t, arms in r["moe"].items():
        lines += _arms_lines(arms, f"MoE pair, T={t}")
    lines += ["", "## Verify against the distinct-expert floor (T=0, synced)", "",
              f"One-token step: synced plain step {e['synced_step_ms']:.1f} ms, floor "
              f"{e['step_floor_ms']:.1f} ms.", "",
              "| width | verify ms | floor ms | verify / floor | verify / step | "
              "distinct experts / layer | over one row | random routes | method |",
              "|---|---|---|---|---|---|---|---|---|"]
    for w in e["widths"]:
        ms = f"{w['verify_ms']:.1f}" if w["verify_ms"] else "-"
        vf = f"{w['verify_over_floor']:.2f}x" if w["verify_over_floor"] else "-"
        vs = f"{w['verify_over_step']:.2f}" if w["verify_over_step"] else "-"
        lines.append(f"| {w['width']} | {ms} | {w['floor_ms']:.1f} | {vf} | {vs} | "
                     f"{w['distinct_per_layer']:.1f} | {w['over_one_row']:.2f}x | "
                     f"{w['random_per_layer']:.1f} | {_methods(w['method'])} |")
    if e.get("drafter_step_ms") and e.get("drafter_step_floor_ms"):
        lines += ["", f"MTP head draft step (synced): {e['drafter_step_ms']:.1f} ms against its "
                      f"one-row floor {e['drafter_step_floor_ms']:.1f} ms "
                      f"({e['drafter_step_ms'] / e['drafter_step_floor_ms']:.2f}x)."]
    if "dense_pair" in r:
        lines += _arms_lines(r["dense_pair"], f"Dense pair of the same shape, T=0 "
                                              f"(`{r['dense']}`)")
    return "\n".join(lines + common.what_it_says(r))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_moe",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", help="the MoE pair (benchmarks.realistic_pair --moe)")
    p.add_argument("--drafter")
    p.add_argument("--dense", help="a dense pair of the same shape, run at T=0 too")
    p.add_argument("--topic", default="moe-pair")
    p.add_argument("--temps", default="0,0.6", help="comma-separated temperatures")
    p.add_argument("--block-sizes", default="1,2,3,4,5,6,auto")
    p.add_argument("--max-block-size", type=int, default=6)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--synced-runs", type=int, default=1)
    common.add_prompt_args(p)
    common.add_render_arg(p)
    common.add_record_args(p, units=True)
    args = p.parse_args(argv)
    rendered = common.render_instead(args, p, render, None)
    if rendered is not None:
        return rendered
    try:
        args.block_sizes = [b if b == AUTO else int(b) for b in args.block_sizes.split(",")]
        args.temps = [float(t) for t in args.temps.split(",")]
    except ValueError:
        p.error(f"--block-sizes / --temps: expected comma-separated values, got "
                f"{args.block_sizes!r} / {args.temps!r}")
    if (not any(b != AUTO and b >= 2 for b in args.block_sizes) or args.synced_runs < 1
            or 0.0 not in args.temps):
        p.error("--block-sizes needs a fixed block of 2 or more, --temps a 0 and --synced-runs "
                ">= 1 (each width's synced verify at T=0 is set against its floor)")
    if args.pairs < 1 or args.max_tokens < 2 or any(t < 0 for t in args.temps):
        p.error("--pairs >= 1, --max-tokens >= 2 and temperatures >= 0 are required")
    args.prompts = common.prompts_of(args, p)
    watch = common.watch(args)
    return common.finish(args, run(args, watch), watch, render, None)


if __name__ == "__main__":
    main()
