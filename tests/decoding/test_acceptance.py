"""The acceptance rule objects (``mlx_mtp.decoding.acceptance``): which one a request gets, what
each drafts, draws and keeps; and that the round steps call the rule instead of asking which it
is. No model: runs in seconds."""

import ast
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from mlx_mtp import MTPError
from mlx_mtp.decoding import acceptance as A
from mlx_mtp.decoding import keyed_sampling, sampling
from mlx_mtp.decoding.keyed_sampling import PositionKeys
from mlx_mtp.decoding.sampling import RandomStreams, make_sampler

VOCAB = 32


class ScriptedDrafter:
    """Drafts ``ids`` greedily; sampled drafts go through ``sample`` over the rows of
    ``logits [k, V]``, one per draft."""

    def __init__(self, ids=(), logits=None):
        self.ids, self.logits = list(ids), logits

    def draft(self, k):
        return mx.array(self.ids[:k], dtype=mx.uint32)

    def draft_sampled(self, k, sample):
        for j in range(k):
            sample(self.logits[j : j + 1])


class GreedyOnly:
    def draft(self, k):
        raise AssertionError


def request(sampler, *, acceptance="auto", auto=False, tree=False, seed=None, processors=None):
    return SimpleNamespace(sampler=sampler, logits_processors=processors, acceptance=acceptance,
                           chooser=object() if auto else None, tree=object() if tree else None,
                           seed=seed)


def random_logits(rows, key):
    return 3.0 * mx.random.normal((rows, VOCAB), key=mx.random.key(key))


# --------------------------------------------------------------------------- choosing a rule


@pytest.mark.parametrize("sampler,drafter,kw,cls,name", [
    (None, ScriptedDrafter(), {}, A.Greedy, "greedy"),
    (make_sampler(), ScriptedDrafter(), {"auto": True}, A.Greedy, "greedy"),
    (make_sampler(temp=0.8), ScriptedDrafter(), {}, A.SpeculativeSampling,
     "speculative-sampling"),
    (make_sampler(temp=0.8), ScriptedDrafter(), {"auto": True}, A.GumbelCoupled,
     "gumbel-coupled"),
    (make_sampler(temp=0.8), GreedyOnly(), {"auto": True}, A.KeyedPointMass, "point-mass"),
    (make_sampler(temp=0.8), GreedyOnly(), {}, A.PointMass, "point-mass"),
    (make_sampler(temp=0.8), ScriptedDrafter(), {"tree": True}, A.PointMass, "point-mass"),
    (make_sampler(temp=0.8), ScriptedDrafter(), {"acceptance": "point-mass", "auto": True},
     A.KeyedPointMass, "point-mass"),
])
def test_a_request_gets_one_rule_object_named_as_the_stats_report_it(sampler, drafter, kw, cls,
                                                                     name):
    rule = A.choose_rule(request(sampler, seed=5, **kw), drafter, VOCAB)
    assert type(rule) is cls and rule.name == name
    assert rule.samples == (name != "greedy")
    assert rule.keyed == (cls in (A.KeyedPointMass, A.GumbelCoupled))
    assert rule.drafts_argmax == (cls in (A.Greedy, A.PointMass, A.KeyedPointMass))


def test_a_rule_takes_a_seed_from_the_global_stream_only_when_it_keys_its_draws():
    """Point-mass at a fixed block size samples from mlx's global stream: choosing it draws
    nothing from that stream. Speculative sampling without a seed takes its streams' seed from
    it (the first ``randint``); with one, it uses that."""
    hot = make_sampler(temp=0.8)
    mx.random.seed(3)
    want = mx.random.randint(0, 2**31 - 1).item()
    mx.random.seed(3)
    A.choose_rule(request(hot), GreedyOnly(), VOCAB)
    assert mx.random.randint(0, 2**31 - 1).item() == want
    mx.random.seed(3)
    assert A.choose_rule(request(hot), ScriptedDrafter(), VOCAB).streams.seed == want
    assert A.choose_rule(request(hot, seed=9), ScriptedDrafter(), VOCAB).streams.seed == 9
    assert A.choose_rule(request(hot, seed=9, auto=True), ScriptedDrafter(), VOCAB).keys.seed == 9


