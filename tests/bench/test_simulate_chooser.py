"""The block-size simulator: its recorded traces reproduce the idle BLIS record's fixed-block runs
round for round, its cost model is the record's, and it replays the chooser."""

import json
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from mlx_mtp.decoding.block_chooser import BlockChooser, ChooserSettings, RoundCosts
from tools import simulate_chooser as sim

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "tests" / "data" / "records"  # trimmed copies of committed records
# The idle BLIS demo-pair record, whose runs decoded the texts of sim.TRACES.
RECORD = RECORDS / "demo-pair-blis.json"
BIG_RECORD = RECORDS / "big-pair-blis.json"


def simulate(argv):
    """The command line on the fixture record (a later ``--record`` in ``argv`` wins)."""
    return sim.main(["--record", str(RECORD), *argv])


def test_traces_reproduce_the_records_fixed_block_runs():
    """At T=0 a fixed block's rounds are a function of the text: replaying the traces gives the
    rounds and kept drafts every run of the record counted."""
    traces = json.loads(sim.TRACES.read_text())
    record = json.loads(RECORD.read_text())
    costs = sim.costs_from_record(RECORD)
    n = traces["max_tokens"]
    checked = 0
    for block in (2, 3, 4):
        for run in record["raw"][f"mtp{block}"]:
            got = sim.replay(traces["prompts"][run["prompt"]]["L"], n, costs, sim.Noise(0, 0.0),
                             fixed=block)
            rounds = sum(got["widths"].values())
            assert (rounds, n - 1 - rounds) == (run["stats"]["rounds"], run["stats"]["accepted"])
            checked += 1
    assert checked == 3 * record["pairs"] * len(record["prompts"])


def test_cost_model_is_the_records():
    record = {str(r["block_size"]): r for r in json.loads(RECORD.read_text())["rows"]}
    c = sim.costs_from_record(RECORD)
    auto = {int(w): ms for w, ms in record["auto"]["verify_ms_by_width"].items()}
    # auto's own verify costs; a width it never verified from the fixed arm that ran it as its block
    assert c.verify == {w: auto[w] if w in auto else record[str(w)]["verify_ms_by_width"][str(w)]
                        for w in range(1, 7)}
    assert c.plain_step == record["1"]["round_ms"]["residual"]
    # the accept hook line passes through the fixed blocks of fewest and most tokens per round
    fixed_blocks = [b for b in record if b not in ("1", "auto")]
    ends = (min(fixed_blocks, key=lambda b: record[b]["tokens_per_round"]),
            max(fixed_blocks, key=lambda b: record[b]["tokens_per_round"]))
    assert ends == ("2", "6")
    (x0, y0), (x1, y1) = ((record[b]["tokens_per_round"], record[b]["round_ms"]["accept"])
                          for b in ends)
    if y1 >= y0:
        for b in ends:
            assert c.accept(record[b]["tokens_per_round"]) == pytest.approx(
                record[b]["round_ms"]["accept"])
    else:  # the ends say more pairs cost less (noise): the rule makes the line flat, at the median
        flat = statistics.median(record[b]["round_ms"]["accept"] for b in fixed_blocks)
        assert (c.accept(x0), c.accept(x1)) == (pytest.approx(flat), pytest.approx(flat))
    fixed = sim.costs_from_record(RECORD, "fixed")
    assert fixed.verify[3] == record["3"]["verify_ms_by_width"]["3"]
    # a round of 2 drafts keeping 1: verify(3) + one drafter step + accept(2 pairs) + the rest
    assert c.round_ms(2, 1) == pytest.approx(c.verify[3] + c.draft_step + c.accept(2)
                                             + c.finalize + c.residual)
    assert c.round_ms(0, 0) == c.verify[1] + c.residual
    # queued phases (no drafter_step_ms): a drafter step is the draft phase per step 2..k
    assert all(record[b]["drafter_step_ms"] is None for b in fixed_blocks)
    per_step = sorted(record[b]["round_ms"]["draft"] / (int(b) - 2) for b in ("3", "4", "5", "6"))
    assert c.draft_step == pytest.approx((per_step[1] + per_step[2]) / 2)  # median of four


