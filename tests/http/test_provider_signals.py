"""Every provider signal real agents see, end to end through the relay (SPEC part two).

A small upstream of the test's own sends exactly the bytes each case needs
(compressed event streams, a Responses-API ``response.failed``, billing and
spend refusals) and counts what it receives. The fake provider's own tests
cover its side; the signal parsing itself is tabled in ``tests/providers/test_signals.py``.
"""

from __future__ import annotations

import asyncio
import json
import time
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import brotli
import pytest
from aiohttp import web
from backports import zstd

from ..conftest import Proxy, chat, serve_app, wait_until

RATE_LIMIT_EVENT = (b'event: error\ndata: {"type": "error", "error": {"type": "rate_limit_error", '
                    b'"message": "Number of request tokens has exceeded your per-minute rate limit"}}\n\n')
RESPONSE_FAILED = b"event: response.failed\ndata: " + json.dumps({
    "type": "response.failed", "sequence_number": 3,
    "response": {"id": "resp_1", "object": "response", "status": "failed", "error": {
        "code": "rate_limit_exceeded",
        "message": "Rate limit reached for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, "
                   "Used 30000, Requested 1200. Please try again in 6.379s."}}}).encode() + b"\n\n"
DELTAS = [b'event: content_block_delta\ndata: {"type": "content_block_delta", "index": 0, '
          b'"delta": {"type": "text_delta", "text": "piece %d"}}\n\n' % n for n in range(3)]


def _compressor(encoding: str) -> tuple[Callable[[bytes], bytes], Callable[[], bytes]]:
    """One compressor for the whole stream, flushed after each event, as a streaming server does."""
    if encoding == "gzip":
        gz = zlib.compressobj(wbits=31)
        return gz.compress, lambda: gz.flush(zlib.Z_SYNC_FLUSH)
    if encoding == "deflate":
        df = zlib.compressobj(wbits=15)
        return df.compress, lambda: df.flush(zlib.Z_SYNC_FLUSH)
    if encoding == "br":
        br = brotli.Compressor()
        return br.process, br.flush
    zs = zstd.ZstdCompressor()
    return zs.compress, lambda: zs.flush(zstd.ZstdCompressor.FLUSH_BLOCK)


@dataclass
class Upstream:
    """Answers each model request with the next scripted reply; counts what reaches it."""

    replies: list[Callable[[web.Request], Any]] = field(default_factory=list)
    seen: list[dict[str, str]] = field(default_factory=list)
    sent: list[bytes] = field(default_factory=list)
    url: str = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.seen.append({k.lower(): v for k, v in request.headers.items()})
        reply = self.replies[min(len(self.seen), len(self.replies)) - 1]
        result: web.StreamResponse = await reply(request)
        return result

    async def stream(self, request: web.Request, events: list[bytes], encoding: str | None = None
                     ) -> web.StreamResponse:
        headers = {"Content-Type": "text/event-stream"}
        if encoding:
            headers["Content-Encoding"] = encoding
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        compress, flush = _compressor(encoding) if encoding else (lambda b: b, lambda: b"")
        for event in events:
            data = compress(event) + flush()
            self.sent.append(data)
            await response.write(data)
            await asyncio.sleep(0.005)
        await response.write_eof()
        return response


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", up.handle)
    runner, port = await serve_app(app)
    up.url = f"http://127.0.0.1:{port}"
    yield up
    await runner.cleanup()


async def proxy_for(start_proxy, upstream: Upstream, **settings: Any) -> Proxy:
    lines = "".join(f"    {key}: {value}\n" for key, value in settings.items())
    proxy: Proxy = await start_proxy(f"state: {{path: null}}\nproviders:\n  p:\n    upstream: {upstream.url}/v1\n"
                                     f"{lines}")
    return proxy


