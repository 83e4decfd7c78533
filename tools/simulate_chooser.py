"""Replay block-size policies on recorded acceptance traces with a device cost model: tokens per
simulated second for every fixed block size and for ``BlockChooser`` (``block_size="auto"``).

The question it answers: would a change to the block chooser (or to its settings, or to the round
costs) bring ``auto`` closer to the best fixed block size, and on which prompts, before any
wall-clock run? Wall-clock runs on a small shared machine are too noisy to tune a chooser by; at
T=0 the drafts are a function of the text (``tools.acceptance_traces`` records L(p), the drafts kept of K
made at output position p, and the output ids, which auto's chooser is shown as the loop shows
them: ``BlockChooser.see_tokens``), so only the costs need a model. A round of k drafts at
position p keeps a = min(L(p), k) and costs, as the round loop spends it (mlx_mtp.decoding.rounds):

    verify(k + 1) + residual                                    k = 0 (auto defers the accept hook)
    verify(k + 1) + (k - 1) * draft_step + accept(a + 1) + finalize + residual      k >= 1

with accept(n) = accept_base + accept_per_pair * n (never falling with n). Under auto, rounds
without drafts hand their pairs to the drafter at the next drafting round, outside the chooser's
measured time: accept(pairs) then; and a choice of no drafts that commits to a stretch of more
than one round (``BlockChooser.undrafted_stretch``) runs it as the loop does, pipelined one-token
steps at ``plain_step`` each, which the chooser records at their mean when the stretch ends.
Fixed block 1 is the plain path (``plain_step`` per token). Each round's time (what both the
clock and the chooser see) is multiplied by a seeded lognormal factor exp(sigma * N(0, 1));
``--spike-every`` adds a rare stall (x ``--spike``) on top. ``--sigma record`` takes sigma from
the record: its auto arm's measured spread of round times within a run
(``round_spread_by_width``); the default 0.15 is a stress, about 2.5 times what an idle 2-core
machine measures.

The costs come from a ``benchmarks.bench_mtp`` record (``--record``: a record's JSON, or a topic,
whose newest record in benchmark_results/ is read; default the topic ``demo-pair-blis``):
``verify_ms_by_width`` of an arm (``--verify-arm``: ``auto``, the default, takes a width auto
never verified from the fixed arm that ran it as its block; ``fixed`` takes each width from the
fixed arm that verified it most, else auto's; ``own`` gives each arm its own: the fixed blocks the
fixed arms', auto its own rounds', for a record where auto's verifies ran dearer than the fixed
arms' at the same width), the round split of the
fixed arms, the plain step (block 1's, else the record's mlx-lm step), the drafter step
(measured per step where the record waited for each phase; else the draft phase's ms per step,
the device work of queued drafts being inside the verify it overlaps).

For a pair without recorded traces, ``--acceptance`` draws synthetic ones from its per-position
acceptance (independent positions: no text's structure), e.g. the realistic-size pair:
``--record big-pair-blis --acceptance 0.6,0.4,0.1,0.1,0.15 --max-tokens 96``.

    python -m tools.simulate_chooser [--traces tests/data/demo_pair_traces.json] \
        [--seeds 20] [--sigma 0.15] [--verify-arm auto|fixed|own] [--offsets 20] \
        [--verify-steps 1,1.25,1.25,1.25,1.35,1.45] [--session] \
        [--chooser decay=0.8,context_weight=none] [--max-tokens 256] [--judge-all] \
        [--round-spread] [--record RECORD.json | --record TOPIC]

``--max-tokens N`` replays recorded traces cut to their first N tokens (a 512-token trace as a
256-token generation). ``--judge-all`` replays auto with a chooser that learns as if every
drafting round had drafted and verified all its drafts for free (``JudgeAll``): with
``--sigma 0`` (round times without noise) and ``--chooser optimism=0`` (no exploration bonus)
what is left of auto's gap to the best fixed block is neither exploration nor measurement.

``--round-spread`` prints instead, per prompt and fixed block, how many tokens a round emits
along the trace from its start (rounds, mean, standard deviation, and the mean's standard error
as a fraction of it): how well one generation's own rounds can measure a block's yield (no
costs, no record read).

``--session`` gives every auto run one shared ``RoundCosts`` (the round costs a session's
earlier generations measured), the runs in a record's order. ``--chooser`` replays auto with
other ``BlockChooser`` settings (``ChooserSettings``' fields; ``none`` for
``context_weight=None``), to compare a setting against the defaults on the same seeds.
``--verify-steps`` replaces the record's verify costs by multiples of its plain step, width 1 up
(what-if: a verify as cheap as a target asks).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import random
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from benchmarks.common import newest_record
# (pure Python)
from mlx_mtp.decoding.block_chooser import BlockChooser, ChooserSettings, RoundCosts
from mlx_mtp.errors import MTPError

ROOT = Path(__file__).resolve().parents[1]
RECORD_TOPIC = "demo-pair-blis"  # the default record: the newest of this topic
# The demo pair's T=0 traces of the benchmarks' four prompts (``tools.acceptance_traces``'s
# default output), the ones the record's runs decoded.
TRACES = ROOT / "tests" / "data" / "demo_pair_traces.json"


def record_path(text: str) -> Path:
    """``--record``: a record's JSON file, or a topic whose newest record is taken
    (``benchmarks.common.newest_record``). FileNotFoundError when it is neither."""
    path = Path(text)
    if path.suffix == ".json" or path.exists():
        if not path.exists():
            raise FileNotFoundError(f"no such record: {path}")
        return path
    return newest_record(text)


@dataclass
class Costs:
    """Milliseconds."""
    verify: Dict[int, float]  # per verify width
    draft_step: float  # one drafter step (drafts 2..k; the first comes from the accept hook)
    accept_base: float
    accept_per_pair: float
    finalize: float
    residual: float
    plain_step: float  # fixed block 1: the plain one-token path

    def round_ms(self, k: int, a: int) -> float:
        if k == 0:
            return self.verify[1] + self.residual
        return (self.verify[k + 1] + (k - 1) * self.draft_step + self.accept(a + 1)
                + self.finalize + self.residual)

    def accept(self, pairs: int) -> float:
        return self.accept_base + self.accept_per_pair * pairs


def costs_from_record(path: Path, verify_arm: str = "auto") -> Costs:
    rows = {str(r["block_size"]): r for r in json.loads(path.read_text())["rows"]}
    auto = rows["auto"]
    fixed = [r for b, r in rows.items() if b != "auto" and r["block_size"] > 1]
    verify = {int(w): ms for w, ms in auto["verify_ms_by_width"].items()}
    own = {r["block_size"]: r["verify_ms_by_width"][str(r["block_size"])] for r in fixed}
    if verify_arm == "fixed":  # each width from the fixed arm that ran it as its own block
        verify.update(own)
        ones = [r["verify_ms_by_width"]["1"] for r in fixed if "1" in r["verify_ms_by_width"]]
        if ones:  # else auto's (fixed arms of 3+ drafts that never ran short of the budget)
            verify[1] = statistics.median(ones)
    else:  # a width auto never verified in the record: the fixed arm's that ran it as its block
        for w, ms in own.items():
            verify.setdefault(w, ms)
    # accept hook ms per round against the pairs it consumed (tokens per round): a line
    pts = [(r["tokens_per_round"], r["round_ms"]["accept"]) for r in fixed]
    (x0, y0), (x1, y1) = min(pts), max(pts)
    slope = (y1 - y0) / (x1 - x0) if x1 != x0 else 0.0
    if slope < 0:  # more pairs never cost less (a record of two noisy arms can say so): flat
        slope, x0, y0 = 0.0, 0.0, statistics.median(y for _, y in pts)
    steps = [r["drafter_step_ms"] for r in fixed if r["drafter_step_ms"]]
    if not steps:  # queued phases: the draft phase is the host's share of steps 2..k (their
        # device work is timed in the verify it overlaps), so take it per step as measured
        steps = [r["round_ms"]["draft"] / (r["block_size"] - 2) for r in fixed
                 if r["block_size"] > 2]
    return Costs(verify=verify, draft_step=statistics.median(steps),
                 accept_base=y0 - slope * x0, accept_per_pair=slope,
                 finalize=statistics.median(r["round_ms"]["finalize"] for r in fixed),
                 residual=statistics.median(r["round_ms"]["residual"] for r in fixed),
                 plain_step=(rows["1"]["round_ms"]["residual"] if "1" in rows
                             else json.loads(path.read_text())["classic_step_ms"]))


def record_sigma(path: Path) -> float:
    """The record's auto arm's spread of round times within a run (the standard deviation of
    log(round wall time) from its mean at the same width, pooled over widths and runs:
    ``round_spread_by_width["all"]``): the noise the cost model's lognormal factor stands for."""
    rows = {str(r["block_size"]): r for r in json.loads(path.read_text())["rows"]}
    spread = rows.get("auto", {}).get("round_spread_by_width", {}).get("all")
    if spread is None:
        raise MTPError(f"{path} has no auto arm with round_spread_by_width (records before it "
                       f"was measured): pass a number")
    return spread["log_sd"]


