"""Upstream-aware admission end to end: cooldown, usage gate, queue bounds, signals to the agent."""

from __future__ import annotations

import asyncio
import logging

import openai
import pytest
from aiohttp import web

from ..conftest import Upstream, chat, provider_yaml, serve_app, wait_until
from ..ports import free_port

pytestmark = pytest.mark.asyncio


async def burst(client, url: str, count: int) -> list[int]:
    async def one(i: int) -> int:
        async with client.post(url, json=chat(user=f"u{i}")) as resp:
            await resp.read()
            return resp.status

    return await asyncio.gather(*(one(i) for i in range(count)))


def usage_yaml(upstream: Upstream) -> str:
    return f"{{url: '{upstream.url}/v1/usage', field: concurrent.sessions, interval: 1s}}"


@pytest.mark.parametrize(
    ("mode", "extra"),
    [
        ("plain", {}),
        ("cooldown", {"release_cooldown": "500ms"}),
        ("usage gate", {"usage": None}),
    ],
)
async def test_lagging_upstream_counter(start_upstream, start_proxy, client, mode, extra) -> None:
    """fake cap 3, lag 400 ms, proxy limit 3: plain mode trips 429s; cooldown and the usage gate never do."""
    upstream = await start_upstream(cap=3, lag_ms=400, chunks=2, delay_ms=10, retry_after=0.2)
    if "usage" in extra:
        extra = {"usage": usage_yaml(upstream)}
    proxy = await start_proxy(provider_yaml(upstream, limit=3, retry_on_429=5, **extra))
    statuses = await burst(client, f"{proxy.url}/openai/chat/completions", 30)
    stats = upstream.fake.stats()
    if mode == "plain":
        assert stats["rate_limited"] > 0, "the problem: a lagging counter answers 429 to a proxy that only counts its own"
    else:
        assert statuses == [200] * 30
        assert stats["rate_limited"] == 0
        assert stats["max_concurrency"] == 3
    status = proxy.status()
    assert (status["in_flight"], status["queued"]) == (0, 0) or mode == "cooldown"


