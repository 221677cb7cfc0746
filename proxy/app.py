"""The aiohttp application: shared state, routes, middleware, and the server's lifecycle."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.http import SERVER_SOFTWARE

from .access import ClientKeys
from .admin import routes as admin_routes
from .admin.metrics import Metrics
from .admin.throttle import AuthFailures
from .backends import Backend, MemoryBackend
from .config import Config, ProviderSettings
from .connections import ConnectionGuard, ConnectionSettings, GuardedRunner
from .errors import (
    AdminError,
    BadRequest,
    BodyTooLarge,
    Forbidden,
    ProxyError,
    UnknownProvider,
)
from .guard import BrowserGuard, check_path
from .headers import PriorityHeaders
from .limiter import LimiterSettings, SlotLease
from .relay import (
    ALLOWED_ORIGIN,
    PROVIDER,
    STATE,
    UNTYPED_BODY,
    error_response,
    proxy_handler,
)
from .state import StateStore
from .usage import UsagePoller

__all__ = ["ProxyState", "build_app", "limiter_settings", "start_server"]

log = logging.getLogger("slotproxy")

_SKIP_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
MAX_RUNTIME_STARS = 10_000
"""Workspaces the admin API may star beyond the YAML's: each is kept in the state file."""


def limiter_settings(settings: ProviderSettings) -> LimiterSettings:
    return LimiterSettings(
        limit=settings.limit,
        release_cooldown=settings.release_cooldown,
        default_pause=settings.default_pause,
        slot_timeout=settings.slot_timeout,
        queue_timeout=settings.queue_timeout,
        max_queue=settings.max_queue,
        recovery_after=settings.recovery.after if settings.recovery is not None else None,
    )


