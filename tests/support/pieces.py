"""What ``compiled_layers``'s checks should choose for a target's verify pieces, derived from how its
row-exact layers compute each width on this host (``row_exact_layers.row_method``, measured by
``row_exact_layers.switch_to_row_exact``), never from the kind of CPU or BLAS.

A piece puts a projection inside its compiled graph where the projection's product is plain MLX
ops at that width: a layer not switched to row-exact products, one below its first divergent
width, or one computed as transposed products or row chunks. The row kernel, column blocks and
one-row calls run outside the graph. Run in the tests' processes and in the fresh interpreters of
the BLAS-binding checks (``support.processes.CHILD_PYTHONPATH`` holding ``tests/``)."""

from __future__ import annotations

from typing import Iterable, List

from mlx_mtp.exactness import row_exact_layers

IN_GRAPH = ("multi-row", "transposed", "chunked")


def in_graph(projections, T: int) -> bool:
    """Whether every one of ``projections`` can sit inside a compiled graph at width ``T``."""
    return all("bias" not in p and (row_exact_layers.row_method(p) in IN_GRAPH or T < p.exact_from)
               for p in projections)


def expected_choices(target, widths: Iterable[int]) -> List[str]:
    """The tail and attention choices (as ``str`` of ``compiled_layers._checked``'s values) that the
    target's verifies at ``widths`` should make, every check passing: ``whole`` / ``split`` for a
    dense MLP's tail, ``(pre, post)`` for a gated attention layer (True: products inside)."""
    out = set()
    for T in widths:
        for layer in target.layers:
            mlp = layer.mlp
            if type(mlp).__name__ == "Qwen3NextMLP":
                out.add("whole" if in_graph([mlp.gate_proj, mlp.up_proj, mlp.down_proj], T)
                        else "split")
            else:  # a mixture of experts: its own ops around the residual and norm
                out.add("split")
            if not layer.is_linear:
                a = layer.self_attn
                out.add(str((in_graph([a.q_proj, a.k_proj, a.v_proj], T), in_graph([a.o_proj], T))))
    return sorted(out)
