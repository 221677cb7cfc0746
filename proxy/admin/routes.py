"""Status, history, usage, health and metrics routes under /_slotproxy/, /healthz, /readyz and /metrics."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web

from ..errors import AdminError
from ..http.answers import Answer, json_answer
from ..http.keys import STATE, error_response
from ..http.metrics import CONTENT_TYPE
from . import api
from .history import History
from .status import status_document
from .usage import usage

__all__ = ["HISTORY", "add_routes"]

HISTORY: web.AppKey[History] = web.AppKey("slotproxy_history", History)
"""The sampled last hour the app's history sampler keeps (``admin.history``)."""


async def status(request: web.Request) -> web.Response:
    state = request.app[STATE]
    await state.backend.refresh()
    return json_answer(status_document(state))


async def history(request: web.Request) -> web.Response:
    """Like status, a read: no admin token."""
    return json_answer(request.app[HISTORY].to_dict())


_DASHBOARD = Path(__file__).with_name("dashboard.html")
_DASHBOARD_HEADERS = {
    "Cache-Control": "no-store",
    # frame-ancestors and X-Frame-Options: no other page may frame the dashboard (clickjacking its buttons).
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "script-src 'self' 'unsafe-inline'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}


@functools.cache
def _dashboard_html() -> bytes:
    return _DASHBOARD.read_bytes()


async def dashboard(request: web.Request) -> web.Response:
    return Answer(
        body=_dashboard_html(),
        content_type="text/html",
        charset="utf-8",
        headers=_DASHBOARD_HEADERS,
    )


async def healthz(request: web.Request) -> web.Response:
    return json_answer({"ok": True})


async def readyz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    reasons = []
    if state.shutting_down:
        reasons.append("shutting down")
    if not state.backend.ready():
        backend = state.backend.backend_status()
        reasons.append(f"backend unreachable ({backend.get('degraded')}): {backend.get('error')}")
    if reasons:
        return json_answer({"ready": False, "reasons": reasons}, status=503)
    return json_answer({"ready": True})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    await state.backend.refresh(queue_detail=False)
    body = state.metrics.render()
    return Answer(body=body, headers={"Content-Type": CONTENT_TYPE})


async def _to_dashboard(request: web.Request) -> web.Response:
    """``/_slotproxy`` without its slash: send the browser to the dashboard, as a web server would."""
    return Answer(status=301, headers={"Location": "/_slotproxy/"}, text="301: Moved Permanently")


def _not_allowed(allowed: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def answer(request: web.Request) -> web.Response:
        response = error_response(AdminError(
            f"{request.method} is not allowed on {request.path}; use {allowed}",
            status=405))
        response.headers["Allow"] = allowed
        return response

    return answer


def _refuse_other_methods(app: web.Application, first: int) -> None:
    """A wrong method on one of the proxy's own paths is 405 with ``Allow``: without a route for every
    other method, the router would hand it to the provider catch-all, which answers 404."""
    for resource in list(app.router.resources())[first:]:
        if not isinstance(resource, web.Resource):
            continue
        methods = sorted({route.method for route in resource if route.method != "*"})
        resource.add_route("*", _not_allowed(", ".join(methods)))


def add_routes(app: web.Application) -> None:
    first = len(app.router.resources())
    app.router.add_get("/_slotproxy/status", status)
    app.router.add_get("/_slotproxy/history", history)
    app.router.add_get("/_slotproxy/usage", usage)
    app.router.add_get("/_slotproxy/", dashboard)
    app.router.add_get("/_slotproxy", _to_dashboard)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    api.add_routes(app)
    _refuse_other_methods(app, first)
