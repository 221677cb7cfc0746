"""Reading a request body whole, bounded in size and in the gap between its bytes."""

from __future__ import annotations

import asyncio

from aiohttp import HttpVersion11, web

from ..errors import BodyTooLarge, RequestTimeout

__all__ = ["read_body"]


_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


async def read_body(request: web.Request, max_body: int, body_timeout: float, *, invite: bool = False) -> bytes:
    """The whole body, before any slot is taken (so a slow client holds none).

    ``invite``: answer ``Expect: 100-continue`` with ``100 Continue`` once the body may come (the relay's
    requests; aiohttp's router has already answered it for the proxy's own routes). A body declared over
    ``max_body`` is refused without inviting it, and the refusal is the caller's to record like any other.

    Bytes already buffered are taken without waiting, so a body that came with its
    headers costs no timer; each wait for more is bounded by ``body_timeout``.
    Raises ``BodyTooLarge`` past ``max_body`` and ``RequestTimeout`` (the
    connection is then closed) when the client stalls.
    """
    declared = request.content_length
    if declared is not None and declared > max_body:
        raise BodyTooLarge(f"request body of {declared} bytes is over server.max_body ({max_body} bytes)")
    if invite and (expect := request.headers.get("Expect")) is not None and expect.lower() == "100-continue" \
            and request.version == HttpVersion11:
        await request.writer.write(_CONTINUE)
    content = request.content
    chunks: list[bytes] = []
    size = 0
    while not content.at_eof():
        chunk = content.read_nowait(-1)
        if not chunk:
            try:
                async with asyncio.timeout(body_timeout):
                    chunk = await content.readany()
            except TimeoutError:
                raise RequestTimeout(f"the request body stalled for server.body_timeout ({body_timeout:g}s); "
                                     "send it without pauses") from None
        size += len(chunk)
        if size > max_body:
            raise BodyTooLarge(f"request body is over server.max_body ({max_body} bytes)")
        chunks.append(chunk)
    return b"".join(chunks)

