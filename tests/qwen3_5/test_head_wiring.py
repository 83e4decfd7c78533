"""A head built to agree with its target must be accepted; wiring mistakes must not be."""

import mlx.core as mx
import pytest
from support import tiny_checkpoints as tc
from support.reference import reference_greedy

import mlx_mtp
import mlx_mtp.models.qwen3_5.loading as loading
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.models.qwen3_5.drafter import MTPHead

PROMPT = [5, 17, 42, 99, 7, 250, 3, 64]
N = 60


@pytest.fixture(scope="module")
def agreeing_dir(ckpt_root):
    return tc.write_agreeing_checkpoint(ckpt_root / "agreeing", seed=3)


def acceptance(model, block_size=3):
    stats = RunStats()
    out = [t for t, _ in mlx_mtp.generate_step(mx.array(PROMPT), model, max_tokens=N,
                                               block_size=block_size, stats=stats)]
    return out, stats


def test_correct_wiring_is_accepted(agreeing_dir):
    model = mlx_mtp.load_model(agreeing_dir)
    ref = reference_greedy(agreeing_dir, PROMPT, N)
    for bs in (2, 3, 4):
        out, stats = acceptance(model, bs)
        assert out == ref
        assert stats.acceptance_rate >= 0.9, (bs, stats.to_dict())
        assert stats.per_position_acceptance[0] >= 0.9
        assert stats.tokens_per_round >= 0.9 * bs


class SwappedConcatHead(MTPHead):
    def __call__(self, embeds, hidden, cache):  # hidden first: the known wrong order
        x = self.fc(mx.concatenate([self.pre_fc_norm_hidden(hidden),
                                    self.pre_fc_norm_embedding(embeds)], axis=-1))
        for layer, c in zip(self.layers, cache):
            x = layer(x, mask=None if x.shape[1] == 1 else "causal", cache=c)
        return self.norm(x)


def test_swapped_concat_is_rejected(agreeing_dir):
    model = mlx_mtp.load_model(agreeing_dir)
    model.drafter.head.__class__ = SwappedConcatHead
    out, stats = acceptance(model)
    assert out == reference_greedy(agreeing_dir, PROMPT, N)  # output exact regardless
    assert stats.acceptance_rate < 0.3


def test_unshifted_norms_are_rejected(agreeing_dir, monkeypatch):
    monkeypatch.setattr(loading, "is_zero_centred_norm", lambda key: False)
    _, stats = acceptance(mlx_mtp.load_model(agreeing_dir))
    assert stats.acceptance_rate < 0.3


def test_double_shifted_norms_are_rejected(agreeing_dir, monkeypatch):
    real = loading.collect_head_weights

    def twice(files, **kw):
        return {k: (v + 1.0 if loading.is_zero_centred_norm(k) and v.ndim == 1 else v)
                for k, v in real(files, **kw).items()}

    monkeypatch.setattr(loading, "collect_head_weights", twice)
    _, stats = acceptance(mlx_mtp.load_model(agreeing_dir))
    assert stats.acceptance_rate < 0.3
