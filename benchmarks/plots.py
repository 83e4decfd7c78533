"""Pictures of a benchmark record, drawn from its JSON alone (so ``--render`` can redraw them).

``bench_mtp`` records ("mtp"): tok/s per block size (plain decode and MTP, min-max over the runs,
the plain-decode read floor as a line), per-position acceptance per block size, and the round split
as stacked bars. ``bench_drafter`` records ("drafter"): the drafter step and accept hook per arm
against their read floor, and the round split per arm. ``bench_server`` records ("server"):
streamed decode tok/s and time to first token per prompt, MTP against ``--no-mtp``.

matplotlib is optional (``pip install -e ".[bench]"``) and only ever imported here, lazily; the
mlx_mtp package never imports it. Figures draw on the Agg canvas directly (no pyplot, no display,
no global figure state), at a fixed pixel size: ``FIGSIZE`` inches x ``DPI``.
"""

from __future__ import annotations

import os
from pathlib import Path

FIGSIZE = (7.0, 4.2)  # inches
DPI = 100
SIZE_PX = (round(FIGSIZE[0] * DPI), round(FIGSIZE[1] * DPI))  # 700 x 420
SECTION = "## Pictures"
INSTALL = 'pip install -e ".[bench]"'
SKIPPED = f"pictures skipped: matplotlib is not installed ({INSTALL})"
PHASES = (("verify", "verify"), ("draft", "draft"), ("accept", "accept hook"),
          ("finalize", "finalize"), ("residual", "residual"))
COLORS = {"verify": "#4c72b0", "draft": "#dd8452", "accept": "#55a868", "finalize": "#c44e52",
          "residual": "#8c8c8c"}


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


# ------------------------------------------------------------------------------ checks


def check(record: dict, kind: str) -> str | None:
    """Why ``record`` cannot be drawn as ``kind`` ("mtp", "drafter", "server"), or None."""
    if not isinstance(record, dict) or not isinstance(record.get("rows"), list) or not record["rows"]:
        return "not a benchmark record (no 'rows')"
    need = {"mtp": ("block_size", "mtp_tps", "classic_tps", "per_position_acceptance", "round_ms"),
            "drafter": ("arm", "step_ms", "step_floor_ms", "accept_ms", "round_ms"),
            "server": ("prompt", "plain_decode_tps", "mtp_decode_tps", "plain_ttft_ms",
                       "mtp_ttft_ms"),
            "trees": ("arm", "topk", "tps", "tokens_per_round", "nodes_per_round"),
            "verify_ops": ("width", "whole_ms", "split_ms"),
            "concurrency": ("clients", "arm", "aggregate_tps", "per_request_tps"),
            "prefill": ("prompt_tokens", "arm", "tokens_per_s"),
            "long_context": ("prompt_tokens", "temperature", "block_size", "ratio_median"),
            "draft_vocab": ("arm", "block_size", "vocab", "tps", "per_position_acceptance",
                            "text_coverage")}[kind]
    script = {"mtp": "bench_mtp.py", "drafter": "bench_drafter.py",
              "server": "bench_server.py", "trees": "bench_trees.py",
              "verify_ops": "verify_ops.py", "concurrency": "bench_concurrency.py",
              "prefill": "bench_prefill.py", "long_context": "bench_long_context.py",
              "draft_vocab": "bench_draft_vocab.py"}[kind]
    missing = [k for k in need if not all(isinstance(row, dict) and k in row for row in record["rows"])]
    if missing:
        return f"not a {script} record (rows lack {', '.join(repr(k) for k in missing)})"
    if kind == "long_context" and not isinstance(record.get("verify"), dict):
        return f"not a {script} record (no 'verify')"
    if kind == "mtp" and "target_step_floor_ms" not in record:
        return f"not a {script} record (no 'target_step_floor_ms')"
    return None


# ------------------------------------------------------------------------------ drawing


def draw(record: dict, stem: Path, kind: str) -> list:
    """Write ``<stem>-<name>.png`` for each picture of ``kind``; [(caption, path)].

    Raises ImportError (with ``SKIPPED``) without matplotlib, ValueError for a record that does
    not fit ``kind``."""
    problem = check(record, kind)
    if problem:
        raise ValueError(problem)
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(SKIPPED) from e
    stem = Path(stem)
    out = []
    for name, caption, fn in FIGURES[kind]:
        fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
        FigureCanvasAgg(fig)
        fn(fig.add_subplot(), record)
        path = stem.parent / f"{stem.name}-{name}.png"
        # No bbox_inches="tight": the file keeps exactly SIZE_PX. No software/date metadata:
        # redrawing the same record gives the same bytes.
        fig.savefig(path, dpi=DPI, format="png", metadata={"Software": None})
        out.append((caption, path))
    return out


