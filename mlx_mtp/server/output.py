"""One request's generated tokens -> its content, reasoning, tool calls and token logprobs.

The text goes through mlx-lm's stop sequences and text state machine (``mlx_lm.generate``), as in
``mlx_lm.server``: reasoning between the thinking markers, tool-call text between the tokenizer's
tool-call markers, parsed by the tool parser mlx-lm chose for the tokenizer. A call that does
not parse, or any call under ``tool_choice: "none"``, stays in the content as the model wrote it.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.generate import TextStateMachine, make_stop_sequences, make_text_state_machine

from mlx_mtp.server.schema import GenerationRequest

logger = logging.getLogger("mlx_mtp.server")


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: Any  # the parsed arguments (a JSON object)


@dataclass
class TokenLogprob:
    token: int
    text: str
    logprob: float
    top: List[Tuple[int, str, float]] = field(default_factory=list)  # (id, text, logprob)


@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    tool_calls: List[ToolCall] = field(default_factory=list)
    logprobs: List[TokenLogprob] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls or self.logprobs)


def parse_tool_call(tokenizer, text: str, tools) -> List[ToolCall]:
    """``text`` between the tool-call markers -> its calls, by the tokenizer's parser;
    ``ValueError`` where it does not parse."""
    try:
        parsed = tokenizer.tool_parser(text, tools)
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # json errors are ValueError
        raise ValueError(f"{type(e).__name__}: {e}") from None
    calls = []
    for call in parsed if isinstance(parsed, list) else [parsed]:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError(f"not a function call: {json.dumps(call)[:80]}")
        args = call.get("arguments", {})
        if isinstance(args, str):
            args = json.loads(args) if args.strip() else {}
        calls.append(ToolCall(call.get("id") or f"call_{uuid.uuid4().hex[:24]}", call["name"],
                              args))
    return calls


class Output:
    """Feed it each ``GenerationResponse`` (``add``); it says what to send and when to stop."""

    def __init__(self, tokenizer, req: GenerationRequest, initial_state: str):
        self.tok = tokenizer
        self.req = req
        self.matcher = make_stop_sequences(tokenizer, req.stop).matcher()
        self.state = make_text_state_machine(tokenizer, req.stop).make_state(initial_state)
        self.stops = [(s, tuple(tokenizer.encode(s, add_special_tokens=False)))
                      for s in req.stop]
        self.parse_calls = req.tool_choice != "none"
        self.tool_text: Optional[str] = None  # inside a tool call: its text so far
        self.tokens: List[int] = []
        self.stop_sequence: Optional[str] = None  # the stop string that ended the text
        self.made_tool_call = False

    def add(self, gen) -> Tuple[Delta, Optional[str]]:
        """The delta of one generated token, and why the text ends there: "stop" (a stop
        string or EOS), "length" (the token budget), or None."""
        tok = self.tok
        self.tokens.append(gen.token)
        delta = Delta()
        if self.req.logprobs:
            delta.logprobs.append(self._logprob(gen))
        stop_word = self.matcher.advance(gen.token) and gen.token not in tok.eos_token_ids
        if stop_word:  # mlx_lm.server: drop the held-back start of the stop string
            self.state, _ = TextStateMachine.discard(self.state)
            self.stop_sequence = self._which_stop()
            segments = []
        else:
            self.state, segments = TextStateMachine.split(self.state, gen.text)
            if gen.finish_reason is not None:
                # At EOS or the token budget keep the held-back text (mlx_lm.server drops it at
                # EOS; the CLI and mlx-lm's generate keep it).
                self.state, flushed, current = TextStateMachine.flush(self.state)
                segments.append((current, flushed))
        ended = "stop" if stop_word else gen.finish_reason
        for state, text in segments:
            self._segment(state, text, delta)
        if ended is not None and self.tool_text is not None:  # a call cut off: parsed as far
            self._close_call(delta, closed=False)  # as it goes
        return delta, ended

    def _segment(self, state: Optional[str], text: str, delta: Delta) -> None:
        if state == "tool":
            self.tool_text = (self.tool_text or "") + text
        else:
            if self.tool_text is not None:
                self._close_call(delta, closed=True)
            if state == "reasoning":
                delta.reasoning += text
            elif state is not None:
                delta.content += text

    def _close_call(self, delta: Delta, closed: bool) -> None:
        text, self.tool_text = self.tool_text, None
        if self.parse_calls:
            try:
                delta.tool_calls.extend(parse_tool_call(self.tok, text, self.req.tools))
                self.made_tool_call = True
                return
            except ValueError as e:
                logger.warning("a tool call did not parse (%s); it stays in the content", e)
        end = self.tok.tool_call_end if closed and self.tok.tool_call_end else ""
        delta.content += f"{self.tok.tool_call_start}{text}{end}"

    def _which_stop(self) -> Optional[str]:
        for text, ids in self.stops:
            if ids and tuple(self.tokens[-len(ids):]) == ids:
                return text
        return None

    def _logprob(self, gen) -> TokenLogprob:
        """The token's processed logprob (what it was drawn from, as mlx-lm yields it) and the
        ``top_logprobs`` most likely tokens, most likely first."""
        logprobs = gen.logprobs.reshape(-1)
        top = []
        k = self.req.top_logprobs
        if k > 0:
            ids = mx.argpartition(-logprobs, kth=k - 1)[:k]
            values = logprobs[ids].tolist()
            top = sorted(zip(ids.tolist(), values), key=lambda p: -p[1])
            top = [(i, self.tok.decode([i]), v) for i, v in top]
        return TokenLogprob(gen.token, self.tok.decode([gen.token]),
                            logprobs[gen.token].item(), top)