def test_a_width_auto_never_verified_costs_what_its_fixed_arm_measured(tmp_path):
    record = json.loads(RECORD.read_text())
    for r in record["rows"]:
        if r["block_size"] == "auto":
            r["verify_ms_by_width"] = {w: ms for w, ms in r["verify_ms_by_width"].items()
                                       if w not in ("4", "5")}
    path = tmp_path / "record.json"
    path.write_text(json.dumps(record))
    rows = {str(r["block_size"]): r for r in record["rows"]}
    c = sim.costs_from_record(path)
    assert c.verify[4] == rows["4"]["verify_ms_by_width"]["4"]
    assert c.verify[5] == rows["5"]["verify_ms_by_width"]["5"]
    assert c.verify[6] == rows["auto"]["verify_ms_by_width"]["6"]


def test_simulation_is_deterministic_and_reports_every_prompt(capsys):
    traces = json.loads(sim.TRACES.read_text())
    costs = sim.costs_from_record(RECORD)
    a = sim.simulate(traces, costs, seeds=2, sigma=0.15)
    assert a == sim.simulate(traces, costs, seeds=2, sigma=0.15)
    assert list(a) == ["code", "prose", "enumeration", "random"]
    for r in a.values():
        assert r["ratio"] == pytest.approx(r["auto"] / r["fixed"][r["best"]])
        assert r["best"] == max(r["fixed"], key=r["fixed"].get)
    # noise-free, the chooser's rounds on a trace are what BlockChooser chooses there
    L = traces["prompts"]["random"]["L"]
    got = sim.replay(L, 128, costs, sim.Noise(0, 0.0), chooser=BlockChooser(5))
    # widths 1 and 2, the widest, width 5 once (unmeasured beside the choice: tried), then the
    # widest; the last round, width 3, cut by the token budget
    assert got["widths"] == {1: 1, 2: 1, 3: 1, 5: 1, 6: 20}
    simulate(["--seeds", "1"])
    out = capsys.readouterr().out
    assert "| enumeration |" in out and "auto / best fixed" in out


class _Scripted(BlockChooser):
    """No drafts for a stretch of 10 rounds, then one draft a round."""

    def choose(self, limit=None):
        first = self.round == 0
        self._stretch = 10 if first else 1
        return 0 if first else min(1, limit)


def test_a_stretch_without_drafts_runs_at_the_plain_step_and_the_drafter_catches_up_later():
    costs = sim.costs_from_record(RECORD)
    chooser = _Scripted(5)
    got = sim.replay([1] * 13, 14, costs, sim.Noise(0, 0.0), chooser=chooser)
    # 10 pipelined steps (tokens 2-11), then the drafting round's catch-up of their 10 pairs
    # (outside its measured time), a round of one kept draft (tokens 12-13), and the last token
    # by a round without drafts (the budget leaves no room for a draft)
    total = (10 * costs.plain_step + costs.accept(10) + costs.round_ms(1, 1)
             + costs.round_ms(0, 0))
    assert got == {"tps": pytest.approx(13 / total * 1e3), "widths": {1: 11, 2: 1}}
    assert chooser.round == 12  # every step observed
    # with noise, the stretch's steps are observed at their mean, as the loop observes them
    noisy = _Scripted(5)
    sim.replay([1] * 13, 14, costs, sim.Noise(0, 0.15), chooser=noisy)
    ref = sim.Noise(0, 0.15)
    walls = [ref(costs.plain_step) for _ in range(10)]
    assert len(set(walls)) == 10
    assert list(noisy.samples[1])[:4] == [pytest.approx(sum(walls) / 10 / 1e3)] * 4