def test_a_tree_request_for_speculative_sampling_is_refused():
    with pytest.raises(MTPError, match="^acceptance speculative-sampling drafts chains: a draft "
                                         r"tree \(draft_topk above 1\) is walked by the "
                                         "point-mass rule$"):
        A.choose_rule(request(make_sampler(temp=0.8), acceptance="speculative-sampling",
                              tree=True), ScriptedDrafter(), VOCAB)


# ------------------------------------------------------------------------------- accepting


def test_the_point_mass_rules_keep_drafts_while_they_equal_the_target_draws():
    rule = A.PointMass(make_sampler(temp=0.8), [])
    picks = [5, 7, 9, 4]
    assert rule.accepted(picks, [5, 7, 9], []) == 3
    assert rule.accepted(picks, [5, 7, 2], []) == 2
    assert rule.accepted(picks, [6, 7, 9], []) == 0
    assert A.Greedy(None, []).accepted(picks, [5, 8, 9], []) == 1


def test_speculative_sampling_keeps_what_its_verdicts_say_not_what_equals_the_draws():
    rule = A.SpeculativeSampling(make_sampler(temp=0.8), [], RandomStreams(1))
    assert rule.accepted([5, 7, 9, 4], [5, 7, 9], [1, 0, 1]) == 1
    assert rule.accepted([5, 7, 9, 4], [1, 2, 3], [1, 1, 1]) == 3
    assert rule.accepted([5], [], []) == 0


# --------------------------------------------------------------------------------- drafting


def test_a_point_mass_rule_drafts_the_drafters_argmax():
    drafter = ScriptedDrafter(ids=[3, 1, 4, 1])
    for rule in (A.Greedy(None, []), A.PointMass(make_sampler(temp=0.8), []),
                 A.KeyedPointMass(make_sampler(temp=0.8), [], PositionKeys(2))):
        proposal = rule.draft(drafter, 3, None, 4, VOCAB)
        assert proposal.ids.tolist() == [3, 1, 4]
        assert proposal.probs is None and proposal.noise == ()


def test_speculative_sampling_drafts_from_q_on_its_draft_stream_and_keeps_q():
    """One-hot draft rows: the drafts are their columns, q their rows; drafting takes keys from
    the draft stream only, so the target's next key is a fresh stream's first."""
    columns = [6, 2, 11]
    rows = np.full((3, VOCAB), -np.inf, dtype=np.float32)
    rows[range(3), columns] = 0.0
    logits = mx.array(rows)
    sampler = make_sampler(temp=0.8)
    rule = A.SpeculativeSampling(sampler, [], RandomStreams(7))
    proposal = rule.draft(ScriptedDrafter(logits=logits), 3, None, 1, VOCAB)
    assert proposal.ids.tolist() == columns
    assert proposal.probs.tolist() == sampler.probs(logits).tolist()
    assert proposal.prob_ids is None
    assert rule.streams.target().tolist() == RandomStreams(7).target().tolist()


def test_coupled_drafts_are_the_target_draws_when_q_equals_p():
    """Gumbel coupling: a drafter whose rows equal the target's draws at each position exactly
    the target's keyed draw there, and the target's draws that reuse the drafts' noise are the
    draws made from the position keys afresh."""
    sampler = make_sampler(temp=1.0)
    keys = PositionKeys(12)
    logits = random_logits(3, 1)
    rule = A.GumbelCoupled(sampler, [], keys)
    proposal = rule.draft(ScriptedDrafter(logits=logits), 3, None, 5, VOCAB)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    fresh = keyed_sampling.draw(sampler, logprobs, keys, 5, logits=logits)
    assert proposal.ids.tolist() == fresh.tolist()
    block = mx.concatenate([mx.array([0], dtype=mx.uint32), proposal.ids])
    reused, verdicts = rule.draw_targets(logits, logprobs, proposal, block, 5)
    assert reused.tolist() == fresh.tolist() and verdicts == []
    assert len(set(fresh.tolist())) > 1  # (the three positions drew with different noise)


# --------------------------------------------------------------------------------- drawing


def test_keyed_draws_depend_on_the_position_not_on_how_rows_are_cut():
    sampler = make_sampler(temp=1.0)
    rule = A.KeyedPointMass(sampler, [], PositionKeys(4))
    logits = random_logits(4, 2)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    whole, _ = rule.draw_targets(logits, logprobs, A.Draft(), mx.zeros((4,), mx.uint32), 10)
    one_by_one = [rule.draw_token(logits[i : i + 1], logprobs[i : i + 1], 10 + i).item()
                  for i in range(4)]
    assert whole.tolist() == one_by_one


