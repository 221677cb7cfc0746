"""What a user meets at the proxy's root, and the ledger rows of the ways a request ends before its answer is whole:
a body over ``server.max_body`` (with a Content-Length or chunked) and a client that leaves a stream it began."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from ..conftest import Upstream, chat, serve_app, wait_until
from ..conftest import ledger_rows as rows
from .test_bad_input import read_response

MAX_BODY = 1024


def rig_yaml(upstream: Upstream, ledger: Path) -> str:
    return (f"state: {{path: null}}\nserver: {{max_body: {MAX_BODY}}}\nledger: {{path: '{ledger}'}}\n"
            f"providers:\n  openai:\n    upstream: {upstream.url}/v1\n"
            f"  anthropic:\n    upstream: {upstream.url}\n    auth: x-api-key\n")


# --- the root ---------------------------------------------------------------------------------------------------


async def test_the_root_names_the_dashboard_and_each_provider_route(start_upstream, start_proxy, client,
                                                                    tmp_path) -> None:
    up = await start_upstream()
    proxy = await start_proxy(rig_yaml(up, tmp_path / "l.sqlite"))
    async with client.get(f"{proxy.url}/") as resp:
        assert resp.status == 200
        assert resp.content_type == "application/json"
        doc = await resp.json()
    assert doc["dashboard"] == "/_slotproxy/"
    assert doc["providers"] == [
        {"provider": "openai", "route": "/openai/", "upstream_host": f"127.0.0.1:{up.port}"},
        {"provider": "anthropic", "route": "/anthropic/", "upstream_host": f"127.0.0.1:{up.port}"},
    ]
    assert "unknown_provider" not in str(doc)
    async with client.head(f"{proxy.url}/") as resp:
        assert resp.status == 200
    assert await rows(proxy) == [], "the root is not a provider's request"


async def test_the_root_names_no_provider_to_a_client_without_its_key(start_upstream, start_proxy, client,
                                                                     tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SP_ROOT_KEYS", "sk-client-1")
    up = await start_upstream()
    proxy = await start_proxy(rig_yaml(up, tmp_path / "l.sqlite") + "access: {keys_env: SP_ROOT_KEYS}\n")
    async with client.get(f"{proxy.url}/") as resp:
        assert resp.status == 200
        doc = await resp.json()
    assert doc["dashboard"] == "/_slotproxy/" and doc["providers"] == []
    async with client.get(f"{proxy.url}/", headers={"Authorization": "Bearer sk-client-1"}) as resp:
        assert [p["provider"] for p in (await resp.json())["providers"]] == ["openai", "anthropic"]


# --- 413: one row, however the body was framed -------------------------------------------------------------------


async def _chunked(pieces: int) -> AsyncIterator[bytes]:
    for _ in range(pieces):
        yield b"x" * 256
        await asyncio.sleep(0)


@pytest.mark.parametrize("expect", [False, True], ids=["", "expect-100-continue"])
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_a_body_over_max_body_is_a_rejected_413_row(start_upstream, start_proxy, client, tmp_path,
                                                          framing, expect) -> None:
    """With ``Expect: 100-continue`` (curl sends it for large bodies) the 413 is answered before the body is
    invited, and is a row all the same."""
    up = await start_upstream()
    proxy = await start_proxy(rig_yaml(up, tmp_path / "l.sqlite"))
    url = f"{proxy.url}/openai/chat/completions"
    data: Any = b"x" * (MAX_BODY + 1) if framing == "content-length" else _chunked(5)
    async with client.post(url, data=data, expect100=expect,
                           headers={"X-Workspace-Id": "big", "Content-Type": "application/json"}) as resp:
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == "body_too_large"
    await wait_until(lambda: bool(proxy.state.ledger._pending), what="the row recorded")
    (row,) = await rows(proxy)
    assert (row["provider"], row["status"], row["outcome"], row["ttfb_ms"]) == ("openai", 413, "rejected", None)


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_a_body_expecting_100_continue_is_invited_once_and_relayed(start_upstream, start_proxy, tmp_path,
                                                                         framing) -> None:
    up = await start_upstream()
    proxy = await start_proxy(rig_yaml(up, tmp_path / "l.sqlite"))
    body = b'{"model": "fake", "messages": []}'
    framed = (f"Content-Length: {len(body)}\r\n".encode(), body) if framing == "content-length" else \
        (b"Transfer-Encoding: chunked\r\n", f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        writer.write(b"POST /openai/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                     b"Content-Type: application/json\r\nExpect: 100-continue\r\n" + framed[0] + b"\r\n")
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(framed[1])
        response = await read_response(reader)
    finally:
        writer.close()
    assert response.status == 200 and response.interim == []
    (row,) = await rows(proxy)
    assert (row["status"], row["outcome"]) == (200, "ok")


async def test_an_unknown_provider_is_answered_without_inviting_the_body(start_upstream, start_proxy,
                                                                        tmp_path) -> None:
    up = await start_upstream()
    proxy = await start_proxy(rig_yaml(up, tmp_path / "l.sqlite"))
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        writer.write(b"POST /nosuch/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                     b"Expect: 100-continue\r\nContent-Length: 10\r\n\r\n")
        response = await read_response(reader)
    finally:
        writer.close()
    assert (response.status, response.interim) == (404, [])


# --- a client that leaves a stream it began --------------------------------------------------------------------


async def test_a_stream_left_after_its_200_headers_is_status_200_client_gone(start_upstream, start_proxy,
                                                                             tmp_path) -> None:
    up = await start_upstream(chunks=100, delay_ms=30)
    proxy = await start_proxy(rig_yaml(up, tmp_path / "l.sqlite"))
    async with aiohttp.ClientSession() as session:
        resp = await session.post(f"{proxy.url}/openai/chat/completions", json=chat())
        assert resp.status == 200
        await resp.content.readline()
        resp.close()
    await wait_until(lambda: proxy.status()["in_flight"] == 0, what="the slot released")
    await wait_until(lambda: bool(proxy.state.ledger._pending), what="the row recorded")
    (row,) = await rows(proxy)
    assert (row["status"], row["outcome"]) == (200, "client_gone")
    assert row["ttfb_ms"] is not None


FINAL_EVENTS = {
    "chat": ("/openai/chat/completions", b"data: [DONE]\n\n"),
    "messages": ("/anthropic/v1/messages", b'event: message_stop\ndata: {"type": "message_stop"}\n\n'),
    "responses": ("/openai/responses", b'event: response.completed\ndata: {"type": "response.completed"}\n\n'),
    "mid-stream": ("/anthropic/v1/messages", b'event: content_block_delta\ndata: {"type": "content_block_delta"}\n\n'),
}


@pytest.mark.parametrize("api", list(FINAL_EVENTS))
async def test_a_client_that_hangs_up_at_the_final_event_was_served(start_proxy, tmp_path, api: str) -> None:
    """The OpenAI SDK closes its connection at ``data: [DONE]``, before the body's end: when upstream's end comes
    later (a busy host), the proxy hears of the hang-up first. After the stream's final event that is a request
    served (its 200, outcome ok, counted as a 200); after any other event, a client gone (counted as a 499)."""
    path, last_event = FINAL_EVENTS[api]
    body_end = asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"type": "ping"}\n\n' + last_event)
        await body_end.wait()  # the body's end, held until the client has hung up
        with contextlib.suppress(ConnectionError):  # the proxy has let go of this stream by then
            await response.write_eof()
        return response

    app = web.Application()
    for route in ("/v1/chat/completions", "/v1/messages", "/v1/responses"):
        app.router.add_post(route, stream)
    runner, port = await serve_app(app)
    try:
        proxy = await start_proxy(f"state: {{path: null}}\nledger: {{path: '{tmp_path / 'l.sqlite'}'}}\nproviders:\n"
                                  f"  openai: {{upstream: 'http://127.0.0.1:{port}/v1'}}\n"
                                  f"  anthropic: {{upstream: 'http://127.0.0.1:{port}', auth: x-api-key}}\n")
        async with aiohttp.ClientSession() as session:
            resp = await session.post(f"{proxy.url}{path}", json={**chat(), "max_tokens": 8, "input": "hi"})
            assert resp.status == 200
            seen = b""
            while not seen.endswith(last_event):
                seen += await asyncio.wait_for(resp.content.readany(), 5)
            resp.close()  # as the SDK does: the body's end is never read
        await wait_until(lambda: proxy.status()["in_flight"] == 0, what="the slot released")
        await wait_until(lambda: bool(proxy.state.ledger._pending), what="the row recorded")
    finally:
        body_end.set()
        await runner.cleanup()
    (row,) = await rows(proxy)
    served = api != "mid-stream"
    assert (row["status"], row["outcome"]) == (200, "ok" if served else "client_gone")
    provider = "openai" if path.startswith("/openai") else "anthropic"
    counted = f'slotproxy_requests_total{{provider="{provider}",status="{200 if served else 499}"}} 1.0'
    assert counted in proxy.state.metrics.render().decode()
