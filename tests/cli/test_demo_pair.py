"""The embedded demo pair: what ``python -m mlx_mtp.generate`` runs with no ``--model``."""

import json

import mlx.core as mx
import pytest
from support.processes import cli
from mlx_lm.generate import generate_step as mlx_generate_step
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.utils import load_model as mlx_load_model
from safetensors import safe_open

import mlx_mtp
from benchmarks.common import distinct_ngram_share
from mlx_mtp import MTPError
from mlx_mtp import demo
from mlx_mtp.decoding.responses import encode_prompt
from mlx_mtp.generate import DEFAULT_PROMPT

# Prompts that end in a newline. The demo tokenizer merges a newline with the next line's indent,
# so each ends in a bare newline token, which text tokenized whole has mostly before an unindented
# line or at a file's end (then end of text); the target was also trained on files cut at line
# ends, each piece tokenized alone (tools/demo_pair/corpus.py), so it writes on after one.
NEWLINE_PROMPTS = (
    "class Parser:\n    def __init__(self, text):\n",
    "def read_config(path):\n    with open(path) as f:\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "for line in lines:\n",
    "try:\n    import json\nexcept ImportError:\n",
)


@pytest.mark.subprocess
def test_no_model_runs_the_demo_pair_exactly_like_mlx_lm():
    """With its decode settings (mlx-lm's repetition penalty) as mlx-lm's greedy decode with the
    same logits processors."""
    # A fixed block size: tokens per round under auto depends on the choices (timings).
    out = json.loads(cli("--max-tokens", 40, "--block-size", 3, "--json").stdout)
    assert out["model"] == str(demo.DEMO_DIR)
    assert out["mtp_enabled"] is True and out["block_size"] == 3
    tok = load_tokenizer(demo.DEMO_DIR)
    # mlx-lm's greedy decode under the demo pair's decode settings (its repetition penalty)
    model, _ = mlx_load_model(demo.DEMO_DIR)
    processors = make_logits_processors(
        repetition_penalty=demo.DEMO_DECODE.repetition_penalty,
        repetition_context_size=demo.DEMO_DECODE.repetition_context_size)
    ref = [t for t, _ in mlx_generate_step(mx.array(tok.encode(DEFAULT_PROMPT)), model,
                                           max_tokens=40, logits_processors=processors)]
    ref = ref[: next((i for i, t in enumerate(ref) if t in tok.eos_token_ids), len(ref))]
    assert len(ref) == 40 and out["tokens"] == ref
    # A trained head, not a random one (random heads accept nothing): the demo's whole point.
    # Its drafts apply the same penalty (the head was trained on the demo's own text for that):
    # measured 0.80 first-position acceptance, 2.44 tokens per round here.
    assert out["draft_processors"] == "applied"
    assert out["per_position_acceptance"][0] >= 0.7, out["per_position_acceptance"]
    assert out["tokens_per_round"] >= 2.2, out["tokens_per_round"]
    # and on plain greedy decode (no penalty anywhere; measured 0.93, 2.79)
    plain = json.loads(cli("--max-tokens", 40, "--block-size", 3, "--repetition-penalty", "1.0",
                           "--json").stdout)
    assert plain["repetition_penalty"] == 1.0
    assert plain["per_position_acceptance"][0] >= 0.6, plain["per_position_acceptance"]
    assert plain["tokens_per_round"] >= 1.8, plain["tokens_per_round"]


@pytest.mark.subprocess
def test_the_cli_writes_on_after_a_prompt_that_ends_in_a_newline():
    out = json.loads(cli("--prompt", NEWLINE_PROMPTS[0], "--max-tokens", 64, "--json").stdout)
    assert out["generation_tokens"] == 64 and len(out["tokens"]) == 64, out["text"]
    assert distinct_ngram_share(out["tokens"]) >= 0.6, out["text"]


@pytest.mark.slow
def test_the_demo_writes_on_after_every_newline_prompt():
    """The other prompts through the API with the demo's decode (its penalty, on the drafts too):
    64 tokens before any end of text, at least 0.6 of their 4-grams distinct."""
    model, tok = mlx_mtp.load(demo.DEMO_DIR)
    for prompt in NEWLINE_PROMPTS[1:]:
        ids = [t for t, _ in mlx_mtp.generate_step(encode_prompt(tok, prompt), model,
                                                    max_tokens=64, block_size=3,
                                                    **demo.DEMO_DECODE.generation_kwargs())]
        text = ids[: next((i for i, t in enumerate(ids) if t in tok.eos_token_ids), len(ids))]
        assert len(text) == 64, (prompt, tok.decode(text))
        assert distinct_ngram_share(text) >= 0.6, (prompt, tok.decode(text))


