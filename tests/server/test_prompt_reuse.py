"""The server's prompt cache in process: the LRU store of whole prompt caches
(``mlx_mtp.decoding.lru_prompt_cache``), where a chat's later prompts share its prompt (measured
on the demo pair's plain layout and on a Qwen3.5-style thinking template), the logits processors
that see the cached tokens, the size flag's parser and where the server keeps no cache."""

import argparse
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache
from mlx_lm.sample_utils import make_logits_processors

import mlx_mtp
from mlx_mtp import MTPError
from mlx_mtp.cli import byte_size
from mlx_mtp.demo import demo_path
from mlx_mtp.decoding.lru_prompt_cache import LRUPromptCache
from mlx_mtp.decoding.prompt_cache import PromptCache
from mlx_mtp.server.engine import Engine
from mlx_mtp.server.prompt_reuse import (PromptReuse, continuation_points, shared_length,
                                         with_history)
from mlx_mtp.server.schema import GenerationRequest

ENTRY_BYTES = 2 * 256 * 4 * 4  # one KVCache's keys and values: a 256-row buffer of 4 floats


def entry(n: int) -> PromptCache:
    """A one-layer prompt cache holding ``n`` tokens."""
    c = KVCache()
    c.update_and_fetch(mx.ones((1, 1, n, 4)), mx.ones((1, 1, n, 4)))
    return PromptCache([c], "qwen3_5")


@pytest.fixture(scope="module")
def demo():
    return mlx_mtp.load(str(demo_path()))


# ------------------------------------------------------------------------------ the store


def test_fetch_takes_the_longest_kept_prefix_and_leaves_a_token_to_prefill():
    store = LRUPromptCache(10**6)
    store.insert([1, 2, 3], entry(3))  # a finished generation: its target holds all 3
    store.insert([1, 2, 3, 4, 5], entry(4))  # a checkpoint: 4 held, the head paired token 5
    store.insert([1, 2, 9], entry(3))
    assert store.fetch([1, 2, 3, 4, 5, 6])[1] == 4
    assert store.fetch([1, 2, 3, 4, 5])[1] == 4  # the checkpoint's last token is prefilled
    assert store.fetch([1, 2, 3, 7])[1] == 3
    assert store.fetch([1, 2, 3]) == (None, 0)  # all of it held: nothing left to prefill
    assert store.fetch([1, 2]) == (None, 0)
    assert store.fetch([5, 1, 2, 3, 4]) == (None, 0)
    assert [1, 2, 9] in store and [1, 2] not in store


def test_a_fetched_copy_is_the_callers_own():
    store = LRUPromptCache(10**6)
    store.insert([1, 2, 3], entry(3))
    got, held = store.fetch([1, 2, 3, 4])
    got[0].update_and_fetch(mx.zeros((1, 1, 5, 4)), mx.zeros((1, 1, 5, 4)))
    again, _ = store.fetch([1, 2, 3, 4])
    assert (held, got.offset, again.offset) == (3, 8, 3)
    assert mx.array_equal(again[0].keys[..., :3, :], mx.ones((1, 1, 3, 4))).item()


