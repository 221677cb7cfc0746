"""Each API's answers as the fake sends them: errors, full bodies and stream events in the wire shapes of
OpenAI's chat, completions and Responses APIs and Anthropic's Messages API; the token usage they state,
and the rate-limit headers that announce a key's window.

The usage each API states, such that a correct reader normalises it back to I,
C, W, O and R (but for what a shape cannot carry, which it reads as 0: W on
OpenAI's routes, R on Anthropic's):

- chat and completions: the JSON answer's ``usage``, and a stream's last chunk
  (``"choices": []``) when the request has ``stream_options.include_usage``,
  every earlier chunk then carrying ``"usage": null`` (without it no chunk
  has a ``usage``): ``{"prompt_tokens": I, "completion_tokens": O,
  "total_tokens": I+O, "prompt_tokens_details": {"cached_tokens": C},
  "completion_tokens_details": {"reasoning_tokens": R}}``;
- Responses API: the ``usage`` of the JSON answer and of ``response.completed``'s
  ``response`` (SSE and WebSocket; ``null`` in ``response.created`` and
  ``response.in_progress``; all zero for a warm-up, whatever the knob says):
  ``{"input_tokens": I, "input_tokens_details": {"cached_tokens": C},
  "output_tokens": O, "output_tokens_details": {"reasoning_tokens": R},
  "total_tokens": I+O}``;
- Anthropic Messages: the JSON answer's ``usage``, ``{"input_tokens": I-C-W,
  "cache_creation_input_tokens": W, "cache_read_input_tokens": C,
  "output_tokens": O}``; a stream's ``message_start`` carries the same with
  ``"output_tokens": 1``, then, between ``content_block_stop`` and
  ``message_stop``, N ``message_delta`` events whose ``usage`` is
  ``{"output_tokens": round(O*k/N)}`` for k = 1..N (cumulative: the last is
  O), the last alone with ``"stop_reason": "end_turn"`` (the others ``null``).

The rate-limit headers every answer carries, and the 429s of the per-minute windows, are described in
:mod:`.ratelimit` (their wire helpers live there).
"""

from __future__ import annotations

import json
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .ratelimit import (
    ANTHROPIC_ORGANIZATION,
    ANTHROPIC_WINDOWS,
    OPENAI_WINDOWS,
    ORGANIZATION,
    WINDOW_TOKENS,
    WindowState,
    nearest_thousand,
    openai_duration,
    retry_after_headers,
    rfc3339,
)
from .windows import INPUT, OUTPUT, REQUESTS, TOKENS, Reading, Refusal

__all__ = [
    "MODEL",
    "ChatDialect",
    "CompletionDialect",
    "Dialect",
    "MessagesDialect",
    "Reply",
    "ResponsesDialect",
    "WindowState",
    "compact",
    "nearest_thousand",
    "openai_duration",
    "retry_after_headers",
    "stream_error_message",
]

MODEL = "fake-model"
_OPENAI_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}
_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
_OPENAI_ERROR_CODES = {429: "rate_limit_exceeded"}
_RATE_LIMIT_MESSAGE = (
    "Rate limit reached for gpt-4o in organization org-x on tokens per min (TPM): "
    "Limit 30000, Used 30000, Requested 1200. Please try again in 6.379s."
)


def compact(data: Any) -> str:
    return json.dumps(data, separators=(",", ":"))


def _sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    payload = data if isinstance(data, str) else compact(data)
    return f"{head}data: {payload}\n\n".encode()


def _typed_sse(event: dict[str, Any]) -> bytes:
    """A typed event (Responses API) as SSE, named by its ``type``."""
    return _sse(event, event["type"])


def stream_error_message(kind: str) -> str:
    return _RATE_LIMIT_MESSAGE if "rate_limit" in kind else f"In-stream error: {kind}"


def _piece(index: int) -> str:
    return f"tok{index} "


@dataclass(frozen=True)
class _Usage:
    """The token figures one answer reports, normalised; each API states them in its own shape.

    ``input`` is all input (``cached`` and ``cache_write`` included); ``output``
    includes ``reasoning``.
    """

    input: int
    cached: int
    cache_write: int
    output: int
    reasoning: int

    def check(self) -> None:
        """Raise ValueError unless every API's shape can state these figures."""
        if self.cached + self.cache_write > self.input:
            raise ValueError(
                f"x-fake-usage: cached + cache_write ({self.cached} + {self.cache_write}) must not exceed input "
                f"({self.input}; by default the body's size // 4)"
            )
        if self.reasoning > self.output:
            raise ValueError(
                f"x-fake-usage: reasoning ({self.reasoning}) must not exceed output "
                f"({self.output}; by default the chunks)"
            )


