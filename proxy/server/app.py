"""The aiohttp application: routes, the guard around it, the history sampler, and starting the server."""

from __future__ import annotations

from functools import partial
from typing import cast

from aiohttp import web
from aiohttp.web_request import BaseRequest
from yarl import URL

from ..admin import history
from ..admin import routes as admin_routes
from ..config.types import RESERVED_PROVIDER_IDS
from ..errors import BadRequest, Forbidden, ProxyError, UnknownProvider
from ..http.answers import ALLOWED_ORIGIN, Answer, json_answer
from ..http.connections import GuardedRunner, Handler
from ..http.guard import check_path
from ..http.keys import STATE, error_response
from ..http.relay import proxy_handler, relay
from ..http.runtime import ProxyState

__all__ = ["guarded", "start_server"]


_ERROR_CODES = {404: UnknownProvider, 400: BadRequest}


_REFUSED_METHODS = frozenset({"CONNECT", "TRACE"})
_PREFLIGHT_METHODS = "GET, HEAD, POST, PUT, DELETE"
_MAX_REFLECTED = 1024
_MAX_BACKLOG = 65535


def guarded(state: ProxyState, handle: Handler) -> Handler:
    """The server's handler: refuse what a proxy beside a browser must never serve, relay provider
    paths and render proxy errors; the proxy's own paths go to the application's
    routing (``handle``).

    It wraps the application rather than sitting in it as a middleware, so no route, the admin API's
    included, is reached unguarded. Provider paths skip aiohttp's router, which cost more per request
    than any other part of the relay's path (``bench/RESULTS.md``, "Lean, second pass"). The order
    matters: who is asking (Host, then Origin) is settled before the method, the path or any route is
    looked at, so a refused page learns nothing.
    """

    async def guard(request: BaseRequest) -> web.StreamResponse:
        try:
            refusal = _refusal(request, state)
        except ProxyError as exc:
            return error_response(exc)
        if refusal is not None:
            return refusal
        try:
            provider, rest = _provider_path(request.path)
            if provider is None:
                response = await handle(request)
            else:  # the application's requests are web.Requests: it makes them
                response = await relay(cast(web.Request, request), state, provider, rest)
        except ProxyError as exc:
            response = error_response(exc)
        except web.HTTPException as exc:  # the router's 404 and 405
            if exc.status in _ERROR_CODES and not request.path.startswith("/_slotproxy/"):
                response = error_response(_ERROR_CODES[exc.status](exc.reason))
            else:
                response = Answer(status=exc.status, reason=exc.reason, text=exc.text, headers=exc.headers)
        return response

    return guard


def _provider_path(path: str) -> tuple[str | None, str]:
    """``/{provider}/{rest}`` for a path that can only be a provider's (ids starting with ``_``, ``metrics``,
    ``healthz`` and ``readyz`` are the proxy's own): those skip aiohttp's router, and the rest go through it."""
    first, _, rest = path[1:].partition("/")
    if not first or first[0] == "_" or first in RESERVED_PROVIDER_IDS:
        return None, ""
    return first, rest


def _refusal(request: BaseRequest, state: ProxyState) -> web.StreamResponse | None:
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


def _preflight(request: BaseRequest, origin: str | None) -> web.Response:
    """OPTIONS is answered here, never forwarded (upstream would see the provider key)."""
    if origin is None:
        return Answer(status=204, headers={"Allow": _PREFLIGHT_METHODS + ", OPTIONS"})
    headers = {
        "Access-Control-Allow-Origin": origin,
        "Access-Control-Allow-Methods": _PREFLIGHT_METHODS,
        "Access-Control-Max-Age": "600",
        "Vary": "Origin",
    }
    asked = request.headers.get("Access-Control-Request-Headers")
    if asked:
        headers["Access-Control-Allow-Headers"] = asked[:_MAX_REFLECTED]
    return Answer(status=204, headers=headers)


def _method_not_allowed(message: str) -> web.Response:
    return json_answer(BadRequest(message).body(), status=405)


async def _relay_invites(request: web.Request) -> None:
    """Provider routes leave ``Expect: 100-continue`` to the relay, which refuses an oversized body before
    inviting it, and records the refusal like any other request's end."""


async def _root(request: web.Request) -> web.Response:
    """``GET /``: where the dashboard is and which provider routes lead where (the upstream's host, never its
    key). With client keys on, the routes are named only to a client that presents a valid one."""
    state = request.app[STATE]
    routes: list[dict[str, str]] = []
    if _may_see_providers(state, request):
        for name in state.provider_names():
            settings = state.provider(name)
            if settings is not None:
                host = URL(settings.upstream).host_port_subcomponent or ""
                routes.append({"provider": name, "route": f"/{name}/", "upstream_host": host})
    return json_answer({"service": "slotproxy", "dashboard": "/_slotproxy/", "status": "/_slotproxy/status",
                        "usage": "/_slotproxy/usage", "metrics": "/metrics", "providers": routes})


def _may_see_providers(state: ProxyState, request: web.Request) -> bool:
    if state.client_keys is None:
        return True
    try:
        state.client_keys.check(request.headers, provider_key_injected=True)
    except Forbidden:
        return False
    return True


def _build_app(state: ProxyState) -> web.Application:
    """The routes alone: served only through ``start_server``, whose runner puts ``guarded`` around them."""
    app = web.Application(client_max_size=state.config.server.max_body + 1)
    app[STATE] = state
    admin_routes.add_routes(app)
    app.router.add_get("/", _root)
    app.router.add_route("*", "/{provider}", proxy_handler, expect_handler=_relay_invites)
    app.router.add_route("*", "/{provider}/{rest:[\\s\\S]*}", proxy_handler, expect_handler=_relay_invites)
    sampler = history.HistorySampler(state.backend, history.History(history.SAMPLE_INTERVAL))
    app[admin_routes.HISTORY] = sampler.history
    app.cleanup_ctx.append(sampler.running)

    async def close_state(_: web.Application) -> None:
        await state.close()

    app.on_cleanup.append(close_state)
    return app


async def start_server(state: ProxyState, host: str, port: int, *,
                       reuse_port: bool = False) -> tuple[web.AppRunner, int]:
    """Start serving; returns the runner and the bound port (port 0 picks a free one). ``reuse_port``: bind
    with ``SO_REUSEPORT``, beside the other workers of ``serve --workers`` (the kernel spreads the
    connections between them)."""
    await state.start()
    state.listen_on(host)
    runner = GuardedRunner(_build_app(state), state.connections, wrap=partial(guarded, state),
                           handler_cancellation=True, access_log=None)
    try:
        await runner.setup()
        # A fleet that starts together connects together: aiohttp's default backlog of 128 overflows at a
        # thousand agents a second (SYNs dropped, a second's retransmit each), so the queue is sized to the
        # connections the proxy takes (the kernel caps it at net.core.somaxconn).
        site = web.TCPSite(runner, host, port, reuse_address=True, reuse_port=reuse_port or None,
                           backlog=min(state.config.server.max_connections, _MAX_BACKLOG))
        await site.start()
    except BaseException:  # the port is taken, say: what start() opened (Redis connections) is closed
        if runner.server is not None:
            await runner.cleanup()  # the app's cleanup closes the state
        else:
            await state.close()
        raise
    bound = runner.addresses[0][1] if runner.addresses else port
    return runner, bound