class ProxyState:
    """Everything a running proxy shares across requests; the config is swapped whole on reload."""

    def __init__(self, config: Config, *, config_path: str | None = None, backend: Backend | None = None) -> None:
        self.config_path = config_path
        self.config_error: str | None = None
        self.backend: Backend = backend or make_backend(config)
        self.metrics = Metrics(lambda: self.backend.statistics(queue_detail=False), self.backend.backend_status)
        self.store = StateStore(_state_path(config, config_path))
        self._star_overrides: dict[str, bool] = {}
        self._save_pending = False
        self.shutting_down = False
        self.active_requests = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self._sessions: dict[bool, aiohttp.ClientSession] = {}
        self._pollers: dict[str, UsagePoller] = {}
        self._stopping: set[asyncio.Task[None]] = set()
        self._timeouts: dict[tuple[float, float], aiohttp.ClientTimeout] = {}
        self.listen_host = config.server.host
        self.connections = ConnectionGuard()
        self.admin_failures = AuthFailures(time.monotonic)
        self.config = config
        restored = self.store.load()
        if restored is not None:
            overrides = restored.get("star_overrides") or {}
            if isinstance(overrides, dict):
                self._star_overrides = _kept_overrides(overrides, config)
        self.apply(config)
        if restored is not None:
            for name, entry in (restored.get("providers") or {}).items():
                if isinstance(entry, dict) and self.backend.has_provider(name):
                    self.backend.restore_state(name, entry)
            log.info("runtime state restored from %s", self.store.path)
        self.backend.on_change = self.schedule_save

    def apply(self, config: Config) -> None:
        """Swap in a validated config; the backend keeps everything queued and in flight."""
        providers = {name: config.provider(name) for name in config.provider_names()}
        self._auth = {name: _auth_header(settings) for name, settings in providers.items()}
        self.client_keys = ClientKeys.from_env(config.access.keys_env, os.environ)
        for warning in config.warnings(os.environ):
            log.warning("%s", warning)
        self.priority_headers = PriorityHeaders(
            workspace=config.headers.workspace,
            starred=config.headers.starred,
            prompt_started_at=config.headers.prompt_started_at,
            conversation=config.headers.conversation,
            max_prompt_age=config.headers.max_prompt_age,
        )
        server = config.server
        self.browser = BrowserGuard.for_listener(self.listen_host, server.allowed_hosts, server.allowed_origins)
        self.connections.configure(ConnectionSettings(
            header_timeout=server.header_timeout, write_timeout=server.write_timeout,
            max_connections=server.max_connections))
        self.strip_headers = self.priority_headers.names()
        self._forget_overrides_changed_in_yaml(config)
        self.backend.configure(
            {name: limiter_settings(settings) for name, settings in providers.items()},
            self._effective_stars(config),
        )
        self._providers = providers
        self.config = config
        self.loaded_at = time.time()
        self._sync_pollers(providers)

    def _sync_pollers(self, providers: dict[str, ProviderSettings]) -> None:
        """One usage poller per provider with a ``usage:`` block; a changed block restarts it."""
        backend = self.backend
        if not isinstance(backend, MemoryBackend):
            return
        for name, poller in list(self._pollers.items()):
            settings = providers.get(name)
            if settings is None or settings.usage != poller.usage:
                del self._pollers[name]
                task = asyncio.get_running_loop().create_task(poller.stop())
                self._stopping.add(task)
                task.add_done_callback(self._stopping.discard)
        for name, settings in providers.items():
            if settings.usage is not None and name not in self._pollers:
                poller = UsagePoller(name, settings.usage, backend.limiter(name),
                                     self.session_for(settings), backend.clock)
                poller.start()
                self._pollers[name] = poller

    # ----- runtime changes (admin API) and the state file ---------------------------

    def _effective_stars(self, config: Config) -> frozenset[str]:
        from_yaml = {w for w in config.workspaces.starred if self._star_overrides.get(w, True)}
        return frozenset(from_yaml | {w for w, starred in self._star_overrides.items() if starred})

    def _forget_overrides_changed_in_yaml(self, config: Config) -> None:
        """A YAML edit of a workspace's star is a manual act: it wins over the admin API's override."""
        before, after = set(self.config.workspaces.starred), set(config.workspaces.starred)
        for workspace in before ^ after:
            self._star_overrides.pop(workspace, None)

    def listen_on(self, host: str) -> None:
        """The address the server is bound to decides the Host rule (loopback or not)."""
        self.listen_host = host
        server = self.config.server
        self.browser = BrowserGuard.for_listener(host, server.allowed_hosts, server.allowed_origins)

    def set_star(self, workspace: str, starred: bool) -> frozenset[str]:
        """Star or unstar at runtime. Unstarring a workspace the YAML does not star forgets it,
        so the state file holds only what differs from the YAML."""
        if starred:
            runtime = sum(1 for value in self._star_overrides.values() if value)
            if not self._star_overrides.get(workspace) and runtime >= MAX_RUNTIME_STARS:
                raise AdminError(f"at most {MAX_RUNTIME_STARS} workspaces can be starred through the admin API; "
                                 "unstar some, or star them in the YAML (workspaces.starred)")
            self._star_overrides[workspace] = True
        elif workspace in self.config.workspaces.starred:
            self._star_overrides[workspace] = False
        else:
            self._star_overrides.pop(workspace, None)
        stars = self._effective_stars(self.config)
        self.backend.set_starred(stars)
        log.info("workspace=%s %s via the admin API", workspace, "starred" if starred else "unstarred")
        self.schedule_save()
        return stars

    def schedule_save(self) -> None:
        """Coalesce a burst of changes into one atomic write at the end of this loop turn."""
        if self.store.path is None or self._save_pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.save_state()
            return
        self._save_pending = True
        loop.call_soon(self.save_state)

    def save_state(self) -> None:
        self._save_pending = False
        self.store.save({"providers": self.backend.export_state(), "star_overrides": self._star_overrides})

    def request_started(self) -> None:
        self.active_requests += 1
        self.idle.clear()

    def request_finished(self) -> None:
        self.active_requests -= 1
        if self.active_requests == 0:
            self.idle.set()

    def provider(self, name: str) -> ProviderSettings | None:
        return self._providers.get(name)

    def provider_names(self) -> list[str]:
        return list(self._providers)

    def provider_auth(self, settings: ProviderSettings) -> tuple[str, str] | None:
        return self._auth.get(settings.name)

    def session_for(self, settings: ProviderSettings) -> aiohttp.ClientSession:
        """One pooled session per TLS policy, shared by every upstream that uses it."""
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
            timeout = aiohttp.ClientTimeout(
                total=None, connect=settings.connect_timeout, sock_read=settings.idle_timeout
            )
            self._timeouts[key] = timeout
        return timeout

    def observe_grant(self, provider: str, lease: SlotLease) -> None:
        self.metrics.observe_wait(provider, lease.queue_wait)
        if lease.queue_wait >= self.config.logging.slow_grant:
            log.info(
                "provider=%s granted a slot after %.1fs in the queue (workspace=%s conversation=%s)",
                provider, lease.queue_wait, lease.priority.workspace, lease.priority.conversation or "-",
            )

    async def start(self) -> None:
        """Connect the backend (Redis) before the first request is served."""
        await self.backend.start()

    def status(self) -> dict[str, Any]:
        """The status document; with the Redis backend call ``await backend.refresh()`` first."""
        providers = []
        for status in self.backend.statistics():
            entry = status.to_dict()
            if not isinstance(self.backend, MemoryBackend):
                entry["local_in_flight"] = self.backend.local_in_flight(status.provider)
            providers.append(entry)
        return {
            "providers": providers,
            "backend": self.backend.backend_status(),
            "config": {
                "path": self.config_path,
                "loaded_at": int(self.loaded_at * 1000),
                "error": self.config_error,
            },
        }

    async def close(self) -> None:
        for poller in self._pollers.values():
            await poller.stop()
        self._pollers.clear()
        for session in self._sessions.values():
            await session.close()
        self._sessions.clear()
        await self.backend.close()


