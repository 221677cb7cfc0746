"""A mock LLM provider with a hard concurrency cap, for the demo, the tests and the benchmarks.

It speaks enough of the OpenAI (``/v1/chat/completions``, ``/v1/completions``,
``/v1/responses``) and Anthropic (``/v1/messages``) APIs for the official SDKs
to parse its answers, streamed or not. Every API path (``/v1/models`` and
``/v1/usage`` too) is also served without its ``/v1``, so a provider's upstream
may be ``http://127.0.0.1:P/v1`` (OpenAI's shape) or ``http://127.0.0.1:P``
(Anthropic's). Any other path gets a 404 in the OpenAI error shape (code
``unknown_url``) that names the path and the routes served. Over its cap it
answers 429 with Retry-After, like a real provider, and it keeps the statistics
a test needs to prove that a proxy in front of it never went over: the highest
concurrency it ever admitted, the 429s it sent, and the tags of the requests in
arrival order.

Request headers inject faults (so a test can reach them through a proxy):

==============================  ===============================================
``x-fake-tag``                  recorded in ``arrivals`` (else the body's ``user``)
``x-fake-status: N``            answer status N, once admitted, with the route's
                                error shape
``x-fake-no-retry-after``       ``1``: that 429 carries no Retry-After headers
``x-fake-error-code``           the error ``code``/``type`` of that answer
``x-fake-stall-ms: N``          wait N ms before sending the response headers
``x-fake-reset-after: K``       stream K chunks, then reset the connection
                                (non-streaming: reset before any answer)
``x-fake-gzip: 1``              gzip a non-streaming answer (with Content-Length)
``x-fake-encoding: E``          compress a streaming answer on the fly with
                                Content-Encoding E (``gzip``, ``deflate``, ``br``
                                or ``zstd``), flushed after every event
``x-fake-stream-error: T``      after one chunk, an in-stream error of type (or
                                code) T, then end
``x-fake-stream-error-form: F`` Responses API only: ``failed`` (default) sends
                                ``response.failed``, ``event`` a top-level
                                ``error`` event
``x-fake-chunks``               per-request ``chunks``
``x-fake-delay-ms``             per-request ``delay_ms``
``x-fake-ratelimit-headers``    a JSON object of header names to string values,
                                added verbatim to that answer (error or not),
                                over any header of the same name
``x-fake-usage``                the token usage that answer reports, as a JSON
                                object of normalised figures ``input`` (I, all
                                input), ``cached`` (C), ``cache_write`` (W),
                                ``output`` (O, all output) and ``reasoning``
                                (R): each an integer >= 0 and optional (I: the
                                body's size // 4, at least 1; O: the chunks;
                                the others 0); stated in the route's own shape
                                (below). Any other value, C + W above I, or R
                                above O is a 400
``x-fake-usage-deltas: N``      Anthropic streams: N ``message_delta`` events
                                (an integer >= 1, default 1), below
==============================  ===============================================

``br`` uses the ``brotli`` package and ``zstd`` the standard library's (or its
backport's) ``compression.zstd``, both installed with slotproxy.

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

Only model requests (the four POST routes, and the ``response.create`` frames
of a WebSocket, below) are counted and capped; ``/v1/models``,
``/v1/usage`` and ``/stats`` never are, so polling them changes nothing.

A request's *key* is the auth value it carries: ``Authorization`` without a
leading ``Bearer ``, else ``x-api-key``, else ``""``. ``stats()["keys"]`` counts
every key seen. With ``key_limit``, each key may have that many requests in
flight, the global ``cap`` still applying too. With ``window_requests``, each
key has a fixed window: its first model request opens one of
``window_seconds``, in which at most ``window_requests`` requests are admitted
(whatever their answer); the next is refused until the window ends, with a
Retry-After (whole seconds, rounded up) and a retry-after-ms (exact) that say
when. Refusals are checked in that order (window, ``cap``, ``key_limit``), each
a 429 counted in ``rate_limited``; the window's also in ``window_rejected``.

With ``window_requests`` set, every model answer past the header checks (200 or
429, streamed or not) announces its key's window as it stands once this request
was counted:

==========================================  ====================================
``x-ratelimit-limit-requests``              OpenAI routes: ``window_requests``
``x-ratelimit-remaining-requests``          what is left of them
``x-ratelimit-reset-requests``              the wait till the window resets,
                                            rounded up to the ms: ``0.25s``,
                                            ``1.5s`` (at most 3 decimals, under
                                            a minute), ``6m0s``, ``1h2m3s``
``x-ratelimit-limit-tokens``                ``WINDOW_TOKENS`` (1000000)
``x-ratelimit-remaining-tokens``            that less ``TOKENS_PER_REQUEST``
                                            (100) per request admitted
``x-ratelimit-reset-tokens``                as ``x-ratelimit-reset-requests``
``anthropic-ratelimit-requests-limit``      Anthropic: ``window_requests``
``anthropic-ratelimit-requests-remaining``  what is left of them
``anthropic-ratelimit-requests-reset``      the instant the window resets,
                                            RFC 3339 UTC with microseconds:
                                            ``2026-12-01T10:00:02.500000Z``
``anthropic-ratelimit-tokens-limit``        as ``x-ratelimit-limit-tokens``
``anthropic-ratelimit-tokens-remaining``    as ``x-ratelimit-remaining-tokens``
``anthropic-ratelimit-tokens-reset``        as the requests' ``-reset``
``anthropic-ratelimit-unified-status``      with ``unified``: ``allowed`` while
                                            requests remain, else ``rejected``
``anthropic-ratelimit-unified-reset``       with ``unified``: the reset, in
                                            epoch seconds rounded up
==========================================  ====================================

The Responses API over WebSocket (Codex's transport): a ``GET /v1/responses``
with ``Upgrade: websocket`` opens a socket (permessage-deflate when the client
offers it, the first offered subprotocol echoed); a plain GET still gets 405.
Each text frame ``{"type": "response.create", ...}`` (the POST body's fields,
at the top or under ``response``) is one model request, recorded, keyed (by the
handshake's auth), admitted, counted and released like a POST, and answered
with the events of the SSE stream, one JSON text frame each. The frames of one
socket are answered one after another, in order. ``"generate": false`` (Codex's
warm-up) gets ``response.created`` and an empty ``response.completed`` (no
output, usage all zero whatever ``usage`` says) at once. An error is one frame,
after which the socket stays open::

    {"type": "error", "status": 429,
     "error": {"message": "Concurrency limit exceeded. Please try again in 1s.",
               "type": "rate_limit_error", "code": "rate_limit_exceeded"},
     "headers": {"retry-after": "1", "retry-after-ms": "1000"}}

A ``response.create`` over the cap, ``key_limit`` or window gets that 429 (the
wait as the HTTP 429 states it; ``headers`` only on 429s); a frame that is no
JSON object, or bad knobs, a 400 (type and code ``invalid_request_error``).
Binary frames and frames of any other type (``response.cancel``) are ignored.
A client that closes the socket, or vanishes, mid-response frees its slot at
once. ``stats()`` counts ``websockets`` open and ``websockets_opened``.

The handshake's ``x-fake-*`` headers apply to every response of its socket
(all but ``reset-after``, ``gzip``, ``encoding``, ``ratelimit-headers`` and
``usage-deltas``, which are ignored). A frame may carry ``"x_fake": {...}``,
the same knobs by their names without ``x-fake-`` (``{"chunks": 3,
"delay-ms": 10}``; ``usage`` as a JSON object, ``{"usage": {"input": 900,
"cached": 512}}``), over the handshake's (null unsets one). ``status`` sends an
error frame with that status once admitted. ``stream-error`` sends, after the
first delta, ``response.failed`` (form ``failed``) or the frame ``{"type":
"error", "status": S, "error": {"type": T, "code": T, "message": ...}}`` (form
``event``; S is 429 when T contains ``rate_limit``, 503 when it contains
``overloaded``, else 500); then the response ends. WebSocket-only knobs (in a frame by these names, on the
handshake as ``x-fake-close-after`` and ``x-fake-drop-after``; not both):

==============================  ===============================================
``x-fake-ws-refuse: N``         handshake only: refuse the upgrade with status N
                                (200-599) and the error body; a 429 with
                                Retry-After, counted in ``rate_limited``
``close-after: K``              after K deltas, close the socket with code 1011
                                (an upstream close)
``drop-after: K``               after K deltas, reset the TCP connection (no
                                close frame)
==============================  ===============================================

Options ``websocket=False`` (``--no-websocket``) refuse every upgrade with 404
and the error body, as a server without the mode; ``ws_refuse_429``
(``--ws-refuse-429``) refuses an upgrade arriving while ``active >= cap`` with a
429 and Retry-After, counted in ``rate_limited``.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import math
import re
import signal
import socket
import struct
import time
import uuid
import zlib
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from aiohttp import WSCloseCode, WSMsgType, hdrs, web

from ...providers.decoders import zstd_module

__all__ = ["FakeUpstream", "add_arguments", "run", "start_fake_upstream"]

ARRIVALS_KEPT = 10_000
API_PREFIXES = ("/v1", "")
"""Every API route is served under each: ``/v1/messages`` and ``/messages`` alike."""
SERVED_ROUTES = "/v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, /v1/models"
DEFAULT_PORT = 9100
MODEL = "fake-model"
WINDOW_TOKENS = 1_000_000
TOKENS_PER_REQUEST = 100
MAX_WINDOW_SECONDS = 1e9

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
_STREAM_ERROR_FORMS = frozenset({"failed", "event"})
_ENCODINGS = frozenset({"gzip", "deflate", "br", "zstd"})
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_USAGE_FIGURES = ("input", "cached", "cache_write", "output", "reasoning")


def _compact(data: Any) -> str:
    return json.dumps(data, separators=(",", ":"))


def _sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    payload = data if isinstance(data, str) else _compact(data)
    return f"{head}data: {payload}\n\n".encode()


def _typed_sse(event: dict[str, Any]) -> bytes:
    """A typed event (Responses API) as SSE, named by its ``type``."""
    return _sse(event, event["type"])


def _stream_error_message(kind: str) -> str:
    return _RATE_LIMIT_MESSAGE if "rate_limit" in kind else f"In-stream error: {kind}"


def _retry_after_headers(seconds: float) -> dict[str, str]:
    """Retry-After (whole seconds, rounded up, at least 1) and retry-after-ms (exact) for a wait."""
    return {"retry-after": str(max(1, math.ceil(seconds))), "retry-after-ms": str(round(seconds * 1000))}


def _piece(index: int) -> str:
    return f"tok{index} "


def _key(headers: Mapping[str, str]) -> str:
    """The auth value a request carries: ``Authorization`` without ``Bearer ``, else ``x-api-key``, else ""."""
    auth = headers.get("Authorization", "").strip()
    if auth:
        return auth[len("bearer "):].strip() if auth[:len("bearer ")].lower() == "bearer " else auth
    return headers.get("x-api-key", "").strip()


def _openai_duration(seconds: float) -> str:
    """A wait the way OpenAI's ``x-ratelimit-reset-*`` put it: ``0.25s``, ``1.5s``, ``6m0s``, ``1h2m3s``.

    Rounded up to the millisecond, so a client that waits that long finds the window reset.
    """
    ms = max(0, math.ceil(seconds * 1000))
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs = f"{ms / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{secs}"
    return f"{minutes}m{secs}" if minutes else secs


def _rfc3339(epoch: float) -> str:
    """``epoch`` as RFC 3339 UTC with microseconds: ``2026-12-01T10:00:02.500000Z``."""
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


@dataclass
class _KeyStats:
    """One key's statistics, as ``stats()["keys"][key]`` shows them."""

    requests: int = 0
    in_flight: int = 0
    max_concurrent: int = 0
    rejected: int = 0


