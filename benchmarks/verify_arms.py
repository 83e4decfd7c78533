"""What an exact verify costs by how the row-exact layers compute it, in one process.

Arms, alternated round by round on the same target, each with its own cache prefilled alike:
  decode    mlx-lm's own forward of one token (the plain decode step)
  forward   mlx-lm's own forward of W tokens (+ the LM head): what a W-token pass costs before
            mlx_mtp adds anything (no stashed states, no row-exact layers)
  kernel    a W-token verify, row-exact layers through the compiled row kernel (mlx_mtp.cpu.row_kernel)
            (every verify arm, as the round loop, with all threads on one core from the first
            eager kernel call on: ``mlx_mtp.cpu.pin``, with one kernel thread)
  unpinned  the kernel arm with the threads free to run on any core (MLX_MTP_PIN_VERIFY=0)
  eager     the kernel arm with the kernels called eagerly (a host sync per call, pinned from the
            first: MLX_MTP_LAZY_KERNELS=0), where the kernel arm runs them as lazy MLX ops
            (``mlx_mtp.cpu.lazy_ops``; a lazy verify makes no eager call, so it never pins)
  pinned    the kernel arm with every thread on one core for the whole verify (does pinning
            pay once the kernels are lazy?)
  blocked   the same verify, row-exact layers as blocked one-row BLAS products (the fallback)
  chunked   the kernel arm with the layers it computes transposed
            (``row_exact_layers.transposed_products``) as chunks of rows narrower than their first
            divergent width instead, where that is more than 2 (``row_exact_layers.chunked``; OpenBLAS:
            two products of 2 rows at width 4)
  inexact   the same verify without exactness fallbacks (what MLX_MTP_ALLOW_INEXACT=1 runs)
  stepwise  the kernel arm's verify with the GatedDeltaNet layers as mlx-lm's ops (the recurrence
            one token at a time, norms unfused): ``gdn_block``'s reference and fallback
  no_gdn_kernel  the kernel arm's verify with the GatedDeltaNet recurrence in the compiled graph
            on every layer, never in the C kernel (``gdn_kernel``): the kernel arm uses the C
            kernel where ``gdn_block.kernel_pays`` (large recurrent states) and its check passes
  uncompiled_layers  the kernel arm's verify with the rest of each decoder layer (norms, residual
            adds, MLP, the attention's parts around its cache update) as mlx-lm's uncompiled ops,
            not ``compiled_layers``'s compiled graphs
  all_kernel       the exact verify with EVERY float32 layer through the kernel, also the ones that
                   are row-invariant (not switched), where its bitwise check passes: does the
                   kernel pay for speed alone?
  all_kernel_body  the same but the LM head keeps its installed path
Prints the median ms per arm and each as a multiple of the decode step, as JSON. Nothing is
written, and the numbers depend on the machine's state: quote them only from an idle machine
(``python -m benchmarks.idle``), beside the decode step they are multiples of.

    python -m benchmarks.verify_arms --model PAIR [--width 3] [--reps 12] [--kernel-threads 2]

What to look for: an arm's multiple of the decode step at each width against ``forward`` (what
mlx-lm itself pays for a W-token pass) and against ``kernel`` (the installed verify). A change to
the verify's layers should keep ``kernel`` at or under ``forward``; an arm that beats ``kernel``
at every width on both the demo pair and a realistic-size pair is a candidate to install.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import nullcontext

import mlx_mtp  # first: binds the system BLAS
import mlx.core as mx
import mlx.nn as mx_nn
import numpy as np

from mlx_mtp.cpu import blas as cpu_blas
from mlx_mtp.cpu import lazy_ops as lazy_kernels
from mlx_mtp.cpu import pin as cpu_pin
from mlx_mtp.cpu import row_kernel
from mlx_mtp.exactness import gate, row_exact_layers
from mlx_mtp.models.qwen3_5 import compiled_layers, gdn_block, gdn_kernel

ARMS = ("decode", "forward", "kernel", "unpinned", "eager", "pinned", "blocked", "chunked",
        "inexact",
        "stepwise", "no_gdn_kernel", "uncompiled_layers", "all_kernel", "all_kernel_body")
KERNEL_ARMS = ("kernel", "unpinned", "eager", "pinned", "stepwise", "no_gdn_kernel",
               "uncompiled_layers")


def measure(model, width: int, reps: int, prompt_len: int = 80,
            kernel_threads: int = 0, arms=ARMS) -> dict:
    """Time the arms on a loaded ``mlx_mtp`` model; its layers' installed choices and its
    target's exactness are as before on return. ``kernel_threads`` > 0: the kernel arm's
    threads (else ``row_exact_layers.kernel_threads``'s, by each product's size), so a thread
    count can be tried on the kernel alone without changing the BLAS threads of the rest.
    ``arms``: the arms to time (``decode`` is always timed: the others are its multiples)."""
    arms = ("decode",) + tuple(a for a in ARMS if a in arms and a != "decode")
    target = model.target
    target.prepare(width)
    layers = [layer for _, layer in model.mlx_model.named_modules()
              if row_exact_layers.row_method(layer) != "multi-row"]
    chosen = {id(layer): (layer.use_kernel, layer.block_cols, layer.chunk_rows, layer.transposed)
              for layer in layers}
    kernel_layers = [layer for layer in layers if layer.use_kernel]
    # the layers chunked or transposed: either, or the blocked fallback
    other_layers = [layer for layer in layers if layer.chunk_rows or layer.transposed]
    extra, head = (speed_candidates(model, width) if any(a.startswith("all_kernel") for a in arms)
                   else ([], target.lm_head_module))
    prompt = mx.array([[5 + i % 200 for i in range(prompt_len)]])

    def fresh():
        cache = target.make_cache()
        mx.eval(target.hidden(prompt, cache))
        return cache

    caches = {arm: fresh() for arm in arms}
    one, block = mx.array([[7]]), mx.array([[7 + i for i in range(width)]])

    def setup(arm):
        all_kernel = arm.startswith("all_kernel")
        for layer in kernel_layers:  # the kernel's layers: kernel, or the blocked fallback
            layer.use_kernel = arm in KERNEL_ARMS or all_kernel
            layer.block_cols = 0 if layer.use_kernel else row_exact_layers.block_columns(layer.weight)
        for layer in other_layers:
            _, _, chunk, flip = chosen[id(layer)]
            if arm == "chunked" and layer.exact_from > 2:
                chunk, flip = layer.exact_from - 1, False
            elif arm == "blocked":
                chunk, flip = 0, False
            layer.chunk_rows, layer.transposed = chunk, flip
            layer.block_cols = 0 if chunk or flip else row_exact_layers.block_columns(layer.weight)
        switch(extra, all_kernel, keep=head if arm == "all_kernel_body" else None)
        target.exact = arm != "inexact"

    def run(arm):
        if arm in ("decode", "forward"):
            mx.eval(model.mlx_model(one if arm == "decode" else block, cache=caches[arm]))
            return
        setup(arm)
        gdn_block.mixer_choice = (lambda *a: None) if arm == "stepwise" else mixer_choice
        gdn_block.kernel_pays = (lambda *a: False) if arm == "no_gdn_kernel" else kernel_pays
        compiled_layers.enabled = arm != "uncompiled_layers"
        pin = (nullcontext() if arm == "unpinned" or threaded
               else cpu_pin.one_core() if arm == "pinned" else cpu_pin.on_first_sync())
        path = lazy_kernels.eager() if arm == "eager" else nullcontext()
        with cpu_blas.verify_threads(), pin, path:
            mx.eval(target.logits(target.verify(block, caches[arm])))

    times = {arm: [] for arm in arms}
    mixer_choice, kernel_pays = gdn_block.mixer_choice, gdn_block.kernel_pays
    default_threads = row_exact_layers.kernel_threads
    threads = kernel_threads or "by size"  # by size: row_exact_layers.kernel_threads's default
    threaded = (kernel_threads > 1 if kernel_threads
                else row_exact_layers.threaded(target.model, width))
    if kernel_threads:
        row_exact_layers.kernel_threads = lambda *_: kernel_threads
    try:
        for _ in range(reps + 1):  # the first round warms up
            for arm in arms:
                start = time.perf_counter()
                run(arm)
                times[arm].append((time.perf_counter() - start) * 1e3)
    finally:
        gdn_block.mixer_choice, gdn_block.kernel_pays = mixer_choice, kernel_pays
        compiled_layers.enabled = True
        row_exact_layers.kernel_threads = default_threads
        for layer in layers:
            layer.use_kernel, layer.block_cols, layer.chunk_rows, layer.transposed = \
                chosen[id(layer)]
        switch(extra, False)
        target.exact = True
    ms = {arm: float(np.median(t[1:])) for arm, t in times.items()}
    return {
        "width": width, "reps": reps, "blas": cpu_blas.STATE.describe(),
        "row_exact": gate.verify_report(model.mlx_model),
        "kernel_layers": len(kernel_layers), "other_layers": len(other_layers),
        "kernel_threads": threads,
        "kernels": lazy_kernels.mode(),
        "gdn_kernel": "available" if gdn_kernel.available() else
                      f"unavailable ({gdn_kernel.reason()})",
        "all_kernel_extra_layers": len(extra), "all_kernel_head": any(layer is head for layer, _, _ in extra),
        "ms": {arm: round(v, 2) for arm, v in ms.items()},
        "x_decode": {arm: round(v / ms["decode"], 3) for arm, v in ms.items()},
    }


def speed_candidates(model, width: int):
    """The target's float32 layers that the installed choice leaves on their multi-row product
    (row-invariant) but that the kernel computes bitwise alike (``kernel_equal_rows`` on their own
    weights, widths 2..width): [(layer, its class, the row-exact class that uses the kernel)],
    and the LM head module. Their attributes are set here once; the arms switch the
    class only."""
    target = model.target
    head = target.lm_head_module
    found = []
    if not row_kernel.available():
        return found, head
    for _, layer in model.mlx_model.named_modules():
        if row_exact_layers.row_method(layer) != "multi-row" or "bias" in layer:
            continue
        base = next((b for b in type(layer).__mro__ if b in (mx_nn.Linear, mx_nn.Embedding)), None)
        if base is None or type(layer) is not base or layer.weight.dtype != mx.float32:
            continue
        if base is mx_nn.Embedding and not (target.tied_head and layer is head):
            continue
        fn = layer.as_linear if base is mx_nn.Embedding else layer
        if not row_exact_layers.kernel_equal_rows(fn, layer, width):
            continue
        layer.exact_from, layer.block_cols, layer.use_kernel = 2, 0, True
        found.append((layer, base, row_exact_layers.ROW_EXACT_CLASS[base]))
    return found, head


def switch(extra, on: bool, keep=None) -> None:
    """``speed_candidates``' layers through the kernel inside ``verifying()`` (``on``), except
    ``keep``, or back to their own class (their installed multi-row product)."""
    for layer, cls, swapped in extra:
        layer.__class__ = swapped if on and layer is not keep else cls


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the target (its MTP head is not used)")
    p.add_argument("--width", type=int, default=3, help="verify width (default 3)")
    p.add_argument("--reps", type=int, default=12, help="timed rounds per arm (default 12)")
    p.add_argument("--kernel-threads", type=int, default=0,
                   help="threads for the kernel arm only (default: MLX_MTP_VERIFY_THREADS, 1)")
    p.add_argument("--arms", default=",".join(ARMS),
                   help="comma-separated arms to alternate (default all; decode is always run)")
    args = p.parse_args(argv)
    arms = ["decode"] + [a for a in args.arms.split(",") if a and a != "decode"]
    if any(a not in ARMS for a in arms):
        p.error(f"--arms: expected names from {','.join(ARMS)}, got {args.arms!r}")
    if args.width < 2 or args.reps < 1 or args.kernel_threads < 0:
        p.error("--width must be at least 2, --reps at least 1, --kernel-threads at least 0")
    if not row_kernel.available():
        print(f"note: row kernel unavailable ({row_kernel.reason()}): kernel = blocked",
              file=sys.stderr)
    model = mlx_mtp.load_model(args.model, require_head=False)
    print(json.dumps({"model": args.model, **measure(model, args.width, args.reps,
                                                     kernel_threads=args.kernel_threads,
                                                     arms=arms)},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