def test_entries_past_the_bound_are_evicted_least_recently_used_first():
    store = LRUPromptCache(ENTRY_BYTES * 5 // 2)  # room for two
    store.insert([1, 2], entry(2))
    store.insert([3, 4], entry(2))
    assert store.fetch([1, 2, 5])[1] == 2  # [1, 2] is now the most recently used
    store.insert([6, 7], entry(2))
    assert [3, 4] not in store and [1, 2] in store and [6, 7] in store
    assert store.nbytes == 2 * ENTRY_BYTES == sum(e["bytes"] for e in store.entries())
    store.insert([6, 7], entry(2))  # the same key again replaces it
    assert len(store) == 2 and store.nbytes == 2 * ENTRY_BYTES


def test_an_entry_larger_than_the_bound_is_not_kept_and_evicts_nothing():
    store = LRUPromptCache(ENTRY_BYTES + 1)
    store.insert([1], entry(1))
    big = entry(300)  # a 512-row buffer
    assert store.insert(list(range(300)), big) is False
    assert len(store) == 1 and store.nbytes == ENTRY_BYTES


def test_a_mirror_keeps_what_the_bounded_store_keeps_in_its_order():
    """A split target's other ranks: an unbounded store through the same requests, then kept to
    rank 0's entries (its evictions, its recency)."""
    bounded, mirror = LRUPromptCache(ENTRY_BYTES * 5 // 2), LRUPromptCache(10**9)
    for store in (bounded, mirror):
        store.insert([1, 2], entry(2))
        store.insert([3, 4], entry(2))
        store.fetch([1, 2, 5])
        store.insert([6, 7], entry(2))  # the bounded store evicts [3, 4]
    assert len(mirror) == 3 and len(bounded) == 2
    mirror.mirror(bounded.digests())
    assert mirror.digests() == bounded.digests() == [[2, hash((1, 2))], [2, hash((6, 7))]]
    assert mirror.nbytes == bounded.nbytes and [3, 4] not in mirror
    # what it must keep but does not: the ranks went apart
    with pytest.raises(MTPError, match=r"^prompt cache: 1 entries to mirror are not kept here "
                                       r"\(first: 3 tokens\)$"):
        mirror.mirror([[3, hash((8, 8, 8))]])


def test_what_the_store_refuses():
    with pytest.raises(MTPError, match=r"^max_bytes must be at least 1, got 0$"):
        LRUPromptCache(0)
    with pytest.raises(MTPError, match=r"^a prompt cache holding 3 tokens cannot be kept under "
                                       r"5 tokens$"):
        LRUPromptCache(10**6).insert([1, 2, 3, 4, 5], entry(3))


# ------------------------------------------------------------------------- what later prompts share


# A Qwen3.5-style ChatML template: the generation prompt opens a thinking block, and an earlier
# answer is rendered without its reasoning.
THINKING_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + m.content.split('</think>')[-1].lstrip('\\n') "
    "+ '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}")
SYSTEM = {"role": "system", "content": "You write short Python."}
ANSWER = "class Stack:\n    def __init__(self):\n        self.items = []"


def chat_ids(tok, messages):
    return Engine(SimpleNamespace(config={}), tok)._render_chat(messages)


def test_the_demo_pairs_next_turn_shares_the_whole_prompt(demo):
    """The plain layout (no chat template) renders an answer after the prompt's own
    ``ASSISTANT:``: the next turn shares the whole prompt, and so does the probe."""
    _, tok = demo
    messages = [SYSTEM, {"role": "user", "content": "Write a stack."}]
    ids = chat_ids(tok, messages)
    nxt = chat_ids(tok, messages + [{"role": "assistant", "content": ANSWER},
                                    {"role": "user", "content": "Add a size method."}])
    other = chat_ids(tok, [SYSTEM, {"role": "user", "content": "Sort a list."}])
    points = continuation_points(ids, lambda m: chat_ids(tok, m), messages)
    assert points == [len(ids), shared_length(ids, other)]
    assert shared_length(ids, nxt) == len(ids)
    assert 0 < points[1] < len(ids)


def test_a_thinking_template_shares_the_prompt_up_to_the_thinking_block(demo):
    """The generation prompt ends ``<think>\\n``, which the next turn does not render: the
    point is where the next turn's prompt (an answer whose reasoning the template drops, then a
    new message) starts to differ, and the system point is where another conversation with the
    same system message does."""
    _, tok = demo
    tok = mlx_mtp.load(str(demo_path()))[1]  # its own copy: a template and special tokens added
    tok._tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]})
    tok._tokenizer.chat_template = THINKING_TEMPLATE
    tok.has_chat_template = True
    messages = [SYSTEM, {"role": "user", "content": "Write a stack."}]
    ids = chat_ids(tok, messages)
    nxt = chat_ids(tok, messages + [
        {"role": "assistant", "content": "<think>\nA list will do.\n</think>\n\n" + ANSWER},
        {"role": "user", "content": "Add a size method."}])
    other = chat_ids(tok, [SYSTEM, {"role": "user", "content": "Sort a list."}])
    points = continuation_points(ids, lambda m: chat_ids(tok, m), messages)
    assert points == [shared_length(ids, nxt), shared_length(ids, other)]
    assert tok.decode(ids[points[0]:]) == "<think>\n"
    assert tok.decode(ids[: points[1]]).endswith("<|im_end|>\n<|im_start|>user\n")


