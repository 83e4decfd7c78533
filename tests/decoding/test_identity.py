"""T=0 identity with mlx-lm's plain greedy decode, and bitwise cache states after every round."""

import mlx.core as mx
import pytest
from support.reference import CODE_PROMPT, reference_greedy
from mlx_lm.models.cache import KVCache
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.utils import load_model as mlx_load_model
from support.native_support import one_row_products_in_kernel_order
from support.commits import committed, drafter_fed
from support.oracle import ForcedHeadDrafter, OracleDrafter

import mlx_mtp
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.models.model import MTPModel

MAX_TOKENS = 24


def prompts(path):
    tok = load_tokenizer(path)
    long = tok.encode(CODE_PROMPT)
    assert len(long) > 16
    return {"len1": long[:1], "long": long}


def run(model, prompt, block_size, max_tokens=MAX_TOKENS, stats=None):
    return [t for t, _ in mlx_mtp.generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                                                block_size=block_size, stats=stats)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "moe", "moe_per_expert", "tied", "q4", "next"])
def test_greedy_identity_with_real_head(kind, request, dense_dir):
    path = request.getfixturevalue(f"{kind}_dir")
    drafter = dense_dir if kind == "q4" else None  # the 4-bit MLX conversion lost its head
    model = mlx_mtp.load_model(path, drafter=drafter)
    for name, prompt in prompts(path).items():
        ref = reference_greedy(path, prompt, MAX_TOKENS)
        for bs in range(1, 7):
            assert run(model, prompt, bs) == ref, (kind, name, bs)


@pytest.mark.parametrize("kind", ["dense"] + [pytest.param(k, marks=pytest.mark.slow)
                                              for k in ("moe", "tied", "q4", "next", "wide")])
def test_every_acceptance_length_is_exact(kind, request):  # dense: the quick subset's Qwen check
    """An oracle drafter forces acceptance lengths 0..K; output stays mlx-lm's greedy output."""
    path = request.getfixturevalue(f"{kind}_dir")
    model = mlx_mtp.load_model(path, require_head=False)
    for name, prompt in prompts(path).items():
        ref = reference_greedy(path, prompt, MAX_TOKENS)
        for bs in range(2, 7):
            K = bs - 1
            oracle = OracleDrafter(prompt + ref, schedule=list(range(K + 1)),
                                   vocab_size=model.target.vocab_size)
            forced = MTPModel(model.mlx_model, model.target, oracle)
            stats = RunStats()
            assert run(forced, prompt, bs, stats=stats) == ref, (kind, name, bs)
            assert stats.accepted == sum(oracle.planned)
            assert stats.accepted > 0
            # every acceptance length 0..K occurred in some round
            assert set(range(K + 1)) <= set(oracle.planned), oracle.planned


class _FedDrafter(OracleDrafter):
    """The oracle, noting how many pairs it had been fed when each round drafted."""

    def draft(self, k: int) -> mx.array:
        self.fed_at_draft = self.consumed
        return super().draft(k)


@pytest.mark.parametrize("block_size", [2, 3, 4])
def test_drafter_is_not_fed_after_the_last_drafting_round(block_size, dense_dir):
    """No later round drafts once at most one token of the budget is left: the last drafting
    round's accepted pairs are never fed to the drafter, and the output stays exact."""
    model = mlx_mtp.load_model(dense_dir, require_head=False)
    prompt = prompts(dense_dir)["long"]
    ref = reference_greedy(dense_dir, prompt, MAX_TOKENS)
    oracle = _FedDrafter(prompt + ref, schedule=[block_size - 1, 0, 1],
                         vocab_size=model.target.vocab_size)
    stats = RunStats()
    out = run(MTPModel(model.mlx_model, model.target, oracle), prompt, block_size, stats=stats)
    assert out == ref
    assert stats.accepted == sum(oracle.planned)
    # every token but the first and those of the last drafting round (and a plain step after it)
    assert oracle.consumed == oracle.fed_at_draft
    assert len(prompt) < oracle.consumed <= len(prompt) + MAX_TOKENS - 1 - 2


