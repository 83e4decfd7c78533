"""What every benchmark shares: the prompts, the timing of one decode, the distinct-4-gram share of
an output, the record flags (``--out``, ``--summary``, ``--allow-busy``, ``--idle-window``,
``--retakes``, ``--wait-idle``), the idle check around a run (``benchmarks.idle``), the setup every
record states, the '## Setup' and '## What it says' lines of its markdown, writing it with its
pictures (``benchmarks.plots``), and finding the newest record of a topic.

A record is ``benchmark_results/<topic>-<host>-<date>.json`` and ``.md`` (``-contended`` before the
suffix when the machine was not idle), with its pictures ``<topic>-<host>-<date>-<name>.png``
beside them. The protocol every benchmark follows is docs/benchmarks.md.

MLX is imported only inside the functions that need it, so a launcher that runs no model itself
(``bench_split``) can use the flags and the idle check without loading it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import random
import re
import shlex
import socket
import statistics
import string
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from benchmarks import idle, plots  # (plots imports matplotlib only inside, lazily)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmark_results"
SUMMARY_TODO = "(to be written by the person who ran it)"


# ------------------------------------------------------------------------------ prompts


def random_characters(n: int = 64, seed: int = 0) -> str:
    """Fixed random printable characters (the same every run): text no head can predict."""
    rng = random.Random(seed)
    return "".join(rng.choice(string.ascii_letters + string.digits + "!#$%&*+-/=?@^~")
                   for _ in range(n))


# The benchmarks' default prompts: code, prose, a list the pair continues by rote, and text no
# head can predict (the floor of acceptance). Records name them; keep names and texts stable.
DEFAULT_PROMPTS = {
    "code": "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Parse the arguments and",
    "prose": "The history of the Python programming language begins in the late 1980s, when",
    "enumeration": "# The days of the week:\n# 1. Monday\n# 2. Tuesday\n# 3.",
    "random": random_characters(),
}
# Three more code openings, where blocks 3-5 and 6 trade places on the demo pair.
CODE_PROMPTS = {
    "code2": "import json\nimport os\n\n\ndef load(path):\n    \"\"\"Read the file and",
    "code3": "def main():\n    parser = argparse.ArgumentParser()\n",
    "code4": "import os\nimport sys\n\n\ndef main(argv):\n",
}
# The first ``def`` / ``class`` line of each standard-library file the demo pair was validated on
# (never trained on, never used to tune the block chooser): out-of-sample prompts for the pair.
HELD_OUT_OPENINGS = {
    "_strptime.py": "def _getlang():",
    "contextlib.py": "class AbstractContextManager(abc.ABC):",
    "distutils/command/config.py": "class config(Command):",
    "encodings/cp1026.py": "class Codec(codecs.Codec):",
    "multiprocessing/dummy/connection.py": "class Listener(object):",
    "multiprocessing/heap.py": "class Heap(object):",
    "sunau.py": "class Error(Exception):",
    "xml/sax/saxutils.py": "def __dict_replace(s, d):",
    "zoneinfo/__init__.py": "def __getattr__(name):",
}
PROMPT_SETS = {"default": DEFAULT_PROMPTS, "code": CODE_PROMPTS, "held-out": HELD_OUT_OPENINGS}


def int_list(p: argparse.ArgumentParser, flag: str, text: str) -> List[int]:
    """``text`` (a flag's value) as comma-separated integers, else a usage error naming ``flag``."""
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        p.error(f"{flag}: expected comma-separated integers, got {text!r}")


def add_prompt_args(p: argparse.ArgumentParser, default: str = "default") -> None:
    """``--prompts NAME`` (a set of ``PROMPT_SETS``) or ``--prompts-json FILE``."""
    p.add_argument("--prompts", choices=sorted(PROMPT_SETS), default=default,
                   help=f"prompt set (default {default}: "
                        + ", ".join(PROMPT_SETS[default]) + ")")
    p.add_argument("--prompts-json", metavar="FILE",
                   help="a JSON object {name: prompt} instead of --prompts")


def pair_info(path) -> dict:
    """``realistic_pair.json`` of the pair a model folder belongs to (the folder itself, or its
    parent for a pair of two folders such as Gemma 4's target and assistant); {} if none."""
    for folder in (Path(path), Path(path).parent):
        f = folder / "realistic_pair.json"
        if f.is_file():
            return json.loads(f.read_text())
    return {}


def read_prompts(path) -> Dict[str, str]:
    """The prompts of a JSON file ``{name: prompt}``; ValueError saying what is wrong."""
    try:
        prompts = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"expected a JSON object ({e})") from None
    if not isinstance(prompts, dict) or not all(isinstance(v, str) and v
                                                for v in prompts.values()):
        raise ValueError("expected a JSON object of non-empty prompt strings")
    return prompts