def make_backend(config: Config) -> Backend:
    if config.backend.kind == "redis":
        from .backends.redis import RedisBackend

        return RedisBackend(
            config.backend.url,
            key_prefix=config.backend.key_prefix,
            lease_ttl=config.backend.lease_ttl,
            on_backend_error=config.backend.on_backend_error,
            local_limit=config.backend.local_limit,
        )
    return MemoryBackend()


def _kept_overrides(overrides: dict[Any, Any], config: Config) -> dict[str, bool]:
    """Star overrides from a state file, without unstars of workspaces the YAML does not star."""
    kept: dict[str, bool] = {}
    runtime = 0
    for workspace, starred in overrides.items():
        name, value = str(workspace), bool(starred)
        if not value and name not in config.workspaces.starred:
            continue
        if value:
            if runtime >= MAX_RUNTIME_STARS:
                continue
            runtime += 1
        kept[name] = value
    return kept


def _state_path(config: Config, config_path: str | None) -> Path | None:
    """A relative state path is taken relative to the config file, like nginx's prefix."""
    if config.state.path is None:
        return None
    path = Path(config.state.path)
    if not path.is_absolute() and config_path is not None:
        path = Path(config_path).resolve().parent / path
    return path


def _auth_header(settings: ProviderSettings) -> tuple[str, str] | None:
    if not settings.api_key_env:
        return None
    key = os.environ.get(settings.api_key_env, "")
    if not key:
        return None
    if settings.auth == "x-api-key":
        return ("x-api-key", key)
    return ("Authorization", f"Bearer {key}")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_ERROR_CODES = {404: UnknownProvider, 400: BadRequest}


_REFUSED_METHODS = frozenset({"CONNECT", "TRACE"})
_PREFLIGHT_METHODS = "GET, HEAD, POST, PUT, DELETE"
_MAX_REFLECTED = 1024


