"""The demo pair's training tools (tools/demo_pair/) that decide what it learns: the corpus cut at
line ends, the prompts cut from the corpus, the demo's decode as demo_texts batches it, the
drafting replay's penalty and rounds, and the count of newline prompts that end the text."""

import json

import numpy as np
import pytest
from mlx_lm.sample_utils import make_repetition_penalty
from tokenizers import Tokenizer

import mlx.core as mx
import mlx_mtp
from mlx_mtp import demo
from mlx_mtp.demo import DEMO_DECODE
from tools.demo_pair import corpus, demo_texts, newline_check

SOURCE = ("class Stack:\n    def __init__(self):\n        self.items = []\n\n"
          "    def push(self, item):\n        self.items.append(item)\n")


def test_line_cuts_fall_after_newlines_and_rejoin_the_text():
    pieces = corpus.line_cut_pieces(SOURCE, 0.5, np.random.default_rng([0, 3]))
    assert "".join(pieces) == SOURCE and len(pieces) > 1
    assert all(p.endswith("\n") for p in pieces[:-1]) and pieces[-1]  # never an empty tail
    assert pieces == corpus.line_cut_pieces(SOURCE, 0.5, np.random.default_rng([0, 3]))
    assert corpus.line_cut_pieces(SOURCE, 0.0, np.random.default_rng(0)) == [SOURCE]
    every = corpus.line_cut_pieces(SOURCE, 1.0, np.random.default_rng(0))
    assert every == SOURCE.splitlines(keepends=True)


def test_a_cut_gives_the_bare_newline_then_an_indent_token():
    """What the cuts are for: whole, the tokenizer merges the newline with the next line's indent;
    cut, the prefix ends in the bare newline a prompt ending in one ends in."""
    tok = Tokenizer.from_file(str(demo.DEMO_DIR / "tokenizer.json"))
    text = "    def f(self):\n        return 1\n"
    newline, indent7, merged = (tok.token_to_id(t) for t in ("\u010a", "\u0120" * 7,
                                                             "\u010a" + "\u0120" * 7))
    assert merged in tok.encode(text).ids and newline not in tok.encode(text).ids[:-1]
    first, rest = corpus.line_cut_pieces(text, 1.0, np.random.default_rng(0))
    assert tok.encode(first).ids[-1] == newline
    assert tok.encode(rest).ids[0] == indent7


def test_prompts_are_cut_after_a_newline_at_a_line_end_or_inside_a_line():
    rng = np.random.default_rng(5)
    seen = set()
    for _ in range(60):
        kind, prompt, whole = demo_texts.cut_prompt(SOURCE, rng)
        seen.add(kind)
        assert whole and SOURCE.startswith(prompt) and prompt.strip()
        after = SOURCE[len(prompt):len(prompt) + 1]
        if kind == "newline":
            assert prompt.endswith("\n")
        elif kind == "line_end":
            assert after == "\n" and not prompt.endswith("\n")
        else:
            assert after not in ("\n", "") and not prompt.endswith("\n")
    assert seen == set(demo_texts.KINDS)
    assert demo_texts.cut_prompt("\n\n", rng) is None  # no line to cut: the file is skipped


def test_the_batched_penalty_is_mlx_lms_processor_row_by_row():
    rng = np.random.default_rng(1)
    logits = mx.array(rng.normal(0, 3, (3, 50)).astype(np.float32))
    history = mx.array(rng.integers(0, 50, (3, 48)).astype(np.int32))  # ids repeat
    got = demo_texts.penalize(logits, history, DEMO_DECODE.repetition_penalty)
    proc = make_repetition_penalty(DEMO_DECODE.repetition_penalty,
                                   DEMO_DECODE.repetition_context_size)
    for r in range(3):
        want = proc(history[r].tolist(), logits[r:r + 1])
        assert mx.array_equal(got[r:r + 1], want).item()