def json_reply(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> Callable[..., Any]:
    async def reply(request: web.Request) -> web.Response:
        return web.json_response(body, status=status, headers=headers)
    return reply


def held_until(gate: asyncio.Event) -> Callable[..., Any]:
    """A reply that holds its request (and so its slot) until the test opens the gate."""
    async def reply(request: web.Request) -> web.Response:
        await gate.wait()
        return web.json_response({"ok": True})
    return reply


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "zstd"])
async def test_a_compressed_stream_arrives_byte_identical_and_its_error_still_backs_off(
        start_proxy, upstream: Upstream, client: aiohttp.ClientSession, encoding: str) -> None:
    async def reply(request: web.Request) -> web.StreamResponse:
        return await upstream.stream(request, [*DELTAS, RATE_LIMIT_EVENT], encoding)

    upstream.replies = [reply]
    proxy = await proxy_for(start_proxy, upstream, limit=4, default_pause="300ms")
    async with client.post(f"{proxy.url}/p/messages", json=chat(),
                           headers={"Accept-Encoding": "gzip, deflate, br, zstd"}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Encoding"] == encoding
        received = await resp.read()
    assert received == b"".join(upstream.sent), "the client gets the upstream's bytes unchanged"
    status = proxy.status("p")
    assert (status["limit"], status["paused"]) == (3, True)
    assert status["notice"] == "Concurrency limit auto-reduced to 3 after a rate_limit_error — restore manually when ready."


async def test_a_stream_that_cannot_be_decoded_is_relayed_and_not_scanned(
        start_proxy, upstream: Upstream, client: aiohttp.ClientSession) -> None:
    async def reply(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Content-Encoding": "gzip"})
        await response.prepare(request)
        await response.write(b"not gzip at all " + RATE_LIMIT_EVENT)
        await response.write_eof()
        return response

    upstream.replies = [reply]
    proxy = await proxy_for(start_proxy, upstream, limit=4)
    async with client.post(f"{proxy.url}/p/messages", json=chat()) as resp:
        assert resp.status == 200
        assert (await resp.read()).startswith(b"not gzip at all")
    assert (proxy.status("p")["limit"], proxy.status("p")["paused"]) == (4, False)


async def test_response_failed_in_a_responses_stream_reduces_and_waits_the_stated_time(
        start_proxy, upstream: Upstream, client: aiohttp.ClientSession) -> None:
    async def reply(request: web.Request) -> web.StreamResponse:
        return await upstream.stream(request, [b'event: response.created\ndata: {"type": "response.created"}\n\n',
                                               RESPONSE_FAILED])

    upstream.replies = [reply]
    proxy = await proxy_for(start_proxy, upstream, limit=4)
    async with client.post(f"{proxy.url}/p/responses", json={"model": "gpt-4o", "input": "hi", "stream": True}) as r:
        assert r.status == 200
        assert (await r.read()).endswith(RESPONSE_FAILED)
    status = proxy.status("p")
    assert (status["limit"], status["paused"]) == (3, True)
    assert 5500 < status["paused_until"] - int(time.time() * 1000) <= 6400  # "try again in 6.379s"


async def test_an_in_stream_overload_pauses_without_lowering(
        start_proxy, upstream: Upstream, client: aiohttp.ClientSession) -> None:
    overloaded = (b'event: error\ndata: {"type": "error", "error": {"type": "overloaded_error", '
                  b'"message": "Overloaded"}}\n\n')

    async def reply(request: web.Request) -> web.StreamResponse:
        return await upstream.stream(request, [DELTAS[0], overloaded])

    upstream.replies = [reply]
    proxy = await proxy_for(start_proxy, upstream, limit=4, overload_pause="1s")
    async with client.post(f"{proxy.url}/p/messages", json=chat()) as resp:
        await resp.read()
    status = proxy.status("p")
    assert (status["limit"], status["paused"], status["notice"]) == (4, True, None)


@pytest.mark.parametrize(("status", "body"), [
    (400, {"type": "error", "error": {"type": "billing_error", "message": "Your credit balance is too low."}}),
    (429, {"type": "error", "error": {"type": "rate_limit_error", "message": "Spend limit reached.",
                                      "details": {"error_code": "enforced_spend_limit_reached"}}}),
    (429, {"error": {"message": "You exceeded your current quota.", "type": "insufficient_quota",
                     "code": "insufficient_quota"}}),
], ids=["anthropic-billing", "anthropic-spend-limit", "openai-insufficient-quota"])
async def test_billing_and_spend_refusals_are_relayed_once_without_pause(
        start_proxy, upstream: Upstream, client: aiohttp.ClientSession, status: int, body: dict[str, Any]) -> None:
    upstream.replies = [json_reply(status, body, {"retry-after": "30"})]
    proxy = await proxy_for(start_proxy, upstream, limit=4, retry_on_429=2, backoff_statuses="[400, 429]")
    async with client.post(f"{proxy.url}/p/messages", json=chat()) as resp:
        assert resp.status == status
        assert await resp.json() == body
    assert len(upstream.seen) == 1, "no retry: no wait will help"
    state = proxy.status("p")
    assert (state["paused"], state["limit"], state["auto_reduced"]) == (False, 4, False)


async def test_a_wait_stated_only_in_words_is_the_pause(
        start_proxy, upstream: Upstream, client: aiohttp.ClientSession) -> None:
    upstream.replies = [json_reply(429, {"error": {"message": "Rate limit reached for gpt-4o. Please try again in "
                                                   "2.5s.", "type": "requests", "code": "rate_limit_exceeded"}})]
    proxy = await proxy_for(start_proxy, upstream, limit=4, retry_on_429=0, default_pause="60s")
    async with client.post(f"{proxy.url}/p/chat/completions", json=chat()) as resp:
        assert resp.status == 429
    paused_for = proxy.status("p")["paused_until"] - int(time.time() * 1000)
    assert 2000 < paused_for <= 2550


async def test_codex_turn_metadata_orders_the_queue_oldest_turn_first(
        start_proxy, upstream: Upstream, client: aiohttp.ClientSession) -> None:
    gate = asyncio.Event()
    held = held_until(gate)
    upstream.replies = [held, json_reply(200, {"ok": True})]
    proxy = await proxy_for(start_proxy, upstream, limit=1)
    url = f"{proxy.url}/p/responses"
    now_ms = int(time.time() * 1000)
    order: list[str] = []

    async def turn(name: str, started_ms: int | None) -> None:
        headers = {"session-id": f"session-{name}", "originator": "codex_exec"}
        if started_ms is not None:
            headers["x-codex-turn-metadata"] = json.dumps({"turn_id": name, "turn_started_at_unix_ms": started_ms})
        async with client.post(url, json={"model": "gpt-5-codex", "input": name}, headers=headers) as resp:
            assert resp.status == 200
            order.append(name)

    first = asyncio.create_task(turn("holder", now_ms))
    await wait_until(lambda: proxy.status("p")["in_flight"] == 1, what="the holder in flight")
    tasks = []
    for name, started in (("new", now_ms - 1_000), ("no-metadata", None), ("old", now_ms - 600_000)):
        tasks.append(asyncio.create_task(turn(name, started)))
        await wait_until(lambda: proxy.status("p")["queued"] == len(tasks), what=f"{name} queued")
    queue = proxy.status("p")["queue"]
    assert [w["conversation"] for w in queue] == ["session-old", "session-new", "session-no-metadata"]
    gate.set()
    await asyncio.gather(first, *tasks)
    assert order == ["holder", "old", "new", "no-metadata"]
    assert all("x-codex-turn-metadata" in seen for seen in upstream.seen[1:3]), "forwarded unchanged"


async def test_the_clients_own_deadline_gets_a_clean_503_before_it_gives_up(
        start_proxy, upstream: Upstream, client: aiohttp.ClientSession) -> None:
    gate = asyncio.Event()
    held = held_until(gate)
    upstream.replies = [held]
    proxy = await proxy_for(start_proxy, upstream, limit=1, queue_timeout="10m")
    holder = asyncio.create_task(client.post(f"{proxy.url}/p/messages", json=chat()))
    await wait_until(lambda: proxy.status("p")["in_flight"] == 1, what="the holder in flight")
    started = time.monotonic()
    async with client.post(f"{proxy.url}/p/messages", json=chat(),
                           headers={"X-Stainless-Timeout": "5.6", "X-Stainless-Retry-Count": "0"}) as resp:
        waited = time.monotonic() - started
        assert resp.status == 503
        body = await resp.json()
        assert resp.headers["Retry-After"] == "1"
    assert body["error"]["code"] == "queue_timeout"
    assert "X-Stainless-Timeout" in body["error"]["message"]
    assert 0.4 <= waited < 3.0, waited  # 5.6 s less the 5 s margin
    assert proxy.status("p")["rejected"]["queue_timeout"] == 1
    with pytest.raises(TimeoutError):  # no usable deadline: it waits, as long as queue_timeout allows
        await client.post(f"{proxy.url}/p/messages", json=chat(), headers={"X-Stainless-Timeout": "NOT_GIVEN"},
                          timeout=aiohttp.ClientTimeout(total=0.8))
    gate.set()
    async with await holder as resp:
        assert resp.status == 200