@dataclass
class _Window:
    """One key's fixed request window: opened (on ``time.monotonic()``) by a request, and what it admitted."""

    opened: float
    admitted: int = 0


@dataclass(frozen=True)
class _WindowState:
    """A key's window as one answer announces it, once that request was counted."""

    limit: int
    admitted: int
    left: float

    @property
    def remaining(self) -> int:
        return max(0, self.limit - self.admitted)

    @property
    def tokens_remaining(self) -> int:
        return max(0, WINDOW_TOKENS - TOKENS_PER_REQUEST * self.admitted)


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
class _Reply:
    """What one answer is about: its id, model, size, the prompt's token estimate and the usage to report.

    ``usage_override`` holds the figures ``x-fake-usage`` set; the others are
    ``prompt_tokens`` (input), ``chunks`` (output) and 0. ``usage_deltas`` is
    the number of Anthropic ``message_delta`` events.
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

    @property
    def text(self) -> str:
        return "".join(_piece(i) for i in range(self.chunks))

    @property
    def usage(self) -> _Usage:
        figures = {"input": self.prompt_tokens, "cached": 0, "cache_write": 0, "output": self.chunks, "reasoning": 0}
        return _Usage(**(figures | dict(self.usage_override)))


class _Dialect(ABC):
    """One API's wire shapes: errors, full answers and stream events."""

    id_prefix = "chatcmpl-"

    def error_type(self, status: int) -> str:
        return _OPENAI_ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def error_body(self, status: int, message: str, code: str | None = None) -> dict[str, Any]:
        error_code = code or _OPENAI_ERROR_CODES.get(status, self.error_type(status))
        return {"error": {"message": message, "type": self.error_type(status), "code": error_code}}

    @abstractmethod
    def full_body(self, reply: _Reply) -> dict[str, Any]: ...

    def opening(self, reply: _Reply) -> list[bytes]:
        return []

    @abstractmethod
    def chunk(self, reply: _Reply, index: int) -> bytes: ...

    @abstractmethod
    def closing(self, reply: _Reply) -> list[bytes]: ...

    def stream_error(self, reply: _Reply, kind: str, *, after: int, form: str) -> bytes:
        """The in-stream error sent after chunk ``after``; ``form`` matters to the Responses API only."""
        return _sse({"error": {"code": kind, "message": f"In-stream error: {kind}"}})

    def usage(self, reply: _Reply) -> dict[str, Any]:
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
    def null_usage(reply: _Reply) -> dict[str, Any]:
        """``"usage": null``, which OpenAI puts on every chunk but the last when the client asked
        ``stream_options.include_usage``; else nothing."""
        return {"usage": None} if reply.include_usage else {}

    def window_headers(self, window: _WindowState, *, unified: bool) -> dict[str, str]:
        """The headers announcing ``window``; ``unified`` matters to Anthropic only."""
        reset = _openai_duration(window.left)
        return {
            "x-ratelimit-limit-requests": str(window.limit),
            "x-ratelimit-remaining-requests": str(window.remaining),
            "x-ratelimit-reset-requests": reset,
            "x-ratelimit-limit-tokens": str(WINDOW_TOKENS),
            "x-ratelimit-remaining-tokens": str(window.tokens_remaining),
            "x-ratelimit-reset-tokens": reset,
        }


