"""benchmarks/realistic_pair.py on small shapes: the folders load through mlx_mtp with their
drafter (the Qwen3.5 head, the Gemma 4 assistant, whose target ties its LM head to its embedding
and keeps the softcap, as Gemma 4's checkpoints do), a small residual scale makes the drafter agree
with the target, the text does not loop, and calibration bisects towards the asked first-draft
acceptance. The MoE pairs: tests/bench/test_realistic_moe_pair.py."""

import json

import pytest

from benchmarks import realistic_pair
from support.realistic_shapes import QWEN_SMALL as SMALL
from support.realistic_shapes import ZIPF_SMALL


def test_a_small_scale_pair_agrees_and_its_text_does_not_loop(tmp_path):
    out = tmp_path / "pair"
    assert realistic_pair.main([str(out), *SMALL, "--residual-scale", "0.003"]) == 0
    info = json.loads((out / "realistic_pair.json").read_text())
    assert info["residual_scale"] == 0.003 and info["first_draft_acceptance"] > 0.9
    config = json.loads((out / "config.json").read_text())["text_config"]
    assert (config["vocab_size"], config["tie_word_embeddings"]) == (12288, False)

    import mlx.core as mx

    import mlx_mtp
    from benchmarks.common import distinct_ngram_share

    model, tokenizer = mlx_mtp.load(str(out))
    ids = [t for t, _ in mlx_mtp.generate_step(mx.array(tokenizer.encode("abc")), model,
                                               max_tokens=64, block_size=3)]
    assert distinct_ngram_share(ids) > 0.9
    assert tokenizer.decode(ids)  # every id decodes (the extended vocabulary)


def test_calibration_bisects_towards_the_asked_acceptance(tmp_path, monkeypatch):
    """Acceptance falls as the residual scale grows; the scale kept is the nearest to the ask."""
    tried = []
    monkeypatch.setattr(realistic_pair, "write_pair", lambda out, a, scale: tried.append(scale))
    monkeypatch.setattr(realistic_pair, "first_draft_acceptance",
                        lambda out, family: max(0.0, 1.0 - 4.0 * tried[-1]))
    args = realistic_pair.parse_args([str(tmp_path), "--first-draft-acceptance", "0.9",
                                      "--calibration-steps", "12"])
    scale = realistic_pair.calibrate(tmp_path, args)
    assert scale == pytest.approx(0.025, rel=0.01)


GEMMA_SMALL = ["--family", "gemma4", "--hidden", "128", "--layers", "6", "--vocab", "12288",
               "--intermediate", "256", "--heads", "2", "--kv-heads", "1", "--head-dim", "64",
               "--sliding-window", "16"]