@dataclass(frozen=True)
class Reply:
    """What one answer is about: its id, model, size, the prompt's token estimate and the usage to report.

    ``usage_override`` holds the figures ``x-fake-usage`` set; the others are
    ``prompt_tokens`` (input), ``cached_tokens`` and ``cache_write_tokens``
    (the prompt cache's, with windows), ``chunks`` (output) and 0.
    ``usage_deltas`` is the number of Anthropic ``message_delta`` events.
    """

    id: str
    model: str
    created: int
    chunks: int
    prompt_tokens: int
    stream: bool
    include_usage: bool
    usage_override: Mapping[str, int] = field(default_factory=dict)
    usage_deltas: int = 1
    cached_tokens: int = 0
    cache_write_tokens: int = 0

    @property
    def text(self) -> str:
        return "".join(_piece(i) for i in range(self.chunks))

    @property
    def usage(self) -> _Usage:
        figures = {"input": self.prompt_tokens, "cached": self.cached_tokens, "cache_write": self.cache_write_tokens,
                   "output": self.chunks, "reasoning": 0}
        return _Usage(**(figures | dict(self.usage_override)))


class Dialect(ABC):
    """One API's wire shapes: errors, full answers and stream events.

    ``windows`` are the windows (``windows``) that hold its route, ``caches_prompts`` whether it
    simulates Anthropic's prompt cache, ``continuable`` whether a later request may continue its answers.
    """

    id_prefix = "chatcmpl-"
    windows: tuple[str, ...] = (TOKENS, REQUESTS)
    caches_prompts = False
    continuable = False

    def error_type(self, status: int) -> str:
        return _OPENAI_ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def error_body(self, status: int, message: str, code: str | None = None) -> dict[str, Any]:
        error_code = code or _OPENAI_ERROR_CODES.get(status, self.error_type(status))
        return {"error": {"message": message, "type": self.error_type(status), "code": error_code}}

    @abstractmethod
    def full_body(self, reply: Reply) -> dict[str, Any]: ...

    def opening(self, reply: Reply) -> list[bytes]:
        return []

    @abstractmethod
    def chunk(self, reply: Reply, index: int) -> bytes: ...

    @abstractmethod
    def closing(self, reply: Reply) -> list[bytes]: ...

    def stream_error(self, reply: Reply, kind: str, *, after: int, form: str) -> bytes:
        """The in-stream error sent after chunk ``after``; ``form`` matters to the Responses API only."""
        return _sse({"error": {"code": kind, "message": f"In-stream error: {kind}"}})

    def usage(self, reply: Reply) -> dict[str, Any]:
        """OpenAI's usage object (chat and completions)."""
        usage = reply.usage
        return {
            "prompt_tokens": usage.input,
            "completion_tokens": usage.output,
            "total_tokens": usage.input + usage.output,
            "prompt_tokens_details": {"cached_tokens": usage.cached},
            "completion_tokens_details": {"reasoning_tokens": usage.reasoning},
        }

    @staticmethod
    def null_usage(reply: Reply) -> dict[str, Any]:
        """``"usage": null``, which OpenAI puts on every chunk but the last when the client asked
        ``stream_options.include_usage``; else nothing."""
        return {"usage": None} if reply.include_usage else {}

    def window_headers(self, window: WindowState, *, unified: bool) -> dict[str, str]:
        """The headers announcing ``window``; ``unified`` matters to Anthropic only."""
        reset = openai_duration(window.left)
        return {
            "x-ratelimit-limit-requests": str(window.limit),
            "x-ratelimit-remaining-requests": str(window.remaining),
            "x-ratelimit-reset-requests": reset,
            "x-ratelimit-limit-tokens": str(WINDOW_TOKENS),
            "x-ratelimit-remaining-tokens": str(window.tokens_remaining),
            "x-ratelimit-reset-tokens": reset,
        }

    def token_window_headers(self, readings: Sequence[Reading]) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-{limit,remaining,reset}-{tokens,requests}`` for the windows read."""
        headers: dict[str, str] = {}
        for reading in readings:
            suffix = OPENAI_WINDOWS[reading.window][0]
            headers[f"x-ratelimit-limit-{suffix}"] = str(reading.limit)
            headers[f"x-ratelimit-remaining-{suffix}"] = str(reading.remaining)
            headers[f"x-ratelimit-reset-{suffix}"] = openai_duration(reading.reset_in)
        return headers

    def window_error_body(self, refusal: Refusal, model: str) -> dict[str, Any]:
        """OpenAI's 429 for a window: ``type`` tokens or requests, ``code`` rate_limit_exceeded."""
        kind, short = OPENAI_WINDOWS[refusal.window]
        where = f"for {model} in organization {ORGANIZATION} on {kind} per min ({short})"
        if refusal.oversize:
            message = (f"Request too large {where}: Limit {refusal.limit}, Requested {refusal.requested}. "
                       "The input or output tokens must be reduced in order to run successfully.")
        else:
            message = (f"Rate limit reached {where}: Limit {refusal.limit}, Used {refusal.used}, "
                       f"Requested {refusal.requested}. Please try again in {openai_duration(refusal.wait)}.")
        message += " Visit https://platform.openai.com/account/rate-limits to learn more."
        return {"error": {"message": message, "type": kind, "param": None, "code": "rate_limit_exceeded"}}


