"""The block-vs-chain exactness probe: per verify width, a synthetic prompt decoded one token at a
time (the chain arm) and verified as one block (the block arm), every position's logits row
compared as raw bytes, over ``PROBE_DRAWS`` draws. It uses only the ``Target`` protocol, draws no
random numbers, and memoizes its results per process. docs/exactness.md, "The probe"."""

from __future__ import annotations

import copy
import time
import weakref
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_mtp.cpu import blas as cpu_blas

EQUAL, DIVERGES, NOT_RUN = "equal", "diverges", "not_run"
PROBE_PROMPT_LEN = 8
PROBE_DRAWS = 3


@dataclass(frozen=True)
class ProbeResult:
    width: int  # tokens in the verify block (block size)
    verdict: str  # EQUAL, DIVERGES or NOT_RUN
    position: Optional[int] = None  # first block position whose logits row differs
    differing_bytes: int = 0  # bytes of that row that differ
    total_bytes: int = 0  # bytes in one logits row
    draw: Optional[int] = None  # which draw (0-based) diverged
    draws: int = PROBE_DRAWS
    reason: str = ""  # why the probe could not run
    config: str = ""  # the cache configuration probed when not the default (kv_bits)
    seconds: float = 0.0  # wall time of the probe run that produced this result
    cached: bool = False  # served from the process memo

    def describe(self) -> str:
        text = self._describe()
        return f"{text} [{self.config}]" if self.config else text

    def _describe(self) -> str:
        if self.verdict == EQUAL:
            return (f"width {self.width}: verify block equals the single-token chain byte for "
                    f"byte ({self.draws} draws, {self.total_bytes}-byte logits rows)")
        if self.verdict == DIVERGES:
            return (f"width {self.width}: verify block position {self.position} differs from the "
                    f"single-token chain in {self.differing_bytes} of {self.total_bytes} logit "
                    f"bytes (draw {self.draw + 1} of {self.draws})")
        return f"width {self.width}: the probe could not run ({self.reason})"

    def to_dict(self) -> dict:
        return asdict(self)


def aggregate_verdict(results: Iterable[ProbeResult]) -> str:
    """DIVERGES if any width diverges, else NOT_RUN if any could not run, else EQUAL."""
    verdicts = {r.verdict for r in results}
    for v in (DIVERGES, NOT_RUN):
        if v in verdicts:
            return v
    return EQUAL


def probe_tokens(vocab_size: int, width: int, draw: int) -> Tuple[List[int], List[int]]:
    """Deterministic synthetic (prompt, block) ids for one draw; no RNG state is touched."""
    salt = 1 + 911 * draw
    prompt = [(5 * i + salt) % vocab_size for i in range(PROBE_PROMPT_LEN)]
    block = [(11 * i + 3 + 2 * salt) % vocab_size for i in range(width)]
    return prompt, block


# ------------------------------------------------------------------------------------- the arms


def _eval_cache(target, cache) -> None:
    state = getattr(target, "cache_state", None)
    mx.eval(state(cache) if state is not None else [])


def prefilled_caches(target, prompt: Sequence[int], kv=None):
    """Fresh caches and the prompt fed as a session feeds it: all but the last token, then it.
    With ``kv`` (``KVSettings``) the caches turn quantized after the first call, as a session's
    do once they pass ``quantized_kv_start``."""
    cache = target.make_cache()
    ids = mx.array(prompt)[None]
    target.hidden(ids[:, :-1], cache)
    if kv is not None:
        kv.quantize_now(cache)
    _eval_cache(target, cache)
    mx.eval(target.hidden(ids[:, -1:], cache))
    _eval_cache(target, cache)
    return cache


def arm_caches(target, prompt: Sequence[int], kv, prefilled):
    """The arm's caches: a deep copy of ``prefilled`` (the ``prefilled_caches`` of ``prompt``;
    mlx-lm caches write their buffers in place, so each arm needs its own), else a prefill (also
    for caches that cannot be copied)."""
    if prefilled is not None:
        try:
            return copy.deepcopy(prefilled)
        except (TypeError, copy.Error):
            pass
    return prefilled_caches(target, prompt, kv)


def chain_rows(target, prompt: Sequence[int], block: Sequence[int], kv=None,
               prefilled=None) -> List[mx.array]:
    """Logits rows of single-token decode steps over ``block`` (what plain decoding computes).
    ``prefilled``: the caches after the prompt's prefill, copied instead of prefilling again."""
    cache = arm_caches(target, prompt, kv, prefilled)
    rows = []
    for t in block:
        h = target.hidden(mx.array([[t]]), cache)
        row = target.logits(h[:, -1])[0]
        mx.eval(row)
        _eval_cache(target, cache)
        rows.append(row)
    return rows


def block_rows(target, prompt: Sequence[int], block: Sequence[int], kv=None,
               prefilled=None) -> List[mx.array]:
    """Logits rows of one verify forward over ``block`` (what a speculative round computes).
    ``prefilled`` as in ``chain_rows``."""
    cache = arm_caches(target, prompt, kv, prefilled)
    with cpu_blas.verify_threads():  # as the round loop verifies
        h = target.verify(mx.array(block)[None], cache)
        logits = target.logits(h[0])
        mx.eval(logits)
    if logits.shape[0] != len(block):
        raise ValueError(f"verify returned {logits.shape[0]} rows for a block of {len(block)}")
    return [logits[i] for i in range(len(block))]


