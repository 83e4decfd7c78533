"""Batched rounds: several sequences' blocks in one packed target forward. Each sequence's rows
and caches equal its verify alone, byte for byte; at T=0 every sequence's tokens are mlx-lm's
greedy tokens for its prompt, whatever else is in the batch, as sequences join and leave."""

import inspect

import mlx.core as mx
import pytest
from support.reference import reference_greedy
from mlx_lm.generate import batch_generate as mlx_batch_generate
from mlx_lm.tokenizer_utils import load as load_tokenizer
from support import tiny_checkpoints as tc
from support.choosers import STRETCHES, ScriptedBatchChooser, StretchChooser
from support.packed import assert_packed_verify_equals_alone
from support.perturbed import one_ulp

import mlx_mtp
from mlx_mtp import MTPError
from mlx_mtp.decoding.batch_rounds import ALONE_STRETCH, BatchRounds
from mlx_mtp.exactness import batch_vs_alone

SLOW_KINDS = [pytest.param(k, marks=pytest.mark.slow) for k in ("moe", "tied", "next", "wide")]


@pytest.fixture(scope="module")
def agreeing_dir(ckpt_root):
    """A head wired to agree with its target: drafts are accepted, so rounds keep several rows."""
    return tc.write_agreeing_checkpoint(ckpt_root / "agreeing-batch", seed=3)


def prompts_for(vocab_size, lengths=(9, 14, 5, 20)):
    return [[(7 * i + 3 * s + 1) % vocab_size for i in range(n)] for s, n in enumerate(lengths)]


def drain(rounds, seqs, budget=None, gens=None):
    """Every sequence's tokens, read in turn as a server reads them (``budget``: stop reading
    sequence s after ``budget[s]`` tokens: its consumer went away; ``gens``: readers already
    open, ``rounds.tokens(s)`` where None)."""
    gens = [g or rounds.tokens(s) for s, g in zip(seqs, gens or [None] * len(seqs))]
    outs = [[] for _ in seqs]
    live = list(range(len(seqs)))
    while live:
        for i in list(live):
            item = next(gens[i], None)
            if item is None or (budget is not None and len(outs[i]) == budget[i]):
                gens[i].close()
                live.remove(i)
            else:
                outs[i].append(item[0])
    return outs


@pytest.mark.parametrize("kind", ["dense"] + SLOW_KINDS)
def test_a_packed_verify_equals_each_sequence_alone(kind, request):
    """Three sequences of different lengths, blocks of widths 3, 1 and 4 in one forward: each
    sequence's logits rows equal its verify alone, and its caches after a partial rollback
    equal those after its own verify and rollback, bitwise."""
    path = request.getfixturevalue(f"{kind}_dir")
    target = mlx_mtp.load_model(path, require_head=False).target
    target.prepare(8)
    V = target.vocab_size
    prompts = prompts_for(V, (9, 14, 5))
    blocks = [[(11 * i + s) % V for i in range(w)] for s, w in enumerate((3, 1, 4))]
    assert_packed_verify_equals_alone(target, prompts, blocks, kind)


def test_the_probe_passes_here_and_names_a_skewed_row(dense_dir, monkeypatch):
    target = mlx_mtp.load_model(dense_dir, require_head=False).target
    target.prepare(12)
    assert batch_vs_alone.probe_batch(target, 3, 4) is None
    real = type(target).verify_batch

    def skewed(self, blocks, caches):
        hidden = real(self, blocks, caches)
        return hidden[:1] + [one_ulp(hidden[1], 0)] + hidden[2:]

    monkeypatch.setattr(type(target), "verify_batch", skewed)
    batch_vs_alone._MEMO.clear()
    assert batch_vs_alone.probe_batch(target, 3, 4) == (
        "sequence 2 of 3 (widths 4, 1, 3): logits row 0 of a packed verify differs from its "
        "verify alone")
    model = mlx_mtp.load_model(dense_dir)
    model.target.__class__ = type(target)
    with pytest.raises(MTPError, match=r"^batched rounds declined: batch-vs-alone probe: "
                                       r"sequence 2 of 3"):
        BatchRounds(model, 3, block_size=4)
    batch_vs_alone._MEMO.clear()