def prompts_of(args, parser: argparse.ArgumentParser) -> Dict[str, str]:
    """The prompts ``add_prompt_args``' flags chose (a bad ``--prompts-json`` is a usage error)."""
    if args.prompts_json:
        try:
            return read_prompts(args.prompts_json)
        except ValueError as e:
            parser.error(f"--prompts-json {args.prompts_json}: {e}")
    return dict(PROMPT_SETS[args.prompts])


# ------------------------------------------------------------------------------ outputs


def distinct_ngram_share(ids: Sequence[int], n: int = 4) -> Optional[float]:
    """The share of distinct n-grams among all n-grams of ``ids`` (len(ids) - n + 1 of them): 1.0
    when no n tokens repeat, near 0 for an output stuck in a loop. None for fewer than n ids.

    A head drafts a loop well, so a loop lifts acceptance and tok/s far above what the pair does
    on text; records carry this share per prompt so loops are kept apart from headline numbers."""
    ids = list(ids)
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    total = len(ids) - n + 1
    if total < 1:
        return None
    return len({tuple(ids[i:i + n]) for i in range(total)}) / total


# ------------------------------------------------------------------------------ timing


def bandwidth_gbs(mb: int = 256, repeats: int = 5) -> float:
    """Streaming-read bandwidth: a one-row f32 matvec over a matrix much larger than the caches
    (median of ``repeats``). A decode step that reads B bytes of weights takes at least
    B / bandwidth: the floor the records state each step against."""
    import mlx_mtp  # noqa: F401  (first: binds the system BLAS before mlx.core loads)
    import mlx.core as mx

    n = int((mb * 2**20 / 4) ** 0.5)
    w = mx.random.normal((n, n), key=mx.random.key(0))
    x = mx.random.normal((1, n), key=mx.random.key(1))
    mx.eval(w, x)
    mx.eval(x @ w.T)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(x @ w.T)
        times.append(time.perf_counter() - t0)
    return w.nbytes / statistics.median(times) / 1e9


@contextlib.contextmanager
def environment(name: str, value: str):
    """The body with ``name`` set to ``value`` in the environment (mlx_mtp reads its variables
    when it uses them); what was there before is put back."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def nbytes(module, skip=()) -> int:
    """Bytes of ``module``'s parameters, less those whose path starts with one of ``skip``."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for k, v in tree_flatten(module.parameters())
               if not any(k.startswith(s) for s in skip))


def experts_per_token(args) -> int:
    """The experts a token is routed to (0: no mixture of experts), from a model's args."""
    return int(getattr(args, "num_experts_per_tok", 0) or getattr(args, "top_k_experts", 0) or 0)


def unrouted_bytes(module, top_k: int) -> int:
    """Bytes of ``module``'s routed expert stacks (mlx-lm's ``SwitchGLU``) that a one-token step
    does not read: all but ``top_k`` of each layer's experts."""
    from mlx_lm.models.switch_layers import SwitchGLU

    skipped = 0
    for _, m in module.named_modules():
        if isinstance(m, SwitchGLU) and top_k:
            experts = m.up_proj.num_experts
            skipped += nbytes(m) * (experts - min(top_k, experts)) // experts
    return skipped


