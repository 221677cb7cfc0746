"""The Responses API over WebSocket (Codex's transport): a ``GET /v1/responses``
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
wait as the HTTP 429 states it; ``headers`` only on 429s). Each frame is charged
to the per-minute windows as a POST is (a warm-up: one request, no tokens); one
they refuse gets the 429 frame with OpenAI's window ``error`` (``dialects``) and,
in ``headers``, the windows' ``x-ratelimit-*`` beside the waits; a frame that is no
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

import asyncio
import json
from typing import Any

from aiohttp import WSCloseCode, WSMsgType, hdrs, web

from .admission import Admission, TurnedAway, key_of
from .dialects import (
    Reply,
    ResponsesDialect,
    compact,
    openai_duration,
    retry_after_headers,
    stream_error_message,
)
from .knobs import (
    Cut,
    SocketKnobs,
    abort,
    flag,
    number_header,
    socket_knob_headers,
    socket_tag,
)

__all__ = ["ResponsesSocket"]

_REFUSAL_STATUSES = (200, 599)


def _stream_error_status(kind: str) -> int:
    if "rate_limit" in kind:
        return 429
    return 503 if "overloaded" in kind else 500


class ResponsesSocket:
    """One WebSocket of the Responses API, as Codex opens it.

    Its text frames are answered one after another, in order: a worker task
    answers them while a reader task watches for the client's close, so a
    client that closes (or vanishes) mid-response frees its slot at once. A
    cut-off waits for both to stop, since aiohttp skips the close handshake
    when ``close()`` runs beside a ``receive()``.
    """

    dialect = ResponsesDialect()

    def __init__(self, fake: Admission, request: web.Request, ws: web.WebSocketResponse) -> None:
        self.fake = fake
        self.request = request
        self.ws = ws
        self.headers = {name.lower(): value for name, value in request.headers.items()}
        self.key = key_of(request.headers)

    @classmethod
    async def handshake(cls, fake: Admission, request: web.Request) -> web.StreamResponse:
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
    def _refusal(cls, fake: Admission, request: web.Request) -> web.Response | None:
        """The answer refusing this upgrade, or None to accept it."""
        if not fake.websocket:
            body = cls.dialect.error_body(404, "This server does not serve the Responses API over WebSocket")
            return web.json_response(body, status=404)
        low, high = _REFUSAL_STATUSES
        try:
            status = number_header(request.headers, "x-fake-ws-refuse", int, low, f"a status {low}-{high}", high)
        except ValueError as exc:
            return web.json_response(cls.dialect.error_body(400, str(exc)), status=400)
        key = key_of(request.headers)
        wait = None if flag(request.headers, "x-fake-no-retry-after") else fake.retry_after
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

    async def _work(self, frames: asyncio.Queue[str]) -> Cut | None:
        """Answer the frames until one cuts the socket off; None once the client is gone."""
        try:
            while True:
                cut = await self._frame(await frames.get())
                if cut is not None:
                    return cut
        except ConnectionResetError:
            return None

    async def _frame(self, text: str) -> Cut | None:
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

    async def _respond(self, frame: dict[str, Any], size: int) -> Cut | None:
        """Count, admit and answer one ``response.create``; what to cut the socket with, if anything."""
        fake, key = self.fake, self.key
        body = frame["response"] if isinstance(frame.get("response"), dict) else frame
        frame_knobs = frame.get("x_fake")
        fake._record(self.headers, body, key, socket_tag(self.headers, frame_knobs))
        warmup = body.get("generate") is False
        try:
            knobs = SocketKnobs.parse(socket_knob_headers(self.headers, frame_knobs), fake)
            counted = fake._count(self.dialect, body, key)
            reply = fake._reply(self.dialect, body, size, knobs, counted)
            if not warmup:  # a warm-up reports no usage, whatever the knob says
                reply.usage.check()
        except (TypeError, ValueError) as exc:
            await self._send_error(400, str(exc))
            return None
        window = fake._window(key)
        plan = fake._plan(self.dialect, body, key, reply, counted, warmup=warmup)
        refusal = fake._refusal(key, window, plan)
        if refusal is not None:
            fake._count_rate_limited(key)
            await self._refuse(refusal, reply, fake._headers(self.dialect, window, knobs, plan))
            return None
        fake._admit(key, window, plan)
        try:
            return await self._answer(knobs, reply, warmup)
        finally:
            if knobs.status is None and not warmup:
                fake._settle(self.dialect, plan, reply)
            fake._schedule_release(key)

    async def _refuse(self, refusal: TurnedAway, reply: Reply, headers: dict[str, str]) -> None:
        """A 429 frame: a window's in OpenAI's words with its rate-limit headers, else the cap's."""
        if refusal.window is None:
            message = f"{refusal.message}. Please try again in {openai_duration(refusal.wait)}."
            await self._send_error(429, message, retry_after=refusal.wait)
            return
        error = self.dialect.window_error_body(refusal.window, reply.model)["error"]
        frame = {"type": "error", "status": 429, "error": error,
                 "headers": headers | retry_after_headers(refusal.wait)}
        await self._send(frame)

    async def _answer(self, knobs: SocketKnobs, reply: Reply, warmup: bool) -> Cut | None:
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

    async def _stream(self, knobs: SocketKnobs, reply: Reply) -> Cut | None:
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

    def _stream_error(self, reply: Reply, kind: str, form: str, after: int) -> dict[str, Any]:
        """``response.failed`` (form ``failed``), else a top-level error frame with the status it stands for."""
        if form == "failed":
            return self.dialect.stream_error_event(reply, kind, after=after, form=form)
        error = {"type": kind, "code": kind, "message": stream_error_message(kind)}
        return {"type": "error", "status": _stream_error_status(kind), "error": error}

    async def _injected_status(self, knobs: SocketKnobs) -> None:
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
            frame["headers"] = retry_after_headers(retry_after)
        await self._send(frame)

    async def _send_all(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            await self._send(event)

    async def _send(self, event: dict[str, Any]) -> None:
        await self.ws.send_str(compact(event))

    async def _cut_off(self, cut: Cut) -> None:
        if cut.drop:
            abort(self.request)
            return
        await self.ws.close(code=WSCloseCode.INTERNAL_ERROR, message=b"Injected upstream close")
