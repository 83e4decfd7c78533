"""Sampling through the round loop: MTP output has plain sampling's distribution (a chi-square
test with a biased rule as negative control), logits processors see mlx-lm's token history,
seeds reproduce, T=0 with processors stays mlx-lm's greedy decode, and the CLI flags."""

import importlib
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from support.chisquare import goodness_of_fit, two_sample
from support.plain_sampling import reference
from support.reference import CODE_PROMPT
from mlx_lm.generate import generate_step as mlx_generate_step
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.sample_utils import make_sampler as mlx_make_sampler
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.utils import load_model as mlx_load_model
from support.oracle import OracleDrafter, TableDrafter

import mlx_mtp
generate = importlib.import_module("mlx_mtp.generate")  # the CLI module (mlx_mtp.generate is also the function)
from mlx_mtp import MTPError
from mlx_mtp.decoding import sampling
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.models.model import MTPModel

ALPHA = 1e-3  # reject "same distribution" below this p-value


# ------------------------------------------------------------ the distribution test (the claim)

PROMPT = [5]
SAMPLING = dict(temp=1.0, top_k=3)
N_TOKENS = 4  # one round of block size 3 can emit tokens 2..4: two chained drafts + bonus
N_PLAIN = 20000
N_MTP = 300


@pytest.fixture(scope="module")
def plain_reference(soft_dir):
    return reference(soft_dir, PROMPT, SAMPLING, N_TOKENS, N_PLAIN)[:2]


def mtp_draws(model, n, acceptance="auto", stats=None):
    sampler = mlx_mtp.make_sampler(**SAMPLING)
    mx.random.seed(1234)  # the point-mass rule draws through the sampler's global stream
    return [tuple(t for t, _ in mlx_mtp.generate_step(
        mx.array(PROMPT), model, max_tokens=N_TOKENS, block_size=3, sampler=sampler, seed=i,
        acceptance=acceptance, stats=stats)) for i in range(n)]


_rejection_sample = sampling.rejection_sample  # the real rule, kept from the monkeypatch


def argmax_matching(p, q, drafts, key, q_ids=None):
    """A known biased rule: keep a sampled draft when it equals the target's argmax; otherwise
    emit a draw from p."""
    k = drafts.size
    if k == 0:
        return _rejection_sample(p, q, drafts, key, q_ids)
    return drafts == mx.argmax(p[:k], axis=-1), mx.random.categorical(mx.log(p), key=key)


@pytest.mark.slow
def test_the_reference_is_mlx_lm_plain_sampling(plain_reference):
    exact, plain = plain_reference
    assert len(exact) == 3 ** N_TOKENS and abs(sum(exact.values()) - 1) < 1e-5
    assert goodness_of_fit(plain, exact)[2] > ALPHA
    assert max(exact.values()) < 0.5  # soft: no single continuation dominates


@pytest.mark.slow
@pytest.mark.parametrize("acceptance,rule", [("auto", "speculative-sampling"),
                                             ("point-mass", "point-mass")])
def test_mtp_sampling_has_plain_samplings_joint_distribution(soft_model, plain_reference,
                                                             acceptance, rule):
    exact, plain = plain_reference
    stats = RunStats()
    draws = mtp_draws(soft_model, N_MTP, acceptance, stats)
    assert stats.acceptance_rule == rule
    assert two_sample(draws, plain)[2] > ALPHA
    assert goodness_of_fit(draws, exact)[2] > ALPHA
    # Both draft positions were tried and kept sometimes, not always.
    assert stats.offered[1] > N_MTP // 2
    assert all(0.2 < a < 0.9 for a in stats.per_position_acceptance), stats.per_position_acceptance


@pytest.mark.slow
def test_the_same_test_rejects_argmax_matching(soft_model, plain_reference, monkeypatch):
    exact, plain = plain_reference
    monkeypatch.setattr(sampling, "rejection_sample", argmax_matching)
    draws = mtp_draws(soft_model, N_MTP)
    assert two_sample(draws, plain)[2] < ALPHA
    assert goodness_of_fit(draws, exact)[2] < ALPHA