def step_bytes(model) -> dict:
    """Weight bytes one decode step must read: the target (its input embedding is a row lookup,
    unless tied, when it is also the LM head; of a mixture of experts' stacks, only its top-k
    experts) and one drafter step: the Qwen head (of an MoE layer, its top-k experts) and the LM
    head it borrows (with a draft vocabulary, only its rows), or the Gemma 4 assistant with its
    own head (with the centroid head, only the ``top_k`` of ``num_centroids`` clusters of that
    head a step ranks)."""
    from mlx.utils import tree_flatten

    target = model.target
    tied = target.args.tie_word_embeddings
    top_k = experts_per_token(target.args)
    emb = target.trunk.embed_tokens
    emb_bytes = sum(v.nbytes for _, v in tree_flatten(emb.parameters()))
    total = nbytes(target.model) - unrouted_bytes(target.model, top_k)
    target_step = total - (0 if tied else emb_bytes)
    lm_head = emb_bytes if tied else nbytes(target.lm.lm_head)
    out = {"target_step_bytes": target_step, "lm_head_bytes": lm_head}
    drafter = model.drafter
    if drafter is not None and hasattr(drafter, "head"):
        lm = getattr(drafter, "lm", None)
        head = nbytes(drafter.head) - unrouted_bytes(drafter.head, top_k)
        if lm is not None and lm.ids is not None:
            rows = lm.tensors.nbytes
            out["drafter_step_bytes"] = head + rows
            out["drafter_step_reads"] = (f"head + the LM head's {lm.ids.size} draft-vocabulary "
                                         f"rows {rows / 1e6:.1f} MB")
        else:
            out["drafter_step_bytes"] = head + lm_head
            out["drafter_step_reads"] = "head + borrowed LM head"
    elif drafter is not None and hasattr(drafter, "assistant"):
        a = drafter.assistant
        read = nbytes(a)
        if "masked_embedding" in a:
            m = a.masked_embedding
            read -= round(nbytes(a.model.embed_tokens) * (1 - m.top_k / m.num_centroids))
        out["drafter_step_bytes"] = read
        out["drafter_step_reads"] = "the assistant, its own head included"
    return out


def plain_decode(mlx_model, prompt, n: int, sampler=None, processors=None):
    """mlx-lm's own plain decode of ``n`` tokens: (tokens, prompt_s, generation_s), the
    generation seconds running from the first token to the last. ``processors``: mlx-lm's
    logits processors (e.g. a repetition penalty), the same for both arms."""
    from mlx_lm.generate import generate_step

    t0 = time.perf_counter()
    toks, t1 = [], None
    for tok, _ in generate_step(prompt, mlx_model, max_tokens=n, sampler=sampler,
                                logits_processors=processors):
        if t1 is None:
            t1 = time.perf_counter()
        toks.append(tok)
    return toks, t1 - t0, time.perf_counter() - t1


def mtp_decode(model, prompt, n: int, block_size, sampler=None, acceptance: str = "auto",
               seed=None, max_block_size: int = 6, processors=None, draft_topk: int = 1,
               draft_tokens=None):
    """mlx_mtp's decode of ``n`` tokens: (tokens, prompt_s, generation_s, RunStats), timed as
    ``plain_decode``; ``draft_topk`` / ``draft_tokens``: draft trees (``generate_step``'s)."""
    import mlx_mtp
    from mlx_mtp.decoding.stats import RunStats

    stats = RunStats()
    t0 = time.perf_counter()
    toks, t1 = [], None
    for tok, _ in mlx_mtp.generate_step(prompt, model, max_tokens=n, block_size=block_size,
                                        max_block_size=max_block_size, stats=stats,
                                        sampler=sampler, acceptance=acceptance, seed=seed,
                                        logits_processors=processors, draft_topk=draft_topk,
                                        draft_tokens=draft_tokens):
        if t1 is None:
            t1 = time.perf_counter()
        toks.append(tok)
    return toks, t1 - t0, time.perf_counter() - t1, stats


PLAIN = "plain"  # plain decode's arm in ``paired_runs``


