"""The exactness gate: which promise a session keeps and whether MTP may run. At T=0 (byte
identity) MTP runs only where the probe finds every verify width the session may use equal to
the one-token chain on this device, else the session decodes plainly with mlx-lm and says why;
at T > 0 (the distribution) no probe runs. Also the stats' verify report and the CLI table's
gate rows. docs/exactness.md, "Two promises" and "The gate"."""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import List, Optional

from mlx_mtp import config as env
from mlx_mtp.exactness import grouped_experts, row_attention, row_exact_layers
from mlx_mtp.exactness.block_vs_chain import DIVERGES, EQUAL, ProbeResult, aggregate_verdict, probe_exactness
from mlx_mtp.exactness.tree_vs_chain import probe_tree_exactness
from mlx_mtp.exactness.device import (ARCH_OVERRIDE_ENV, FIRST_WIDE_KERNEL_GENERATION, DeviceFacts,
                             current_device_facts, narrow_kernel_architecture)

ALLOW_INEXACT_ENV = "MLX_MTP_ALLOW_INEXACT"
NOT_NEEDED = "not_needed"  # block size 1: no verify block, nothing to probe
SAMPLING = "sampling"  # T > 0: the promise is the distribution; no probe runs
# The promise a session keeps (``GateDecision.promise``, ``exactness.promise`` in the stats).
BYTE_IDENTITY = "byte-identity"  # T=0: token for token what plain greedy decode gives
DISTRIBUTION = "distribution"  # T > 0: distributed exactly as plain sampling
ROW_EXACT_ENV = "MLX_MTP_ROW_EXACT"
SAMPLING_REASON = ("temperature > 0: speculative sampling keeps the target's distribution on any "
                   "device (no byte-identity probe)")

logger = logging.getLogger("mlx_mtp")


def session_widths(block_size: int) -> List[int]:
    """Every verify width a session of ``block_size`` may run: the token budget trims the last
    rounds to fewer drafts, so all of 2..block_size (width 1 is the chain itself)."""
    return list(range(2, block_size + 1))


def allow_inexact_from_env(environ=None) -> bool:
    return env.flag(ALLOW_INEXACT_ENV, environ)


@dataclass
class GateDecision:
    mtp_enabled: bool
    verdict: str  # EQUAL, DIVERGES, NOT_RUN, or NOT_NEEDED (block size 1)
    reason: str  # one line, logged and put in the stats
    device: DeviceFacts
    override: bool = False  # MLX_MTP_ALLOW_INEXACT=1 turned a decline into an inexact MTP run
    probes: List[ProbeResult] = field(default_factory=list)
    promise: str = BYTE_IDENTITY

    @property
    def exact_verify(self) -> bool:
        """Whether the verify computes its rows with the row-exact products (``row_exact_layers``):
        wherever byte identity is promised and proven, and for a sampled session on the CPU,
        where they are the faster verify (docs/exactness.md, "Two promises"). Never under the
        override. ``MLX_MTP_ROW_EXACT=0`` still turns them off (``TrunkTarget.prepare``)."""
        if self.override:
            return False
        return self.promise == BYTE_IDENTITY or self.device.kind == "cpu"

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "override": self.override, "promise": self.promise,
                **self.device.to_dict(), "widths": [p.to_dict() for p in self.probes]}


def _failure(probes: List[ProbeResult], device: DeviceFacts) -> str:
    text = f"exactness probe on {device.describe()}: " + "; ".join(
        p.describe() for p in probes if p.verdict != EQUAL)
    gen = device.generation
    if device.kind == "metal" and gen is not None and gen >= FIRST_WIDE_KERNEL_GENERATION:
        text += (f" (on Apple GPU generation {FIRST_WIDE_KERNEL_GENERATION}+ MLX reduces "
                 "multi-row quantized matmuls differently from one-row decode steps")
        narrow = narrow_kernel_architecture(device.architecture)
        if narrow and aggregate_verdict(probes) == DIVERGES:
            text += (f"; {ARCH_OVERRIDE_ENV}={narrow} set before Python starts may restore the "
                     "one-row kernel: check with python -m mlx_mtp.probe")
        text += ")"
    return text


def decide(probes: List[ProbeResult], device: DeviceFacts, allow_inexact: bool,
           row_exact_on: bool = True) -> GateDecision:
    """The decision table at T=0: (device/generation, probe verdicts, override, whether the
    row-exact products are on) -> decision. Pure."""
    if not probes:
        return GateDecision(True, NOT_NEEDED, "block size 1: no verify block, nothing to probe",
                            device)
    verdict = aggregate_verdict(probes)
    if verdict == EQUAL:
        widths = ", ".join(str(p.width) for p in probes)
        return GateDecision(True, EQUAL, f"exactness probe on {device.describe()}: verify blocks "
                            f"of width {widths} equal the single-token chain byte for byte",
                            device, probes=probes)
    failure = _failure(probes, device)
    if not row_exact_on:
        failure += f" ({ROW_EXACT_ENV}=0: the verify ran without row-exact products)"
    if allow_inexact:
        return GateDecision(True, verdict, f"{ALLOW_INEXACT_ENV}=1: running MTP although the "
                            f"{failure}; output may differ from plain decoding", device,
                            override=True, probes=probes)
    return GateDecision(False, verdict, f"MTP declined, decoding plainly: {failure}. Set "
                        f"{ALLOW_INEXACT_ENV}=1 to run MTP anyway (output may then differ from "
                        "plain decoding)", device, probes=probes)


