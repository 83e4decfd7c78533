"""T=0 output stays mlx-lm's greedy decode with every drafter phase on; phase 4's two checks."""

import mlx.core as mx
import numpy as np
import pytest
from support import tiny_checkpoints as tc
from support.reference import reference_greedy
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.tokenizer_utils import load as load_tokenizer
from support.oracle import ForcedHeadDrafter

import mlx_mtp
from mlx_mtp.models.qwen3_5 import vocab_reduction as draft_vocab
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.models.options import DraftOptions
from mlx_mtp.models.model import MTPModel

PROMPTS = {"short": [7], "long": [5, 17, 3, 99, 42, 7, 250, 31, 64, 12, 9, 200, 33, 1, 8, 77, 150]}
N = 20


def all_phases(path, tmp_path, drafter=None, size=128):
    """Every phase on: device ids, fused argmax (small chunks), a draft vocabulary built over
    the tests' corpus, and a 4-bit head."""
    (tmp_path / "corpus.txt").write_text("\n\n".join(tc.CORPUS))
    base = mlx_mtp.load_model(path, drafter=drafter)
    draft_vocab.build(base, load_tokenizer(path), size=size, corpus=[tmp_path / "corpus.txt"],
                      out=tmp_path / "vocab")
    options = DraftOptions(device_ids=True, fused_argmax=True, fused_chunk=16,
                           vocab=tmp_path / "vocab", bits=4)
    model = mlx_mtp.load_model(path, drafter=drafter, draft_options=options)
    d = model.drafter.describe()
    assert d["reduced_vocab"] and d["fused_argmax"] and d["bits"] == [4], d
    return model


def run(model, prompt, bs, stats=None):
    return [t for t, _ in mlx_mtp.generate_step(mx.array(prompt), model, max_tokens=N,
                                                block_size=bs, stats=stats)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "tied", "q4", "moe", "next"])
def test_every_phase_on_keeps_greedy_identity(kind, request, dense_dir, tmp_path):
    path = request.getfixturevalue(f"{kind}_dir")
    model = all_phases(path, tmp_path, drafter=dense_dir if kind == "q4" else None)
    for name, prompt in PROMPTS.items():
        ref = reference_greedy(path, prompt, N)
        for bs in range(1, 7):
            assert run(model, prompt, bs) == ref, (kind, name, bs)
        # Every acceptance length, through the optimized drafter's own state handling.
        for bs in (3, 5):
            K = bs - 1
            forced = ForcedHeadDrafter(model.drafter, prompt + ref, schedule=list(range(K + 1)),
                                       vocab_size=model.target.vocab_size)
            assert run(MTPModel(model.mlx_model, model.target, forced), prompt, bs) == ref
            assert set(range(K + 1)) <= set(forced.planned)


def test_every_phase_on_a_head_that_agrees(tmp_path):
    """The agreeing pair's drafts are really accepted with every phase on (the draft vocabulary
    here is built from the target's own generations, which is where its drafts live)."""
    path = tc.write_agreeing_checkpoint(tmp_path / "pair", seed=3)
    prompt = PROMPTS["long"]
    ref = reference_greedy(path, prompt, 40)
    base = mlx_mtp.load_model(path)
    (tmp_path / "c.txt").write_text(" ".join(str(t) for t in prompt))
    tok = load_tokenizer(path)
    counts = np.bincount(np.array(ref), minlength=320)
    ids = np.sort(np.argsort(-counts, kind="stable")[:160])
    draft_vocab.write_sidecar(tmp_path / "v", ids, {
        "size": 160, "vocab_size": 320, "tokenizer_sha256": draft_vocab.tokenizer_sha256(tok),
        "head_sha256": draft_vocab.head_sha256(base.target)})
    model = mlx_mtp.load_model(path, draft_options=DraftOptions(
        fused_argmax=True, fused_chunk=16, vocab=tmp_path / "v", bits=4))
    for bs in (2, 3, 4, 6):
        stats = RunStats()
        out = [t for t, _ in mlx_mtp.generate_step(mx.array(prompt), model, max_tokens=40,
                                                   block_size=bs, stats=stats)]
        assert out == ref, bs
        assert stats.acceptance_rate > 0.5, (bs, stats.acceptance_rate)


class Recorder(ForcedHeadDrafter):
    def accept(self, hidden, next_ids):
        self.seen.append((hidden, next_ids.tolist()))
        super().accept(hidden, next_ids)


def test_accept_hook_gets_one_slice_of_the_verify_hidden(dense_dir):
    """Phase 4: the accepted hidden states reach the accept hook as one slice h[:, :a + 1] of
    the verify output (no per-position concatenation anywhere)."""
    model = mlx_mtp.load_model(dense_dir)
    prompt = PROMPTS["long"]
    ref = reference_greedy(dense_dir, prompt, N)
    run(model, prompt, 4)  # the exactness probe (memoized) verifies too: keep it out
    verified = []
    real_verify = model.target.verify
    model.target.verify = lambda ids, cache: verified.append(real_verify(ids, cache)) or verified[-1]
    try:
        rec = Recorder(model.drafter, prompt + ref, schedule=[3, 0, 1, 2], vocab_size=320)
        rec.seen = []
        assert run(MTPModel(model.mlx_model, model.target, rec), prompt, 4) == ref
    finally:
        del model.target.verify
    # every drafting round but the last feeds the hook (no round drafts after it)
    assert len(rec.seen) == len(verified) - 1 > 3
    for (hidden, ids), h, a in zip(rec.seen, verified, rec.planned):
        n = len(ids)
        assert n == a + 1  # the a accepted drafts and the target's token
        assert hidden.shape == (1, n, h.shape[-1])
        assert bytes(memoryview(hidden)) == bytes(memoryview(h[:, :n]))


@pytest.mark.parametrize("offset", [0, 1, 17, 300])
@pytest.mark.parametrize("width", range(1, 9))
def test_no_array_mask_is_built_for_multi_token_calls(offset, width):
    """Phase 4: for full-attention KV caches (the head's and the target's), mlx-lm hands SDPA
    the string "causal" for a multi-token call and None for one token: there is no mask array
    to cache by (length, offset)."""
    cache = KVCache()
    cache.offset = offset
    mask = create_attention_mask(mx.zeros((1, width, 8)), cache)
    assert mask == ("causal" if width > 1 else None)
