"""mlx_mtp as a drop-in for mlx-lm: the same functions with mlx-lm's documented arguments give, at
T=0, exactly what mlx-lm's own call gives on the same target (prompt caches over turns, saved and
loaded caches, kv_bits, max_kv_size, LoRA adapters); what cannot work is one clear error."""

import inspect
import logging

import mlx.core as mx
import mlx_lm
import pytest
from support import tiny_checkpoints as tc
from support.reference import CODE_PROMPT
from support.token_streams import bitwise, take
from mlx_lm.generate import generate_step as mlx_generate_step
from mlx_lm.generate import stream_generate as mlx_stream_generate
from mlx_lm.models import cache as mlx_cache

import mlx_mtp
from mlx_mtp import MTPError
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.models.qwen3_5.target import Qwen3_5Target

TURNS = ["def add(a, b):\n    return a + b\n", "class Point:\n", "for i in range(10):"]


@pytest.fixture(scope="module")
def agree_dir(ckpt_root):
    """A pair whose head agrees with its target: rounds keep drafts, so stopping mid-round (an
    EOS or a stop string inside a verify block) really happens."""
    return tc.write_agreeing_checkpoint(ckpt_root / "dropin-agree")


def pair(path, **kw):
    """Ours and mlx-lm's load of the same folder with the same arguments."""
    return mlx_mtp.load(str(path), **kw), mlx_lm.load(str(path), **kw)


# ------------------------------------------------------------------------------ the signatures


def _params(fn):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()
            if p.kind is not p.VAR_KEYWORD]


@pytest.mark.parametrize("ours, theirs", [
    (mlx_mtp.make_prompt_cache, mlx_cache.make_prompt_cache),
    (mlx_mtp.save_prompt_cache, mlx_cache.save_prompt_cache),
    (mlx_mtp.load_prompt_cache, mlx_cache.load_prompt_cache),
])
def test_same_arguments_and_defaults_as_mlx_lm(ours, theirs):
    """mlx-lm's parameters come first, in its order, with its defaults; ours follow."""
    mine = _params(ours)
    assert mine[: len(_params(theirs))] == _params(theirs)


def test_load_takes_mlx_lm_arguments_and_defaults_to_the_demo_pair():
    """``load``'s parameters are mlx-lm's, in its order and with its defaults, except that the
    path may be left out (the embedded demo pair, as the CLI's default)."""
    mine, theirs = _params(mlx_mtp.load), _params(mlx_lm.load)
    assert mine[0] == ("path_or_hf_repo", None)
    assert theirs[0] == ("path_or_hf_repo", inspect.Parameter.empty)
    assert mine[1: len(theirs)] == theirs[1:]


def _differing(ours, theirs):
    """mlx-lm's parameters that ours lacks or defaults differently: {name: (ours, theirs)}."""
    mine = dict(_params(ours))

    def same(a, b):  # (mlx's stream objects cannot be compared with None)
        return a is b or (type(a) is type(b) and a == b)

    return {n: (mine.get(n, "missing"), d) for n, d in _params(theirs)
            if n not in mine or not same(mine[n], d)}