def _title(ax, record: dict, what: str) -> None:
    ax.set_title(f"{record.get('topic', '?')} on {record.get('host', {}).get('name', '?')}, "
                 f"{record.get('date', '?')}: {what}", fontsize=10)


def _tps_range(runs, fallback: float) -> tuple:
    tps = [run["tps"] for run in runs or () if "tps" in run]
    return (min(tps), max(tps)) if tps else (fallback, fallback)


def _x_positions(arms) -> list:
    """Block sizes as x positions; a non-numeric arm ("auto") goes one past the widest fixed."""
    fixed = [a for a in arms if isinstance(a, int)]
    extra = (max(fixed) if fixed else 0) + 1
    return [a if isinstance(a, int) else extra for a in arms]


def _mtp_tps(ax, r: dict) -> None:
    rows = r["rows"]
    raw = r.get("raw") or {}
    arms = [row["block_size"] for row in rows]
    bs = _x_positions(arms)  # an "auto" arm sits one step right of the widest fixed block
    med = [row["mtp_tps"] for row in rows]
    rng = [_tps_range(raw.get(f"mtp{a}"), m) for a, m in zip(arms, med)]
    plain = rows[0]["classic_tps"]
    plo, phi = _tps_range(raw.get("classic"), plain)
    ax.axhspan(plo, phi, color="#8c8c8c", alpha=0.18, lw=0)
    ax.axhline(plain, color="#595959", lw=1.5, label=f"plain decode (mlx-lm) {plain:.1f} tok/s, "
                                                      "band = min-max")
    ax.errorbar(bs, med, yerr=[[m - lo for m, (lo, _) in zip(med, rng)],
                               [hi - m for m, (_, hi) in zip(med, rng)]],
                fmt="o-", color=COLORS["verify"], capsize=4, lw=1.8,
                label="MTP: median, bars = min-max over runs")
    for b, m, row in zip(bs, med, rows):
        ax.annotate(f"{row['ratio_median']:.2f}x", (b, m), textcoords="offset points",
                    xytext=(-6, 7), ha="right", fontsize=8, color=COLORS["verify"],
                    bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none", alpha=0.8))
    floor = 1e3 / r["target_step_floor_ms"]
    ax.axhline(floor, color="black", ls="--", lw=1,
               label=f"plain decode's read floor {floor:.0f} tok/s (weights / bandwidth)")
    # Log scale: the floor is often several times the measured speeds; on a linear axis it
    # would squash the curve. Equal ratios then look equal at any speed.
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    lo = min([plo] + [lo for lo, _ in rng] + [floor])
    hi = max([phi] + [hi for _, hi in rng] + [floor])
    ax.set_yscale("log")
    ax.set_ylim(lo / 1.25, hi * 2.6)  # headroom: the legend sits above the floor line
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(bs, [str(a) for a in arms])
    ax.set_xlim(min(bs) - 0.4, max(bs) + 0.6)
    ax.set_xlabel("block size (tokens verified per round); label: MTP / plain, median of pairs")
    ax.set_ylabel("tok/s (log scale)")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="y", which="both", alpha=0.3)
    _title(ax, r, "tok/s per block size" + (f", T={r['temperature']}" if r.get("temperature")
                                            else ", T=0"))


def _mtp_acceptance(ax, r: dict) -> None:
    drew = False
    for row in r["rows"]:
        pp = row["per_position_acceptance"]
        if pp:
            ax.plot(range(1, len(pp) + 1), pp, "o-", label=f"block {row['block_size']}")
            drew = True
    if drew:
        ax.legend(fontsize=8, loc="lower left")
        longest = max(len(row["per_position_acceptance"]) for row in r["rows"])
        ax.set_xticks(range(1, longest + 1))
    else:
        ax.text(0.5, 0.5, "no drafts in this record (block size 1 only)", ha="center",
                va="center", transform=ax.transAxes)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance")
    ax.grid(alpha=0.3)
    _title(ax, r, "per-position acceptance")