class ChatDialect(Dialect):
    def full_body(self, reply: Reply) -> dict[str, Any]:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": reply.text},
            "finish_reason": "stop",
            "logprobs": None,
        }
        return self._envelope(reply, "chat.completion", [choice]) | {"usage": self.usage(reply)}

    def chunk(self, reply: Reply, index: int) -> bytes:
        delta = {"content": _piece(index)} | ({"role": "assistant"} if index == 0 else {})
        choice = {"index": 0, "delta": delta, "finish_reason": None}
        return _sse(self._envelope(reply, "chat.completion.chunk", [choice]) | self.null_usage(reply))

    def closing(self, reply: Reply) -> list[bytes]:
        last = {"index": 0, "delta": {}, "finish_reason": "stop"}
        events = [_sse(self._envelope(reply, "chat.completion.chunk", [last]) | self.null_usage(reply))]
        if reply.include_usage:
            usage = self._envelope(reply, "chat.completion.chunk", []) | {"usage": self.usage(reply)}
            events.append(_sse(usage))
        return [*events, _sse("[DONE]")]

    @staticmethod
    def _envelope(reply: Reply, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": reply.id,
            "object": kind,
            "created": reply.created,
            "model": reply.model,
            "choices": choices,
        }


class CompletionDialect(Dialect):
    id_prefix = "cmpl-"

    def full_body(self, reply: Reply) -> dict[str, Any]:
        choice = {"index": 0, "text": reply.text, "finish_reason": "stop", "logprobs": None}
        return self._envelope(reply, [choice]) | {"usage": self.usage(reply)}

    def chunk(self, reply: Reply, index: int) -> bytes:
        choice = {"index": 0, "text": _piece(index), "finish_reason": None, "logprobs": None}
        return _sse(self._envelope(reply, [choice]) | self.null_usage(reply))

    def closing(self, reply: Reply) -> list[bytes]:
        last = {"index": 0, "text": "", "finish_reason": "stop", "logprobs": None}
        events = [_sse(self._envelope(reply, [last]) | self.null_usage(reply))]
        if reply.include_usage:
            events.append(_sse(self._envelope(reply, []) | {"usage": self.usage(reply)}))
        return [*events, _sse("[DONE]")]

    @staticmethod
    def _envelope(reply: Reply, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": reply.id,
            "object": "text_completion",
            "created": reply.created,
            "model": reply.model,
            "choices": choices,
        }


