"""A request's logprobs, logit_bias and penalties through the server's engine, with MTP on.

At T=0 the tokens are mlx-lm's ``generate_step`` with the same ``make_logits_processors``, and
every token's logprob (and its top alternatives) is mlx-lm's, bit for bit, whether the token came
from a draft or not. At T>0 the draws have plain sampling's processed distribution (the chi-square
test of the sampling tests, with a negative control: the unprocessed distribution is rejected).
"""

import math
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step as mlx_generate_step
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.utils import load_model as mlx_load_model
from support.chisquare import goodness_of_fit
from support.oracle import OracleDrafter
from support.plain_sampling import plain_tree
from support.reference import CODE_PROMPT

import mlx_mtp
from mlx_mtp.decoding.speculation import SpeculationOptions
from mlx_mtp.models.model import MTPModel
from mlx_mtp.server.engine import Engine, Finished
from mlx_mtp.server.output import Delta
from mlx_mtp.server.schema import GenerationRequest

N = 24
TOP = 3
NO_EOS = {0: -30.0}  # the tiny target's EOS, held off so that the penalties have a history
# (settings, the same without what is tested): each pair's greedy outputs differ (asserted).
SETTINGS = {
    "bias": (dict(logit_bias={0: -30.0, 7: 1.5, 19: -3.0}), {}),
    "presence-frequency": (dict(presence_penalty=1.5, frequency_penalty=0.7, logit_bias=NO_EOS),
                           dict(logit_bias=NO_EOS)),
    "repetition-bias": (dict(repetition_penalty=1.6, repetition_context_size=8,
                             logit_bias={0: -30.0, 11: 1.0}), dict(logit_bias=NO_EOS)),
    "context-sizes": (dict(presence_penalty=-4.0, presence_context_size=3, frequency_penalty=1.0,
                           frequency_context_size=5, logit_bias=NO_EOS),
                      dict(presence_penalty=-4.0, presence_context_size=3, frequency_penalty=1.0,
                           logit_bias=NO_EOS)),
}


def processors(settings: dict):
    """mlx-lm's processors for a request's settings (mlx_lm.server's defaults elsewhere)."""
    return make_logits_processors(
        logit_bias=settings.get("logit_bias"),
        repetition_penalty=settings.get("repetition_penalty", 0.0),
        repetition_context_size=settings.get("repetition_context_size", 20),
        presence_penalty=settings.get("presence_penalty", 0.0),
        presence_context_size=settings.get("presence_context_size", 20),
        frequency_penalty=settings.get("frequency_penalty", 0.0),
        frequency_context_size=settings.get("frequency_context_size", 20))


def mlx_lm_greedy(path, prompt, settings, eos=(0,)):
    """mlx-lm's tokens up to EOS, each one's logprob and its ``TOP`` alternatives (id, logprob)."""
    model, _ = mlx_load_model(Path(path))
    out = []
    for token, lp in mlx_generate_step(mx.array(prompt), model, max_tokens=N,
                                       logits_processors=processors(settings)):
        order = sorted(range(lp.size), key=lambda i: -lp[i].item())[:TOP]
        out.append((token, lp[token].item(), [(i, lp[i].item()) for i in order]))
        if token in eos:
            break
    return out


def served(engine, prompt, **settings):
    """The engine's tokens, logprobs and alternatives for a T=0 request, and its Finished."""
    req = GenerationRequest(kind="text", model="m", prompt="", max_tokens=N, logprobs=True,
                            top_logprobs=TOP, **settings)
    out, done = [], None
    for event in engine.generate(req, prompt):
        if isinstance(event, Delta):
            out += [(e.token, e.logprob, [(i, v) for i, _, v in e.top]) for e in event.logprobs]
        elif isinstance(event, Finished):
            done = event
    return out, done


@pytest.fixture(scope="module")
def dense(dense_dir):
    model, tok = mlx_mtp.load(str(dense_dir))
    return model, tok, tok.encode(CODE_PROMPT)


@pytest.mark.parametrize("case", SETTINGS)
def test_greedy_tokens_and_logprobs_are_mlx_lm_s_with_the_same_processors(dense_dir, dense,
                                                                          case):
    model, tok, prompt = dense
    settings, control = SETTINGS[case]
    assert list(tok.eos_token_ids) == [0]
    want = mlx_lm_greedy(dense_dir, prompt, settings)
    assert [t for t, _, _ in want] != [t for t, _, _ in mlx_lm_greedy(dense_dir, prompt, control)]
    assert len(want) == N
    # The real head, then an oracle drafter whose drafts are kept 0, 1 or 2 at a time: the
    # emitted tokens come from drafts and from the target's own picks.
    oracle = OracleDrafter(prompt + [t for t, _, _ in want], schedule=[0, 1, 2], vocab_size=320)
    for drafter in (model.drafter, oracle):
        engine = Engine(MTPModel(model.mlx_model, model.target, drafter), tok,
                        speculation=SpeculationOptions(block_size=3))
        got, done = served(engine, prompt, **settings)
        assert got == want  # ids, and the logprob floats bit for bit
        assert done.mtp["mtp_enabled"] is True and done.mtp["acceptance_rule"] == "greedy"
        assert done.completion_tokens == N and done.finish_reason == "length"
    assert done.mtp["acceptance_rate"] > 0 and {1, 2} <= set(oracle.planned)