@pytest.mark.parametrize("block_size", [3, "auto"])
def test_batched_tokens_are_each_prompts_greedy_tokens(agreeing_dir, block_size):
    """Four prompts of different lengths and token budgets decoded together equal mlx-lm's
    greedy decode of each alone; the agreeing head's drafts are accepted."""
    model = mlx_mtp.load_model(agreeing_dir)
    prompts = prompts_for(model.target.vocab_size)
    budgets = [20, 7, 16, 1]
    rounds = BatchRounds(model, 4, block_size=block_size)
    seqs = [rounds.start(mx.array(p), max_tokens=n) for p, n in zip(prompts, budgets)]
    outs = drain(rounds, seqs)
    for p, n, out in zip(prompts, budgets, outs):
        assert out == reference_greedy(agreeing_dir, p, n)
    assert seqs[0].stats.accepted > 0 and seqs[0].stats.rounds < 20
    assert rounds.active == []  # each left once read to its end


def test_under_auto_the_batchs_chooser_sets_every_sequences_drafts(agreeing_dir):
    """Under ``auto`` a batched round drafts the batch chooser's count for every sequence (at
    most what its budget allows) and tells it the round's size, count and tokens; the sequences'
    own choosers count the judgments but time nothing of a batched round. Output greedy."""
    model = mlx_mtp.load_model(agreeing_dir)
    prompts = prompts_for(model.target.vocab_size)[:3]
    rounds = BatchRounds(model, 3, block_size="auto")
    rounds.chooser = ScriptedBatchChooser(5, [2, 0, 4, 1])
    seqs = [rounds.start(mx.array(p), max_tokens=16) for p in prompts]
    outs = drain(rounds, seqs)
    for p, out in zip(prompts, outs):
        assert out == reference_greedy(agreeing_dir, p, 16)
    # every draft accepted: rounds of 2, 0, 4, 1 drafts emit 3, 1, 5, 2 tokens each, so after the
    # first token 15 more take rounds 2, 0, 4, 1, 2 (3 + 1 + 5 + 2 + 3 = 14) and a last one
    # whose budget leaves no draft (the script's 0)
    assert rounds.chooser.observed == [(3, 2, 9), (3, 0, 3), (3, 4, 15), (3, 1, 6), (3, 2, 9),
                                       (3, 0, 3)]
    for s in seqs:
        assert s.stats.block_sizes == {3: 2, 1: 2, 5: 1, 2: 1}
        assert s.stats.accepted == s.stats.drafted == 9
        chooser = s.session.chooser
        assert chooser.round == 6 and all(len(d) == 0 for d in chooser.samples.values())
        assert chooser.judged[:4] == [4, 3, 1, 1]


def test_a_sequence_alone_in_the_batch_decodes_as_alone(dense_dir):
    """With no other sequence in the batch, a round is the round it runs alone: under ``auto``
    the chooser's undrafted stretches run as pipelined one-token steps (one host read a step),
    as ``generate_step`` runs them; a sequence that joins later is batched with it, and both keep
    their greedy tokens."""
    model = mlx_mtp.load_model(dense_dir)
    prompts = prompts_for(model.target.vocab_size)
    chooser = StretchChooser(5, STRETCHES)
    rounds = BatchRounds(model, 2, block_size=chooser)
    alone = rounds.start(mx.array(prompts[0]), max_tokens=24)
    first = rounds.tokens(alone)
    read = [next(first)[0] for _ in range(12)]
    assert alone.stats.undrafted_steps >= 3 + 5  # the first two stretches
    assert alone.stats.host_syncs == alone.stats.rounds  # one read per step or round
    late = rounds.start(mx.array(prompts[1]), max_tokens=10)
    outs = drain(rounds, [alone, late], gens=[first, None])
    assert read + outs[0] == reference_greedy(dense_dir, prompts[0], 24)
    assert outs[1] == reference_greedy(dense_dir, prompts[1], 10)
    assert late.stats.rounds > 0 and rounds.active == []


