"""A mock LLM provider with a hard concurrency cap, for the demo, the tests and the benchmarks.

It speaks enough of the OpenAI (``/v1/chat/completions``, ``/v1/completions``,
``/v1/responses``) and Anthropic (``/v1/messages``) APIs for the official SDKs
to parse its answers, streamed or not. Over its cap it answers 429 with
Retry-After, like a real provider, and it keeps the statistics a test needs to
prove that a proxy in front of it never went over: the highest concurrency it
ever admitted, the 429s it sent, and the tags of the requests in arrival order.

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
==============================  ===============================================

``br`` uses the ``brotli`` package and ``zstd`` the standard library's (or its
backport's) ``compression.zstd``, both installed with slotproxy.

Only model requests (the four POST routes) are counted and capped; ``/v1/models``,
``/v1/usage`` and ``/stats`` never are, so polling them changes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import math
import signal
import socket
import struct
import time
import uuid
import zlib
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from .decoders import zstd_module

__all__ = ["FakeUpstream", "add_arguments", "run", "start_fake_upstream"]

ARRIVALS_KEPT = 10_000
DEFAULT_PORT = 9100
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
_STREAM_ERROR_FORMS = frozenset({"failed", "event"})
_ENCODINGS = frozenset({"gzip", "deflate", "br", "zstd"})


def _sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"{head}data: {payload}\n\n".encode()


def _piece(index: int) -> str:
    return f"tok{index} "


@dataclass(frozen=True)
class _Reply:
    """What one answer is about: its id, model, size and the prompt's token estimate."""

    id: str
    model: str
    created: int
    chunks: int
    prompt_tokens: int
    stream: bool
    include_usage: bool

    @property
    def text(self) -> str:
        return "".join(_piece(i) for i in range(self.chunks))


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

    def usage(self, reply: _Reply) -> dict[str, int]:
        return {
            "prompt_tokens": reply.prompt_tokens,
            "completion_tokens": reply.chunks,
            "total_tokens": reply.prompt_tokens + reply.chunks,
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
        return _sse(self._envelope(reply, "chat.completion.chunk", [choice]))

    def closing(self, reply: _Reply) -> list[bytes]:
        last = {"index": 0, "delta": {}, "finish_reason": "stop"}
        events = [_sse(self._envelope(reply, "chat.completion.chunk", [last]))]
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
        return self._envelope(reply, choice) | {"usage": self.usage(reply)}

    def chunk(self, reply: _Reply, index: int) -> bytes:
        choice = {"index": 0, "text": _piece(index), "finish_reason": None, "logprobs": None}
        return _sse(self._envelope(reply, choice))

    def closing(self, reply: _Reply) -> list[bytes]:
        last = {"index": 0, "text": "", "finish_reason": "stop", "logprobs": None}
        return [_sse(self._envelope(reply, last)), _sse("[DONE]")]

    @staticmethod
    def _envelope(reply: _Reply, choice: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": reply.id,
            "object": "text_completion",
            "created": reply.created,
            "model": reply.model,
            "choices": [choice],
        }


class _MessagesDialect(_Dialect):
    id_prefix = "msg_"

    def error_type(self, status: int) -> str:
        return _ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")

    def error_body(self, status: int, message: str, code: str | None = None) -> dict[str, Any]:
        return {"type": "error", "error": {"type": code or self.error_type(status), "message": message}}

    def full_body(self, reply: _Reply) -> dict[str, Any]:
        return self._message(reply, [{"type": "text", "text": reply.text}], "end_turn", reply.chunks)

    def opening(self, reply: _Reply) -> list[bytes]:
        start = {"type": "message_start", "message": self._message(reply, [], None, 1)}
        block = {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
        return [_sse(start, "message_start"), _sse(block, "content_block_start")]

    def chunk(self, reply: _Reply, index: int) -> bytes:
        text = {"type": "text_delta", "text": _piece(index)}
        return _sse({"type": "content_block_delta", "index": 0, "delta": text}, "content_block_delta")

    def closing(self, reply: _Reply) -> list[bytes]:
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": None},
            "usage": {"output_tokens": reply.chunks},
        }
        return [
            _sse({"type": "content_block_stop", "index": 0}, "content_block_stop"),
            _sse(delta, "message_delta"),
            _sse({"type": "message_stop"}, "message_stop"),
        ]

    def stream_error(self, reply: _Reply, kind: str, *, after: int, form: str) -> bytes:
        error = {"type": kind, "message": f"In-stream error: {kind}"}
        return _sse({"type": "error", "error": error}, "error")

    @staticmethod
    def _message(reply: _Reply, content: list[dict[str, Any]], stop: str | None, out: int) -> dict[str, Any]:
        return {
            "id": reply.id,
            "type": "message",
            "role": "assistant",
            "model": reply.model,
            "content": content,
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": out},
        }


class _ResponsesDialect(_Dialect):
    """The OpenAI Responses API: one output message, every stream event typed and numbered.

    Event ``sequence_number``s follow from the positions: four opening events,
    then one per chunk, then the four closing ones (or the error after a chunk).
    """

    id_prefix = "resp_"
    _OPENED = 4

    def full_body(self, reply: _Reply) -> dict[str, Any]:
        return self._response(reply, "completed", [self._message(reply, "completed", reply.text)],
                              usage=self.responses_usage(reply))

    def opening(self, reply: _Reply) -> list[bytes]:
        snapshot = self._response(reply, "in_progress", [])
        where = {"item_id": self._item_id(reply), "output_index": 0, "content_index": 0}
        return [
            self._event(0, "response.created", response=snapshot),
            self._event(1, "response.in_progress", response=snapshot),
            self._event(2, "response.output_item.added", output_index=0,
                        item=self._message(reply, "in_progress", None)),
            self._event(3, "response.content_part.added", **where, part=self._text_part("")),
        ]

    def chunk(self, reply: _Reply, index: int) -> bytes:
        return self._event(self._OPENED + index, "response.output_text.delta", item_id=self._item_id(reply),
                           output_index=0, content_index=0, delta=_piece(index), logprobs=[])

    def closing(self, reply: _Reply) -> list[bytes]:
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

    def stream_error(self, reply: _Reply, kind: str, *, after: int, form: str) -> bytes:
        seq = self._OPENED + after + 1
        message = _RATE_LIMIT_MESSAGE if "rate_limit" in kind else f"In-stream error: {kind}"
        if form == "event":
            return self._event(seq, "error", code=kind, message=message, param=None)
        failed = self._response(reply, "failed", [], error={"code": kind, "message": message})
        return self._event(seq, "response.failed", response=failed)

    @staticmethod
    def responses_usage(reply: _Reply) -> dict[str, Any]:
        return {
            "input_tokens": reply.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": reply.chunks,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": reply.prompt_tokens + reply.chunks,
        }

    @staticmethod
    def _event(seq: int, kind: str, **fields: Any) -> bytes:
        return _sse({"type": kind, "sequence_number": seq, **fields}, kind)

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


def _number_header(headers: Mapping[str, str], name: str, kind: _Kind, low: float, what: str) -> Any:
    raw = headers.get(name)
    if raw is None:
        return None
    value = _in_range(raw, kind, low)
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
        )


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
    wait, in seconds, its 429s state. Options may be changed while running.
    """

    cap: int | None = None
    chunks: int = 5
    delay_ms: float = 20
    lag_ms: float = 0
    retry_after: float = 1.0
    max_concurrency: int = field(default=0, init=False)
    active: int = field(default=0, init=False)
    rate_limited: int = field(default=0, init=False)
    requests: int = field(default=0, init=False)
    completed: int = field(default=0, init=False)
    arrivals: list[dict[str, Any]] = field(default_factory=list, init=False)
    last_headers: dict[str, str] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if self.cap is not None and self.cap < 1:
            raise ValueError(f"cap must be a positive integer or None, got {self.cap!r}")
        if self.chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {self.chunks!r}")
        for name in ("delay_ms", "lag_ms", "retry_after"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")

    def reset(self) -> None:
        """Zero the statistics; ``active`` stays, since requests in flight will still end."""
        self.max_concurrency = self.active
        self.rate_limited = self.requests = self.completed = 0
        self.arrivals.clear()
        self.last_headers = {}

    def stats(self) -> dict[str, Any]:
        """The statistics (and the cap), as ``GET /stats`` answers them."""
        return {
            "cap": self.cap,
            "max_concurrency": self.max_concurrency,
            "active": self.active,
            "rate_limited": self.rate_limited,
            "requests": self.requests,
            "completed": self.completed,
            "arrivals": list(self.arrivals),
            "last_headers": dict(self.last_headers),
        }

    def app(self) -> web.Application:
        """The aiohttp application serving this fake."""
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._route(_ChatDialect()))
        app.router.add_post("/v1/completions", self._route(_CompletionDialect()))
        app.router.add_post("/v1/messages", self._route(_MessagesDialect()))
        app.router.add_post("/v1/responses", self._route(_ResponsesDialect()))
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/usage", self._usage)
        app.router.add_get("/stats", self._stats)
        app.router.add_post("/stats/reset", self._reset)
        return app

    def _route(self, dialect: _Dialect) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await self._handle(request, dialect)

        return handler

    async def _handle(self, request: web.Request, dialect: _Dialect) -> web.StreamResponse:
        body, size = await _read_json(request)
        self._record(request, body)
        try:
            knobs = _Knobs.parse(request.headers, self)
        except ValueError as exc:
            return web.json_response(dialect.error_body(400, str(exc)), status=400)
        if self.cap is not None and self.active >= self.cap:
            return self._error(dialect, 429, "Concurrency limit exceeded", retry_after=True)
        self._admit()
        try:
            return await self._answer(request, dialect, knobs, self._reply(dialect, body, size, knobs))
        finally:
            self._schedule_release()

    def _record(self, request: web.Request, body: dict[str, Any]) -> None:
        self.requests += 1
        self.last_headers = {name.lower(): value for name, value in request.headers.items()}
        tag = request.headers.get("x-fake-tag")
        if tag is None:
            tag = body.get("user") if isinstance(body.get("user"), str) else ""
        self.arrivals.append({"tag": tag, "at": int(time.time() * 1000)})
        if len(self.arrivals) > ARRIVALS_KEPT:
            del self.arrivals[: len(self.arrivals) - ARRIVALS_KEPT]

    def _admit(self) -> None:
        self.active += 1
        self.max_concurrency = max(self.max_concurrency, self.active)

    def _schedule_release(self) -> None:
        if self.lag_ms > 0:
            asyncio.get_running_loop().call_later(self.lag_ms / 1000, self._release)
        else:
            self._release()

    def _release(self) -> None:
        self.active -= 1

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
        )

    def _error(
        self, dialect: _Dialect, status: int, message: str, *, retry_after: bool, code: str | None = None
    ) -> web.Response:
        headers: dict[str, str] = {}
        if status == 429:
            self.rate_limited += 1
            if retry_after:
                headers["retry-after"] = str(max(1, math.ceil(self.retry_after)))
                headers["retry-after-ms"] = str(round(self.retry_after * 1000))
        return web.json_response(dialect.error_body(status, message, code), status=status, headers=headers)

    async def _answer(
        self, request: web.Request, dialect: _Dialect, knobs: _Knobs, reply: _Reply
    ) -> web.StreamResponse:
        if knobs.stall_ms:
            await asyncio.sleep(knobs.stall_ms / 1000)
        if knobs.status is not None:
            error = self._error(
                dialect, knobs.status, f"Injected status {knobs.status}",
                retry_after=knobs.retry_after, code=knobs.error_code,
            )
            return await self._send(request, error)
        if reply.stream:
            return await self._stream(request, dialect, knobs, reply)
        if knobs.reset_after is not None:
            _abort(request)
            return web.Response()
        await asyncio.sleep(knobs.delay_ms / 1000)
        return await self._send(request, self._full(dialect, reply, knobs.gzip))

    @staticmethod
    def _full(dialect: _Dialect, reply: _Reply, compress: bool) -> web.Response:
        data = json.dumps(dialect.full_body(reply)).encode()
        if not compress:
            return web.Response(body=data, content_type="application/json")
        return web.Response(
            body=gzip.compress(data), content_type="application/json", headers={"Content-Encoding": "gzip"}
        )

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
        self, request: web.Request, dialect: _Dialect, knobs: _Knobs, reply: _Reply
    ) -> web.StreamResponse:
        encoder = _StreamEncoder.named(knobs.encoding)
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **encoder.headers}
        response = web.StreamResponse(headers=headers)

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``fake-upstream`` flags (dests: port, cap, chunks, delay_ms, lag_ms)."""
    add = parser.add_argument
    add("--port", type=_port, default=DEFAULT_PORT, help="port on 127.0.0.1 (default 9100)")
    add("--cap", type=_positive_int, default=None, help="hard concurrency cap (default: none)")
    add("--chunks", type=_positive_int, default=5, help="stream chunks per answer (default 5)")
    add("--delay-ms", type=_non_negative, default=20.0, help="ms between chunks (default 20)")
    add("--lag-ms", type=_non_negative, default=0.0, help="ms a finished request stays counted (default 0)")


async def _serve_until_signalled(fake: FakeUpstream, port: int) -> None:
    runner, bound = await start_fake_upstream(fake, port=port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    cap = "none" if fake.cap is None else fake.cap
    print(
        f"fake-upstream listening on http://127.0.0.1:{bound} "
        f"(cap={cap}, chunks={fake.chunks}, delay_ms={fake.delay_ms:g}, lag_ms={fake.lag_ms:g})",
        flush=True,
    )
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
) -> None:
    """Serve a fake upstream on 127.0.0.1 until SIGINT or SIGTERM (the ``fake-upstream`` command)."""
    fake = FakeUpstream(cap=cap, chunks=chunks, delay_ms=delay_ms, lag_ms=lag_ms)
    asyncio.run(_serve_until_signalled(fake, port))