@pytest.mark.parametrize("case", ["bias", "presence-frequency"])
def test_draft_trees_keep_mlx_lm_s_tokens_and_logprobs(dense_dir, dense, case):
    """Tree rounds (``draft_topk`` 2) verify the processed rows of every node's path."""
    model, tok, prompt = dense
    settings = SETTINGS[case][0]
    engine = Engine(model, tok, speculation=SpeculationOptions(block_size=3, draft_topk=2))
    got, done = served(engine, prompt, **settings)
    assert got == mlx_lm_greedy(dense_dir, prompt, settings)
    assert done.mtp["tree_rounds"] > 0 and done.mtp["draft_topk"] == 2


def test_the_server_s_default_auto_block_keeps_mlx_lm_s_tokens_and_logprobs(dense_dir, dense):
    model, tok, prompt = dense
    settings = SETTINGS["repetition-bias"][0]
    engine = Engine(model, tok, speculation=SpeculationOptions(block_size="auto"))
    got, done = served(engine, prompt, **settings)
    assert got == mlx_lm_greedy(dense_dir, prompt, settings)
    assert done.mtp["block_size"] == "auto" and done.mtp["mtp_enabled"] is True


def test_logprobs_of_tokens_that_end_the_text_are_reported(dense):
    """A stop string's tokens and the budget's last token carry their logprobs too (one entry
    per completion token, as mlx_lm.server)."""
    model, tok, prompt = dense
    engine = Engine(model, tok, speculation=SpeculationOptions(block_size=3))
    full, _ = served(engine, prompt)
    tokens = [t for t, _, _ in full]
    # a token that is its own text's encoding (stop strings match by their ids), past the start
    stop_id = next(t for t in tokens[3:] if tok.encode(tok.decode([t]),
                                                       add_special_tokens=False) == [t])
    n = tokens.index(stop_id) + 1
    req = GenerationRequest(kind="text", model="m", prompt="", max_tokens=N, logprobs=True,
                            stop=["never appears", tok.decode([stop_id])])
    events = list(engine.generate(req, prompt))
    entries = [e for ev in events if isinstance(ev, Delta) for e in ev.logprobs]
    done = events[-1]
    assert (done.finish_reason, done.stop_sequence) == ("stop", tok.decode([stop_id]))
    assert done.completion_tokens == n == len(entries)
    assert [(e.token, e.logprob) for e in entries] == [(t, lp) for t, lp, _ in full[:n]]


# ------------------------------------------------------------------------------------ T > 0

PROMPT = [5]
SAMPLING = dict(temp=1.0, top_k=3)
N_TOKENS = 4
N_MTP = 300
ALPHA = 1e-3


@pytest.mark.slow
def test_sampled_draws_have_plain_samplings_processed_distribution(soft_dir):
    model, tok = mlx_mtp.load(str(soft_dir))
    exact_raw = plain_tree(soft_dir, PROMPT, mlx_mtp.make_sampler(**SAMPLING), N_TOKENS)[2]
    first = max((p for p in exact_raw), key=lambda p: exact_raw[p])[0]
    settings = dict(logit_bias={first: -1.5}, presence_penalty=0.8)
    exact = plain_tree(soft_dir, PROMPT, mlx_mtp.make_sampler(**SAMPLING), N_TOKENS,
                       processors(settings))[2]
    assert math.isclose(sum(exact.values()), 1, abs_tol=1e-5)
    engine = Engine(model, tok, speculation=SpeculationOptions(block_size=3))
    draws, accepted = [], 0
    for seed in range(N_MTP):
        req = GenerationRequest(kind="text", model="m", prompt="", max_tokens=N_TOKENS,
                                temperature=1.0, top_k=3, seed=seed, logprobs=True, **settings)
        events = list(engine.generate(req, PROMPT))
        draws.append(tuple(e.token for ev in events if isinstance(ev, Delta)
                           for e in ev.logprobs))
        assert events[-1].mtp["acceptance_rule"] == "speculative-sampling"
        accepted += bool(events[-1].mtp["acceptance_rate"])
    assert accepted > N_MTP // 4  # drafts were kept in many runs
    assert goodness_of_fit(draws, exact)[2] > ALPHA
    assert goodness_of_fit(draws, exact_raw)[2] < ALPHA  # the processors changed it
