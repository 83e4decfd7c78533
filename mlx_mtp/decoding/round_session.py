"""What one generation of the round loop (``mlx_mtp.decoding.rounds``) works with once it opens:
the session's fixed parts, and where the output stands (the request is ``decoding.request``).

``Session`` holds the fixed parts of a generation once the exactness gate let it run as rounds
(among them its acceptance rule, ``decoding.acceptance``: how tokens are drafted, drawn and
kept); ``Progress`` what changes between rounds (the bonus token not yet fed to the target, the
token history, tokens emitted, and the rounds without drafts whose pairs the drafter has not
consumed yet).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

import mlx.core as mx

from mlx_mtp import config as env
from mlx_mtp.decoding.acceptance import AcceptanceRule
from mlx_mtp.decoding.block_chooser import AUTO, BlockChooser
from mlx_mtp.decoding.request import Request
from mlx_mtp.decoding.shape_chooser import ShapeChooser
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.io.kv_settings import KVSettings
from mlx_mtp.decoding.prompt_cache import PromptCache, Turn
from mlx_mtp.draft_tree import TreeShape
from mlx_mtp.models.model import MTPModel
from mlx_mtp.models.protocols import Drafter, Target

# 1: evaluate the draft and the accept hook before the next phase starts, so that the round
# split (RunStats.phase_ms) times each phase's device work; slower (see ``open_session``).
SYNC_PHASES_ENV = "MLX_MTP_SYNC_PHASES"


def start_stats(request: Request, rule: AcceptanceRule) -> RunStats:
    """The caller's ``RunStats`` (or a fresh one) with the session's block size and rule."""
    stats = request.stats if request.stats is not None else RunStats()
    stats.block_size = request.block_size if request.chooser is None else AUTO
    stats.max_block_size = request.block_size
    stats.acceptance_rule = rule.name
    if request.tree is not None:
        stats.draft_topk, stats.draft_tokens = request.tree.topk, request.tree.nodes
    return stats


@dataclass(kw_only=True)
class Session:
    """The fixed parts of one generation run as rounds (the exactness gate let MTP run)."""

    model: MTPModel
    cache: PromptCache
    kv: KVSettings
    turn: Optional[Turn]  # a caller's prompt cache: reported to after the prefill and each round
    drafter: Optional[Drafter]  # None at block size 1
    rule: AcceptanceRule
    stats: RunStats
    chooser: Optional[BlockChooser]  # ``auto``: chooses each round's drafts
    max_tokens: int
    max_drafts: int  # the widest chain less one (a tree's depth)
    prompt_len: int
    queue: Callable[..., None]  # mx.async_eval, or mx.eval with MLX_MTP_SYNC_PHASES=1
    split: Optional[Any]  # mlx_mtp.models.distributed.Split of a split target
    crossings: Callable[[], None]  # brings the split's collective counts in stats up to date
    tree: Optional[TreeShape] = None  # draft trees instead of chains
    shapes: Optional[ShapeChooser] = None  # ``auto`` with a tree: chain or tree, per round
    pin: bool = False  # a drafted round's verify pins the process to one core (cpu_pin)
    generation_start: float = 0.0  # perf_counter when the first token was ready

    @property
    def target(self) -> Target:
        return self.model.target

    @property
    def widest(self) -> int:
        """The widest verify: the widest chain, or a tree's nodes and root."""
        return self.max_drafts + 1 if self.tree is None else max(self.max_drafts + 1,
                                                                  self.tree.width)

    @property
    def plain_decode(self) -> bool:
        """Block size 1 without anything a round must do: no verify block, no keyed draws, no
        prompt-cache turn, no KV quantization, no split. Decodes as mlx-lm does."""
        return (self.drafter is None and not self.rule.keyed and self.turn is None
                and not self.kv.enabled and self.split is None)

    @property
    def stretches(self) -> bool:
        """``auto``: a stretch of rounds the chooser gives no drafts runs as pipelined one-token
        steps (a round without drafts waits for its token before building the next forward)."""
        return (self.chooser is not None and self.turn is None and not self.kv.enabled
                and self.split is None)

    def note_generation_time(self) -> None:
        self.stats.generation_s = time.perf_counter() - self.generation_start
        self.stats.peak_memory_gb = mx.get_peak_memory() / 1e9


def open_session(model: MTPModel, cache: PromptCache, kv: KVSettings, turn: Optional[Turn],
                 drafter: Optional[Drafter], rule: AcceptanceRule, stats: RunStats,
                 request: Request,
                 prompt_len: int) -> Session:
    """The session once the gate let MTP run. The draft and the accept hook are queued
    (``mx.async_eval``), not waited for: the verify graph is built in Python while they compute,
    as mlx-lm's generate_step builds step n + 1 while step n computes. The round's one host read
    waits for all of it; only the timing split changes (``SYNC_PHASES_ENV``)."""
    stats.phases_synced = env.flag(SYNC_PHASES_ENV)
    queue = mx.eval if stats.phases_synced else mx.async_eval
    split = getattr(model, "split", None)
    crossings = stats.count_split(split)  # after the probe: counts this session's forwards
    session = Session(model=model, cache=cache, kv=kv, turn=turn, drafter=drafter, rule=rule,
                      stats=stats, chooser=request.chooser, max_tokens=request.max_tokens,
                      max_drafts=request.block_size - 1, prompt_len=prompt_len, queue=queue,
                      split=split, crossings=crossings, tree=request.tree,
                      shapes=(ShapeChooser(request.block_size - 1)
                              if request.tree is not None and request.chooser is not None
                              else None))
    mx.reset_peak_memory()
    return session


@dataclass
class Progress:
    """Where the output stands between rounds."""

    bonus: mx.array  # [1]: the last token emitted, sampled but not yet fed to the target
    history: Optional[mx.array]  # every token so far, kept only for logits processors
    emitted: int = 1
    # ``auto``: (hidden, ids) of rounds without drafts, fed to the drafter once it drafts again
    deferred: List[Tuple[mx.array, mx.array]] = field(default_factory=list)


def logprobs_of(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
