"""The WebSocket relay: the Responses API's WebSocket mode (Codex's default transport), a slot per response.

One socket carries a whole agent session: many responses, one ``response.create``
frame each. The handshake takes no slot. Each ``response.create`` takes one, at
every level that applies (the provider, the model cap, the key the socket opened
with), before it is forwarded, and holds it until that response's terminal event
(``response.completed``, ``response.failed``, ``response.incomplete`` or ``error``)
has been written to the client, or either side closes, or ``idle_timeout`` /
``slot_timeout`` fires (then both sockets close with 1011). Frames of one socket
keep their order: the frames behind a queued ``response.create`` wait with it.

A handshake refused for a reason no wait helps (the upstream has no WebSocket
mode, or cannot be reached, or ``websocket: false``) gets 426: clients such as
Codex then use HTTP at once, where any other status makes them retry the upgrade
for seconds. A backoff status (429) is a signal like an HTTP answer's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import WSCloseCode, WSMsgType, web
from multidict import CIMultiDict
from yarl import URL

from ..errors import (
    ProxyError,
    QueueFull,
    QueueTimeout,
    ShuttingDown,
    SpendLimitReached,
    WebSocketUnsupported,
)
from ..limiter import Priority, SlotLease
from ..providers.estimate import Estimate
from ..providers.model_name import frame_model, model_hint
from ..providers.signals import Backoff, classify_response, event_backoff, readable_body
from ..providers.tokens import UsageReader
from . import upstream_errors
from .accounting import Account
from .answers import ALLOWED_ORIGIN, Answer
from .frames import TERMINAL, event_type, is_create, parsed_frame
from .headers import (
    body_turn_started_at,
    forward_request_headers,
    forward_response_headers,
    parse_priority,
)
from .idle import Watch
from .keys import error_response
from .runtime import ProxyState
from .upstreams import expect_upgrade, refused_upgrade_body
from .windows import Costing, EndedResponses, parsed_request

if TYPE_CHECKING:
    from ..config import ProviderSettings
    from ..telemetry.spans import SocketTrace

__all__ = ["relay_websocket", "wants_websocket"]

log = logging.getLogger("slotproxy.websocket")

_HANDSHAKE_HEADERS = frozenset({
    "sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions", "sec-websocket-protocol",
    "sec-websocket-accept",
})
"""Written by the client side of aiohttp for the upstream handshake: the client's own are not passed on."""
_OUTPUT_EVENT = b'{"type":"response.output_'
"""The opening of most of a response's events (its text, items and parts), none of them its end."""
_UNSENDABLE_CLOSE_CODES = frozenset({1005, 1006, 1015})
_CLOSE_WAIT = 5.0
_PAUSE_MARGIN = 0.1
"""A retried upgrade waits this much past its pause, so that a shared backend has seen the pause end too
(its clock is Redis's): the retry's answer then counts as a burst of its own, as an HTTP retry's does."""
_COMPLETED = 200
_CLIENT_GONE = 499
_UPSTREAM_FAILED = 502
_TIMED_OUT = 504

def wants_websocket(headers: Mapping[str, str]) -> bool:
    """A WebSocket upgrade request (``Upgrade: websocket``; the method is checked by the caller)."""
    upgrade = headers.get("Upgrade")
    return upgrade is not None and upgrade.strip().lower() == "websocket"


async def relay_websocket(request: web.Request, state: ProxyState, provider: str, settings: ProviderSettings,
                          url: URL, consumed: frozenset[str]) -> web.StreamResponse:
    """Relay one WebSocket upgrade on a provider route; an answer that is not a socket is counted here."""
    relay = SocketRelay(request, state, provider, settings, url, consumed)
    try:
        response = await relay.open()
    except ProxyError as exc:
        response = error_response(exc)
    if not isinstance(response, web.WebSocketResponse):
        if relay.trace is not None:
            relay.trace.end(response.status)
        state.metrics.count_request(provider, str(response.status))
        refused = Account(provider, "websocket")
        refused.priority, refused.status = relay.priority, response.status
        state.account(refused)
        return response
    return await relay.run(response)


@dataclass(slots=True)
class _Response:
    """One response in flight on the socket: its slot and its ledger row."""

    lease: SlotLease
    account: Account
    estimate: Estimate | None = None
    """With token windows: what it was estimated to cost."""
    group: str = ""


