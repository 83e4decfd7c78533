"""The Gemma 4 assistant against a NumPy re-implementation of the spec's forward (§1.4), its
centroid head (§1.6), which target K/V it reads (§1.5) and its round-loop state (§2.4)."""

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache
from support.tiny_gemma4 import WINDOW, Checkpoints

import mlx_mtp
from mlx_mtp.models.gemma4.drafter import Gemma4AssistantDrafter
from mlx_mtp.errors import MTPError

SLIDING, FULL = "sliding_attention", "full_attention"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return Checkpoints(tmp_path_factory)


def np_params(module):
    from mlx.utils import tree_flatten

    return {k: np.array(v, dtype=np.float64) for k, v in tree_flatten(module.parameters())}


def rms(x, w, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, pos, layer_type, head_dim):
    """Non-traditional RoPE on the last axis; full layers rotate only 25% of the dims
    ("proportional": exponents over the full head_dim, the rest unrotated)."""
    if layer_type == SLIDING:
        base, rotated = 10000.0, head_dim
    else:
        base, rotated = 1000000.0, int(head_dim * 0.25)
    half = head_dim // 2
    freqs = np.full(half, np.inf)
    i = np.arange(0, rotated, 2)
    freqs[: i.size] = base ** (i / head_dim)
    ang = pos / freqs
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x1 * np.sin(ang) + x2 * np.cos(ang)], -1)


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def np_step(P, cfg, emb_scaled, h_prev, kv, pos):
    """Spec §1.4, one query, float64. ``kv[type] = (K [n_kv, S, hd], V)``."""
    t = cfg["text_config"]
    x = P["pre_projection.weight"] @ np.concatenate([emb_scaled, h_prev])
    for i, lt in enumerate(t["layer_types"]):
        p = f"model.layers.{i}."
        hd = t["global_head_dim"] if lt == FULL else t["head_dim"]
        nq = t["num_attention_heads"]
        r = x
        a = rms(x, P[p + "input_layernorm.weight"])
        q = (P[p + "self_attn.q_proj.weight"] @ a).reshape(nq, hd)
        q = rope(rms(q, P[p + "self_attn.q_norm.weight"]), pos, lt, hd)
        K, V = kv[lt]
        group = nq // K.shape[0]
        o = []
        for j in range(nq):
            s = K[j // group] @ q[j]  # attention scale 1.0
            w = np.exp(s - s.max())
            o.append((w / w.sum()) @ V[j // group])
        x = r + rms(P[p + "self_attn.o_proj.weight"] @ np.concatenate(o),
                    P[p + "post_attention_layernorm.weight"])
        u = rms(x, P[p + "pre_feedforward_layernorm.weight"])
        m = P[p + "mlp.down_proj.weight"] @ (gelu_tanh(P[p + "mlp.gate_proj.weight"] @ u)
                                             * (P[p + "mlp.up_proj.weight"] @ u))
        x = (x + rms(m, P[p + "post_feedforward_layernorm.weight"])) * P[p + "layer_scalar"]
    hn = rms(x, P["model.norm.weight"])
    return hn, P["post_projection.weight"] @ hn


def reference_kv(target, prompt, pos):
    """Producer K/V from an independent full-history run (KVCache everywhere, mlx-lm masks the
    window), cut to what a query at ``pos`` may see among the committed positions."""
    cache = [KVCache() for _ in range(target.num_cached)]
    h = target.hidden(mx.array(prompt)[None], cache)
    p = len(prompt)
    out = {}
    for lt, i in target.producers.items():
        lo = max(0, pos - WINDOW + 1) if lt == SLIDING else 0
        out[lt] = tuple(np.array(a[0, :, lo:p], dtype=np.float64) for a in (cache[i].keys, cache[i].values))
    return h, out


def np_greedy(P, cfg, hn, order):
    E = P["model.embed_tokens.weight"]
    if not cfg["use_ordered_embeddings"]:
        return int(np.argmax(E @ hn))
    C, k = cfg["num_centroids"], cfg["centroid_intermediate_top_k"]
    top = np.argsort(-(P["masked_embedding.centroids.weight"] @ hn))[:k]
    ids = order.reshape(C, -1)[top].reshape(-1)
    return int(ids[np.argmax(E[ids] @ hn)])


@pytest.mark.parametrize("kind", ["e2b", "31b"])
@pytest.mark.parametrize("query_position", ["last_kv", "bonus"])
@pytest.mark.parametrize("prompt_len", [5, 40])
def test_drafts_match_numpy_reference_of_the_spec(kind, query_position, prompt_len, ckpts):
    import json

    model = mlx_mtp.load_model(ckpts.target(kind), drafter=ckpts.assistant(kind))
    drafter, target = model.drafter, model.target
    drafter.query_position = query_position
    cfg = json.loads((ckpts.assistant(kind) / "config.json").read_text())
    prompt = [(7 * i + 3) % 300 for i in range(prompt_len)]
    bonus = 42
    cache = target.make_cache()
    drafter.reset()
    drafter.bind_cache(cache)
    h = target.hidden(mx.array(prompt)[None], cache)
    drafter.prefill(h, mx.array(prompt[1:] + [bonus]))
    drafts = drafter.draft(3)
    assert drafts.shape == (3,) and drafts.dtype == mx.uint32

    p = prompt_len
    pos = p - 1 if query_position == "last_kv" else p
    assert drafter.position == pos
    h_ref, kv = reference_kv(target, prompt, pos)
    for lt, (K, _) in kv.items():
        assert drafter.shared_kv[lt][0].shape[2] == K.shape[1]  # the window it reads
    P = np_params(drafter.assistant)
    order = np.array(drafter.assistant.masked_embedding._token_ordering) if kind == "e2b" else None
    E_tgt = np.array(target.trunk.embed_tokens.weight, dtype=np.float64)
    state = np.array(h_ref[0, -1], dtype=np.float64)
    tok, want = bonus, []
    for _ in range(3):
        emb = E_tgt[tok] * math.sqrt(target.hidden_size)
        hn, state = np_step(P, cfg, emb, state, kv, pos)
        tok = np_greedy(P, cfg, hn, order)
        want.append(tok)
    assert drafts.tolist() == want
    # and the MLX forward itself, not only its argmax
    hn_mx, st_mx = drafter.assistant(target.embed(mx.array([[bonus]])), h[:, -1:],
                                     drafter.shared_kv, pos)
    hn0, st0 = np_step(P, cfg, E_tgt[bonus] * math.sqrt(target.hidden_size),
                       np.array(h_ref[0, -1], dtype=np.float64), kv, pos)
    np.testing.assert_allclose(np.array(hn_mx[0, 0]), hn0, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.array(st_mx[0, 0]), st0, rtol=1e-4, atol=1e-5)


def test_producers_are_the_last_own_kv_layer_of_each_type(ckpts):
    e2b = mlx_mtp.load_model(ckpts.target("e2b"), require_head=False).target
    assert e2b.producers == {SLIDING: 5, FULL: 4}
    assert e2b.trunk.previous_kvs[6:] == [5, 5, 5, 4]  # what the target's shared layers read
    b31 = mlx_mtp.load_model(ckpts.target("31b"), require_head=False).target
    assert b31.producers == {SLIDING: 10, FULL: 11}
    assert b31.layers[11].self_attn.use_k_eq_v and b31.layers[11].self_attn.n_kv_heads == 1


def test_centroid_head(ckpts):
    model = mlx_mtp.load_model(ckpts.target("e2b"), drafter=ckpts.assistant("e2b"))
    a = model.drafter.assistant
    me = a.masked_embedding
    hn = mx.random.normal((1, 3, 32), key=mx.random.key(3))
    logits = a.logits(hn)
    assert logits.shape == (1, 3, 320)
    order = np.array(me._token_ordering).reshape(16, 20)
    scores = np.array(me.centroids(hn))
    E = np.array(a.model.embed_tokens.weight)
    for r in range(3):
        top = np.argsort(-scores[0, r])[:4]
        cand = order[top].reshape(-1)
        row = np.array(logits[0, r])
        assert set(np.flatnonzero(np.isfinite(row))) == set(cand.tolist())
        assert np.all(row[np.setdiff1d(np.arange(320), cand)] == -np.inf)
        np.testing.assert_allclose(row[cand], E[cand] @ np.array(hn[0, r]), rtol=1e-5, atol=1e-6)
    assert a.argmax(hn).tolist() == mx.argmax(logits, axis=-1).tolist()


def test_dense_head_is_the_tied_embedding_without_softcap(ckpts):
    model = mlx_mtp.load_model(ckpts.target("31b"), drafter=ckpts.assistant("31b"))
    a = model.drafter.assistant
    assert "masked_embedding" not in a
    hn = mx.random.normal((1, 2, 32), key=mx.random.key(4))
    assert mx.array_equal(a.logits(hn), hn @ a.model.embed_tokens.weight.T).item()
    assert a.argmax(hn).tolist() == mx.argmax(hn @ a.model.embed_tokens.weight.T, -1).tolist()


def test_query_position_setting(ckpts):
    model = mlx_mtp.load_model(ckpts.target("e2b"), drafter=ckpts.assistant("e2b"))
    assert model.drafter.query_position == "last_kv"
    with pytest.raises(MTPError, match=r"^query_position must be one of last_kv, bonus, got 'p'$"):
        model.drafter.query_position = "p"
    with pytest.raises(MTPError, match=r"^query_position must be one of last_kv, bonus, got 3$"):
        Gemma4AssistantDrafter(model.drafter.assistant, model.target, query_position=3)


def test_drafter_needs_the_target_cache(ckpts):
    model = mlx_mtp.load_model(ckpts.target("e2b"), drafter=ckpts.assistant("e2b"))
    d = Gemma4AssistantDrafter(model.drafter.assistant, model.target)
    with pytest.raises(RuntimeError, match="needs the target cache: call bind_cache"):
        d.prefill(mx.zeros((1, 1, 64)), mx.array([1]))


@pytest.mark.parametrize("kind", ["e2b", "31b"])
def test_draft_sampled_hands_full_vocabulary_logits_to_the_sampler(kind, ckpts):
    """The sampling-drafter hook: each step's logits [1, V] go to ``sample`` (-inf outside the
    centroid head's candidates); an argmax ``sample`` reproduces the greedy drafts."""
    model = mlx_mtp.load_model(ckpts.target(kind), drafter=ckpts.assistant(kind))
    drafter, target = model.drafter, model.target
    prompt = [(7 * i + 3) % 300 for i in range(20)]
    cache = target.make_cache()
    drafter.reset()
    drafter.bind_cache(cache)
    drafter.prefill(target.hidden(mx.array(prompt)[None], cache), mx.array(prompt[1:] + [42]))
    seen = []

    def argmax_sample(logits):
        seen.append(logits)
        return mx.argmax(logits, axis=-1)

    sampled = drafter.draft_sampled(4, argmax_sample)
    assert sampled.tolist() == drafter.draft(4).tolist() and sampled.dtype == mx.uint32
    assert len(seen) == 4 and all(l.shape == (1, 320) for l in seen)
    finite = [int(mx.isfinite(l).sum().item()) for l in seen]
    assert finite == ([4 * 20] * 4 if kind == "e2b" else [320] * 4)
