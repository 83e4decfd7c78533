"""The drafts see the logits processors the target's rows see (``decoding.draft_processing``).

On a pair whose head computes its target's logits (``write_mirroring_checkpoint``), a draft made
after the same processing over the same history is the target's pick: every draft is kept, in
chains at every block size, trees, batches, over a reduced vocabulary and on bfloat16 weights,
while the same run with the drafts left unprocessed misses some (the penalty changes the target's
choices). T=0 output stays mlx-lm's with the same processors. What a processor the drafts cannot
apply does, the stats' field, the CLI's and the server's."""

import importlib
import json
import logging
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step as mlx_generate_step
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.utils import load_model as mlx_load_model
from support import tiny_checkpoints as tc
from support.native_support import require_lazy
from support.oracle import OracleDrafter

import mlx_mtp
from mlx_mtp.decoding.batch_rounds import BatchRounds
from mlx_mtp.decoding.draft_processing import DraftProcessors, known_draftable
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.models.model import MTPModel
from mlx_mtp.models.options import DraftOptions
from mlx_mtp.models.qwen3_5.drafter import QwenMTPDrafter
from mlx_mtp.server.engine import mtp_summary

generate = importlib.import_module("mlx_mtp.generate")  # the CLI module

PROMPT = [5, 17, 42, 99, 7, 3]
N = 48
PENALTY = dict(repetition_penalty=2.0, repetition_context_size=48)


@pytest.fixture(scope="module")
def mirror_dir(ckpt_root):
    return tc.write_mirroring_checkpoint(ckpt_root / "mirror", seed=5)


@pytest.fixture(scope="module")
def mirror(mirror_dir):
    return mlx_mtp.load_model(mirror_dir)


def plain(path, prompt, n, processors):
    """mlx-lm's own greedy decode with ``processors``, and the raw (unprocessed) argmax at
    every step."""
    model, _ = mlx_load_model(Path(path))
    raw = []

    def record(tokens, logits):
        raw.append(mx.argmax(logits, axis=-1).item())
        return logits

    out = [t for t, _ in mlx_generate_step(mx.array(prompt), model, max_tokens=n,
                                           logits_processors=[record, *processors])]
    return out, raw


def run(model, prompt, n, processors, stats, **kw):
    return [t for t, _ in mlx_mtp.generate_step(mx.array(prompt), model, max_tokens=n,
                                                logits_processors=processors, stats=stats, **kw)]


class Undraftable:
    """A processor the drafts must leave out (``draftable = False``)."""

    draftable = False

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, tokens, logits):
        return self.inner(tokens, logits)


@pytest.fixture(scope="module")
def reference(mirror_dir):
    """mlx-lm's output with the penalty, and where the penalty changed its choice."""
    out, raw = plain(mirror_dir, PROMPT, N, make_logits_processors(**PENALTY))
    changed = [i for i, (t, r) in enumerate(zip(out, raw)) if t != r]
    assert len(changed) >= 5, changed  # the penalty is strong enough to matter
    return out


def kept_everything(stats: RunStats, positions: int) -> bool:
    return (stats.per_position_acceptance == [1.0] * positions
            and all(n > 0 for n in stats.offered))


# ------------------------------------------------------------------------------------ chains


@pytest.mark.parametrize("block_size", [2, 3, 4, 5])
def test_every_chain_draft_is_the_targets_processed_pick(mirror, reference, block_size):
    stats = RunStats()
    assert run(mirror, PROMPT, N, make_logits_processors(**PENALTY), stats,
               block_size=block_size) == reference
    assert stats.draft_processors == "applied" and stats.acceptance_rule == "greedy"
    assert kept_everything(stats, block_size - 1), stats.per_position_acceptance
    # one evaluation per drafted block: no host read inside
    assert stats.draft_syncs == stats.rounds - stats.block_sizes.get(1, 0)
    # Left unprocessed (the processor opts out), the same drafts miss where the penalty moved
    # the target's choice; the output is the same.
    stats = RunStats()
    assert run(mirror, PROMPT, N, [Undraftable(p) for p in make_logits_processors(**PENALTY)],
               stats, block_size=block_size) == reference
    assert stats.draft_processors == ("not applied: logits processor Undraftable has "
                                      "draftable=False")
    assert min(stats.per_position_acceptance) < 1.0