@web.middleware
async def _guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse what a proxy beside a browser must never serve, render proxy errors, and count answers.

    The order matters: who is asking (Host, then Origin) is settled before the
    method, the path or any route is looked at, so a refused page learns nothing.
    """
    state = request.app[STATE]
    try:
        refusal = _refusal(request, state)
    except ProxyError as exc:
        return error_response(exc)
    if refusal is not None:
        return refusal
    try:
        response = await handler(request)
    except ProxyError as exc:
        response = error_response(exc)
    except web.HTTPException as exc:
        if exc.status in _ERROR_CODES and not request.path.startswith("/_slotproxy/"):
            response = error_response(_ERROR_CODES[exc.status](exc.reason))
        else:
            raise
    except asyncio.CancelledError:
        _count(request, state, "499")
        raise
    _count(request, state, str(response.status))
    return response


def _refusal(request: web.Request, state: ProxyState) -> web.StreamResponse | None:
    headers = request.headers
    host = headers.get("Host")
    if not state.browser.host_allowed(host):
        shown = (host or "")[:100]
        raise Forbidden(f"Host {shown!r} is not a name this proxy answers to: a web page may be trying "
                        "DNS rebinding. To allow it (a Kubernetes Service name, say), add it to "
                        "server.allowed_hosts")
    raw_path = request.raw_path
    refusal = state.browser.refusal(request.method, raw_path.partition("?")[0], headers)
    if refusal is not None:
        raise Forbidden(refusal)
    origin = headers.get("Origin")
    if origin is not None:
        request[ALLOWED_ORIGIN] = origin
    method = request.method
    if method in _REFUSED_METHODS:
        return _method_not_allowed(f"{method} is not supported: slotproxy is not a forward proxy")
    if not raw_path.startswith("/"):
        raise BadRequest("absolute-form request targets are refused: slotproxy is not an open proxy")
    check_path(raw_path)
    if method == "OPTIONS":
        return _preflight(request, origin)
    return None


def _preflight(request: web.Request, origin: str | None) -> web.Response:
    """OPTIONS is answered here, never forwarded (upstream would see the provider key)."""
    if origin is None:
        return web.Response(status=204, headers={"Allow": _PREFLIGHT_METHODS + ", OPTIONS"})
    headers = {
        "Access-Control-Allow-Origin": origin,
        "Access-Control-Allow-Methods": _PREFLIGHT_METHODS,
        "Access-Control-Max-Age": "600",
        "Vary": "Origin",
    }
    asked = request.headers.get("Access-Control-Request-Headers")
    if asked:
        headers["Access-Control-Allow-Headers"] = asked[:_MAX_REFLECTED]
    return web.Response(status=204, headers=headers)


def _count(request: web.Request, state: ProxyState, status: str) -> None:
    provider = request.get(PROVIDER)
    if provider is not None:
        state.metrics.count_request(provider, status)


def _method_not_allowed(message: str) -> web.Response:
    error = BadRequest(message)
    response = web.json_response(error.body(), status=405)
    return response


async def _expect_continue(request: web.Request) -> web.StreamResponse | None:
    """Refuse an oversized body before the client sends it, instead of inviting it with 100 Continue."""
    if request.version != aiohttp.HttpVersion11 or request.headers.get("Expect", "").lower() != "100-continue":
        return None
    max_body = request.app[STATE].config.server.max_body
    if request.content_length is not None and request.content_length > max_body:
        return error_response(BodyTooLarge(
            f"request body of {request.content_length} bytes is over server.max_body ({max_body} bytes)"))
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    return None


async def _finish_headers(request: web.Request, response: web.StreamResponse) -> None:
    """aiohttp names itself in a Server header, and types an untyped body as octet-stream; a relay adds
    neither. A browser origin the config allows may read the answer."""
    headers = response.headers
    if headers.get("Server") == SERVER_SOFTWARE:
        del headers["Server"]
    if response.get(UNTYPED_BODY) and headers.get("Content-Type") == "application/octet-stream":
        del headers["Content-Type"]
    origin = request.get(ALLOWED_ORIGIN)
    if origin is not None and "Access-Control-Allow-Origin" not in headers:
        headers["Access-Control-Allow-Origin"] = origin
        headers.add("Vary", "Origin")


def build_app(state: ProxyState) -> web.Application:
    app = web.Application(middlewares=[_guard], client_max_size=state.config.server.max_body + 1)
    app[STATE] = state
    admin_routes.add_routes(app)
    app.router.add_route("*", "/{provider}", proxy_handler, expect_handler=_expect_continue)
    app.router.add_route("*", "/{provider}/{rest:[\\s\\S]*}", proxy_handler, expect_handler=_expect_continue)
    app.on_response_prepare.append(_finish_headers)

    async def close_state(_: web.Application) -> None:
        await state.close()

    app.on_cleanup.append(close_state)
    return app


async def start_server(state: ProxyState, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Start serving; returns the runner and the bound port (port 0 picks a free one)."""
    await state.start()
    state.listen_on(host)
    runner = GuardedRunner(build_app(state), state.connections, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    return runner, bound