def _stacked(ax, labels, splits, notes, horizontal: bool) -> None:
    """Stacked round split bars: one per label, PHASES in order, a note at the end of each."""
    pos = range(len(labels))
    base = [0.0] * len(labels)
    bar = ax.barh if horizontal else ax.bar
    for key, name in PHASES:
        vals = [s.get(key, 0.0) or 0.0 for s in splits]
        if horizontal:
            bar(pos, vals, left=base, color=COLORS[key], label=name, height=0.7)
        else:
            bar(pos, vals, bottom=base, color=COLORS[key], label=name, width=0.7)
        base = [b + v for b, v in zip(base, vals)]
    top = max(base) if base else 1.0
    for p, total, note in zip(pos, base, notes):
        if horizontal:
            ax.text(total + top * 0.01, p, note, va="center", fontsize=8)
        else:
            ax.text(p, total + top * 0.01, note, ha="center", va="bottom", fontsize=8)
    if horizontal:
        ax.set_yticks(list(pos), labels)
        ax.invert_yaxis()
        ax.set_xlim(0, top * 1.45)
        ax.set_xlabel("ms per round")
        ax.grid(axis="x", alpha=0.3)
    else:
        ax.set_xticks(list(pos), labels)
        ax.set_ylim(0, top * 1.25)
        ax.set_ylabel("ms per round")
        ax.grid(axis="y", alpha=0.3)
    if horizontal:  # below the axes: every bar runs the full width
        _legend_below(ax, ncol=len(PHASES))
    else:
        ax.legend(fontsize=8, loc="upper left", ncol=3)


def _legend_below(ax, ncol: int) -> None:
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=ncol,
              frameon=False, handlelength=1.5, columnspacing=1.2)


def _mtp_rounds(ax, r: dict) -> None:
    rows = r["rows"]
    notes = []
    for row in rows:
        ms, tok = sum(v or 0 for v in row["round_ms"].values()), row.get("tokens_per_round") or 0
        notes.append(f"{ms:.1f} ms, {tok:.2f} tok\n" + (f"{ms / tok:.1f} ms/tok" if tok else ""))
    _stacked(ax, [str(row["block_size"]) for row in rows], [row["round_ms"] for row in rows],
             notes, horizontal=False)
    ax.set_xlabel("block size (above a bar: ms and tokens per round, ms per token)")
    _title(ax, r, "round split")


