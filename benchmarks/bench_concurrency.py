"""Serving under concurrency: per-request and aggregate tok/s at C concurrent clients for
``mlx_mtp.server`` with batched rounds, the same server one request at a time
(``--max-batch 1``), and ``mlx_lm.server`` (plain decode, which batches across requests), on the
same checkpoint, in one run.

The three servers run at once (an idle server waits on its queue and uses no CPU). For each C
above 1 the arms take turns (the order rotates with C); each of the C clients sends ``--requests``
completions at T=0, each prompt its own (every client's prompt differs). At C=1 the arms alternate
request by request (the order rotating with the request), so that each prompt's requests to the
three servers run side by side in time, and the record adds each arm's per-request time over the
serial server's on the same prompt, paired (median, min-max). Per arm and C: the
aggregate tok/s (completion tokens over the wall time), the median per-request tok/s
(completion tokens over the request's time, queueing included), and whether every text equals
the serial server's text for the same prompt (it decodes each request alone). Writes benchmark_results/<topic>-<host>-<date>.md and .json.

    python -m benchmarks.bench_concurrency --model PATH --block-size 3
    python -m benchmarks.bench_concurrency --render RECORD.json --summary "..."   # no run
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks import common
from benchmarks.harness.server_process import ServerProcess, free_port

ARMS = ("batched", "serial", "mlx_lm")
LABELS = {"batched": "mlx_mtp.server (batched)", "serial": "mlx_mtp.server --max-batch 1",
          "mlx_lm": "mlx_lm.server"}


# mlx_lm.server with the system BLAS mlx_mtp binds (importing mlx_mtp first does it): on Linux
# its own process would run MLX's bundled reference BLAS, many times slower.
MLX_LM_SERVER = ("import mlx_mtp, runpy, sys; sys.argv[0] = 'mlx_lm.server'; "
                 "runpy.run_module('mlx_lm.server', run_name='__main__')")


class MlxLmServer:
    """``python -m mlx_lm.server`` (``MLX_LM_SERVER``) on a free port with ``args`` after
    ``--model``, up once its /v1/models answers."""

    def __init__(self, model: str, *args: str, startup_timeout: float = 600.0):
        import urllib.request

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-c", MLX_LM_SERVER, "--model", model,
                                      *args, "--port", str(self.port), "--log-level", "WARNING"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlx_lm.server exited with {self.proc.returncode}")
            try:
                urllib.request.urlopen(self.url + "/v1/models", timeout=5)
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("mlx_lm.server did not come up")
                time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def prompts_for(n: int) -> list:
    """``n`` different prompts (the default set's openings, numbered)."""
    base = list(common.DEFAULT_PROMPTS.values())
    return [f"{base[i % len(base)]} {i}" for i in range(n)]


def one_request(client, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    r = client.completions.create(model="default_model", prompt=prompt, max_tokens=max_tokens,
                                  temperature=0)
    seconds = time.perf_counter() - t0
    n = r.usage.completion_tokens
    return {"prompt": prompt, "text": r.choices[0].text, "tokens": n, "seconds": seconds,
            "tps": n / seconds}


def level(client, prompts: list, clients: int, per_client: int, max_tokens: int) -> dict:
    """``clients`` concurrent clients, ``per_client`` requests each (client c sends prompts
    c, c + clients, ...)."""
    def one_client(c):
        return [one_request(client, prompts[c + j * clients], max_tokens)
                for j in range(per_client)]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(one_client, range(clients)) for r in rs]
    return run_summary(results, time.perf_counter() - t0)


def run_summary(results: list, wall: float) -> dict:
    """One arm's run at one level: its requests and ``wall`` seconds."""
    tokens = sum(r["tokens"] for r in results)
    return {"wall_s": wall, "tokens": tokens, "aggregate_tps": tokens / wall,
            "per_request_tps": statistics.median(r["tps"] for r in results),
            "requests": results}


def alternating(clients: dict, prompts: list, requests: int, max_tokens: int) -> dict:
    """One client, ``requests`` prompts: each prompt sent to every arm in turn (the order
    rotating with the prompt), so a drift in the machine's speed falls on every arm alike.
    Per arm the shape of ``level``'s result, its wall time the sum of its requests' times."""
    results = {arm: [] for arm in clients}
    arms = list(clients)
    for j in range(requests):
        order = arms[j % len(arms):] + arms[: j % len(arms)]
        for arm in order:
            results[arm].append(one_request(clients[arm], prompts[j], max_tokens))
    return {arm: {**run_summary(rs, sum(r["seconds"] for r in rs)), "alternating": True}
            for arm, rs in results.items()}


def paired_to_serial(raw: dict, arm: str, clients: int = 1):
    """``arm``'s tok/s over the serial server's on the same prompt, per request of an
    alternating level: (median, min, max), or None where the level did not alternate."""
    run, serial = raw[arm].get(str(clients)), raw["serial"].get(str(clients))
    if not run or not run.get("alternating"):
        return None
    by_prompt = {r["prompt"]: r["tps"] for r in serial["requests"]}
    ratios = [r["tps"] / by_prompt[r["prompt"]] for r in run["requests"]
              if r["prompt"] in by_prompt]
    return statistics.median(ratios), min(ratios), max(ratios)


def summarize(raw: dict, levels: list) -> list:
    # the serial server decodes each request alone: its texts are the solo texts
    solo = {r["prompt"]: r["text"] for run in raw["serial"].values() for r in run["requests"]}
    rows = []
    for c in levels:
        for arm in ARMS:
            run = raw[arm][str(c)]
            compared = [r for r in run["requests"] if r["prompt"] in solo]
            # mlx_lm.server drops a last, not yet decodable byte sequence that mlx_mtp's server
            # streams: its texts are compared as prefixes of the solo texts
            same = ((lambda r: solo[r["prompt"]].startswith(r["text"])) if arm == "mlx_lm"
                    else (lambda r: r["text"] == solo[r["prompt"]]))
            rows.append({
                "clients": c, "arm": arm, "aggregate_tps": run["aggregate_tps"],
                "per_request_tps": run["per_request_tps"], "wall_s": run["wall_s"],
                "tokens": run["tokens"],
                "texts_equal_solo": all(same(r) for r in compared) if compared else None,
            })
    return rows


def render(r: dict) -> str:
    lines = common.setup_lines(r) + [
        f"- Model: {r['model']}; T=0; max_tokens {r['max_tokens']}; {r['requests_per_client']} "
        "request(s) per client, every prompt different; all three servers up at once, the arms "
        "taking turns at each C (at C=1 request by request, each prompt sent to every server "
        "in turn)",
        *(f"- {LABELS[a]}: `{' '.join(r['server_args'][a])}`" for a in ARMS),
        f"- Batch: {r['batch']}",
        "- Texts are compared with the serial server's, which decodes each request alone "
        "(mlx_lm.server's as prefixes: it drops a last partial character that mlx_mtp streams)",
        "",
        "## Aggregate and per-request tok/s", "",
        "| C | arm | aggregate tok/s | per-request tok/s (median) | wall s | texts equal solo |",
        "|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        same = {True: "yes", False: "NO", None: "n/a"}[row["texts_equal_solo"]]
        lines.append(f"| {row['clients']} | {LABELS[row['arm']]} | {row['aggregate_tps']:.1f} | "
                     f"{row['per_request_tps']:.1f} | {row['wall_s']:.1f} | {same} |")
    by = {(row["clients"], row["arm"]): row for row in r["rows"]}
    lines += ["", "## Ratios", "",
              "| C | batched / its own C=1 aggregate | batched / mlx_lm.server | "
              "batched / serial |", "|---|---|---|---|"]
    one = by[(r["levels"][0], "batched")]["aggregate_tps"]
    for c in r["levels"]:
        b = by[(c, "batched")]["aggregate_tps"]
        lines.append(f"| {c} | {b / one:.2f}x | {b / by[(c, 'mlx_lm')]['aggregate_tps']:.2f}x | "
                     f"{b / by[(c, 'serial')]['aggregate_tps']:.2f}x |")
    paired = [(arm, paired_to_serial(r["raw"], arm)) for arm in ("batched", "mlx_lm")]
    if any(p is not None for _, p in paired):
        lines += ["", "## One client, paired by prompt", "",
                  "Each request's tok/s over the serial server's on the same prompt (the arms "
                  "alternate request by request): median (min-max) over the prompts.", "",
                  "| arm | per-request tok/s / serial's, paired |", "|---|---|"]
        lines += [f"| {LABELS[arm]} | {p[0]:.3f}x ({p[1]:.3f}-{p[2]:.3f}) |"
                  for arm, p in paired if p is not None]
    lines += common.what_it_says(r)
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="aggregate tok/s under C concurrent clients")
    p.add_argument("--model", help="target folder with its MTP head (required unless --render)")
    p.add_argument("--block-size", default="3")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--levels", default="1,4,8,16", help="concurrent clients, comma separated")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=1, help="requests per client")
    p.add_argument("--topic", default="concurrency-realistic-pair")
    common.add_render_arg(p)
    common.add_record_args(p)
    args = p.parse_args(argv)
    rendered = common.render_instead(args, p, render, "concurrency")
    if rendered is not None:
        return rendered
    import openai

    levels = [int(x) for x in args.levels.split(",")]
    if levels[0] != 1:
        sys.exit("error: --levels must start with 1 (the ratios are to C=1)")
    most = max(levels)
    server_args = {
        "batched": ["--model", args.model, "--block-size", args.block_size,
                    "--max-batch", str(args.max_batch), "--max-queue", str(most)],
        "serial": ["--model", args.model, "--block-size", args.block_size,
                   "--max-batch", "1", "--max-queue", str(most)],
        "mlx_lm": ["python -m mlx_lm.server (system BLAS bound as mlx_mtp binds it)", "--model",
                   args.model],
    }
    servers = {}
    watch = common.watch(args)
    try:
        for arm in ("batched", "serial"):
            servers[arm] = ServerProcess(*server_args[arm], "--log-level", "warning",
                                         startup_timeout=1200)
        servers["mlx_lm"] = MlxLmServer(args.model)
        clients = {arm: openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0,
                                      timeout=3600) for arm, s in servers.items()}
        batch = servers["batched"].get("/health")["batch"]
        prompts = prompts_for(most * args.requests)
        for arm in ARMS:  # warm-up, not counted
            one_request(clients[arm], "warm up", 4)
        raw = {arm: {} for arm in ARMS}
        for i, c in enumerate(levels):
            if c == 1:
                for arm, run in alternating(clients, prompts, args.requests,
                                            args.max_tokens).items():
                    raw[arm]["1"] = run
                continue
            order = ARMS[i % 3:] + ARMS[: i % 3]
            for arm in order:
                raw[arm][str(c)] = level(clients[arm], prompts, c, args.requests,
                                         args.max_tokens)
    finally:
        for s in servers.values():
            s.stop()
    result = common.record_setup(args.topic)
    result.update(model=args.model, server_args=server_args, max_tokens=args.max_tokens,
                  requests_per_client=args.requests, levels=levels, batch=batch,
                  rows=summarize(raw, levels), raw=raw)
    return common.finish(args, result, watch, render, "concurrency")


if __name__ == "__main__":
    main()
