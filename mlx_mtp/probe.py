"""``python -m mlx_mtp.probe``: run the block-vs-chain exactness probe on a target and report it
per width (verdict, first differing position, bytes differing), as a table or one JSON object
with a top-level ``verdict`` (``equal`` / ``diverges`` / ``not_run``)."""

from __future__ import annotations

import argparse
import sys
import time

import mlx.core as mx
from tabulate import tabulate

from mlx_mtp.models import loader
from mlx_mtp.cli import Parser, cli_main
from mlx_mtp.demo import model_or_demo
from mlx_mtp.exactness.block_vs_chain import DIVERGES, PROBE_DRAWS, aggregate_verdict, probe_exactness
from mlx_mtp.exactness.device import DeviceFacts, current_device_facts
from mlx_mtp.decoding.limits import MAX_BLOCK_SIZE, block_size_problem

DEFAULT_WIDTHS = "2,3,4"


def _widths(s: str):
    try:
        widths = sorted({int(x) for x in s.split(",")})
    except ValueError:
        widths = []
    if not widths or not all(w >= 2 and block_size_problem(w) is None for w in widths):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated block sizes between 2 and {MAX_BLOCK_SIZE} (block size 1 "
            f"has no verify block), got {s!r}")
    return widths


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m mlx_mtp.probe",
               description="Check that verify blocks equal single-token decode, byte for byte.")
    p.add_argument("--model", help="local folder or Hugging Face repo id of the target "
                   "(default: the embedded demo pair, mlx_mtp/demo_pair)")
    p.add_argument("--drafter", help="the MTP head the session would use (loaded as it would be)")
    p.add_argument("--block-sizes", type=_widths, default=_widths(DEFAULT_WIDTHS),
                   help=f"verify widths to probe, comma-separated (default {DEFAULT_WIDTHS})")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run(args) -> dict:
    args.model = model_or_demo(args.model, args.drafter)
    t0 = time.perf_counter()
    model = loader.load_model(args.model, drafter=args.drafter, require_head=False)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    results = probe_exactness(model.target, args.block_sizes)
    return {
        "verdict": aggregate_verdict(results),
        "model": str(args.model),
        "drafter": args.drafter,
        "dtype": str(model.target.dtype).rsplit(".", 1)[-1],
        **current_device_facts().to_dict(),
        "mlx_version": mx.__version__,
        "draws": PROBE_DRAWS,
        "load_s": load_s,
        "probe_s": time.perf_counter() - t0,
        "widths": [r.to_dict() for r in results],
    }


def print_report(report: dict) -> None:
    rows = []
    for w in report["widths"]:
        diverged = w["verdict"] == DIVERGES
        rows.append((w["width"], w["verdict"], w["position"] if diverged else "-",
                     f"{w['differing_bytes']} of {w['total_bytes']}" if diverged else
                     (f"0 of {w['total_bytes']}" if w["total_bytes"] else "-"),
                     w["reason"] or "-"))
    device = DeviceFacts(report["device"], report["architecture"], report["gpu_generation"],
                         report["arch_override"])
    print(f"model {report['model']} ({report['dtype']}) on {device.describe()}, "
          f"MLX {report['mlx_version']}")
    print(tabulate(rows, headers=["width", "verdict", "first differing position",
                                  "bytes differing", "why not run"], tablefmt="simple"))
    print(f"verdict: {report['verdict']} ({report['draws']} draws per width, "
          f"{report['probe_s']:.2f} s)")


def main(argv=None) -> int:
    return cli_main(build_parser(), run, print_report, argv)


if __name__ == "__main__":
    sys.exit(main())
