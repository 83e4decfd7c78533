"""The command line: load once, warm up, serve with uvicorn on 127.0.0.1 by default."""

from __future__ import annotations

import logging
import os
import signal
import sys

import mlx_mtp  # noqa: F401  (first: binds the system BLAS before mlx.core loads)
from mlx_mtp import MTPError
from mlx_mtp import cli
from mlx_mtp.demo import DEMO_DECODE, DEMO_MODEL_ID, model_or_demo, repetition_settings
from mlx_mtp.decoding.limits import DEFAULT_MAX_BATCH
from mlx_mtp.models.distributed import SPLITS, init_split

DEFAULT_MAX_QUEUE = 16
DEFAULT_PROMPT_CACHE_BYTES = "4G"  # the caches kept across requests (docs/server.md)
# On SIGTERM/Ctrl-C, requests still open after this long are cut (a decode may run for minutes).
GRACEFUL_SHUTDOWN_S = 3


def build_parser() -> cli.Parser:
    p = cli.Parser(prog="python -m mlx_mtp.server",
                   description="OpenAI-compatible HTTP server (and Anthropic Messages API) "
                               "decoding with MTP (exact at T=0). No authentication: it binds "
                               "127.0.0.1 unless --host says otherwise.")
    p.add_argument("--model", help="local folder or Hugging Face repo id of the target "
                   "(default: the embedded demo pair)")
    p.add_argument("--drafter",
                   help="folder or repo id of a separate MTP head or Gemma 4 assistant")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=cli.non_negative_int, default=8080,
                   help="port (default: 8080)")
    # --block-size ... --draft-bf16, as the CLI's; the acceptance rule is for requests at
    # temperature > 0
    cli.add_speculation_args(p)
    p.add_argument("--max-queue", type=cli.positive_int, default=DEFAULT_MAX_QUEUE,
                   help="requests that may wait while one decodes; more get 429 "
                        f"(default: {DEFAULT_MAX_QUEUE})")
    p.add_argument("--max-batch", type=cli.positive_int, default=DEFAULT_MAX_BATCH,
                   help="most requests decoded together in one batched round; 1 serves one "
                        f"request at a time (default: {DEFAULT_MAX_BATCH})")
    p.add_argument("--prompt-cache-bytes", type=cli.byte_size, default=None, metavar="SIZE",
                   help="keep the caches of recent requests up to this many bytes (e.g. 512M, "
                        "8G; least recently used evicted), so a prompt that starts as a kept "
                        "one prefills only the rest; 0 turns it off "
                        f"(default: {DEFAULT_PROMPT_CACHE_BYTES})")
    p.add_argument("--chat-template", type=cli.chat_template, default=None, metavar="TEMPLATE",
                   help="a Jinja chat template (or a file holding one) in place of the "
                        "tokenizer's, as mlx_lm.server's flag; tool calls are parsed as its "
                        "format says")
    p.add_argument("--chat-template-args", type=cli.json_object, default=None, metavar="JSON",
                   help="arguments every chat's template gets, as mlx_lm.server's flag, e.g. "
                        "'{\"enable_thinking\": false}'; a request's chat_template_kwargs "
                        "override them")
    p.add_argument("--no-mtp", action="store_true",
                   help="serve mlx-lm's plain decode of the same target, for comparison")
    p.add_argument("--split", choices=SPLITS, default=None,
                   help="split the target over the processes mlx.launch started: pipeline "
                        "(layers) or tensor (heads); rank 0 serves HTTP, the others follow it")
    # Defaults for fields a request leaves out, as mlx_lm.server's flags.
    p.add_argument("--max-tokens", type=cli.positive_int, default=512,
                   help="default max_tokens (default: 512)")
    p.add_argument("--temp", type=cli.temperature, default=0.0, help="default temperature (0.0)")
    p.add_argument("--top-p", type=cli.unit_interval, default=1.0, help="default top_p (1.0)")
    p.add_argument("--top-k", type=cli.non_negative_int, default=0, help="default top_k (0: off)")
    p.add_argument("--min-p", type=cli.unit_interval, default=0.0, help="default min_p (0.0)")
    p.add_argument("--repetition-penalty", type=cli.non_negative_float, default=None,
                   help=f"default repetition_penalty (0: off; with the demo pair "
                        f"{DEMO_DECODE.repetition_penalty})")
    p.add_argument("--repetition-context-size", type=cli.positive_int, default=None,
                   help=f"default repetition_context_size (20; with the demo pair "
                        f"{DEMO_DECODE.repetition_context_size})")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error", "critical"])
    return p


