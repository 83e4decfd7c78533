"""A chat as chat apps and coding agents send it: every turn resends the whole conversation (the
system message, the user messages so far, the server's own earlier answers) through the ``openai``
client, streamed at T=0. Each user message pastes the next lines of a source file, so the prompt
grows to thousands of tokens over ``--turns`` turns.

Every server renders the chat with ``--template``'s layout: ``chatml`` (default) gives each
server ChatML, the layout of Qwen's chat templates, through ``--chat-template`` (``CHATML``: with
a space before an answer, for the biased answers below); ``own`` keeps the tokenizer's (mlx-lm's
plain layout where it has none, which puts a space before each re-rendered answer, so no answer
is reused). With ``--answers words`` (default) every request
adds ``logit_bias`` +100 on up to 2000 of the tokenizer's whole-word tokens (a space and letters,
each one token that re-encodes to itself): a random pair then writes words, which the next turn
renders back as the ids it wrote, as a trained model's text is; ``free`` leaves the answers to
the model (a random pair's ids mostly decode to ``<xN>`` text, about five tokens each when
re-encoded, which no cache can serve).

Three servers on one checkpoint, up at once: ``mlx_mtp.server`` with its prompt cache
(``cached``), the same with ``--prompt-cache-bytes 0`` (``cold``) and ``mlx_lm.server`` (plain
decode, its own LRU prompt cache). The arms take turns, turn by turn, each following its own
conversation. Per turn and arm: time to first token, decode tok/s after the first token, the prompt
tokens served from a cache and those prefilled, whether the text equals the cold server's.
Writes benchmark_results/<topic>-<host>-<date>.md and .json.

    python -m benchmarks.bench_conversation --model PATH
    python -m benchmarks.bench_conversation --render RECORD.json --summary "..."   # no run
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import mlx_mtp  # noqa: F401  (first: binds the system BLAS before mlx.core loads)
from benchmarks import common
from benchmarks.bench_concurrency import MlxLmServer
from benchmarks.harness.server_process import ServerProcess

ARMS = ("cached", "cold", "mlx_lm")
LABELS = {"cached": "mlx_mtp.server (prompt cache)",
          "cold": "mlx_mtp.server --prompt-cache-bytes 0", "mlx_lm": "mlx_lm.server"}
SYSTEM = ("You are a senior Python engineer reviewing a colleague's code. Each message pastes the "
          "next part of the file; explain what it does and point out anything to fix, briefly.")
QUESTIONS = ("What does this part do?", "Anything to fix here?", "How would you test this?",
             "Can this be simpler?", "What are the edge cases?")
# What the prompt cache is for: the last turn's time to first token at most this share of the
# cold server's, and the later half of the turns served at least this share of their prompt
# from the cache (the record says whether the run met them).
TTFT_GOAL = 0.2
CACHED_GOAL = 0.9
# ChatML, with a space before an answer's text: the biased answers' words each begin with a
# space, and mlx-lm's streaming detokenizer (both servers') drops the first one's, so the
# template puts it back, as Llama 2's and Mistral's templates put a space before an answer.
CHATML = ("{% for message in messages %}<|im_start|>{{ message.role }}\n"
          "{% if message.role == 'assistant' %} {% endif %}{{ message.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORD_BIAS, MAX_WORDS = 100.0, 2000
SOURCE = "argparse.py"  # of the standard library: the same text on every machine of one Python


def source_lines() -> list:
    """The pasted file's lines (blank lines dropped)."""
    import argparse as pasted

    return [line for line in Path(pasted.__file__).read_text().splitlines() if line.strip()]


def user_messages(turns: int, paste_lines: int) -> list:
    """Turn i's user message: a question, then the file's next ``paste_lines`` lines as code."""
    lines = source_lines()
    out = []
    for i in range(turns):
        part = lines[(i * paste_lines) % len(lines):][:paste_lines]
        out.append(f"{QUESTIONS[i % len(QUESTIONS)]}\n\n```python\n" + "\n".join(part) + "\n```")
    return out


