"""The upstream side: pooled client sessions, per-provider timeouts and the provider key to send."""

from __future__ import annotations

import contextvars
import os
from collections.abc import Iterable, Mapping
from typing import Any

import aiohttp
from multidict import CIMultiDict

from ..config import ProviderSettings

__all__ = ["Upstreams", "expect_upgrade", "refused_upgrade_body"]

_SKIP_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
_SKIPPED: CIMultiDict[None] = CIMultiDict((name, None) for name in sorted(_SKIP_AUTO_HEADERS))


_MAX_REFUSAL_BODY = 1 << 20
_refusal_body: contextvars.ContextVar[bytes] = contextvars.ContextVar("slotproxy_refusal_body", default=b"")


def expect_upgrade() -> None:
    """Forget any earlier refusal's body before a WebSocket handshake (in the handshake's task)."""
    _refusal_body.set(b"")


def refused_upgrade_body() -> bytes:
    """The body of the upgrade just refused, in the task that sent it (at most 1 MiB)."""
    return _refusal_body.get()


def _relay_session(settings: ProviderSettings, **options: Any) -> aiohttp.ClientSession:
    """A client session as the relay needs one: no connection limit (the slots are the limit), bodies passed
    on compressed as they came, no cookies, no headers of aiohttp's own, no proxy from the environment."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, ssl=settings.tls_verify, ttl_dns_cache=300),
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=_SKIP_AUTO_HEADERS,
        trust_env=False,
        **options,
    )


async def _keep_refusal_body(_session: aiohttp.ClientSession, _context: object,
                             params: aiohttp.TraceRequestEndParams) -> None:
    """aiohttp closes a refused upgrade unread; its body says why (a 429's wait), so it is read here, as the
    answer arrives, in the handshake's own task, where ``refused_upgrade_body`` finds it."""
    response = params.response
    if response.status == 101:
        return
    chunks: list[bytes] = []
    size = 0
    while size < _MAX_REFUSAL_BODY and not response.content.at_eof():
        chunk = await response.content.read(_MAX_REFUSAL_BODY - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    _refusal_body.set(b"".join(chunks))


class _RelayedRequest(aiohttp.ClientRequest):
    """An upstream request that carries the headers the relay gives it, and no others but Host.

    aiohttp adds Accept, Accept-Encoding and User-Agent to a request without them, and a Content-Type to a
    body; a relay must not. The session's ``skip_auto_headers`` says so, and aiohttp honours it by
    building a multidict of the skipped names and a copy of the request's headers for every request.
    Every one of these sessions skips the same names, so that multidict is built once; aiohttp only
    reads it."""

    def update_auto_headers(self, skip_auto_headers: Iterable[str] | None) -> None:
        self._skip_auto_headers = _SKIPPED


class Upstreams:
    """One pooled session per TLS policy, shared by every upstream that uses it; the auth header each
    provider injects, read from the environment at each config load."""

    def __init__(self) -> None:
        self._sessions: dict[bool, aiohttp.ClientSession] = {}
        self._websocket_sessions: dict[tuple[bool, float], aiohttp.ClientSession] = {}
        self._timeouts: dict[float, aiohttp.ClientTimeout] = {}
        self._auth: dict[str, tuple[str, str] | None] = {}
        self._pool_auth: dict[str, dict[str, tuple[str, str]]] = {}

    def configure(self, providers: Mapping[str, ProviderSettings], environ: Mapping[str, str] = os.environ) -> None:
        self._auth = {name: _auth_header(settings.auth, environ.get(settings.api_key_env or "", ""))
                      for name, settings in providers.items()}
        self._pool_auth = {
            name: {key.name: header for key in settings.keys
                   if (header := _auth_header(settings.auth, environ.get(key.api_key_env, ""))) is not None}
            for name, settings in providers.items()
        }

    def auth(self, settings: ProviderSettings, key: str | None = None) -> tuple[str, str] | None:
        """The auth header to send: the pool key the slot was taken on, else the provider's one key
        (a request that takes no slot, such as listing models, goes with the pool's first key)."""
        pool = self._pool_auth.get(settings.name)
        if pool:
            return pool.get(key) if key is not None else next(iter(pool.values()))
        return self._auth.get(settings.name)

    def injects_auth(self, settings: ProviderSettings) -> bool:
        """Whether requests to this provider carry a key of the proxy's (so the client's own is replaced)."""
        return self._auth.get(settings.name) is not None or bool(self._pool_auth.get(settings.name))

    def session_for(self, settings: ProviderSettings) -> aiohttp.ClientSession:
        session = self._sessions.get(settings.tls_verify)
        if session is None or session.closed:
            session = _relay_session(settings, request_class=_RelayedRequest)
            self._sessions[settings.tls_verify] = session
        return session

    def websocket_session_for(self, settings: ProviderSettings) -> aiohttp.ClientSession:
        """The session upstream WebSockets open on: its own, because it reads the body of a refused upgrade
        (a trace hook every answer would pay for on the relay's session), and its handshake's connect
        timeout is the session's."""
        policy = (settings.tls_verify, settings.connect_timeout)
        session = self._websocket_sessions.get(policy)
        if session is None or session.closed:
            trace = aiohttp.TraceConfig()
            trace.on_request_end.append(_keep_refusal_body)
            session = _relay_session(settings, trace_configs=[trace], timeout=aiohttp.ClientTimeout(
                total=None, connect=settings.connect_timeout, sock_read=None))
            self._websocket_sessions[policy] = session
        return session

    def client_timeout(self, settings: ProviderSettings) -> aiohttp.ClientTimeout:
        key = settings.connect_timeout
        timeout = self._timeouts.get(key)
        if timeout is None:
            # idle_timeout is the relay's own (proxy.http.idle): aiohttp's sock_read would set a timer per read.
            timeout = aiohttp.ClientTimeout(total=None, connect=settings.connect_timeout, sock_read=None)
            self._timeouts[key] = timeout
        return timeout

    async def close(self) -> None:
        for session in (*self._sessions.values(), *self._websocket_sessions.values()):
            await session.close()
        self._sessions.clear()
        self._websocket_sessions.clear()


def _auth_header(auth: str, key: str) -> tuple[str, str] | None:
    if not key:
        return None
    if auth == "x-api-key":
        return ("x-api-key", key)
    return ("Authorization", f"Bearer {key}")
