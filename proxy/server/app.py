"""The aiohttp application: routes, the guard around it, the history sampler, and starting the server."""

from __future__ import annotations

from functools import partial
from typing import cast

import aiohttp
from aiohttp import web
from aiohttp.web_request import BaseRequest

from ..admin import history
from ..admin import routes as admin_routes
from ..config.types import RESERVED_PROVIDER_IDS
from ..errors import BadRequest, BodyTooLarge, Forbidden, ProxyError, UnknownProvider
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
                relayed = cast(web.Request, request)
                refused = await _answer_expect(relayed, state.config.server.max_body) \
                    if request.headers.get("Expect") else None
                response = refused if refused is not None else await relay(relayed, state, provider, rest)
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


async def _expect_continue(request: web.Request) -> web.StreamResponse | None:
    return await _answer_expect(request, request.app[STATE].config.server.max_body)


async def _answer_expect(request: web.Request, max_body: int) -> web.StreamResponse | None:
    """Refuse an oversized body before the client sends it, instead of inviting it with 100 Continue."""
    if request.version != aiohttp.HttpVersion11 or request.headers.get("Expect", "").lower() != "100-continue":
        return None
    if request.content_length is not None and request.content_length > max_body:
        return error_response(BodyTooLarge(
            f"request body of {request.content_length} bytes is over server.max_body ({max_body} bytes)"))
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    return None


def _build_app(state: ProxyState) -> web.Application:
    """The routes alone: served only through ``start_server``, whose runner puts ``guarded`` around them."""
    app = web.Application(client_max_size=state.config.server.max_body + 1)
    app[STATE] = state
    admin_routes.add_routes(app)
    app.router.add_route("*", "/{provider}", proxy_handler, expect_handler=_expect_continue)
    app.router.add_route("*", "/{provider}/{rest:[\\s\\S]*}", proxy_handler, expect_handler=_expect_continue)
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