def first_difference(chain: Sequence[mx.array], block: Sequence[mx.array]):
    """``(position, differing_bytes, row_bytes)`` of the first row whose raw bytes differ, or None."""
    for i, (a, b) in enumerate(zip(chain, block)):
        if a.dtype != b.dtype or a.shape != b.shape:
            raise ValueError(f"logits row {i}: chain gives {a.dtype} {a.shape}, verify gives "
                             f"{b.dtype} {b.shape}")
        n = (a.view(mx.uint8) != b.view(mx.uint8)).sum().item()
        if n:
            return i, n, a.nbytes
    return None


# ------------------------------------------------------------------------------------- the memo

# target adapter -> {(width, precision, device): ProbeResult}; dies with the adapter.
_MEMO: "weakref.WeakKeyDictionary[Any, Dict[tuple, ProbeResult]]" = weakref.WeakKeyDictionary()


def model_signature(target) -> tuple:
    """Parameter dtypes, quantization modes and module classes of the target's model: a model
    cast, quantized or given other layer classes in place after a probe gets probed again."""
    module = getattr(target, "model", None)
    if module is None or not hasattr(module, "parameters"):
        return (str(getattr(target, "dtype", None)),)
    modules = [m for _, m in module.named_modules()]
    dtypes = {str(v.dtype) for _, v in tree_flatten(module.parameters())}
    quant = {(getattr(m, "mode", "affine"), m.bits, m.group_size)
             for m in modules if hasattr(m, "bits") and hasattr(m, "group_size")}
    classes = Counter(f"{type(m).__module__}.{type(m).__qualname__}" for m in modules)
    return tuple(sorted(dtypes)), tuple(sorted(quant)), tuple(sorted(classes.items()))


def _memo_for(target) -> Optional[Dict[tuple, ProbeResult]]:
    try:
        return _MEMO.setdefault(target, {})
    except TypeError:  # an adapter that cannot be weakly referenced is probed every time
        return None


def clear_memo() -> None:
    _MEMO.clear()


# ------------------------------------------------------------------------------------- the probe


def error_line(e: Exception) -> str:
    """Why a probe could not run, as one line: the exception's type and first line."""
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0]}" if msg else type(e).__name__


def _run(target, widths: List[int], draws: int, kv=None) -> Dict[int, ProbeResult]:
    """Probe ``widths`` (each >= 2) together: one chain arm per draw serves every width."""
    results: Dict[int, ProbeResult] = {}
    row_bytes: Dict[int, int] = {}
    vocab = getattr(target, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        return {w: ProbeResult(w, NOT_RUN, draws=draws,
                               reason="the target adapter reports no vocab_size") for w in widths}
    pending = list(widths)
    for draw in range(draws):
        if not pending:
            break
        prompt, block = probe_tokens(vocab, max(pending), draw)
        try:
            prefilled = prefilled_caches(target, prompt, kv)  # once per draw: each arm copies it
            chain = chain_rows(target, prompt, block, kv, prefilled)
        except Exception as e:
            for w in pending:
                results[w] = ProbeResult(w, NOT_RUN, draws=draws, reason=error_line(e))
            return results
        for w in list(pending):
            try:
                diff = first_difference(chain[:w], block_rows(target, prompt, block[:w], kv,
                                                              prefilled))
            except Exception as e:
                results[w] = ProbeResult(w, NOT_RUN, draws=draws, reason=error_line(e))
                pending.remove(w)
                continue
            row_bytes[w] = chain[0].nbytes
            if diff is not None:
                pos, n, total = diff
                results[w] = ProbeResult(w, DIVERGES, position=pos, differing_bytes=n,
                                         total_bytes=total, draw=draw, draws=draws)
                pending.remove(w)
    for w in pending:
        results[w] = ProbeResult(w, EQUAL, total_bytes=row_bytes[w], draws=draws)
    return results


def probe_exactness(target, widths: Iterable[int], *, draws: int = PROBE_DRAWS,
                    memoize: bool = True, kv=None) -> List[ProbeResult]:
    """One ``ProbeResult`` per requested width (sorted, each >= 2), memoized for the process.
    ``kv`` (``mlx_mtp.io.kv_settings.KVSettings``): probe against quantized KV caches instead."""
    widths = sorted(set(widths))
    if any(not isinstance(w, int) or w < 2 for w in widths):
        raise ValueError(f"probe widths must be integers >= 2, got {widths}")
    prepare = getattr(target, "prepare", None)
    if widths and callable(prepare):  # configure the target for these widths as a session does
        prepare(widths[-1])
    memo = _memo_for(target) if memoize else None
    config = kv.describe_cache() if kv is not None else ""
    key = (model_signature(target), str(mx.default_device()), draws, config)
    out: Dict[int, ProbeResult] = {}
    todo = []
    for w in widths:
        hit = memo.get((w,) + key) if memo is not None else None
        if hit is not None:
            out[w] = ProbeResult(**{**hit.to_dict(), "cached": True})
        else:
            todo.append(w)
    if todo:
        t0 = time.perf_counter()
        fresh = _run(target, todo, draws, kv)
        seconds = time.perf_counter() - t0
        for w, r in fresh.items():
            r = ProbeResult(**{**r.to_dict(), "seconds": seconds, "config": config})
            out[w] = r
            if memo is not None:
                memo[(w,) + key] = r
    return [out[w] for w in widths]
