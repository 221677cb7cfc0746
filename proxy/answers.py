"""The answers slotproxy sends: aiohttp's responses, with their headers finished the way a relay's must be.

aiohttp names itself in a ``Server`` header and types an untyped body as
``application/octet-stream``; a relay adds neither. A browser origin the config
allows (``ALLOWED_ORIGIN``, set by the guard) may read the answer. This is done
as aiohttp prepares the headers (after its defaults, before they are written),
so every answer gets it, those refused before routing included, with no
response signal to run on each request.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from aiohttp.http import SERVER_SOFTWARE

__all__ = ["ALLOWED_ORIGIN", "Answer", "StreamedAnswer", "json_answer"]

ALLOWED_ORIGIN: web.RequestKey[str | None] = web.RequestKey("slotproxy_allowed_origin", str)
"""Set by the guard on every request it lets through: the Origin, which passed the origin rule, or None
(no Origin). Upstream CORS headers reach only a set origin. Always set, because a request mapping's
missing key costs a raised KeyError on every lookup."""

_OCTET_STREAM = "application/octet-stream"


def _finish(response: web.StreamResponse, untyped: bool) -> None:
    headers = response.headers
    if headers.get("Server") == SERVER_SOFTWARE:
        del headers["Server"]
    if untyped and headers.get("Content-Type") == _OCTET_STREAM:
        del headers["Content-Type"]
    request = response._req
    origin = request.get(ALLOWED_ORIGIN) if request is not None else None
    if origin is not None and "Access-Control-Allow-Origin" not in headers:
        headers["Access-Control-Allow-Origin"] = origin
        headers.add("Vary", "Origin")


class Answer(web.Response):
    """A whole answer. ``untyped``: the body it relays came without a Content-Type, and leaves without one."""

    untyped = False

    async def _prepare_headers(self) -> None:
        await super()._prepare_headers()
        _finish(self, self.untyped)


class StreamedAnswer(web.StreamResponse):
    """An answer written as it arrives (``untyped`` as for ``Answer``)."""

    untyped = False

    async def _prepare_headers(self) -> None:
        await super()._prepare_headers()
        _finish(self, self.untyped)


def json_answer(data: Any, *, status: int = 200) -> Answer:
    return Answer(text=json.dumps(data), status=status, content_type="application/json")