def _drafter_step(ax, r: dict) -> None:
    rows = r["rows"]
    pos = list(range(len(rows)))
    h = 0.38
    step = [row["step_ms"] or 0.0 for row in rows]
    acc = [row["accept_ms"] or 0.0 for row in rows]
    ax.barh([p - h / 2 for p in pos], step, height=h, color=COLORS["draft"],
            label="drafter step (draft phase / steps)")
    ax.barh([p + h / 2 for p in pos], acc, height=h, color=COLORS["accept"],
            label="accept hook (per call)")
    ax.scatter([row["step_floor_ms"] for row in rows], pos, marker="|", s=400, color="black",
               zorder=3, label="read floor (weights it reads / bandwidth)")
    top = max(step + acc + [row["step_floor_ms"] for row in rows]) or 1.0
    for p, row in zip(pos, rows):
        if row["step_ms"]:
            ax.text(row["step_ms"] + top * 0.01, p - h / 2,
                    f"{row['step_ms']:.2f} ms ({row['step_ms'] / row['step_floor_ms']:.1f}x floor)",
                    va="center", fontsize=7)
    ax.set_yticks(pos, [row["arm"] for row in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, top * 1.45)
    ax.set_xlabel("ms")
    ax.grid(axis="x", alpha=0.3)
    _legend_below(ax, ncol=3)
    _title(ax, r, f"drafter step vs floor, block {r.get('block_size', '?')}")


def _drafter_rounds(ax, r: dict) -> None:
    rows = r["rows"]
    notes = [f"{sum(v or 0 for v in row['round_ms'].values()):.1f} ms, "
             f"{row.get('tokens_per_round') or 0:.2f} tok, {row.get('tps') or 0:.1f} tok/s"
             for row in rows]
    _stacked(ax, [row["arm"] for row in rows], [row["round_ms"] for row in rows], notes,
             horizontal=True)
    _title(ax, r, f"round split per arm, block {r.get('block_size', '?')}")


def _server_bars(ax, r: dict, key: str, unit: str, what: str) -> None:
    """Plain vs MTP per prompt, side by side (bench_server.py: medians of the pairs)."""
    rows = r["rows"]
    xs = range(len(rows))
    top = 0.0
    for dx, arm, color in ((-0.2, "plain", "#8c8c8c"), (0.2, "mtp", COLORS["verify"])):
        vals = [row[f"{arm}_{key}"] or 0.0 for row in rows]
        top = max([top, *vals])
        ax.bar([x + dx for x in xs], vals, width=0.4, color=color,
               label="--no-mtp (mlx-lm plain decode)" if arm == "plain" else "MTP")
    ax.set_ylim(0, top * 1.3 or 1.0)  # headroom: the legend sits above the bars
    ax.set_xticks(list(xs))
    ax.set_xticklabels([row["prompt"] for row in rows])
    ax.set_ylabel(unit)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    _title(ax, r, what)


def _server_tps(ax, r: dict) -> None:
    _server_bars(ax, r, "decode_tps", "tok/s (client side, after the first token)",
                 "streamed decode tok/s per prompt")


def _server_ttft(ax, r: dict) -> None:
    _server_bars(ax, r, "ttft_ms", "ms", "time to first token per prompt")


def _tree_tps(ax, r: dict) -> None:
    """Median tok/s per arm with the pairs' range, plain decode as a line (bench_trees.py)."""
    rows = r["rows"]
    xs = range(len(rows))
    runs = r.get("raw") or {}
    for x, row in zip(xs, rows):
        lo, hi = _tps_range(runs.get(row["arm"]), row["tps"])
        color = COLORS["draft"] if row["topk"] > 1 else COLORS["verify"]
        ax.bar(x, row["tps"], width=0.6, color=color)
        ax.plot([x, x], [lo, hi], color="black", linewidth=1)
    ax.axhline(r["plain_tps"], color="#8c8c8c", linestyle="--",
               label=f"plain decode {r['plain_tps']:.1f} tok/s")
    ax.bar([], [], color=COLORS["verify"], label="chain")
    ax.bar([], [], color=COLORS["draft"], label="tree")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([row["arm"] for row in rows])
    ax.set_ylabel("tok/s (median; bar: the pairs' range)")
    ax.set_ylim(0, max([r["plain_tps"], *[row["tps"] for row in rows]]) * 1.3)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    _title(ax, r, "tok/s per arm")


def _tree_rounds(ax, r: dict) -> None:
    """Tokens emitted per round against nodes verified per round, per arm."""
    rows = r["rows"]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [row["nodes_per_round"] + 1 for row in rows], width=0.4,
           color="#8c8c8c", label="tokens verified per round (nodes + bonus)")
    ax.bar([x + 0.2 for x in xs], [row["tokens_per_round"] for row in rows], width=0.4,
           color=COLORS["accept"], label="tokens emitted per round")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([row["arm"] for row in rows])
    ax.set_ylim(0, max(row["nodes_per_round"] + 1 for row in rows) * 1.35)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    _title(ax, r, "tokens verified and emitted per round")


