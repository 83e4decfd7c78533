"""Draft trees at temperature > 0: every node's target draw is kept when it equals one of its
children (the point-mass rule over siblings), which keeps plain sampling's joint distribution; a
chi-square test says so, and rejects a walk biased towards the head's first choices."""

import mlx.core as mx
import pytest
from support.chisquare import goodness_of_fit, two_sample
from support.plain_sampling import reference

import mlx_mtp
from mlx_mtp.decoding import round_steps
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp import draft_tree
from mlx_mtp.models.model import MTPModel
from mlx_mtp.models.protocols import DrafterDefaults

ALPHA = 1e-3
PROMPT = [5]
SAMPLING = dict(temp=1.0, top_k=3)
N_TOKENS = 4  # a round of depth 2 can emit tokens 2..4
N_PLAIN = 20000
N_MTP = 300


@pytest.fixture(scope="module")
def plain_reference(soft_dir):
    exact, samples, index, logprobs = reference(soft_dir, PROMPT, SAMPLING, N_TOKENS, N_PLAIN)
    return exact, samples, (index, logprobs)


def tree_draws(model, n, stats):
    sampler = mlx_mtp.make_sampler(**SAMPLING)
    mx.random.seed(4321)  # the point-mass rule draws through the sampler's global stream
    return [tuple(t for t, _ in mlx_mtp.generate_step(
        mx.array(PROMPT), model, max_tokens=N_TOKENS, block_size=3, draft_topk=2,
        draft_tokens=4, sampler=sampler, stats=stats)) for _ in range(n)]


@pytest.mark.slow
def test_tree_sampling_has_plain_samplings_joint_distribution(soft_model, plain_reference):
    exact, plain, _ = plain_reference
    stats = RunStats()
    draws = tree_draws(soft_model, N_MTP, stats)
    assert stats.acceptance_rule == "point-mass"
    assert two_sample(draws, plain)[2] > ALPHA
    assert goodness_of_fit(draws, exact)[2] > ALPHA
    assert stats.offered[1] > N_MTP // 2 and stats.accepted > N_MTP // 2


class SupportTreeDrafter(DrafterDefaults):
    """Drafts, under every node, the target's two likeliest tokens after that node's path (read
    off the plain reference's rows), so that second siblings are drawn and kept often."""

    syncs = 0

    def __init__(self, index, logprobs):
        self.index, self.logprobs = index, logprobs
        self.sampler = mlx_mtp.make_sampler(**SAMPLING)
        self.reset()

    def reset(self):
        self.seen = []  # every next id consumed: the prompt's after the first, then the output

    def prefill(self, hidden, next_ids):
        self.seen += next_ids.tolist()

    def accept(self, hidden, next_ids):
        self.seen += next_ids.tolist()

    def state_arrays(self):
        return []

    def _top2(self, prefix):
        probs = self.sampler.probs(self.logprobs[self.index[tuple(prefix)]][None])[0]
        return mx.argsort(-probs)[:2].tolist()

    def draft_tree(self, topk, nodes, depth):
        out = self.seen[len(PROMPT) - 1 :]
        tokens, parents, ranks, paths = [], [-1], [0], {0: []}
        for d in range(depth):
            for node in [n for n, p in paths.items() if len(p) == d]:
                for rank, tok in enumerate(self._top2(out + paths[node])):
                    paths[len(parents)] = paths[node] + [tok]
                    tokens.append(tok)
                    parents.append(node)
                    ranks.append(rank)
        return draft_tree.DraftTree(mx.array(tokens, dtype=mx.uint32), tokens, parents, ranks)


@pytest.mark.slow
def test_second_siblings_are_kept_as_often_as_the_target_draws_them(soft_model,
                                                                     plain_reference):
    exact, plain, (index, logprobs) = plain_reference
    drafter = SupportTreeDrafter(index, logprobs)
    model = MTPModel(soft_model.mlx_model, soft_model.target, drafter)
    stats = RunStats()
    sampler = mlx_mtp.make_sampler(**SAMPLING)
    mx.random.seed(99)
    draws = [tuple(t for t, _ in mlx_mtp.generate_step(
        mx.array(PROMPT), model, max_tokens=N_TOKENS, block_size=3, draft_topk=2,
        draft_tokens=6, sampler=sampler, stats=stats)) for _ in range(N_MTP)]
    assert two_sample(draws, plain)[2] > ALPHA
    assert goodness_of_fit(draws, exact)[2] > ALPHA
    first, second = stats.sibling_rank_hits
    assert second > N_MTP // 10 and first > second  # the second likeliest is kept less often


def first_child_walk(tree, picks):
    """A biased walk: a node's first child is kept whatever the target drew there."""
    path = [0]
    while True:
        children = [i for i in range(1, len(tree.parents)) if tree.parents[i] == path[-1]]
        drawn = [c for c in children if tree.tokens[c - 1] == picks[path[-1]]]
        if not children:
            return path
        path.append(drawn[0] if drawn else children[0])


@pytest.mark.slow
def test_the_same_test_rejects_a_walk_biased_to_first_children(soft_model, plain_reference,
                                                               monkeypatch):
    exact, plain, _ = plain_reference
    monkeypatch.setattr(draft_tree, "accepted_path", first_child_walk)
    assert round_steps.draft_tree.accepted_path is first_child_walk
    draws = tree_draws(soft_model, N_MTP, RunStats())
    assert two_sample(draws, plain)[2] < ALPHA
    assert goodness_of_fit(draws, exact)[2] < ALPHA