def test_generation_functions_take_mlx_lm_arguments():
    from mlx_lm.generate import generate as mlx_generate
    from mlx_lm.generate import speculative_generate_step as mlx_speculative

    empty = inspect.Parameter.empty
    # mlx-lm's default stream is its own generation stream; ours: the current one (README)
    assert _differing(mlx_mtp.generate_step, mlx_generate_step) == {
        "stream": (None, mlx_generate_step.__defaults__[0])}
    # draft_model / num_draft_tokens are there for the call shape and must stay None (the MTP
    # head drafts); the prefill chunks as mlx-lm's generate_step, which T=0 output must equal
    assert _differing(mlx_mtp.speculative_generate_step, mlx_speculative) == {
        "draft_model": (None, empty), "stream": (None, mlx_speculative.__defaults__[0]),
        "num_draft_tokens": (None, 2), "prefill_step_size": (2048, 512)}
    positional = [n for n, p in inspect.signature(mlx_speculative).parameters.items()
                  if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [n for n, _ in _params(mlx_mtp.speculative_generate_step)[:4]] == positional
    assert [n for n, _ in _params(mlx_mtp.generate_step)[:3]] == ["prompt", "model", "stream"]
    # one set of arguments: generate_step is speculative_generate_step without from_draft
    assert _params(mlx_mtp.generate_step) == [
        p for p in _params(mlx_mtp.speculative_generate_step)
        if p[0] not in ("draft_model", "num_draft_tokens")]
    assert _params(mlx_mtp.generate)[:4] == _params(mlx_generate)[:4]
    assert _differing(mlx_mtp.stream_generate, mlx_stream_generate) == {
        "stream": (None, mlx_stream_generate.__defaults__[-1])}


# ------------------------------------------------------------------------------ the functions


def test_generate_returns_mlx_lm_text_and_verbose_prints_speed(dense_dir, capsys):
    import re

    (model, tok), (ref, ref_tok) = pair(dense_dir)
    capsys.readouterr()
    want = mlx_lm.generate(ref, ref_tok, CODE_PROMPT, verbose=True, max_tokens=20)
    want_out = capsys.readouterr().out
    got = mlx_mtp.generate(model, tok, CODE_PROMPT, verbose=True, max_tokens=20)
    out = capsys.readouterr().out
    assert got == want and len(got) > 0

    def shape(text):  # the lines with their speeds blanked
        return [re.sub(r"\d+\.\d+", "#", line) for line in text.splitlines()]

    assert shape(out)[:-1] == shape(want_out)  # text, then mlx-lm's lines, counts included
    assert shape(out)[-2].startswith("Peak memory: ")
    assert shape(out)[-1].startswith("MTP: block size auto, ")  # the default


def test_stream_generate_carries_mlx_lm_response_fields(dense_dir):
    from mlx_lm.generate import GenerationResponse

    (model, tok), (ref, ref_tok) = pair(dense_dir)
    want = list(mlx_stream_generate(ref, ref_tok, CODE_PROMPT, max_tokens=16))
    got = list(mlx_mtp.stream_generate(model, tok, CODE_PROMPT, max_tokens=16, block_size=4))
    assert [r.token for r in got] == [r.token for r in want]
    assert [r.text for r in got] == [r.text for r in want]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
    assert [r.generation_tokens for r in got] == [r.generation_tokens for r in want]
    for r in got:
        assert isinstance(r, GenerationResponse)
        assert r.prompt_tokens == want[0].prompt_tokens
        assert r.logprobs.shape == (model.target.vocab_size,)
        assert isinstance(r.from_draft, bool)
        assert r.prompt_tps > 0 and r.generation_tps >= 0 and r.peak_memory >= 0
    assert isinstance(got[-1].stats, RunStats) and got[-1].stats.block_size == 4
    for g, w in zip(got, want):  # the same processed logprobs as mlx-lm's (greedy: raw)
        assert bitwise([g.logprobs], [w.logprobs])


@pytest.mark.parametrize("block_size", [4, "auto"])
def test_generate_step_yields_what_mlx_lm_generate_step_yields(agree_dir, block_size):
    """Pairs ``(int, mx.array)``: the same token ids and, bitwise, the same logprobs vectors as
    mlx-lm's ``generate_step`` on the same target, including rows a verify block produced."""
    (model, tok), (ref, _) = pair(agree_dir)
    prompt = mx.array(tok.encode(CODE_PROMPT))
    want = list(mlx_generate_step(prompt, ref, max_tokens=24))
    stats = RunStats()
    got = list(mlx_mtp.generate_step(prompt, model, max_tokens=24, block_size=block_size,
                                     stats=stats))
    assert stats.mtp_enabled and stats.accepted > 0  # drafts were kept: verify rows yielded
    assert len(got) == len(want) == 24
    for g, w in zip(got, want):
        assert type(g) is type(w) is tuple and len(g) == len(w) == 2
        assert type(g[0]) is type(w[0]) is int and g[0] == w[0]
        assert isinstance(g[1], mx.array) and g[1].shape == w[1].shape == (model.target.vocab_size,)
    assert bitwise([g[1] for g in got], [w[1] for w in want])


def test_speculative_generate_step_yields_triples_with_from_draft(agree_dir):
    """mlx-lm's speculative shape ``(int, mx.array, bool)``: generate_step's pairs plus whether
    each token was a kept draft (one per accepted draft, as ``RunStats`` counts them)."""
    model, tok = mlx_mtp.load(str(agree_dir))
    prompt = mx.array(tok.encode(CODE_PROMPT))
    stats = RunStats()
    triples = list(mlx_mtp.speculative_generate_step(prompt, model, max_tokens=24, block_size=4,
                                                     stats=stats))
    pairs = list(mlx_mtp.generate_step(prompt, model, max_tokens=24, block_size=4))
    assert all(type(t) is tuple and len(t) == 3 and type(t[0]) is int and
               type(t[2]) is bool for t in triples)
    assert [t[0] for t in triples] == [p[0] for p in pairs]
    assert bitwise([t[1] for t in triples], [p[1] for p in pairs])
    drafted = [t[2] for t in triples]
    assert not drafted[0] and sum(drafted) == stats.accepted > 0
    # a round yields its kept drafts (at most block_size - 1), then the target's own token
    runs = "".join("d" if d else "t" for d in drafted).split("t")
    assert max(len(r) for r in runs) <= 3


def test_generate_step_progress_callback_and_unlimited_tokens(dense_dir):
    (model, tok), (ref, _) = pair(dense_dir)
    prompt = mx.array(tok.encode(CODE_PROMPT))
    calls, ref_calls = [], []
    want = take(mlx_generate_step(prompt, ref, max_tokens=-1, prefill_step_size=5,
                                  prompt_progress_callback=lambda *a: ref_calls.append(a)), 25)
    got = take(mlx_mtp.generate_step(prompt, model, max_tokens=-1, prefill_step_size=5,
                                     prompt_progress_callback=lambda *a: calls.append(a)), 25)
    assert got == want
    assert calls == ref_calls and calls[0] == (0, prompt.size) and len(calls) > 3


def test_input_embeddings_as_mlx_lm(dense_dir):
    (model, tok), (ref, _) = pair(dense_dir)
    prompt = mx.array(tok.encode(CODE_PROMPT))
    # embeddings that are not the ids' own, so using them (or not) changes the output
    emb = ref.language_model.model.embed_tokens(prompt) * 1.5
    want = take(mlx_generate_step(prompt, ref, max_tokens=20, input_embeddings=emb), 20)
    got = take(mlx_mtp.generate_step(prompt, model, max_tokens=20, input_embeddings=emb), 20)
    plain = take(mlx_mtp.generate_step(prompt, model, max_tokens=20), 20)
    assert got == want and got != plain


# ------------------------------------------------------------------------------ prompt caches


def _turns(model, ref, tok, stops, *, ours_cache=None, ref_cache=None, block_size=3, stats=None,
           ours_kw=None, **kw):
    """Three chat turns: each passes only its new tokens and reads ``stops[i]`` tokens. Returns
    (ours, mlx-lm's, tokens fed to the target before each turn's first token). ``ours_kw``: more
    arguments for mlx_mtp's side only."""
    ours_cache = ours_cache if ours_cache is not None else mlx_mtp.make_prompt_cache(model)
    ref_cache = ref_cache if ref_cache is not None else mlx_cache.make_prompt_cache(ref)
    fed = []
    hidden, decode = model.target.hidden, model.target.decode
    counter = {"n": 0}

    def counting(ids, cache, input_embeddings=None):
        counter["n"] += ids.shape[1]
        return hidden(ids, cache, input_embeddings)

    def counting_decode(ids, cache):  # the prompt's last token is a one-token step
        counter["n"] += ids.shape[1]
        return decode(ids, cache)

    model.target.hidden, model.target.decode = counting, counting_decode
    got, want = [], []
    try:
        for text, n in zip(TURNS, stops):
            prompt = mx.array(tok.encode(text))
            counter["n"] = 0
            gen = mlx_mtp.generate_step(prompt, model, max_tokens=64, prompt_cache=ours_cache,
                                        block_size=block_size, stats=stats, **kw,
                                        **(ours_kw or {}))
            first = next(gen)
            fed.append((prompt.size, counter["n"]))
            got.append([first[0]] + take(gen, n - 1))
            want.append(take(mlx_generate_step(prompt, ref, max_tokens=64, prompt_cache=ref_cache,
                                               **kw), n))
            assert ours_cache.offset == ref_cache[-1].offset  # the prompt and every token read
            assert bitwise(model.target.cache_state(ours_cache),
                           model.target.cache_state(ref_cache))
    finally:
        del model.target.hidden, model.target.decode
    return got, want, fed


@pytest.mark.parametrize("stops", [(13, 8, 20), (12, 9, 11)])
def test_prompt_cache_over_three_turns(agree_dir, stops):
    """Turns stop at the end of a round and inside one (kept drafts the caller never reads); after
    each the cache is bitwise mlx-lm's, and the next turn prefills only its new tokens."""
    (model, tok), (ref, _) = pair(agree_dir)
    stats = RunStats()
    got, want, fed = _turns(model, ref, tok, stops, stats=stats)
    assert got == want
    # the second and third turn feed only their new tokens (the first also ran the probe)
    assert all(n == new for new, n in fed[1:]), fed
    assert stats.mtp_enabled and stats.accepted > 0  # rounds kept drafts (mid-round stops)


@pytest.mark.parametrize("stops", [(13, 8, 20), (12, 9, 11)])
def test_prompt_cache_over_three_turns_with_draft_trees(agree_dir, stops):
    """The same with draft trees: a turn that stops inside a round rolls the walked path back
    as a chain's rows, and the cache stays bitwise mlx-lm's."""
    (model, tok), (ref, _) = pair(agree_dir)
    stats = RunStats()
    got, want, fed = _turns(model, ref, tok, stops, block_size=4, stats=stats,
                            ours_kw=dict(draft_topk=2, draft_tokens=5))
    assert got == want
    assert all(n == new for new, n in fed[1:]), fed
    assert stats.tree_rounds > 0 and stats.accepted > 0


def test_prompt_cache_drafter_context_continues(agree_dir):
    """The MTP head's own cache keeps one pair per processed position minus the last (whose pair
    needs the next turn's first token): it continues where the target does."""
    model, tok = mlx_mtp.load(str(agree_dir))
    cache = mlx_mtp.make_prompt_cache(model)
    for text, n in zip(TURNS, (12, 9, 11)):
        take(mlx_mtp.generate_step(mx.array(tok.encode(text)), model, prompt_cache=cache), n)
        assert [c.offset for c in cache.drafter_state] == [cache.offset - 1]
        assert cache.hidden.shape == (1, 1, model.target.hidden_size)


def test_saved_and_loaded_cache_continues_as_mlx_lm(agree_dir, tmp_path):
    (model, tok), (ref, _) = pair(agree_dir)
    ours, theirs = mlx_mtp.make_prompt_cache(model), mlx_cache.make_prompt_cache(ref)
    first = mx.array(tok.encode(TURNS[0]))
    assert take(mlx_mtp.generate_step(first, model, prompt_cache=ours), 10) == \
        take(mlx_generate_step(first, ref, prompt_cache=theirs), 10)
    f = str(tmp_path / "chat.safetensors")
    mlx_mtp.save_prompt_cache(f, ours, {"chat": "demo"})
    loaded, meta = mlx_mtp.load_prompt_cache(f, return_metadata=True)
    assert meta == {"chat": "demo"}
    assert loaded.offset == ours.offset and loaded.family == "qwen3_5"
    assert bitwise(model.target.cache_state(loaded), model.target.cache_state(ours))
    assert bitwise([c.keys[..., : c.offset, :] for c in loaded.drafter_state] + [loaded.hidden],
                   [c.keys[..., : c.offset, :] for c in ours.drafter_state] + [ours.hidden])
    assert len(mlx_cache.load_prompt_cache(f)) == len(ours) + 2  # mlx-lm reads the file too
    nxt = mx.array(tok.encode(TURNS[1]))
    got = take(mlx_mtp.generate_step(nxt, model, prompt_cache=loaded), 14)
    assert got == take(mlx_generate_step(nxt, ref, prompt_cache=theirs), 14)


def test_prompt_cache_errors(dense_dir, tmp_path):
    model, tok = mlx_mtp.load(str(dense_dir))
    prompt = mx.array(tok.encode(CODE_PROMPT))
    with pytest.raises(MTPError, match=r"^prompt_cache must come from "
                       r"mlx_mtp.make_prompt_cache\(model\) .* got list$"):
        next(mlx_mtp.generate_step(prompt, model, prompt_cache=mlx_cache.make_prompt_cache(
            model.mlx_model)))
    f = str(tmp_path / "plain.safetensors")
    mlx_cache.save_prompt_cache(f, mlx_cache.make_prompt_cache(model.mlx_model))
    with pytest.raises(MTPError, match="not a prompt cache saved by mlx_mtp.save_prompt_cache"):
        mlx_mtp.load_prompt_cache(f)


# ------------------------------------------------------------------------------ KV cache options


@pytest.mark.parametrize("start", [0, 30])
def test_kv_bits_8_as_mlx_lm(agree_dir, start):
    """Quantized from the start, and from a position reached while decoding (rounds then stop
    short of the switch, as mlx-lm's decode steps switch after the step that reaches it)."""
    (model, tok), (ref, _) = pair(agree_dir)
    kw = dict(kv_bits=8, kv_group_size=32, quantized_kv_start=start)
    stats = RunStats()
    cache = mlx_mtp.make_prompt_cache(model)
    assert isinstance(cache[1], mlx_cache.KVCache)
    got, want, _ = _turns(model, ref, tok, (12, 9, 11), ours_cache=cache, stats=stats, **kw)
    assert got == want
    assert isinstance(cache[1], mlx_cache.QuantizedKVCache)  # and bitwise mlx-lm's (_turns)
    assert stats.mtp_enabled and stats.accepted > 0
    configs = {w["config"] for w in stats.exactness["widths"]}
    assert configs == {"", "kv 8-bit, group 32"}  # the probe covered the quantized cache too


@pytest.mark.parametrize("start", [0, 30])
def test_kv_bits_8_with_draft_trees_as_mlx_lm(agree_dir, start):
    """Draft trees on a quantized KV cache: the accepted path's packed entries, scales and
    biases move to consecutive positions; the cache stays bitwise mlx-lm's."""
    (model, tok), (ref, _) = pair(agree_dir)
    kw = dict(kv_bits=8, kv_group_size=32, quantized_kv_start=start)
    stats = RunStats()
    cache = mlx_mtp.make_prompt_cache(model)
    got, want, _ = _turns(model, ref, tok, (12, 9, 11), ours_cache=cache, stats=stats,
                          block_size=4, ours_kw=dict(draft_topk=2, draft_tokens=5), **kw)
    assert got == want
    assert isinstance(cache[1], mlx_cache.QuantizedKVCache)
    assert stats.tree_rounds > 0 and stats.accepted > 0
    tree = stats.exactness["tree"]  # the tree probe covered the quantized cache too
    assert tree["verdict"] == "equal" and tree["config"].endswith("; kv 8-bit, group 32")


def test_kv_cache_argument_errors(dense_dir):
    model, tok = mlx_mtp.load(str(dense_dir))
    prompt = mx.array(tok.encode(CODE_PROMPT))
    cases = [(dict(kv_bits=7), "kv_bits must be one of 2, 3, 4, 5, 6, 8, got 7"),
             (dict(kv_bits=8, kv_group_size=64),
              "kv_group_size 64 does not divide the target's head_dim 32"),
             (dict(kv_bits=4, kv_group_size=32, quantized_kv_start=-1),
              "quantized_kv_start must be an integer >= 0, got -1"),
             (dict(max_kv_size=0), "max_kv_size must be a positive integer, got 0")]
    for kw, msg in cases:
        with pytest.raises(MTPError) as e:
            next(mlx_mtp.generate_step(prompt, model, **kw))
        assert str(e.value) == msg


def test_max_kv_size_past_the_window_as_mlx_lm(dense_dir, caplog):
    """mlx-lm ignores max_kv_size for models that make their own cache (all MTP families): so do
    we, saying so once; the output is mlx-lm's with the same argument, past the window."""
    (model, tok), (ref, _) = pair(dense_dir)
    prompt = mx.array(tok.encode(CODE_PROMPT))
    with caplog.at_level(logging.WARNING, logger="mlx_mtp"):
        got = take(mlx_mtp.generate_step(prompt, model, max_tokens=40, max_kv_size=8), 40)
    assert got == take(mlx_generate_step(prompt, ref, max_tokens=40, max_kv_size=8), 40)
    assert prompt.size + 40 > 8
    assert any("max_kv_size=8 has no effect on qwen3_5 targets, as in mlx-lm" in r.message
               for r in caplog.records)


@pytest.mark.slow
def test_gemma4_max_kv_size_past_the_window_and_kv_bits_refused(tmp_path_factory, tmp_path):
    from support.tiny_gemma4 import WINDOW, Checkpoints

    ckpts = Checkpoints(tmp_path_factory)
    path = ckpts.target("31b", "text")
    model, tok = mlx_mtp.load(str(path), drafter=ckpts.assistant("31b"))
    ref, _ = mlx_lm.load(str(path))
    prompt = mx.array([(7 * i + 3) % 300 for i in range(5)])
    n = 3 * WINDOW  # well past the sliding window
    cache, ref_cache = mlx_mtp.make_prompt_cache(model, max_kv_size=8), \
        mlx_cache.make_prompt_cache(ref, max_kv_size=8)
    got = take(mlx_mtp.generate_step(prompt, model, max_tokens=n, max_kv_size=8,
                                     prompt_cache=cache), n)
    assert got == take(mlx_generate_step(prompt, ref, max_tokens=n, max_kv_size=8,
                                         prompt_cache=ref_cache), n)
    nxt = mx.array([5, 9, 11])
    assert take(mlx_mtp.generate_step(nxt, model, prompt_cache=cache), 9) == \
        take(mlx_generate_step(nxt, ref, prompt_cache=ref_cache), 9)
    f = str(tmp_path / "gemma.safetensors")  # the rotating caches survive a save and a load
    mlx_mtp.save_prompt_cache(f, cache)
    loaded = mlx_mtp.load_prompt_cache(f)
    assert [type(c) for c in loaded] == [type(c) for c in cache]
    last = mx.array([17, 3])
    assert take(mlx_mtp.generate_step(last, model, prompt_cache=loaded), 9) == \
        take(mlx_generate_step(last, ref, prompt_cache=ref_cache), 9)
    with pytest.raises(MTPError, match=r"^kv_bits is not supported for Gemma 4: its "
                       r"sliding-window layers use mlx-lm's RotatingKVCache"):
        next(mlx_mtp.generate_step(prompt, model, kv_bits=8))


# ------------------------------------------------------------------------------ load arguments


def test_load_arguments_as_mlx_lm(dense_dir, monkeypatch):
    kw = dict(return_config=True, lazy=True, tokenizer_config={"eos_token": "<|im_end|>"},
              model_config={"note": "from model_config"})
    model, tok, config = mlx_mtp.load(str(dense_dir), **kw)
    ref, ref_tok, ref_config = mlx_lm.load(str(dense_dir), **kw)
    assert config["model_type"] == ref_config["model_type"] == "qwen3_5"
    assert config["note"] == ref_config["note"] == "from model_config"
    assert tok.eos_token_ids == ref_tok.eos_token_ids and tok.eos_token == "<|im_end|>"
    with pytest.raises(MTPError, match=r"requires importing and running a custom module .*"
                       r"Pass trust_remote_code=True if you trust this model"):
        mlx_mtp.load(str(dense_dir), model_config={"model_file": "custom.py"})
    asked = {}

    def fake_download(repo_id, **kw):
        asked.update(kw, repo_id=repo_id)
        return str(dense_dir)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    mlx_mtp.load("someone/tiny-qwen", revision="v1.2")
    assert asked["repo_id"] == "someone/tiny-qwen" and asked["revision"] == "v1.2"


@pytest.mark.subprocess
def test_lora_adapter_as_mlx_lm(dense_dir, tmp_path):
    """A tiny adapter trained for a few steps by mlx_lm.lora: the adapted target with its
    original MTP head decodes exactly as mlx-lm with the adapter."""
    import json

    from support.processes import run_module

    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "valid"):
        (data / f"{split}.jsonl").write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in tc.CORPUS * 2))
    adapters = tmp_path / "adapters"
    run_module("mlx_lm", "lora", "--model", dense_dir, "--train", "--data", data,
               "--iters", "3", "--batch-size", "1", "--num-layers", "2",
               "--learning-rate", "0.05", "--adapter-path", adapters, "--val-batches", "1",
               "--steps-per-report", "1", "--save-every", "3", "--max-seq-length", "64")
    (model, tok), (ref, _) = pair(dense_dir, adapter_path=str(adapters))
    prompt = mx.array(tok.encode(CODE_PROMPT))
    stats = RunStats()
    got = take(mlx_mtp.generate_step(prompt, model, max_tokens=24, stats=stats), 24)
    assert got == take(mlx_generate_step(prompt, ref, max_tokens=24), 24)
    base, _ = mlx_mtp.load(str(dense_dir))
    assert got != take(mlx_mtp.generate_step(prompt, base, max_tokens=24), 24)  # it adapted
    assert stats.mtp_enabled and stats.rounds > 0
    assert model.drafter.head is not None
    with pytest.raises(MTPError, match=r"adapter_path .*: expected a folder with "
                       r"adapter_config.json and adapters.safetensors"):
        mlx_mtp.load(str(dense_dir), adapter_path=str(tmp_path))