def test_every_penalty_of_mlx_lm_and_a_logit_bias(mirror_dir, mirror):
    procs = make_logits_processors(logit_bias={11: 3.0, 200: -5.0}, presence_penalty=1.5,
                                   presence_context_size=12, frequency_penalty=0.7,
                                   frequency_context_size=30)
    assert len(procs) == 3 and all(known_draftable(p) for p in procs)
    want, raw = plain(mirror_dir, PROMPT, N, procs)
    assert want != raw
    stats = RunStats()
    assert run(mirror, PROMPT, N, procs, stats, block_size=4) == want
    assert stats.draft_processors == "applied" and kept_everything(stats, 3)


def test_under_auto_every_draft_is_the_processed_pick(mirror, reference):
    stats = RunStats()
    assert run(mirror, PROMPT, N, make_logits_processors(**PENALTY), stats,
               block_size="auto") == reference
    drafted = len(stats.per_position_acceptance)
    assert drafted >= 1 and kept_everything(stats, drafted)


# ------------------------------------------------------------------------------------- trees


def first_choice_depth(tree) -> int:
    """How deep the path of the head's first choices runs in ``tree``."""
    node, depth = 0, 0
    while True:
        first = [i for i in range(1, len(tree.parents))
                 if tree.parents[i] == node and tree.ranks[i] == 0]
        if not first:
            return depth
        node, depth = first[0], depth + 1


@pytest.mark.parametrize("block_size", [3, 4, "auto"])
def test_every_trees_first_choice_is_the_targets_processed_pick(mirror, reference,
                                                                 block_size):
    """A tree's children are the top-k of the processed logits with each node's path as
    history: every round's walk follows the head's first choices to the end of that path."""
    trees = []
    real = mirror.drafter.draft_tree

    def spy(*args, **kw):
        trees.append(real(*args, **kw))
        return trees[-1]

    mirror.drafter.draft_tree = spy
    try:
        arms = [(make_logits_processors(**PENALTY), True)]
        if block_size != "auto":  # (auto's tree rounds follow timings: maybe too few to miss)
            arms.append(([Undraftable(p) for p in make_logits_processors(**PENALTY)], False))
        for procs, kept in arms:
            trees.clear()
            stats = RunStats()
            assert run(mirror, PROMPT, N, procs, stats, block_size=block_size,
                       draft_topk=2) == reference
            assert stats.tree_rounds == len(trees) > 0
            assert (stats.draft_processors == "applied") == kept
            first_choices = sum(first_choice_depth(t) for t in trees)
            walked = sum(stats.sibling_rank_hits)  # the nodes the tree rounds kept
            assert (walked == first_choices and not any(stats.sibling_rank_hits[1:])) == kept, \
                (walked, first_choices, stats.sibling_rank_hits)
    finally:
        del mirror.drafter.draft_tree


# ------------------------------------------------------------------------------------ batches


def test_each_batched_sequence_drafts_with_its_own_processors(mirror_dir, mirror, monkeypatch):
    """Three sequences in one batch: two with their own penalties, one without; the draft steps
    stay batched (``draft_batch`` picks each processed sequence's ids from its own rows)."""
    calls = []
    real = QwenMTPDrafter.draft_batch

    def spy(drafters, drafts, picks=None):
        calls.append(None if picks is None else [p is not None for p in picks])
        return real(drafters, drafts, picks) if picks is not None else real(drafters, drafts)

    monkeypatch.setattr(QwenMTPDrafter, "draft_batch", staticmethod(spy))
    settings = [PENALTY, dict(presence_penalty=2.0, presence_context_size=10), {}]
    prompts = [PROMPT, [9, 8, 7, 6, 5, 4, 3], [200, 100, 50]]
    rounds = BatchRounds(mirror, 3, block_size=4)
    seqs = [rounds.start(mx.array(p), max_tokens=32, logits_processors=make_logits_processors(**s))
            for p, s in zip(prompts, settings)]
    gens = [rounds.tokens(s) for s in seqs]
    outs = [[], [], []]
    while any(len(o) < 32 for o in outs):
        for o, g in zip(outs, gens):
            if len(o) < 32:
                o.append(next(g)[0])
    for out, prompt, s, seq in zip(outs, prompts, settings, seqs):
        assert out == plain(mirror_dir, prompt, 32, make_logits_processors(**s))[0]
        assert kept_everything(seq.stats, 3), seq.stats.per_position_acceptance
    assert [s.stats.draft_processors for s in seqs] == ["applied", "applied", None]
    assert [True, True, False] in calls