AUTO_WIDEST = "auto"  # ``sampling_decision``'s block size for ``block_size="auto"``


def sampling_decision(block_size, device: DeviceFacts) -> GateDecision:
    """T > 0: MTP runs, no probe, the verify on the device kind's faster kernels
    (``GateDecision.exact_verify``). ``block_size``: the widest
    verify (an int), or ``"auto"`` (drafts chosen per round)."""
    if block_size != AUTO_WIDEST and not session_widths(block_size):
        return GateDecision(True, NOT_NEEDED, "block size 1: no verify block, nothing to probe",
                            device, promise=DISTRIBUTION)
    return GateDecision(True, SAMPLING, SAMPLING_REASON, device, promise=DISTRIBUTION)


def check(model, block_size: int, device: Optional[DeviceFacts] = None,
          kv=None, sampling: bool = False) -> GateDecision:
    """The session's decision, its reason logged once. ``sampling`` (T > 0): no probe (module
    docstring). Else probe (memoized) every width the session may use and decide. ``kv``
    (``mlx_mtp.io.kv_settings.KVSettings``): the session quantizes its KV cache, so its verify
    blocks run against both caches; both are probed."""
    allow_inexact = allow_inexact_from_env()  # bad values fail before any work
    row_exact_on = env.flag(ROW_EXACT_ENV)
    device = device or current_device_facts()
    if sampling:
        decision = sampling_decision(block_size, device)
    else:
        widths = session_widths(block_size)
        probes = probe_exactness(model.target, widths) if widths else []
        if widths and kv is not None:
            probes += probe_exactness(model.target, widths, kv=kv)
        decision = decide(probes, device, allow_inexact, row_exact_on)
    _log_once(model.target, decision)
    return decision


# The reasons already logged for each target: a server checks the gate on every request, and its
# log should say the decision once, not once a request.
_logged_reasons: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _log_once(target, decision: GateDecision) -> None:
    seen = _logged_reasons.setdefault(target, set())
    if decision.reason in seen:
        return
    seen.add(decision.reason)
    if decision.override:
        logger.warning("WARNING: MTP output is NOT guaranteed to equal plain decoding. %s",
                       decision.reason)
    elif not decision.mtp_enabled:
        logger.warning("%s", decision.reason)
    else:
        logger.info("%s", decision.reason)


def apply(model, block_size: int, stats, kv=None, sampling: bool = False) -> GateDecision:
    """``check`` and write the decision into ``stats`` (``RunStats``)."""
    decision = check(model, block_size, kv=kv, sampling=sampling)
    stats.mtp_enabled = decision.mtp_enabled
    stats.gate_reason = decision.reason
    stats.exactness = decision.to_dict()
    return decision


def apply_tree(model, topk: int, nodes: int, depth: int, stats, kv=None) -> bool:
    """At T=0 with a draft tree (after ``apply`` let MTP run): whether the session drafts trees.
    The tree probe (``tree_vs_chain``) must find every node's row equal to the chain through its
    path, also on the quantized KV cache of a session with ``kv``; else the session drafts
    chains, and the stats say why. Under the override (``MLX_MTP_ALLOW_INEXACT=1``) trees run
    unprobed, as blocks do."""
    if allow_inexact_from_env():
        return True
    result = probe_tree_exactness(model.target, topk, nodes, depth)
    if result.verdict == EQUAL and kv is not None:
        result = probe_tree_exactness(model.target, topk, nodes, depth, kv=kv)
    stats.exactness["tree"] = result.to_dict()
    if result.verdict == EQUAL:
        return True
    reason = (f"draft tree declined, drafting chains: exactness probe on "
              f"{current_device_facts().describe()}: {result.describe()}")
    stats.gate_reason = f"{stats.gate_reason}; {reason}" if stats.gate_reason else reason
    seen = _logged_reasons.setdefault(model.target, set())
    if reason not in seen:
        seen.add(reason)
        logger.warning("%s", reason)
    return False


def report_verify(model, stats) -> None:
    """Once the target is prepared for the session's verify blocks: which layers compute rows
    how (``mlx_mtp.exactness.row_exact_layers``), where the verify uses the row-exact products."""
    if stats.mtp_enabled and getattr(model.target, "exact", False) and hasattr(model, "mlx_model"):
        stats.exactness["row_exact"] = verify_report(model.mlx_model)


