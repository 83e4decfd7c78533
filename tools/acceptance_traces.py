"""Acceptance traces for the block-size simulator (``tools.simulate_chooser``).

The question it answers: for a given pair and prompts, how many drafts does the target keep at
every position of the greedy text? Those traces are what the simulator replays a block-size
policy on.

At T=0 the drafts are a deterministic function of the text: verify rows are bitwise single-token
decode (the exactness gate), so the drafter sees the same hidden states whatever the block sizes.
For each prompt this writes, for every output position p (the bonus is output token p),
L(p) = how many of K consecutive drafts made there the target keeps (the longest prefix of
draft(K) equal to output tokens p + 1 .. p + K). It computes L by replaying the loop one position
at a time (prefill as the loop does, then draft K, feed the target one token, accept one pair),
then checks it against real ``generate_step`` runs (fixed block sizes and ``auto``): every round
of every run must have kept exactly min(L(p), k) of its k drafts at the position p it started at.

    python -m tools.acceptance_traces [--model mlx_mtp/demo_pair] [--max-tokens 128] \
        [--out tests/data/demo_pair_traces.json] [--prompts NAME | --prompts-json FILE] \
        [--cli-default]

Prompts: a set of ``benchmarks.common.PROMPT_SETS`` (``--prompts``, default the benchmarks'
four), or ``--prompts-json`` (an object {name: prompt}); ``--cli-default`` adds the CLI's default
prompt as ``cli-default``, as ``python -m mlx_mtp.generate`` feeds it (e.g. to replay the CLI's
default run in ``python -m tools.simulate_chooser --traces``). The default ``--out`` is the
traces the tests and the simulator read by default.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx_mtp  # first: binds the system BLAS before mlx.core loads
import mlx.core as mx

from benchmarks import common
from mlx_mtp.decoding.block_chooser import BlockChooser
from mlx_mtp.decoding.responses import encode_prompt
from mlx_mtp.generate import DEFAULT_PROMPT, prepare_prompt

ROOT = Path(__file__).resolve().parents[1]


def greedy_text(model, prompt, n):
    """mlx-lm's plain greedy decode: the text every T=0 run emits."""
    from mlx_lm.generate import generate_step
    return [t for t, _ in generate_step(prompt, model.mlx_model, max_tokens=n)]


def trace(model, prompt, text, K):
    """L(p) for p = 0 .. len(text) - K - 1, by the loop's own calls one position at a time."""
    target, drafter = model.target, model.drafter
    cache = target.make_cache()
    target.prepare(K + 1)
    drafter.reset()
    drafter.bind_cache(cache)
    n = prompt.size
    if n > 1:  # the loop's prefill: prompt[:-1] in one chunk (shorter than prefill_step_size)
        drafter.prefill(target.hidden(prompt[None, :-1], cache), prompt[1:])
    h = target.hidden(prompt[None, -1:], cache)
    assert mx.argmax(target.logits(h[:, -1]), axis=-1).item() == text[0]
    drafter.prefill(h, mx.array(text[:1]))
    out = []
    for p in range(len(text) - K):
        drafts = drafter.draft(K).tolist()
        kept = 0
        while kept < K and drafts[kept] == text[p + 1 + kept]:
            kept += 1
        out.append(kept)
        h = target.hidden(mx.array(text[p : p + 1])[None], cache)  # a one-row verify, as a round
        drafter.accept(h, mx.array(text[p + 1 : p + 2]))
    return out


class Recorder(BlockChooser):
    """A fixed number of drafts every round (or ``auto``'s choice), recording (drafts, kept)."""

    def __init__(self, max_drafts, fixed=None):
        super().__init__(max_drafts)
        self.fixed, self.rounds = fixed, []

    def choose(self, limit=None):
        if self.fixed is None:
            return super().choose(limit)
        return min(self.fixed, self.max_drafts if limit is None else limit)

    def record_round(self, drafts, accepted, wall_s):
        self.rounds.append((drafts, accepted))
        super().record_round(drafts, accepted, wall_s)


def check(model, prompt, text, L, n, K):
    """Real runs: every round kept min(L(p), k). Returns the rounds checked."""
    checked = 0
    for fixed in list(range(1, K + 1)) + [None]:
        rec = Recorder(K, fixed)
        got = [t for t, _ in mlx_mtp.generate_step(prompt, model, max_tokens=n, block_size=rec)]
        assert got == text[:n], f"block {fixed}: not the greedy text"
        p = 0
        for k, a in rec.rounds:
            assert a == min(L[p], k), f"drafts {fixed}: round at {p} kept {a}, trace says " \
                                      f"min({L[p]}, {k})"
            p += a + 1
            checked += 1
        assert p == n - 1, (p, n)
    return checked


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "mlx_mtp" / "demo_pair"))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--drafts", type=int, default=5, help="K: drafts judged per position")
    ap.add_argument("--out", default=str(ROOT / "tests" / "data" / "demo_pair_traces.json"))
    ap.add_argument("--no-check", action="store_true", help="skip the real-run check")
    common.add_prompt_args(ap)
    ap.add_argument("--cli-default", action="store_true",
                    help="also the CLI's default prompt, as 'cli-default'")
    args = ap.parse_args(argv)
    prompts = common.prompts_of(args, ap)
    model, tokenizer = mlx_mtp.load(args.model)
    if args.cli_default:  # through the chat template where there is one, as the CLI does
        prompts["cli-default"] = prepare_prompt(tokenizer, DEFAULT_PROMPT, False)
    n, K = args.max_tokens, args.drafts
    traces = {}
    for name, text in prompts.items():
        prompt = encode_prompt(tokenizer, text)
        out = greedy_text(model, prompt, n + K)
        L = trace(model, prompt, out, K)
        rounds = 0 if args.no_check else check(model, prompt, out, L, n, K)
        traces[name] = {"L": L[: n - 1], "tokens": out[:n]}
        print(f"{name}: mean L {sum(L[: n - 1]) / (n - 1):.2f}, {rounds} real rounds agree",
              flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "model": Path(args.model).name, "max_tokens": n, "drafts": K,
        "what": "L[p]: of K drafts made with output token p as the bonus, how many the target "
                "keeps (T=0); python -m tools.acceptance_traces",
        "prompts": traces}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
