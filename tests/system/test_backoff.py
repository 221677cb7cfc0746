"""Upstream rate-limit answers: pause, auto-reduce once per burst, retry before the client sees it."""

from __future__ import annotations

import asyncio
import time

import pytest

from proxy.limiter import auto_reduce_notice

from ..conftest import chat, provider_yaml, wait_until

pytestmark = pytest.mark.asyncio


async def test_first_429_pauses_reduces_and_every_client_still_gets_200(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream(cap=2, chunks=5, delay_ms=30, retry_after=0.3)
    proxy = await start_proxy(provider_yaml(upstream, limit=3))
    url = f"{proxy.url}/openai/chat/completions"

    async def one() -> int:
        async with client.post(url, json=chat()) as resp:
            await resp.read()
            return resp.status

    first_wave = [asyncio.create_task(one()) for _ in range(3)]
    await wait_until(lambda: proxy.status()["paused"], what="pause after the 429")
    status = proxy.status()
    assert status["limit"] == 2
    assert (status["auto_reduced"], status["auto_reduced_from"], status["configured_limit"]) == (True, 3, 3)
    assert status["notice"] == auto_reduce_notice(2, "429")
    # The stated wait was retry-after-ms: 300.
    assert 0 < status["paused_until"] - int(time.time() * 1000) <= 300
    statuses = await asyncio.gather(*first_wave, *(one() for _ in range(7)))
    assert statuses == [200] * 10
    stats = upstream.fake.stats()
    assert stats["rate_limited"] == 1
    assert stats["max_concurrency"] == 2
    final = proxy.status()
    assert (final["in_flight"], final["queued"], final["limit"]) == (0, 0, 2)
    metrics = proxy.state.metrics.render().decode()
    assert 'slotproxy_upstream_backoff_total{provider="openai",status="429"} 1.0' in metrics
    assert 'slotproxy_auto_reductions_total{provider="openai"} 1.0' in metrics


async def test_pause_lasts_the_stated_wait(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream(retry_after=0.5)
    proxy = await start_proxy(provider_yaml(upstream, limit=3, retry_on_429=0))
    loop = asyncio.get_running_loop()
    async with client.post(f"{proxy.url}/openai/chat/completions", json=chat(),
                           headers={"x-fake-status": "429"}) as resp:
        assert resp.status == 429
        assert resp.headers["retry-after-ms"] == "500"
    assert proxy.status()["paused"]
    started = loop.time()
    async with client.post(f"{proxy.url}/openai/chat/completions", json=chat()) as resp:
        assert resp.status == 200
        await resp.read()
        assert int(resp.headers["X-Slotproxy-Queue-Ms"]) >= 300
    assert loop.time() - started >= 0.3


async def test_retry_on_429_exhausted_relays_the_last_answer(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream(retry_after=0.05)
    proxy = await start_proxy(provider_yaml(upstream, limit=3, retry_on_429=1))
    async with client.post(f"{proxy.url}/openai/chat/completions", json=chat(),
                           headers={"x-fake-status": "429"}) as resp:
        assert resp.status == 429
        assert (await resp.json())["error"]["code"] == "rate_limit_exceeded"
    assert upstream.fake.stats()["rate_limited"] == 2
    assert proxy.status()["in_flight"] == 0


async def test_quota_exhausted_429_is_relayed_without_pause(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream()
    proxy = await start_proxy(provider_yaml(upstream, limit=3))
    headers = {"x-fake-status": "429", "x-fake-error-code": "insufficient_quota"}
    async with client.post(f"{proxy.url}/openai/chat/completions", json=chat(), headers=headers) as resp:
        assert resp.status == 429
        assert (await resp.json())["error"]["code"] == "insufficient_quota"
    status = proxy.status()
    assert (status["paused"], status["limit"], status["auto_reduced"]) == (False, 3, False)
    assert upstream.fake.stats()["rate_limited"] == 1


async def test_529_pauses_for_overload_pause_without_lowering_the_limit(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream()
    proxy = await start_proxy(provider_yaml(upstream, limit=4, retry_on_429=0, backoff_statuses="[429, 529]",
                                            default_pause="30s", overload_pause="2s"))
    async with client.post(f"{proxy.url}/openai/chat/completions", json=chat(),
                           headers={"x-fake-status": "529", "x-fake-no-retry-after": "1"}) as resp:
        assert resp.status == 529
    status = proxy.status()
    assert (status["paused"], status["limit"], status["auto_reduced"], status["notice"]) == (True, 4, False, None)
    assert 1000 < status["paused_until"] - int(time.time() * 1000) <= 2050


async def test_529_lowers_the_limit_when_listed_in_reduce_statuses(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream()
    proxy = await start_proxy(provider_yaml(upstream, limit=4, retry_on_429=0, backoff_statuses="[429, 529]",
                                            reduce_statuses="[429, 529]", default_pause="200ms"))
    async with client.post(f"{proxy.url}/openai/chat/completions", json=chat(),
                           headers={"x-fake-status": "529", "x-fake-no-retry-after": "1"}) as resp:
        assert resp.status == 529
    assert proxy.status()["notice"] == auto_reduce_notice(3, "529")


async def test_in_stream_rate_limit_error_counts_like_a_429(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream(chunks=3, delay_ms=5)
    proxy = await start_proxy(provider_yaml(upstream, limit=4, default_pause="300ms"))
    async with client.post(f"{upstream.url}/v1/chat/completions", json=chat(),
                           headers={"x-fake-stream-error": "rate_limit_exceeded"}) as direct:
        direct_body = await direct.read()
    async with client.post(f"{proxy.url}/openai/chat/completions", json=chat(),
                           headers={"x-fake-stream-error": "rate_limit_exceeded"}) as resp:
        assert resp.status == 200
        body = await resp.read()
    assert body.split(b"\n\n")[1:] == direct_body.split(b"\n\n")[1:]
    status = proxy.status()
    assert status["limit"] == 3
    assert status["notice"] == auto_reduce_notice(3, "rate_limit_exceeded")


async def test_a_burst_of_429s_lowers_the_limit_once(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream(retry_after=0.2)
    proxy = await start_proxy(provider_yaml(upstream, limit=5, retry_on_429=0))
    url = f"{proxy.url}/openai/chat/completions"

    async def rate_limited() -> int:
        async with client.post(url, json=chat(), headers={"x-fake-status": "429", "x-fake-stall-ms": "50"}) as resp:
            return resp.status

    assert await asyncio.gather(*(rate_limited() for _ in range(5))) == [429] * 5
    status = proxy.status()
    assert (status["limit"], status["auto_reduced_from"]) == (4, 5)