def paired_runs(prompts: Dict, arms: Dict, pairs: int, unit, plain):
    """Plain decode and every arm on each prompt, ``pairs`` times, the order reversed and the
    first arm moved last every other pair; each pair of a prompt one ``unit``
    (``idle.Watch.runner``). ``arms``: name -> ``decode(prompt)`` returning ``mtp_decode``'s
    tuple; ``plain(prompt)``: ``plain_decode``'s. Returns ``(raw, exact, plain_tokens)``: per arm
    (and ``PLAIN``) one entry per run (pair, prompt, gen_s, tps, distinct 4-gram share, the
    arm's stats), whether every run of an arm emitted plain decode's tokens, and plain decode's
    tokens per prompt."""
    names = list(arms)
    raw = {PLAIN: [], **{a: [] for a in names}}
    exact = {a: True for a in names}
    plain_tokens = {}
    for pair in range(pairs):
        for name, prompt in prompts.items():
            order = [None] + (names if pair % 2 == 0 else names[::-1])
            if pair % 2:
                order = order[1:] + order[:1]  # alternate which arm goes first

            def measure():
                out = {}
                for arm in order:
                    if arm is None:
                        toks, _, gs = plain(prompt)
                        out[PLAIN] = {"tokens": toks, "gen_s": gs}
                    else:
                        toks, _, gs, st = arms[arm](prompt)
                        out[arm] = {"tokens": toks, "gen_s": gs, "stats": st.to_dict()}
                return out

            results = unit(f"pair {pair} {name}", measure)
            plain_tokens[name] = results[PLAIN]["tokens"]
            for arm, r in results.items():
                r["tps"] = (len(r["tokens"]) - 1) / r["gen_s"]
                r["distinct_4gram_share"] = distinct_ngram_share(r["tokens"])
                if arm != PLAIN:
                    exact[arm] &= r["tokens"] == results[PLAIN]["tokens"]
                raw[arm].append({"pair": pair, "prompt": name,
                                 **{k: v for k, v in r.items() if k != "tokens"}})
            print(f"pair {pair} {name}: " + ", ".join(
                f"{a} {r['tps']:.1f}" for a, r in results.items()), flush=True)
    return raw, exact, plain_tokens


def alternating_passes(units: Sequence, arms: Sequence[str], run, pairs: int, same):
    """A warm-up pass, not kept, then ``pairs`` counted passes; each pass runs every arm on
    every unit, the arms' order reversed every other pass. ``run(unit, arm)`` returns
    ``(seconds, output)``; each output is compared with the first arm's of the same pass by
    ``same(first, output)``. Returns ``(seconds, identical)``: per unit and arm, the counted
    runs' seconds, and whether every output equaled the first arm's."""
    seconds = {u: {arm: [] for arm in arms} for u in units}
    identical = {u: {arm: True for arm in arms} for u in units}
    for i in range(pairs + 1):
        for u in units:
            outs = {}
            for arm in (arms if i % 2 == 0 else arms[::-1]):
                s, outs[arm] = run(u, arm)
                if i > 0:
                    seconds[u][arm].append(s)
            for arm in arms:
                identical[u][arm] &= same(outs[arms[0]], outs[arm])
    return seconds, identical


def paired_timing(seconds: Sequence[float], base: Sequence[float]) -> dict:
    """Milliseconds (median, min, max) of ``seconds`` and its speedup over ``base`` run by run
    (``base[i] / seconds[i]``: median, min, max), for a record's row."""
    ratios = [b / s for b, s in zip(base, seconds)]
    return {"ms": 1e3 * statistics.median(seconds), "ms_min": 1e3 * min(seconds),
            "ms_max": 1e3 * max(seconds), "speedup": statistics.median(ratios),
            "speedup_min": min(ratios), "speedup_max": max(ratios)}


def synced_runs(prompts: Dict, arms: Dict, reps: int, unit) -> List[dict]:
    """``reps`` runs per prompt of every arm (``paired_runs``' ``arms``) with each phase synced
    (MLX_MTP_SYNC_PHASES=1), so the stats' phase split times each phase's own work; each
    prompt's runs one ``unit``. One ``{"arm", "prompt", "stats"}`` per run."""
    from mlx_mtp.decoding.rounds import SYNC_PHASES_ENV

    out = []
    with environment(SYNC_PHASES_ENV, "1"):
        for rep in range(reps):
            for name, prompt in prompts.items():
                def measure():
                    return [{"arm": arm, "prompt": name, "stats": decode(prompt)[3].to_dict()}
                            for arm, decode in arms.items()]
                out += unit(f"synced {rep} {name}", measure)
    return out


