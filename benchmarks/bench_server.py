"""Serving benchmark: ``python -m mlx_mtp.server`` with MTP against the same server with
``--no-mtp`` (mlx-lm's plain decode of the same target), through HTTP with the ``openai`` client.

Both servers run at once (an idle server waits on its queue and uses no CPU). Per prompt,
``--pairs`` alternating streamed requests, one arm then the other (the order flips every pair),
each arm warmed up first: time to first token, client-side decode tok/s (tokens after the first
over the time after the first), the server's own generation tok/s, identical text at T=0. Then
``--clients`` concurrent clients each send ``--requests`` requests to one arm, then to the other:
requests/s and aggregate tokens/s. All of it inside the benchmarks' idle check (refused on a busy
machine unless ``--allow-busy``). Writes benchmark_results/<topic>-<host>-<date>.md and .json.

Each prompt's row carries the share of distinct 4-grams of its output (``distinct_4gram_share``):
the server streams text, not ids, so the plain arm's text is encoded again with the target's
tokenizer (the median over its requests; at T=0 both arms stream the same text).

    python -m benchmarks.bench_server                     # the embedded demo pair
    python -m benchmarks.bench_server --model PATH [--drafter D] --block-size 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks import common
from benchmarks.harness.server_process import ServerProcess

ARMS = ("mtp", "plain")


def stream_once(client, prompt: str, max_tokens: int) -> dict:
    """One streamed completion at T=0: TTFT, decode tok/s, the server's numbers, the text."""
    t0 = time.perf_counter()
    first = last = None
    parts, usage, mtp = [], None, None
    stream = client.completions.create(model="bench", prompt=prompt, max_tokens=max_tokens,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    for chunk in stream:
        now = time.perf_counter()
        for c in chunk.choices:
            if c.text:
                first = first or now
                last = now
                parts.append(c.text)
        if chunk.usage is not None:
            usage, mtp = chunk.usage, chunk.model_extra.get("mtp")
    n = usage.completion_tokens
    decode_s = (last - first) if first is not None and last is not None else 0.0
    return {"text": "".join(parts), "tokens": n, "ttft_ms": 1e3 * ((first or now) - t0),
            "total_s": time.perf_counter() - t0,
            "decode_tps": (n - 1) / decode_s if decode_s > 0 and n > 1 else 0.0,
            "server_generation_tps": mtp["generation_tps"],
            "acceptance_rate": mtp["acceptance_rate"], "tokens_per_round": mtp["tokens_per_round"]}


def latency_pairs(clients: dict, prompts: dict, pairs: int, max_tokens: int) -> dict:
    raw = {arm: [] for arm in ARMS}
    for arm in ARMS:  # warm-up, not counted
        stream_once(clients[arm], next(iter(prompts.values())), max_tokens)
    for name, prompt in prompts.items():
        for i in range(pairs):
            order = ARMS if i % 2 == 0 else ARMS[::-1]
            for arm in order:
                raw[arm].append({"prompt": name, "pair": i,
                                 **stream_once(clients[arm], prompt, max_tokens)})
    return raw


def throughput(client, prompts: list, n_clients: int, per_client: int, max_tokens: int) -> dict:
    def one_client(c):
        return [stream_once(client, prompts[(c + j) % len(prompts)], max_tokens)
                for j in range(per_client)]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(n_clients) as pool:
        results = [r for rs in pool.map(one_client, range(n_clients)) for r in rs]
    wall = time.perf_counter() - t0
    return {"requests": len(results), "wall_s": wall, "requests_per_s": len(results) / wall,
            "tokens_per_s": sum(r["tokens"] for r in results) / wall,
            "median_ttft_ms": statistics.median(r["ttft_ms"] for r in results)}


def text_shares(raw: dict, encode) -> None:
    """Each request's ``distinct_4gram_share``, of its text as ``encode`` (the target's tokenizer)
    gives its ids."""
    for runs in raw.values():
        for r in runs:
            r["distinct_4gram_share"] = common.distinct_ngram_share(encode(r["text"]))


def summarize(raw: dict, prompts: dict) -> list:
    rows = []
    for name in prompts:
        mtp = [r for r in raw["mtp"] if r["prompt"] == name]
        plain = [r for r in raw["plain"] if r["prompt"] == name]
        ratios = [m["decode_tps"] / p["decode_tps"] for m, p in zip(mtp, plain) if p["decode_tps"]]
        shares = [r["distinct_4gram_share"] for r in plain
                  if r.get("distinct_4gram_share") is not None]
        rows.append({
            "prompt": name,
            "distinct_4gram_share": statistics.median(shares) if shares else None,
            "plain_decode_tps": statistics.median(r["decode_tps"] for r in plain),
            "mtp_decode_tps": statistics.median(r["decode_tps"] for r in mtp),
            "ratio_median": statistics.median(ratios) if ratios else None,
            "ratio_min": min(ratios) if ratios else None,
            "ratio_max": max(ratios) if ratios else None,
            "plain_ttft_ms": statistics.median(r["ttft_ms"] for r in plain),
            "mtp_ttft_ms": statistics.median(r["ttft_ms"] for r in mtp),
            "plain_server_tps": statistics.median(r["server_generation_tps"] for r in plain),
            "mtp_server_tps": statistics.median(r["server_generation_tps"] for r in mtp),
            "acceptance": statistics.median(r["acceptance_rate"] or 0.0 for r in mtp),
            "tokens_per_round": statistics.median(r["tokens_per_round"] or 0.0 for r in mtp),
            "identical_text": all(m["text"] == p["text"] for m, p in zip(mtp, plain)),
        })
    return rows


def _f(v, fmt=".1f"):
    return "n/a" if v is None else format(v, fmt)


def render(r: dict) -> str:
    lines = common.setup_lines(r) + [
        f"- Servers: `python -m mlx_mtp.server {' '.join(r['server_args']['mtp'])}` and "
        f"`... {' '.join(r['server_args']['plain'])}`",
        f"- Prompts: {', '.join(r['prompts'])}; max_tokens {r['max_tokens']} (EOS ends a "
        f"request, in both arms at the same token at T=0), T=0, streamed; {r['pairs']} "
        "alternating pairs per prompt after one warm-up request per arm",
        f"- MTP server: {r['gate']['mtp']}", "",
        "## Single client: decode speed and time to first token", "",
        "| prompt | distinct 4-grams | plain tok/s | MTP tok/s | ratio (median, min-max) | "
        "plain TTFT ms | MTP TTFT ms | server tok/s plain / MTP | acceptance | tokens/round | "
        "same text |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        lines.append(
            f"| {row['prompt']} | {_f(row.get('distinct_4gram_share'), '.2f')} | "
            f"{_f(row['plain_decode_tps'])} | {_f(row['mtp_decode_tps'])} | "
            f"{_f(row['ratio_median'], '.2f')}x ({_f(row['ratio_min'], '.2f')}-"
            f"{_f(row['ratio_max'], '.2f')}) | {_f(row['plain_ttft_ms'])} | "
            f"{_f(row['mtp_ttft_ms'])} | {_f(row['plain_server_tps'])} / "
            f"{_f(row['mtp_server_tps'])} | {_f(row['acceptance'], '.3f')} | "
            f"{_f(row['tokens_per_round'], '.2f')} | {'yes' if row['identical_text'] else 'NO'} |")
    t = r["throughput"]
    lines += [
        "", f"## {r['clients']} concurrent clients ({r['requests_per_client']} requests each, "
        "one decode at a time)", "",
        "| arm | requests/s | tokens/s | median TTFT ms | wall s |", "|---|---|---|---|---|",
    ]
    for arm in ARMS:
        a = t[arm]
        lines.append(f"| {arm} | {a['requests_per_s']:.2f} | {a['tokens_per_s']:.1f} | "
                     f"{a['median_ttft_ms']:.0f} | {a['wall_s']:.1f} |")
    lines.append(f"\nrequests/s ratio MTP / plain: "
                 f"{t['mtp']['requests_per_s'] / t['plain']['requests_per_s']:.2f}x")
    lines += common.what_it_says(r)
    return "\n".join(lines)


def target_encoder(model):
    """``text -> ids`` of the target's tokenizer (``model``, or the embedded demo pair), without
    loading its weights."""
    import mlx_mtp  # noqa: F401  (first: binds the system BLAS before mlx.core loads)
    from mlx_mtp.demo import demo_path
    from mlx_mtp.io.checkpoint import load_tokenizer, resolve_path

    tokenizer = load_tokenizer(resolve_path(model) if model else demo_path())
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="mlx_mtp.server with MTP vs --no-mtp, through HTTP")
    p.add_argument("--model", help="target (default: the embedded demo pair)")
    p.add_argument("--drafter")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--topic", default="server-demo-pair")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--requests", type=int, default=3, help="requests per concurrent client")
    common.add_record_args(p)
    args = p.parse_args(argv)
    import openai

    both = []  # the flags both servers get
    if args.model:
        both += ["--model", args.model]
    if args.drafter:
        both += ["--drafter", args.drafter]
    server_args = {"mtp": both + (["--block-size", str(args.block_size)]
                                  if args.block_size else []),
                   "plain": both + ["--no-mtp"]}
    queue = str(max(args.clients, 1))
    servers = {}
    # The servers are this process's children: the idle check counts them as the run's own CPU.
    watch = common.watch(args)
    try:
        for arm in ARMS:
            servers[arm] = ServerProcess(*server_args[arm], "--max-queue", queue,
                                         "--log-level", "warning")
        clients = {arm: openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0,
                                      timeout=600) for arm, s in servers.items()}
        gate = {arm: s.get("/health")["gate_reason"] for arm, s in servers.items()}
        prompts = common.DEFAULT_PROMPTS
        raw = latency_pairs(clients, prompts, args.pairs, args.max_tokens)
        tput = {arm: throughput(clients[arm], list(prompts.values()), args.clients,
                                args.requests, args.max_tokens) for arm in ARMS}
    finally:
        for s in servers.values():
            s.stop()
    text_shares(raw, target_encoder(args.model))
    result = common.record_setup(args.topic)
    result.update(model=args.model or "embedded demo pair", drafter=args.drafter,
                  server_args=server_args, prompts=prompts, max_tokens=args.max_tokens,
                  pairs=args.pairs, clients=args.clients, requests_per_client=args.requests,
                  gate=gate, rows=summarize(raw, prompts), throughput=tput, raw=raw,
                  summary=args.summary)
    return common.finish(args, result, watch, render, "server")


if __name__ == "__main__":
    main()