def synthetic_traces(acceptance: List[float], max_tokens: int, prompts: int = 4,
                     seed: int = 0) -> dict:
    """Traces for a pair no trace was recorded for, from its per-position acceptance (a_j =
    P(draft j kept | drafts 1..j-1 kept), e.g. a record's ``per_position_acceptance``): L(p)
    drawn independently per position, seeded; one trace per "prompt"."""
    rng = random.Random(seed)
    out = {}
    for i in range(prompts):
        L = []
        for _ in range(max_tokens - 1):
            kept = 0
            while kept < len(acceptance) and rng.random() < acceptance[kept]:
                kept += 1
            L.append(kept)
        out[f"synthetic-{i}"] = {"L": L}
    return {"max_tokens": max_tokens, "drafts": len(acceptance), "prompts": out}


def cut_traces(traces: dict, max_tokens: int) -> dict:
    """The traces of the first ``max_tokens`` tokens of each run: L(p) of every position p whose
    drafts a generation of that many tokens could still make (max_tokens - 1 of them)."""
    prompts = {name: {**t, "L": t["L"][: max_tokens - 1],
                      **({"tokens": t["tokens"][:max_tokens]} if "tokens" in t else {})}
               for name, t in traces["prompts"].items()}
    return {**traces, "max_tokens": max_tokens, "prompts": prompts}