def _snapshot(target, cache):
    arrays = target.cache_state(cache)
    mx.eval(arrays)
    return arrays


def _assert_bitwise(got, want, what):
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, (what, i, g.shape, w.shape)
        assert bytes(memoryview(g)) == bytes(memoryview(w)), (what, i)


def _assert_close(got, want, what):
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, (what, i, g.shape, w.shape)
        assert mx.allclose(g, w, rtol=1e-4, atol=1e-5).item(), (what, i)


def _head_rows_invariant(model, T: int = 6) -> bool:
    """Whether the head's forward over T pairs at once (the accept hook) gives the cache entries
    of T one-pair forwards bitwise with this BLAS on this CPU, measured on random pairs: its
    multi-row products (which ``row_exact_layers`` leaves alone: they shape drafts, never the output)
    may reduce differently from one-row ones, depending on the BLAS's kernels and the shapes."""
    head = model.drafter.head
    H = model.target.args.hidden_size
    x = mx.random.normal((1, T, H), key=mx.random.key(71))
    h = mx.random.normal((1, T, H), key=mx.random.key(72))
    block, rows = [KVCache() for _ in head.layers], [KVCache() for _ in head.layers]
    head(x, h, block)
    for i in range(T):
        head(x[:, i : i + 1], h[:, i : i + 1], rows)
    a = [block[0].keys[..., :T, :], block[0].values[..., :T, :]]
    b = [rows[0].keys[..., :T, :], rows[0].values[..., :T, :]]
    mx.eval(a, b)
    return all(bytes(memoryview(p)) == bytes(memoryview(q)) for p, q in zip(a, b))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "moe", "next", "wide"])
