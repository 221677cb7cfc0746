"""A collector that is down or slow: every request is still answered on time; the spans it never got are
dropped, counted (on /metrics too) and said in one log line a minute."""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import pytest

from ..conftest import Proxy
from .conftest import Collector, nowhere, telemetry_yaml

pytestmark = pytest.mark.asyncio

BODY = {"model": "fake", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


async def answer_all(client: aiohttp.ClientSession, proxy: Proxy, count: int) -> list[float]:
    async def one() -> float:
        started = time.monotonic()
        async with client.post(f"{proxy.url}/openai/chat/completions", json=BODY) as resp:
            assert resp.status == 200
            await resp.read()
        return time.monotonic() - started
    return list(await asyncio.gather(*(one() for _ in range(count))))


def proxy_yaml(endpoint: str, upstream_url: str) -> str:
    return f"state: {{path: null}}\n{telemetry_yaml(endpoint)}providers:\n  openai:\n    upstream: {upstream_url}/v1\n"


def telemetry_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records
            if record.name.startswith("opentelemetry") or record.getMessage().startswith("telemetry:")]


async def dropped_on_metrics(client: aiohttp.ClientSession, proxy: Proxy) -> float:
    async with client.get(f"{proxy.url}/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith("slotproxy_telemetry_dropped_total "):
            return float(line.split()[1])
    raise AssertionError("slotproxy_telemetry_dropped_total is not on /metrics")


async def test_a_collector_that_is_down_delays_no_request_and_its_spans_are_counted_as_dropped(
        fast_export: None, start_upstream, start_proxy, client: aiohttp.ClientSession,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    up = await start_upstream(chunks=2)
    proxy = await start_proxy(proxy_yaml(nowhere(), up.url))
    telemetry = proxy.state.telemetry
    assert telemetry is not None
    for _ in range(3):
        took = await answer_all(client, proxy, 10)
        assert max(took) < 1.0
        await asyncio.sleep(0.3)
    deadline = time.monotonic() + 10
    while telemetry.drops.spans < 30 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert telemetry.drops.spans >= 30, "every span of the 30 requests dropped and counted"
    assert await dropped_on_metrics(client, proxy) == telemetry.drops.spans
    lines = telemetry_lines(caplog)
    assert len(lines) == 1, lines
    assert "OTLP collector at http://127.0.0.1:" in lines[0] and "Requests are served as usual" in lines[0]


async def test_a_slow_collector_delays_no_request_and_what_its_full_queue_pushes_out_is_counted(
        collector: Collector, start_upstream, start_proxy, client: aiohttp.ClientSession,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "8")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "8")
    collector.delay = 2.0  # past the exporter's 1 s timeout
    up = await start_upstream(chunks=2)
    proxy = await start_proxy(proxy_yaml(collector.url, up.url))
    telemetry = proxy.state.telemetry
    assert telemetry is not None
    took = await answer_all(client, proxy, 30)
    assert max(took) < 1.0
    deadline = time.monotonic() + 10
    while telemetry.drops.spans < 60 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert telemetry.drops.spans >= 60, "spans beyond the queue's 8, and the batch that timed out, dropped"
    assert len(telemetry_lines(caplog)) == 1