def test_a_lone_sequences_stretch_yields_to_joins(dense_dir):
    """A lone sequence's stretch runs at most ``ALONE_STRETCH`` steps a round, so a sequence that
    starts meanwhile waits no longer; the output is still the greedy decode."""
    model = mlx_mtp.load_model(dense_dir)
    prompt = prompts_for(model.target.vocab_size)[0]
    rounds = BatchRounds(model, 2, block_size=StretchChooser(5, [("stretch", 20), 1]))
    alone = rounds.start(mx.array(prompt), max_tokens=30)
    assert len(alone.out) == 1  # the first token, drawn with the prefill
    rounds.round()
    assert len(alone.out) == 1 + ALONE_STRETCH and alone.stats.undrafted_steps == ALONE_STRETCH
    assert [t for t, _, _ in rounds.tokens(alone)] == reference_greedy(dense_dir, prompt, 30)


def test_sequences_join_and_leave_between_rounds(dense_dir):
    """Two sequences decode, two more join after a few rounds, one consumer stops reading early
    (it leaves at once): the others' tokens are still their greedy tokens."""
    model = mlx_mtp.load_model(dense_dir)
    prompts = prompts_for(model.target.vocab_size)
    rounds = BatchRounds(model, 3, block_size=3)
    first = [rounds.start(mx.array(p), max_tokens=18) for p in prompts[:2]]
    for _ in range(3):
        rounds.round()
    with pytest.raises(MTPError, match=r"^the batch is full \(3 sequences\)$"):
        rounds.start(mx.array(prompts[2]), max_tokens=18)
        rounds.start(mx.array(prompts[3]), max_tokens=18)
    late = rounds.active[2]
    outs = drain(rounds, first + [late], budget=[18, 5, 18])
    assert outs[1] == reference_greedy(dense_dir, prompts[1], 18)[:5]
    assert outs[0] == reference_greedy(dense_dir, prompts[0], 18)
    assert outs[2] == reference_greedy(dense_dir, prompts[2], 18)
    assert rounds.active == []


def test_a_sampled_sequence_beside_a_greedy_one(agreeing_dir):
    """A T=0.8 sequence in the batch leaves the T=0 one's tokens as they are alone."""
    model = mlx_mtp.load_model(agreeing_dir)
    prompts = prompts_for(model.target.vocab_size)
    rounds = BatchRounds(model, 2, block_size=3)
    greedy = rounds.start(mx.array(prompts[0]), max_tokens=16)
    hot = rounds.start(mx.array(prompts[1]), max_tokens=16,
                       sampler=mlx_mtp.make_sampler(temp=0.8), seed=5)
    outs = drain(rounds, [greedy, hot])
    assert outs[0] == reference_greedy(agreeing_dir, prompts[0], 16)
    assert len(outs[1]) == 16 and hot.stats.acceptance_rule == "speculative-sampling"


def test_what_batched_rounds_refuse(dense_dir, tmp_path):
    model = mlx_mtp.load_model(dense_dir)
    with pytest.raises(MTPError, match=r"^max_batch must be a positive integer, got 0$"):
        BatchRounds(model, 0)
    with pytest.raises(MTPError, match=r"^batched rounds draft: block_size must be above 1$"):
        BatchRounds(model, 2, block_size=1)
    headless = mlx_mtp.load_model(dense_dir, require_head=False)
    headless.drafter = None
    with pytest.raises(MTPError, match=r"^batched rounds: the model has no MTP head$"):
        BatchRounds(headless, 2)


def test_batch_generate_takes_mlx_lms_arguments_and_gives_each_prompts_text(agreeing_dir):
    assert list(inspect.signature(mlx_mtp.batch_generate).parameters) == \
        list(inspect.signature(mlx_batch_generate).parameters)
    model, tok = mlx_mtp.load(agreeing_dir)
    prompts = prompts_for(model.target.vocab_size, (9, 14, 5))
    r = mlx_mtp.batch_generate(model, tok, prompts, max_tokens=[12, 5, 9], max_batch=2,
                               block_size=3, return_token_ids=True, return_logprobs=True)
    refs = [reference_greedy(agreeing_dir, p, n) for p, n in zip(prompts, (12, 5, 9))]
    eos = set(load_tokenizer(agreeing_dir).eos_token_ids)
    for ids, ref in zip(r.token_ids, refs):
        cut = next((i for i, t in enumerate(ref) if t in eos), len(ref))
        assert ids == ref[:cut]
    assert r.texts == [tok.decode(ids) for ids in r.token_ids]
    assert [len(x) for x in r.logprobs] == [len(x) for x in r.token_ids]
    assert all(v <= 0 for x in r.logprobs for v in x)
    assert r.stats.generation_tokens == sum(len(x) for x in r.token_ids)
    assert r.stats.prompt_tokens == 28
    with pytest.raises(MTPError, match=r"^batch_generate takes no prompt caches"):
        mlx_mtp.batch_generate(model, tok, prompts, return_prompt_caches=True)
    with pytest.raises(MTPError, match=r"^batch_generate got unexpected arguments: kv_bits "):
        mlx_mtp.batch_generate(model, tok, prompts, kv_bits=4)
    with pytest.raises(MTPError, match=r"^max_tokens has 2 entries for 3 prompts$"):
        mlx_mtp.batch_generate(model, tok, prompts, max_tokens=[3, 4])


