"""Spans and GenAI metrics as an OTLP/HTTP collector receives them, for each kind of request the proxy relays."""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import WSMsgType, web

from proxy.http.keys import QUEUE_MS_HEADER
from proxy.telemetry import names

from ..conftest import serve_app
from .conftest import Collector, SpanSeen, telemetry_yaml

pytestmark = pytest.mark.asyncio

PROMPT = "PROMPT-MARKER-do-not-export"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_PARENT = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_PARENT}-01"
USAGE = {"input": 40, "cached": 10, "cache_write": 6, "output": 9, "reasoning": 2}


def proxy_yaml(collector: Collector, upstream_url: str, provider: str = "openai", **settings: Any) -> str:
    lines = "".join(f"    {key}: {value}\n" for key, value in settings.items())
    return (f"state: {{path: null}}\n{telemetry_yaml(collector.url)}providers:\n  {provider}:\n"
            f"    upstream: {upstream_url}\n{lines}")


def strings_in(spans: list[SpanSeen]) -> list[str]:
    return [value for span in spans for value in span.attributes.values() if isinstance(value, str)]


def assert_no_content(collector: Collector, *texts: str) -> None:
    for value in strings_in(collector.spans):
        for text in texts:
            assert text not in value, f"{text!r} was exported in {value!r}"


def answer_text(body: bytes) -> str:
    """The text the answer streamed (its deltas), to look for in the spans."""
    text = []
    for line in body.decode().splitlines():
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[6:])
        for choice in event.get("choices") or ():
            text.append((choice.get("delta") or {}).get("content") or "")
        delta = event.get("delta") or {}
        text.append(delta.get("text") or "")
    return "".join(text)


def one(spans: list[SpanSeen]) -> SpanSeen:
    assert len(spans) == 1, [span.name for span in spans]
    return spans[0]


async def test_a_chat_stream_is_a_server_a_queue_and_a_client_span_with_the_genai_attributes(
        collector: Collector, start_upstream, start_proxy, client: aiohttp.ClientSession) -> None:
    up = await start_upstream(chunks=5, delay_ms=30)
    proxy = await start_proxy(proxy_yaml(collector, f"{up.url}/v1", limit=2))
    body = {"model": "fake", "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": PROMPT}]}
    headers = {"traceparent": TRACEPARENT, "X-Workspace-Id": "team-a", "X-Conversation-Id": "conv-1",
               "x-fake-usage": json.dumps(USAGE)}
    async with client.post(f"{proxy.url}/openai/chat/completions", json=body, headers=headers) as resp:
        assert resp.status == 200
        answer = await resp.read()
    read_at = time.time()
    await collector.wait_for_spans(3)
    server, queue, upstream = one(collector.kind("SERVER")), one(collector.named("slotproxy.queue")), \
        one(collector.kind("CLIENT"))
    assert {span.trace_id for span in (server, queue, upstream)} == {TRACE_ID}
    assert server.parent_id == CLIENT_PARENT
    assert queue.parent_id == upstream.parent_id == server.span_id
    assert server.name == "POST /openai"
    assert server.attributes[names.HTTP_STATUS] == 200
    assert (queue.kind, queue.attributes[names.WORKSPACE], queue.attributes[names.STARRED]) == \
        ("INTERNAL", "team-a", False)
    assert upstream.name == "chat fake"
    attributes = upstream.attributes
    assert {key: attributes.get(key) for key in (
        names.OPERATION, names.PROVIDER, names.REQUEST_MODEL, names.RESPONSE_MODEL, names.INPUT_TOKENS,
        names.OUTPUT_TOKENS, names.CACHE_READ, names.CACHE_CREATION, names.CONVERSATION, names.SERVER_ADDRESS,
        names.SERVER_PORT)} == {
        names.OPERATION: "chat", names.PROVIDER: "openai", names.REQUEST_MODEL: "fake",
        names.RESPONSE_MODEL: "fake", names.INPUT_TOKENS: 40, names.OUTPUT_TOKENS: 9, names.CACHE_READ: 10,
        names.CACHE_CREATION: 0, names.CONVERSATION: "conv-1", names.SERVER_ADDRESS: "127.0.0.1",
        names.SERVER_PORT: up.port}
    assert names.ERROR_TYPE not in attributes
    # The CLIENT span lasts until the last byte reached the client: the whole stream (5 chunks 30 ms apart).
    assert upstream.duration >= 0.12
    assert upstream.end <= read_at + 0.05
    assert up.fake.last_headers["traceparent"] == f"00-{TRACE_ID}-{upstream.span_id}-01"
    assert_no_content(collector, PROMPT, answer_text(answer))
    assert collector.resources[0]["service.name"] == "slotproxy"

    await collector.wait_for_metric(names.TOKEN_USAGE)
    await collector.wait_for_metric(names.OPERATION_DURATION)
    await collector.wait_for_metric(names.QUEUE_TIME)
    await collector.wait_for_metric("slotproxy.slots.in_flight")
    tokens = collector.metric(names.TOKEN_USAGE)
    assert {point.attributes[names.TOKEN_TYPE] for point in tokens} == {"input", "output"}
    assert {point.unit for point in tokens} == {"{token}"}
    assert tokens[0].bounds == tuple(float(bound) for bound in names.TOKEN_BUCKETS)
    duration = collector.metric(names.OPERATION_DURATION)[0]
    assert (duration.unit, duration.bounds, duration.attributes[names.PROVIDER]) == \
        ("s", names.DURATION_BUCKETS, "openai")
    assert collector.metric(names.QUEUE_TIME)[0].unit == "s"
    for point in collector.points:
        assert not {names.WORKSPACE, names.CONVERSATION} & set(point.attributes), point


