"""Client connections: how many, how slow, and what a request that cannot be parsed gets.

aiohttp's server keeps a connection that sends nothing (or one header byte a
second) for its keep-alive timeout, has no deadline for a client that stops
reading, accepts connections until the process runs out of file descriptors,
and answers an unparsable request with a text that quotes the request's bytes.
A proxy that holds provider keys and shared slots needs all four bounded:

- ``header_timeout``: the request line and headers must arrive within it;
- ``write_timeout``: a client that accepts no bytes for this long while the
  proxy has some to send is cut off (its handler is cancelled, so a slot it
  holds is released at once);
- a connection cap (``max_connections``, lowered to what the open-files limit
  allows): at the cap the oldest idle connection is closed to make room, as
  nginx reuses its keep-alive connections; when none is idle the new one gets
  503 and is closed, and the connections already served carry on;
- parser errors: 400 in the OpenAI error shape, no request bytes, no banner.

Each refusal is logged at most once a second, with a count.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import resource
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from ..errors import BadRequest, ProxyError, TooManyConnections, UpstreamTimeout
from ..logs import ThrottledLog
from .answers import Answer

__all__ = [
    "ConnectionGuard",
    "ConnectionSettings",
    "GuardedRunner",
    "install_accept_error_log",
    "raise_open_files_limit",
]

log = logging.getLogger("slotproxy.connections")

KEEPALIVE_TIMEOUT = 75.0
"""How long an idle keep-alive connection is kept between requests (nginx's default)."""

_FDS_RESERVED = 64
"""File descriptors kept back for listeners, Redis, the state file and the logs."""

_OUT_OF_FDS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def _raw_error(status: int, reason: str, error: ProxyError) -> bytes:
    body = json.dumps(error.body()).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Retry-After: 1\r\nConnection: close\r\n\r\n")
    return head.encode() + body


_REFUSED = _raw_error(503, "Service Unavailable", TooManyConnections(
    "slotproxy has reached server.max_connections and every connection is busy; retry shortly"))


def raise_open_files_limit() -> tuple[int, int]:
    """Raise the soft open-files limit to the hard limit; returns (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft, soft
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def connection_cap(max_connections: int, open_files: int) -> int:
    """``server.max_connections`` as written, lowered to what the open-files limit leaves room for (each
    client connection may need an upstream one too), that lowering never below 16."""
    return min(max_connections, max(16, (open_files - _FDS_RESERVED) // 2))


@dataclass(slots=True)
class ConnectionSettings:
    header_timeout: float = 10.0
    write_timeout: float = 60.0
    max_connections: int = 4096


class ConnectionGuard:
    """The open client connections of one server, with the settings that bound them (live-reloadable)."""

    def __init__(self, settings: ConnectionSettings | None = None) -> None:
        self.settings = settings or ConnectionSettings()
        self._open: dict[GuardedRequestHandler, None] = {}
        self._warned: tuple[int, int] | None = None
        self.refused = ThrottledLog(log, logging.WARNING, "refused a client connection: %d open, every one busy "
                                    "(%s)")
        self.evicted = ThrottledLog(log, logging.INFO, "closed an idle client connection to make room: %d open")
        self.headers_late = ThrottledLog(log, logging.INFO, "closed a client connection that sent no complete "
                                         "request headers within server.header_timeout (%gs)")
        self.writes_stalled = ThrottledLog(log, logging.WARNING, "cut off a client that accepted no bytes for "
                                           "server.write_timeout (%gs)")
        self.malformed = ThrottledLog(log, logging.INFO, "rejected a bad request: not valid HTTP (%s)")
        self.configure(self.settings, quiet=settings is None)

    def configure(self, settings: ConnectionSettings, *, quiet: bool = False) -> None:
        """Apply settings. A cap lowered by the open-files limit is warned about once per
        (max_connections, open files) pair, not again on each reload."""
        self.settings = settings
        open_files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.cap = connection_cap(settings.max_connections, open_files)
        limits = (settings.max_connections, open_files)
        if self.cap < settings.max_connections and not quiet and limits != self._warned:
            self._warned = limits
            log.warning("server.max_connections is %d, but the open files limit (%d) leaves room for %d client "
                        "connections: raise it (ulimit -n, LimitNOFILE=) to serve more",
                        settings.max_connections, open_files, self.cap)

    def cap_reason(self) -> str:
        """Where the cap comes from, in the words of the refusal's log line."""
        written = self.settings.max_connections
        if self.cap < written:
            return f"server.max_connections is {written}, lowered to {self.cap} by the open files limit"
        return f"server.max_connections is {written}"

    @property
    def open_count(self) -> int:
        return len(self._open)

    def admit(self, handler: GuardedRequestHandler) -> bool:
        """Take a new connection in, closing the oldest idle one at the cap; False when all are busy."""
        if len(self._open) >= self.cap:
            victim = next((h for h in self._open if h.idle), None)
            if victim is None:
                self.refused.event(len(self._open), self.cap_reason())
                return False
            victim.evict()
            self._open[handler] = None
            self.evicted.event(len(self._open))
            return True
        self._open[handler] = None
        return True

    def forget(self, handler: GuardedRequestHandler) -> None:
        self._open.pop(handler, None)


class GuardedRequestHandler(RequestHandler):
    """aiohttp's connection protocol with the header and write deadlines and the connection cap."""

    def __init__(self, manager: web.Server, *, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._header_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self.write_timed_out = False

    @property
    def idle(self) -> bool:
        """No request being handled or waiting to be: closing it loses nobody's work."""
        return not self._request_in_progress and not self._messages

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if not self._guard.admit(self):
            # Not an isinstance check: uvloop's transports write and close like asyncio's but derive from none
            # of its classes (aiohttp casts the same way).
            refused = cast(asyncio.WriteTransport, transport)
            refused.write(_REFUSED)
            self.force_close()
            refused.close()
            return
        self._header_timer = self._loop.call_later(self._guard.settings.header_timeout, self._headers_late)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._guard.forget(self)
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        parsed = self._request_count
        super().data_received(data)
        if self._request_count != parsed or self._request_in_progress:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
        elif data and self._header_timer is None and not self._force_close:
            # The first bytes of a keep-alive connection's next request: its headers are due in time too.
            self._header_timer = self._loop.call_later(self._guard.settings.header_timeout, self._headers_late)

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.idle:
            return
        self._guard.headers_late.event(self._guard.settings.header_timeout)
        self.evict()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._write_timer = self._loop.call_later(self._guard.settings.write_timeout, self._write_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_stalled(self) -> None:
        """Abort, not close: close would wait for the buffer to drain, and this client drains nothing.
        Losing the connection cancels the handler, whose ``finally`` releases the slot."""
        self._write_timer = None
        self.write_timed_out = True
        self._guard.writes_stalled.event(self._guard.settings.write_timeout)
        if self.transport is not None:
            self.transport.abort()

    def evict(self) -> None:
        self._guard.forget(self)
        self.force_close()
        if self.transport is not None:
            self.transport.close()

    def _cancel_timers(self) -> None:
        for timer in (self._header_timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._write_timer = None

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """aiohttp's own error answers, in the OpenAI shape, naming neither the request's bytes nor aiohttp."""
        error: ProxyError
        if status >= 500:
            if status == 504:
                error = UpstreamTimeout("the request timed out inside slotproxy")
            else:
                self.log_exception("unhandled error while handling a request", exc_info=exc)
                error = ProxyError("internal error in slotproxy; its log has the details")
        else:
            self._guard.malformed.event(type(exc).__name__ if exc is not None else "bad request")
            error = BadRequest("the request is not valid HTTP/1.1 and was not read further")
        if request.writer.output_size > 0:
            raise ConnectionError("a response was already under way; the connection is closed instead")
        response = Answer(status=status, body=json.dumps(error.body()).encode(), content_type="application/json")
        response.force_close()
        return response


class _GuardedServer(web.Server):
    def __init__(self, *args: Any, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard

    def __call__(self) -> GuardedRequestHandler:
        return GuardedRequestHandler(self, loop=self._loop, guard=self.guard, **self._kwargs)


Handler = Callable[[BaseRequest], Awaitable[web.StreamResponse]]


class GuardedRunner(web.AppRunner):
    """An AppRunner whose connections are ``GuardedRequestHandler``s under one ``ConnectionGuard``;
    ``wrap`` puts a handler around the application's (every request passes through it, routed or not)."""

    def __init__(self, app: web.Application, guard: ConnectionGuard,
                 wrap: Callable[[Handler], Handler] | None = None, **kwargs: Any) -> None:
        super().__init__(app, keepalive_timeout=KEEPALIVE_TIMEOUT, **kwargs)
        self.guard = guard
        self._wrap = wrap

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()
        handler = plain.request_handler
        return _GuardedServer(
            self._wrap(handler) if self._wrap is not None else handler,
            request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation,
            loop=plain._loop,
            guard=self.guard,
            **plain._kwargs,
        )


def install_accept_error_log(loop: asyncio.AbstractEventLoop) -> None:
    """Log failed accepts (out of file descriptors) once a second with a count, not once each with a traceback.

    The event loop reports each failed ``accept()`` to its exception handler; at
    the file limit that is thousands a second. It keeps retrying by itself, and
    the connections already open are served meanwhile.
    """
    previous = loop.get_exception_handler()
    throttled = ThrottledLog(log, logging.WARNING, "could not accept a client connection: %s (the open files "
                             "limit is %d; raise it with ulimit -n or LimitNOFILE=)")

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _OUT_OF_FDS and "accept" in str(context.get("message", "")):
            throttled.event(exc.strerror or type(exc).__name__, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handle)