def test_batched_continuations_are_generate_steps(dense_dir):
    """demo_texts' batch of equal-length prompts gives each prompt's mlx-lm decode under the
    demo's penalty, token for token, stopping at an end-of-text id."""
    model, _ = mlx_mtp.load(dense_dir, require_head=False)
    prompts = np.array([[5, 9, 2, 7, 7, 3], [11, 4, 4, 8, 1, 6]])
    got = demo_texts.continue_batch(model, prompts, 24, eos=set())
    want = [demo_texts.single_continuation(model, p.tolist(), 24, eos=set()) for p in prompts]
    assert got == want and all(len(c) == 24 for c in got)
    stop = want[0][10]
    cut = demo_texts.continue_batch(model, prompts, 24, eos={stop})
    assert cut[0] == want[0][: want[0].index(stop)]


def test_the_replay_penalizes_as_mlx_lm_and_runs_rounds_from_the_prompts_end():
    torch = pytest.importorskip("torch", reason="the train extra")
    from tools.demo_pair import drafting_sim

    rng = np.random.default_rng(2)
    logits = rng.normal(0, 3, (4, 50)).astype(np.float32)
    ids = torch.from_numpy(rng.integers(0, 50, 60))
    hist = drafting_sim.histories(ids, torch.tensor([3, 20, 59, 0]), 48)
    assert hist[0].tolist() == [ids[3 - i].item() if i <= 3 else ids[0].item()
                                for i in range(48)]
    assert hist[2].tolist() == ids.flip(0)[:48].tolist()
    got = drafting_sim.penalize(torch.from_numpy(logits), hist, DEMO_DECODE.repetition_penalty)
    proc = make_repetition_penalty(DEMO_DECODE.repetition_penalty, 48)
    for r in range(4):
        want = np.array(proc(hist[r].tolist(), mx.array(logits[r:r + 1])))
        assert np.array_equal(got[r:r + 1].numpy(), want)
    # a round keeps L(p) drafts (at most the block's) and the next starts after them and the bonus
    assert drafting_sim.rounds([2, 0, 1, 1, 0, 2, 2], 2) == [2, 1, 2]
    assert drafting_sim.rounds([2, 0, 1, 1, 0, 2, 2], 1) == [1, 1, 0, 1]


def test_a_newline_prompt_is_whole_lines_ending_after_a_non_blank_one():
    rng = np.random.default_rng(5)
    for _ in range(20):
        p = newline_check.newline_prompt(SOURCE, rng, 40)
        assert p.endswith("\n") and p.strip() and SOURCE.find(p) >= 0
        start = SOURCE.find(p)
        assert start == 0 or SOURCE[start - 1] == "\n"  # whole lines
        assert len(p) <= 40 or p.count("\n") == 1  # one line longer than the limit comes alone
        assert p.splitlines()[-1].strip()  # ends after a non-blank line
    assert newline_check.newline_prompt(SOURCE, rng, 10_000) in {
        SOURCE[:SOURCE.index(line) + len(line)] for line in SOURCE.splitlines(keepends=True)
        if line.strip()}
    assert newline_check.newline_prompt("\n\n   \n", rng, 100) is None


def test_the_newline_check_counts_first_tokens_that_end_the_text(tmp_path, capsys):
    """Its count is the number of prompts after which mlx-lm's decode under the demo's penalty
    starts with end of text; cut from the held-out files corpus.json lists."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "stack.py").write_text(SOURCE)
    (tmp_path / "corpus.json").write_text(
        '{"stdlib": "%s", "val_files": ["stack.py"]}' % (tmp_path / "lib"))
    newline_check.main(["--pair", str(demo.DEMO_DIR), "--work", str(tmp_path),
                        "--prompts", "4", "--seed", "3"])
    got = json.loads(capsys.readouterr().out)
    prompts = newline_check.newline_prompts([("stack.py", SOURCE)], 4, 3, 1500)
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors
    from mlx_lm.utils import load_model

    model, _ = load_model(demo.DEMO_DIR)
    tok = mlx_mtp.load(demo.DEMO_DIR)[1]
    ends = 0
    for p in prompts:
        processors = make_logits_processors(
            repetition_penalty=DEMO_DECODE.repetition_penalty,
            repetition_context_size=DEMO_DECODE.repetition_context_size)
        t, _ = next(generate_step(mx.array(tok.encode(p)), model, max_tokens=1,
                                  logits_processors=processors))
        ends += int(t) in tok.eos_token_ids
    assert got == {"pair": str(demo.DEMO_DIR), "prompts": 4, "chars": 1500,
                   "first_token_end_of_text": ends}