def test_offsets_replay_each_seed_from_its_own_position():
    traces = json.loads(sim.TRACES.read_text())
    traces["prompts"] = {"code": traces["prompts"]["code"]}
    costs = sim.costs_from_record(RECORD)
    got = sim.simulate(traces, costs, seeds=2, sigma=0.1, offsets=2)["code"]
    L, n = traces["prompts"]["code"]["L"], traces["max_tokens"]
    for b in (1, 4):
        runs = [sim.replay(L[s:], n - s, costs, sim.Noise(1000 * s + b, 0.1), fixed=b)["tps"]
                for s in (0, 1)]
        assert got["fixed"][b] == pytest.approx(sum(runs) / 2)


def test_synthetic_traces_follow_the_per_position_acceptance():
    a = sim.synthetic_traces([0.6, 0.4, 0.1], 200, prompts=2, seed=5)
    assert a == sim.synthetic_traces([0.6, 0.4, 0.1], 200, prompts=2, seed=5)
    assert (a["max_tokens"], a["drafts"], list(a["prompts"])) == (200, 3, ["synthetic-0",
                                                                           "synthetic-1"])
    assert all(len(t["L"]) == 199 and set(t["L"]) <= {0, 1, 2, 3} for t in a["prompts"].values())
    always = sim.synthetic_traces([1.0, 1.0, 0.0], 10, prompts=1)["prompts"]["synthetic-0"]["L"]
    assert always == [2] * 9  # drafts 1 and 2 always kept, draft 3 never


def test_the_accept_hook_never_gets_cheaper_with_more_pairs(tmp_path):
    """Two noisy fixed arms can say the hook cost less at more tokens per round: the model then
    takes it flat at their median instead of a falling line (the realistic-size record's arms,
    with the hook's ms set to fall, as an earlier take of that record had them)."""
    record = json.loads(BIG_RECORD
                        .read_text())
    rows = {str(r["block_size"]): r for r in record["rows"]}
    assert rows["3"]["tokens_per_round"] > rows["2"]["tokens_per_round"]
    rows["2"]["round_ms"]["accept"], rows["3"]["round_ms"]["accept"] = 2.9, 2.1
    path = tmp_path / "falling.json"
    path.write_text(json.dumps(record))
    c = sim.costs_from_record(path)
    assert c.accept_per_pair == 0.0
    assert c.accept_base == pytest.approx((2.9 + 2.1) / 2)
    # rising: the line through the two arms, as for the demo pair
    rows["2"]["round_ms"]["accept"], rows["3"]["round_ms"]["accept"] = 2.1, 2.9
    path.write_text(json.dumps(record))
    c = sim.costs_from_record(path)
    assert c.accept_per_pair > 0
    for b in ("2", "3"):
        assert c.accept(rows[b]["tokens_per_round"]) == pytest.approx(rows[b]["round_ms"]["accept"])