def test_caches_bitwise_equal_sequential_reference_after_every_round(kind, request):
    path = request.getfixturevalue(f"{kind}_dir")
    model = mlx_mtp.load_model(path)
    prompt = prompts(path)["long"]
    n_tokens = 30
    ref = reference_greedy(path, prompt, n_tokens)
    full = prompt + ref

    # Sequential reference on a pristine mlx-lm model: target cache state and post-norm hidden
    # after each committed token, exactly as plain decode builds them.
    pristine, _ = mlx_load_model(path)
    trunk = pristine.language_model.model if kind != "next" else pristine.model
    ref_cache = pristine.make_cache()
    hiddens = [trunk(mx.array(prompt[:-1])[None], ref_cache)]
    target_states = {}
    for p in range(len(prompt) - 1, len(full) - 1):
        hiddens.append(trunk(mx.array(full[p : p + 1])[None], ref_cache))
        target_states[p + 1] = _snapshot(model.target, ref_cache)
    hidden_all = mx.concatenate(hiddens, axis=1)  # h_p for p = 0 .. len(full) - 2

    # Reference MTP cache: the head run one pair (x_{p+1}, h_p) at a time.
    head = model.drafter.head
    mtp_cache = [KVCache() for _ in head.layers]
    mtp_states = {}
    for p in range(len(full) - 1):
        head(model.target.embed(mx.array([[full[p + 1]]])), hidden_all[:, p : p + 1], mtp_cache)
        c = mtp_cache[0]
        mtp_states[p + 1] = [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
        mx.eval(mtp_states[p + 1])

    head_exact = _head_rows_invariant(model)
    for bs in (2, 3, 4, 6):
        K = bs - 1
        forced = ForcedHeadDrafter(model.drafter, full, schedule=[K, 0, 1, K - 1, 2],
                                   vocab_size=model.target.vocab_size)
        fm = MTPModel(model.mlx_model, model.target, forced)
        # The target cache at the end of every round.
        with committed(model.target) as captured:
            gen = mlx_mtp.generate_step(mx.array(prompt), fm, max_tokens=n_tokens, block_size=bs)
            out = []
            checked = 0
            for tok, _ in gen:
                out.append(tok)
                cache = captured.get("cache")
                if cache is None:
                    continue
                offset = next(c.offset for c in cache if isinstance(c, KVCache))
                _assert_bitwise(_snapshot(model.target, cache), target_states[offset],
                                (kind, bs, "target", offset))
                if not drafter_fed(offset, len(prompt), n_tokens):
                    assert model.drafter.offset < offset  # the last drafting round's pairs
                    continue
                assert model.drafter.offset == offset
                c = model.drafter.cache[0]
                got = [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
                mx.eval(got)
                # The head's cache holds the entries of exactly the committed pairs: bitwise
                # those of one pair at a time where its multi-row products are row-invariant
                # here (measured; BLIS on AVX2 with 1152-wide inputs is not, nor BLIS's generic
                # kernels), else equal up to rounding. The target's caches above are the
                # exactness promise.
                check = _assert_bitwise if head_exact else _assert_close
                check(got, mtp_states[offset], (kind, bs, "mtp", offset))
                checked += 1
        assert out == ref
        assert checked >= n_tokens // 2
        assert set(forced.planned) >= {0, 1, K}


@pytest.mark.parametrize("kernel", ["lazy", "eager", "0"])
def test_wide_projections_verify_exactly_with_and_without_the_row_kernel(kernel, wide_dir,
                                                                       monkeypatch):
    """Inputs wider than 512 (BLIS reduces their multi-row products another way): with the
    compiled row kernel (where it builds) as a lazy MLX op or called eagerly, and with it
    switched off, every acceptance length gives mlx-lm's greedy output, and the stats say which
    method the row-exact layers use and how the kernel runs."""
    from mlx_mtp.cpu import lazy_ops as lazy_kernels
    from mlx_mtp.cpu import row_kernel
    from mlx_mtp.exactness import row_exact_layers

    monkeypatch.setenv(row_kernel.ENV, "0" if kernel == "0" else "1")
    monkeypatch.setenv(lazy_kernels.ENV, "0" if kernel == "eager" else "1")
    row_kernel.reset()
    lazy_kernels.reset()
    try:
        model = mlx_mtp.load_model(wide_dir, require_head=False)
        prompt = prompts(wide_dir)["long"]
        ref = reference_greedy(wide_dir, prompt, MAX_TOKENS)
        oracle = OracleDrafter(prompt + ref, schedule=[3, 0, 2, 1],
                               vocab_size=model.target.vocab_size)
        stats = RunStats()
        assert run(MTPModel(model.mlx_model, model.target, oracle), prompt, 4, stats=stats) == ref
        info = stats.exactness["row_exact"]
        # the stats count the forms the model runs (which ones depends on how this BLAS
        # reduces here: BLIS's AVX2 kernels switch every 576 / 1152-wide projection)
        running = row_exact_layers.row_exact_report(model.mlx_model)["layers"]
        assert info["layers"] == running, info
        if kernel == "0" or not row_kernel.available():
            assert "kernel" not in info["layers"], info
        if kernel != "0" and row_kernel.available() and one_row_products_in_kernel_order():
            assert set(info["layers"]) == {"kernel"} and info["layers"]["kernel"] >= 20, info
        assert info["kernel"] == (
            (f"available, {lazy_kernels.mode()}" if info["layers"].get("kernel") else "available")
            if kernel != "0" and row_kernel.available()
            else f"unavailable ({row_kernel.reason()})")
        if kernel == "0":
            assert info["kernel"] == "unavailable (MLX_MTP_ROW_KERNEL=0)"
        if kernel == "eager" and info["layers"].get("kernel"):
            assert info["kernel"] == "available, eager (MLX_MTP_LAZY_KERNELS=0)"
        if kernel == "lazy" and info["layers"].get("kernel") and lazy_kernels.available():
            assert info["kernel"] == "available, lazy"
    finally:
        monkeypatch.delenv(lazy_kernels.ENV)
        lazy_kernels.reset()
        monkeypatch.delenv(row_kernel.ENV)
        row_kernel.reset()