@pytest.mark.slow
def test_gemma4_sampling_has_plain_samplings_joint_distribution(tmp_path_factory):
    """The other family through the same loop: a Gemma 4 target with its assistant sampling the
    drafts (full-vocabulary q, the 31B-like layout without a centroid head). Random weights, so
    drafts are mostly rejected: this checks the rejection / residual / bonus path for Gemma."""
    from support.tiny_gemma4 import Checkpoints

    ckpts = Checkpoints(tmp_path_factory)
    target = ckpts.target("31b")
    model = mlx_mtp.load_model(target, drafter=ckpts.assistant("31b"))
    exact, plain, _, _ = reference(target, PROMPT, SAMPLING, N_TOKENS, N_PLAIN)
    assert goodness_of_fit(plain, exact)[2] > ALPHA
    stats = RunStats()
    draws = mtp_draws(model, N_MTP, "auto", stats)
    assert stats.acceptance_rule == "speculative-sampling"
    # Each 4-token run has at least two rounds with room for a draft (a last round that needs
    # one token drafts nothing).
    assert stats.offered[0] >= 2 * N_MTP
    assert two_sample(draws, plain)[2] > ALPHA
    assert goodness_of_fit(draws, exact)[2] > ALPHA


# ----------------------------------------------------------------- history, seeds, rule choice


def forced_mlx_lm(path, prompt, tokens, processors):
    """mlx-lm's generate_step made to emit ``tokens``: its (processed) logprobs at every step."""
    model, _ = mlx_load_model(Path(path))
    forced = iter(tokens)
    steps = mlx_generate_step(mx.array(prompt), model, max_tokens=len(tokens),
                              sampler=lambda lp: mx.array([next(forced, 0)]),
                              logits_processors=processors)
    return [(t, np.array(lp)) for t, lp in steps]


@pytest.mark.parametrize("kind,acceptance,top_k", [("soft", "speculative-sampling", 5),
                                                   ("soft", "point-mass", 5),
                                                   ("next", "speculative-sampling", 0)])
def test_processed_rows_see_the_history_mlx_lm_would(request, kind, acceptance, top_k):
    """Every yielded row equals mlx-lm's processed logprobs for the same emitted prefix, also the
    rows that follow accepted drafts (their history holds the in-block drafted prefix). Qwen3.5
    (the soft head) and Qwen3-Next (a random head, accepted at T=1 since both are flat)."""
    path = request.getfixturevalue(f"{kind}_dir")
    model = request.getfixturevalue("soft_model") if kind == "soft" else mlx_mtp.load_model(path)
    procs = make_logits_processors(repetition_penalty=2.0, repetition_context_size=8)
    prompt = [5, 17, 42]
    mx.random.seed(0)
    got = list(mlx_mtp.speculative_generate_step(
        mx.array(prompt), model, max_tokens=40, block_size=4,
        sampler=mlx_mtp.make_sampler(temp=1.0, top_k=top_k), logits_processors=procs, seed=3,
        acceptance=acceptance))
    tokens = [t for t, _, _ in got]
    ref = forced_mlx_lm(path, prompt, tokens, procs)
    unprocessed = forced_mlx_lm(path, prompt, tokens, None)
    assert [t for t, _ in ref] == tokens
    for i, ((_, lp, _), (_, want)) in enumerate(zip(got, ref)):
        assert np.abs(np.array(lp) - want).max() < 1e-4, i
    after_draft = [i for i in range(1, len(got)) if got[i - 1][2]]
    assert len(after_draft) >= 5
    assert max(np.abs(np.array(got[i][1]) - unprocessed[i][1]).max() for i in after_draft) > 0.05


def test_drafter_samples_with_the_history_through_the_bonus(soft_model):
    procs = make_logits_processors(repetition_penalty=1.5)
    prompt, max_tokens = [5, 17, 42], 30
    seen = []
    real = soft_model.drafter.draft_sampled

    def spy(k, sample):
        seen.append(sample.history.tolist())
        return real(k, sample)

    soft_model.drafter.draft_sampled = spy
    try:
        got = list(mlx_mtp.speculative_generate_step(
            mx.array(prompt), soft_model, max_tokens=max_tokens, block_size=3,
            sampler=mlx_mtp.make_sampler(temp=1.0), logits_processors=procs, seed=1))
    finally:
        del soft_model.drafter.draft_sampled
    full = prompt + [t for t, _, _ in got]
    # A round starts after every token that did not come from a draft; it drafts when the
    # budget leaves room for at least one more token.
    starts = [n for n in range(1, max_tokens - 1) if not got[n - 1][2]]
    assert seen == [full[: len(prompt) + n] for n in starts]


