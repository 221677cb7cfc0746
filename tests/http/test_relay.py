"""The relay end to end: a real proxy in front of a real fake provider, over loopback HTTP."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import time

import openai
import pytest
from aiohttp import web

from proxy.admin.status import status_document

from ..conftest import chat, provider_yaml, serve_app, wait_until

pytestmark = pytest.mark.asyncio


async def test_openai_sdk_non_streaming_and_streaming(start_upstream, start_proxy) -> None:
    upstream = await start_upstream(chunks=10, delay_ms=50)
    proxy = await start_proxy(provider_yaml(upstream, limit=2))
    sdk = openai.AsyncOpenAI(base_url=f"{proxy.url}/openai", api_key="client-key", max_retries=0)
    answer = await sdk.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content

    started = time.monotonic()
    stream = await sdk.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    arrivals: list[float] = []
    text = []
    async for chunk in stream:
        arrivals.append(time.monotonic() - started)
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
    await sdk.close()
    assert len(text) == 10
    # The upstream writes its last content chunk ~450 ms after its first; the first
    # must reach the client long before that (no buffering anywhere).
    assert arrivals[0] < arrivals[-1] - 0.3, arrivals
    assert proxy.status()["in_flight"] == 0


async def test_twenty_streams_never_exceed_the_upstream_cap(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream(cap=3, chunks=5, delay_ms=20)
    proxy = await start_proxy(provider_yaml(upstream, limit=3))

    async def one(i: int) -> tuple[int, bytes]:
        async with client.post(f"{proxy.url}/openai/chat/completions", json=chat(user=f"u{i}")) as resp:
            return resp.status, await resp.read()

    results = await asyncio.gather(*(one(i) for i in range(20)))
    assert all(status == 200 and body.endswith(b"data: [DONE]\n\n") for status, body in results)
    stats = upstream.fake.stats()
    assert stats["max_concurrency"] == 3
    assert stats["rate_limited"] == 0
    status = proxy.status()
    assert (status["in_flight"], status["queued"]) == (0, 0)


async def test_queued_requests_reach_upstream_starred_then_oldest_then_newest(
    start_upstream, start_proxy, client
) -> None:
    upstream = await start_upstream(chunks=1, delay_ms=1)
    proxy = await start_proxy(provider_yaml(upstream, limit=1))
    url = f"{proxy.url}/openai/chat/completions"
    now_ms = int(time.time() * 1000)
    holder = asyncio.create_task(client.post(url, json=chat(), headers={"x-fake-stall-ms": "400", "x-fake-tag": "holder"}))
    await wait_until(lambda: proxy.status()["in_flight"] == 1, what="holder admitted")
    waiters = [
        ("new", {"X-Prompt-Started-At": str(now_ms)}),
        ("old", {"X-Prompt-Started-At": str(now_ms - 600_000)}),
        ("starred", {"X-Prompt-Started-At": str(now_ms), "X-Workspace-Starred": "true"}),
    ]
    tasks = []
    for tag, headers in waiters:
        tasks.append(asyncio.create_task(client.post(url, json=chat(), headers={**headers, "x-fake-tag": tag})))
        count = len(tasks)
        await wait_until(lambda n=count: proxy.status()["queued"] == n, what=f"{tag} queued")
    for response in await asyncio.gather(holder, *tasks):
        assert response.status == 200
        await response.read()
        response.release()
    assert [a["tag"] for a in upstream.fake.stats()["arrivals"]] == ["holder", "starred", "old", "new"]


async def test_gzip_body_reaches_the_client_byte_identical(start_proxy, client) -> None:
    payload = gzip.compress(json.dumps({"object": "chat.completion", "pad": "x" * 5000}).encode(), mtime=0)

    async def gzipped(request: web.Request) -> web.StreamResponse:
        if request.query.get("chunked"):
            response = web.StreamResponse(headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
            await response.prepare(request)
            for i in range(0, len(payload), 97):
                await response.write(payload[i:i + 97])
            await response.write_eof()
            return response
        return web.Response(body=payload, headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", gzipped)
    runner, port = await serve_app(app)
    try:
        proxy = await start_proxy(f"state: {{path: null}}\nproviders:\n  openai: {{upstream: 'http://127.0.0.1:{port}/v1', limit: 1}}\n")
        for query, length in (("", str(len(payload))), ("?chunked=1", None)):
            async with client.post(f"{proxy.url}/openai/chat/completions{query}", json=chat(stream=False),
                                   headers={"Accept-Encoding": "gzip"}) as via:
                assert await via.read() == payload
                assert via.headers["Content-Encoding"] == "gzip"
                assert via.headers.get("Content-Length") == length
    finally:
        await runner.cleanup()


async def test_priority_headers_stripped_and_provider_key_replaces_client_auth(
    start_upstream, start_proxy, client, monkeypatch, caplog
) -> None:
    caplog.set_level(logging.DEBUG)
    secret = "sk-provider-secret-0123456789"
    monkeypatch.setenv("FAKE_PROVIDER_KEY", secret)
    upstream = await start_upstream()
    proxy = await start_proxy(provider_yaml(upstream, limit=2, api_key_env="FAKE_PROVIDER_KEY"))
    headers = {
        "Authorization": "Bearer client-own-key",
        "X-Workspace-Id": "ws1",
        "X-Workspace-Starred": "yes",
        "X-Prompt-Started-At": "2026-01-01T00:00:00Z",
        "X-Conversation-Id": "conv-7",
        "X-Custom": "kept",
    }
    async with client.post(f"{proxy.url}/openai/chat/completions", json=chat(), headers=headers) as resp:
        assert resp.status == 200
        assert "X-Slotproxy-Queue-Ms" in resp.headers
        await resp.read()
    seen = upstream.fake.stats()["last_headers"]
    assert seen["authorization"] == f"Bearer {secret}"
    assert seen["x-custom"] == "kept"
    for name in ("x-workspace-id", "x-workspace-starred", "x-prompt-started-at", "x-conversation-id"):
        assert name not in seen
    status_text = json.dumps(status_document(proxy.state))
    metrics_text = proxy.state.metrics.render().decode()
    for text in (caplog.text, status_text, metrics_text):
        assert secret not in text


@pytest.mark.parametrize("sent", [
    [],
    [("User-Agent", "agent/1.0"), ("Accept", "text/event-stream"), ("Accept-Encoding", "identity"),
     ("Content-Type", "application/json")],
])
async def test_upstream_gets_the_clients_headers_and_none_of_the_http_clients_own(start_proxy, sent) -> None:
    """No Accept, Accept-Encoding, User-Agent or Content-Type of aiohttp's is added on the way up; the
    client's own go through as sent."""
    seen: list[list[tuple[str, str]]] = []

    async def record(request: web.Request) -> web.Response:
        seen.append([(name.decode(), value.decode()) for name, value in request.raw_headers])
        return web.json_response({"object": "chat.completion"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", record)
    runner, port = await serve_app(app)
    try:
        proxy = await start_proxy(f"state: {{path: null}}\nproviders:\n  openai: {{upstream: 'http://127.0.0.1:{port}/v1'}}\n")
        body = b'{"model": "fake"}'
        lines = ["POST /openai/chat/completions HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(body)}",
                 "Connection: close", *(f"{name}: {value}" for name, value in sent)]
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write("\r\n".join(lines).encode() + b"\r\n\r\n" + body)
        answer = await reader.read()
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200"), answer
    finally:
        await runner.cleanup()
    names = {name.lower(): value for name, value in seen[0]}
    assert set(names) == {"host", "content-length"} | {name.lower() for name, _ in sent}, seen
    assert all(names[name.lower()] == value for name, value in sent)


async def _read_answer(reader: asyncio.StreamReader) -> tuple[str, dict[str, str], bytes]:
    """One answer off a client connection: status line, headers (lower-cased names), body by Content-Length."""
    head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).decode()
    status_line, *lines = head.split("\r\n")[:-2]
    headers = {name.lower(): value for name, _, value in (line.partition(": ") for line in lines)}
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", "0"))), 5)
    return status_line, headers, body


@pytest.mark.parametrize(("version", "connection", "answered", "kept"), [
    ("1.1", None, None, True),
    ("1.1", "close", "close", False),
    ("1.0", None, None, False),
    ("1.0", "keep-alive", "keep-alive", True),
])
async def test_a_whole_answer_keeps_or_closes_the_connection_as_http_says(
    start_proxy, version, connection, answered, kept
) -> None:
    """Small answers are written whole by slotproxy itself: framing, Date and keep-alive as aiohttp would do them."""
    async def answer(request: web.Request) -> web.Response:
        return web.Response(body=b'{"object": "chat.completion"}', content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/{name}", answer)
    runner, port = await serve_app(app)
    try:
        proxy = await start_proxy(f"state: {{path: null}}\nproviders:\n  openai: {{upstream: 'http://127.0.0.1:{port}/v1'}}\n")
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        extra = f"Connection: {connection}\r\n" if connection else ""
        for _ in range(2 if kept else 1):
            writer.write(f"POST /openai/chat HTTP/{version}\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n{extra}\r\n{{}}".encode())
            status_line, headers, body = await _read_answer(reader)
            assert status_line == f"HTTP/{version} 200 OK"
            assert body == b'{"object": "chat.completion"}'
            assert headers["content-type"] == "application/json"
            assert headers.get("connection") == answered, headers
            assert headers["x-slotproxy-queue-ms"] == "0"
            assert headers["date"].endswith(" GMT")
        if not kept:
            assert await asyncio.wait_for(reader.read(), 5) == b"", "the connection should have been closed"
        writer.close()
        await writer.wait_closed()
    finally:
        await runner.cleanup()


async def test_upstream_answers_without_a_body_keep_the_connection_framed(start_proxy) -> None:
    """204 and 304 carry no body and HEAD's answer none: they leave through aiohttp's own response, and the
    next request on the connection still gets its answer."""
    async def answer(request: web.Request) -> web.Response:
        status = int(request.match_info["status"])
        return web.Response(status=status, headers={"Content-Length": "0"} if status == 200 else None)

    app = web.Application()
    app.router.add_route("*", "/v1/{status}", answer)
    runner, port = await serve_app(app)
    try:
        proxy = await start_proxy(f"state: {{path: null}}\nproviders:\n  openai: {{upstream: 'http://127.0.0.1:{port}/v1'}}\n")
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        for method, status in (("POST", 204), ("GET", 304), ("HEAD", 200), ("POST", 200)):
            writer.write(f"{method} /openai/{status} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n".encode())
            head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).decode()
            assert head.startswith(f"HTTP/1.1 {status} "), head
        writer.close()
        await writer.wait_closed()
    finally:
        await runner.cleanup()


async def test_x_api_key_auth_replaces_both_client_credentials(start_upstream, start_proxy, client, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_ANTHROPIC_KEY", "sk-ant-secret-abcdef")
    upstream = await start_upstream()
    proxy = await start_proxy(provider_yaml(upstream, limit=2, auth="x-api-key", api_key_env="FAKE_ANTHROPIC_KEY"))
    headers = {"Authorization": "Bearer mine", "x-api-key": "mine-too"}
    async with client.post(f"{proxy.url}/openai/chat/completions", json=chat(stream=False), headers=headers) as resp:
        assert resp.status == 200
    seen = upstream.fake.stats()["last_headers"]
    assert seen["x-api-key"] == "sk-ant-secret-abcdef"
    assert "authorization" not in seen


async def test_unset_key_env_forwards_the_clients_own_authorization(start_upstream, start_proxy, client, monkeypatch) -> None:
    monkeypatch.delenv("UNSET_PROVIDER_KEY", raising=False)
    upstream = await start_upstream()
    proxy = await start_proxy(provider_yaml(upstream, limit=2, api_key_env="UNSET_PROVIDER_KEY"))
    async with client.post(f"{proxy.url}/openai/chat/completions", json=chat(stream=False),
                           headers={"Authorization": "Bearer client-own"}) as resp:
        assert resp.status == 200
    assert upstream.fake.stats()["last_headers"]["authorization"] == "Bearer client-own"


@pytest.mark.parametrize(
    ("header", "value", "metric_label"),
    [
        ("X-Workspace-Starred", "maybe", "starred"),
        ("X-Prompt-Started-At", "yesterday", "prompt_started_at"),
        ("X-Prompt-Started-At", "99999999999999", "prompt_started_at"),
        ("X-Prompt-Started-At", "1700000000", "prompt_started_at"),
        ("X-Workspace-Id", "x" * 300, "workspace"),
    ],
)
async def test_invalid_priority_header_falls_back_and_the_request_succeeds(
    start_upstream, start_proxy, client, header, value, metric_label
) -> None:
    upstream = await start_upstream()
    proxy = await start_proxy(provider_yaml(upstream, limit=2))
    async with client.post(f"{proxy.url}/openai/chat/completions", json=chat(), headers={header: value}) as resp:
        assert resp.status == 200
        await resp.read()
    metrics = proxy.state.metrics.render().decode()
    assert f'slotproxy_invalid_priority_headers_total{{header="{metric_label}"}} 1.0' in metrics


async def test_routing_keeps_path_and_query(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream()
    proxy = await start_proxy(provider_yaml(upstream, limit=2))
    async with client.get(f"{proxy.url}/openai/models?limit=5") as resp:
        assert resp.status == 200
        assert (await resp.json())["object"] == "list"
        assert resp.headers["X-Slotproxy-Queue-Ms"] == "0"


@pytest.mark.parametrize(
    ("path", "status", "code"),
    [
        ("/nope/chat/completions", 404, "unknown_provider"),
        ("/_slotproxy/chat", 404, None),
        ("/metrics/x", 404, "unknown_provider"),
        ("/openai/a/../../etc/passwd", 400, "bad_request"),
    ],
)
async def test_unroutable_paths_get_a_clear_error(start_upstream, start_proxy, path, status, code) -> None:
    upstream = await start_upstream()
    proxy = await start_proxy(provider_yaml(upstream, limit=2))
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode())
    raw = (await reader.read()).decode()
    writer.close()
    assert raw.startswith(f"HTTP/1.1 {status}"), raw
    if code:
        assert f'"code": "{code}"' in raw
    assert upstream.fake.stats()["requests"] == 0


@pytest.mark.parametrize(
    ("request_line", "status"),
    [
        ("GET http://127.0.0.1:1/openai/models HTTP/1.1", 400),
        ("CONNECT example.com:443 HTTP/1.1", 405),
    ],
)
async def test_never_an_open_proxy(start_upstream, start_proxy, request_line, status) -> None:
    upstream = await start_upstream()
    proxy = await start_proxy(provider_yaml(upstream, limit=2))
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(f"{request_line}\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
    raw = (await reader.read()).decode()
    writer.close()
    assert raw.startswith(f"HTTP/1.1 {status}"), raw
    assert upstream.fake.stats()["requests"] == 0


async def test_body_over_max_body_gets_413_and_takes_no_slot(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream()
    proxy = await start_proxy("server: {max_body: 1KiB}\n" + provider_yaml(upstream, limit=1))
    async with client.post(f"{proxy.url}/openai/chat/completions", data=b"x" * 4096) as resp:
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == "body_too_large"
    assert proxy.status()["in_flight"] == 0
    assert proxy.state.backend.provider_status("openai").counters["granted"] == 0


async def test_methods_outside_slot_methods_take_no_slot(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream(chunks=1, delay_ms=1)
    proxy = await start_proxy(provider_yaml(upstream, limit=1))
    url = f"{proxy.url}/openai/chat/completions"
    holder = asyncio.create_task(client.post(url, json=chat(), headers={"x-fake-stall-ms": "300"}))
    await wait_until(lambda: proxy.status()["in_flight"] == 1)
    async with client.get(f"{proxy.url}/openai/models") as resp:
        assert resp.status == 200
    assert proxy.status()["in_flight"] == 1
    (await holder).release()