def _verify_ops(ax, r: dict) -> None:
    """The verify's split per width (bench verify_ops), each category stacked."""
    rows = r["rows"]
    xs = [row["width"] for row in rows]
    colors = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3")
    bottom = [0.0] * len(rows)
    for name, color in zip(rows[0]["split_ms"], colors):
        vals = [row["split_ms"][name] for row in rows]
        ax.bar(xs, vals, bottom=bottom, color=color, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.plot(xs, [row["whole_ms"] for row in rows], color="black", marker="o",
            label="whole verify (no barriers)")
    ax.set_xlabel("verify width (1: the decode step)")
    ax.set_ylabel("ms (median)")
    ax.set_ylim(0, max(bottom) * 1.35)
    ax.legend(fontsize=8, loc="upper left", ncol=2)
    ax.grid(axis="y", alpha=0.3)
    _title(ax, r, "verify split by op per width")


def _concurrency(ax, r: dict, key: str, unit: str, what: str) -> None:
    """One line per server over the concurrent clients (bench_concurrency.py)."""
    styles = {"batched": ("mlx_mtp.server (batched)", COLORS["verify"]),
              "serial": ("mlx_mtp.server --max-batch 1", COLORS["draft"]),
              "mlx_lm": ("mlx_lm.server", "#8c8c8c")}
    for arm, (label, color) in styles.items():
        rows = [row for row in r["rows"] if row["arm"] == arm]
        ax.plot([row["clients"] for row in rows], [row[key] for row in rows], marker="o",
                color=color, label=label)
    ax.set_xticks(r["levels"])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel(unit)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    _title(ax, r, what)


def _prefill(ax, r: dict) -> None:
    """Prefill tok/s per prompt length, one bar per arm (bench_prefill.py)."""
    lengths = sorted({row["prompt_tokens"] for row in r["rows"]})
    arms = list(dict.fromkeys(row["arm"] for row in r["rows"]))
    width = 0.8 / len(arms)
    colors = ("#8c8c8c", COLORS["draft"], COLORS["verify"], COLORS["accept"])
    for j, (arm, color) in enumerate(zip(arms, colors)):
        got = {row["prompt_tokens"]: row["tokens_per_s"] for row in r["rows"] if row["arm"] == arm}
        ax.bar([i + (j - (len(arms) - 1) / 2) * width for i in range(len(lengths))],
               [got[n] for n in lengths], width, color=color, label=arm)
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("prefill tok/s (median)")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    _title(ax, r, "prefill tok/s per arm")


def _long_ratio(ax, r: dict) -> None:
    """MTP over plain per prompt length, one line per block size and temperature."""
    lengths = sorted({row["prompt_tokens"] for row in r["rows"]})
    arms = list(dict.fromkeys((row["temperature"], row["block_size"]) for row in r["rows"]))
    for t, bs in arms:
        got = {row["prompt_tokens"]: row for row in r["rows"]
               if (row["temperature"], row["block_size"]) == (t, bs)}
        xs = [n for n in lengths if n in got]
        ax.errorbar(xs, [got[n]["ratio_median"] for n in xs],
                    yerr=[[got[n]["ratio_median"] - got[n]["ratio_min"] for n in xs],
                          [got[n]["ratio_max"] - got[n]["ratio_median"] for n in xs]],
                    marker="o", capsize=3, linestyle="-" if t == 0 else "--",
                    label=f"block {bs}, T={t:g}")
    ax.axhline(1.0, color="#8c8c8c", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("MTP tok/s over plain (median, min-max)")
    ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3)
    _title(ax, r, "MTP over plain decode per prompt length")


def _long_verify(ax, r: dict) -> None:
    """The synced verify over the plain step per width, one line per prompt length and mode."""
    for length, v in r["verify"].items():
        modes = list(dict.fromkeys(w["mode"] for w in v["widths"]))
        for mode in modes:
            ws = sorted((w["width"], w["over_step"]) for w in v["widths"] if w["mode"] == mode)
            ax.plot([w for w, _ in ws], [o for _, o in ws], marker="o",
                    linestyle="--" if mode == "by rows" else "-", label=f"{length} tokens, {mode}")
    ax.set_xlabel("verify width (tokens)")
    ax.set_ylabel("verify / plain step (synced)")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    _title(ax, r, "the verify's cost by width and prompt length")


def _concurrency_aggregate(ax, r: dict) -> None:
    _concurrency(ax, r, "aggregate_tps", "tok/s, all requests", "aggregate tok/s")


def _concurrency_per_request(ax, r: dict) -> None:
    _concurrency(ax, r, "per_request_tps", "tok/s per request (queueing included)",
                 "per-request tok/s (median)")


def _vocab_groups(r: dict):
    """(block sizes, vocabularies in row order, row per (block, vocabulary))."""
    rows = r["rows"]
    blocks = list(dict.fromkeys(row["block_size"] for row in rows))
    vocabs = list(dict.fromkeys(row["vocab"] for row in rows))
    return blocks, vocabs, {(row["block_size"], row["vocab"]): row for row in rows}


def _vocab_bars(ax, r: dict, value, ylabel: str, what: str, line=None) -> None:
    """One group of bars per block size, one bar per vocabulary (bench_draft_vocab.py)."""
    blocks, vocabs, at = _vocab_groups(r)
    width = 0.8 / len(vocabs)
    cmap = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3"]
    top = 0.0
    for j, v in enumerate(vocabs):
        xs = [i + (j - (len(vocabs) - 1) / 2) * width for i in range(len(blocks))]
        ys = [value(at[(b, v)]) if (b, v) in at else 0.0 for b in blocks]
        top = max([top, *ys])
        ax.bar(xs, ys, width=width, color=cmap[j % len(cmap)],
               label=v if v == "full" else f"{v} ids")
    if line is not None:
        ax.axhline(line[0], color="#8c8c8c", linestyle="--", label=line[1])
        top = max(top, line[0])
    ax.set_xticks(list(range(len(blocks))))
    ax.set_xticklabels([f"block {b}" for b in blocks])
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, top * 1.3 or 1.0)
    ax.legend(fontsize=8, loc="upper left", ncol=min(len(vocabs) + 1, 4))
    ax.grid(axis="y", alpha=0.3)
    _title(ax, r, what)