def test_speculative_sampling_draws_its_first_token_on_the_target_stream():
    sampler = make_sampler(temp=1.0)
    logits = random_logits(1, 3)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    rule = A.SpeculativeSampling(sampler, [], RandomStreams(21))
    want = sampler.sample(logprobs, RandomStreams(21).target())
    assert rule.draw_token(logits, logprobs, 0).tolist() == want.tolist()


def test_speculative_sampling_verify_rows_are_block_verification_on_the_target_stream():
    sampler = make_sampler(temp=1.0)
    draft_logits, logits = random_logits(2, 4), random_logits(3, 5)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    rule = A.SpeculativeSampling(sampler, [], RandomStreams(8))
    proposal = rule.draft(ScriptedDrafter(logits=draft_logits), 2, None, 1, VOCAB)
    block = mx.concatenate([mx.array([0], dtype=mx.uint32), proposal.ids])
    streams = RandomStreams(8)
    streams.draft()
    want_verdicts, want_ids = sampling.rejection_sample(
        sampler.probs(logits), proposal.probs, proposal.ids, streams.target())
    target_ids, (verdicts,) = rule.draw_targets(logits, logprobs, proposal, block, 1)
    assert target_ids.tolist() == want_ids.tolist()
    assert verdicts.dtype == mx.uint32 and verdicts.tolist() == want_verdicts.tolist()


# ----------------------------------------------------------------- the steps ask no rule


STEP_MODULES = ["round_steps.py", "pipelined_steps.py", "batch_rounds.py"]
RULE_NAMES = {"greedy", "point-mass", "speculative-sampling", "gumbel-coupled"}
RULE_CONSTANTS = {"GREEDY", "POINT_MASS", "SPECULATIVE", "COUPLED"}
RULE_CLASSES = {"Greedy", "PointMass", "KeyedPointMass", "GumbelCoupled", "SpeculativeSampling"}


def rule_questions(source: str) -> list:
    """``(function, line, what)`` wherever a function's code names a rule (its name string or
    constant, its class, a rule's ``name``) or reads ``.keys`` / ``.streams`` other than as a
    method call."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        called = {id(n.func) for n in ast.walk(fn) if isinstance(n, ast.Call)}
        for node in ast.walk(fn):
            what = None
            if isinstance(node, ast.Constant) and node.value in RULE_NAMES:
                what = repr(node.value)
            elif isinstance(node, ast.Name) and node.id in RULE_CONSTANTS | RULE_CLASSES:
                what = node.id
            elif isinstance(node, ast.Attribute):
                if node.attr in RULE_CONSTANTS | RULE_CLASSES:
                    what = node.attr
                elif node.attr in ("keys", "streams") and id(node) not in called:
                    what = "." + node.attr
                elif node.attr == "name" and "rule" in ast.unparse(node.value):
                    what = ast.unparse(node)
            if what is not None:
                found.append((node.lineno, node.col_offset, fn.name, what))
    return [(name, line, what) for line, _, name, what in sorted(found)]


def test_the_round_steps_call_the_rule_and_never_ask_which_it_is():
    decoding = Path(A.__file__).parent
    for module in STEP_MODULES:
        assert rule_questions((decoding / module).read_text()) == [], module


def test_the_rule_question_finder_finds_the_branches_it_forbids():
    source = '''
def first(session, logprobs):
    if session.draws.keys is not None:
        return 1
    return session.draws.streams is None

def second(draws):
    return draws.rule == keyed_sampling.COUPLED or draws.rule == "point-mass"

def third(session):
    return 1 if session.rule.name == GREEDY else isinstance(session.rule, A.SpeculativeSampling)

def clean(session, d):
    return session.rule.draw_token(1, 2, 3), d.keys(), session.rule.streams_free
'''
    assert rule_questions(source) == [
        ("first", 3, ".keys"), ("first", 5, ".streams"),
        ("second", 8, "COUPLED"), ("second", 8, "'point-mass'"),
        ("third", 11, "session.rule.name"), ("third", 11, "GREEDY"),
        ("third", 11, "SpeculativeSampling")]