def test_the_demo_is_a_raw_hugging_face_checkpoint_under_40_mb():
    d = demo.DEMO_DIR
    config = json.loads((d / "config.json").read_text())
    assert config["model_type"] == "qwen3_5" and config["tie_word_embeddings"] is True
    text = config["text_config"]
    assert text["model_type"] == "qwen3_5_text" and text["num_hidden_layers"] == 16
    assert text["mtp_num_hidden_layers"] == 1
    with safe_open(str(d / "model.safetensors"), "np") as f:
        keys = set(f.keys())
        assert f.metadata() == {"format": "pt"}
        assert f.get_slice("model.language_model.layers.0.linear_attn.conv1d.weight").get_shape() \
            == [512, 1, 4]  # HF conv1d layout
    assert "model.language_model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight",
            "mtp.layers.0.self_attn.q_proj.weight"} <= keys
    assert sum(p.stat().st_size for p in d.iterdir()) < 40 * 2**20
    check = json.loads((d / "export_check.json").read_text())  # written by tools/demo_pair/export.py
    assert check["target_max_abs_diff"] < 2e-3 and check["head_max_abs_diff"] < 2e-3


def test_the_demo_loads_through_the_real_checkpoint_path():
    model, tok = mlx_mtp.load(demo.DEMO_DIR)
    assert model.path == demo.DEMO_DIR and model.drafter is not None
    assert tok.eos_token_ids == {tok.convert_tokens_to_ids("<|endoftext|>")}


def test_load_without_a_path_is_the_demo_pair_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, tok = mlx_mtp.load()
    assert model.path == demo.DEMO_DIR and model.drafter is not None
    assert tok.encode(DEFAULT_PROMPT) == mlx_mtp.load(demo.DEMO_DIR)[1].encode(DEFAULT_PROMPT)
    with pytest.raises(MTPError) as e:
        mlx_mtp.load(drafter="/some/head")
    assert str(e.value) == ("drafter needs a path_or_hf_repo: the embedded demo pair has its own "
                            "head")


def test_the_demo_decode_kwargs_give_the_api_mlx_lms_penalized_decode():
    """``DEMO_DECODE.generation_kwargs()`` is mlx-lm's repetition penalty as logits processors:
    the API with them decodes as mlx-lm's greedy decode with the same processors, and the
    penalty changes the text (what it is there for)."""
    model, tok = mlx_mtp.load()
    kwargs = mlx_mtp.DEMO_DECODE.generation_kwargs()
    assert set(kwargs) == {"logits_processors"}
    ids = [r.token for r in mlx_mtp.stream_generate(model, tok, DEFAULT_PROMPT, max_tokens=40,
                                                    block_size=3, **kwargs)]
    mlx_model, _ = mlx_load_model(demo.DEMO_DIR)
    processors = make_logits_processors(
        repetition_penalty=demo.DEMO_DECODE.repetition_penalty,
        repetition_context_size=demo.DEMO_DECODE.repetition_context_size)
    ref = [t for t, _ in mlx_generate_step(mx.array(tok.encode(DEFAULT_PROMPT)), mlx_model,
                                           max_tokens=40, logits_processors=processors)]
    assert ids == ref[:len(ids)] and len(ids) == next(
        (i + 1 for i, t in enumerate(ref) if t in tok.eos_token_ids), 40)
    unpenalized = [r.token for r in mlx_mtp.stream_generate(model, tok, DEFAULT_PROMPT,
                                                            max_tokens=40, block_size=3)]
    assert unpenalized != ids


@pytest.mark.subprocess
def test_drafter_without_model_is_one_line_error():
    r = cli("--drafter", "/some/head", check=False)
    assert r.returncode == 1
    assert r.stderr == "error: --drafter needs --model: the embedded demo pair has its own head\n"


def test_an_incomplete_demo_folder_is_named(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(demo, "DEMO_DIR", tmp_path)
    with pytest.raises(MTPError) as e:
        demo.demo_path()
    assert str(e.value) == (f"{tmp_path}: the embedded demo pair is incomplete (missing "
                            "model.safetensors, tokenizer.json, tokenizer_config.json); "
                            "reinstall mlx-mtp or pass --model")