@pytest.mark.parametrize("argv,msg", [
    (["--offsets", "0"], "--offsets: expected 1 to 127 (the traces' tokens less one), got 0"),
    (["--acceptance", "0.5,x"], "--acceptance: expected comma-separated numbers in [0, 1], "
                                "got '0.5,x'"),
    (["--acceptance", "1.5"], "--acceptance: expected comma-separated numbers in [0, 1], "
                              "got '1.5'"),
    (["--acceptance", "0.5", "--max-tokens", "1"], "--max-tokens: expected at least 2, got 1"),
    (["--verify-steps", "1,1.2,1.3"], "--verify-steps: expected 6 or more positive numbers "
                                      "(width 1 up), got '1,1.2,1.3'"),
    (["--verify-steps", "1,1,1,1,1,0"], "--verify-steps: expected 6 or more positive numbers "
                                        "(width 1 up), got '1,1,1,1,1,0'"),
    (["--chooser", "foo=1"], "--chooser: expected KEY=VALUE pairs, KEY one of prior, "
                             "prior_weight, decay, optimism, pooling, cost_window, stale_rounds, "
                             "probe_every, context_weight, min_evidence, explore_reach, "
                             "token_weight, token_context; "
                             "got 'foo=1'"),
    (["--chooser", "decay"], "--chooser: expected KEY=VALUE pairs, KEY one of prior, "
                             "prior_weight, decay, optimism, pooling, cost_window, stale_rounds, "
                             "probe_every, context_weight, min_evidence, explore_reach, "
                             "token_weight, token_context; "
                             "got 'decay'"),
    (["--chooser", "cost_window=1.5"], "--chooser: cost_window expects an integer, got '1.5'"),
    (["--chooser", "cost_window=none"], "--chooser: cost_window expects an integer, got 'none'"),
    (["--chooser", "context_weight=x"], "--chooser: context_weight expects a number or none, "
                                        "got 'x'"),
    (["--chooser", "decay=2"], "--chooser: BlockChooser needs 0 <= prior <= 1, prior_weight > 0, "
                               "0 < decay <= 1"),
    (["--sigma", "loud"], "--sigma: expected a number >= 0 or 'record', got 'loud'"),
    (["--sigma", "-0.1"], "--sigma: expected a number >= 0 or 'record', got '-0.1'"),
    (["--sigma", "nan"], "--sigma: expected a number >= 0 or 'record', got 'nan'"),
])
def test_bad_arguments_name_the_flag(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        simulate(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(msg)


def table_rows(out):
    """The simulator's printed table: row text by its first cell."""
    return {line.split(" | ")[0]: line for line in out.splitlines() if line.startswith("| ")}


def auto_column(out):
    """The auto column of the code prompt's row(s) in the simulator's printed table."""
    return [line.split(" | ")[7] for line in out.splitlines() if line.startswith("| code")]


def test_chooser_settings_replay_auto_with_them(capsys):
    assert sim.chooser_settings("decay=0.8, context_weight=none,min_evidence=0") == {
        "decay": 0.8, "context_weight": None, "min_evidence": 0}
    assert type(sim.chooser_settings("cost_window=3")["cost_window"]) is int
    # the table's auto column is the chooser with those settings, on the same seeds
    traces = json.loads(sim.TRACES.read_text())
    costs = sim.costs_from_record(RECORD)
    argv = ["--seeds", "2", "--offsets", "3"]

    want = {}
    for text, make in (("", BlockChooser),
                       ("optimism=0,context_weight=none",
                        lambda k: BlockChooser(k, settings=ChooserSettings(
                            optimism=0.0, context_weight=None)))):
        got = sim.simulate(traces, costs, 2, 0.15, make_chooser=make, offsets=3)
        want[text] = f"{got['code']['auto']:.1f}"
        simulate(argv + (["--chooser", text] if text else []))
        assert auto_column(capsys.readouterr().out) == [want[text]]
    assert want[""] != want["optimism=0,context_weight=none"]  # the settings changed the choices


def test_a_session_shares_round_costs_across_auto_runs_in_the_records_order(capsys):
    traces = json.loads(sim.TRACES.read_text())
    costs = sim.costs_from_record(RECORD)
    got = sim.simulate(traces, costs, 2, 0.15, offsets=3, session=RoundCosts())

    class First(BlockChooser):  # remembers its first choice
        def choose(self, limit=None):
            k = super().choose(limit)
            self.first = getattr(self, "first", k)
            return k

    # by hand: seed by seed, the prompts in turn, every chooser on the one RoundCosts
    shared, tps, firsts = RoundCosts(), {name: [] for name in traces["prompts"]}, []
    for s in range(2):
        for name, tr in traces["prompts"].items():
            chooser = First(5, round_costs=shared)
            r = sim.replay(tr["L"][s % 3:], 128 - s % 3, costs, sim.Noise(1000 * s + 99, 0.15),
                           chooser=chooser, tokens=tr["tokens"][s % 3:])
            tps[name].append(r["tps"])
            firsts.append(chooser.first)
    alone = sim.simulate(traces, costs, 2, 0.15, offsets=3)
    for name in traces["prompts"]:
        assert got[name]["auto"] == pytest.approx(statistics.mean(tps[name]))
        assert got[name]["fixed"] == alone[name]["fixed"]  # the fixed arms do not change
    # the session's first run measures width 1 first; every later one drafts in its first round
    # on the costs the earlier runs left (how many depends on the record's costs), where a
    # chooser of its own starts at width 1
    assert firsts[0] == 0 and min(firsts[1:]) > 0
    assert BlockChooser(5).choose() == 0
    simulate(["--seeds", "1", "--session"])
    assert "| random |" in capsys.readouterr().out


def test_the_512_token_traces_extend_the_128_token_ones():
    """tests/data/demo_pair_traces_512.json: the same greedy texts, longer (every trace of the
    128-token files is its first 127 positions), plus the CLI's default prompt."""
    long = json.loads((sim.ROOT / "tests" / "data" / "demo_pair_traces_512.json").read_text())
    assert (long["max_tokens"], long["drafts"]) == (512, 5)
    assert list(long["prompts"]) == ["code", "prose", "enumeration", "random", "cli-default",
                                     "code2", "code3", "code4"]
    for name in ("demo_pair_traces.json", "demo_pair_code_traces.json"):
        short = json.loads((sim.ROOT / "tests" / "data" / name).read_text())
        for prompt, tr in short["prompts"].items():
            assert tr["L"] == long["prompts"][prompt]["L"][:127]
            assert tr["tokens"] == long["prompts"][prompt]["tokens"][:128]
    assert all(len(tr["L"]) == 511 for tr in long["prompts"].values())


def test_max_tokens_cuts_recorded_traces(capsys):
    long = json.loads((sim.ROOT / "tests" / "data" / "demo_pair_traces_512.json").read_text())
    cut = sim.cut_traces(long, 128)
    assert cut["max_tokens"] == 128 and list(cut["prompts"]) == list(long["prompts"])
    short = json.loads(sim.TRACES.read_text())
    for prompt, tr in short["prompts"].items():
        assert cut["prompts"][prompt]["L"] == tr["L"]
        assert cut["prompts"][prompt]["tokens"] == tr["tokens"]
    assert long["max_tokens"] == 512  # the input is left as it was
    # through the command line: the 128-token cut replays as the 128-token file does
    path = str(sim.ROOT / "tests" / "data" / "demo_pair_traces_512.json")
    simulate(["--traces", path, "--max-tokens", "128", "--seeds", "1"])
    rows = table_rows(capsys.readouterr().out)
    simulate(["--seeds", "1"])
    want = table_rows(capsys.readouterr().out)
    assert [rows[k] for k in want] == list(want.values())
    with pytest.raises(SystemExit) as e:
        simulate(["--max-tokens", "129"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "--max-tokens: expected 2 to 128 (the traces' tokens), got 129")


def test_judge_all_counts_every_draft_of_every_drafting_round(capsys):
    """``JudgeAll`` counts min(L(p), K) of K drafts (``oracle``) instead of the round's own
    judgments; its cost samples and context stay the round's."""
    c = sim.JudgeAll(3)
    c.oracle = 2  # of 3 drafts here, the target would keep 2
    c.record_round(1, 1, 0.01)  # the round drafted 1 and kept it
    assert (c.tests, c.hits, c.judged) == ([1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1, 1, 1])
    assert c.context == 1 and list(c.samples[2]) == [0.01]
    own = BlockChooser(3)
    own.record_round(1, 1, 0.01)
    assert (own.tests, own.hits, own.judged) == ([1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1, 0, 0])
    # replayed: every drafting round's judgments reach draft 5 on a trace that keeps all five
    chooser = sim.JudgeAll(5)
    costs = sim.costs_from_record(RECORD)
    got = sim.replay([5] * 40, 41, costs, sim.Noise(0, 0.0), chooser=chooser)
    drafting = sum(n for w, n in got["widths"].items() if w > 1)
    assert got["widths"][2] >= 1  # the second round drafts one, and is judged on five
    assert chooser.judged == [drafting] * 5
    # the command line's auto column is JudgeAll's (with --chooser settings on top)
    traces = json.loads(sim.TRACES.read_text())
    want = sim.simulate(traces, costs, 1, 0.15,
                        make_chooser=lambda k: sim.JudgeAll(
                            k, settings=ChooserSettings(optimism=0.0)))["code"]["auto"]
    simulate(["--seeds", "1", "--judge-all", "--chooser", "optimism=0"])
    assert auto_column(capsys.readouterr().out) == [f"{want:.1f}"]
    assert want != sim.simulate(traces, costs, 1, 0.15)["code"]["auto"]


def test_round_spread_gives_each_fixed_blocks_yield_per_round(capsys):
    """``round_yields`` counts the tokens of the rounds ``replay`` times for a fixed block; the
    table gives their count, mean, sd and the mean's standard error as a fraction of the mean."""
    L = [3, 0, 5, 1, 2, 0, 4, 4, 0, 1, 5, 5, 5]
    # block 3 (2 drafts), 10 tokens, the first from the prefill: rounds at p = 0, 3, 5, 6 keep
    # min(L(p), 2) = 2, 1, 0, 2 drafts and emit one more each
    assert sim.round_yields(L, 10, 3) == [3, 2, 1, 3]
    # 9 tokens: the round at p = 6 may keep only 9 - 7 - 1 = 1 (the token budget)
    assert sim.round_yields(L, 9, 3) == [3, 2, 1, 2]
    assert sum(sim.round_yields(L, 10, 6)) == 9  # every token after the first, whatever block
    costs = sim.costs_from_record(RECORD)
    for b in (2, 3, 4, 5, 6):
        got = sim.replay(L, 10, costs, sim.Noise(0, 0.0), fixed=b)
        assert len(sim.round_yields(L, 10, b)) == sum(got["widths"].values())
    # through the command line: the row of block 5 on the code trace
    traces = json.loads(sim.TRACES.read_text())
    y = sim.round_yields(traces["prompts"]["code"]["L"], 128, 5)
    mean, sd = statistics.mean(y), statistics.stdev(y)
    simulate(["--round-spread"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| code | 5 |")]
    assert rows == [["| code", "5", str(len(y)), f"{mean:.2f}", f"{sd:.2f}",
                     f"{sd / len(y) ** 0.5 / mean:.3f} |"]]


def test_synthetic_run_prints_a_table(capsys):
    path = BIG_RECORD
    simulate(["--record", str(path), "--acceptance", "0.6,0.4,0.1,0.1,0.15", "--max-tokens",
              "96", "--seeds", "1"])
    out = capsys.readouterr().out
    assert "| synthetic-3 |" in out and "auto / best fixed" in out


def test_acceptance_traces_agree_with_real_runs_on_a_tiny_pair(tmp_path):
    """The trace script's replay one position at a time and its check against real fixed-block
    and auto runs (which raises on any round that kept other than min(L(p), k))."""
    from support import tiny_checkpoints as tc
    from tools import acceptance_traces

    model = tc.write_agreeing_checkpoint(tmp_path / "pair", seed=3)
    out = tmp_path / "traces.json"
    acceptance_traces.main(["--model", str(model), "--max-tokens", "16", "--drafts", "3",
                            "--out", str(out)])
    got = json.loads(out.read_text())
    assert (got["max_tokens"], got["drafts"]) == (16, 3)
    assert list(got["prompts"]) == ["code", "prose", "enumeration", "random"]
    for tr in got["prompts"].values():
        assert len(tr["L"]) == 15 and len(tr["tokens"]) == 16
        assert all(0 <= x <= 3 for x in tr["L"])
    assert any(x > 0 for tr in got["prompts"].values() for x in tr["L"])  # the head agrees


def test_acceptance_traces_of_given_prompts_and_the_cli_default(tmp_path):
    """``--prompts-json`` replaces the benchmark's prompts; ``--cli-default`` adds the CLI's
    default prompt, fed as the CLI feeds it: its trace's tokens are the CLI's greedy text."""
    from support import tiny_checkpoints as tc
    from tools import acceptance_traces
    import mlx_mtp
    from mlx_mtp.decoding.responses import encode_prompt
    from mlx_mtp.generate import DEFAULT_PROMPT, prepare_prompt

    model = tc.write_agreeing_checkpoint(tmp_path / "pair", seed=3)
    (tmp_path / "p.json").write_text(json.dumps({"add": "def add(a, b):"}))
    out = tmp_path / "traces.json"
    acceptance_traces.main(["--model", str(model), "--max-tokens", "12", "--drafts", "3",
                            "--prompts-json", str(tmp_path / "p.json"), "--cli-default",
                            "--out", str(out)])
    got = json.loads(out.read_text())["prompts"]
    assert list(got) == ["add", "cli-default"]
    m, tok = mlx_mtp.load(str(model))
    prompt = encode_prompt(tok, prepare_prompt(tok, DEFAULT_PROMPT, False))
    assert got["cli-default"]["tokens"] == acceptance_traces.greedy_text(m, prompt, 12)
    assert len(got["add"]["L"]) == len(got["cli-default"]["L"]) == 11


def test_acceptance_traces_refuse_prompts_json_that_is_not_an_object(tmp_path, capsys):
    from tools import acceptance_traces

    (tmp_path / "p.json").write_text(json.dumps(["def add(a, b):"]))
    with pytest.raises(SystemExit) as e:
        acceptance_traces.main(["--prompts-json", str(tmp_path / "p.json")])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        f": error: --prompts-json {tmp_path / 'p.json'}: expected a JSON object of non-empty "
        "prompt strings")


def test_verify_steps_replace_the_records_verify_costs(capsys):
    """``--verify-steps``: verify(w) = the given multiple of the record's plain step; the other
    costs stay the record's."""
    simulate(["--seeds", "1", "--verify-steps", "1,1.25,1.25,1.25,1.35,1.45"])
    out = capsys.readouterr().out
    c = sim.costs_from_record(RECORD)
    want = {w: x * c.plain_step for w, x in enumerate([1, 1.25, 1.25, 1.25, 1.35, 1.45], 1)}
    assert f"costs (ms): {replace(c, verify=want)}" in out
    assert "| random |" in out


AUTO_RECORD = RECORDS / "demo-pair-blis-auto.json"


def test_a_record_without_block_1_takes_the_plain_step_from_mlx_lm_and_own_costs_split_arms():
    """The auto record ran blocks 3-6 and auto, no block 1: the plain step is its measured mlx-lm
    step. ``auto_costs`` (``--verify-arm own``): the fixed arms replay on the fixed arms' verify
    costs, auto on its own rounds'."""
    record = json.loads(AUTO_RECORD.read_text())
    fixed = sim.costs_from_record(AUTO_RECORD, "fixed")
    auto = sim.costs_from_record(AUTO_RECORD, "auto")
    assert fixed.plain_step == auto.plain_step == record["classic_step_ms"]
    rows = {str(r["block_size"]): r for r in record["rows"]}
    assert auto.verify[3] == rows["auto"]["verify_ms_by_width"]["3"]
    assert fixed.verify[3] == rows["3"]["verify_ms_by_width"]["3"]
    traces = json.loads(sim.TRACES.read_text())
    traces["prompts"] = {"code": traces["prompts"]["code"]}
    got = sim.simulate(traces, fixed, seeds=1, sigma=0.0, auto_costs=auto)["code"]
    L = traces["prompts"]["code"]["L"]
    tokens = traces["prompts"]["code"]["tokens"]
    assert got["auto"] == sim.replay(L, 128, auto, sim.Noise(0, 0.0), chooser=BlockChooser(5),
                                     tokens=tokens)["tps"]
    assert got["fixed"][4] == sim.replay(L, 128, fixed, sim.Noise(0, 0.0), fixed=4)["tps"]


def test_fixed_costs_take_width_1_from_the_fixed_arms_that_verified_one_token(tmp_path):
    """In the code-prompt auto record blocks 5 and 6 never ran a one-token round (the budget's
    last round was wider): ``fixed`` costs take width 1 from blocks 3 and 4 (it failed with a
    KeyError); with no fixed arm that ran one, auto's."""
    path = RECORDS / "demo-pair-blis-auto-code.json"
    record = json.loads(path.read_text())
    rows = {str(r["block_size"]): r for r in record["rows"]}
    assert [b for b in ("3", "4", "5", "6") if "1" in rows[b]["verify_ms_by_width"]] == ["3", "4"]
    fixed = sim.costs_from_record(path, "fixed")
    assert fixed.verify[1] == pytest.approx((rows["3"]["verify_ms_by_width"]["1"]
                                             + rows["4"]["verify_ms_by_width"]["1"]) / 2)
    assert fixed.verify[4] == rows["4"]["verify_ms_by_width"]["4"]
    for b in ("3", "4"):
        del rows[b]["verify_ms_by_width"]["1"]
    bare = tmp_path / "record.json"
    bare.write_text(json.dumps(record))
    assert sim.costs_from_record(bare, "fixed").verify[1] == rows["auto"]["verify_ms_by_width"]["1"]


def test_own_costs_from_the_command_line(capsys):
    simulate(["--seeds", "1", "--record", str(AUTO_RECORD), "--verify-arm", "own"])
    out = capsys.readouterr().out
    assert f"costs (ms): {sim.costs_from_record(AUTO_RECORD, 'fixed')}" in out
    assert f"auto's costs (ms): {sim.costs_from_record(AUTO_RECORD, 'auto')}" in out
    with pytest.raises(SystemExit) as e:
        simulate(["--verify-arm", "own", "--verify-steps", "1,1,1,1,1,1"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "--verify-steps: not with --verify-arm own (it sets one verify cost table for every arm)")


def test_sigma_from_the_record_is_its_auto_arms_spread_within_a_run(tmp_path, capsys):
    """``--sigma record`` replays with the record's measured noise (the auto arm's
    round_spread_by_width, all widths): the same table as that number given."""
    record = json.loads(RECORD.read_text())
    auto = next(r for r in record["rows"] if r["block_size"] == "auto")
    auto["round_spread_by_width"] = {"3": {"rounds": 40, "log_sd": 0.05},
                                     "all": {"rounds": 90, "log_sd": 0.0375}}
    path = tmp_path / "record.json"
    path.write_text(json.dumps(record))
    assert sim.record_sigma(path) == 0.0375
    argv = ["--record", str(path), "--seeds", "2", "--offsets", "3"]
    simulate(argv + ["--sigma", "record"])
    measured = capsys.readouterr().out
    assert "sigma (the record's auto arm, within a run): 0.0375" in measured
    simulate(argv + ["--sigma", "0.0375"])
    given = capsys.readouterr().out
    assert table_rows(measured) == table_rows(given)
    simulate(argv)  # the default, 0.15: other round times, another table
    assert table_rows(capsys.readouterr().out) != table_rows(given)
    # a record from before the field: an error naming the flag and the record
    del auto["round_spread_by_width"]
    path.write_text(json.dumps(record))
    with pytest.raises(SystemExit) as e:
        simulate(argv + ["--sigma", "record"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        f"--sigma record: {path} has no auto arm with round_spread_by_width (records before it "
        f"was measured): pass a number")