class MessagesDialect(Dialect):
    id_prefix = "msg_"
    windows = (INPUT, OUTPUT, REQUESTS)
    caches_prompts = True

    def error_type(self, status: int) -> str:
        return _ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")

    def error_body(self, status: int, message: str, code: str | None = None) -> dict[str, Any]:
        return {"type": "error", "error": {"type": code or self.error_type(status), "message": message}}

    def full_body(self, reply: Reply) -> dict[str, Any]:
        return self._message(reply, [{"type": "text", "text": reply.text}], "end_turn", reply.usage.output)

    def opening(self, reply: Reply) -> list[bytes]:
        start = {"type": "message_start", "message": self._message(reply, [], None, 1)}
        block = {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
        return [_sse(start, "message_start"), _sse(block, "content_block_start")]

    def chunk(self, reply: Reply, index: int) -> bytes:
        text = {"type": "text_delta", "text": _piece(index)}
        return _sse({"type": "content_block_delta", "index": 0, "delta": text}, "content_block_delta")

    def closing(self, reply: Reply) -> list[bytes]:
        """The block's stop, ``usage_deltas`` message_deltas (cumulative output, the stop reason on the last
        alone), then message_stop."""
        output, count = reply.usage.output, reply.usage_deltas
        deltas = [
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn" if k == count else None, "stop_sequence": None},
                "usage": {"output_tokens": output if k == count else round(output * k / count)},
            }
            for k in range(1, count + 1)
        ]
        return [
            _sse({"type": "content_block_stop", "index": 0}, "content_block_stop"),
            *(_sse(delta, "message_delta") for delta in deltas),
            _sse({"type": "message_stop"}, "message_stop"),
        ]

    def stream_error(self, reply: Reply, kind: str, *, after: int, form: str) -> bytes:
        error = {"type": kind, "message": f"In-stream error: {kind}"}
        return _sse({"type": "error", "error": error}, "error")

    def window_headers(self, window: WindowState, *, unified: bool) -> dict[str, str]:
        resets_at = time.time() + window.left
        reset = rfc3339(resets_at)
        headers = {
            "anthropic-ratelimit-requests-limit": str(window.limit),
            "anthropic-ratelimit-requests-remaining": str(window.remaining),
            "anthropic-ratelimit-requests-reset": reset,
            "anthropic-ratelimit-tokens-limit": str(WINDOW_TOKENS),
            "anthropic-ratelimit-tokens-remaining": str(window.tokens_remaining),
            "anthropic-ratelimit-tokens-reset": reset,
        }
        if unified:
            headers["anthropic-ratelimit-unified-status"] = "allowed" if window.remaining else "rejected"
            headers["anthropic-ratelimit-unified-reset"] = str(math.ceil(resets_at))
        return headers

    def token_window_headers(self, readings: Sequence[Reading]) -> dict[str, str]:
        """``anthropic-ratelimit-{input-tokens,output-tokens,requests}-{limit,remaining,reset}``, token counts
        remaining rounded to the nearest thousand, and ``anthropic-ratelimit-tokens-*`` repeating the token
        window with the least remaining."""
        headers: dict[str, str] = {}
        now = time.time()
        tightest: tuple[int, int, str] | None = None
        for reading in readings:
            name = ANTHROPIC_WINDOWS[reading.window][0]
            remaining = reading.remaining if reading.window == REQUESTS else nearest_thousand(reading.remaining)
            reset = rfc3339(now + reading.reset_in)
            headers[f"anthropic-ratelimit-{name}-limit"] = str(reading.limit)
            headers[f"anthropic-ratelimit-{name}-remaining"] = str(remaining)
            headers[f"anthropic-ratelimit-{name}-reset"] = reset
            if reading.window != REQUESTS and (tightest is None or (remaining, reading.limit) < tightest[:2]):
                tightest = (remaining, reading.limit, reset)
        if tightest is not None:
            remaining, limit, reset = tightest
            headers |= {"anthropic-ratelimit-tokens-limit": str(limit),
                        "anthropic-ratelimit-tokens-remaining": str(remaining),
                        "anthropic-ratelimit-tokens-reset": reset}
        return headers

    def window_error_body(self, refusal: Refusal, model: str) -> dict[str, Any]:
        """Anthropic's 429 for a window, in its words: type rate_limit_error, the limit with thousands commas."""
        what = ANTHROPIC_WINDOWS[refusal.window][1]
        message = (
            f"This request would exceed the rate limit for your organization ({ANTHROPIC_ORGANIZATION}) of "
            f"{refusal.limit:,} {what} per minute. For details, refer to: https://docs.claude.com/en/api/rate-limits. "
            "You can see the response headers for current usage. Please reduce the prompt length or the maximum "
            "tokens requested, or try again later. You may also contact sales at "
            "https://www.anthropic.com/contact-sales to discuss your options for a rate limit increase."
        )
        return self.error_body(429, message)

    @staticmethod
    def _message(reply: Reply, content: list[dict[str, Any]], stop: str | None, out: int) -> dict[str, Any]:
        usage = reply.usage
        return {
            "id": reply.id,
            "type": "message",
            "role": "assistant",
            "model": reply.model,
            "content": content,
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": {
                "input_tokens": usage.input - usage.cached - usage.cache_write,
                "cache_creation_input_tokens": usage.cache_write,
                "cache_read_input_tokens": usage.cached,
                "output_tokens": out,
            },
        }