class _ChatDialect(_Dialect):
    def full_body(self, reply: _Reply) -> dict[str, Any]:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": reply.text},
            "finish_reason": "stop",
            "logprobs": None,
        }
        return self._envelope(reply, "chat.completion", [choice]) | {"usage": self.usage(reply)}

    def chunk(self, reply: _Reply, index: int) -> bytes:
        delta = {"content": _piece(index)} | ({"role": "assistant"} if index == 0 else {})
        choice = {"index": 0, "delta": delta, "finish_reason": None}
        return _sse(self._envelope(reply, "chat.completion.chunk", [choice]) | self.null_usage(reply))

    def closing(self, reply: _Reply) -> list[bytes]:
        last = {"index": 0, "delta": {}, "finish_reason": "stop"}
        events = [_sse(self._envelope(reply, "chat.completion.chunk", [last]) | self.null_usage(reply))]
        if reply.include_usage:
            usage = self._envelope(reply, "chat.completion.chunk", []) | {"usage": self.usage(reply)}
            events.append(_sse(usage))
        return [*events, _sse("[DONE]")]

    @staticmethod
    def _envelope(reply: _Reply, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": reply.id,
            "object": kind,
            "created": reply.created,
            "model": reply.model,
            "choices": choices,
        }


class _CompletionDialect(_Dialect):
    id_prefix = "cmpl-"

    def full_body(self, reply: _Reply) -> dict[str, Any]:
        choice = {"index": 0, "text": reply.text, "finish_reason": "stop", "logprobs": None}
        return self._envelope(reply, [choice]) | {"usage": self.usage(reply)}

    def chunk(self, reply: _Reply, index: int) -> bytes:
        choice = {"index": 0, "text": _piece(index), "finish_reason": None, "logprobs": None}
        return _sse(self._envelope(reply, [choice]) | self.null_usage(reply))

    def closing(self, reply: _Reply) -> list[bytes]:
        last = {"index": 0, "text": "", "finish_reason": "stop", "logprobs": None}
        events = [_sse(self._envelope(reply, [last]) | self.null_usage(reply))]
        if reply.include_usage:
            events.append(_sse(self._envelope(reply, []) | {"usage": self.usage(reply)}))
        return [*events, _sse("[DONE]")]

    @staticmethod
    def _envelope(reply: _Reply, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": reply.id,
            "object": "text_completion",
            "created": reply.created,
            "model": reply.model,
            "choices": choices,
        }


class _MessagesDialect(_Dialect):
    id_prefix = "msg_"

    def error_type(self, status: int) -> str:
        return _ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")

    def error_body(self, status: int, message: str, code: str | None = None) -> dict[str, Any]:
        return {"type": "error", "error": {"type": code or self.error_type(status), "message": message}}

    def full_body(self, reply: _Reply) -> dict[str, Any]:
        return self._message(reply, [{"type": "text", "text": reply.text}], "end_turn", reply.usage.output)

    def opening(self, reply: _Reply) -> list[bytes]:
        start = {"type": "message_start", "message": self._message(reply, [], None, 1)}
        block = {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
        return [_sse(start, "message_start"), _sse(block, "content_block_start")]

    def chunk(self, reply: _Reply, index: int) -> bytes:
        text = {"type": "text_delta", "text": _piece(index)}
        return _sse({"type": "content_block_delta", "index": 0, "delta": text}, "content_block_delta")

    def closing(self, reply: _Reply) -> list[bytes]:
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

    def stream_error(self, reply: _Reply, kind: str, *, after: int, form: str) -> bytes:
        error = {"type": kind, "message": f"In-stream error: {kind}"}
        return _sse({"type": "error", "error": error}, "error")

    def window_headers(self, window: _WindowState, *, unified: bool) -> dict[str, str]:
        resets_at = time.time() + window.left
        reset = _rfc3339(resets_at)
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

    @staticmethod
    def _message(reply: _Reply, content: list[dict[str, Any]], stop: str | None, out: int) -> dict[str, Any]:
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


class _ResponsesDialect(_Dialect):
    """The OpenAI Responses API: one output message, every stream event typed and numbered.

    Event ``sequence_number``s follow from the positions: four opening events,
    then one per chunk, then the four closing ones (or the error after a chunk).
    The ``*_events`` builders give the events as objects, shared by the SSE
    stream and the WebSocket mode.
    """

    id_prefix = "resp_"
    _OPENED = 4

    def full_body(self, reply: _Reply) -> dict[str, Any]:
        return self._response(reply, "completed", [self._message(reply, "completed", reply.text)],
                              usage=self.responses_usage(reply))

    def opening(self, reply: _Reply) -> list[bytes]:
        return [_typed_sse(event) for event in self.opening_events(reply)]

    def chunk(self, reply: _Reply, index: int) -> bytes:
        return _typed_sse(self.chunk_event(reply, index))

    def closing(self, reply: _Reply) -> list[bytes]:
        return [_typed_sse(event) for event in self.closing_events(reply)]

    def stream_error(self, reply: _Reply, kind: str, *, after: int, form: str) -> bytes:
        return _typed_sse(self.stream_error_event(reply, kind, after=after, form=form))

    def opening_events(self, reply: _Reply) -> list[dict[str, Any]]:
        snapshot = self._response(reply, "in_progress", [])
        where = {"item_id": self._item_id(reply), "output_index": 0, "content_index": 0}
        return [
            self._event(0, "response.created", response=snapshot),
            self._event(1, "response.in_progress", response=snapshot),
            self._event(2, "response.output_item.added", output_index=0,
                        item=self._message(reply, "in_progress", None)),
            self._event(3, "response.content_part.added", **where, part=self._text_part("")),
        ]

    def chunk_event(self, reply: _Reply, index: int) -> dict[str, Any]:
        return self._event(self._OPENED + index, "response.output_text.delta", item_id=self._item_id(reply),
                           output_index=0, content_index=0, delta=_piece(index), logprobs=[])

    def closing_events(self, reply: _Reply) -> list[dict[str, Any]]:
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

    def stream_error_event(self, reply: _Reply, kind: str, *, after: int, form: str) -> dict[str, Any]:
        seq = self._OPENED + after + 1
        message = _stream_error_message(kind)
        if form == "event":
            return self._event(seq, "error", code=kind, message=message, param=None)
        failed = self._response(reply, "failed", [], error={"code": kind, "message": message})
        return self._event(seq, "response.failed", response=failed)

    def warmup_events(self, reply: _Reply) -> list[dict[str, Any]]:
        """A warm-up's answer (``"generate": false``): created, then completed with no output and no usage."""
        empty = replace(reply, chunks=0, prompt_tokens=0, usage_override={})
        done = self._response(empty, "completed", [], usage=self.responses_usage(empty))
        return [
            self._event(0, "response.created", response=self._response(empty, "in_progress", [])),
            self._event(1, "response.completed", response=done),
        ]

    @staticmethod
    def responses_usage(reply: _Reply) -> dict[str, Any]:
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
    def _item_id(reply: _Reply) -> str:
        return "msg_" + reply.id.removeprefix("resp_")

    @staticmethod
    def _text_part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _message(self, reply: _Reply, status: str, text: str | None) -> dict[str, Any]:
        content = [] if text is None else [self._text_part(text)]
        return {"id": self._item_id(reply), "type": "message", "status": status, "role": "assistant",
                "content": content}

    @staticmethod
    def _response(
        reply: _Reply, status: str, output: list[dict[str, Any]], *,
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


@dataclass(frozen=True)
class _StreamEncoder:
    """One stream's Content-Encoding: one compressor, flushed after every event so each is decodable on arrival."""

    name: str | None
    encode: Callable[[bytes], bytes]
    finish: Callable[[], bytes]

    @classmethod
    def named(cls, name: str | None) -> _StreamEncoder:
        if name is None:
            return cls(None, lambda data: data, lambda: b"")
        if name in ("gzip", "deflate"):
            deflater = zlib.compressobj(wbits=31 if name == "gzip" else 15)
            return cls(name, lambda data: deflater.compress(data) + deflater.flush(zlib.Z_SYNC_FLUSH), deflater.flush)
        if name == "br":
            import brotli  # type: ignore[import-untyped]

            compressor = brotli.Compressor()
            return cls(name, lambda data: compressor.process(data) + compressor.flush(), compressor.finish)
        zstd = zstd_module()
        packer = zstd.ZstdCompressor()
        return cls(name, lambda data: packer.compress(data) + packer.flush(zstd.ZstdCompressor.FLUSH_BLOCK),
                   packer.flush)

    @property
    def headers(self) -> dict[str, str]:
        return {} if self.name is None else {"Content-Encoding": self.name}


_Kind = type[int] | type[float]


def _in_range(raw: str, kind: _Kind, low: float, high: float = math.inf) -> int | float | None:
    """``raw`` read as ``kind`` when it lies in [low, high] (NaN never does), else None."""
    try:
        value = kind(raw)
    except ValueError:
        return None
    return value if low <= value <= high else None


def _number_header(
    headers: Mapping[str, str], name: str, kind: _Kind, low: float, what: str, high: float = math.inf
) -> Any:
    raw = headers.get(name)
    if raw is None:
        return None
    value = _in_range(raw, kind, low, high)
    if value is None:
        raise ValueError(f"{name} must be {what}, got {raw!r}")
    return value


def _flag(headers: Mapping[str, str], name: str) -> bool:
    return headers.get(name, "").strip().lower() in {"1", "true", "yes"}


def _choice(headers: Mapping[str, str], name: str, allowed: Mapping[str, Any] | frozenset[str]) -> str | None:
    raw = headers.get(name)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(sorted(allowed))}, got {raw!r}")
    return value


def _encoding(headers: Mapping[str, str]) -> str | None:
    return _choice(headers, "x-fake-encoding", _ENCODINGS)


def _header_object(headers: Mapping[str, str], name: str) -> dict[str, str]:
    """The JSON object of header names to string values in header ``name``, each checked to be sendable."""
    raw = headers.get(name)
    if raw is None:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, dict) or not all(isinstance(item, str) for item in value.values()):
        raise ValueError(f"{name} must be a JSON object of header names to string values, got {raw!r}")
    for header, item in value.items():
        if not _HEADER_NAME.fullmatch(header) or any(c in item for c in "\r\n\0"):
            raise ValueError(f"{name} holds a header no answer can carry: {header!r}: {item!r}")
    return value


