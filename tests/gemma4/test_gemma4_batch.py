"""Batched rounds on Gemma 4: several sequences' blocks in one packed forward, each row fed to
its own sequence's caches (sliding windows included) and attending on its own, so each sequence
gets what its verify alone gives; with the assistant drafting, T=0 output is mlx-lm's greedy
output for every sequence."""

import mlx.core as mx
import pytest
from support.reference import reference_greedy
from support.packed import assert_packed_verify_equals_alone
from support.tiny_gemma4 import WINDOW, Checkpoints

import mlx_mtp
from mlx_mtp.decoding.batch_rounds import BatchRounds

SLOW = [pytest.param(k, marks=pytest.mark.slow) for k in ("31b", "26b")]
# a prompt inside the window, one that crosses it while decoding, one longer than it
PROMPTS = [[(7 * i + 3) % 300 for i in range(5)], [(5 * i + 1) % 300 for i in range(WINDOW - 2)],
           [(11 * i + 5) % 300 for i in range(40)]]
assert len(PROMPTS[2]) > WINDOW


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return Checkpoints(tmp_path_factory)


@pytest.mark.parametrize("kind", ["e2b"] + SLOW)
def test_a_packed_verify_equals_each_sequence_alone(kind, ckpts):
    target = mlx_mtp.load_model(ckpts.target(kind), require_head=False).target
    target.prepare(8)
    blocks = [[(13 * i + s) % target.vocab_size for i in range(w)]
              for s, w in enumerate((3, 1, 4))]
    assert_packed_verify_equals_alone(target, PROMPTS, blocks, kind)


@pytest.mark.parametrize("kind", ["e2b"] + SLOW)
def test_batched_rounds_with_the_assistant_give_each_prompts_greedy_tokens(kind, ckpts):
    model = mlx_mtp.load_model(ckpts.target(kind), drafter=ckpts.assistant(kind))
    rounds = BatchRounds(model, 3, block_size=3)
    budgets = [12, 9, 14]
    seqs = [rounds.start(mx.array(p), max_tokens=n) for p, n in zip(PROMPTS, budgets)]
    gens = [rounds.tokens(s) for s in seqs]
    outs = [[t for t, _, _ in g] for g in gens]  # one sequence read to its end, then the next
    for p, n, out in zip(PROMPTS, budgets, outs):
        assert out == reference_greedy(ckpts.target(kind), p, n)
    assert all(s.stats.rounds > 0 for s in seqs)