class BrokenUsage:
    """A usage endpoint that fails in one chosen way."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.calls = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.calls += 1
        if self.mode == "500":
            return web.json_response({"error": "boom"}, status=500)
        if self.mode == "invalid json":
            return web.Response(text="{not json", content_type="application/json")
        if self.mode == "missing field":
            return web.json_response({"concurrent": {}})
        await asyncio.sleep(2.0)
        return web.json_response({"concurrent": {"sessions": 0}})


@pytest.mark.parametrize("mode", ["down", "500", "invalid json", "missing field", "slow"])
async def test_failing_usage_poll_falls_back_to_cooldown_only(start_upstream, start_proxy, client, mode) -> None:
    upstream = await start_upstream(cap=2, chunks=2, delay_ms=10)
    broken = BrokenUsage(mode)
    app = web.Application()
    app.router.add_get("/usage", broken.handle)
    runner, served_port = await serve_app(app)
    port = free_port() if mode == "down" else served_port
    usage = f"{{url: 'http://127.0.0.1:{port}/usage', field: concurrent.sessions, interval: 300ms}}"
    try:
        proxy = await start_proxy(provider_yaml(upstream, limit=2, release_cooldown="50ms", usage=usage))
        statuses = await burst(client, f"{proxy.url}/openai/chat/completions", 8)
        assert statuses == [200] * 8
        stats = upstream.fake.stats()
        assert stats["rate_limited"] == 0 and stats["max_concurrency"] == 2
        usage_status = proxy.status()["usage"]
        assert usage_status["state"] == "failing"
        assert usage_status["error"]
    finally:
        await runner.cleanup()


async def test_queue_full_answers_503_with_retry_after_and_the_sdk_raises(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream(chunks=1, delay_ms=1)
    proxy = await start_proxy(provider_yaml(upstream, limit=1, max_queue=1))
    url = f"{proxy.url}/openai/chat/completions"
    holder = asyncio.create_task(client.post(url, json=chat(), headers={"x-fake-stall-ms": "500"}))
    await wait_until(lambda: proxy.status()["in_flight"] == 1)
    waiter = asyncio.create_task(client.post(url, json=chat()))
    await wait_until(lambda: proxy.status()["queued"] == 1)
    async with client.post(url, json=chat()) as resp:
        assert resp.status == 503
        assert int(resp.headers["Retry-After"]) >= 1
        assert "X-Slotproxy-Queue-Ms" in resp.headers
        assert (await resp.json())["error"] == {
            "message": resp_message(await resp.json()), "type": "slotproxy_error", "code": "queue_full"}
    sdk = openai.AsyncOpenAI(base_url=f"{proxy.url}/openai", api_key="k", max_retries=0)
    with pytest.raises(openai.InternalServerError) as raised:
        await sdk.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}])
    assert raised.value.status_code == 503
    assert "queue" in str(raised.value)
    await sdk.close()
    for response in await asyncio.gather(holder, waiter):
        await response.read()
        response.release()
    assert proxy.status()["rejected"]["queue_full"] == 2


def resp_message(body: dict) -> str:
    return body["error"]["message"]


async def test_queue_timeout_answers_503_with_retry_after(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream(chunks=1, delay_ms=1)
    proxy = await start_proxy(provider_yaml(upstream, limit=1, queue_timeout="200ms"))
    url = f"{proxy.url}/openai/chat/completions"
    holder = asyncio.create_task(client.post(url, json=chat(), headers={"x-fake-stall-ms": "800"}))
    await wait_until(lambda: proxy.status()["in_flight"] == 1)
    async with client.post(url, json=chat()) as resp:
        assert resp.status == 503
        assert int(resp.headers["Retry-After"]) >= 1
        assert int(resp.headers["X-Slotproxy-Queue-Ms"]) >= 190
        body = await resp.json()
        assert body["error"]["code"] == "queue_timeout" and body["error"]["type"] == "slotproxy_error"
    (await holder).release()
    assert proxy.status()["rejected"]["queue_timeout"] == 1


async def test_recovery_climbs_back_one_step_per_quiet_period(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream(retry_after=0.05)
    proxy = await start_proxy(provider_yaml(upstream, limit=3, retry_on_429=0, recovery="{after: 300ms}"))
    url = f"{proxy.url}/openai/chat/completions"
    for expected in (2, 1):
        async with client.post(url, json=chat(), headers={"x-fake-status": "429"}) as resp:
            assert resp.status == 429
        assert proxy.status()["limit"] == expected
        await asyncio.sleep(0.1)
    seen = [proxy.status()["limit"]]
    for _ in range(80):
        await asyncio.sleep(0.025)
        if proxy.status()["limit"] != seen[-1]:
            seen.append(proxy.status()["limit"])
    assert seen == [1, 2, 3]
    final = proxy.status()
    assert (final["auto_reduced"], final["notice"]) == (False, None)


async def test_slow_grant_is_logged(start_upstream, start_proxy, client, caplog) -> None:
    caplog.set_level(logging.INFO)
    upstream = await start_upstream(chunks=1, delay_ms=1)
    proxy = await start_proxy("logging: {slow_grant: 100ms}\n" + provider_yaml(upstream, limit=1))
    url = f"{proxy.url}/openai/chat/completions"
    holder = asyncio.create_task(client.post(url, json=chat(), headers={"x-fake-stall-ms": "300"}))
    await wait_until(lambda: proxy.status()["in_flight"] == 1)
    async with client.post(url, json=chat(), headers={"X-Workspace-Id": "slowpoke"}) as resp:
        assert int(resp.headers["X-Slotproxy-Queue-Ms"]) >= 150
        await resp.read()
    (await holder).release()
    assert any("granted a slot after" in r.getMessage() and "slowpoke" in r.getMessage() for r in caplog.records)