def report_attention(stats, since: dict) -> None:
    """After a generation's rounds: how its verifies computed their attention rows (the
    attention kernel or one SDPA per row, counted from ``since``, an earlier
    ``row_attention.usage()``) and the kernel's checks (``row_attention.report``)."""
    info = stats.exactness.get("row_exact")
    if info is None:
        return
    now = row_attention.usage()
    info["attention"] = {**row_attention.report(),
                         "verifies": {k: now[k] - since.get(k, 0) for k in now}}


def attention_summary(exactness: dict) -> Optional[str]:
    """One cell for the CLI's stats table: the verify attentions by method, and the checks."""
    info = (exactness.get("row_exact") or {}).get("attention")
    if not info:
        return None
    counts = info.get("verifies", {})
    text = f"kernel {counts.get('kernel', 0)}, by rows {counts.get('rows', 0)}"
    checked = info.get("checked")
    if checked:
        text += " (" + "; ".join(f"{sig}: {verdict}" for sig, verdict in checked.items()) + ")"
    elif info["kernel"] != "available":
        text += f" (kernel {info['kernel']})"
    return text


def verify_report(mlx_model) -> dict:
    """How a verify computes its rows: the row-exact layers
    (``row_exact_layers.row_exact_report``) and, with mixture-of-experts layers, how each width
    computes them (``experts``: ``grouped_experts.experts_report``)."""
    out = row_exact_layers.row_exact_report(mlx_model)
    experts = grouped_experts.experts_report(mlx_model)
    if experts:
        out["experts"] = experts
    return out


def row_exact_summary(exactness: dict) -> Optional[str]:
    """One cell for the CLI's stats table: the row-exact layers by method, and the kernel."""
    info = exactness.get("row_exact")
    if not info:
        return None
    layers = info["layers"]
    text = (f"{sum(layers.values())} ("
            + ", ".join(f"{m} {n}" for m, n in sorted(layers.items())) + ")") if layers else "none"
    return f"{text}; row kernel {info['kernel']}"


def verdict_summary(exactness: dict) -> str:
    """One cell for the CLI's stats table: the verdict the run used."""
    verdict = exactness.get("verdict")
    if verdict in (None, NOT_NEEDED):
        return "not needed (no verify block)"
    if verdict == SAMPLING:
        return "not run (temperature > 0: the promise is the distribution)"
    widths = exactness.get("widths", [])
    text = f"{verdict} (width {', '.join(str(w['width']) for w in widths)}"
    bad = next((w for w in widths if w["verdict"] == DIVERGES), None)
    if bad is not None:
        text += (f"; width {bad['width']} position {bad['position']}: {bad['differing_bytes']} of "
                 f"{bad['total_bytes']} bytes differ")
    text += ")"
    return text + (f", overridden by {ALLOW_INEXACT_ENV}=1" if exactness.get("override") else "")


def gate_rows(result: dict, full: bool = False) -> list:
    """The CLI stats table's rows for the gate: whether MTP ran and what the output promises
    (the default table); ``full`` adds the probe's verdicts and how the verify computes its rows."""
    exactness = result.get("exactness") or {}
    if result["mtp_enabled"]:
        mtp = f"on, NOT exact ({ALLOW_INEXACT_ENV}=1)" if exactness.get("override") else "on"
    elif exactness:
        mtp = "off (declined by the exactness gate: mlx-lm plain decode)"
    else:
        mtp = f"off ({result['gate_reason']})"
    rows = [("mtp", mtp)]
    promise = exactness.get("promise")
    if exactness.get("override") or not result["mtp_enabled"]:
        if exactness.get("verdict") not in (None, NOT_NEEDED):
            rows.append(("exactness probe", verdict_summary(exactness)))
    elif promise == BYTE_IDENTITY and exactness.get("verdict") == EQUAL:
        rows.append(("exactness", "the same tokens as plain greedy decode (the probe checked "
                                  "this device)"))
    elif promise == DISTRIBUTION:
        rows.append(("exactness", "the same distribution as plain sampling"))
    if not full:
        return rows
    if rows[-1][0] != "exactness probe":
        rows.append(("exactness probe", verdict_summary(exactness)))
    tree = exactness.get("tree")
    if tree:
        rows.append(("tree probe", f"{tree['verdict']} ({tree['config']})"))
    layers = row_exact_summary(exactness)
    if layers is not None:
        rows.append(("row-exact layers", layers))
    attention = attention_summary(exactness)
    if attention is not None:
        rows.append(("verify attention", attention))
    experts = (exactness.get("row_exact") or {}).get("experts")
    if experts:
        rows.append(("expert layers", grouped_experts.experts_summary(experts)))
    return rows