def test_a_small_scale_gemma4_pair_agrees_and_matches_plain_decode(tmp_path):
    out = tmp_path / "pair"
    # a scale whose context flips some of f's choices, as calibrated pairs' do: they move the
    # text off f's orbits (a 12k-id f cycles within tens of tokens)
    assert realistic_pair.main([str(out), *GEMMA_SMALL, "--residual-scale", "0.005"]) == 0
    info = json.loads((out / "realistic_pair.json").read_text())
    assert info["family"] == "gemma4" and info["first_draft_acceptance"] > 0.9
    config = json.loads((out / "target" / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"], config["tie_word_embeddings"],
            config["final_logit_softcapping"]) == ("gemma4_text", 12288, True, 30.0)
    assistant = json.loads((out / "assistant" / "config.json").read_text())
    assert assistant["model_type"] == "gemma4_assistant"
    import mlx.core as mx

    target = mx.load(str(out / "target" / "model.safetensors"))
    assert "lm_head.weight" not in target  # tied: the embedding is the LM head, as Gemma 4's
    helper = mx.load(str(out / "assistant" / "model.safetensors"))
    assert mx.array_equal(helper["model.embed_tokens.weight"],
                          target["model.embed_tokens.weight"]).item()

    import mlx.core as mx
    from mlx_lm.generate import generate_step as plain_step

    import mlx_mtp
    from benchmarks.common import distinct_ngram_share

    model, tokenizer = mlx_mtp.load(str(out / "target"), drafter=str(out / "assistant"))
    assert model.target.tied_head and model.mlx_model.final_logit_softcapping == 30.0
    prompt = mx.array(tokenizer.encode("abc"))
    ids = [t for t, _ in mlx_mtp.generate_step(prompt, model, max_tokens=48, block_size=3)]
    plain = [int(t) for t, _ in plain_step(prompt, model.mlx_model, max_tokens=48)]
    assert ids == plain
    assert distinct_ngram_share(ids) > 0.9


def test_gemma4_calibration_sets_the_scale_on_the_loaded_target_as_a_written_pair_has_it(tmp_path):
    """The in-place candidates measure what a pair written with that scale measures."""
    args = realistic_pair.parse_args([str(tmp_path / "a"), *GEMMA_SMALL])
    measure = realistic_pair._measure(tmp_path / "a", args)
    in_place = [measure(scale) for scale in (0.003, 0.3)]
    written = []
    for scale in (0.003, 0.3):
        realistic_pair.write_pair(tmp_path / "b", args, scale)
        written.append(realistic_pair.first_draft_acceptance(tmp_path / "b", "gemma4"))
    assert in_place == written and written[0] > written[1]


def test_a_zipf_pair_drafts_exactly_without_noise_and_its_choices_follow_zipf(tmp_path):
    """With (almost) no context noise the head computes the target's next token from the last
    three at every depth, and the target's choices after random contexts fall in the top quarter
    of the frequency ranks about as often as Zipf's law says (a uniform pair: a quarter). At this
    small size the noiseless text loops; records check the full-size pair's text."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step as plain_step

    import mlx_mtp
    from benchmarks import realistic_zipf
    from mlx_mtp.decoding.stats import RunStats

    out = tmp_path / "pair"
    assert realistic_pair.main([str(out), *ZIPF_SMALL, "--zipf", "1.0",
                                "--residual-scale", "1e-6"]) == 0
    assert json.loads((out / "realistic_pair.json").read_text())["zipf"] == 1.0
    model, tokenizer = mlx_mtp.load(str(out))
    emitted = []
    for prompt in ("abc", "The river rose", "def f(x):"):
        stats = RunStats()
        ids = [t for t, _ in mlx_mtp.generate_step(mx.array(tokenizer.encode(prompt)), model,
                                                   max_tokens=96, block_size=4, stats=stats)]
        assert stats.per_position_acceptance == [1.0, 1.0, 1.0]
        emitted += ids
    plain = [int(t) for t, _ in plain_step(mx.array(tokenizer.encode("abc")), model.mlx_model,
                                           max_tokens=96)]
    assert emitted[:96] == plain

    rank = realistic_zipf.pair_ranks(model) - 1  # 0 = the largest bias
    assert int(rank[0]) == 12287  # EOS is the rarest id
    context = mx.random.randint(1, 12288, (1, 512), key=mx.random.key(1))
    choices = mx.argmax(model.mlx_model(context)[0], axis=-1)
    top_quarter = (rank[choices] < 12288 // 4).mean().item()
    assert abs(top_quarter - realistic_zipf.zipf_share(12288 // 4, 12288, 1.0)) < 0.05


def test_zipf_needs_two_attention_layers_and_the_qwen_family(tmp_path, capsys):
    for bad in (["--layers", "4"], ["--family", "gemma4"], ["--zipf", "0"]):
        with pytest.raises(SystemExit, match="--zipf takes an exponent > 0"):
            realistic_pair.main([str(tmp_path / "x"), *ZIPF_SMALL, "--zipf", "1.0", *bad,
                                 "--residual-scale", "0.1"])
        assert not (tmp_path / "x").exists()
