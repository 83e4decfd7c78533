"""What an exact verify costs by how the row-exact layers compute it (issue 12), in one process.

Arms, alternated round by round on the same target, each with its own cache prefilled alike:
  decode    mlx-lm's own forward of one token (the plain decode step)
  kernel    a W-token verify, row-exact layers through the compiled row kernel (mlx_mtp.row_kernel)
  blocked   the same verify, row-exact layers as blocked one-row BLAS products (the fallback)
  inexact   the same verify without exactness fallbacks (what MLX_MTP_ALLOW_INEXACT=1 runs)
Prints the median ms per arm and each as a multiple of the decode step, as JSON. Nothing is
written: quote it with the machine's state (run it idle for a number worth quoting):

    python scripts/verify_arms.py --model PAIR [--width 3] [--reps 12] [--kernel-threads 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx_mtp  # noqa: E402  (first: binds the system BLAS)
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from mlx_mtp import cpu_blas, row_exact, row_kernel  # noqa: E402

ARMS = ("decode", "kernel", "blocked", "inexact")


def measure(model, width: int, reps: int, prompt_len: int = 80,
            kernel_threads: int = 0) -> dict:
    """Time the arms on a loaded ``mlx_mtp`` model; its layers' installed choices and its
    target's exactness are as before on return. ``kernel_threads`` > 0: the kernel arm's
    threads (else ``row_exact.kernel_threads()``, from MLX_MTP_VERIFY_THREADS), so a thread
    count can be tried on the kernel alone without changing the BLAS threads of the rest."""
    target = model.target
    target.prepare(width)
    layers = [layer for _, layer in model.mlx_model.named_modules()
              if row_exact.method(layer) != "multi-row"]
    chosen = {id(layer): (layer.use_kernel, layer.block_cols) for layer in layers}
    kernel_layers = [layer for layer in layers if layer.use_kernel]
    prompt = mx.array([[5 + i % 200 for i in range(prompt_len)]])

    def fresh():
        cache = target.make_cache()
        mx.eval(target.hidden(prompt, cache))
        return cache

    caches = {arm: fresh() for arm in ARMS}
    one, block = mx.array([[7]]), mx.array([[7 + i for i in range(width)]])

    def setup(arm):
        for layer in kernel_layers:  # the kernel's layers: kernel, or the blocked fallback
            layer.use_kernel = arm == "kernel"
            layer.block_cols = 0 if arm == "kernel" else row_exact.block_columns(layer.weight)
        target.exact = arm != "inexact"

    def run(arm):
        if arm == "decode":
            mx.eval(model.mlx_model(one, cache=caches[arm]))
            return
        setup(arm)
        with cpu_blas.verify_threads():
            mx.eval(target.logits(target.verify(block, caches[arm])))

    times = {arm: [] for arm in ARMS}
    default_threads = row_exact.kernel_threads
    threads = kernel_threads or default_threads()
    row_exact.kernel_threads = lambda: threads
    try:
        for _ in range(reps + 1):  # the first round warms up
            for arm in ARMS:
                start = time.perf_counter()
                run(arm)
                times[arm].append((time.perf_counter() - start) * 1e3)
    finally:
        row_exact.kernel_threads = default_threads
        for layer in layers:
            layer.use_kernel, layer.block_cols = chosen[id(layer)]
        target.exact = True
    ms = {arm: float(np.median(t[1:])) for arm, t in times.items()}
    return {
        "width": width, "reps": reps, "blas": cpu_blas.STATE.describe(),
        "row_exact": row_exact.report(model.mlx_model),
        "kernel_layers": len(kernel_layers), "kernel_threads": threads,
        "ms": {arm: round(v, 2) for arm, v in ms.items()},
        "x_decode": {arm: round(v / ms["decode"], 3) for arm, v in ms.items()},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the target (its MTP head is not used)")
    p.add_argument("--width", type=int, default=3, help="verify width (default 3)")
    p.add_argument("--reps", type=int, default=12, help="timed rounds per arm (default 12)")
    p.add_argument("--kernel-threads", type=int, default=0,
                   help="threads for the kernel arm only (default: MLX_MTP_VERIFY_THREADS, 1)")
    args = p.parse_args(argv)
    if args.width < 2 or args.reps < 1 or args.kernel_threads < 0:
        p.error("--width must be at least 2, --reps at least 1, --kernel-threads at least 0")
    if not row_kernel.available():
        print(f"note: row kernel unavailable ({row_kernel.reason()}): kernel = blocked",
              file=sys.stderr)
    model = mlx_mtp.load_model(args.model, require_head=False)
    print(json.dumps({"model": args.model, **measure(model, args.width, args.reps,
                                                     kernel_threads=args.kernel_threads)},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