# ------------------------------------------------------------------------------ refusals


def test_what_cannot_work_with_mtp_is_one_clear_error(dense_dir):
    model, tok = mlx_mtp.load(str(dense_dir))
    with pytest.raises(MTPError, match=r"^draft_model is not supported: mlx_mtp drafts with the "
                       r"target's own MTP head"):
        next(mlx_mtp.stream_generate(model, tok, "x", draft_model=model.mlx_model))
    with pytest.raises(MTPError, match=r"^num_draft_tokens is mlx-lm's setting for a separate "
                       r"draft model: use block_size"):
        next(mlx_mtp.stream_generate(model, tok, "x", num_draft_tokens=3))
    prompt = mx.array([5, 17])
    for gen in (mlx_mtp.speculative_generate_step(prompt, model, model.mlx_model),
                mlx_mtp.generate_step(prompt, model, draft_model=model.mlx_model)):
        with pytest.raises(MTPError, match=r"^draft_model is not supported: mlx_mtp drafts with "
                           r"the target's own MTP head"):
            next(gen)
    for gen in (mlx_mtp.speculative_generate_step(prompt, model, num_draft_tokens=2),
                mlx_mtp.generate_step(prompt, model, num_draft_tokens=2)):
        with pytest.raises(MTPError, match=r"^num_draft_tokens is mlx-lm's setting for a "
                           r"separate draft model: use block_size"):
            next(gen)
    with pytest.raises(MTPError, match=r"^max_tokens must be non-zero \(use -1 for no limit\)$"):
        next(mlx_mtp.stream_generate(model, tok, "x", max_tokens=0))
    with pytest.raises(MTPError, match=r"^the prompt must be a non-empty 1-D array of token ids "
                       r"\(with input_embeddings too"):
        next(mlx_mtp.generate_step(mx.array([], dtype=mx.uint32), model,
                                   input_embeddings=mx.zeros((3, 64))))
    assert isinstance(model.target, Qwen3_5Target)
    with pytest.raises(AttributeError, match=r"^module 'mlx_mtp' has no attribute 'nope'$"):
        mlx_mtp.nope