class JudgeAll(BlockChooser):
    """A chooser that learns as if every drafting round had drafted and verified all its
    ``max_drafts`` drafts, for free: ``replay`` sets ``oracle`` to the kept length of K drafts at
    the round's position (min(L(p), K)) before each ``record_round``, and the round's judgments
    count that instead of its own (its cost and context stay its own). An upper bound on what measuring
    acceptance could tell a chooser (``--judge-all``)."""

    oracle: Optional[int] = None

    def count(self, drafts: int, accepted: int) -> None:
        super().count(self.max_drafts, self.oracle)


class Noise:
    def __init__(self, seed: int, sigma: float, spike_every: int = 0, spike: float = 1.0):
        self.rng = random.Random(seed)
        self.sigma, self.spike_every, self.spike = sigma, spike_every, spike

    def __call__(self, ms: float) -> float:
        f = math.exp(self.sigma * self.rng.gauss(0.0, 1.0))
        if self.spike_every and self.rng.random() < 1.0 / self.spike_every:
            f *= self.spike
        return ms * f


def replay(L: List[int], n: int, costs: Costs, noise: Noise, fixed: Optional[int] = None,
           chooser: Optional[BlockChooser] = None, max_drafts: int = 5,
           tokens: Optional[List[int]] = None) -> dict:
    """One generation of ``n`` tokens (the first from the prefill, untimed, as the record's
    tok/s): ``fixed`` block size, or the ``chooser``'s rounds. ``tokens``: the trace's output
    ids, which the chooser sees as the loop shows them (``BlockChooser.see_tokens``); None
    (synthetic traces) shows none. Returns tok/s and widths used."""
    widths: Dict[int, int] = {}
    if chooser is None:
        if fixed == 1:
            total = sum(noise(costs.plain_step) for _ in range(n - 1))
            return {"tps": (n - 1) / total * 1e3, "widths": {1: n - 1}}
        total = 0.0
        for k, a in fixed_rounds(L, n, min(fixed, max_drafts + 1)):
            # a fixed arm's last round, without drafts, still runs the accept hook
            total += noise(costs.round_ms(k, a) + (costs.accept(1) if k == 0 else 0.0))
            widths[k + 1] = widths.get(k + 1, 0) + 1
        return {"tps": (n - 1) / total * 1e3, "widths": widths}
    emitted, p, total, deferred, seen = 1, 0, 0.0, 0, 0
    while emitted < n:
        if tokens is not None:  # up to the round's first token, the bonus at p
            chooser.see_tokens(tokens[seen : p + 1])
            seen = p + 1
        k = chooser.choose(min(max_drafts, n - emitted - 1))
        steps = min(chooser.undrafted_stretch(), n - emitted) if k == 0 else 0
        if steps > 1:  # a stretch: pipelined one-token steps, recorded at their mean as the
            # loop records them (a pipelined step has no time of its own)
            stretch = sum(noise(costs.plain_step) for _ in range(steps))
            total += stretch
            for _ in range(steps):
                chooser.record_round(0, 0, stretch / steps / 1e3)
            deferred += steps
            widths[1] = widths.get(1, 0) + steps
            emitted += steps
            p += steps
            continue
        if k > 0 and deferred:
            total += noise(costs.accept(deferred))  # the catch-up, outside the round's time
            deferred = 0
        a = min(L[p], k)
        if isinstance(chooser, JudgeAll):
            chooser.oracle = min(L[p], chooser.max_drafts)
        wall = noise(costs.round_ms(k, a))
        total += wall
        chooser.record_round(k, a, wall / 1e3)
        deferred += k == 0
        widths[k + 1] = widths.get(k + 1, 0) + 1
        emitted += a + 1
        p += a + 1
    return {"tps": (n - 1) / total * 1e3, "widths": widths}