async def test_an_anthropic_stream_names_its_provider_and_its_cache_tokens(
        collector: Collector, start_upstream, start_proxy, client: aiohttp.ClientSession) -> None:
    up = await start_upstream(chunks=3)
    proxy = await start_proxy(proxy_yaml(collector, up.url, provider="anthropic", auth="x-api-key"))
    body = {"model": "claude-sonnet-4-5", "stream": True, "max_tokens": 64,
            "messages": [{"role": "user", "content": PROMPT}]}
    async with client.post(f"{proxy.url}/anthropic/v1/messages", json=body,
                           headers={"x-fake-usage": json.dumps(USAGE)}) as resp:
        assert resp.status == 200
        answer = await resp.read()
    await collector.wait_for_spans(3)
    upstream = one(collector.kind("CLIENT"))
    assert upstream.name == "chat claude-sonnet-4-5"
    assert {key: upstream.attributes.get(key) for key in (
        names.PROVIDER, names.REQUEST_MODEL, names.RESPONSE_MODEL, names.INPUT_TOKENS, names.OUTPUT_TOKENS,
        names.CACHE_READ, names.CACHE_CREATION)} == {
        names.PROVIDER: "anthropic", names.REQUEST_MODEL: "claude-sonnet-4-5", names.RESPONSE_MODEL: "claude-sonnet-4-5",
        names.INPUT_TOKENS: 40, names.OUTPUT_TOKENS: 9, names.CACHE_READ: 10, names.CACHE_CREATION: 6}
    assert_no_content(collector, PROMPT, answer_text(answer))


async def test_each_websocket_response_is_a_client_span_under_the_sockets_server_span(
        collector: Collector, start_upstream, start_proxy, client: aiohttp.ClientSession) -> None:
    up = await start_upstream(chunks=3, websocket=True)
    proxy = await start_proxy(proxy_yaml(collector, f"{up.url}/v1"))
    async with client.ws_connect(f"{proxy.url}/openai/responses", headers={"traceparent": TRACEPARENT}) as ws:
        for turn in range(2):
            await ws.send_str(json.dumps({"type": "response.create", "model": "gpt-5",
                                          "input": [{"role": "user", "content": f"{PROMPT}-{turn}"}],
                                          "x_fake": {"usage": USAGE}}))
            while True:
                message = await ws.receive(timeout=10)
                assert message.type is WSMsgType.TEXT
                if json.loads(message.data)["type"] in ("response.completed", "error"):
                    break
    await collector.wait_for_spans(5)
    server = one(collector.kind("SERVER"))
    clients = collector.kind("CLIENT")
    assert (server.name, server.parent_id, server.trace_id) == ("GET /openai", CLIENT_PARENT, TRACE_ID)
    assert len(clients) == 2 and len(collector.named("slotproxy.queue")) == 2
    for span in clients:
        assert (span.name, span.parent_id) == ("chat gpt-5", server.span_id)
        assert (span.attributes[names.INPUT_TOKENS], span.attributes[names.OUTPUT_TOKENS]) == (40, 9)
        assert span.attributes[names.RESPONSE_MODEL] == "gpt-5"
    assert_no_content(collector, PROMPT)