class SocketRelay:
    """One client socket and its upstream socket."""

    __slots__ = ("client", "closing_after_responses", "consumed", "ended", "in_flight", "key", "priority",
                 "prompt_from_handshake", "provider", "request", "settings", "state", "trace", "upstream",
                 "upstream_pump", "url", "watch", "windowing")

    def __init__(self, request: web.Request, state: ProxyState, provider: str, settings: ProviderSettings,
                 url: URL, consumed: frozenset[str]) -> None:
        self.request = request
        self.state = state
        self.provider = provider
        self.settings = settings
        self.url = url.with_scheme("wss" if url.scheme == "https" else "ws")
        self.consumed = consumed
        now = time.time()
        self.priority, invalid = parse_priority(request.headers, state.priority_headers, now,
                                                transport="websocket")
        for name in invalid:
            state.metrics.invalid_headers.labels(name).inc()
        self.prompt_from_handshake = self._handshake_names_prompt()
        self.key: str | None = None
        self.upstream: aiohttp.ClientWebSocketResponse[bool] | None = None
        self.client: web.WebSocketResponse | None = None
        self.in_flight: list[_Response] = []
        """Responses forwarded and not yet ended, in order (one at a time, as clients send them)."""
        self.watch: Watch | None = None
        self.upstream_pump: asyncio.Task[None] | None = None
        self.closing_after_responses = False
        self.windowing = state.windowing(provider)
        self.ended = EndedResponses()
        """With token windows: the input and output tokens each recent response reported, by its id."""
        self.trace: SocketTrace | None = None if state.telemetry is None else \
            state.telemetry.socket(request.headers, provider, settings, request.path)

    def _handshake_names_prompt(self) -> bool:
        """Whether the handshake itself said when the prompt began (else each response is aged from its own
        turn metadata, or its arrival: a socket lives for a whole session)."""
        headers = self.request.headers
        if self.state.priority_headers.prompt_started_at in headers:
            return True
        metadata = headers.get("x-codex-turn-metadata")
        return metadata is not None and b"turn_started_at_unix_ms" in metadata.encode("utf-8", "replace")

    # ----- the handshake ---------------------------------------------------------------

    async def open(self) -> web.StreamResponse:
        """Open the upstream socket, then complete the client's handshake; or the answer that refuses it."""
        if not self.settings.websocket:
            raise WebSocketUnsupported(f"provider '{self.provider}' does not relay WebSockets "
                                       f"(providers.{self.provider}.websocket is false): use HTTP")
        if self.state.shutting_down:
            raise ShuttingDown("slotproxy is shutting down; retry shortly", retry_after=1.0)
        self.key = await self.state.backend.socket_key(self.provider, self.priority.conversation)
        retries_left = self.settings.retry_on_429
        while True:
            refused = await self._connect_upstream()
            if refused is None:
                return await self._accept_client()
            if not isinstance(refused, _Retry) or retries_left <= 0:
                return refused.answer if isinstance(refused, _Retry) else refused
            retries_left -= 1
            log.debug("provider=%s retrying a WebSocket upgrade after a %s, in %.1fs (the client has seen "
                      "nothing yet)", self.provider, refused.backoff.cause, refused.pause)
            await asyncio.sleep(refused.pause + _PAUSE_MARGIN)

    async def _connect_upstream(self) -> web.StreamResponse | _Retry | None:
        headers = self._upstream_headers()
        protocols = _protocols(self.request.headers)
        compress = 15 if "permessage-deflate" in self.request.headers.get("Sec-WebSocket-Extensions", "") else 0
        session = self.state.upstreams.websocket_session_for(self.settings)
        expect_upgrade()
        sent_at = time.time()
        try:
            self.upstream = await session.ws_connect(
                self.url, headers=headers, protocols=protocols, compress=compress, autoping=True,
                max_msg_size=0, decode_text=False, timeout=aiohttp.ClientWSTimeout(ws_close=_CLOSE_WAIT),
                ssl=self.settings.tls_verify)
        except aiohttp.WSServerHandshakeError as exc:
            return self._refused(exc, refused_upgrade_body(), sent_at)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            host, port = self.url.host, self.url.port
            what = upstream_errors.connect_timed_out(host, port, self.settings.connect_timeout) \
                if isinstance(exc, TimeoutError) else upstream_errors.before_answer(exc, host, port)
            log.warning("provider=%s %s; the WebSocket upgrade was answered 426 (the client falls back to HTTP)",
                        self.provider, what)
            raise WebSocketUnsupported(upstream_errors.for_provider(
                self.provider, f"{what}; the upstream could not be reached for a WebSocket upgrade: use HTTP")) from exc
        return None

    def _upstream_headers(self) -> CIMultiDict[str]:
        strip = self.state.strip_headers | self.consumed | _HANDSHAKE_HEADERS
        headers = forward_request_headers(self.request.headers, strip=strip,
                                          auth=self.state.upstreams.auth(self.settings, self.key))
        if self.trace is not None:
            headers["traceparent"] = self.trace.traceparent
        return headers

    def _refused(self, exc: aiohttp.WSServerHandshakeError, body: bytes,
                 sent_at: float) -> web.StreamResponse | _Retry:
        """An upstream that answered the upgrade with something else than a WebSocket."""
        status = exc.status
        headers: Mapping[str, str] = exc.headers or CIMultiDict()
        if status not in self.settings.backoff_statuses:
            what = f"upstream {upstream_errors.place(self.url.host, self.url.port)} refused the WebSocket upgrade " \
                f"with {status}"
            log.info("provider=%s %s; answered 426 (the client falls back to HTTP)", self.provider, what)
            raise WebSocketUnsupported(upstream_errors.for_provider(self.provider, f"{what}: use HTTP"))
        readable = readable_body(body, headers.get("Content-Encoding"))
        backoff = classify_response(status, headers, readable, self.settings.backoff_statuses, time.time())
        answer = Answer(status=status, body=body,
                        headers=forward_response_headers(headers, keep_cors=self.request.get(ALLOWED_ORIGIN)
                                                         is not None))
        if backoff is None:
            return answer
        pause = self._report(backoff, sent_at)
        return _Retry(answer, backoff, pause)

    async def _accept_client(self) -> web.StreamResponse:
        upstream = self.upstream
        assert upstream is not None
        client = web.WebSocketResponse(
            protocols=(upstream.protocol,) if upstream.protocol else (), autoping=True,
            compress="permessage-deflate" in self.request.headers.get("Sec-WebSocket-Extensions", ""),
            max_msg_size=self.state.config.server.max_body, decode_text=False, timeout=_CLOSE_WAIT)
        if not client.can_prepare(self.request).ok:
            await upstream.close()
            raise WebSocketUnsupported("not a valid WebSocket handshake: use HTTP")
        try:
            await client.prepare(self.request)
        except BaseException:
            await upstream.close()
            raise
        self.client = client
        return client

    # ----- the open socket -------------------------------------------------------------

    async def run(self, client: web.WebSocketResponse) -> web.WebSocketResponse:
        """Relay frames both ways until either side closes; every slot taken is released exactly once.

        Frames from the client are relayed in the handler's own task, those from upstream in a task of their
        own (the idle watch cancels that one); whichever side closes first closes the other, which ends the
        other loop."""
        upstream = self.upstream
        assert upstream is not None
        self.state.open_sockets.opened(self)
        pump = self.upstream_pump = asyncio.get_running_loop().create_task(self._from_upstream(upstream, client))
        try:
            # Cancellation point: the client's connection is lost (no close frame: Codex leaves that way), and
            # the handler is cancelled; the finally below releases what the socket holds.
            await self._from_client(client, upstream)
        except (ConnectionError, aiohttp.ClientError) as exc:
            log.debug("provider=%s WebSocket relay ended: %s", self.provider, _reason(exc))
        finally:
            pump.cancel()
            self._end_all(_CLIENT_GONE if not upstream.closed else _UPSTREAM_FAILED,
                          "client_gone" if not upstream.closed else "upstream_error")
            self.state.open_sockets.closed(self)
            if self.trace is not None:
                self.trace.end(101)
            await _quietly(upstream.close(code=_sendable(client.close_code, WSCloseCode.GOING_AWAY)))
            await _quietly(client.close(code=_sendable(upstream.close_code, WSCloseCode.GOING_AWAY)))
            await asyncio.gather(pump, return_exceptions=True)
        return client

    async def _from_client(self, client: web.WebSocketResponse, upstream: aiohttp.ClientWebSocketResponse[bool]) \
            -> None:
        while True:
            message = await client.receive()
            kind = message.type
            if kind is WSMsgType.TEXT:
                data: bytes = message.data
                if is_create(data) and not await self._take_slot(client, data):
                    continue
                await upstream.send_frame(data, WSMsgType.TEXT)
            elif kind is WSMsgType.BINARY:
                await upstream.send_frame(message.data, WSMsgType.BINARY)
            else:  # CLOSE (answered by aiohttp), CLOSING (upstream closed it), CLOSED, ERROR: the client is gone
                if upstream.closed:
                    return
                self._end_all(_CLIENT_GONE, "client_gone")
                await _quietly(upstream.close(code=_sendable(client.close_code, WSCloseCode.GOING_AWAY),
                                              message=(message.extra or "").encode()[:123]
                                              if kind is WSMsgType.CLOSE else b""))
                return

    async def _take_slot(self, client: web.WebSocketResponse, frame: bytes) -> bool:
        """Wait for this response's slot; False (and an ``error`` frame to the client) when it gets none."""
        account = Account(self.provider, "websocket")
        account.priority = priority = self._frame_priority(frame)
        windowing = self.windowing
        costing: Costing | None = None
        if windowing is None:
            account.model = frame_model(frame) if self.settings.models else model_hint("", frame)
            group = ""
        else:  # costed again while it waits if its group's estimates move (``providers.recost``)
            account.model, request = parsed_request("", frame)
            group = windowing.group(account.model)
        if self.state.shutting_down or self.closing_after_responses:
            await self._refuse(client, ShuttingDown("slotproxy is shutting down; retry shortly", retry_after=1.0),
                               account)
            return False
        refusal = self.state.spend_refusal(priority.workspace, self.settings)
        if refusal is not None:
            await self._refuse(client, refusal, account)
            return False
        if windowing is not None:
            costing = windowing.costing(self.state.backend, group, frame, request, key=self.key,
                                        continuation=self.ended.continued(request))
        self.state.request_started()
        asked_at = time.monotonic()
        try:
            lease = await self.state.backend.acquire(self.provider, priority, model=account.model, key=self.key,
                                                     cost=None if costing is None else costing.cost,
                                                     group=group or None, recost=costing)
        except (QueueFull, QueueTimeout, ShuttingDown, SpendLimitReached) as exc:
            self.state.request_finished()
            account.queue_ms = round((time.monotonic() - asked_at) * 1000)
            if self.trace is not None:
                self.trace.response().waited(time.monotonic() - asked_at, priority, refused=exc.status)
            await self._refuse(client, exc, account)
            return False
        except BaseException:
            self.state.request_finished()
            raise
        finally:  # asks no more, granted or not (``taken`` below says so again)
            if costing is not None:
                costing.left()
        estimate = None if costing is None else costing.taken(lease)
        self.state.observe_grant(self.provider, lease)
        account.queue_ms, account.key = round(lease.queue_wait * 1000), lease.key
        refusal = self.state.spend_refusal(priority.workspace, self.settings)
        if refusal is not None:  # its workspace reached its cap while it waited
            lease.release()
            self.state.request_finished()
            await self._refuse(client, refusal, account)
            return False
        if self.trace is not None:
            account.trace = trace = self.trace.response()
            trace.waited(lease.queue_wait, priority, lease)
            trace.sending(account.model, lease.key)
        self._start(_Response(lease, account, estimate, group))
        return True

    def _frame_priority(self, frame: bytes) -> Priority:
        """The handshake's workspace, star and conversation; the prompt start of this response's own turn."""
        if self.prompt_from_handshake:
            return self.priority
        now = time.time()
        started = body_turn_started_at(frame, now) or now
        started = max(started, now - self.state.priority_headers.max_prompt_age)
        return self.priority._replace(prompt_started_at=started)

    def _start(self, response: _Response) -> None:
        """The response is in flight: its slot, the idle watch over upstream's data frames, the watchdog."""
        self.in_flight.append(response)
        lease = response.lease
        if self.watch is None and self.upstream_pump is not None:
            self.watch = self.state.idle_watch.watch(self.settings.idle_timeout, self.upstream_pump)
        lease.on_reclaim = self._reclaimed
        if lease.reclaimed:
            self._reclaimed()

    def _reclaimed(self) -> None:
        if self.watch is not None:
            self.watch.fire()

    async def _refuse(self, client: web.WebSocketResponse, error: ProxyError, account: Account) -> None:
        """A response that got no slot: an ``error`` event with a status (clients retry on it)."""
        self.state.metrics.count_request(self.provider, str(error.status))
        account.status = error.status
        self.state.account(account)
        frame: dict[str, Any] = {"type": "error", "status": error.status, **error.body()}
        if error.retry_after is not None:
            frame["retry_after_seconds"] = max(1, int(error.retry_after + 0.999))
        await client.send_frame(json.dumps(frame).encode(), WSMsgType.TEXT)

    async def _from_upstream(self, upstream: aiohttp.ClientWebSocketResponse[bool],
                             client: web.WebSocketResponse) -> None:
        receive, send, text, binary = upstream.receive, client.send_frame, WSMsgType.TEXT, WSMsgType.BINARY
        try:
            while True:
                message = await receive()
                kind = message.type
                if kind is text:
                    data: bytes = message.data
                    watch = self.watch
                    if watch is not None:
                        watch.progress()
                    await send(data, text)
                    if self.in_flight:
                        self._note_event(data)
                elif kind is binary:
                    watch = self.watch
                    if watch is not None:
                        watch.progress()
                    await send(message.data, binary)
                else:
                    self._upstream_closed(message.extra or (f"close code {message.data}" if kind is WSMsgType.CLOSE
                                                            else "connection lost"))
                    await _quietly(client.close(code=_sendable(upstream.close_code, WSCloseCode.INTERNAL_ERROR),
                                                message=(message.extra or "").encode()[:123]
                                                if kind is WSMsgType.CLOSE else b""))
                    return
        except asyncio.CancelledError:
            if self.watch is None or not self.watch.absorbed():
                raise
            await self._timed_out(upstream, client)
        except (ConnectionError, aiohttp.ClientError) as exc:  # the client went while a frame was on its way
            log.debug("provider=%s WebSocket relay ended: %s", self.provider, _reason(exc))

    def _upstream_closed(self, why: str) -> None:
        if self.in_flight:
            log.warning("provider=%s upstream closed the WebSocket (%s) with %d response(s) in flight",
                        self.provider, why, len(self.in_flight))
        self._end_all(_UPSTREAM_FAILED, "upstream_error")

    async def _timed_out(self, upstream: aiohttp.ClientWebSocketResponse[bool],
                         client: web.WebSocketResponse) -> None:
        leases = [response.lease for response in self.in_flight]
        if any(lease.lease_lost for lease in leases):
            what, why = "slot lease lost", "a response's slot was given up (its lease could not be renewed in redis)"
        else:
            what = "slot_timeout" if any(lease.reclaimed for lease in leases) else "idle_timeout"
            why = f"{what} fired on a WebSocket response"
        log.warning("provider=%s %s; both sockets closed (1011)", self.provider, why)
        self._end_all(_TIMED_OUT, "timeout")
        await _quietly(upstream.close(code=WSCloseCode.INTERNAL_ERROR, message=what.encode()))
        await _quietly(client.close(code=WSCloseCode.INTERNAL_ERROR, message=what.encode()))

    def _note_event(self, data: bytes) -> None:
        """Read an event for what the relay needs: the first byte, the end of the response in flight, its usage
        and rate-limit signals. Most events are a response's output (``response.output_*``): those are
        recognised by their opening and read no further."""
        account = self.in_flight[0].account
        if data.startswith(_OUTPUT_EVENT) and account.ttfb_ms is not None:
            return
        if account.ttfb_ms is None:
            account.first_byte()
        if data.startswith(_OUTPUT_EVENT):
            return
        kind = event_type(data)
        if kind is None or kind not in TERMINAL:
            return
        usage = account.usage = UsageReader()
        status = _COMPLETED
        if kind == b"response.completed" or kind == b"response.incomplete":
            usage.read(data)
            if self.windowing is not None:
                self.ended.remember(data, usage)
        else:
            document = parsed_frame(data)
            if document is not None:
                response = document.get("response")
                usage.add(response.get("usage") if isinstance(response, dict) else None)
                backoff = event_backoff(document)
                if backoff is not None and not self._window_hit(document, data, backoff):
                    self._report(backoff, self.in_flight[0].lease.granted_at)
                stated = document.get("status")
                if kind == b"error" and isinstance(stated, int) and 400 <= stated <= 599:
                    status = stated
        self._end_first(status)

    def _window_hit(self, document: dict[str, Any], data: bytes, backoff: Backoff) -> bool:
        """An error event that names a window: the window is emptied until the stated wait, with no backoff."""
        windowing = self.windowing
        if windowing is None:
            return False
        headers = document.get("headers")
        first = self.in_flight[0]
        return windowing.hit(self.state.backend, self.key, first.group, backoff.status,
                             headers if isinstance(headers, dict) else {}, data, backoff.wait,
                             first.lease.cost) is not None

    def _report(self, backoff: Backoff, sent_at: float) -> float:
        """Report a backoff to what was sent at ``sent_at`` (the same-burst rule); returns the pause it calls
        for (what a retried handshake waits)."""
        self.state.metrics.backoffs.labels(self.provider, backoff.cause).inc()
        self.state.backend.report_backoff(
            self.provider, backoff.cause, backoff.wait, sent_at,
            reduce=backoff.status in self.settings.reduce_statuses, key=self.key)
        if backoff.wait is not None:
            return backoff.wait
        reduces = backoff.status in self.settings.reduce_statuses
        return self.settings.default_pause if reduces else self.settings.overload_pause

    # ----- ending responses ----------------------------------------------------------------

    def _end_first(self, status: int) -> None:
        self._end(self.in_flight.pop(0), status, "ok")
        if not self.in_flight:
            self._unwatch()
            if self.closing_after_responses and self.client is not None:
                asyncio.get_running_loop().create_task(_quietly(self.client.close(code=WSCloseCode.GOING_AWAY)))

    def _end_all(self, status: int, outcome: str) -> None:
        in_flight, self.in_flight = self.in_flight, []
        for response in in_flight:
            self._end(response, status, outcome)
        self._unwatch()

    def _end(self, response: _Response, status: int, outcome: str) -> None:
        lease = response.lease
        lease.on_reclaim = None
        if response.estimate is not None and self.windowing is not None:
            usage = response.account.usage
            self.windowing.settle(self.state.backend, lease, response.group, response.estimate,
                                  None if usage is None else usage.totals())
        lease.release()
        self.state.request_finished()
        self.state.metrics.count_request(self.provider, str(status))
        account = response.account
        account.status, account.outcome = status, outcome
        self.state.account(account)

    def _unwatch(self) -> None:
        if self.watch is not None:
            self.watch.close()
            self.watch = None

    def shutdown(self) -> None:
        """Graceful shutdown: close now when no response is in flight, else after the last one ends."""
        self.closing_after_responses = True
        if not self.in_flight and self.client is not None:
            asyncio.get_running_loop().create_task(_quietly(self.client.close(code=WSCloseCode.GOING_AWAY)))


@dataclass(frozen=True, slots=True)
class _Retry:
    """A backoff answer to the upgrade: retried after ``pause`` while retries are left, else relayed."""

    answer: web.StreamResponse
    backoff: Backoff
    pause: float


def _protocols(headers: Mapping[str, str]) -> tuple[str, ...]:
    raw = headers.get("Sec-WebSocket-Protocol", "")
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def _sendable(code: int | None, fallback: int) -> int:
    """A close code that may go in a close frame (1005, 1006 and 1015 only describe a close)."""
    if code is None or code in _UNSENDABLE_CLOSE_CODES or not (1000 <= code <= 4999):
        return fallback
    return code


def _reason(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "connect_timeout"
    return str(exc) or exc.__class__.__name__


async def _quietly(closing: Any) -> None:
    """A close on the way out: the other side may be gone already."""
    try:
        await closing
    except (TimeoutError, ConnectionError, RuntimeError, aiohttp.ClientError):
        return
