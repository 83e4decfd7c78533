"""Phase 2b: the reduced draft vocabulary sidecar (build, load, fall back) and the drafter on it."""

import importlib
import json
import logging
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from support import tiny_checkpoints as tc
from support.reference import reference_greedy
from mlx_lm.tokenizer_utils import load as load_tokenizer

import mlx_mtp
from mlx_mtp import MTPError
from mlx_mtp import draft_vocab as draft_vocab_cli
from mlx_mtp.models.qwen3_5 import vocab_reduction as draft_vocab
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.models.options import DraftOptions

SIZE = 64


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    files = [d / "a.txt", d / "b.txt"]
    files[0].write_text("\n\n".join(tc.CORPUS[:3]) * 3)
    files[1].write_text("\n\n".join(tc.CORPUS[3:]) + "\n\nprint('hello world')\n")
    return files


def build(capsys, path, out, corpus, *extra):
    argv = ["build", "--model", str(path), "--size", str(SIZE), "--out", str(out), "--json",
            "--corpus", *map(str, corpus), *extra]
    code = draft_vocab_cli.main(argv)
    captured = capsys.readouterr()
    return code, captured


@pytest.fixture(scope="module")
def sidecar(dense_dir, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("vocab") / "dense"
    assert draft_vocab_cli.main(["build", "--model", str(dense_dir), "--size", str(SIZE),
                             "--out", str(out), "--corpus", *map(str, corpus)]) == 0
    return out


def expected_ids(tok, texts, extra=(), size=SIZE):
    counts = Counter()
    for t in texts:
        counts.update(tok.encode(t, add_special_tokens=False))
    counts.update(extra)
    must = set(tok.eos_token_ids)
    ranked = sorted(range(320), key=lambda i: (i not in must, -counts[i], i))
    return sorted(ranked[:size]), counts


def test_build_picks_the_most_frequent_ids(capsys, dense_dir, corpus, tmp_path):
    code, out = build(capsys, dense_dir, tmp_path / "v", corpus)
    assert code == 0, out.err
    result = json.loads(out.out)
    tok = load_tokenizer(dense_dir)
    texts = [f.read_text() for f in corpus]
    want, counts = expected_ids(tok, texts)
    tensors = mx.load(str(tmp_path / "v" / "draft_vocab.safetensors"))
    ids = tensors["ids"].tolist()
    assert ids == want
    assert tensors["d2t"].tolist() == [t - i for i, t in enumerate(ids)]
    assert tensors["ids"].dtype == mx.uint32
    meta = json.loads((tmp_path / "v" / "draft_vocab.json").read_text())
    model = mlx_mtp.load_model(dense_dir)
    assert meta["format"] == "mlx_mtp.draft_vocab" and meta["size"] == SIZE
    assert meta["vocab_size"] == 320 and meta["generated_tokens"] == 0
    assert meta["tokenizer_sha256"] == draft_vocab.tokenizer_sha256(tok)
    assert meta["head_sha256"] == draft_vocab.head_sha256(model.target)
    assert meta["corpus_tokens"] == sum(counts.values())
    assert meta["coverage"] == pytest.approx(sum(counts[i] for i in ids) / sum(counts.values()))
    assert result["out"] == str(tmp_path / "v") and result["size"] == SIZE


def test_build_without_a_size_keeps_32768_ids_or_a_quarter_of_a_smaller_vocabulary(
        capsys, dense_dir, corpus, tmp_path):
    argv = ["build", "--model", str(dense_dir), "--out", str(tmp_path / "v"), "--json",
            "--corpus", *map(str, corpus)]
    assert draft_vocab_cli.main(argv) == 0
    tok = load_tokenizer(dense_dir)
    want, _ = expected_ids(tok, [f.read_text() for f in corpus], size=80)  # 320 ids / 4
    assert mx.load(str(tmp_path / "v" / "draft_vocab.safetensors"))["ids"].tolist() == want
    assert json.loads(capsys.readouterr().out)["size"] == 80
    assert [draft_vocab.default_size(v) for v in (248320, 131072, 32768, 8192, 3)] == \
        [32768, 32768, 8192, 2048, 1]


def test_build_counts_the_targets_own_generations(capsys, dense_dir, corpus, tmp_path):
    code, out = build(capsys, dense_dir, tmp_path / "v", corpus, "--generate-tokens", "12",
                      "--generate-prompts", "2")
    assert code == 0, out.err
    tok = load_tokenizer(dense_dir)
    texts = [f.read_text() for f in corpus]
    prompts = [tok.encode(p, add_special_tokens=False)[:64]
               for p in texts[0].split("\n\n") if p][:2]
    generated = [t for p in prompts for t in reference_greedy(dense_dir, p, 12)]
    want, _ = expected_ids(tok, texts, generated)
    assert mx.load(str(tmp_path / "v" / "draft_vocab.safetensors"))["ids"].tolist() == want
    assert json.loads(out.out)["generated_tokens"] == 24


@pytest.mark.parametrize("args,message", [
    (["--size", "320"], "error: --size must be between 1 and 319 (the target's vocabulary has "
                        "320 ids), got 320"),
    (["--size", "0"], "error: argument --size: must be at least 1, got 0"),
    (["--generate-tokens", "-1"], "error: --generate-tokens must be >= 0, got -1"),
])
def test_build_bad_flags(capsys, dense_dir, corpus, tmp_path, args, message):
    argv = ["build", "--model", str(dense_dir), "--size", str(SIZE), "--out", str(tmp_path / "v"),
            "--corpus", *map(str, corpus)] + args
    try:
        code = draft_vocab_cli.main(argv)
    except SystemExit as e:  # argparse's own checks exit 2
        code = e.code
    assert code in (1, 2)
    assert capsys.readouterr().err.strip() == message


def test_build_missing_corpus(capsys, dense_dir, tmp_path):
    missing = tmp_path / "nope.txt"
    code, out = build(capsys, dense_dir, tmp_path / "v", [missing])
    assert code == 1
    assert out.err.strip() == f"error: --corpus {missing} does not exist (expected a text file)"


def test_drafter_projects_only_the_subset(dense_dir, sidecar):
    model = mlx_mtp.load_model(dense_dir, draft_options=DraftOptions(vocab=sidecar))
    ids = mx.load(str(sidecar / "draft_vocab.safetensors"))["ids"].tolist()
    d = model.drafter
    assert d.lm.ids.tolist() == ids and d.lm.size == SIZE
    assert d.describe()["reduced_vocab"] and d.describe()["vocab_size"] == SIZE
    cache = model.target.make_cache()
    prompt = mx.array([5, 17, 3, 99, 42, 7])
    d.reset()
    d.prefill(model.target.hidden(prompt[None, :-1], cache), prompt[1:])
    drafts = d.draft(6).tolist()
    assert set(drafts) <= set(ids)
    # The greedy draft is the argmax over the subset rows of the target's LM head.
    g = d.first_draft_hidden[:, -1]
    full = model.target.logits(g)
    assert d.first_draft.tolist() == [ids[int(np.argmax(np.array(full)[0, ids]))]]


def test_t0_output_is_unchanged_with_a_draft_vocabulary(dense_dir, sidecar):
    model = mlx_mtp.load_model(dense_dir, draft_options=DraftOptions(vocab=sidecar))
    prompt = [5, 17, 3, 99, 42]
    ref = reference_greedy(dense_dir, prompt, 20)
    for bs in range(2, 6):
        assert [t for t, _ in mlx_mtp.generate_step(mx.array(prompt), model, max_tokens=20,
                                                    block_size=bs)] == ref


def test_sampling_draws_on_the_subset(dense_dir, sidecar):
    model = mlx_mtp.load_model(dense_dir, draft_options=DraftOptions(vocab=sidecar))
    ids = set(mx.load(str(sidecar / "draft_vocab.safetensors"))["ids"].tolist())
    seen = []
    real = mlx_mtp.decoding.sampling.DraftSampler.result

    def spy(self):
        drafts, q, q_ids = real(self)
        seen.append((drafts.tolist(), q.shape, q_ids.tolist()))
        return drafts, q, q_ids

    mlx_mtp.decoding.sampling.DraftSampler.result = spy
    try:
        stats = RunStats()
        out = list(mlx_mtp.speculative_generate_step(mx.array([5, 17]), model, max_tokens=16,
                                                     block_size=4, seed=3, stats=stats,
                                                     sampler=mlx_mtp.make_sampler(temp=1.0)))
    finally:
        mlx_mtp.decoding.sampling.DraftSampler.result = real
    assert len(out) == 16 and stats.acceptance_rule == "speculative-sampling"
    assert seen
    for drafts, shape, q_ids in seen:
        assert set(drafts) <= ids and shape == (len(drafts), SIZE) and q_ids == sorted(ids)


def one_warning(caplog):
    records = [r for r in caplog.records if r.name == "mlx_mtp" and r.levelno == logging.WARNING]
    assert len(records) == 1, [r.getMessage() for r in records]
    return records[0].getMessage()


def test_absent_sidecar_falls_back_with_one_warning(dense_dir, tmp_path, caplog):
    missing = tmp_path / "none"
    with caplog.at_level(logging.WARNING, logger="mlx_mtp"):
        model = mlx_mtp.load_model(dense_dir, draft_options=DraftOptions(vocab=missing))
    assert model.drafter.lm.ids is None and model.drafter.lm.size == 320
    assert one_warning(caplog) == (
        f"draft vocabulary sidecar {missing} not found (expected draft_vocab.json and "
        "draft_vocab.safetensors): drafting over the full vocabulary")


def copy_sidecar(src, dst, **meta_changes):
    dst.mkdir()
    (dst / "draft_vocab.safetensors").write_bytes((src / "draft_vocab.safetensors").read_bytes())
    meta = json.loads((src / "draft_vocab.json").read_text())
    meta.update(meta_changes)
    (dst / "draft_vocab.json").write_text(json.dumps(meta))
    return dst


@pytest.mark.parametrize("change,why", [
    ({"tokenizer_sha256": "0" * 64}, "was built for another tokenizer (vocabulary hash differs)"),
    ({"head_sha256": "0" * 64}, "was built for another LM head (head fingerprint differs)"),
    ({"vocab_size": 512}, "was built for a vocabulary of 512 ids, the target has 320"),
])
def test_mismatched_sidecar_falls_back_with_one_warning(dense_dir, sidecar, tmp_path, caplog,
                                                        change, why):
    bad = copy_sidecar(sidecar, tmp_path / "bad", **change)
    with caplog.at_level(logging.WARNING, logger="mlx_mtp"):
        model = mlx_mtp.load_model(dense_dir, draft_options=DraftOptions(vocab=bad))
    assert model.drafter.lm.ids is None
    assert one_warning(caplog) == f"draft vocabulary {bad} {why}: drafting over the full vocabulary"


def test_another_models_head_is_detected(tied_dir, sidecar, caplog):
    """Same tokenizer, different LM head: the fingerprint tells them apart."""
    with caplog.at_level(logging.WARNING, logger="mlx_mtp"):
        model = mlx_mtp.load_model(tied_dir, draft_options=DraftOptions(vocab=sidecar))
    assert model.drafter.lm.ids is None
    assert "was built for another LM head" in one_warning(caplog)


def test_head_fingerprint_ignores_the_float_dtype(dense_dir):
    f32 = mlx_mtp.load_model(dense_dir, dtype=mx.float32, require_head=False)
    bf16 = mlx_mtp.load_model(dense_dir, dtype=mx.bfloat16, require_head=False)
    rounded = mlx_mtp.load_model(dense_dir, dtype=mx.float32, require_head=False)
    head = rounded.target.lm_head_module
    head.weight = head.weight.astype(mx.bfloat16).astype(mx.float32)
    assert draft_vocab.head_sha256(bf16.target) == draft_vocab.head_sha256(rounded.target)
    assert draft_vocab.head_sha256(f32.target) != draft_vocab.head_sha256(bf16.target)


def test_unreadable_sidecars_are_errors(dense_dir, sidecar, tmp_path):
    bad = copy_sidecar(sidecar, tmp_path / "garbage")
    (bad / "draft_vocab.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(MTPError) as e:
        mlx_mtp.load_model(dense_dir, draft_options=DraftOptions(vocab=bad))
    assert str(e.value).startswith(f"draft vocabulary {bad}: unreadable sidecar (")
    unsorted = copy_sidecar(sidecar, tmp_path / "unsorted")
    ids = mx.load(str(sidecar / "draft_vocab.safetensors"))["ids"][::-1]
    mx.save_safetensors(str(unsorted / "draft_vocab.safetensors"),
                        {"ids": ids, "d2t": (ids.astype(mx.int32) - mx.arange(SIZE)).astype(mx.int32)})
    with pytest.raises(MTPError) as e:
        mlx_mtp.load_model(dense_dir, draft_options=DraftOptions(vocab=unsorted))
    assert str(e.value) == (f"draft vocabulary {unsorted}: ids must be {SIZE} sorted, distinct "
                            "target ids below 320 with d2t = ids - index")


def test_cli_takes_a_draft_vocabulary(capsys, dense_dir, sidecar):
    generate = importlib.import_module("mlx_mtp.generate")  # the CLI module (mlx_mtp.generate is also the function)

    assert generate.main(["--model", str(dense_dir), "--max-tokens", "8", "--json",
                          "--ignore-chat-template", "--draft-vocab", str(sidecar)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["draft"]["reduced_vocab"] and out["draft"]["vocab_size"] == SIZE


def test_a_sidecar_in_the_checkpoint_folder_is_used(dense_dir, sidecar, tmp_path):
    """A raw checkpoint (head from its own mtp.* tensors) with mtp/draft_vocab/ uses it, as a
    converted folder does; an explicit --draft-vocab wins; --drafter DIR ignores the folder's."""
    import shutil

    raw = tmp_path / "raw"
    shutil.copytree(dense_dir, raw)
    assert mlx_mtp.load_model(raw).drafter.lm.ids is None
    shutil.copytree(sidecar, raw / "mtp" / "draft_vocab")
    ids = mx.load(str(sidecar / "draft_vocab.safetensors"))["ids"].tolist()
    assert mlx_mtp.load_model(raw).drafter.lm.ids.tolist() == ids
    other = copy_sidecar(sidecar, tmp_path / "other")
    small = mx.array(ids[:32], dtype=mx.uint32)
    mx.save_safetensors(str(other / draft_vocab.TENSOR_FILE),
                        {"ids": small, "d2t": (small - mx.arange(32)).astype(mx.int32)})
    meta = json.loads((other / draft_vocab.META_FILE).read_text())
    (other / draft_vocab.META_FILE).write_text(json.dumps({**meta, "size": 32}))
    explicit = mlx_mtp.load_model(raw, draft_options=DraftOptions(vocab=other))
    assert explicit.drafter.lm.ids.tolist() == ids[:32]
    assert mlx_mtp.load_model(raw, drafter=dense_dir).drafter.lm.ids is None


def test_the_demo_pair_ships_its_draft_vocabulary():
    """The demo pair drafts on its 4096 most frequent ids (the acceptance A/B found none lost)."""
    model = mlx_mtp.load_model("mlx_mtp/demo_pair")
    d = model.drafter.describe()
    assert d["reduced_vocab"] and d["vocab_size"] == 4096 and d["compiled"]
    assert model.drafter.whole_step
    # a bfloat16 checkpoint: by default its 4096 rows are drafted over as bfloat16 copies (where
    # the CPU kernels run), else transposed for the BLAS
    from mlx_mtp.models.options import DraftOptions
    from mlx_mtp.models import bf16_weights

    lm = model.drafter.lm.tensors
    if bf16_weights.bf16_problem() is None:
        assert d["bf16"] and lm.bf16 and lm.weight.shape == (4096, lm.weight.shape[1])
    else:
        assert not d["bf16"] and lm.transposed
    off = mlx_mtp.load_model("mlx_mtp/demo_pair", draft_options=DraftOptions(bf16=False))
    assert not off.drafter.describe()["bf16"] and off.drafter.lm.tensors.transposed