def _repetition_defaults(args) -> dict:
    """The requests' default repetition penalty (``mlx_mtp.demo.repetition_settings``; off is
    0.0 in a request, as mlx_lm.server's)."""
    penalty, context = repetition_settings(args.model, args.repetition_penalty,
                                           args.repetition_context_size)
    return {"repetition_penalty": 0.0 if penalty is None else penalty,
            "repetition_context_size": context}


def _prompt_cache_bytes(args) -> int:
    """``--prompt-cache-bytes``, or its default; refused where nothing could be kept."""
    if args.prompt_cache_bytes is None:
        return cli.byte_size(DEFAULT_PROMPT_CACHE_BYTES)
    if args.prompt_cache_bytes > 0 and args.no_mtp:
        raise MTPError("--prompt-cache-bytes: --no-mtp serves without a prompt cache (every "
                       "prompt is prefilled in full); leave the flag out or pass 0")
    return args.prompt_cache_bytes


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import uvicorn

        from mlx_mtp.server.app import build_app
    except ImportError as e:
        sys.stderr.write(f"error: mlx_mtp.server needs the server extra "
                         f"(pip install 'mlx-mtp[server]'): {e}\n")
        return 1
    from mlx_mtp.server.engine import Engine
    from mlx_mtp.server.schema import Defaults
    from mlx_mtp.server.worker import Worker

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    try:
        prompt_cache_bytes = _prompt_cache_bytes(args)
        model = model_or_demo(args.model, args.drafter)
        speculation, draft_options = cli.speculation_options(args)
        split = init_split(args.split, program="mlx_mtp.server") if args.split else None
    except MTPError as e:
        sys.stderr.write(f"error: {e}\n")
        return 1

    def load():
        return Engine.load(model, drafter=args.drafter, no_mtp=args.no_mtp,
                           speculation=speculation, draft_options=draft_options, split=split,
                           chat_template=args.chat_template,
                           chat_template_args=args.chat_template_args)

    if split is not None and split.rank != 0:
        from mlx_mtp.server.split import follow

        return follow(load, prompt_cache_bytes)  # (--no-mtp: Engine keeps none)
    if split is not None:
        from mlx_mtp.server.split import SplitWorker

        worker = SplitWorker(load, args.max_queue, args.max_batch, prompt_cache_bytes)
    else:
        worker = Worker(load, args.max_queue, args.max_batch, prompt_cache_bytes)
    try:
        worker.start()
    except MTPError as e:
        sys.stderr.write(f"error: {e}\n")
        return 1
    mtp = worker.warm_up.mtp
    model_id = args.model or DEMO_MODEL_ID
    print(f"mlx_mtp.server: {model_id} on http://{args.host}:{args.port} "
          f"(MTP {'on' if mtp['mtp_enabled'] else 'off'}: {mtp['gate_reason']}; "
          f"queue {args.max_queue}; {worker.engine.batch_reason}; "
          f"prompt cache {worker.engine.prompt_cache_reason}; no authentication)"
          + (f" [rank 0 of {split.size}, {split.kind} split, pid {os.getpid()}]" if split else ""),
          flush=True)
    defaults = Defaults(max_tokens=args.max_tokens, temperature=args.temp, top_p=args.top_p,
                        top_k=args.top_k, min_p=args.min_p, model=model_id,
                        **_repetition_defaults(args))
    if split is not None:
        # uvicorn re-raises SIGTERM / SIGINT after its graceful shutdown: swallowed, so rank 0
        # stops its worker below (which tells the other ranks to exit) and exits 0 (mlx.launch
        # kills the other ranks at once when one exits otherwise).
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
    try:
        uvicorn.run(build_app(worker, model_id, defaults), host=args.host, port=args.port,
                    log_level=args.log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    finally:
        # uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown, which ends the process
        # right there; on any other way out, a cut decode stops before the interpreter does.
        worker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