def simulate(traces: dict, costs: Costs, seeds: int, sigma: float, make_chooser=BlockChooser,
             max_block_size: int = 6, spike_every: int = 0, spike: float = 1.0,
             offsets: int = 1, auto_costs: Optional[Costs] = None,
             session: Optional[RoundCosts] = None) -> dict:
    """Per prompt: mean tok/s over seeds of every fixed block size and of auto; auto's ratio to
    the best fixed block (by mean), its worst seed, and the widths it chose (summed).

    At T=0 a trace's rejections sit at fixed positions, so which rounds land on them (the
    alignment) moves a run's tok/s by several percent whatever the policy. ``offsets`` > 1
    averages that luck out: seed s replays the trace from position s % offsets (every arm the
    same, the run that many tokens shorter). ``auto_costs``: auto's rounds cost these instead
    of ``costs`` (``--verify-arm own``). ``session``: every auto run's chooser shares these
    round costs (``BlockChooser(round_costs=)``), the runs in a record's order: seed by seed,
    the prompts in turn within each."""
    fixed = {name: {b: [] for b in range(1, max_block_size + 1)} for name in traces["prompts"]}
    auto = {name: [] for name in traces["prompts"]}
    widths = {name: {} for name in traces["prompts"]}
    for s in range(seeds):
        o = s % offsets
        for name, tr in traces["prompts"].items():
            L, n = tr["L"][o:], traces["max_tokens"] - o
            for b in fixed[name]:
                fixed[name][b].append(replay(L, n, costs, Noise(1000 * s + b, sigma, spike_every,
                                                                spike), fixed=b)["tps"])
            chooser = (make_chooser(max_block_size - 1) if session is None
                       else make_chooser(max_block_size - 1, round_costs=session))
            r = replay(L, n, auto_costs or costs, Noise(1000 * s + 99, sigma, spike_every, spike),
                       chooser=chooser, max_drafts=max_block_size - 1,
                       tokens=tr["tokens"][o:] if "tokens" in tr else None)
            auto[name].append(r["tps"])
            for w, c in r["widths"].items():
                widths[name][w] = widths[name].get(w, 0) + c
    out = {}
    for name in traces["prompts"]:
        means = {b: statistics.mean(v) for b, v in fixed[name].items()}
        best = max(means, key=means.get)
        mean = statistics.mean(auto[name])
        out[name] = {"fixed": means, "auto": mean, "best": best, "ratio": mean / means[best],
                     "worst_seed_ratio": min(a / means[best] for a in auto[name]),
                     "widths": dict(sorted(widths[name].items()))}
    return out


def fixed_rounds(L: List[int], n: int, block: int) -> List[Tuple[int, int]]:
    """(drafts, kept) of each round of a fixed-``block`` run of ``n`` tokens over trace ``L``:
    the first token from the prefill, as the record's tok/s; the token budget cuts the drafts
    of the last rounds. ``replay`` times these rounds; ``round_yields`` counts their tokens."""
    emitted, p, out = 1, 0, []
    while emitted < n:
        k = min(block - 1, n - emitted - 1)
        a = min(L[p], k)
        out.append((k, a))
        emitted += a + 1
        p += a + 1
    return out


def round_yields(L: List[int], n: int, block: int) -> List[int]:
    """Tokens each round emits along a fixed-``block`` run of ``n`` tokens over trace ``L``
    (``fixed_rounds``: the rounds ``replay`` times)."""
    return [a + 1 for _, a in fixed_rounds(L, n, block)]