def _usage_object(headers: Mapping[str, str]) -> dict[str, int]:
    """The token figures ``x-fake-usage`` sets: a JSON object of ``_USAGE_FIGURES`` to integers >= 0."""
    name = "x-fake-usage"
    raw = headers.get(name)
    if raw is None:
        return {}
    try:
        decoded = json.loads(raw)
    except ValueError:
        decoded = None
    value: dict[str, Any] | None = decoded if isinstance(decoded, dict) else None
    if value is None:
        raise ValueError(f"{name} must be a JSON object of token figures ({', '.join(_USAGE_FIGURES)}), got {raw!r}")
    for figure, count in value.items():
        if figure not in _USAGE_FIGURES:
            raise ValueError(f"{name} has no figure {figure!r}; the figures are {', '.join(_USAGE_FIGURES)}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"{name}: {figure} must be an integer >= 0, got {_compact(count)}")
    return value


@dataclass(frozen=True)
class _Knobs:
    """The fault-injection headers of one request, validated."""

    status: int | None
    retry_after: bool
    error_code: str | None
    stall_ms: float
    reset_after: int | None
    gzip: bool
    encoding: str | None
    stream_error: str | None
    stream_error_form: str
    chunks: int
    delay_ms: float
    ratelimit_headers: dict[str, str]
    usage: dict[str, int]
    usage_deltas: int

    @classmethod
    def parse(cls, headers: Mapping[str, str], fake: FakeUpstream) -> _Knobs:
        chunks = _number_header(headers, "x-fake-chunks", int, 1, "an integer >= 1")
        delay = _number_header(headers, "x-fake-delay-ms", float, 0, "a number of ms >= 0")
        return cls(
            status=_number_header(headers, "x-fake-status", int, 100, "an HTTP status code"),
            retry_after=not _flag(headers, "x-fake-no-retry-after"),
            error_code=headers.get("x-fake-error-code") or None,
            stall_ms=_number_header(headers, "x-fake-stall-ms", float, 0, "a number of ms >= 0") or 0.0,
            reset_after=_number_header(headers, "x-fake-reset-after", int, 0, "an integer >= 0"),
            gzip=_flag(headers, "x-fake-gzip"),
            encoding=_encoding(headers),
            stream_error=headers.get("x-fake-stream-error") or None,
            stream_error_form=_choice(headers, "x-fake-stream-error-form", _STREAM_ERROR_FORMS) or "failed",
            chunks=fake.chunks if chunks is None else chunks,
            delay_ms=fake.delay_ms if delay is None else delay,
            ratelimit_headers=_header_object(headers, "x-fake-ratelimit-headers"),
            usage=_usage_object(headers),
            usage_deltas=_number_header(headers, "x-fake-usage-deltas", int, 1, "an integer >= 1") or 1,
        )


def not_found_message(method: str, path: str, host: str) -> str:
    """What the fake answers for a path it does not serve: the path, the routes it does, and for a doubled
    ``/v1`` the likely cause (an upstream ending in /v1 in front of clients that add /v1 themselves)."""
    message = f"slotproxy fake-upstream has no route {method} {path}; it serves {SERVED_ROUTES} (with or without /v1)"
    if path.startswith("/v1/v1/"):
        message += (f". The path has /v1 twice: point an Anthropic-style provider's upstream at http://{host} "
                    f"(its clients add /v1), an OpenAI-style one at http://{host}/v1")
    return message


@web.middleware
async def _json_not_found(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """A path the fake does not serve gets a JSON error in the OpenAI shape, not aiohttp's bare text."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        message = not_found_message(request.method, request.path, request.host)
        return web.json_response(_ChatDialect().error_body(404, message, "unknown_url"), status=404)


async def _read_json(request: web.Request) -> tuple[dict[str, Any], int]:
    raw = await request.read()
    try:
        body = json.loads(raw) if raw else {}
    except ValueError:
        body = {}
    return (body if isinstance(body, dict) else {}), len(raw)


def _abort(request: web.Request) -> None:
    """Close the connection with a TCP reset, so the client sees an abrupt failure, not an EOF."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    transport.abort()


@dataclass(eq=False)
class FakeUpstream:
    """A capped fake provider and its statistics.

    ``cap`` is the hard concurrency limit (None: no limit); ``chunks`` and
    ``delay_ms`` shape each answer (a stream sends ``chunks`` chunks
    ``delay_ms`` apart; a non-streaming answer takes ``delay_ms``); ``lag_ms``
    keeps a finished request counted that much longer (the provider's
    accounting lag, also visible in ``/v1/usage``); ``retry_after`` is the
    wait, in seconds, its cap 429s state. ``key_limit`` caps the requests in
    flight per key; ``window_requests`` (None: no window) are admitted per key
    per fixed window of ``window_seconds``, announced in every answer's
    headers; ``unified`` adds Anthropic's unified status to them (see the
    module's text). ``websocket`` False refuses the Responses API's WebSocket
    upgrades with 404; ``ws_refuse_429`` refuses an upgrade with 429 while the
    cap is full. Options may be changed while running.
    """

    cap: int | None = None
    chunks: int = 5
    delay_ms: float = 20
    lag_ms: float = 0
    retry_after: float = 1.0
    key_limit: int | None = None
    window_requests: int | None = None
    window_seconds: float = 60.0
    unified: bool = False
    websocket: bool = True
    ws_refuse_429: bool = False
    max_concurrency: int = field(default=0, init=False)
    active: int = field(default=0, init=False)
    rate_limited: int = field(default=0, init=False)
    window_rejected: int = field(default=0, init=False)
    requests: int = field(default=0, init=False)
    completed: int = field(default=0, init=False)
    arrivals: list[dict[str, Any]] = field(default_factory=list, init=False)
    last_headers: dict[str, str] = field(default_factory=dict, init=False)
    keys: dict[str, _KeyStats] = field(default_factory=dict, init=False)
    websockets: int = field(default=0, init=False)
    websockets_opened: int = field(default=0, init=False)
    _windows: dict[str, _Window] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("cap", "key_limit", "window_requests"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer or None, got {getattr(self, name)!r}")
        if self.chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {self.chunks!r}")
        for name in ("delay_ms", "lag_ms", "retry_after"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0 < self.window_seconds <= MAX_WINDOW_SECONDS:
            raise ValueError(f"window_seconds must be > 0 and <= {MAX_WINDOW_SECONDS:g}, got {self.window_seconds!r}")

    def reset(self) -> None:
        """Zero the statistics and close every key's window.

        ``active`` and the keys with requests in flight stay (with their
        ``in_flight``), since those requests will still end; so do the open
        WebSockets, which ``websockets_opened`` restarts from.
        """
        self.max_concurrency = self.active
        self.websockets_opened = self.websockets
        self.rate_limited = self.window_rejected = self.requests = self.completed = 0
        self.arrivals.clear()
        self.last_headers = {}
        self.keys = {
            key: _KeyStats(in_flight=account.in_flight, max_concurrent=account.in_flight)
            for key, account in self.keys.items() if account.in_flight
        }
        self._windows.clear()

    def stats(self) -> dict[str, Any]:
        """The statistics (and the limits), as ``GET /stats`` answers them."""
        return {
            "cap": self.cap,
            "key_limit": self.key_limit,
            "window_requests": self.window_requests,
            "window_seconds": self.window_seconds,
            "max_concurrency": self.max_concurrency,
            "active": self.active,
            "rate_limited": self.rate_limited,
            "window_rejected": self.window_rejected,
            "requests": self.requests,
            "completed": self.completed,
            "arrivals": list(self.arrivals),
            "last_headers": dict(self.last_headers),
            "keys": {key: asdict(account) for key, account in self.keys.items()},
            "websockets": self.websockets,
            "websockets_opened": self.websockets_opened,
        }

    def app(self) -> web.Application:
        """The aiohttp application serving this fake."""
        app = web.Application(middlewares=[_json_not_found])
        # Each API path with and without its /v1: an upstream of http://127.0.0.1:P/v1 (OpenAI's shape) and one
        # of http://127.0.0.1:P (Anthropic's, whose clients add /v1 themselves) both reach it.
        for prefix in API_PREFIXES:
            app.router.add_post(f"{prefix}/chat/completions", self._route(_ChatDialect()))
            app.router.add_post(f"{prefix}/completions", self._route(_CompletionDialect()))
            app.router.add_post(f"{prefix}/messages", self._route(_MessagesDialect()))
            app.router.add_post(f"{prefix}/responses", self._route(_ResponsesDialect()))
            app.router.add_get(f"{prefix}/responses", self._responses_socket, allow_head=False)
            app.router.add_get(f"{prefix}/models", self._models)
            app.router.add_get(f"{prefix}/usage", self._usage)
        app.router.add_get("/stats", self._stats)
        app.router.add_post("/stats/reset", self._reset)
        return app

    def _route(self, dialect: _Dialect) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await self._handle(request, dialect)

        return handler

    async def _handle(self, request: web.Request, dialect: _Dialect) -> web.StreamResponse:
        body, size = await _read_json(request)
        key = _key(request.headers)
        self._record(request.headers, body, key, request.headers.get("x-fake-tag"))
        try:
            knobs = _Knobs.parse(request.headers, self)
            reply = self._reply(dialect, body, size, knobs)
            reply.usage.check()
        except ValueError as exc:
            return web.json_response(dialect.error_body(400, str(exc)), status=400)
        window = self._window(key)
        refusal = self._refusal(key, window)
        if refusal is not None:
            message, wait = refusal
            return self._error(dialect, 429, message, key=key, retry_after=wait,
                               headers=self._headers(dialect, window, knobs))
        self._admit(key, window)
        headers = self._headers(dialect, window, knobs)
        try:
            return await self._answer(request, dialect, knobs, reply, key, headers)
        finally:
            self._schedule_release(key)

    def _window(self, key: str) -> _Window | None:
        """``key``'s open window (a new one once the last has ended); None without ``window_requests``."""
        if self.window_requests is None:
            return None
        now = time.monotonic()
        window = self._windows.get(key)
        if window is None or now - window.opened >= self.window_seconds:
            window = self._windows[key] = _Window(now)
        return window

    def _refusal(self, key: str, window: _Window | None) -> tuple[str, float] | None:
        """Why a 429 turns this request away and the wait it states, or None to admit it.

        A refusal by the window is counted in ``window_rejected`` here.
        """
        if window is not None and self.window_requests is not None and window.admitted >= self.window_requests:
            self.window_rejected += 1
            wait = math.ceil((window.opened + self.window_seconds - time.monotonic()) * 1000) / 1000
            return f"Request limit reached: {self.window_requests} per {self.window_seconds:g}s", max(0.001, wait)
        if self.cap is not None and self.active >= self.cap:
            return "Concurrency limit exceeded", self.retry_after
        if self.key_limit is not None and self.keys[key].in_flight >= self.key_limit:
            return "Concurrency limit exceeded for this key", self.retry_after
        return None

    def _headers(self, dialect: _Dialect, window: _Window | None, knobs: _Knobs) -> dict[str, str]:
        """An answer's extra headers: its window announced (when there is one), then ``x-fake-ratelimit-headers``."""
        if window is None or self.window_requests is None:
            return dict(knobs.ratelimit_headers)
        left = max(0.0, window.opened + self.window_seconds - time.monotonic())
        state = _WindowState(limit=self.window_requests, admitted=window.admitted, left=left)
        return dialect.window_headers(state, unified=self.unified) | knobs.ratelimit_headers

    def _record(self, headers: Mapping[str, str], body: dict[str, Any], key: str, tag: str | None) -> None:
        """Count one model request; ``tag`` None falls back to the body's ``user``."""
        self.requests += 1
        self.keys.setdefault(key, _KeyStats()).requests += 1
        self.last_headers = {name.lower(): value for name, value in headers.items()}
        if tag is None:
            tag = body.get("user") if isinstance(body.get("user"), str) else ""
        self.arrivals.append({"tag": tag, "at": int(time.time() * 1000)})
        if len(self.arrivals) > ARRIVALS_KEPT:
            del self.arrivals[: len(self.arrivals) - ARRIVALS_KEPT]

    def _admit(self, key: str, window: _Window | None) -> None:
        self.active += 1
        self.max_concurrency = max(self.max_concurrency, self.active)
        account = self.keys[key]
        account.in_flight += 1
        account.max_concurrent = max(account.max_concurrent, account.in_flight)
        if window is not None:
            window.admitted += 1

    def _schedule_release(self, key: str) -> None:
        if self.lag_ms > 0:
            asyncio.get_running_loop().call_later(self.lag_ms / 1000, self._release, key)
        else:
            self._release(key)

    def _release(self, key: str) -> None:
        self.active -= 1
        self.keys[key].in_flight -= 1

    def _count_rate_limited(self, key: str) -> None:
        self.rate_limited += 1
        self.keys.setdefault(key, _KeyStats()).rejected += 1

    @staticmethod
    def _reply(dialect: _Dialect, body: dict[str, Any], size: int, knobs: _Knobs) -> _Reply:
        options = body.get("stream_options")
        return _Reply(
            id=dialect.id_prefix + uuid.uuid4().hex[:24],
            model=str(body.get("model") or MODEL),
            created=int(time.time()),
            chunks=knobs.chunks,
            prompt_tokens=max(1, size // 4),
            stream=body.get("stream") is True,
            include_usage=isinstance(options, dict) and bool(options.get("include_usage")),
            usage_override=knobs.usage,
            usage_deltas=knobs.usage_deltas,
        )

    def _error(
        self, dialect: _Dialect, status: int, message: str, *, key: str, retry_after: float | None,
        headers: Mapping[str, str], code: str | None = None,
    ) -> web.Response:
        """An error answer; a 429 is counted (for its key too) and states ``retry_after`` seconds unless None."""
        waits: dict[str, str] = {}
        if status == 429:
            self._count_rate_limited(key)
            if retry_after is not None:
                waits = _retry_after_headers(retry_after)
        response = web.json_response(dialect.error_body(status, message, code), status=status, headers=waits)
        response.headers.update(headers)
        return response

    async def _answer(
        self, request: web.Request, dialect: _Dialect, knobs: _Knobs, reply: _Reply, key: str,
        headers: Mapping[str, str],
    ) -> web.StreamResponse:
        if knobs.stall_ms:
            await asyncio.sleep(knobs.stall_ms / 1000)
        if knobs.status is not None:
            error = self._error(
                dialect, knobs.status, f"Injected status {knobs.status}", key=key,
                retry_after=self.retry_after if knobs.retry_after else None, headers=headers, code=knobs.error_code,
            )
            return await self._send(request, error)
        if reply.stream:
            return await self._stream(request, dialect, knobs, reply, headers)
        if knobs.reset_after is not None:
            _abort(request)
            return web.Response()
        await asyncio.sleep(knobs.delay_ms / 1000)
        return await self._send(request, self._full(dialect, reply, knobs.gzip, headers))

    @staticmethod
    def _full(dialect: _Dialect, reply: _Reply, compress: bool, headers: Mapping[str, str]) -> web.Response:
        data = json.dumps(dialect.full_body(reply)).encode()
        if compress:
            response = web.Response(
                body=gzip.compress(data), content_type="application/json", headers={"Content-Encoding": "gzip"}
            )
        else:
            response = web.Response(body=data, content_type="application/json")
        response.headers.update(headers)
        return response

    async def _send(self, request: web.Request, response: web.Response) -> web.Response:
        """Send the whole answer before the handler returns, so its slot is held until the last byte."""
        try:
            await response.prepare(request)
            await response.write_eof()
        except ConnectionResetError:
            return response
        self.completed += 1
        return response

    async def _stream(
        self, request: web.Request, dialect: _Dialect, knobs: _Knobs, reply: _Reply, headers: Mapping[str, str]
    ) -> web.StreamResponse:
        encoder = _StreamEncoder.named(knobs.encoding)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **encoder.headers}
        )
        response.headers.update(headers)

        async def write(event: bytes) -> None:
            await response.write(encoder.encode(event))

        try:
            await response.prepare(request)
            for event in dialect.opening(reply):
                await write(event)
            if not await self._stream_chunks(request, write, dialect, knobs, reply):
                return response
            await response.write_eof(encoder.finish())
        except ConnectionResetError:
            return response
        self.completed += 1
        return response

    @staticmethod
    async def _stream_chunks(
        request: web.Request, write: Callable[[bytes], Awaitable[None]], dialect: _Dialect, knobs: _Knobs,
        reply: _Reply,
    ) -> bool:
        """Write the chunks and the closing events; False when the connection was reset on purpose.

        Each chunk is awaited onto the socket before the next delay, so a client
        sees the first chunk long before the last.
        """
        for index in range(reply.chunks):
            if index == knobs.reset_after:
                break
            await asyncio.sleep(knobs.delay_ms / 1000)
            await write(dialect.chunk(reply, index))
            if knobs.stream_error:
                await write(dialect.stream_error(reply, knobs.stream_error, after=index,
                                                 form=knobs.stream_error_form))
                return True
        if knobs.reset_after is not None:
            _abort(request)
            return False
        for event in dialect.closing(reply):
            await write(event)
        return True

    async def _responses_socket(self, request: web.Request) -> web.StreamResponse:
        return await _ResponsesSocket.handshake(self, request)

    async def _models(self, request: web.Request) -> web.Response:
        """A model list both SDKs accept: OpenAI's fields and Anthropic's side by side."""
        model = {
            "id": MODEL,
            "object": "model",
            "created": 0,
            "owned_by": "slotproxy",
            "type": "model",
            "display_name": "Fake model",
            "created_at": "2024-01-01T00:00:00Z",
        }
        return web.json_response(
            {"object": "list", "data": [model], "has_more": False, "first_id": MODEL, "last_id": MODEL}
        )

    async def _usage(self, request: web.Request) -> web.Response:
        return web.json_response({"concurrent": {"sessions": self.active}})

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats())

    async def _reset(self, request: web.Request) -> web.Response:
        self.reset()
        return web.json_response(self.stats())


# --- the Responses API over WebSocket ----------------------------------------------------------

_KNOB_PREFIX = "x-fake-"
_SOCKET_KNOBS = frozenset({
    "chunks", "delay-ms", "stall-ms", "status", "no-retry-after", "error-code", "tag",
    "stream-error", "stream-error-form", "close-after", "drop-after", "usage",
})
_OBJECT_KNOBS = frozenset({"usage"})
"""Frame knobs given as a JSON object (their header holds its JSON text)."""
_REFUSAL_STATUSES = (200, 599)


def _knob_text(name: str, value: Any) -> str:
    """A frame knob's JSON value as the header value it stands for."""
    if name in _OBJECT_KNOBS:
        if isinstance(value, dict):
            return _compact(value)
        raise ValueError(f"x_fake.{name} must be a JSON object, got {_compact(value)}")
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, str | int | float):
        return str(value)
    raise ValueError(f"x_fake.{name} must be a string, a number or a boolean, got {_compact(value)}")


def _socket_knob_headers(handshake: Mapping[str, str], frame_knobs: Any) -> dict[str, str]:
    """One response's knobs as headers: the handshake's, overridden by the frame's ``x_fake`` (null unsets)."""
    merged = {name: value for name, value in handshake.items()
              if name.startswith(_KNOB_PREFIX) and name.removeprefix(_KNOB_PREFIX) in _SOCKET_KNOBS}
    if frame_knobs is None:
        return merged
    if not isinstance(frame_knobs, dict):
        raise TypeError(f"x_fake must be a JSON object, got {_compact(frame_knobs)}")
    for name, value in frame_knobs.items():
        if name not in _SOCKET_KNOBS:
            raise ValueError(f"x_fake has no knob {name!r}; the knobs are {', '.join(sorted(_SOCKET_KNOBS))}")
        if value is None:
            merged.pop(_KNOB_PREFIX + name, None)
        else:
            merged[_KNOB_PREFIX + name] = _knob_text(name, value)
    return merged


def _socket_tag(handshake: Mapping[str, str], frame_knobs: Any) -> str | None:
    if isinstance(frame_knobs, dict) and isinstance(frame_knobs.get("tag"), str):
        return str(frame_knobs["tag"])
    return handshake.get("x-fake-tag")


def _stream_error_status(kind: str) -> int:
    if "rate_limit" in kind:
        return 429
    return 503 if "overloaded" in kind else 500


@dataclass(frozen=True)
class _Cut:
    """Where a response is cut off: after ``after`` deltas, by a 1011 close or (``drop``) a TCP reset."""

    after: int
    drop: bool


@dataclass(frozen=True)
class _SocketKnobs(_Knobs):
    """One WebSocket response's knobs: the HTTP ones that apply, and the cut."""

    cut: _Cut | None = None

    @classmethod
    def parse(cls, headers: Mapping[str, str], fake: FakeUpstream) -> _SocketKnobs:
        close_after = _number_header(headers, "x-fake-close-after", int, 0, "an integer >= 0")
        drop_after = _number_header(headers, "x-fake-drop-after", int, 0, "an integer >= 0")
        if close_after is not None and drop_after is not None:
            raise ValueError("close-after and drop-after cannot both be set")
        cut = None if close_after is None and drop_after is None else \
            _Cut(close_after if drop_after is None else drop_after, drop=drop_after is not None)
        return cls(**vars(_Knobs.parse(headers, fake)), cut=cut)


class _ResponsesSocket:
    """One WebSocket of the Responses API, as Codex opens it.

    Its text frames are answered one after another, in order: a worker task
    answers them while a reader task watches for the client's close, so a
    client that closes (or vanishes) mid-response frees its slot at once. A
    cut-off waits for both to stop, since aiohttp skips the close handshake
    when ``close()`` runs beside a ``receive()``.
    """

    dialect = _ResponsesDialect()

    def __init__(self, fake: FakeUpstream, request: web.Request, ws: web.WebSocketResponse) -> None:
        self.fake = fake
        self.request = request
        self.ws = ws
        self.headers = {name.lower(): value for name, value in request.headers.items()}
        self.key = _key(request.headers)

    @classmethod
    async def handshake(cls, fake: FakeUpstream, request: web.Request) -> web.StreamResponse:
        if request.headers.get(hdrs.UPGRADE, "").strip().lower() != "websocket":
            raise web.HTTPMethodNotAllowed(request.method, ["POST"])
        fake.last_headers = {name.lower(): value for name, value in request.headers.items()}
        refusal = cls._refusal(fake, request)
        if refusal is not None:
            return refusal
        offered = [p.strip() for p in request.headers.get(hdrs.SEC_WEBSOCKET_PROTOCOL, "").split(",") if p.strip()]
        ws = web.WebSocketResponse(autoping=True, compress=True, max_msg_size=0, protocols=offered)
        await ws.prepare(request)
        fake.websockets += 1
        fake.websockets_opened += 1
        try:
            await cls(fake, request, ws).serve()
        finally:
            fake.websockets -= 1
        return ws

    @classmethod
    def _refusal(cls, fake: FakeUpstream, request: web.Request) -> web.Response | None:
        """The answer refusing this upgrade, or None to accept it."""
        if not fake.websocket:
            body = cls.dialect.error_body(404, "This server does not serve the Responses API over WebSocket")
            return web.json_response(body, status=404)
        low, high = _REFUSAL_STATUSES
        try:
            status = _number_header(request.headers, "x-fake-ws-refuse", int, low, f"a status {low}-{high}", high)
        except ValueError as exc:
            return web.json_response(cls.dialect.error_body(400, str(exc)), status=400)
        key = _key(request.headers)
        wait = None if _flag(request.headers, "x-fake-no-retry-after") else fake.retry_after
        if status is not None:
            return fake._error(cls.dialect, status, f"Injected refusal {status} of the WebSocket upgrade",
                               key=key, retry_after=wait, headers={})
        if fake.ws_refuse_429 and fake.cap is not None and fake.active >= fake.cap:
            return fake._error(cls.dialect, 429, "Concurrency limit exceeded", key=key, retry_after=wait, headers={})
        return None

    async def serve(self) -> None:
        frames: asyncio.Queue[str] = asyncio.Queue()
        reader = asyncio.create_task(self._read(frames))
        worker = asyncio.create_task(self._work(frames))
        try:
            await asyncio.wait((reader, worker), return_when=asyncio.FIRST_COMPLETED)
        finally:
            reader.cancel()
            worker.cancel()
            await asyncio.wait((reader, worker))
        cut = None if worker.cancelled() else worker.result()
        if cut is not None:
            await self._cut_off(cut)

    async def _read(self, frames: asyncio.Queue[str]) -> None:
        async for message in self.ws:
            if message.type is WSMsgType.TEXT:
                frames.put_nowait(message.data)

    async def _work(self, frames: asyncio.Queue[str]) -> _Cut | None:
        """Answer the frames until one cuts the socket off; None once the client is gone."""
        try:
            while True:
                cut = await self._frame(await frames.get())
                if cut is not None:
                    return cut
        except ConnectionResetError:
            return None

    async def _frame(self, text: str) -> _Cut | None:
        try:
            frame = json.loads(text)
        except ValueError:
            frame = None
        if not isinstance(frame, dict):
            await self._send_error(400, "A text frame must hold a JSON object, such as a response.create event")
            return None
        if frame.get("type") != "response.create":
            return None
        return await self._respond(frame, len(text))

    async def _respond(self, frame: dict[str, Any], size: int) -> _Cut | None:
        """Count, admit and answer one ``response.create``; what to cut the socket with, if anything."""
        fake, key = self.fake, self.key
        body = frame["response"] if isinstance(frame.get("response"), dict) else frame
        frame_knobs = frame.get("x_fake")
        fake._record(self.headers, body, key, _socket_tag(self.headers, frame_knobs))
        warmup = body.get("generate") is False
        try:
            knobs = _SocketKnobs.parse(_socket_knob_headers(self.headers, frame_knobs), fake)
            reply = fake._reply(self.dialect, body, size, knobs)
            if not warmup:  # a warm-up reports no usage, whatever the knob says
                reply.usage.check()
        except (TypeError, ValueError) as exc:
            await self._send_error(400, str(exc))
            return None
        window = fake._window(key)
        refusal = fake._refusal(key, window)
        if refusal is not None:
            message, wait = refusal
            fake._count_rate_limited(key)
            await self._send_error(429, f"{message}. Please try again in {_openai_duration(wait)}.", retry_after=wait)
            return None
        fake._admit(key, window)
        try:
            return await self._answer(knobs, reply, warmup)
        finally:
            fake._schedule_release(key)

    async def _answer(self, knobs: _SocketKnobs, reply: _Reply, warmup: bool) -> _Cut | None:
        if knobs.stall_ms and not warmup:
            await asyncio.sleep(knobs.stall_ms / 1000)
        if knobs.status is not None:
            await self._injected_status(knobs)
        elif warmup:
            await self._send_all(self.dialect.warmup_events(reply))
        else:
            cut = await self._stream(knobs, reply)
            if cut is not None:
                return cut
        self.fake.completed += 1
        return None

    async def _stream(self, knobs: _SocketKnobs, reply: _Reply) -> _Cut | None:
        await self._send_all(self.dialect.opening_events(reply))
        cut = knobs.cut
        for index in range(reply.chunks):
            if cut is not None and index == cut.after:
                return cut
            await asyncio.sleep(knobs.delay_ms / 1000)
            await self._send(self.dialect.chunk_event(reply, index))
            if knobs.stream_error:
                await self._send(self._stream_error(reply, knobs.stream_error, knobs.stream_error_form, index))
                return None
        if cut is not None:
            return cut
        await self._send_all(self.dialect.closing_events(reply))
        return None

    def _stream_error(self, reply: _Reply, kind: str, form: str, after: int) -> dict[str, Any]:
        """``response.failed`` (form ``failed``), else a top-level error frame with the status it stands for."""
        if form == "failed":
            return self.dialect.stream_error_event(reply, kind, after=after, form=form)
        error = {"type": kind, "code": kind, "message": _stream_error_message(kind)}
        return {"type": "error", "status": _stream_error_status(kind), "error": error}

    async def _injected_status(self, knobs: _SocketKnobs) -> None:
        status = knobs.status
        assert status is not None
        if status == 429:
            self.fake._count_rate_limited(self.key)
        wait = self.fake.retry_after if status == 429 and knobs.retry_after else None
        await self._send_error(status, f"Injected status {status}", code=knobs.error_code, retry_after=wait)

    async def _send_error(
        self, status: int, message: str, *, code: str | None = None, retry_after: float | None = None
    ) -> None:
        """An error frame as Codex reads one: ``status`` set, and for a 429 the wait in ``headers``."""
        frame: dict[str, Any] = {"type": "error", "status": status,
                                 "error": self.dialect.error_body(status, message, code)["error"]}
        if retry_after is not None:
            frame["headers"] = _retry_after_headers(retry_after)
        await self._send(frame)

    async def _send_all(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            await self._send(event)

    async def _send(self, event: dict[str, Any]) -> None:
        await self.ws.send_str(_compact(event))

    async def _cut_off(self, cut: _Cut) -> None:
        if cut.drop:
            _abort(self.request)
            return
        await self.ws.close(code=WSCloseCode.INTERNAL_ERROR, message=b"Injected upstream close")


async def start_fake_upstream(
    fake: FakeUpstream, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, int]:
    """Serve ``fake`` in this event loop; returns the runner (to ``cleanup()``) and the bound port.

    Handler cancellation is on, so a client that goes away frees its slot at
    once, as a provider watching its sockets would.
    """
    runner = web.AppRunner(fake.app(), handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, runner.addresses[0][1]


def _bounded(kind: _Kind, low: float, high: float, what: str) -> Callable[[str], Any]:
    """An argparse ``type`` that accepts ``kind`` values in [low, high] and names the rule it enforces."""

    def convert(raw: str) -> int | float:
        value = _in_range(raw, kind, low, high)
        if value is None:
            raise argparse.ArgumentTypeError(f"must be {what}, got {raw!r}")
        return value

    return convert


_port = _bounded(int, 0, 65535, "a port number 0-65535")
_positive_int = _bounded(int, 1, math.inf, "a positive integer")
_non_negative = _bounded(float, 0, math.inf, "a number >= 0")
_window_length = _bounded(float, math.ulp(0.0), MAX_WINDOW_SECONDS, f"a number > 0 and <= {MAX_WINDOW_SECONDS:g}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``fake-upstream`` flags.

    Dests: port, cap, chunks, delay_ms, lag_ms, key_limit, window_requests, window_seconds, unified,
    websocket, ws_refuse_429.
    """
    add = parser.add_argument
    add("--port", type=_port, default=DEFAULT_PORT, help="port on 127.0.0.1 (default 9100)")
    add("--cap", type=_positive_int, default=None, help="hard concurrency cap (default: none)")
    add("--chunks", type=_positive_int, default=5, help="stream chunks per answer (default 5)")
    add("--delay-ms", type=_non_negative, default=20.0, help="ms between chunks (default 20)")
    add("--lag-ms", type=_non_negative, default=0.0, help="ms a finished request stays counted (default 0)")
    add("--key-limit", type=_positive_int, default=None, help="concurrency cap per API key (default: none)")
    add("--window-requests", type=_positive_int, default=None,
        help="requests admitted per API key per window, announced in rate-limit headers (default: no window)")
    add("--window-seconds", type=_window_length, default=60.0, help="length of a key's request window (default 60)")
    add("--unified", action="store_true",
        help="Anthropic answers also carry the unified rate-limit headers (default: off)")
    add("--no-websocket", dest="websocket", action="store_false",
        help="refuse WebSocket upgrades of /v1/responses with 404, as a server without that mode "
             "(default: upgrades accepted)")
    add("--ws-refuse-429", action="store_true",
        help="refuse a WebSocket upgrade with 429 while the cap is full (default: off; the upgrade succeeds "
             "and a response.create over the cap gets an error event)")


async def _serve_until_signalled(fake: FakeUpstream, port: int) -> None:
    try:
        runner, bound = await start_fake_upstream(fake, port=port)
    except OSError as exc:  # a taken port is one line (slotproxy: cannot listen on ...), exit 2: no traceback
        from ...server.bind import failure

        bind_failed = failure(exc, "127.0.0.1", port, host_flag=None)
        if bind_failed is None:
            raise
        raise bind_failed from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    cap = "none" if fake.cap is None else fake.cap
    details = [f"cap={cap}", f"chunks={fake.chunks}", f"delay_ms={fake.delay_ms:g}", f"lag_ms={fake.lag_ms:g}"]
    if fake.key_limit is not None:
        details.append(f"key_limit={fake.key_limit}")
    if fake.window_requests is not None:
        details.append(f"window={fake.window_requests}/{fake.window_seconds:g}s")
    if fake.unified:
        details.append("unified")
    if not fake.websocket:
        details.append("no-websocket")
    if fake.ws_refuse_429:
        details.append("ws-refuse-429")
    print(f"fake-upstream listening on http://127.0.0.1:{bound} ({', '.join(details)})", flush=True)
    try:
        await stop.wait()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        await runner.cleanup()


def run(
    port: int = DEFAULT_PORT,
    cap: int | None = None,
    chunks: int = 5,
    delay_ms: float = 20.0,
    lag_ms: float = 0.0,
    *,
    key_limit: int | None = None,
    window_requests: int | None = None,
    window_seconds: float = 60.0,
    unified: bool = False,
    websocket: bool = True,
    ws_refuse_429: bool = False,
) -> None:
    """Serve a fake upstream on 127.0.0.1 until SIGINT or SIGTERM (the ``fake-upstream`` command)."""
    fake = FakeUpstream(
        cap=cap, chunks=chunks, delay_ms=delay_ms, lag_ms=lag_ms, key_limit=key_limit,
        window_requests=window_requests, window_seconds=window_seconds, unified=unified,
        websocket=websocket, ws_refuse_429=ws_refuse_429,
    )
    asyncio.run(_serve_until_signalled(fake, port))