def word_bias(model: str) -> dict:
    """``logit_bias`` +``WORD_BIAS`` on the tokenizer's first ``MAX_WORDS`` whole-word tokens: a
    space then letters, which the tokenizer encodes back to that one token."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(Path(model))
    words = {}
    for i in range(tok.vocab_size):
        text = tok.decode([i])
        if len(text) > 2 and text[0] == " " and text[1:].isascii() and text[1:].isalpha() \
                and tok.encode(text, add_special_tokens=False) == [i]:
            words[str(i)] = WORD_BIAS
            if len(words) == MAX_WORDS:
                break
    if not words:
        raise SystemExit(f"error: --answers words: {model}'s tokenizer has no whole-word tokens")
    return words


def stream_turn(client, messages: list, max_tokens: int, logit_bias=None) -> dict:
    """One streamed chat completion at T=0: TTFT, decode tok/s, the text and the usage."""
    t0 = time.perf_counter()
    first = last = None
    parts, usage, mtp = [], None, None
    stream = client.chat.completions.create(model="default_model", messages=messages,
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            **({"logit_bias": logit_bias} if logit_bias else {}))
    for chunk in stream:
        now = time.perf_counter()
        for c in chunk.choices:
            # mlx_lm.server streams a thinking template's reasoning apart from the content
            text = (c.delta.content or "") + ((c.delta.model_extra or {}).get("reasoning") or "")
            if text:
                first = first or now
                last = now
                parts.append(c.delta.content or "")
        if chunk.usage is not None:
            usage, mtp = chunk.usage, (chunk.model_extra or {}).get("mtp")
    n = usage.completion_tokens
    details = usage.prompt_tokens_details
    decode_s = (last - first) if first is not None else 0.0
    return {"text": "".join(parts), "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": details.cached_tokens if details is not None else None,
            "prefilled_tokens": mtp["prefilled_tokens"] if mtp else None,
            "completion_tokens": n, "ttft_ms": 1e3 * ((first or now) - t0),
            "total_s": time.perf_counter() - t0,
            "decode_tps": (n - 1) / decode_s if decode_s > 0 and n > 1 else 0.0}


def conversation(clients: dict, users: list, max_tokens: int, system: str,
                 logit_bias=None) -> dict:
    """Every arm's conversation, turn by turn, the arms taking turns (the order rotating with the
    turn); each arm resends its own earlier answers. Per arm its turns, in order."""
    history = {arm: [{"role": "system", "content": system}] for arm in clients}
    turns = {arm: [] for arm in clients}
    arms = list(clients)
    for i, user in enumerate(users):
        for arm in arms[i % len(arms):] + arms[: i % len(arms)]:
            history[arm].append({"role": "user", "content": user})
            turn = stream_turn(clients[arm], history[arm], max_tokens, logit_bias)
            history[arm].append({"role": "assistant", "content": turn["text"]})
            turns[arm].append({"turn": i + 1, **turn})
    return turns


def summarize(raw: list) -> list:
    """Per turn and arm: the medians over the repeats, and whether every repeat's text equals
    the cold server's (mlx_lm.server's as a prefix: it drops a last partial character that
    mlx_mtp streams)."""
    rows = []
    for t in range(len(raw[0]["cold"])):
        for arm in ARMS:
            runs = [rep[arm][t] for rep in raw]
            cold = [rep["cold"][t]["text"] for rep in raw]
            same = [(c.startswith(r["text"]) if arm == "mlx_lm" else r["text"] == c)
                    for r, c in zip(runs, cold)]

            def med(key):
                values = [r[key] for r in runs if r[key] is not None]
                return statistics.median(values) if values else None

            rows.append({"turn": t + 1, "arm": arm, "prompt_tokens": med("prompt_tokens"),
                         "cached_tokens": med("cached_tokens"),
                         "prefilled_tokens": med("prefilled_tokens"),
                         "completion_tokens": med("completion_tokens"), "ttft_ms": med("ttft_ms"),
                         "decode_tps": med("decode_tps"), "same_text_as_cold": all(same)})
    return rows


def _share(row):
    """The share of a turn's prompt served from the cache."""
    if row["cached_tokens"] is None or not row["prompt_tokens"]:
        return None
    return row["cached_tokens"] / row["prompt_tokens"]