def test_seed_reproduces_speculative_sampling_whatever_the_global_state(soft_model):
    def run(seed, global_seed):
        mx.random.seed(global_seed)
        return [t for t, _ in mlx_mtp.generate_step(
            mx.array([5, 17]), soft_model, max_tokens=30, block_size=3, seed=seed,
            sampler=mlx_mtp.make_sampler(temp=1.0, top_k=5))]

    a = run(7, 0)
    assert run(7, 123) == a
    assert run(8, 0) != a


def test_draft_and_target_streams_differ():
    streams = sampling.RandomStreams(0)
    d1, t1, d2 = streams.draft(), streams.target(), streams.draft()
    assert d1.tolist() != t1.tolist() and d1.tolist() != d2.tolist()
    again = sampling.RandomStreams(0)
    assert again.draft().tolist() == d1.tolist() and again.target().tolist() == t1.tolist()


def test_a_subset_drafter_runs_through_the_loop(soft_model):
    table = list(range(0, 320, 2))  # even ids only
    drafter = TableDrafter(soft_model.drafter, table)
    model = MTPModel(soft_model.mlx_model, soft_model.target, drafter)
    stats = RunStats()
    out = [t for t, _ in mlx_mtp.generate_step(mx.array([5, 17]), model, max_tokens=40,
                                               block_size=3, seed=2, stats=stats,
                                               sampler=mlx_mtp.make_sampler(temp=1.0))]
    assert len(out) == 40 and stats.acceptance_rule == "speculative-sampling"
    assert drafter.drafted and all(t % 2 == 0 for t in drafter.drafted)
    assert stats.accepted > 0


def test_a_drafter_without_draft_sampled_gets_the_point_mass_rule(soft_dir, soft_model):
    oracle = OracleDrafter([5, 17] + list(range(60)), schedule=[1], vocab_size=320)
    model = MTPModel(soft_model.mlx_model, soft_model.target, oracle)
    hot = mlx_mtp.make_sampler(temp=1.0)
    stats = RunStats()
    out = list(mlx_mtp.speculative_generate_step(mx.array([5, 17]), model, max_tokens=12,
                                                 block_size=3, sampler=hot, stats=stats))
    assert len(out) == 12 and stats.acceptance_rule == "point-mass" and stats.rounds > 0
    with pytest.raises(MTPError) as e:
        next(mlx_mtp.generate_step(mx.array([5, 17]), model, block_size=3, sampler=hot,
                                   acceptance="speculative-sampling"))
    assert str(e.value) == ("acceptance speculative-sampling needs a drafter with draft_sampled; "
                            "OracleDrafter only drafts greedily")
    # An mlx-lm sampler function does not say what it samples from: point-mass too.
    next(mlx_mtp.generate_step(mx.array([5, 17]), soft_model, block_size=3, stats=stats,
                               sampler=mlx_make_sampler(temp=1.0)))
    assert stats.acceptance_rule == "point-mass"


def test_top_k_at_the_vocabulary_size_is_an_error(soft_model):
    with pytest.raises(MTPError) as e:
        next(mlx_mtp.generate_step(mx.array([5]), soft_model,
                                   sampler=mlx_mtp.make_sampler(temp=1.0, top_k=400)))
    assert str(e.value) == "top_k (--top-k) must be below the vocabulary size 320, got 400"


# ---------------------------------------------------------------- T = 0 with logits processors


def test_greedy_with_processors_is_mlx_lm_greedy_with_processors(dense_dir):
    """Repetition/presence penalties at T=0: token-identical to mlx-lm's generate_step with the
    same processors, for every acceptance length (oracle) and with the real head."""
    procs = make_logits_processors(repetition_penalty=1.8, presence_penalty=0.5)
    prompt = load_tokenizer(dense_dir).encode(CODE_PROMPT)
    pristine, _ = mlx_load_model(Path(dense_dir))
    n = 24
    ref = [t for t, _ in mlx_generate_step(mx.array(prompt), pristine, max_tokens=n,
                                           logits_processors=procs)]
    plain = [t for t, _ in mlx_generate_step(mx.array(prompt), pristine, max_tokens=n)]
    assert ref != plain  # the penalties change this output
    model = mlx_mtp.load_model(dense_dir)
    for bs in range(1, 5):
        stats = RunStats()
        out = [t for t, _ in mlx_mtp.generate_step(mx.array(prompt), model, max_tokens=n,
                                                   block_size=bs, logits_processors=procs,
                                                   stats=stats)]
        assert out == ref, bs
        assert stats.acceptance_rule == "greedy"
        if bs == 1:
            continue
        oracle = OracleDrafter(prompt + ref, schedule=list(range(bs)), vocab_size=320)
        forced = MTPModel(model.mlx_model, model.target, oracle)
        out = [t for t, _ in mlx_mtp.generate_step(mx.array(prompt), forced, max_tokens=n,
                                                   block_size=bs, logits_processors=procs)]
        assert out == ref, ("oracle", bs)
        assert set(range(bs)) <= set(oracle.planned)


