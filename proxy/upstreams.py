"""The upstream side: pooled client sessions, per-provider timeouts and the provider key to send."""

from __future__ import annotations

import os
from collections.abc import Mapping

import aiohttp

from .config import ProviderSettings

__all__ = ["Upstreams"]

_SKIP_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")


class Upstreams:
    """One pooled session per TLS policy, shared by every upstream that uses it; the auth header each
    provider injects, read from the environment at each config load."""

    def __init__(self) -> None:
        self._sessions: dict[bool, aiohttp.ClientSession] = {}
        self._timeouts: dict[tuple[float, float], aiohttp.ClientTimeout] = {}
        self._auth: dict[str, tuple[str, str] | None] = {}

    def configure(self, providers: Mapping[str, ProviderSettings], environ: Mapping[str, str] = os.environ) -> None:
        self._auth = {name: _auth_header(settings, environ) for name, settings in providers.items()}

    def auth(self, settings: ProviderSettings) -> tuple[str, str] | None:
        return self._auth.get(settings.name)

    def session_for(self, settings: ProviderSettings) -> aiohttp.ClientSession:
        session = self._sessions.get(settings.tls_verify)
        if session is None or session.closed:
            connector = aiohttp.TCPConnector(limit=0, ssl=settings.tls_verify, ttl_dns_cache=300)
            session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=_SKIP_AUTO_HEADERS,
                trust_env=False,
            )
            self._sessions[settings.tls_verify] = session
        return session

    def client_timeout(self, settings: ProviderSettings) -> aiohttp.ClientTimeout:
        key = (settings.connect_timeout, settings.idle_timeout)
        timeout = self._timeouts.get(key)
        if timeout is None:
            timeout = aiohttp.ClientTimeout(total=None, connect=settings.connect_timeout,
                                            sock_read=settings.idle_timeout)
            self._timeouts[key] = timeout
        return timeout

    async def close(self) -> None:
        for session in self._sessions.values():
            await session.close()
        self._sessions.clear()


def _auth_header(settings: ProviderSettings, environ: Mapping[str, str]) -> tuple[str, str] | None:
    if not settings.api_key_env:
        return None
    key = environ.get(settings.api_key_env, "")
    if not key:
        return None
    if settings.auth == "x-api-key":
        return ("x-api-key", key)
    return ("Authorization", f"Bearer {key}")
