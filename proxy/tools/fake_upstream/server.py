"""The fake's HTTP side: its routes (the four APIs' POSTs with and without ``/v1``, models, usage,
stats), each answer sent whole or streamed (optionally compressed) with the knobs' faults, and a
JSON 404 that names the routes served.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ...providers.decoders import zstd_module
from .admission import Admission, key_of
from .dialects import (
    MODEL,
    ChatDialect,
    CompletionDialect,
    Dialect,
    MessagesDialect,
    Reply,
    ResponsesDialect,
)
from .knobs import Knobs, abort
from .websocket import ResponsesSocket

__all__ = ["FakeUpstream", "not_found_message", "start_fake_upstream"]

API_PREFIXES = ("/v1", "")
"""Every API route is served under each: ``/v1/messages`` and ``/messages`` alike."""
SERVED_ROUTES = "/v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, /v1/models"


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
        return web.json_response(ChatDialect().error_body(404, message, "unknown_url"), status=404)


async def _read_json(request: web.Request) -> tuple[dict[str, Any], int]:
    raw = await request.read()
    try:
        body = json.loads(raw) if raw else {}
    except ValueError:
        body = {}
    return (body if isinstance(body, dict) else {}), len(raw)


class FakeUpstream(Admission):
    """A capped fake provider and its statistics (the options are ``Admission``'s), served by ``app()``:
    the four APIs over HTTP, and the Responses API over WebSocket (``websocket``)."""

    def app(self) -> web.Application:
        """The aiohttp application serving this fake."""
        app = web.Application(middlewares=[_json_not_found])
        # Each API path with and without its /v1: an upstream of http://127.0.0.1:P/v1 (OpenAI's shape) and one
        # of http://127.0.0.1:P (Anthropic's, whose clients add /v1 themselves) both reach it.
        for prefix in API_PREFIXES:
            app.router.add_post(f"{prefix}/chat/completions", self._route(ChatDialect()))
            app.router.add_post(f"{prefix}/completions", self._route(CompletionDialect()))
            app.router.add_post(f"{prefix}/messages", self._route(MessagesDialect()))
            app.router.add_post(f"{prefix}/responses", self._route(ResponsesDialect()))
            app.router.add_get(f"{prefix}/responses", self._responses_socket, allow_head=False)
            app.router.add_get(f"{prefix}/models", self._models)
            app.router.add_get(f"{prefix}/usage", self._usage)
        app.router.add_get("/stats", self._stats)
        app.router.add_post("/stats/reset", self._reset)
        return app

    def _route(self, dialect: Dialect) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await self._handle(request, dialect)

        return handler

    async def _handle(self, request: web.Request, dialect: Dialect) -> web.StreamResponse:
        body, size = await _read_json(request)
        key = key_of(request.headers)
        self._record(request.headers, body, key, request.headers.get("x-fake-tag"))
        try:
            knobs = Knobs.parse(request.headers, self)
            counted = self._count(dialect, body, key)
            reply = self._reply(dialect, body, size, knobs, counted)
            reply.usage.check()
        except ValueError as exc:
            return web.json_response(dialect.error_body(400, str(exc)), status=400)
        window = self._window(key)
        plan = self._plan(dialect, body, key, reply, counted)
        refusal = self._refusal(key, window, plan)
        if refusal is not None:
            error = None if refusal.window is None else dialect.window_error_body(refusal.window, reply.model)
            return self._error(dialect, 429, refusal.message, key=key, retry_after=refusal.wait,
                               headers=self._headers(dialect, window, knobs, plan), body=error)
        self._admit(key, window, plan)
        headers = self._headers(dialect, window, knobs, plan)
        try:
            return await self._answer(request, dialect, knobs, reply, key, headers)
        finally:
            if knobs.status is None:
                self._settle(dialect, plan, reply)
            self._schedule_release(key)

    async def _answer(
        self, request: web.Request, dialect: Dialect, knobs: Knobs, reply: Reply, key: str,
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
            abort(request)
            return web.Response()
        await asyncio.sleep(knobs.delay_ms / 1000)
        return await self._send(request, self._full(dialect, reply, knobs.gzip, headers))

    @staticmethod
    def _full(dialect: Dialect, reply: Reply, compress: bool, headers: Mapping[str, str]) -> web.Response:
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
        self, request: web.Request, dialect: Dialect, knobs: Knobs, reply: Reply, headers: Mapping[str, str]
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
        request: web.Request, write: Callable[[bytes], Awaitable[None]], dialect: Dialect, knobs: Knobs,
        reply: Reply,
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
            abort(request)
            return False
        for event in dialect.closing(reply):
            await write(event)
        return True

    async def _responses_socket(self, request: web.Request) -> web.StreamResponse:
        return await ResponsesSocket.handshake(self, request)

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