def test_a_long_prompt_joins_a_chunk_per_round(dense_dir):
    """A prompt of four prefill chunks joins over the rounds of the sequence already decoding:
    its first chunk at ``start``, one more before each round, its first token with the last;
    the other sequence emits in every one of those rounds. Both get their greedy tokens (the
    long one as mlx-lm decodes it with the same prefill chunks)."""
    from mlx_lm.generate import generate_step as mlx_generate_step
    from mlx_lm.utils import load_model as mlx_load_model

    model = mlx_mtp.load_model(dense_dir)
    V = model.target.vocab_size
    short_prompt = prompts_for(V)[0]
    long_prompt = [(5 * i + 2) % V for i in range(30)]  # 29 tokens before the last: 8+8+8+5
    rounds = BatchRounds(model, 2, block_size=3)
    short = rounds.start(mx.array(short_prompt), max_tokens=12)
    long = rounds.start(mx.array(long_prompt), max_tokens=12, prefill_step_size=8)
    emitted = []
    for _ in range(3):
        assert long.joining is not None and not long.out
        rounds.round()
        emitted.append(short.progress.emitted)
    assert long.joining is None and len(long.out) >= 1
    assert emitted[0] > 1 and emitted[1] > emitted[0] and emitted[2] > emitted[1]
    outs = drain(rounds, [short, long])
    assert outs[0] == reference_greedy(dense_dir, short_prompt, 12)
    plain, _ = mlx_load_model(dense_dir)
    assert outs[1] == [t for t, _ in mlx_generate_step(mx.array(long_prompt), plain,
                                                       max_tokens=12, prefill_step_size=8)]


SAMPLING = dict(temp=1.0, top_k=3)


def batched_draws(model, n, settings, max_batch=8, n_tokens=4):
    """``n`` sampled continuations of one prompt, decoded ``max_batch`` at a time in batched
    rounds (speculative sampling, block 3), each sequence with its own seed."""
    rounds = BatchRounds(model, max_batch, block_size=3)
    out, rules, accepted = [], set(), 0
    while len(out) < n:
        seqs = [rounds.start(mx.array([5]), max_tokens=n_tokens, seed=len(out) + i,
                             sampler=mlx_mtp.make_sampler(**settings))
                for i in range(max_batch)]
        out += [tuple(ids) for ids in drain(rounds, seqs)]
        rules |= {s.stats.acceptance_rule for s in seqs}
        accepted += sum(s.stats.accepted for s in seqs)
    return out[:n], rules, accepted


@pytest.mark.slow
def test_sampled_sequences_in_a_batch_keep_plain_samplings_distribution(soft_dir, soft_model):
    """Each sequence's continuations, sampled in batches of eight, follow plain sampling's joint
    distribution (chi-square against the exact distribution and against mlx-lm's own draws);
    the same test rejects draws at another temperature (its power at this sample size)."""
    from support.chisquare import goodness_of_fit, two_sample
    from support.plain_sampling import reference

    exact, plain, _, _ = reference(soft_dir, [5], SAMPLING, 4, 20000)
    draws, rules, accepted = batched_draws(soft_model, 304, SAMPLING)
    assert rules == {"speculative-sampling"} and accepted > 100
    assert two_sample(draws, plain)[2] > 1e-3
    assert goodness_of_fit(draws, exact)[2] > 1e-3
    colder, _, _ = batched_draws(soft_model, 304, dict(temp=0.5, top_k=3))
    assert two_sample(colder, plain)[2] < 1e-3
