"""Every way a slot can end is released exactly once, leaving in_flight 0 and no waiter."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from ..conftest import Proxy, Upstream, chat, provider_yaml, wait_until
from ..ports import free_port

pytestmark = pytest.mark.asyncio


async def drained(proxy: Proxy, upstream: Upstream | None = None) -> None:
    await wait_until(lambda: proxy.status()["in_flight"] == 0 and proxy.status()["queued"] == 0,
                     what="in_flight 0 and queued 0")
    if upstream is not None:
        await wait_until(lambda: upstream.fake.stats()["active"] == 0, what="upstream idle")


async def test_normal_end_releases(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream(chunks=3, delay_ms=5)
    proxy = await start_proxy(provider_yaml(upstream, limit=1))
    for _ in range(3):
        async with client.post(f"{proxy.url}/openai/chat/completions", json=chat()) as resp:
            assert resp.status == 200
            await resp.read()
    await drained(proxy, upstream)
    assert proxy.state.backend.provider_status("openai").counters["granted"] == 3


async def test_client_leaving_while_queued_leaves_the_queue_at_once(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream(chunks=1, delay_ms=1)
    proxy = await start_proxy(provider_yaml(upstream, limit=1))
    url = f"{proxy.url}/openai/chat/completions"
    holder = asyncio.create_task(client.post(url, json=chat(), headers={"x-fake-stall-ms": "500", "x-fake-tag": "holder"}))
    await wait_until(lambda: proxy.status()["in_flight"] == 1)
    queued = asyncio.create_task(client.post(url, json=chat(), headers={"x-fake-tag": "gone"}))
    await wait_until(lambda: proxy.status()["queued"] == 1)
    queued.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued
    await wait_until(lambda: proxy.status()["queued"] == 0, timeout=2, what="waiter removed")
    (await holder).release()
    await drained(proxy, upstream)
    assert [a["tag"] for a in upstream.fake.stats()["arrivals"]] == ["holder"]


async def test_client_leaving_mid_stream_releases_and_closes_upstream(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream(chunks=50, delay_ms=20)
    proxy = await start_proxy(provider_yaml(upstream, limit=1))
    resp = await client.post(f"{proxy.url}/openai/chat/completions", json=chat())
    await resp.content.readline()
    assert upstream.fake.stats()["active"] == 1
    resp.close()
    await drained(proxy, upstream)
    assert upstream.fake.stats()["completed"] == 0


async def test_upstream_connect_failure_gives_502_and_releases(start_proxy, client) -> None:
    proxy = await start_proxy(f"state: {{path: null}}\nproviders:\n  openai: {{upstream: 'http://127.0.0.1:{free_port()}/v1', limit: 1}}\n")
    async with client.post(f"{proxy.url}/openai/chat/completions", json=chat()) as resp:
        assert resp.status == 502
        body = await resp.json()
        assert body["error"]["code"] == "upstream_unreachable"
        assert body["error"]["type"] == "slotproxy_error"
    await drained(proxy)


async def test_upstream_reset_mid_stream_cuts_the_client_and_releases(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream(chunks=10, delay_ms=10)
    proxy = await start_proxy(provider_yaml(upstream, limit=1))
    async with client.post(f"{proxy.url}/openai/chat/completions", json=chat(),
                           headers={"x-fake-reset-after": "2"}) as resp:
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()
    await drained(proxy, upstream)


@pytest.mark.parametrize("status", [400, 401, 404, 500, 502, 503])
async def test_upstream_error_status_is_relayed_and_releases(start_upstream, start_proxy, client, status) -> None:
    upstream = await start_upstream()
    proxy = await start_proxy(provider_yaml(upstream, limit=1))
    async with client.post(f"{proxy.url}/openai/chat/completions", json=chat(),
                           headers={"x-fake-status": str(status)}) as resp:
        assert resp.status == status
        assert "error" in await resp.json()
    await drained(proxy, upstream)
    assert not proxy.status()["paused"]


async def test_idle_timeout_before_headers_gives_504_and_releases(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream()
    proxy = await start_proxy(provider_yaml(upstream, limit=1, idle_timeout="200ms"))
    async with client.post(f"{proxy.url}/openai/chat/completions", json=chat(),
                           headers={"x-fake-stall-ms": "2000"}) as resp:
        assert resp.status == 504
        assert (await resp.json())["error"]["code"] == "upstream_timeout"
    await drained(proxy, upstream)


async def test_idle_timeout_mid_stream_cuts_and_releases(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream(chunks=3, delay_ms=1500)
    proxy = await start_proxy(provider_yaml(upstream, limit=1, idle_timeout="300ms"))
    async with client.post(f"{proxy.url}/openai/chat/completions", json=chat()) as resp:
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()
    await drained(proxy, upstream)


async def test_slot_timeout_before_first_byte_gives_504_and_reclaims(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream()
    proxy = await start_proxy(provider_yaml(upstream, limit=1, slot_timeout="300ms"))
    async with client.post(f"{proxy.url}/openai/chat/completions", json=chat(),
                           headers={"x-fake-stall-ms": "3000"}) as resp:
        assert resp.status == 504
        assert (await resp.json())["error"]["code"] == "upstream_timeout"
    await drained(proxy, upstream)
    assert proxy.state.backend.provider_status("openai").counters["reclaims"] == 1


async def test_slot_timeout_mid_stream_cuts_and_hands_the_slot_on(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream(chunks=40, delay_ms=50)
    proxy = await start_proxy(provider_yaml(upstream, limit=1, slot_timeout="400ms"))
    url = f"{proxy.url}/openai/chat/completions"
    long = await client.post(url, json=chat())
    waiting = asyncio.create_task(client.post(url, json=chat(), headers={"x-fake-chunks": "1"}))
    with pytest.raises(aiohttp.ClientPayloadError):
        await long.read()
    nxt = await waiting
    assert nxt.status == 200
    await nxt.read()
    await drained(proxy, upstream)
    assert proxy.state.backend.provider_status("openai").counters["reclaims"] == 1


async def test_speculative_open_and_cancel_200_times_leaks_nothing(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream(chunks=20, delay_ms=10)
    proxy = await start_proxy(provider_yaml(upstream, limit=2))
    url = f"{proxy.url}/openai/chat/completions"

    async def open_and_cancel(i: int) -> None:
        task = asyncio.create_task(client.post(url, json=chat()))
        await asyncio.sleep((i % 5) * 0.01)
        task.cancel()
        try:
            resp = await task
        except asyncio.CancelledError:
            return
        resp.close()

    for i in range(200):
        await open_and_cancel(i)
    await drained(proxy, upstream)
    async with client.post(url, json=chat()) as resp:
        assert resp.status == 200
        await resp.read()
    assert upstream.fake.stats()["max_concurrency"] <= 2