def spread_table(traces: dict, max_block_size: int = 6) -> str:
    """Per prompt and fixed block 2..``max_block_size``: rounds, tokens per round (mean and
    standard deviation) and the mean's standard error over its rounds as a fraction of it."""
    lines = ["| prompt | block | rounds | tokens / round | sd | standard error / mean |",
             "|---|---|---|---|---|---|"]
    n = traces["max_tokens"]
    for name, t in traces["prompts"].items():
        for b in range(2, max_block_size + 1):
            y = round_yields(t["L"], n, b)
            mean, sd = statistics.mean(y), statistics.stdev(y) if len(y) > 1 else 0.0
            lines.append(f"| {name} | {b} | {len(y)} | {mean:.2f} | {sd:.2f} | "
                         f"{sd / math.sqrt(len(y)) / mean:.3f} |")
    return "\n".join(lines)


def table(result: dict, max_block_size: int = 6) -> str:
    head = ("| prompt | " + " | ".join(f"block {b}" for b in range(1, max_block_size + 1))
            + " | auto | auto / best fixed | worst seed | widths auto chose |")
    lines = [head, "|" + "---|" * (max_block_size + 5)]
    for name, r in result.items():
        lines.append(f"| {name} | " + " | ".join(f"{r['fixed'][b]:.1f}"
                                                 for b in range(1, max_block_size + 1))
                     + f" | {r['auto']:.1f} | {r['ratio']:.3f} (block {r['best']}) | "
                       f"{r['worst_seed_ratio']:.3f} | "
                     + ", ".join(f"{w}: {c}" for w, c in r["widths"].items()) + " |")
    return "\n".join(lines)


