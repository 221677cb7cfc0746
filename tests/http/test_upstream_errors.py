"""Upstream failures in words (issue 24, finding 3): host and port, what happened, no library class names,
no secrets; the same sentence in the client's error body and in the log line.

End to end on loopback only: a port nothing listens on (refused), a server that accepts and closes (closed
before answering), the fake resetting a stream mid-way (the log counts the chunks), a TLS server with a
self-signed certificate, a plain-HTTP server behind an ``https://`` upstream, an upstream that never answers
and one that stalls mid-stream (idle_timeout), and a WebSocket upgrade to a refused port. What loopback
cannot show (a name that does not resolve, a connect timeout, several addresses failing) is held to its
words by unit tests of the translator, ``proxy.http.upstream_errors``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.client_reqrep import ConnectionKey

from proxy.errors import UpstreamTimeout, UpstreamUnreachable
from proxy.http import upstream_errors

from ..conftest import chat, serve_app, wait_until
from ..ports import free_port
from ..system.test_security import _self_signed
from .test_bad_input import assert_error
from .test_websocket import upgrade

CLASS_NAMES = ("ClientConnectorError", "ClientPayloadError", "ServerDisconnectedError", "ClientOSError",
               "ClientConnectorCertificateError", "ClientConnectorSSLError", "TimeoutError", "SSLError",
               "ConnectionResetError", "Error:", "aiohttp", "Errno", "_ssl.c")


def one_provider(upstream: str, **settings: str) -> str:
    extra = "".join(f", {key}: {value}" for key, value in settings.items())
    return f"state: {{path: null}}\nproviders:\n  openai: {{upstream: '{upstream}', limit: 1{extra}}}\n"


def relay_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "slotproxy.relay" and r.levelno >= logging.WARNING]


async def post_error(client: aiohttp.ClientSession, url: str, **kwargs: object) -> tuple[int, str, str]:
    async with client.post(url, json=chat(stream=False), **kwargs) as resp:  # type: ignore[arg-type]
        body = await resp.read()
        code = {502: "upstream_unreachable", 504: "upstream_timeout"}[resp.status]
        return resp.status, code, assert_error(body, code)


@pytest.fixture
def relay_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.WARNING, logger="slotproxy.relay")
    return caplog


# --- end to end, on loopback -------------------------------------------------------------------------


async def test_a_refused_connection_is_named_with_host_and_port(start_proxy, client, relay_log) -> None:
    port = free_port()
    proxy = await start_proxy(one_provider(f"http://127.0.0.1:{port}/v1"))
    status, _, message = await post_error(client, f"{proxy.url}/openai/chat/completions?key=sk-secret-in-query",
                                          headers={"Authorization": "Bearer sk-client-secret"})
    assert status == 502
    assert message == f"provider 'openai': could not connect to 127.0.0.1:{port} (connection refused)"
    assert relay_lines(relay_log) == [
        f"provider=openai could not connect to 127.0.0.1:{port} (connection refused); answered 502 upstream_unreachable"
    ]
    assert "secret" not in relay_log.text and "/chat/completions" not in message
    assert proxy.status()["in_flight"] == 0


async def test_a_server_that_closes_without_answering(start_proxy, client, relay_log) -> None:
    async def close_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(close_at_once, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        proxy = await start_proxy(one_provider(f"http://127.0.0.1:{port}/v1"))
        status, _, message = await post_error(client, f"{proxy.url}/openai/chat/completions")
    finally:
        server.close()
    assert status == 502
    assert message == f"provider 'openai': upstream 127.0.0.1:{port} closed the connection before answering"
    assert relay_lines(relay_log) == [(f"provider=openai upstream 127.0.0.1:{port} closed the connection before "
                                       "answering; answered 502 upstream_unreachable")]


async def test_a_stream_cut_mid_way_is_logged_with_its_chunk_count(start_upstream, start_proxy, client,
                                                                   relay_log) -> None:
    """The client's answer had begun (200 and 19 chunks): its connection is cut, as before; the log says why."""
    upstream = await start_upstream(chunks=30, delay_ms=10)
    proxy = await start_proxy(one_provider(f"{upstream.url}/v1"))
    got = b""
    async with client.post(f"{proxy.url}/openai/chat/completions", json=chat(),
                           headers={"x-fake-reset-after": "19"}) as resp:
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            async for chunk in resp.content.iter_any():
                got += chunk
    assert got.count(b"data: ") == 19
    await wait_until(lambda: bool(relay_lines(relay_log)))
    assert relay_lines(relay_log) == [
        (f"provider=openai upstream 127.0.0.1:{upstream.port} closed the stream after 19 chunks (connection reset); "
         "the client's connection was cut (its answer had begun)")
    ]
    await wait_until(lambda: proxy.status()["in_flight"] == 0)