async def test_a_queued_request_has_a_queue_span_as_long_as_its_wait_naming_what_held_it_and_its_star(
        collector: Collector, start_upstream, start_proxy, client: aiohttp.ClientSession, backend_yaml: str) -> None:
    up = await start_upstream(chunks=4, delay_ms=80)
    proxy = await start_proxy(backend_yaml + "workspaces: {starred: [second]}\n" +
                              proxy_yaml(collector, f"{up.url}/v1", limit=1))
    body = {"model": "fake", "stream": True, "messages": [{"role": "user", "content": "hi"}]}

    async def ask(workspace: str) -> int:
        async with client.post(f"{proxy.url}/openai/chat/completions", json=body,
                               headers={"X-Workspace-Id": workspace}) as resp:
            await resp.read()
            return int(resp.headers[QUEUE_MS_HEADER])

    first = asyncio.ensure_future(ask("first"))
    await asyncio.sleep(0.1)
    waited_ms = await ask("second")
    await first
    await collector.wait_for_spans(6)
    queued = [span for span in collector.named("slotproxy.queue") if span.attributes[names.WORKSPACE] == "second"]
    span = one(queued)
    assert waited_ms >= 150
    assert abs(span.duration - waited_ms / 1000) < 0.03
    assert span.attributes[names.HELD_BY] == "provider limit"
    assert span.attributes[names.STARRED] is True  # starred by the config, not by a header: on either backend
    first_span = one([span for span in collector.named("slotproxy.queue")
                      if span.attributes[names.WORKSPACE] == "first"])
    assert first_span.attributes[names.STARRED] is False
    await collector.wait_for_metric(names.QUEUE_TIME)


async def test_a_429_retried_by_the_proxy_is_two_client_spans_the_first_an_error(
        collector: Collector, start_proxy, client: aiohttp.ClientSession) -> None:
    seen: list[str] = []

    async def answer(request: web.Request) -> web.StreamResponse:
        await request.read()
        seen.append(request.headers["traceparent"])
        if len(seen) == 1:
            return web.json_response({"error": {"message": "Rate limit reached", "type": "requests",
                                                "code": "rate_limit_exceeded"}}, status=429,
                                     headers={"retry-after-ms": "50"})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"id":"c","model":"gpt-4o-2024-08-06","choices":[{"delta":{"content":"ok"}}],'
                             b'"usage":{"prompt_tokens":12,"completion_tokens":3}}\n\ndata: [DONE]\n\n')
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner, port = await serve_app(app)
    try:
        proxy = await start_proxy(proxy_yaml(collector, f"http://127.0.0.1:{port}/v1", limit=4, retry_on_429=1))
        async with client.post(f"{proxy.url}/openai/chat/completions",
                               json={"model": "gpt-4o", "stream": True, "messages": []}) as resp:
            assert resp.status == 200
            await resp.read()
        await collector.wait_for_spans(5)
    finally:
        await runner.cleanup()
    server = one(collector.kind("SERVER"))
    first, second = sorted(collector.kind("CLIENT"), key=lambda span: span.start)
    assert server.attributes[names.RETRIES] == 1
    assert (first.attributes[names.ERROR_TYPE], first.attributes[names.HTTP_STATUS], first.error) == ("429", 429, True)
    assert names.ERROR_TYPE not in second.attributes
    assert (second.attributes[names.RESPONSE_MODEL], second.attributes[names.INPUT_TOKENS]) == \
        ("gpt-4o-2024-08-06", 12)
    assert [parent.split("-")[2] for parent in seen] == [first.span_id, second.span_id]
    waits = sorted(collector.named("slotproxy.queue"), key=lambda span: span.start)
    assert len(waits) == 2
    assert waits[1].attributes[names.HELD_BY] == "provider paused"
    assert waits[1].duration >= 0.04
    await collector.wait_for_metric(names.OPERATION_DURATION)
    errors = [point for point in collector.metric(names.OPERATION_DURATION) if names.ERROR_TYPE in point.attributes]
    assert [point.attributes[names.ERROR_TYPE] for point in errors] == ["429"]


async def test_the_latest_experimental_conventions_only_when_opted_in(
        collector: Collector, start_upstream, start_proxy, client: aiohttp.ClientSession,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SEMCONV_STABILITY_OPT_IN", "http,gen_ai_latest_experimental")
    up = await start_upstream(chunks=2)
    proxy = await start_proxy(proxy_yaml(collector, f"{up.url}/v1"))
    async with client.post(f"{proxy.url}/openai/chat/completions",
                           json={"model": "fake", "messages": [{"role": "user", "content": "hi"}]},
                           headers={"x-fake-usage": json.dumps(USAGE)}) as resp:
        await resp.read()
    await collector.wait_for_metric(names.INPUT_BY_CACHE)
    by_cache = {point.attributes[names.TOKEN_CACHE]: point.value for point in collector.metric(names.INPUT_BY_CACHE)}
    assert by_cache == {"read": 10, "creation": 0, "none": 30}
    assert not collector.metric(names.TOKEN_USAGE)
    assert os.environ["OTEL_SEMCONV_STABILITY_OPT_IN"]
