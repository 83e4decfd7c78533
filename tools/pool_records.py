"""Pool the alternating pairs of several takes of one ``bench_mtp`` record and print its per-prompt
tables over all of them: auto against the best fixed block (held out: chosen on the other pairs),
against each fixed block pair by pair, and against plain decode.

The question it answers: is ``auto``'s gap to the best fixed block size on a prompt real, or the
noise of one take? One take's 6-10 pairs measure a prompt's auto / best fixed block to a few
percent, about the size of the gaps in question; takes of the same command and code, pooled,
measure it more finely than either alone. Writes no record: the takes are the records.

    python -m tools.pool_records A.json B.json [...]

An earlier take of the same name is in git history:
``git show <commit>:benchmark_results/<name>.json > take1.json``. The takes must agree on the
model, prompts, token budget, temperature and arms (else an error naming the file); each take's
pairs are renumbered after the previous take's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

from benchmarks import bench_mtp

SAME = ("model", "prompts", "max_tokens", "temperature")  # what makes two takes one experiment


def load(path: str) -> dict:
    try:
        record = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SystemExit(f"pool_records.py: {path}: no such file")
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise SystemExit(f"pool_records.py: {path}: not a JSON record")
    if not isinstance(record, dict) or not isinstance(record.get("raw"), dict) \
            or not isinstance(record.get("rows"), list):
        raise SystemExit(f"pool_records.py: {path}: not a bench_mtp record (no raw runs)")
    return record


def pairs_of(record: dict) -> set:
    """The numbers of the take's alternating pairs, over all its arms."""
    return {r["pair"] for runs in record["raw"].values() for r in runs}


def pool(records: list, paths: list) -> dict:
    """The takes' raw runs as one record's: the same arms, each take's pairs numbered after the
    previous take's. Raises SystemExit naming the file whose take is another experiment."""
    first = records[0]
    arms = sorted(first["raw"])
    raw = {arm: [] for arm in arms}
    offset = 0
    for record, path in zip(records, paths):
        for key in SAME:
            if record.get(key) != first.get(key):
                raise SystemExit(f"pool_records.py: {path}: {key} differs from {paths[0]}'s "
                                 f"({record.get(key)!r} against {first.get(key)!r})")
        if sorted(record["raw"]) != arms:
            raise SystemExit(f"pool_records.py: {path}: arms {sorted(record['raw'])} differ from "
                             f"{paths[0]}'s {arms}")
        pairs = pairs_of(record)
        for arm in arms:
            raw[arm] += [dict(r, pair=r["pair"] + offset) for r in record["raw"][arm]]
        offset += max(pairs) + 1 if pairs else 0
    return raw


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", nargs="+", help="bench_mtp record JSON files (two or more)")
    args = ap.parse_args(argv)
    if len(args.records) < 2:
        ap.error(f"expected two or more records, got {len(args.records)}")
    records = [load(p) for p in args.records]
    raw = pool(records, args.records)
    blocks = [row["block_size"] for row in records[0]["rows"]]
    rows = bench_mtp.per_prompt(SimpleNamespace(prompts=records[0]["prompts"],
                                                block_sizes=blocks), raw)
    lines = [f"# {records[0].get('topic', '?')}: {len(records)} takes pooled", ""]
    for path, r in zip(args.records, records):
        lines.append(f"- {path}: commit {str(r.get('git_commit', '?'))[:12]}, {r.get('date', '?')}, "
                     f"{len(pairs_of(r))} pairs, plain {rows_classic(r):.1f} tok/s")
    lines += bench_mtp.per_prompt_lines({"per_prompt": rows, "raw": raw})
    held = [(row["prompt"], row.get("auto_vs_best_fixed_held_out") or {}) for row in rows]
    if any(h for _, h in held):  # the tables round to 0.01, the size of the question
        lines += ["", "Auto / best fixed block, held out, to three decimals (median over the "
                      "pooled pairs): " + ", ".join(f"{name} {h['median']:.3f}"
                                                    for name, h in held if h) + "."]
    text = "\n".join(lines)
    print(text)
    return text


def rows_classic(record: dict) -> float:
    """The take's plain decode tok/s (median over its runs, as its record states it)."""
    return record["rows"][0]["classic_tps"] if record["rows"] else float("nan")


if __name__ == "__main__":
    main()