# ------------------------------------------------------------------------------ flags and the run


def add_record_args(p: argparse.ArgumentParser, summary: bool = True, units: bool = False) -> None:
    """The flags of a script that writes a record: where, its summary, and the idle check's
    (``--retakes`` for a benchmark that measures in units: ``idle.Watch.unit``)."""
    p.add_argument("--out", type=Path, default=RESULTS)
    if summary:
        p.add_argument("--summary", default=None, help="the record's 'What it says' paragraph")
    p.add_argument("--allow-busy", action="store_true", help=idle.ALLOW_BUSY_HELP)
    p.add_argument("--idle-window", type=float, default=2.0, help=idle.WINDOW_HELP)
    if units:
        p.add_argument("--retakes", type=int, default=24, help=idle.RETAKES_HELP)
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                   help=idle.WAIT_HELP)


def add_render_arg(p: argparse.ArgumentParser) -> None:
    """``--render RECORD.json``: no run, the record's .md and pictures again from its JSON."""
    p.add_argument("--render", type=Path, metavar="RECORD.json",
                   help="no run: redraw this record's pictures and link them from its .md "
                        "(with --summary: also store it and rewrite the .md from the JSON)")


def render_instead(args, p: argparse.ArgumentParser, render_fn, kind: Optional[str]
                   ) -> Optional[dict]:
    """With ``--render``: the record rendered again (``rerender_record``), for the script to
    return instead of running; else None, once ``--model`` is checked to be given."""
    if args.render is not None:
        return rerender_record(args.render, render_fn, kind, args.summary)
    if not getattr(args, "model", None):
        p.error("--model is required (or --render RECORD.json)")
    return None


def watch(args) -> idle.Watch:
    """Start the idle check before the run (refused on a busy machine, at once or after
    ``--wait-idle`` seconds, unless ``--allow-busy``)."""
    retakes = getattr(args, "retakes", 0)
    if retakes < 0 or args.wait_idle < 0:
        sys.exit(f"error: --retakes and --wait-idle must be >= 0, got {retakes} and "
                 f"{args.wait_idle:g}")
    return idle.Watch(args.idle_window, args.allow_busy, retakes=retakes,
                      wait_s=args.wait_idle)


def finish(args, result: dict, watch: idle.Watch, render_fn,
           kind: Optional[str] = None) -> dict:
    """After the run: finish the idle check (refuse, or label the record), add ``--summary`` and
    write the record (``write_record``)."""
    result = idle.attach(result, watch, args.allow_busy)
    if args.summary:
        result["summary"] = args.summary
    write_record(args.out, result, render_fn, kind)
    return result


# ------------------------------------------------------------------------------ the setup


def record_setup(topic: str) -> dict:
    """The setup every record states (docs/benchmarks.md): topic, date, host, versions, BLAS,
    commit, the exact command and the environment variables that steer MLX and the BLAS."""
    from mlx_mtp.cpu import blas as cpu_blas  # first: binds the system BLAS before mlx.core loads

    return {
        "topic": topic, "date": _dt.date.today().isoformat(), "host": host_facts(),
        "versions": versions(), "cpu_blas": cpu_blas.STATE.describe(),
        "git_commit": git_commit(), "command": command_line(),
        "env": {k: v for k, v in os.environ.items()
                if k.startswith(("MLX", "BLIS", "OPENBLAS", "OMP"))},
    }


def command_line(argv: Optional[List[str]] = None) -> str:
    """The command that ran (``sys.argv``), a module of this repository as ``python -m`` names
    it (``python -m benchmarks.bench_mtp ...``), not as the path Python reports for it."""
    argv = list(sys.argv if argv is None else argv)
    if argv and argv[0].endswith(".py"):
        path = Path(argv[0]).resolve()
        if ROOT in path.parents:
            argv[:1] = ["python", "-m", ".".join(path.relative_to(ROOT).with_suffix("").parts)]
    return " ".join(shlex.quote(a) for a in argv)