def chooser_settings(text: str) -> dict:
    """``KEY=VALUE,...`` -> keyword arguments of ``ChooserSettings``: each value as the type of
    the setting's default (int or float), ``none`` for None where the setting takes None. Raises
    ValueError with the reason."""
    params = {f.name: f for f in dataclasses.fields(ChooserSettings)}
    out = {}
    for item in text.split(","):
        key, eq, value = (x.strip() for x in item.partition("="))
        if not eq or key not in params:
            raise ValueError(f"expected KEY=VALUE pairs, KEY one of {', '.join(params)}; "
                             f"got {item!r}")
        whole = isinstance(params[key].default, int)
        optional = "Optional" in str(params[key].type)
        try:
            if optional and value.lower() == "none":
                out[key] = None
            else:
                out[key] = int(value) if whole else float(value)
        except ValueError:
            kind = ("an integer" if whole else "a number") + (" or none" if optional else "")
            raise ValueError(f"{key} expects {kind}, got {value!r}") from None
    try:
        ChooserSettings(**out)
    except MTPError as e:
        raise ValueError(str(e)) from None
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default=str(TRACES))
    ap.add_argument("--acceptance", help="instead of --traces: synthetic traces from this "
                    "per-position acceptance, comma-separated (e.g. 0.6,0.4,0.1,0.1,0.15)")
    ap.add_argument("--max-tokens", type=int,
                    help="tokens per run: of the --acceptance traces (default 128), or the "
                         "recorded --traces cut to their first MAX_TOKENS (default: all)")
    ap.add_argument("--record", default=RECORD_TOPIC, metavar="RECORD.json|TOPIC",
                    help="the bench_mtp record whose round costs are replayed, or a topic whose "
                         f"newest record in benchmark_results/ is (default: {RECORD_TOPIC})")
    ap.add_argument("--verify-arm", choices=("auto", "fixed", "own"), default="auto",
                    help="verify cost per width: the record's auto arm's, the fixed arms' (each "
                         "width from the arm that verified it most), or each arm its own (fixed "
                         "blocks the fixed arms', auto its own rounds': a record where auto's "
                         "verifies ran dearer than the fixed arms' at the same width)")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--sigma", default="0.15",
                    help="log-sd of a round's time noise, or 'record': the record's auto arm's "
                         "measured spread within a run (round_spread_by_width, all widths)")
    ap.add_argument("--spike-every", type=int, default=0, help="a stall every N rounds on average")
    ap.add_argument("--spike", type=float, default=5.0, help="the stall's factor")
    ap.add_argument("--max-block-size", type=int, default=6)
    ap.add_argument("--verify-steps", help="verify cost per width 1.. as multiples of the "
                    "record's plain step, comma-separated (default: the record's own)")
    ap.add_argument("--offsets", type=int, default=1,
                    help="seed s replays the traces from position s %% OFFSETS (averages out "
                         "where the rejections fall against the rounds; 1: from the start)")
    ap.add_argument("--session", action="store_true",
                    help="auto's runs share their round costs (BlockChooser(round_costs=)), as "
                         "the generations of one session can: seed by seed, each prompt in turn")
    ap.add_argument("--chooser", help="auto's BlockChooser settings, KEY=VALUE comma-separated "
                    "(e.g. decay=0.8,context_weight=none; default: its defaults)")
    ap.add_argument("--judge-all", action="store_true",
                    help="auto learns as if every drafting round had judged all its drafts for "
                         "free (JudgeAll: what measuring acceptance could tell it at best)")
    ap.add_argument("--round-spread", action="store_true",
                    help="print, per prompt and fixed block, the tokens a round emits along the "
                         "trace (mean, sd, standard error / mean) instead of replaying")
    args = ap.parse_args(argv)
    if args.sigma != "record":
        given = args.sigma
        try:
            args.sigma = float(given)
        except ValueError:
            args.sigma = -1.0
        if not args.sigma >= 0:  # (nan too)
            ap.error(f"--sigma: expected a number >= 0 or 'record', got {given!r}")
    make_chooser = JudgeAll if args.judge_all else BlockChooser
    if args.chooser:
        try:
            make_chooser = functools.partial(
                make_chooser, settings=ChooserSettings(**chooser_settings(args.chooser)))
        except ValueError as e:
            ap.error(f"--chooser: {e}")
    if args.acceptance:
        try:
            acceptance = [float(x) for x in args.acceptance.split(",")]
        except ValueError:
            acceptance = []
        if not acceptance or not all(0.0 <= a <= 1.0 for a in acceptance):
            ap.error(f"--acceptance: expected comma-separated numbers in [0, 1], "
                     f"got {args.acceptance!r}")
        if args.max_tokens is None:
            args.max_tokens = 128
        if args.max_tokens < 2:
            ap.error(f"--max-tokens: expected at least 2, got {args.max_tokens}")
        traces = synthetic_traces(acceptance, args.max_tokens)
    else:
        traces = json.loads(Path(args.traces).read_text())
        if args.max_tokens is not None:
            if not 2 <= args.max_tokens <= traces["max_tokens"]:
                ap.error(f"--max-tokens: expected 2 to {traces['max_tokens']} (the traces' "
                         f"tokens), got {args.max_tokens}")
            traces = cut_traces(traces, args.max_tokens)
    if not 1 <= args.offsets < traces["max_tokens"]:
        ap.error(f"--offsets: expected 1 to {traces['max_tokens'] - 1} (the traces' tokens "
                 f"less one), got {args.offsets}")
    if args.round_spread:
        print(spread_table(traces, args.max_block_size))
        return
    try:
        args.record = record_path(args.record)
    except FileNotFoundError as e:
        ap.error(f"--record: {e}")
    own = args.verify_arm == "own"
    costs = costs_from_record(args.record, "fixed" if own else args.verify_arm)
    auto_costs = costs_from_record(args.record, "auto") if own else None
    if args.verify_steps and own:
        ap.error("--verify-steps: not with --verify-arm own (it sets one verify cost table for "
                 "every arm)")
    if args.verify_steps:
        try:
            steps = [float(x) for x in args.verify_steps.split(",")]
        except ValueError:
            steps = []
        if len(steps) < args.max_block_size or not all(x > 0 for x in steps):
            ap.error(f"--verify-steps: expected {args.max_block_size} or more positive numbers "
                     f"(width 1 up), got {args.verify_steps!r}")
        costs = replace(costs, verify={w: x * costs.plain_step for w, x in enumerate(steps, 1)})
    sigma = args.sigma
    if sigma == "record":
        try:
            sigma = record_sigma(args.record)
        except MTPError as e:
            ap.error(f"--sigma record: {e}")
        print(f"sigma (the record's auto arm, within a run): {sigma:.4f}")
    print(f"costs (ms): {costs}")
    if auto_costs is not None:
        print(f"auto's costs (ms): {auto_costs}")
    result = simulate(traces, costs, args.seeds, sigma, make_chooser=make_chooser,
                      max_block_size=args.max_block_size,
                      spike_every=args.spike_every, spike=args.spike, offsets=args.offsets,
                      auto_costs=auto_costs, session=RoundCosts() if args.session else None)
    print(table(result, args.max_block_size))


if __name__ == "__main__":
    main()
