"""The command line: load once, warm up, serve with uvicorn on 127.0.0.1 by default."""

from __future__ import annotations

import argparse
import logging
import sys

import mlx_mtp  # noqa: F401  (first: binds the system BLAS before mlx.core loads)
from mlx_mtp import MTPError

DEFAULT_MAX_QUEUE = 16
# On SIGTERM/Ctrl-C, requests still open after this long are cut (a decode may run for minutes).
GRACEFUL_SHUTDOWN_S = 3


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, like the other CLIs
        sys.stderr.write(f"error: {message}\n")
        sys.exit(2)


def _int_at_least(lo: int):
    def parse(s):
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}")
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be at least {lo}, got {v}")
        return v
    return parse


def _block_size(s):
    """An integer, checked against the library's bounds at warm-up; other words (a future
    ``auto``) go to the library as they are."""
    try:
        return int(s)
    except ValueError:
        return s


def _number(lo: float, hi: float = float("inf")):
    def parse(s):
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {s!r}")
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be between {lo} and {hi}, got {s}"
                                             if hi != float("inf") else f"must be >= {lo}, got {s}")
        return v
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m mlx_mtp.server",
                description="OpenAI-compatible HTTP server decoding with MTP (exact at T=0). "
                            "No authentication: it binds 127.0.0.1 unless --host says otherwise.")
    p.add_argument("--model", help="local folder or Hugging Face repo id of the target "
                   "(default: the embedded demo pair)")
    p.add_argument("--drafter", help="folder or repo id of a separate MTP head or Gemma 4 assistant")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=_int_at_least(0), default=8080, help="port (default: 8080)")
    p.add_argument("--block-size", type=_block_size, default=None,
                   help="tokens verified per round, drafts + 1 (default: the library's)")
    p.add_argument("--max-queue", type=_int_at_least(1), default=DEFAULT_MAX_QUEUE,
                   help="requests that may wait while one decodes; more get 429 "
                        f"(default: {DEFAULT_MAX_QUEUE})")
    p.add_argument("--no-mtp", action="store_true",
                   help="serve mlx-lm's plain decode of the same target, for comparison")
    # Defaults for fields a request leaves out, as mlx_lm.server's flags.
    p.add_argument("--max-tokens", type=_int_at_least(1), default=512,
                   help="default max_tokens (default: 512)")
    p.add_argument("--temp", type=_number(0.0), default=0.0, help="default temperature (0.0)")
    p.add_argument("--top-p", type=_number(0.0, 1.0), default=1.0, help="default top_p (1.0)")
    p.add_argument("--top-k", type=_int_at_least(0), default=0, help="default top_k (0: off)")
    p.add_argument("--min-p", type=_number(0.0, 1.0), default=0.0, help="default min_p (0.0)")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error", "critical"])
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import uvicorn

        from .app import build_app
    except ImportError as e:
        sys.stderr.write(f"error: mlx_mtp.server needs the server extra "
                         f"(pip install 'mlx-mtp[server]'): {e}\n")
        return 1
    from .engine import Engine
    from .schema import Defaults
    from .worker import Worker

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    model = args.model
    if model is None:
        if args.drafter is not None:
            sys.stderr.write("error: --drafter needs --model: the embedded demo pair has its own "
                             "head\n")
            return 1
        from mlx_mtp.demo import demo_path

        try:
            model = str(demo_path())
        except MTPError as e:
            sys.stderr.write(f"error: {e}\n")
            return 1
    worker = Worker(lambda: Engine.load(model, drafter=args.drafter, no_mtp=args.no_mtp,
                                        block_size=args.block_size), args.max_queue)
    try:
        worker.start()
    except MTPError as e:
        sys.stderr.write(f"error: {e}\n")
        return 1
    mtp = worker.warm_up.mtp
    model_id = args.model or "mlx_mtp-demo-pair"
    print(f"mlx_mtp.server: {model_id} on http://{args.host}:{args.port} "
          f"(MTP {'on' if mtp['mtp_enabled'] else 'off'}: {mtp['gate_reason']}; "
          f"queue {args.max_queue}; no authentication)", flush=True)
    defaults = Defaults(max_tokens=args.max_tokens, temperature=args.temp, top_p=args.top_p,
                        top_k=args.top_k, min_p=args.min_p)
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
