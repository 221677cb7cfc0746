"""What the HTTP layer shares: the application's typed keys and the renderer of proxy-made errors.

Its own module so that the relay, the admin routes and the app each import it
and none of them imports another for it.
"""

from __future__ import annotations

from aiohttp import web

from .errors import ProxyError
from .runtime import ProxyState

__all__ = ["ALLOWED_ORIGIN", "PROVIDER", "QUEUE_MS_HEADER", "STATE", "UNTYPED_BODY", "error_response"]

QUEUE_MS_HEADER = "X-Slotproxy-Queue-Ms"
STATE: web.AppKey[ProxyState] = web.AppKey("slotproxy", ProxyState)
PROVIDER: web.RequestKey[str] = web.RequestKey("slotproxy_provider", str)
UNTYPED_BODY: web.ResponseKey[bool] = web.ResponseKey("slotproxy_untyped_body", bool)
ALLOWED_ORIGIN: web.RequestKey[str] = web.RequestKey("slotproxy_allowed_origin", str)
"""Set on a request whose Origin header passed the origin rule; upstream CORS headers reach only those."""


def error_response(error: ProxyError, *, queue_ms: int | None = None) -> web.Response:
    """A proxy-made answer in the OpenAI error shape, so SDKs surface it."""
    response = web.json_response(error.body(), status=error.status)
    if error.retry_after is not None:
        response.headers["Retry-After"] = str(max(1, int(error.retry_after + 0.999)))
    if queue_ms is not None:
        response.headers[QUEUE_MS_HEADER] = str(queue_ms)
    if error.status == 408:
        response.force_close()
    return response