# ---------------------------------------------------------------------- vocabulary, bfloat16


def test_a_reduced_vocabulary_is_processed_by_target_id(mirror_dir, mirror, reference):
    """Over a draft vocabulary of half the ids (every id the text uses among them), processors
    see full-vocabulary ids: the drafts are still the target's picks."""
    V = mirror.target.vocab_size
    table = sorted(set(PROMPT) | set(reference) | set(range(1, V, 2)))
    assert len(table) < 0.6 * V
    drafter = QwenMTPDrafter(mirror.drafter.head, mirror.target, mirror.drafter.options,
                             mx.array(table, dtype=mx.uint32))
    model = MTPModel(mirror.mlx_model, mirror.target, drafter)
    for procs, kept in ((make_logits_processors(**PENALTY), True),
                        ([Undraftable(p) for p in make_logits_processors(**PENALTY)], False)):
        stats = RunStats()
        assert run(model, PROMPT, N, procs, stats, block_size=4) == reference
        assert kept_everything(stats, 3) == kept, stats.per_position_acceptance


def test_a_reduced_vocabularys_tree_is_processed_by_target_id(mirror, reference):
    """A tree over a reduced vocabulary: each node's row is lifted to target ids with its path;
    every round's walk follows the head's first choices to the end of that path."""
    V = mirror.target.vocab_size
    table = sorted(set(PROMPT) | set(reference) | set(range(1, V, 2)))
    drafter = QwenMTPDrafter(mirror.drafter.head, mirror.target, mirror.drafter.options,
                             mx.array(table, dtype=mx.uint32))
    trees = []
    real = drafter.draft_tree

    def spy(*args, **kw):
        trees.append(real(*args, **kw))
        return trees[-1]

    drafter.draft_tree = spy
    model = MTPModel(mirror.mlx_model, mirror.target, drafter)
    for procs, kept in ((make_logits_processors(**PENALTY), True),
                        ([Undraftable(p) for p in make_logits_processors(**PENALTY)], False)):
        trees.clear()
        stats = RunStats()
        assert run(model, PROMPT, N, procs, stats, block_size=3, draft_topk=2) == reference
        assert stats.tree_rounds == len(trees) > 0
        assert all(set(t.tokens) <= set(table) for t in trees)
        walked = sum(stats.sibling_rank_hits)
        first_choices = sum(first_choice_depth(t) for t in trees)
        assert (walked == first_choices and not any(stats.sibling_rank_hits[1:])) == kept, \
            (walked, first_choices, stats.sibling_rank_hits)


def test_a_fused_argmax_head_drafts_the_processed_pick(mirror, reference):
    drafter = QwenMTPDrafter(mirror.drafter.head, mirror.target,
                             DraftOptions(fused_argmax=True, fused_chunk=64))
    assert drafter.describe()["fused_argmax"]
    stats = RunStats()
    assert run(MTPModel(mirror.mlx_model, mirror.target, drafter), PROMPT, N,
               make_logits_processors(**PENALTY), stats, block_size=3) == reference
    assert kept_everything(stats, 2)


