"""What the HTTP layer shares: the application's typed keys and the renderer of proxy-made errors.

Its own module so that the relay, the admin routes and the app each import it
and none of them imports another for it.
"""

from __future__ import annotations

from aiohttp import web

from ..errors import ProxyError, RequestTimeout
from .answers import Answer, json_answer
from .runtime import ProxyState

__all__ = ["QUEUE_MS_HEADER", "STATE", "error_response"]

QUEUE_MS_HEADER = "X-Slotproxy-Queue-Ms"
STATE: web.AppKey[ProxyState] = web.AppKey("slotproxy", ProxyState)


def error_response(error: ProxyError, *, queue_ms: int | None = None) -> Answer:
    """A proxy-made answer in the OpenAI error shape, so SDKs surface it."""
    response = json_answer(error.body(), status=error.status, close=isinstance(error, RequestTimeout))
    if error.retry_after is not None:
        response.headers["Retry-After"] = str(max(1, int(error.retry_after + 0.999)))
    if queue_ms is not None:
        response.headers[QUEUE_MS_HEADER] = str(queue_ms)
    return response
