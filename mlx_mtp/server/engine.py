"""One loaded model and what a request does with it: prompt ids, then a stream of events.

Runs on the server's one decode thread (``worker.py``) and uses the library's API (``mlx_mtp.load``,
``mlx_mtp.stream_generate``, ``mlx_mtp.make_sampler``, ``BatchRounds`` and the response stream of
``mlx_mtp.decoding.responses``, and for ``--no-mtp`` ``plain_stream_generate``, as the CLI) plus
mlx-lm's own pieces: its chat conversion for tokenizers without a template, its logits
processors (``logit_bias``, repetition, presence and frequency penalties), and through
``output.py`` its stop sequences, text state machine and tool parsers, so stop strings, reasoning
text and tool calls behave as in ``mlx_lm.server``. With a prompt cache (``start_prompt_cache``,
``prompt_reuse.py``) a request prefills only what the cache does not hold of its prompt.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Callable, Iterator, List, Optional, Union

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.server import convert_chat, process_message_content

import mlx_mtp
from mlx_mtp.decoding.batch_rounds import BatchRounds
from mlx_mtp.decoding.plain import plain_stream_generate
from mlx_mtp.decoding.responses import prepare, stream_responses
from mlx_mtp.decoding.speculation import SpeculationOptions
from mlx_mtp.decoding.stats import RunStats
from mlx_mtp.exactness import gate
from mlx_mtp.exactness.device import current_device_facts
from mlx_mtp.errors import MTPError
from mlx_mtp.models.options import DraftOptions

from mlx_mtp.server.output import Delta, Output
from mlx_mtp.server.prompt_reuse import PromptReuse, Reused, continuation_points, with_history
from mlx_mtp.server.schema import GenerationRequest, RequestError

NO_MTP_REASON = "--no-mtp: mlx-lm plain decode"


@dataclass
class Started:
    """The prompt is prefilled and the first token is out: the request is valid."""

    prompt_tokens: int
    cached_tokens: int = 0  # of them, taken from the prompt cache (not prefilled)


@dataclass
class Finished:
    # "stop" (EOS or a stop string), "length", "tool_calls" (stopped after a tool call), or
    # "cancelled" (the client went away)
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    mtp: dict
    cached_tokens: int = 0
    stop_sequence: Optional[str] = None  # the stop string that ended the text


Event = Union[Started, Delta, Finished]


def mtp_summary(stats: RunStats) -> dict:
    """The ``mtp`` object of a response. Rates are null where nothing was drafted. On a split
    target it adds the split and rank 0's collectives per generated token."""
    split = {}
    if stats.split is not None:
        d = stats.to_dict()
        split = {k: d[k] for k in ("split", "split_messages_per_token", "split_bytes_per_token")}
    return {
        "mtp_enabled": stats.mtp_enabled,
        "gate_reason": stats.gate_reason,
        "block_size": stats.block_size,  # as requested: an integer or "auto"
        "block_sizes": {str(w): n for w, n in sorted(stats.block_sizes.items())},
        "acceptance_rule": stats.acceptance_rule,
        "draft_processors": stats.draft_processors,
        "rounds": stats.rounds,
        "acceptance_rate": stats.acceptance_rate if stats.drafted else None,
        "tokens_per_round": stats.tokens_per_round if stats.rounds else None,
        "per_position_acceptance": stats.per_position_acceptance,
        "draft_topk": stats.draft_topk,
        "tree_rounds": stats.tree_rounds,
        "tree_nodes_per_round": (stats.tree_nodes / stats.tree_rounds if stats.tree_rounds
                                 else None),
        "accepted_by_sibling_rank": list(stats.sibling_rank_hits),
        "generation_tps": stats.generation_tps,
        "prefilled_tokens": stats.prompt_tokens,  # the prompt tokens this request prefilled
        "prefill_s": stats.prompt_s,
        **split,
    }