# --------------------------------------------------------------------------------------- CLI


def cli(capsys, *args):
    """``python -m mlx_mtp.generate`` in process: (exit code, stdout, stderr)."""
    try:
        code = generate.main([str(a) for a in args])
    except SystemExit as e:  # argparse errors
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def cli_json(capsys, *args):
    code, out, err = cli(capsys, *args, "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.mark.subprocess
def test_cli_sampling_flags_seed_and_rule(capsys, soft_dir):
    args = ["--model", soft_dir, "--prompt", "def add", "--ignore-chat-template",
            "--max-tokens", 24, "--temp", 1.0, "--top-k", 5, "--top-p", 0.95, "--min-p", 0.01,
            "--block-size", 3]  # speculative sampling needs a fixed block size
    a = cli_json(capsys, *args, "--seed", 7)
    assert cli_json(capsys, *args, "--seed", 7)["tokens"] == a["tokens"]
    assert cli_json(capsys, *args, "--seed", 8)["tokens"] != a["tokens"]
    assert a["acceptance_rule"] == "speculative-sampling"
    assert (a["temperature"], a["top_k"], a["top_p"], a["min_p"], a["seed"]) == (1.0, 5, 0.95,
                                                                                  0.01, 7)
    assert len(a["per_position_acceptance"]) == 2 and len(a["tokens"]) == 24
    pm = cli_json(capsys, *args, "--seed", 7, "--acceptance", "point-mass")
    assert pm["acceptance_rule"] == "point-mass"
    assert (a["exactness"]["verdict"], a["exactness"]["promise"]) == ("sampling", "distribution")
    code, _, table = cli(capsys, *args, "--seed", 7)  # the stats table goes to stderr
    assert code == 0 and "acceptance rule  " in table and "speculative-sampling" in table
    assert "the same distribution as plain sampling" in table


@pytest.mark.subprocess
def test_cli_no_mtp_samples_like_mlx_lm(capsys, soft_dir):
    out = cli_json(capsys, "--model", soft_dir, "--prompt", "def add", "--ignore-chat-template",
                   "--max-tokens", 12, "--temp", 0.8, "--top-k", 4, "--seed", 3, "--no-mtp")
    assert out["acceptance_rule"] is None
    tok = load_tokenizer(soft_dir)
    model, _ = mlx_load_model(Path(soft_dir))
    mx.random.seed(3)
    ref = [t for t, _ in mlx_generate_step(mx.array(tok.encode("def add")), model, max_tokens=12,
                                           sampler=mlx_make_sampler(temp=0.8, top_k=4))]
    eos = tok.eos_token_ids
    assert out["tokens"] == ref[: next((i for i, t in enumerate(ref) if t in eos), len(ref))]


@pytest.mark.subprocess
def test_cli_greedy_with_repetition_penalty_matches_mlx_lm(capsys, dense_dir):
    prompt = "def add(a, b):\n    return"
    out = cli_json(capsys, "--model", dense_dir, "--prompt", prompt, "--ignore-chat-template",
                   "--max-tokens", 16, "--repetition-penalty", 1.8,
                   "--repetition-context-size", 10)
    assert out["acceptance_rule"] == "greedy" and out["repetition_penalty"] == 1.8
    tok = load_tokenizer(dense_dir)
    model, _ = mlx_load_model(Path(dense_dir))
    procs = make_logits_processors(repetition_penalty=1.8, repetition_context_size=10)
    ref = [t for t, _ in mlx_generate_step(mx.array(tok.encode(prompt)), model, max_tokens=16,
                                           logits_processors=procs)]
    eos = tok.eos_token_ids
    assert out["tokens"] == ref[: next((i for i, t in enumerate(ref) if t in eos), len(ref))]


@pytest.mark.subprocess
@pytest.mark.parametrize("args,message", [
    (["--top-p", "1.5"], "error: argument --top-p: must be between 0 and 1, got 1.5"),
    (["--min-p", "-0.5"], "error: argument --min-p: must be between 0 and 1, got -0.5"),
    (["--top-k", "-1"], "error: argument --top-k: must be >= 0, got -1"),
    (["--min-tokens-to-keep", "0"],
     "error: argument --min-tokens-to-keep: must be at least 1, got 0"),
    (["--repetition-penalty", "-1"], "error: argument --repetition-penalty: must be >= 0, got -1"),
    (["--acceptance", "bogus"], "error: argument --acceptance: invalid choice: 'bogus'"),
])
def test_cli_bad_sampling_flags(capsys, args, message):
    code, _, err = cli(capsys, *args)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith(message)


@pytest.mark.subprocess
def test_cli_sampling_errors_after_loading(capsys, soft_dir):
    assert cli(capsys, "--model", soft_dir, "--temp", 1.0, "--top-k", 320)[::2] == (
        1, "error: top_k (--top-k) must be below the vocabulary size 320, got 320\n")
    assert cli(capsys, "--model", soft_dir, "--acceptance", "speculative-sampling")[::2] == (
        1, "error: acceptance speculative-sampling needs a temperature above 0\n")


@pytest.mark.slow
def test_a_draft_vocabulary_keeps_plain_samplings_distribution(soft_dir, plain_reference,
                                                               tmp_path):
    """Phase 2b at T > 0: the drafter's q lives on the sidecar's ids (even ids here), and the
    output keeps plain sampling's distribution."""
    from mlx_mtp.models.qwen3_5 import vocab_reduction as draft_vocab
    from mlx_mtp.models.options import DraftOptions

    full = mlx_mtp.load_model(soft_dir)
    draft_vocab.write_sidecar(tmp_path / "even", np.arange(0, 320, 2), {
        "size": 160, "vocab_size": 320,
        "tokenizer_sha256": draft_vocab.tokenizer_sha256(load_tokenizer(soft_dir)),
        "head_sha256": draft_vocab.head_sha256(full.target)})
    model = mlx_mtp.load_model(soft_dir, draft_options=DraftOptions(vocab=tmp_path / "even"))
    assert model.drafter.lm.size == 160
    exact, plain = plain_reference
    stats = RunStats()
    draws = mtp_draws(model, N_MTP, stats=stats)
    assert stats.acceptance_rule == "speculative-sampling"
    assert two_sample(draws, plain)[2] > ALPHA
    assert goodness_of_fit(draws, exact)[2] > ALPHA
    assert 0 < stats.acceptance_rate < 1


# ------------------------------------- T > 0 on a verify that is not byte-identical to the chain


def _perturbed(model):
    from support.perturbed import PerturbedVerify

    return MTPModel(model.mlx_model, PerturbedVerify(model.target, position=0), model.drafter)


def _no_probe(*args, **kwargs):
    raise AssertionError("the exactness probe ran at temperature > 0")


@pytest.mark.slow
def test_sampling_keeps_the_distribution_on_a_verify_that_is_not_byte_exact(
        soft_model, plain_reference, monkeypatch):
    """Where a verify block differs from the chain (here: one ulp in every verify's first row,
    as a kernel that rounds differently), T=0 is declined, but sampling runs MTP without a probe
    and is still distributed as plain sampling."""
    from mlx_mtp.exactness import gate

    exact, plain = plain_reference
    greedy = RunStats()
    list(mlx_mtp.generate_step(mx.array(PROMPT), _perturbed(soft_model), max_tokens=4,
                               block_size=3, stats=greedy))
    assert not greedy.mtp_enabled and greedy.exactness["verdict"] == "diverges"
    assert greedy.exactness["promise"] == "byte-identity"

    monkeypatch.setattr(gate, "probe_exactness", _no_probe)
    stats = RunStats()
    draws = mtp_draws(_perturbed(soft_model), N_MTP, stats=stats)
    assert stats.mtp_enabled and stats.acceptance_rule == "speculative-sampling"
    assert (stats.exactness["verdict"], stats.exactness["promise"]) == ("sampling", "distribution")
    assert stats.gate_reason.startswith("temperature > 0: speculative sampling keeps")
    assert two_sample(draws, plain)[2] > ALPHA
    assert goodness_of_fit(draws, exact)[2] > ALPHA


@pytest.mark.slow
def test_the_perturbed_verify_still_rejects_a_biased_rule(soft_model, plain_reference,
                                                          monkeypatch):
    exact, plain = plain_reference
    monkeypatch.setattr(sampling, "rejection_sample", argmax_matching)
    draws = mtp_draws(_perturbed(soft_model), N_MTP)
    assert two_sample(draws, plain)[2] < ALPHA
    assert goodness_of_fit(draws, exact)[2] < ALPHA


def test_row_exact_off_declines_t0_where_the_probe_diverges_and_samples_anyway(
        wide_dir, monkeypatch):
    """MLX_MTP_ROW_EXACT=0: the verify uses the plain multi-row products. T=0 then follows the
    probe of that verify (with BLIS on these widths: diverges, declined with the reason); T > 0
    runs MTP with no probe on that plain verify."""
    from mlx_mtp.cpu import blas as cpu_blas
    from mlx_mtp.exactness import gate
    from mlx_mtp.exactness.block_vs_chain import probe_exactness

    monkeypatch.setenv("MLX_MTP_ROW_EXACT", "0")
    model = mlx_mtp.load_model(wide_dir)
    verdicts = {p.verdict for p in probe_exactness(model.target, [2, 3])}
    assert model.target.exact is False and model.target.row_exact_layers == {}
    if cpu_blas.STATE.describe().startswith("BLIS"):
        assert "diverges" in verdicts  # BLIS reduces K > 512 rows differently
    prompt = mx.array([5, 6, 7])
    greedy = RunStats()
    out = [t for t, _ in mlx_mtp.generate_step(prompt, model, max_tokens=8, block_size=3,
                                               stats=greedy)]
    assert out == [t for t, _ in mlx_generate_step(prompt, model.mlx_model, max_tokens=8)]
    assert greedy.mtp_enabled == (verdicts == {"equal"})
    if not greedy.mtp_enabled:
        assert greedy.gate_reason.startswith("MTP declined")
        assert "MLX_MTP_ROW_EXACT=0: the verify ran without row-exact products" in \
            greedy.gate_reason

    monkeypatch.setattr(gate, "probe_exactness", _no_probe)
    hot = RunStats()
    list(mlx_mtp.generate_step(prompt, model, max_tokens=8, block_size=3, stats=hot, seed=3,
                               sampler=mlx_mtp.make_sampler(temp=0.6)))
    assert hot.mtp_enabled and hot.rounds > 0 and hot.exactness["promise"] == "distribution"
    assert model.target.exact is False


def test_a_sampled_session_keeps_the_row_exact_products_on_the_cpu_only(wide_dir, monkeypatch):
    """T > 0 runs no probe; its verify keeps the row-exact products on the CPU (the faster
    verify there) and takes the plain multi-row kernels on a GPU kind."""
    from mlx_mtp.exactness import gate
    from mlx_mtp.exactness.device import DeviceFacts

    cpu, cuda = DeviceFacts("cpu", "x86_64", None), DeviceFacts("cuda", "sm_90", None)
    assert gate.sampling_decision(3, cpu).exact_verify is True
    assert gate.sampling_decision("auto", cuda).exact_verify is False
    assert gate.sampling_decision(3, cuda).promise == "distribution"

    monkeypatch.setattr(gate, "probe_exactness", _no_probe)
    model = mlx_mtp.load_model(wide_dir)
    stats = RunStats()
    list(mlx_mtp.generate_step(mx.array([5, 6, 7]), model, max_tokens=8, block_size=3,
                               stats=stats, seed=3, sampler=mlx_mtp.make_sampler(temp=0.6)))
    assert stats.mtp_enabled and stats.exactness["promise"] == "distribution"
    assert model.target.exact is True  # which layers switch depends on this host's BLAS
    report = dict(stats.exactness["row_exact"])
    verifies = report.pop("attention")["verifies"]  # the run's verify attentions, counted
    assert report == gate.verify_report(model.mlx_model)
    assert verifies["kernel"] + verifies["rows"] > 0


def test_a_bad_row_exact_value_is_one_line(wide_dir, monkeypatch):
    monkeypatch.setenv("MLX_MTP_ROW_EXACT", "no")
    model = mlx_mtp.load_model(wide_dir)
    with pytest.raises(MTPError, match="^environment variable MLX_MTP_ROW_EXACT must be 0 or 1, "
                                       "got 'no'$"):
        list(mlx_mtp.generate_step(mx.array([5, 6]), model, max_tokens=4, block_size=3))