def _vocab_tps(ax, r: dict) -> None:
    _vocab_bars(ax, r, lambda row: row["tps"], "tok/s (median)",
                "tok/s per draft vocabulary",
                (r["plain_tps"], f"plain decode {r['plain_tps']:.1f} tok/s"))


def _vocab_acceptance(ax, r: dict) -> None:
    _vocab_bars(ax, r, lambda row: row["per_position_acceptance"][0],
                "first draft accepted (share of rounds)",
                "first-draft acceptance per draft vocabulary")


FIGURES = {  # kind -> [(file name suffix, caption, draw(ax, record))]
    "mtp": [("tps", "tok/s per block size", _mtp_tps),
            ("acceptance", "per-position acceptance per block size", _mtp_acceptance),
            ("rounds", "round split per block size", _mtp_rounds)],
    "drafter": [("step", "drafter step and accept hook vs their read floor, per arm",
                 _drafter_step),
                ("rounds", "round split per arm", _drafter_rounds)],
    "verify_ops": [("split", "the verify split by op, per width", _verify_ops)],
    "prefill": [("tps", "prefill tok/s per prompt length and arm", _prefill)],
    "long_context": [("ratio", "MTP over plain decode per prompt length", _long_ratio),
                     ("verify", "the verify over a plain step, by width and prompt length",
                      _long_verify)],
    "trees": [("tps", "tok/s per arm: chains and trees", _tree_tps),
              ("rounds", "tokens verified and emitted per round, per arm", _tree_rounds)],
    "draft_vocab": [("tps", "tok/s per block size and draft vocabulary", _vocab_tps),
                    ("acceptance", "first-draft acceptance per block size and draft vocabulary",
                     _vocab_acceptance)],
    "concurrency": [("aggregate", "aggregate tok/s per server over concurrent clients",
                     _concurrency_aggregate),
                    ("per-request", "per-request tok/s per server over concurrent clients",
                     _concurrency_per_request)],
    "server": [("tps", "streamed decode tok/s per prompt, MTP vs --no-mtp", _server_tps),
               ("ttft", "time to first token per prompt, MTP vs --no-mtp", _server_ttft)],
}


# ------------------------------------------------------------------------------ the markdown


def section(pictures, md_dir: Path) -> str:
    """The ``## Pictures`` section linking ``pictures`` relative to the .md's folder."""
    lines = [SECTION, ""]
    for caption, path in pictures:
        rel = Path(os.path.relpath(Path(path), Path(md_dir))).as_posix()
        lines += [f"![{caption}]({rel})", ""]
    return "\n".join(lines)


def embed(md: str, pictures, md_dir: Path) -> str:
    """``md`` with its pictures section replaced by one linking ``pictures``, or, if it has none,
    one inserted before the results (else before "What it says", else at the end)."""
    if not pictures:
        return md
    new = section(pictures, md_dir).split("\n")  # keeps the blank line that ends it
    lines = md.splitlines()
    if SECTION in lines:
        start = lines.index(SECTION)
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")),
                   len(lines))
        lines[start:end] = new
    else:
        at = next((i for i, line in enumerate(lines) if line.startswith("## Results")), None)
        if at is None:
            at = next((i for i, line in enumerate(lines) if line.startswith("## What it says")),
                      len(lines))
        if at == len(lines) and lines and lines[-1] != "":
            lines.append("")
            at = len(lines)
        lines[at:at] = new
    text = "\n".join(lines)
    return text + "\n" if md.endswith("\n") and not text.endswith("\n") else text