def test_a_bfloat16_head_drafts_the_processed_pick(ckpt_root):
    require_lazy()
    path = tc.write_mirroring_checkpoint(ckpt_root / "mirror-bf16", seed=5, bf16_values=True)
    model = mlx_mtp.load_model(path, draft_options=DraftOptions(bf16=True))
    assert model.drafter.describe()["bf16"]
    procs = make_logits_processors(**PENALTY)
    want, raw = plain(path, PROMPT, N, procs)
    assert want != raw
    for bs in (2, 4):
        stats = RunStats()
        assert run(model, PROMPT, N, procs, stats, block_size=bs) == want
        assert kept_everything(stats, bs - 1), (bs, stats.per_position_acceptance)


# ------------------------------------------------------------- each row's history and pick


class Recording:
    """mlx-lm's repetition penalty that records what it sees while ``drafting`` is set: the
    history and the processed row's argmax (the processed pick)."""

    def __init__(self, **kw):
        self.inner = make_logits_processors(**kw)[0]
        self.drafting = False
        self.rows = []

    def __call__(self, tokens, logits):
        out = self.inner(tokens, logits)
        if self.drafting:
            self.rows.append((tokens.tolist(), mx.argmax(out, axis=-1).item()))
        return out


def recording_drafter(drafter, rec, drafted):
    """Wraps ``drafter.draft_sampled`` / ``draft_tree`` so that ``rec`` records during drafting and
    the drafts (chain ids, or trees) go to ``drafted``."""
    chain, tree = drafter.draft_sampled, drafter.draft_tree

    def draft_sampled(k, sample):
        rec.drafting = True
        try:
            ids = chain(k, sample)
        finally:
            rec.drafting = False
        drafted.append(ids.tolist())
        return ids

    def draft_tree(topk, nodes, depth, process=None):
        rec.drafting = True
        try:
            t = tree(topk, nodes, depth, process=process)
        finally:
            rec.drafting = False
        drafted.append(t)
        return t

    drafter.draft_sampled, drafter.draft_tree = draft_sampled, draft_tree


@pytest.mark.parametrize("kind", ["qwen3_5", "gemma4-31b", "gemma4-e2b"])
def test_each_draft_row_sees_its_history_and_drafts_its_processed_argmax(tmp_path_factory,
                                                                        mirror_dir, kind):
    """The drafts of the Qwen head and of the Gemma 4 assistant (a centroid head's too) are the
    argmax of their processed logits, each draft's processors seeing the emitted tokens and the
    drafts before it; a tree's rows see their paths. The Gemma 4 pairs have random weights: the
    point is what the drafts are, not that they are kept."""
    if kind == "qwen3_5":
        target, model = mirror_dir, mlx_mtp.load_model(mirror_dir)
    else:
        from support.tiny_gemma4 import Checkpoints

        ckpts = Checkpoints(tmp_path_factory)
        target = ckpts.target(kind.split("-")[1])
        model = mlx_mtp.load_model(target, drafter=ckpts.assistant(kind.split("-")[1]))
    prompt = [5, 17, 42, 99, 7, 3, 17, 42]
    want, _ = plain(target, prompt, 24, [Recording(**PENALTY)])
    for topk in (1, 2):
        rec, drafted, stats = Recording(**PENALTY), [], RunStats()
        recording_drafter(model.drafter, rec, drafted)
        try:
            out = run(model, prompt, 24, [rec], stats, block_size=3, draft_topk=topk)
        finally:
            del model.drafter.draft_sampled, model.drafter.draft_tree
        assert out == want and stats.draft_processors == "applied"
        full = prompt + out
        rows = iter(rec.rows)
        if topk == 1:
            assert len(drafted) == stats.rounds - stats.block_sizes.get(1, 0)
            for ids in drafted:
                for j, d in enumerate(ids):
                    tokens, pick = next(rows)
                    start = len(tokens) - j
                    assert tokens == full[:start] + ids[:j] and pick == d
        else:
            for tree in drafted:
                check_tree_rows(tree, rows, full)
        assert next(rows, None) is None