class ResponsesDialect(Dialect):
    """The OpenAI Responses API: one output message, every stream event typed and numbered.

    Event ``sequence_number``s follow from the positions: four opening events,
    then one per chunk, then the four closing ones (or the error after a chunk).
    The ``*_events`` builders give the events as objects, shared by the SSE
    stream and the WebSocket mode.
    """

    id_prefix = "resp_"
    continuable = True
    _OPENED = 4

    def full_body(self, reply: Reply) -> dict[str, Any]:
        return self._response(reply, "completed", [self._message(reply, "completed", reply.text)],
                              usage=self.responses_usage(reply))

    def opening(self, reply: Reply) -> list[bytes]:
        return [_typed_sse(event) for event in self.opening_events(reply)]

    def chunk(self, reply: Reply, index: int) -> bytes:
        return _typed_sse(self.chunk_event(reply, index))

    def closing(self, reply: Reply) -> list[bytes]:
        return [_typed_sse(event) for event in self.closing_events(reply)]

    def stream_error(self, reply: Reply, kind: str, *, after: int, form: str) -> bytes:
        return _typed_sse(self.stream_error_event(reply, kind, after=after, form=form))

    def opening_events(self, reply: Reply) -> list[dict[str, Any]]:
        snapshot = self._response(reply, "in_progress", [])
        where = {"item_id": self._item_id(reply), "output_index": 0, "content_index": 0}
        return [
            self._event(0, "response.created", response=snapshot),
            self._event(1, "response.in_progress", response=snapshot),
            self._event(2, "response.output_item.added", output_index=0,
                        item=self._message(reply, "in_progress", None)),
            self._event(3, "response.content_part.added", **where, part=self._text_part("")),
        ]

    def chunk_event(self, reply: Reply, index: int) -> dict[str, Any]:
        return self._event(self._OPENED + index, "response.output_text.delta", item_id=self._item_id(reply),
                           output_index=0, content_index=0, delta=_piece(index), logprobs=[])

    def closing_events(self, reply: Reply) -> list[dict[str, Any]]:
        seq = self._OPENED + reply.chunks
        where = {"item_id": self._item_id(reply), "output_index": 0, "content_index": 0}
        message = self._message(reply, "completed", reply.text)
        done = self._response(reply, "completed", [message], usage=self.responses_usage(reply))
        return [
            self._event(seq, "response.output_text.done", **where, text=reply.text, logprobs=[]),
            self._event(seq + 1, "response.content_part.done", **where, part=self._text_part(reply.text)),
            self._event(seq + 2, "response.output_item.done", output_index=0, item=message),
            self._event(seq + 3, "response.completed", response=done),
        ]

    def stream_error_event(self, reply: Reply, kind: str, *, after: int, form: str) -> dict[str, Any]:
        seq = self._OPENED + after + 1
        message = stream_error_message(kind)
        if form == "event":
            return self._event(seq, "error", code=kind, message=message, param=None)
        failed = self._response(reply, "failed", [], error={"code": kind, "message": message})
        return self._event(seq, "response.failed", response=failed)

    def warmup_events(self, reply: Reply) -> list[dict[str, Any]]:
        """A warm-up's answer (``"generate": false``): created, then completed with no output and no usage."""
        empty = replace(reply, chunks=0, prompt_tokens=0, usage_override={})
        done = self._response(empty, "completed", [], usage=self.responses_usage(empty))
        return [
            self._event(0, "response.created", response=self._response(empty, "in_progress", [])),
            self._event(1, "response.completed", response=done),
        ]

    @staticmethod
    def responses_usage(reply: Reply) -> dict[str, Any]:
        usage = reply.usage
        return {
            "input_tokens": usage.input,
            "input_tokens_details": {"cached_tokens": usage.cached},
            "output_tokens": usage.output,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning},
            "total_tokens": usage.input + usage.output,
        }

    @staticmethod
    def _event(seq: int, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": seq, **fields}

    @staticmethod
    def _item_id(reply: Reply) -> str:
        return "msg_" + reply.id.removeprefix("resp_")

    @staticmethod
    def _text_part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _message(self, reply: Reply, status: str, text: str | None) -> dict[str, Any]:
        content = [] if text is None else [self._text_part(text)]
        return {"id": self._item_id(reply), "type": "message", "status": status, "role": "assistant",
                "content": content}

    @staticmethod
    def _response(
        reply: Reply, status: str, output: list[dict[str, Any]], *,
        usage: dict[str, Any] | None = None, error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return {
            "id": reply.id,
            "object": "response",
            "created_at": reply.created,
            "status": status,
            "completed_at": reply.created if status == "completed" else None,
            "error": error,
            "incomplete_details": None,
            "instructions": None,
            "max_output_tokens": None,
            "model": reply.model,
            "output": output,
            "parallel_tool_calls": True,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": True,
            "temperature": 1.0,
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": [],
            "top_p": 1.0,
            "truncation": "disabled",
            "usage": usage,
            "user": None,
            "metadata": {},
        }