def context_length(config: dict) -> Optional[int]:
    text = config.get("text_config", config) if isinstance(config, dict) else {}
    n = text.get("max_position_embeddings", config.get("max_position_embeddings"))
    return n if isinstance(n, int) and n > 0 else None


class Engine:
    def __init__(self, model, tokenizer, *, no_mtp: bool = False,
                 speculation: SpeculationOptions = SpeculationOptions(),
                 chat_template_args: Optional[dict] = None):
        self.model = model
        self.tokenizer = tokenizer
        # every chat's template arguments, under a request's own chat_template_kwargs
        self.chat_template_args = dict(chat_template_args or {})
        self.no_mtp = no_mtp
        self.speculation = speculation  # every request's (its seed is the request's)
        self.context_length = context_length(model.config)
        self.batch: Optional[BatchRounds] = None  # requests decode together (``start_batch``)
        self.max_batch = 1
        self.batch_reason = "one request at a time: --max-batch 1"
        self.prompt_cache: Optional[PromptReuse] = None  # ``start_prompt_cache``
        self.prompt_cache_reason = "off: --prompt-cache-bytes 0"

    def start_batch(self, max_batch: int) -> None:
        """Decode up to ``max_batch`` requests together in batched rounds, where this model
        and device allow it (the batch-vs-alone probe passes); else one at a time, and
        ``batch_reason`` says why."""
        self.max_batch = max_batch
        if max_batch == 1:
            return
        why = None
        if self.no_mtp:
            why = "--no-mtp: mlx-lm plain decode"
        elif self.speculation.draft_topk != 1:
            why = "draft trees (--draft-topk above 1) decode one request at a time"
        elif self.speculation.block_size == 1:
            why = "--block-size 1 drafts nothing"
        if why is None:
            try:
                self.batch = BatchRounds(self.model, max_batch,
                                         block_size=self.speculation.block_size,
                                         max_block_size=self.speculation.max_block_size)
            except MTPError as e:
                why = str(e)
        self.batch_reason = (f"up to {max_batch} requests per round" if why is None
                             else f"one request at a time: {why}")

    def start_prompt_cache(self, max_bytes: int) -> None:
        """Keep the caches of requests, up to ``max_bytes`` (0: none), for later requests whose
        prompts start alike; else ``prompt_cache_reason`` says why not."""
        if max_bytes == 0:
            return
        if self.no_mtp:
            self.prompt_cache_reason = "off: --no-mtp serves mlx-lm's plain decode"
        else:
            self.prompt_cache = PromptReuse(self.model, max_bytes)
            self.prompt_cache_reason = f"up to {max_bytes} bytes"

    def prompt_cache_summary(self) -> dict:
        """The ``prompt_cache`` object of ``/health``."""
        if self.prompt_cache is None:
            return {"enabled": False, "reason": self.prompt_cache_reason}
        return self.prompt_cache.summary()

    def batch_summary(self) -> dict:
        """The ``batch`` object of ``/health``; under ``auto`` with ``drafts``: the draft count
        the batch's chooser runs at each batch size it has measured."""
        out = {"max_batch": self.max_batch, "batched": self.batch is not None,
               "reason": self.batch_reason,
               "active": len(self.batch.active) if self.batch is not None else 0}
        if self.batch is not None and self.batch.chooser is not None:
            out["drafts"] = {str(size): k for size, k in sorted(self.batch.chooser.best.items())}
        return out

    def draft_summary(self) -> Optional[dict]:
        """The ``draft`` object of ``/health``: what the loaded drafter runs with (its
        ``describe()``, as the CLI's ``--json``), or None without one."""
        drafter = self.model.drafter
        return drafter.describe() if drafter is not None else None

    @classmethod
    def load(cls, model: str, *, drafter: Optional[str] = None, no_mtp: bool = False,
             speculation: SpeculationOptions = SpeculationOptions(),
             draft_options: Optional[DraftOptions] = None, split=None,
             chat_template: Optional[str] = None,
             chat_template_args: Optional[dict] = None) -> "Engine":
        """``draft_options``: how the drafter runs (None: the defaults); ``split``: this rank's
        ``mlx_mtp.models.distributed.Split`` (``server/split.py``); ``chat_template``: a Jinja
        template in place of the tokenizer's (its tool parser follows it, as mlx-lm's load
        chooses one); ``chat_template_args``: every chat's template arguments."""
        need_head = not no_mtp and speculation.widest > 1
        m, tok = mlx_mtp.load(model, drafter=drafter, require_head=need_head,
                              draft_options=draft_options, split=split,
                              tokenizer_config=({"chat_template": chat_template}
                                                if chat_template is not None else None))
        if chat_template_args and not tok.has_chat_template:
            raise MTPError("--chat-template-args: this model's tokenizer has no chat template "
                           "(give one with --chat-template)")
        return cls(m, tok, no_mtp=no_mtp, speculation=speculation,
                   chat_template_args=chat_template_args)

    def sampling_gate(self) -> dict:
        """Whether a request at temperature > 0 decodes with MTP, and why: its promise is the
        distribution, so no probe decides it (``mlx_mtp.exactness.gate``); a T=0 request gets
        the probe's decision (the warm-up's, in ``/health``)."""
        if self.no_mtp:
            return {"mtp_enabled": False, "gate_reason": NO_MTP_REASON}
        decision = gate.sampling_decision(self.speculation.block_size, current_device_facts())
        return {"mtp_enabled": decision.mtp_enabled, "gate_reason": decision.reason}

    # ------------------------------------------------------------------------------ prompt

    def prompt_ids(self, req: GenerationRequest) -> List[int]:
        """The request's prompt as token ids, checked against the model (its context, its
        vocabulary, its chat template)."""
        tok = self.tokenizer
        self._check_against_model(req)
        if req.kind == "chat":
            messages = copy.deepcopy(req.messages)
            try:  # text parts -> one string, tool-call arguments parsed, as mlx_lm.server
                process_message_content(messages)
            except (ValueError, KeyError, TypeError) as e:
                raise RequestError(f"messages: {_first_line(e)}", param="messages") from None
            try:
                ids = self._render_chat(messages, req)
            except Exception as e:  # a template that rejects the conversation (roles...)
                raise RequestError(f"messages: the chat template refused them: "
                                   f"{_first_line(e)}", param="messages") from None
        else:
            # Like mlx-lm's stream_generate and the CLI: special tokens unless the text has a BOS.
            add_special = tok.bos_token is None or not req.prompt.startswith(tok.bos_token)
            ids = tok.encode(req.prompt, add_special_tokens=add_special)
        ids = list(ids)
        if not ids:
            raise RequestError("prompt is empty: it encodes to no tokens", param="prompt")
        n = self.context_length
        if n is not None and len(ids) >= n:
            raise RequestError(f"the prompt is {len(ids)} tokens: the model's context is {n} "
                               f"tokens, with room needed for at least one generated token",
                               param="messages" if req.kind == "chat" else "prompt")
        return ids

    def _check_against_model(self, req: GenerationRequest) -> None:
        """What only the model can say is wrong with a request: fields its tokenizer cannot
        honour, token ids outside its vocabulary."""
        tok = self.tokenizer
        if req.tools is not None and not tok.has_tool_calling:
            raise RequestError("tools: this model's tokenizer has no tool-call format that "
                               "mlx-lm can parse (no tool parser for its chat template)",
                               param="tools")
        if req.chat_template_kwargs is not None and not tok.has_chat_template:
            raise RequestError("chat_template_kwargs: this model's tokenizer has no chat "
                               "template", param="chat_template_kwargs")
        if req.role_mapping is not None and tok.has_chat_template:
            raise RequestError("role_mapping: this model's tokenizer has a chat template, "
                               "which lays out the roles", param="role_mapping")
        vocab = self.model.target.vocab_size
        for token in (req.logit_bias or {}):
            if not 0 <= int(token) < vocab:
                raise RequestError(f"logit_bias: token id {token} is not in the vocabulary "
                                   f"(0 to {vocab - 1})", param="logit_bias")

    def _render_chat(self, messages: List[dict],
                     req: Optional[GenerationRequest] = None) -> List[int]:
        """Chat messages (their content processed) -> the prompt's ids: the chat template with
        the generation prompt, the request's tools (withheld under ``tool_choice: "none"``, so
        the model is not offered them) and ``chat_template_kwargs``; or mlx-lm's plain layout
        (``role_mapping``) for a tokenizer without a template. No ``req``: none of them."""
        tok = self.tokenizer
        if req is None:
            req = GenerationRequest(kind="chat", model="")
        if not tok.has_chat_template:
            return list(tok.encode(convert_chat(messages, req.role_mapping)))
        kwargs = {**self.chat_template_args, **(req.chat_template_kwargs or {})}
        if req.tools is not None:
            kwargs["tool_choice"] = req.tool_choice
            if req.tool_choice != "none":
                kwargs["tools"] = req.tools
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                      **kwargs)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    def reuse_points(self, req: GenerationRequest, ids: List[int]) -> List[int]:
        """Prompt lengths that later prompts may share with this one (``prompt_reuse``): a chat's
        continuation points, else (or where the template refuses the probes) the whole
        prompt."""
        if req.kind == "chat":
            messages = copy.deepcopy(req.messages)
            process_message_content(messages)  # (it passed in ``prompt_ids``)
            points = continuation_points(ids, lambda m: self._render_chat(m, req), messages)
            if points:
                return points
        return [len(ids)]

    def _initial_state(self, req: GenerationRequest, ids: List[int]) -> str:
        """mlx_lm.server's choice: a chat prompt that opens a thinking block starts in it."""
        tok = self.tokenizer
        state = "normal"
        if req.kind == "chat" and tok.has_thinking:
            if tok.rfind_think_start(ids) > tok.rfind_think_end(ids):
                state = "reasoning"
        if req.kind == "chat":
            state = tok.response_initial_state or state
        return state

    # ------------------------------------------------------------------------------ decode

    @staticmethod
    def _draws(req: GenerationRequest, reused: Optional[Reused]):
        """The request's sampler and logits processors; from a prompt cache, the processors see
        the cached prompt tokens too (the round loop gives them the rest onward)."""
        sampler = mlx_mtp.make_sampler(temp=req.temperature, top_p=req.top_p, min_p=req.min_p,
                                       top_k=req.top_k)
        bias = {int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None
        processors = make_logits_processors(
            logit_bias=bias, repetition_penalty=req.repetition_penalty,
            repetition_context_size=req.repetition_context_size,
            presence_penalty=req.presence_penalty,
            presence_context_size=req.presence_context_size,
            frequency_penalty=req.frequency_penalty,
            frequency_context_size=req.frequency_context_size)
        if reused is not None:
            processors = with_history(processors, reused.ids[: reused.cached])
        return sampler, processors

    def _batched_responses(self, req: GenerationRequest, ids: List[int], stats: RunStats,
                           on_sequence: Callable, reused: Optional[Reused]):
        """The request's responses from the batch (``BatchRounds``); it joins the batch when
        first read, and ``on_sequence`` gets its ``BatchedSequence``."""
        sampler, processors = self._draws(req, reused)
        rest = ids if reused is None else reused.rest

        def tokens():
            seq = self.batch.start(mx.array(rest), max_tokens=req.max_tokens, sampler=sampler,
                                   logits_processors=processors, seed=req.seed,
                                   acceptance=self.speculation.acceptance, stats=stats,
                                   prompt_cache=reused.cache if reused is not None else None)
            on_sequence(seq)
            yield from self.batch.tokens(seq)

        tokenizer, prompt, _ = prepare(self.tokenizer, rest, stats)
        return stream_responses(tokens(), tokenizer, prompt, req.max_tokens, stats)

    def _responses(self, req: GenerationRequest, ids: List[int], stats: RunStats,
                   reused: Optional[Reused]):
        sampler, processors = self._draws(req, reused)
        if req.seed is not None:
            mx.random.seed(req.seed)
        prompt = mx.array(ids if reused is None else reused.rest)
        if self.no_mtp:  # mlx-lm's own plain decode of the target, as the CLI's --no-mtp
            return plain_stream_generate(self.model, self.tokenizer, prompt,
                                         max_tokens=req.max_tokens, sampler=sampler,
                                         logits_processors=processors, stats=stats)
        speculation = replace(self.speculation, seed=req.seed)
        if req.temperature > 0 and speculation.auto:
            # auto's sampled draws are keyed per position; trees run there at temperature 0
            speculation = replace(speculation, draft_topk=1, draft_tokens=None)
        return mlx_mtp.stream_generate(self.model, self.tokenizer, prompt,
                                       max_tokens=req.max_tokens, sampler=sampler, stats=stats,
                                       logits_processors=processors,
                                       prompt_cache=reused.cache if reused is not None else None,
                                       **speculation.as_kwargs())

    def generate(self, req: GenerationRequest, ids: List[int],
                 cancelled: Callable[[], bool] = lambda: False,
                 on_sequence: Optional[Callable] = None,
                 points: Optional[List[int]] = None) -> Iterator[Event]:
        """``Started``, ``Delta``s, then one ``Finished``. Checks ``cancelled`` after every token,
        so a cancelled request stops before the next round and its generator is closed. With
        ``on_sequence`` the request decodes in the batch (``start_batch``), and
        ``on_sequence`` gets its ``BatchedSequence`` once it joined. With a prompt cache the
        request starts from the kept cache that holds most of its prompt, and what it leaves is
        kept for later requests (``prompt_reuse``), with checkpoints at ``points`` (default:
        ``reuse_points``); not after a failure."""
        stats = RunStats(block_size=1, mtp_enabled=False, gate_reason=NO_MTP_REASON) \
            if self.no_mtp else RunStats()
        output = Output(self.tokenizer, req, self._initial_state(req, ids))
        reuse = self.prompt_cache
        if reuse is not None and points is None:
            points = self.reuse_points(req, ids)
        reused = reuse.open(ids, points) if reuse is not None else None
        cached = reused.cached if reused is not None else 0
        responses = (self._responses(req, ids, stats, reused) if on_sequence is None
                     else self._batched_responses(req, ids, stats, on_sequence, reused))
        n, finish, tokens, ended = 0, "length", [], False
        try:
            for gen in responses:
                n += 1
                tokens.append(gen.token)
                if n == 1:
                    if reused is not None:
                        reuse.keep_checkpoints(reused)
                    yield Started(len(ids), cached)
                delta, stop = output.add(gen)
                if delta:
                    yield delta
                if stop is not None:
                    finish = stop
                    break
                if cancelled():
                    finish = "cancelled"
                    break
            ended = True
        except BaseException:
            if reused is not None:
                reused.cache.abandoned = True  # (the close below finishes no turn)
            raise
        finally:
            responses.close()  # a prompt cache now holds the prompt and exactly ``tokens``
        if reused is not None and ended and n:
            reuse.keep_finished(reused, tokens)
        if finish == "stop" and output.made_tool_call:
            finish = "tool_calls"  # as mlx_lm.server
        mtp = mtp_summary(stats)
        # whether this request decoded in the batch, and how the server batches (``/health``)
        mtp["batched"] = on_sequence is not None
        mtp["batch_reason"] = self.batch_reason
        yield Finished(finish, len(ids), n, mtp, cached_tokens=cached,
                       stop_sequence=output.stop_sequence)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