def check_tree_rows(tree, rows, full):
    """A tree of depth 1 or 2 with two children per node: the root's row sees the emitted tokens
    and its argmax is the first child; each child's row sees the emitted tokens and the child,
    and its argmax is the child's own first child, where the tree kept it."""
    history, pick = next(rows)
    assert history == full[: len(history)] and pick == tree.tokens[0]
    level1 = [i for i in range(1, len(tree.parents)) if tree.parents[i] == 0]
    if max(tree.depths) == 1:
        return
    expansions = [next(rows) for _ in level1]
    assert sorted(tokens for tokens, _ in expansions) == sorted(
        history + [tree.tokens[i - 1]] for i in level1)
    for tokens, pick in expansions:
        node = next(i for i in level1 if tree.tokens[i - 1] == tokens[-1])
        first = [i for i in range(1, len(tree.parents))
                 if tree.parents[i] == node and tree.ranks[i] == 0]
        assert not first or tree.tokens[first[0] - 1] == pick


# ------------------------------------------------------------------ what cannot be applied


class MisbehavesOnDrafts:
    """The repetition penalty on the target's rows; on a draft's row it raises, or returns a
    row of the wrong width (``how``). ``drafting`` is set by the test around the drafts."""

    def __init__(self, how):
        self.inner = make_logits_processors(**PENALTY)[0]
        self.how, self.drafting = how, False

    def __call__(self, tokens, logits):
        if self.drafting and self.how == "raises":
            raise ValueError("this processor reads the target's rows only")
        if self.drafting:
            return logits[:, :5]
        return self.inner(tokens, logits)


@pytest.mark.parametrize("how,why", [
    ("raises", "logits processor MisbehavesOnDrafts raised ValueError on a draft's logits: this "
               "processor reads the target's rows only"),
    ("shape", "logits processor MisbehavesOnDrafts returned shape (1, 5) for a draft's logits "
              "of shape (1, 320)")])
def test_a_processor_the_drafts_cannot_apply_leaves_them_unprocessed(mirror, reference, how,
                                                                      why, caplog):
    proc = MisbehavesOnDrafts(how)
    drafts = mirror.drafter.draft_sampled

    def draft_sampled(k, sample):
        proc.drafting = True
        try:
            return drafts(k, sample)
        finally:
            proc.drafting = False

    mirror.drafter.draft_sampled = draft_sampled
    try:
        stats = RunStats()
        with caplog.at_level(logging.WARNING, logger="mlx_mtp"):
            out = run(mirror, PROMPT, N, [proc], stats, block_size=3)
    finally:
        del mirror.drafter.draft_sampled
    assert out == reference
    assert stats.draft_processors == f"not applied: {why}"
    assert min(stats.per_position_acceptance) < 1.0
    assert [r.getMessage() for r in caplog.records if "drafts without" in r.getMessage()] == [
        f"mlx_mtp: drafts without logits processors (the output is unchanged): {why}"]


def test_a_user_callable_that_works_on_drafts_is_applied(mirror, reference):
    inner = make_logits_processors(**PENALTY)[0]
    stats = RunStats()
    assert run(mirror, PROMPT, N, [lambda tokens, logits: inner(tokens, logits)], stats,
               block_size=4) == reference
    assert stats.draft_processors == "applied" and kept_everything(stats, 3)


def test_a_drafter_without_draft_sampled_drafts_unprocessed(mirror_dir, mirror, reference):
    drafter = OracleDrafter(PROMPT + reference, [1, 0, 2], mirror.target.vocab_size)
    stats = RunStats()
    assert run(MTPModel(mirror.mlx_model, mirror.target, drafter), PROMPT, N,
               make_logits_processors(**PENALTY), stats, block_size=3) == reference
    assert stats.draft_processors == ("not applied: the drafter (OracleDrafter) has no "
                                      "draft_sampled to pick processed drafts")


def test_a_tree_drafter_without_process_drafts_unprocessed():
    class ChainsOnly:
        def draft_sampled(self, k, sample):
            pass

        def draft_tree(self, topk, nodes, depth):
            pass

    from mlx_mtp.decoding.draft_processing import drafter_problem

    assert drafter_problem(ChainsOnly(), trees=False) is None
    assert drafter_problem(ChainsOnly(), trees=True) == (
        "the drafter (ChainsOnly) drafts trees without logits processors (its draft_tree takes "
        "no process)")