def host_facts() -> dict:
    import mlx_mtp  # noqa: F401  (first: binds the system BLAS before mlx.core loads)
    import mlx.core as mx

    from mlx_mtp.cpu import blas as cpu_blas

    mem = None
    try:
        mem = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    return {"name": socket.gethostname(), "cpu": idle.cpu_model(),
            "cores": cpu_blas.usable_cores(),
            "memory_gib": mem, "os": platform.platform(), "device": str(mx.default_device())}


def versions() -> dict:
    from importlib.metadata import version

    import mlx_mtp

    return {p: version(p) for p in ("mlx", "mlx-lm")} | {"mlx_mtp": mlx_mtp.__version__,
                                                         "python": platform.python_version()}


def git_commit() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True,
                               text=True).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# ------------------------------------------------------------------------------ the markdown


def setup_lines(r: dict, *, memory: bool = False, device: bool = True, blas: bool = True,
                env: bool = True) -> List[str]:
    """The record's title and the start of its '## Setup': host, versions, BLAS, commit, command,
    environment. ``memory``: the host line gives the memory (and, where it is unknown, only the
    CPU and OS); ``device``, ``blas``, ``env``: whether those are stated (a record of several
    processes with their own BLAS states it per arm instead)."""
    h = r["host"]
    if memory and not h["memory_gib"]:
        host = f"- Host: {h['cpu']}, {h['os']}"
    else:
        host = (f"- Host: {h['cpu']}, {h['cores']} cores"
                + (f", {h['memory_gib']:.0f} GiB" if memory else "") + f", {h['os']}"
                + (f", device {h['device']}" if device else ""))
    lines = [f"# {r['topic']} on {h['name']}, {r['date']}", "", "## Setup", host,
             "- Versions: " + ", ".join(f"{k} {v}" for k, v in r["versions"].items())]
    if blas:
        lines.append(f"- BLAS: {r['cpu_blas']}")
    lines += [f"- Commit: {r['git_commit']}", f"- Command: `{r['command']}`"]
    if env:
        lines.append(f"- Environment: {r['env'] or 'none set'}")
    return lines


def what_it_says(r: dict) -> List[str]:
    """The record's last section: the summary of whoever ran it, or a placeholder."""
    summary = r.get("summary")
    return ["", "## What it says", "", SUMMARY_TODO if summary is None else summary, ""]


def render_markdown(result: dict, render_fn) -> str:
    """The record's markdown: ``render_fn``'s, with the idle check the run saw."""
    return idle.annotate(render_fn(result), result.get("idle_check"))


# ------------------------------------------------------------------------------ writing


def write_record(out: Path, result: dict, render_fn, kind: Optional[str] = "mtp") -> None:
    """``<topic>-<host>-<date>.json``, the ``.md`` that ``render_fn`` makes of it with the idle
    check in it (``-contended`` in the name when the machine was not idle), and the record's
    pictures (``benchmarks.plots``, ``kind`` "mtp", "drafter" or "server"; None: a record without
    pictures) linked from the ``.md``."""
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{result['topic']}-{result['host']['name']}-{result['date']}"
    stem += "-contended" if idle.is_contended(result) else ""
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    try:
        pictures = plots.draw(result, out / stem, kind) if kind else []
    except ImportError as e:  # matplotlib is an optional extra: the record stands without it
        print(e)
        pictures = []
    md = plots.embed(render_markdown(result, render_fn), pictures, out)
    (out / f"{stem}.md").write_text(md)
    print(f"wrote {out / stem}.md and .json"
          + (f" and {len(pictures)} pictures" if pictures else ""))


