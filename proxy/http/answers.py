"""The answers slotproxy sends: aiohttp's responses, with their headers finished the way a relay's must be.

aiohttp names itself in a ``Server`` header and types an untyped body as
``application/octet-stream``; a relay adds neither. A browser origin the config
allows (``ALLOWED_ORIGIN``, set by the guard) may read the answer. This is done
as aiohttp prepares the headers (after its defaults, before they are written),
so every answer gets it, those refused before routing included, with no
response signal to run on each request. A small relayed answer (``WrittenAnswer``)
skips aiohttp's preparation altogether: it gets no defaults to take back, and the
origin rule is applied as it is written.
"""

from __future__ import annotations

import json
import time
from email.utils import formatdate
from typing import Any

from aiohttp import web
from aiohttp.http import SERVER_SOFTWARE, HttpVersion10
from aiohttp.web_request import BaseRequest
from multidict import CIMultiDict

__all__ = ["ALLOWED_ORIGIN", "Answer", "ClosingAnswer", "StreamedAnswer", "WrittenAnswer", "json_answer"]

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
    if request is not None:
        _allow_origin(headers, request.get(ALLOWED_ORIGIN))


def _allow_origin(headers: CIMultiDict[str], origin: str | None) -> None:
    if origin is not None and "Access-Control-Allow-Origin" not in headers:
        headers["Access-Control-Allow-Origin"] = origin
        headers.add("Vary", "Origin")


class Answer(web.Response):
    """A whole answer. ``untyped``: the body it relays came without a Content-Type, and leaves without one."""

    untyped = False

    async def _prepare_headers(self) -> None:
        await super()._prepare_headers()
        _finish(self, self.untyped)


class ClosingAnswer(Answer):
    """An answer after which the connection closes at once, unread: the 408 for a body that stalled
    (``body_timeout``). aiohttp would otherwise linger, for up to 10 s, reading the rest of a body the
    client has stopped sending."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.force_close()

    async def write_eof(self, data: bytes = b"") -> None:
        request = self._req
        await super().write_eof(data)
        if request is not None:
            request.protocol.force_close()


class StreamedAnswer(web.StreamResponse):
    """An answer written as it arrives (``untyped`` as for ``Answer``)."""

    untyped = False

    async def _prepare_headers(self) -> None:
        await super()._prepare_headers()
        _finish(self, self.untyped)


class WrittenAnswer(web.StreamResponse):
    """A relayed whole answer with a body, written by ``send``: status line, headers and body in one write.

    aiohttp's ``Response`` gets there through seven coroutines (``prepare``, ``_start``, ``_prepare_headers``
    twice, the prepare signal, ``_write_headers``, ``write_eof``), adding default headers that ``_finish``
    then takes back: 34 000 instructions of a small request, more than the limiter (``bench/RESULTS.md``,
    "Lean, sixth pass"). The relayed headers are final but for the ones HTTP itself needs, so they go
    straight to the connection's writer. aiohttp's connection handler gets the answer back as one
    already sent: its ``prepare`` and ``write_eof`` have nothing left to do.

    Only for answers that carry a body (``fits``): not to HEAD, and not a 1xx, 204 or 304."""

    _sent = False
    _kept_alive = False

    @staticmethod
    def fits(method: str, status: int) -> bool:
        return method != "HEAD" and status >= 200 and status != 204 and status != 304

    @property
    def keep_alive(self) -> bool:
        return self._kept_alive

    @property
    def prepared(self) -> bool:
        return self._sent

    async def send(self, request: BaseRequest, headers: CIMultiDict[str], body: bytes) -> None:
        """Write the answer; ``headers`` are the relayed ones (no Content-Length, no hop-by-hop)."""
        keep_alive = request.keep_alive
        version = request.version
        _allow_origin(headers, request.get(ALLOWED_ORIGIN))
        if "Date" not in headers:
            headers["Date"] = _http_date()
        if version == HttpVersion10:
            if keep_alive:
                headers["Connection"] = "keep-alive"
        elif not keep_alive:
            headers["Connection"] = "close"
        headers["Content-Length"] = str(len(body))
        self._kept_alive = keep_alive
        self._sent = True
        writer = request.writer
        await writer.write_headers(f"HTTP/{version.major}.{version.minor} {self.status} {self.reason}", headers)
        await writer.write_eof(body)

    async def prepare(self, request: BaseRequest) -> None:
        return None

    async def write_eof(self, data: bytes = b"") -> None:
        return None


_date = (0, "")


def _http_date() -> str:
    """Now as an HTTP date, formatted once a second."""
    global _date
    second = int(time.time())
    if _date[0] != second:
        _date = (second, formatdate(second, usegmt=True))
    return _date[1]


def json_answer(data: Any, *, status: int = 200, close: bool = False) -> Answer:
    """``close``: the connection closes after it (``ClosingAnswer``)."""
    return (ClosingAnswer if close else Answer)(text=json.dumps(data), status=status, content_type="application/json")
