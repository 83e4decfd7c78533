"""Per-run statistics of the speculative round loop. Passed into the loop, never global."""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

PHASES = ("verify", "draft", "accept", "finalize", "residual")


@dataclass
class RunStats:
    block_size: Union[int, str] = 1  # as requested: an integer or "auto"
    max_block_size: int = 1  # the widest verify the session may use
    prompt_tokens: int = 0
    prompt_s: float = 0.0
    generation_tokens: int = 0
    generation_s: float = 0.0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    host_syncs: int = 0
    draft_syncs: int = 0  # evaluations / host reads while drafting (one per block with device_ids)
    # auto: rounds without drafts run as pipelined one-token steps (a stretch up to the next probe)
    undrafted_steps: int = 0
    # True (MLX_MTP_SYNC_PHASES=1): each phase was evaluated before the next, so phase_s times its
    # device work. False: the draft and accept hook were queued, and their device work is timed in
    # the phase that waits for it (the verify's host read).
    phases_synced: bool = False
    # offered[j] / hits[j]: rounds in which a draft at position j + 1 was made / accepted.
    offered: List[int] = field(default_factory=list)
    hits: List[int] = field(default_factory=list)
    # block_sizes[w]: rounds whose verify was w tokens wide (w - 1 drafts)
    block_sizes: Dict[int, int] = field(default_factory=dict)
    phase_s: Dict[str, float] = field(default_factory=lambda: {p: 0.0 for p in PHASES})
    # verify width (tokens in the block) -> [verify phase seconds summed, rounds]
    verify_by_width: Dict[int, List[float]] = field(default_factory=dict)
    rounds_s: float = 0.0
    # verify width -> [rounds, mean, sum of squared deviations] of log(round wall seconds)
    # (Welford): how far a width's round times spread within one run, the noise a chooser's
    # cost estimates see (tools/simulate_chooser.py --sigma record replays with it)
    round_log_s: Dict[int, List[float]] = field(default_factory=dict)
    peak_memory_gb: float = 0.0
    # Draft trees (mlx_mtp.draft_tree): the shape, nodes verified over the run, and
    # accepted nodes by their rank among their siblings (0: the drafter's first choice).
    draft_topk: int = 1
    draft_tokens: Optional[int] = None
    tree_nodes: int = 0
    tree_rounds: int = 0  # rounds that drafted a tree (all drafting rounds but under ``auto``)
    sibling_rank_hits: List[int] = field(default_factory=list)
    # greedy / point-mass / speculative-sampling (``mlx_mtp.decoding.sampling``); None when no
    # MTP loop ran.
    acceptance_rule: Optional[str] = None
    # The logits processors on the drafts (mlx_mtp.decoding.draft_processing): "applied",
    # "not applied: <why>", or None (no processors, or no draft made).
    draft_processors: Optional[str] = None
    # The exactness gate's decision (mlx_mtp.exactness.gate): MTP on or declined, why, and the
    # probe.
    mtp_enabled: bool = True
    gate_reason: str = ""
    exactness: Dict[str, object] = field(default_factory=dict)
    # mlx_mtp.models.draft_profile.DraftProfiler of the run (None when no MTP loop ran)
    draft_profiler: Optional[Any] = None

    # A split target (mlx_mtp.models.distributed): this rank's collectives and their payload bytes
    # from the prefill on (the exactness probe excluded); None when not split.
    split: Optional[str] = None
    split_messages: int = 0
    split_bytes: int = 0

    def count_split(self, split):
        """Start counting ``split``'s collectives; returns the function that brings the counts
        up to date (a no-op when not split)."""
        if split is None:
            return lambda: None
        self.split = split.describe()
        base = split.counter.snapshot()

        def update():
            m, b = split.counter.snapshot()
            self.split_messages, self.split_bytes = m - base[0], b - base[1]
        return update

    @contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phase_s[name] += time.perf_counter() - t0

    def record_verify(self, width: int, seconds: float) -> None:
        acc = self.verify_by_width.setdefault(width, [0.0, 0])
        acc[0] += seconds
        acc[1] += 1

    def verify_ms_by_width(self) -> Dict[int, float]:
        """Mean verify-phase ms per round, by verify width."""
        return {w: 1e3 * s / n for w, (s, n) in sorted(self.verify_by_width.items()) if n}

    def record_round(self, drafted: int, accepted: int, wall_s: float,
                     own_time: bool = True) -> None:
        """A round of ``drafted`` drafts, ``accepted`` kept, ``wall_s`` seconds. ``own_time``
        False: a pipelined one-token step, whose ``wall_s`` is the time between two host reads
        (mostly the next step's work): counted in the run's time, not in the spread of round
        times (``round_spread_by_width``)."""
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.rounds_s += wall_s
        self.block_sizes[drafted + 1] = self.block_sizes.get(drafted + 1, 0) + 1
        if own_time and wall_s > 0:
            acc = self.round_log_s.setdefault(drafted + 1, [0, 0.0, 0.0])
            x = math.log(wall_s)
            acc[0] += 1
            delta = x - acc[1]
            acc[1] += delta / acc[0]
            acc[2] += delta * (x - acc[1])
        while len(self.offered) < drafted:
            self.offered.append(0)
            self.hits.append(0)
        for j in range(drafted):
            self.offered[j] += 1
            self.hits[j] += j < accepted

    def record_tree(self, tree, path: List[int]) -> None:
        """A verified draft tree and the walked path (root first)."""
        self.tree_nodes += len(tree.parents) - 1
        self.tree_rounds += 1
        for node in path[1:]:
            rank = tree.ranks[node]
            while len(self.sibling_rank_hits) <= rank:
                self.sibling_rank_hits.append(0)
            self.sibling_rank_hits[rank] += 1

    def round_spread_by_width(self) -> Dict[int, Dict[str, float]]:
        """Per verify width timed in two rounds or more: the rounds and the standard deviation of
        log(round wall time) among them (0.03: a round's time typically within 3% of the
        width's geometric mean). Pipelined one-token steps (block 1, ``auto``'s stretches
        without drafts) are not rounds with a time of their own and are left out."""
        return {w: {"rounds": int(n), "log_sd": math.sqrt(m2 / (n - 1))}
                for w, (n, _, m2) in sorted(self.round_log_s.items()) if n >= 2}

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def per_position_acceptance(self) -> List[float]:
        return [h / o if o else 0.0 for h, o in zip(self.hits, self.offered)]

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_s if self.prompt_s else 0.0

    @property
    def generation_tps(self) -> float:
        return self.generation_tokens / self.generation_s if self.generation_s else 0.0

    def phase_ms(self) -> Dict[str, float]:
        """Wall ms per phase summed over the run; residual = round wall minus the named phases."""
        named = sum(v for k, v in self.phase_s.items() if k != "residual")
        out = {k: 1e3 * v for k, v in self.phase_s.items()}
        out["residual"] = 1e3 * max(self.rounds_s - named, 0.0)
        return out

    def to_dict(self) -> dict:
        return {
            "block_size": self.block_size,
            "max_block_size": self.max_block_size,
            "block_sizes": {str(w): n for w, n in sorted(self.block_sizes.items())},
            "prompt_tokens": self.prompt_tokens,
            "prompt_tps": self.prompt_tps,
            "generation_tokens": self.generation_tokens,
            "generation_tps": self.generation_tps,
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_round": self.tokens_per_round,
            "per_position_acceptance": self.per_position_acceptance,
            "per_position_rounds": list(self.offered),
            "host_syncs_per_round": self.host_syncs / self.rounds if self.rounds else 0.0,
            "draft_syncs_per_round": self.draft_syncs / self.rounds if self.rounds else 0.0,
            "undrafted_steps": self.undrafted_steps,
            "phases_synced": self.phases_synced,
            "phase_ms": self.phase_ms(),
            "verify_ms_by_width": {str(w): ms for w, ms in self.verify_ms_by_width().items()},
            "verify_rounds_by_width": {str(w): n for w, (_, n) in
                                       sorted(self.verify_by_width.items())},
            "round_spread_by_width": {str(w): v for w, v in self.round_spread_by_width().items()},
            "peak_memory_gb": self.peak_memory_gb,
            "draft_topk": self.draft_topk,
            "draft_tokens": self.draft_tokens,
            "tree_rounds": self.tree_rounds,
            "tree_nodes_per_round": (self.tree_nodes / self.tree_rounds if self.tree_rounds
                                     else 0.0),
            "accepted_by_sibling_rank": list(self.sibling_rank_hits),
            "acceptance_rule": self.acceptance_rule,
            "draft_processors": self.draft_processors,
            "mtp_enabled": self.mtp_enabled,
            "gate_reason": self.gate_reason,
            "exactness": self.exactness,
            "split": self.split,
            "split_messages": self.split_messages,
            "split_bytes": self.split_bytes,
            "split_messages_per_token": (self.split_messages / self.generation_tokens
                                         if self.generation_tokens else 0.0),
            "split_bytes_per_token": (self.split_bytes / self.generation_tokens
                                      if self.generation_tokens else 0.0),
            "draft_profile": (self.draft_profiler.report(self.phase_s, self.rounds)
                              if self.draft_profiler is not None else None),
        }