def test_no_processors_no_status(mirror):
    stats = RunStats()
    run(mirror, PROMPT, 12, None, stats, block_size=3)
    assert stats.draft_processors is None and stats.to_dict()["draft_processors"] is None
    stats = RunStats()  # block size 1: nothing is drafted
    run(mirror, PROMPT, 12, make_logits_processors(**PENALTY), stats, block_size=1)
    assert stats.draft_processors is None
    assert DraftProcessors([]).status is None


# ------------------------------------------------------------------------- what reports it


def test_the_cli_json_table_and_server_summary_say_it(capsys, mirror_dir):
    argv = ["--model", str(mirror_dir), "--prompt", "def f(x):", "--max-tokens", "24",
            "--block-size", "3", "--repetition-penalty", "2.0", "--ignore-chat-template"]
    assert generate.main(argv + ["--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["draft_processors"] == "applied"
    assert generate.main(argv) == 0
    table = capsys.readouterr().err
    assert any(line.split() == ["logits", "processors", "on", "drafts", "applied"]
               for line in table.splitlines())
    assert generate.main(argv[:-3] + ["--ignore-chat-template", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["draft_processors"] \
        is None
    stats = RunStats(draft_processors="applied")
    assert mtp_summary(stats)["draft_processors"] == "applied"


# ------------------------------------------------------------ T > 0: the distribution is kept

ALPHA = 1e-3  # reject "same distribution" below this p-value
SAMPLED_PROMPT = [5]
SAMPLING = dict(temp=1.0, top_k=3)
# the mode's second token biased away, and tokens seen in the last 8 penalized
SAMPLED_PENALTY = dict(logit_bias={279: -3.0}, presence_penalty=1.0, presence_context_size=8)
N_TOKENS, N_PLAIN, N_MTP = 4, 20000, 300


@pytest.mark.slow
@pytest.mark.parametrize("acceptance,block_size,topk,rule", [
    ("auto", 3, 1, "speculative-sampling"), ("point-mass", 3, 1, "point-mass"),
    ("auto", "auto", 1, "gumbel-coupled"), ("auto", 3, 2, "point-mass")])
def test_sampling_with_processed_drafts_keeps_plain_samplings_distribution(
        soft_dir, soft_model, acceptance, block_size, topk, rule):
    """Every rule with the drafts processed (speculative sampling's q, point-mass' argmax, the
    coupled draws, a tree's top-k) emits plain sampling's distribution with the same processors,
    which is not the distribution without them."""
    from support.chisquare import goodness_of_fit, two_sample
    from support.plain_sampling import reference as plain_reference

    exact, plain_draws = plain_reference(soft_dir, SAMPLED_PROMPT, SAMPLING, N_TOKENS, N_PLAIN,
                                         penalties=SAMPLED_PENALTY)[:2]
    unprocessed = plain_reference(soft_dir, SAMPLED_PROMPT, SAMPLING, N_TOKENS, N_PLAIN)[0]
    shift = sum(abs(exact.get(k, 0.0) - unprocessed.get(k, 0.0))
                for k in set(exact) | set(unprocessed)) / 2
    assert shift > 0.5, shift  # the processors change the distribution a test can see
    assert goodness_of_fit(plain_draws, exact)[2] > ALPHA
    stats = RunStats()
    sampler = mlx_mtp.make_sampler(**SAMPLING)
    procs = make_logits_processors(**SAMPLED_PENALTY)
    mx.random.seed(1234)  # the point-mass rule draws through the sampler's global stream
    draws = [tuple(run(soft_model, SAMPLED_PROMPT, N_TOKENS, procs, stats, block_size=block_size,
                       sampler=sampler, seed=i, acceptance=acceptance, draft_topk=topk))
             for i in range(N_MTP)]
    assert stats.acceptance_rule == rule and stats.draft_processors == "applied"
    assert stats.drafted >= N_MTP and 0.2 < stats.acceptance_rate < 1.0, stats.acceptance_rate
    assert two_sample(draws, plain_draws)[2] > ALPHA
    assert goodness_of_fit(draws, exact)[2] > ALPHA