async def test_an_answer_cut_before_its_end_without_streaming(start_proxy, client, relay_log) -> None:
    """Headers came, then fewer bytes than Content-Length: nothing reached the client yet, so it gets a 502."""
    async def short(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"id\"")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(short, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        proxy = await start_proxy(one_provider(f"http://127.0.0.1:{port}/v1"))
        status, _, message = await post_error(client, f"{proxy.url}/openai/chat/completions")
    finally:
        server.close()
    assert (status, message) == (502, (f"provider 'openai': upstream 127.0.0.1:{port} closed the connection before "
                                       "its answer was complete"))


@pytest.fixture
async def self_signed_port(tmp_path: Path) -> AsyncIterator[int]:
    cert, key = _self_signed(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context).start()
    yield runner.addresses[0][1]
    await runner.cleanup()


async def test_a_self_signed_certificate_is_named_as_such(start_proxy, client, relay_log, self_signed_port) -> None:
    proxy = await start_proxy(one_provider(f"https://127.0.0.1:{self_signed_port}/v1"))
    status, _, message = await post_error(client, f"{proxy.url}/openai/chat/completions")
    assert status == 502
    assert message == (f"provider 'openai': TLS certificate for 127.0.0.1:{self_signed_port} not valid "
                       "(self-signed certificate)")
    assert relay_lines(relay_log) == [(f"provider=openai TLS certificate for 127.0.0.1:{self_signed_port} not valid "
                                       "(self-signed certificate); answered 502 upstream_unreachable")]


async def test_https_to_a_plain_http_server_says_so(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream()
    proxy = await start_proxy(one_provider(f"https://127.0.0.1:{upstream.port}/v1"))
    status, _, message = await post_error(client, f"{proxy.url}/openai/chat/completions")
    assert (status, message) == (502, (f"provider 'openai': TLS handshake with 127.0.0.1:{upstream.port} failed "
                                       "(wrong version number: it may speak plain HTTP, try http://)"))


async def test_no_response_headers_within_idle_timeout(start_upstream, start_proxy, client, relay_log) -> None:
    upstream = await start_upstream()
    proxy = await start_proxy(one_provider(f"{upstream.url}/v1", idle_timeout="200ms"))
    status, _, message = await post_error(client, f"{proxy.url}/openai/chat/completions",
                                          headers={"x-fake-stall-ms": "1000"})
    assert status == 504
    assert message == (f"provider 'openai': upstream 127.0.0.1:{upstream.port} sent no response headers within "
                       "idle_timeout (200ms)")
    assert relay_lines(relay_log) == [(f"provider=openai upstream 127.0.0.1:{upstream.port} sent no response "
                                       "headers within idle_timeout (200ms); answered 504 upstream_timeout")]


async def test_a_stream_that_goes_quiet_mid_way(start_proxy, client, relay_log) -> None:
    done = asyncio.Event()

    async def three_then_silence(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for index in range(3):
            await response.write(f"data: {index}\n\n".encode())
            await asyncio.sleep(0.02)
        await done.wait()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", three_then_silence)
    runner, port = await serve_app(app)
    try:
        proxy = await start_proxy(one_provider(f"http://127.0.0.1:{port}/v1", idle_timeout="300ms"))
        async with client.post(f"{proxy.url}/openai/chat/completions", json=chat()) as resp:
            assert resp.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()
        await wait_until(lambda: bool(relay_lines(relay_log)))
    finally:
        done.set()
        await runner.cleanup()
    assert relay_lines(relay_log) == [
        (f"provider=openai upstream 127.0.0.1:{port} sent nothing for idle_timeout (300ms) after 3 chunks; "
         "the client's connection was cut (its answer had begun)")
    ]


async def test_a_websocket_upgrade_to_a_refused_port_says_why(start_proxy, client, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="slotproxy.websocket")
    port = free_port()
    proxy = await start_proxy(one_provider(f"http://127.0.0.1:{port}/v1"))
    code, body = await upgrade(client, f"{proxy.url}/openai/responses")
    assert (code, body["error"]["code"]) == (426, "websocket_unsupported")
    assert body["error"]["message"] == (f"provider 'openai': could not connect to 127.0.0.1:{port} (connection "
                                        "refused); the upstream could not be reached for a WebSocket upgrade: use HTTP")
    lines = [r.getMessage() for r in caplog.records if r.name == "slotproxy.websocket"]
    assert lines == [(f"provider=openai could not connect to 127.0.0.1:{port} (connection refused); the WebSocket "
                      "upgrade was answered 426 (the client falls back to HTTP)")]


# --- the translator, for what loopback cannot show -------------------------------------------------


def _key(host: str, port: int, ssl_: bool = True) -> ConnectionKey:
    return ConnectionKey(host, port, ssl_, ssl_, None, None, None)


def test_a_name_that_does_not_resolve() -> None:
    exc = aiohttp.ClientConnectorDNSError(_key("api.openai.com", 443),
                                          socket.gaierror(socket.EAI_NONAME, "Name or service not known"))
    assert upstream_errors.before_answer(exc, "api.openai.com", 443) == "could not resolve api.openai.com (name not known)"
    again = aiohttp.ClientConnectorDNSError(_key("api.openai.com", 443),
                                            socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"))
    assert upstream_errors.before_answer(again, "api.openai.com", 443) == \
        "could not resolve api.openai.com (temporary failure in name resolution)"


def test_connect_failures_in_words() -> None:
    refused = aiohttp.ClientConnectorError(_key("api.openai.com", 443),
                                           ConnectionRefusedError(111, "Connect call failed ('1.2.3.4', 443)"))
    assert upstream_errors.before_answer(refused, "api.openai.com", 443) == \
        "could not connect to api.openai.com:443 (connection refused)"
    several = aiohttp.ClientConnectorError(_key("api.openai.com", 443), OSError(
        "Multiple exceptions: [Errno 111] Connect call failed ('::1', 443, 0, 0), "
        "[Errno 101] Network is unreachable"))
    assert upstream_errors.before_answer(several, "api.openai.com", 443) == \
        "could not connect to api.openai.com:443 (connection refused, network unreachable)"
    assert upstream_errors.connect_timed_out("api.openai.com", 443, 10) == \
        "could not connect to api.openai.com:443 within connect_timeout (10s)"
    assert upstream_errors.before_answer(aiohttp.ServerDisconnectedError(), "::1", 8443) == \
        "upstream [::1]:8443 closed the connection before answering"


def test_certificate_failures_in_words() -> None:
    error = ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: "
                                            "certificate has expired (_ssl.c:1006)")
    error.verify_message = "certificate has expired"
    exc = aiohttp.ClientConnectorCertificateError(_key("api.anthropic.com", 443), error)
    assert upstream_errors.before_answer(exc, "api.anthropic.com", 443) == \
        "TLS certificate for api.anthropic.com:443 not valid (certificate has expired)"


def test_cut_streams_and_timeouts_in_words() -> None:
    reset = aiohttp.ClientPayloadError("Response payload is not completed: <TransferEncodingError: 400, "
                                       "message='Not enough data'>. ConnectionResetError(104, 'Connection reset')")
    assert upstream_errors.broke_off(reset, "api.openai.com", 443, 19) == \
        "upstream api.openai.com:443 closed the stream after 19 chunks (connection reset)"
    closed = aiohttp.ClientPayloadError("Response payload is not completed")
    assert upstream_errors.broke_off(closed, "api.openai.com", 443, 1) == \
        "upstream api.openai.com:443 closed the stream after 1 chunk"
    assert upstream_errors.idle("api.openai.com", 443, 60, None, headers_seen=False) == \
        "upstream api.openai.com:443 sent no response headers within idle_timeout (1m)"
    assert upstream_errors.idle("api.openai.com", 443, 120, 0, headers_seen=True) == \
        "upstream api.openai.com:443 sent nothing for idle_timeout (2m) after its response headers"
    assert upstream_errors.slot_timed_out("api.openai.com", 443, 900) == \
        "upstream api.openai.com:443 did not finish its answer within slot_timeout (15m)"


def test_the_one_form_with_the_provider_and_no_class_names() -> None:
    words = upstream_errors.before_answer(
        aiohttp.ClientConnectorError(_key("api.openai.com", 443), ConnectionRefusedError(111, "x")),
        "api.openai.com", 443)
    message = upstream_errors.for_provider("openai", words)
    assert message == "provider 'openai': could not connect to api.openai.com:443 (connection refused)"
    assert UpstreamUnreachable(message).body()["error"]["code"] == "upstream_unreachable"
    assert UpstreamTimeout(message).status == 504
    samples = [
        message,
        upstream_errors.before_answer(aiohttp.ClientOSError(104, "Connection reset by peer"), "h", 1),
        upstream_errors.before_answer(aiohttp.ClientResponseError(None, (), status=400,  # type: ignore[arg-type]
                                                                  message="Bad status line:\n  junk"), "h", 1),
        upstream_errors.before_answer(RuntimeError("ClientSomethingError"), "h", 1),
        upstream_errors.broke_off(aiohttp.ServerDisconnectedError(), "h", 1, None),
    ]
    assert samples[1:] == [
        "upstream h:1 reset the connection before answering",
        "upstream h:1 sent an answer that is not valid HTTP (bad status line)",
        "the connection to upstream h:1 failed before an answer",
        "upstream h:1 closed the connection before its answer was complete",
    ]
    for sample in samples:
        assert not any(name in sample for name in CLASS_NAMES), sample