def rerender_record(path: Path, render_fn, kind: Optional[str] = "mtp",
                    summary: str = None) -> dict:
    """``--render RECORD.json``: draw the record's pictures again from its JSON (no run) and link
    them from its ``.md`` (which is otherwise kept; written from the JSON if absent). With
    ``summary``: also store it in the JSON and rewrite the whole ``.md`` from the JSON.
    ``kind`` None: a record without pictures (only the summary and the .md)."""
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: --render {path}: expected a record's .json ({e})")
    if not isinstance(result, dict):
        raise SystemExit(f"error: --render {path}: expected a record's .json (a JSON object)")
    if kind is not None:
        problem = plots.check(result, kind)
        if problem:
            raise SystemExit(f"error: --render {path}: {problem}")
        if not plots.available():
            raise SystemExit(f"error: --render needs matplotlib: {plots.INSTALL}")
    path = Path(path)
    md_path = path.with_suffix(".md")
    pictures = [] if kind is None else plots.draw(result, path.with_suffix(""), kind)
    if summary is not None:
        result["summary"] = summary
        path.write_text(json.dumps(result, indent=1))
    md = (md_path.read_text() if summary is None and md_path.exists()
          else render_markdown(result, render_fn))
    md_path.write_text(plots.embed(md, pictures, md_path.parent))
    print(f"rewrote {md_path} and {len(pictures)} pictures")
    return result


# ------------------------------------------------------------------------------ finding records

# <topic>-<host>-<YYYY-MM-DD>[-contended], then ".json", ".md" or "-<picture>.png"
_DATE = r"(?P<date>\d{4}-\d{2}-\d{2})(?P<contended>-contended)?"


def record_date(path) -> Optional[str]:
    """The date in a record file's name (``YYYY-MM-DD``), or None for a file that has none."""
    m = re.search(r"-" + _DATE + r"(\.json|\.md|-[A-Za-z0-9_]+\.png)$", Path(path).name)
    return m.group("date") if m else None


def topic_records(topic: str, folder: Path = RESULTS, contended: bool = False) -> List[Path]:
    """The JSON records of ``topic`` in ``folder``, oldest first (by the date in the name).

    ``folder/<topic>-*.json`` also matches longer topics (``drafter-phases-*`` holds
    ``drafter-phases-demo-pair-...``), so a file counts when the topic it states is ``topic``.
    Contended records ("not a result") only with ``contended``."""
    out = []
    for path in Path(folder).glob(f"{glob_escape(topic)}-*.json"):
        m = re.fullmatch(re.escape(topic) + r"-(?P<host>.+)-" + _DATE + r"\.json", path.name)
        if not m or (m.group("contended") and not contended):
            continue
        try:
            stated = json.loads(path.read_text()).get("topic")
        except (OSError, ValueError, AttributeError):
            continue
        if stated == topic:
            out.append(path)
    return sorted(out, key=lambda p: (record_date(p), p.name))


def newest_record(topic: str, folder: Path = RESULTS) -> Path:
    """The newest record of ``topic`` (``folder/<topic>-<host>-<date>.json``); FileNotFoundError
    naming the topic and folder when there is none."""
    found = topic_records(topic, folder)
    if not found:
        raise FileNotFoundError(f"no record of topic {topic!r} in {folder}")
    return found[-1]


def superseded(topic: str, folder: Path = RESULTS) -> List[Path]:
    """Every file of ``topic``'s records but the newest record's: older records' ``.json``,
    ``.md`` and pictures, pictures or markdown left of a record whose JSON is gone, and the
    topic's contended records. [] when the topic has no record that is not contended."""
    records = topic_records(topic, folder, contended=True)
    clean = [p for p in records if not p.name.endswith("-contended.json")]
    if not clean:
        return []
    name = re.compile(re.escape(topic) + r"-(?P<host>.+)-" + _DATE
                      + r"(\.json|\.md|-[A-Za-z0-9_]+\.png)")
    keep = name.fullmatch(clean[-1].name)
    out = []
    for host in {name.fullmatch(p.name).group("host") for p in records}:
        for path in Path(folder).glob(f"{glob_escape(topic)}-{glob_escape(host)}-*"):
            m = name.fullmatch(path.name)
            if not m or m.group("host") != host:
                continue
            if (host, m.group("date"), m.group("contended")) != (
                    keep.group("host"), keep.group("date"), None):
                out.append(path)
    return sorted(out)


def glob_escape(text: str) -> str:
    """``text`` with glob's special characters taken literally."""
    return re.sub(r"([*?\[])", r"[\1]", text)
