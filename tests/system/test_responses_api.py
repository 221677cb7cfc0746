"""The OpenAI Responses API end to end: the real openai SDK, through slotproxy, against the fake provider."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.responses import ResponseStreamEvent

from proxy.tools.fake_upstream import FakeUpstream

from ..conftest import Proxy, Upstream, provider_yaml, wait_until

pytestmark = pytest.mark.asyncio

TEXT = "tok0 tok1 tok2 "
REQUEST: dict[str, Any] = {"model": "fake", "input": "hi"}
OPENING = [
    "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
]
CLOSING = [
    "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed",
]
TPM_MESSAGE = (
    "Rate limit reached for gpt-4o in organization org-x on tokens per min (TPM): "
    "Limit 30000, Used 30000, Requested 1200. Please try again in 6.379s."
)

StartUpstream = Callable[..., Awaitable[Upstream]]
StartProxy = Callable[[str], Awaitable[Proxy]]
Proxied = Callable[..., Awaitable[tuple[Upstream, Proxy]]]


@pytest.fixture
def fixed_replies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every answer gets the same id and timestamp, so two answers compare byte for byte."""
    real = FakeUpstream._reply
    monkeypatch.setattr(
        FakeUpstream, "_reply", staticmethod(lambda *args: dataclasses.replace(real(*args), id="fixed", created=0))
    )


@pytest.fixture
def proxied(start_upstream: StartUpstream, start_proxy: StartProxy) -> Proxied:
    """Start a fake (3 chunks, 5 ms apart, unless told) and a proxy with ``limit`` in front of it."""

    async def start(*, limit: int = 2, **fake: Any) -> tuple[Upstream, Proxy]:
        upstream = await start_upstream(**({"chunks": 3, "delay_ms": 5} | fake))
        return upstream, await start_proxy(provider_yaml(upstream, limit=limit))

    return start


@asynccontextmanager
async def sdk(proxy: Proxy) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/openai", api_key="client-key", max_retries=0) as client:
        yield client


async def failed_responses_stream(
    client: openai.AsyncOpenAI, code: str = "rate_limit_exceeded", form: str = "failed"
) -> list[ResponseStreamEvent]:
    """Every event of a streamed Responses call the fake ends, after one delta, with an in-stream error.

    ``form`` ``failed`` ends it with ``response.failed``, ``event`` with a top-level ``error`` event.
    """
    headers = {"x-fake-stream-error": code, "x-fake-stream-error-form": form}
    stream = await client.responses.create(**REQUEST, stream=True, extra_headers=headers)
    return [event async for event in stream]


def deltas(events: list[ResponseStreamEvent]) -> str:
    return "".join(event.delta for event in events if event.type == "response.output_text.delta")


async def test_streaming_create_relays_every_event_and_the_queue_header(proxied: Proxied) -> None:
    _, proxy = await proxied()
    async with sdk(proxy) as client:
        raw = await client.responses.with_raw_response.create(**REQUEST, stream=True)
        assert int(raw.headers["X-Slotproxy-Queue-Ms"]) >= 0
        events = [event async for event in raw.parse()]
    assert [event.type for event in events] == [*OPENING, *["response.output_text.delta"] * 3, *CLOSING]
    assert deltas(events) == TEXT
    completed = events[-1]
    assert completed.type == "response.completed" and completed.response.output_text == TEXT


async def test_non_streaming_create_returns_output_text(proxied: Proxied) -> None:
    _, proxy = await proxied()
    async with sdk(proxy) as client:
        raw = await client.responses.with_raw_response.create(**REQUEST)
        response = raw.parse()
    assert "X-Slotproxy-Queue-Ms" in raw.headers
    assert (response.status, response.output_text) == ("completed", TEXT)
    assert response.usage is not None and response.usage.output_tokens == 3


async def test_stream_helper_reaches_the_final_response(proxied: Proxied) -> None:
    _, proxy = await proxied()
    async with sdk(proxy) as client, client.responses.stream(**REQUEST) as stream:
        final = await stream.get_final_response()
    assert (final.status, final.output_text) == ("completed", TEXT)


async def test_five_concurrent_streams_under_limit_one_never_overlap(
    proxied: Proxied, client: aiohttp.ClientSession
) -> None:
    upstream, proxy = await proxied(limit=1, cap=1)

    async def one(sdk_client: openai.AsyncOpenAI) -> list[ResponseStreamEvent]:
        stream = await sdk_client.responses.create(**REQUEST, stream=True)
        return [event async for event in stream]

    async with sdk(proxy) as sdk_client:
        results = await asyncio.gather(*(one(sdk_client) for _ in range(5)))
    assert all(events[-1].type == "response.completed" and deltas(events) == TEXT for events in results)
    async with client.get(f"{upstream.url}/stats") as resp:
        stats = await resp.json()
    assert (stats["max_concurrency"], stats["rate_limited"], stats["completed"]) == (1, 0, 5)
    await wait_until(lambda: proxy.status()["in_flight"] == 0, what="every slot released")


async def test_response_failed_reaches_the_sdk(proxied: Proxied) -> None:
    _, proxy = await proxied()
    async with sdk(proxy) as client:
        events = await failed_responses_stream(client)
    assert [event.type for event in events] == [*OPENING, "response.output_text.delta", "response.failed"]
    assert deltas(events) == "tok0 "
    failed = events[-1]
    assert failed.type == "response.failed" and failed.response.status == "failed"
    assert failed.response.error is not None
    assert (failed.response.error.code, failed.response.error.message) == ("rate_limit_exceeded", TPM_MESSAGE)


async def test_error_event_reaches_the_sdk(proxied: Proxied) -> None:
    _, proxy = await proxied()
    async with sdk(proxy) as client:
        events = await failed_responses_stream(client, form="event")
    error = events[-1]
    assert error.type == "error"
    assert (error.code, error.message, error.sequence_number) == ("rate_limit_exceeded", TPM_MESSAGE, 5)


@pytest.mark.usefixtures("fixed_replies")
@pytest.mark.parametrize("form", ["failed", "event"])
async def test_failed_stream_bytes_are_relayed_unchanged(
    proxied: Proxied, client: aiohttp.ClientSession, form: str
) -> None:
    upstream, proxy = await proxied()
    headers = {"x-fake-stream-error": "rate_limit_exceeded", "x-fake-stream-error-form": form}
    body = REQUEST | {"stream": True}
    async with client.post(f"{upstream.url}/v1/responses", json=body, headers=headers) as resp:
        direct = await resp.read()
    async with client.post(f"{proxy.url}/openai/responses", json=body, headers=headers) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        relayed = await resp.read()
    assert relayed == direct
    assert TPM_MESSAGE.encode() in relayed