def test_a_template_that_refuses_the_probe_gives_no_point():
    def render(messages):
        if messages[-1]["content"] == "x":
            raise ValueError("roles must alternate")
        return [1, 2, 3]

    assert continuation_points([1, 2, 3], render, [SYSTEM, {"role": "user", "content": "q"}]) == []


def test_processors_see_the_cached_tokens_first():
    """A repetition penalty over the rest of the prompt onward, with the cached prompt tokens
    before it, weighs exactly what it weighs over the whole history."""
    earlier, later = [5, 6, 7, 8], mx.array([9, 5, 3])

    def logits():  # (mlx-lm's penalty writes into the logits it is given)
        return mx.arange(16, dtype=mx.float32)[None] / 3

    (penalty,) = make_logits_processors(repetition_penalty=1.5, repetition_context_size=6)
    (wrapped,) = with_history([penalty], earlier)
    want = penalty(mx.array(earlier + [9, 5, 3]), logits())
    assert mx.array_equal(wrapped(later, logits()), want).item()
    assert not mx.array_equal(penalty(later, logits()), want).item()
    assert with_history([penalty], []) == [penalty] and with_history([], earlier) == []


def test_a_request_keeps_checkpoints_once_and_starts_from_the_longest(demo):
    model, tok = demo
    reuse = PromptReuse(model, 10**9)
    prompt = tok.encode("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n")
    first = reuse.open(prompt, [len(prompt), 6])
    assert (first.cached, first.checkpoints) == (0, {len(prompt) - 1: len(prompt) - 1, 5: 5})
    steps = mlx_mtp.generate_step(mx.array(first.rest), model, prompt_cache=first.cache)
    out = [next(steps)[0]]
    reuse.keep_checkpoints(first)
    out += [next(steps)[0] for _ in range(7)]
    steps.close()  # the cache holds the prompt and the 8 tokens read
    reuse.keep_finished(first, out)
    assert [e["tokens"] for e in reuse.store.entries()] == [5, len(prompt) - 1, len(prompt) + 8]

    again = reuse.open(prompt, [len(prompt), 6])  # both checkpoints are kept: none again
    assert (again.cached, again.checkpoints, again.rest) == (len(prompt) - 1, {}, prompt[-1:])
    branch = reuse.open(prompt[:6] + [11, 12, 13], [9])
    assert (branch.cached, branch.checkpoints) == (5, {3: 8})


# ------------------------------------------------------------------------------ the flag


@pytest.mark.parametrize("text, size", [("0", 0), ("4096", 4096), ("512M", 512 * 10**6),
                                        ("1.5G", 15 * 10**8), ("8gb", 8 * 10**9), (" 2K", 2000)])
def test_sizes_in_mlx_lm_servers_units(text, size):
    assert byte_size(text) == size


@pytest.mark.parametrize("text", ["lots", "-1", "1X", "G", "inf", "nan", ""])
def test_a_bad_size_names_what_was_expected(text):
    with pytest.raises(argparse.ArgumentTypeError,
                       match=r"^expected a size in bytes such as 512M or 8G \(0: none\), got "):
        byte_size(text)


def test_where_the_server_keeps_no_prompt_cache(demo):
    model, tok = demo
    off = Engine(model, tok)
    off.start_prompt_cache(0)
    plain = Engine(model, tok, no_mtp=True)
    plain.start_prompt_cache(10**9)
    assert off.prompt_cache_summary() == {"enabled": False,
                                          "reason": "off: --prompt-cache-bytes 0"}
    assert plain.prompt_cache_summary() == {
        "enabled": False, "reason": "off: --no-mtp serves mlx-lm's plain decode"}
    assert off.prompt_cache is plain.prompt_cache is None
    on = Engine(model, tok)
    on.start_prompt_cache(10**9)
    req = GenerationRequest(kind="text", model="", prompt="def f(x):\n", max_tokens=3)
    done = list(on.generate(req, on.prompt_ids(req)))[-1]
    assert on.prompt_cache_summary()["enabled"] and len(on.prompt_cache.store) == 2
    assert (done.cached_tokens, done.mtp["prefilled_tokens"]) == (0, done.prompt_tokens)