def _layout_lines(r: dict) -> list:
    """The chat layout and the answers' bias (none for a record without these fields)."""
    if "template" not in r:
        return []
    layout = ("ChatML through --chat-template (CHATML below)" if r["template"] == "chatml"
              else "the tokenizer's own")
    answers = (f"logit_bias +{WORD_BIAS:.0f} on {r['word_tokens']} whole-word tokens, so the "
               "answers are words that re-encode to the ids written" if r["answers"] == "words"
               else "the model's own choice")
    out = [f"- Chat layout: {layout}; answers: {answers}"]
    if r.get("chat_template"):
        out.append(f"- CHATML: `{r['chat_template']!r}`")
    return out


def _f(v, fmt=".0f"):
    return "n/a" if v is None else format(v, fmt)


def render(r: dict) -> str:
    lines = common.setup_lines(r) + [
        f"- Model: {r['model']}" + (f", drafter {r['drafter']}" if r.get("drafter") else ""),
        f"- Conversation: {r['turns']} turns, each user message a question and the next "
        f"{r['paste_lines']} lines of {r['source']}, streamed at T=0, max_tokens "
        f"{r['max_tokens']}; every turn resends the whole conversation with the arm's own "
        f"answers; {r['repeats']} repeat(s), each with its own system message (medians)",
        *_layout_lines(r),
        *(f"- {LABELS[a]}: `{' '.join(r['server_args'][a])}`" for a in ARMS),
        "- The arms take turns, the order rotating with the turn; one warm-up request each",
        "", "## Per turn", "",
        "| turn | prompt tokens | cached: from cache | share | cached: TTFT ms | cold: TTFT ms | "
        "mlx_lm: from cache | mlx_lm: TTFT ms | tok/s cached / cold / mlx_lm | same text |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    by = {(row["turn"], row["arm"]): row for row in r["rows"]}
    for t in range(1, r["turns"] + 1):
        c, k, m = by[(t, "cached")], by[(t, "cold")], by[(t, "mlx_lm")]
        same = "yes" if all(x["same_text_as_cold"] for x in (c, m)) else "NO"
        lines.append(
            f"| {t} | {_f(c['prompt_tokens'])} | {_f(c['cached_tokens'])} | "
            f"{_f(_share(c), '.0%')} | {_f(c['ttft_ms'])} | "
            f"{_f(k['ttft_ms'])} | {_f(m['cached_tokens'])} | {_f(m['ttft_ms'])} | "
            f"{_f(c['decode_tps'], '.1f')} / {_f(k['decode_tps'], '.1f')} / "
            f"{_f(m['decode_tps'], '.1f')} | {same} |")
    last = r["turns"]
    ttft = {arm: by[(last, arm)]["ttft_ms"] for arm in ARMS}
    total = {arm: sum(by[(t, arm)]["ttft_ms"] for t in range(1, last + 1)) for arm in ARMS}
    lines += ["", "## Time to first token", "",
              "| arm | last turn ms | all turns s | last turn / cold | all turns / cold |",
              "|---|---|---|---|---|"]
    for arm in ARMS:
        lines.append(f"| {LABELS[arm]} | {ttft[arm]:.0f} | {total[arm] / 1e3:.1f} | "
                     f"{ttft[arm] / ttft['cold']:.2f}x | {total[arm] / total['cold']:.2f}x |")
    ratio = ttft["cached"] / ttft["cold"]
    lines += ["", f"Turn {last}'s time to first token with the prompt cache is {ratio:.2f}x the "
              f"cold server's: the goal of at most {TTFT_GOAL}x is "
              f"{'met' if ratio <= TTFT_GOAL else 'NOT met'}."]
    later = range(last // 2 + 1, last + 1)
    shares = [_share(by[(t, "cached")]) for t in later]
    if later and None not in shares:
        lines += ["", f"Turns {later[0]}-{later[-1]} take {min(shares):.0%} to "
                  f"{max(shares):.0%} of their prompt from the cache: the goal of at least "
                  f"{CACHED_GOAL:.0%} is {'met' if min(shares) >= CACHED_GOAL else 'NOT met'}."]
    lines += common.what_it_says(r)
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="a growing chat with and without the prompt cache, "
                                            "and against mlx_lm.server")
    p.add_argument("--model", help="target folder with its MTP head (required unless --render)")
    p.add_argument("--drafter")
    p.add_argument("--block-size", default="auto")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--paste-lines", type=int, default=25,
                   help=f"lines of {SOURCE} each user message pastes")
    p.add_argument("--max-tokens", type=int, default=256, help="each answer's max_tokens")
    p.add_argument("--repeats", type=int, default=1,
                   help="whole conversations, each with its own system message")
    p.add_argument("--template", choices=("chatml", "own"), default="chatml",
                   help="the chat layout every server renders: ChatML through --chat-template "
                        "(default), or the tokenizer's own")
    p.add_argument("--answers", choices=("words", "free"), default="words",
                   help="words: logit_bias on whole-word tokens, so answers re-encode to the "
                        "ids written (default); free: the model's own choice")
    p.add_argument("--prompt-cache-bytes", default=None,
                   help="the cached server's bound (default: the server's)")
    p.add_argument("--topic", default="conversation-realistic-pair")
    common.add_render_arg(p)
    common.add_record_args(p)
    args = p.parse_args(argv)
    rendered = common.render_instead(args, p, render, None)
    if rendered is not None:
        return rendered
    for flag, value in (("--turns", args.turns), ("--paste-lines", args.paste_lines),
                        ("--max-tokens", args.max_tokens), ("--repeats", args.repeats)):
        if value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    import openai

    template = ["--chat-template", CHATML] if args.template == "chatml" else []
    shown = ["--chat-template", "CHATML"] if template else []  # the record holds the text
    mtp_args = ["--model", args.model, "--block-size", args.block_size]
    if args.drafter:
        mtp_args += ["--drafter", args.drafter]
    server_args = {
        "cached": mtp_args + (["--prompt-cache-bytes", args.prompt_cache_bytes]
                              if args.prompt_cache_bytes else []),
        "cold": mtp_args + ["--prompt-cache-bytes", "0"],
        "mlx_lm": ["--model", args.model],
    }
    users = user_messages(args.turns, args.paste_lines)
    bias = word_bias(args.model) if args.answers == "words" else None
    servers = {}
    watch = common.watch(args)
    try:
        for arm in ("cached", "cold"):
            servers[arm] = ServerProcess(*server_args[arm], *template, "--log-level", "warning",
                                         startup_timeout=1200)
        servers["mlx_lm"] = MlxLmServer(args.model, *template)
        clients = {arm: openai.OpenAI(base_url=servers[arm].url + "/v1", api_key="none",
                                      max_retries=0, timeout=3600) for arm in ARMS}
        for arm in ARMS:  # warm-up, not counted
            stream_turn(clients[arm], [{"role": "user", "content": "warm up"}], 4)
        raw = [conversation(clients, users, args.max_tokens, f"(Review {k + 1}.) {SYSTEM}",
                            bias) for k in range(args.repeats)]
    finally:
        for s in servers.values():
            s.stop()
    server_args = {arm: a + shown for arm, a in server_args.items()}
    server_args["mlx_lm"] = ["python -m mlx_lm.server (system BLAS bound as mlx_mtp binds it)",
                             *server_args["mlx_lm"]]
    result = common.record_setup(args.topic)
    result.update(model=args.model, drafter=args.drafter, server_args=server_args,
                  turns=args.turns, paste_lines=args.paste_lines, source=SOURCE,
                  max_tokens=args.max_tokens, repeats=args.repeats, template=args.template,
                  chat_template=CHATML if template else None, answers=args.answers,
                  word_tokens=len(bias or {}), users=users, rows=summarize(raw), raw=raw)
    return common.finish(args, result, watch, render, None)


if __name__ == "__main__":
    main()
