"""What the requests cost in dollars, and the daily spend cap per workspace, through a real proxy in front of the
fake provider: exact costs for each answer shape, the refusal past a cap (each provider's shape, the queued
included), a restart, a reload, two replicas on Redis and a WebSocket's ``response.create``."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import WSMsgType

from proxy.cli.status import format_status
from proxy.config.loader import parse_config
from proxy.ledger.prices import DAY_MS
from proxy.ledger.store import COLUMNS

from ..backends.conftest import REDIS_URL, delete_prefix, require_redis
from ..conftest import Proxy, Upstream, wait_until

pytestmark = pytest.mark.asyncio

FIGURES = {"input": 1200, "cached": 1000, "cache_write": 50, "output": 90, "reasoning": 30}
PRICES = "prices:\n  'priced-*': {input: 2.0, output: 8.0, cache_read: 0.5, cache_write: 3.0}\n"
ANTHROPIC = {"x-api-key": "k", "anthropic-version": "2023-06-01"}
ONE_CENT_A_TOKEN = "prices:\n  'capped-*': {input: 10000.0, output: 10000.0}\n"
"""A token costs $0.01: a request of 10 input tokens and 1 output token costs $0.11."""


def rig(upstream: Upstream, ledger: Path | None, extra: str = "", *, backend: str = "", limit: str = "null") -> str:
    where = "null" if ledger is None else f"'{ledger}'"
    return (f"state: {{path: null}}\nledger: {{path: {where}}}\n{backend}{extra}providers:\n"
            f"  openai: {{upstream: '{upstream.url}/v1', limit: {limit}}}\n"
            f"  anthropic: {{upstream: '{upstream.url}', auth: x-api-key, limit: {limit}}}\n")


def capped(cap: float = 0.1, others: float = 100.0) -> str:
    return ONE_CENT_A_TOKEN + f"workspaces:\n  spend_per_day_usd: {{'*': {others}, web: {cap}}}\n"


async def rows(proxy: Proxy) -> list[dict[str, Any]]:
    await proxy.state.ledger.flush()
    assert proxy.state.ledger.path is not None
    with sqlite3.connect(proxy.state.ledger.path) as connection:
        cursor = connection.execute(f"SELECT {', '.join(COLUMNS)} FROM requests ORDER BY rowid")
        return [dict(zip(COLUMNS, values, strict=True)) for values in cursor]


async def post(client: aiohttp.ClientSession, proxy: Proxy, route: str, model: str, workspace: str = "web",
               usage: dict[str, int] | None = None, stream: bool = False, **headers: str) -> tuple[int, Any, Any]:
    """One request; the status, the parsed body (or the raw stream) and the headers."""
    wire = {"X-Workspace-Id": workspace, "x-fake-usage": json.dumps(usage or {"input": 10, "output": 1}),
            **headers}
    if route == "chat":
        url, body = f"{proxy.url}/openai/chat/completions", {
            "model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}],
            **({"stream_options": {"include_usage": True}} if stream else {})}
    elif route == "responses":
        url, body = f"{proxy.url}/openai/responses", {"model": model, "input": "hi", "stream": stream}
    else:
        url, body = f"{proxy.url}/anthropic/v1/messages", {
            "model": model, "max_tokens": 5, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
        wire.update(ANTHROPIC)
    async with client.post(url, json=body, headers=wire) as resp:
        raw = await resp.read()
        parsed = json.loads(raw) if resp.content_type == "application/json" else raw
        return resp.status, parsed, resp.headers


# --- what each answer cost ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("route", "stream"), [("chat", False), ("chat", True), ("responses", False),
                                               ("responses", True), ("messages", False), ("messages", True)])
async def test_each_answer_shape_is_priced_exactly_from_the_configured_prices(
        start_upstream, start_proxy, client, tmp_path, route, stream) -> None:
    """Cached input at the cache-read price, cache writes at theirs (Anthropic's shape carries them), the rest of
    the input at the input price, and reasoning inside output at the output price."""
    proxy = await start_proxy(rig(await start_upstream(chunks=2), tmp_path / "l.sqlite", PRICES))
    status, _, _ = await post(client, proxy, route, "priced-1", usage=FIGURES, stream=stream)
    assert status == 200
    written = 50 if route == "messages" else 0
    expected = ((1200 - 1000 - written) * 2.0 + 1000 * 0.5 + written * 3.0 + 90 * 8.0) / 1_000_000
    (row,) = await rows(proxy)
    assert row["cost_usd"] == pytest.approx(expected, rel=1e-12)
    async with client.get(f"{proxy.url}/_slotproxy/usage", params={"by": "model"}) as resp:
        (usage,) = (await resp.json())["rows"]
    assert usage["cost_usd"] == pytest.approx(expected, abs=1e-6) and usage["unpriced"] == 0
    metrics = proxy.state.metrics.render().decode()
    line = next(line for line in metrics.splitlines() if line.startswith("slotproxy_cost_usd_total{"))
    assert 'provider="' in line and float(line.rsplit(" ", 1)[1]) == pytest.approx(expected)


async def test_published_prices_price_a_mainstream_model_and_an_unknown_one_is_unpriced(
        start_upstream, start_proxy, client, tmp_path) -> None:
    from genai_prices import Usage, calc_price

    proxy = await start_proxy(rig(await start_upstream(), tmp_path / "l.sqlite"))
    usage = {"input": 5000, "cached": 1000, "output": 300}
    for route, model in (("chat", "gpt-4o"), ("messages", "claude-sonnet-4-5"), ("chat", "no-such-model-9")):
        status, _, _ = await post(client, proxy, route, model, usage=usage)
        assert status == 200
    gpt, claude, unknown = await rows(proxy)
    published = calc_price(Usage(input_tokens=5000, cache_read_tokens=1000, output_tokens=300), "gpt-4o",
                           provider_id="openai")
    assert gpt["cost_usd"] == pytest.approx(float(published.total_price), rel=1e-9)
    published = calc_price(Usage(input_tokens=5000, cache_read_tokens=1000, output_tokens=300),
                           "claude-sonnet-4-5", provider_id="anthropic")
    assert claude["cost_usd"] == pytest.approx(float(published.total_price), rel=1e-9)
    assert unknown["cost_usd"] is None and unknown["input_tokens"] == 5000
    async with client.get(f"{proxy.url}/_slotproxy/usage", params={"by": "model"}) as resp:
        by_model = {row["model"]: row for row in (await resp.json())["rows"]}
    assert by_model["no-such-model-9"]["unpriced"] == 1 and by_model["no-such-model-9"]["cost_usd"] == 0
    assert by_model["gpt-4o"]["unpriced"] == 0 and by_model["gpt-4o"]["cost_usd"] > 0


# --- the daily cap -------------------------------------------------------------------------------------------------


def seconds_to_midnight() -> float:
    return ((int(time.time() * 1000) // DAY_MS + 1) * DAY_MS) / 1000 - time.time()


async def test_the_request_that_crosses_the_cap_completes_and_the_next_is_refused_in_each_shape(
        start_upstream, start_proxy, client, tmp_path) -> None:
    up = await start_upstream()
    proxy = await start_proxy(rig(up, tmp_path / "l.sqlite", capped(0.1)))
    status, _, _ = await post(client, proxy, "chat", "capped-1")
    assert status == 200, "$0.11 crosses the $0.10 cap: it was under the cap when it began"
    status, body, headers = await post(client, proxy, "chat", "capped-1")
    assert status == 429
    assert body["error"]["code"] == "spend_limit_reached"
    message = body["error"]["message"]
    assert "'web'" in message and "$0.10" in message and "$0.11" in message and "00:00 UTC" in message
    assert abs(int(headers["Retry-After"]) - seconds_to_midnight()) < 5
    status, body, headers = await post(client, proxy, "messages", "capped-1")
    assert status == 429
    assert body["type"] == "error" and body["error"]["type"] == "spend_limit_reached"
    assert "'web'" in body["error"]["message"] and "Retry-After" in headers
    status, _, _ = await post(client, proxy, "chat", "capped-1", workspace="docs")
    assert status == 200, "another workspace is not touched by web's cap"
    ledger = await rows(proxy)
    assert [(row["workspace"], row["status"], row["outcome"]) for row in ledger] == [
        ("web", 200, "ok"), ("web", 429, "rejected"), ("web", 429, "rejected"), ("docs", 200, "ok")]
    async with client.get(f"{proxy.url}/_slotproxy/status") as resp:
        spend = (await resp.json())["spend"]
    assert spend == [{"workspace": "docs", "spent_usd": pytest.approx(0.11), "cap_usd": 100.0,
                      "resets_at": (int(time.time() * 1000) // DAY_MS + 1) * DAY_MS},
                     {"workspace": "web", "spent_usd": pytest.approx(0.11), "cap_usd": 0.1,
                      "resets_at": (int(time.time() * 1000) // DAY_MS + 1) * DAY_MS}]
    printed = format_status({"providers": [], "spend": spend})
    assert "workspace web spent $0.11 of $0.10 today: new requests refused, resets" in printed
    assert "workspace docs spent $0.11 of $100.00 today, resets" in printed


async def test_a_queued_request_of_a_workspace_that_reached_its_cap_is_refused_and_in_flight_ones_finish(
        start_upstream, start_proxy, client, tmp_path) -> None:
    up = await start_upstream(chunks=3, delay_ms=100)
    proxy = await start_proxy(rig(up, tmp_path / "l.sqlite", capped(0.1), limit="1"))
    first = asyncio.ensure_future(post(client, proxy, "chat", "capped-1"))
    await wait_until(lambda: proxy.state.backend.statistics()[0].in_flight == 1, what="the first holds the slot")
    queued = asyncio.ensure_future(post(client, proxy, "chat", "capped-1"))
    await wait_until(lambda: proxy.state.backend.statistics()[0].queued == 1, what="the second queued")
    assert (await first)[0] == 200
    status, body, _ = await queued
    assert status == 429 and body["error"]["code"] == "spend_limit_reached"
    assert [row["status"] for row in await rows(proxy)] == [200, 429]


async def slots(proxy: Proxy, in_flight: int, queued: int, timeout: float = 5.0) -> None:
    """Wait until the openai provider's shared counts (refreshed from Redis where it is used) are these."""
    deadline = time.monotonic() + timeout
    while True:
        await proxy.state.backend.refresh()
        status = proxy.state.backend.provider_status("openai")
        if (status.in_flight, status.queued) == (in_flight, queued):
            return
        assert time.monotonic() < deadline, f"expected {in_flight} in flight and {queued} queued, got {status}"
        await asyncio.sleep(0.02)


STALL = {"x-fake-stall-ms": "4000"}
"""Another workspace's request that holds its slot well past the moment the cap is crossed."""


async def test_a_queued_request_is_refused_at_once_when_its_workspace_s_own_request_crosses_the_cap(
        start_upstream, start_proxy, client, tmp_path) -> None:
    up = await start_upstream()
    proxy = await start_proxy(rig(up, tmp_path / "l.sqlite", capped(0.1), limit="2"))
    docs_long = asyncio.ensure_future(post(client, proxy, "chat", "capped-1", workspace="docs", **STALL))
    crossing = asyncio.ensure_future(post(client, proxy, "chat", "capped-1", **{"x-fake-stall-ms": "500"}))
    await slots(proxy, 2, 0)
    docs_next = asyncio.ensure_future(post(client, proxy, "chat", "capped-1", workspace="docs", **STALL))
    await slots(proxy, 2, 1)
    web_queued = asyncio.ensure_future(post(client, proxy, "chat", "capped-1"))
    await slots(proxy, 2, 2)
    docs_last = asyncio.ensure_future(post(client, proxy, "chat", "capped-1", workspace="docs"))
    await slots(proxy, 2, 3)
    assert (await crossing)[0] == 200
    crossed_at = time.monotonic()
    status, body, headers = await asyncio.wait_for(web_queued, 1.5)
    assert time.monotonic() - crossed_at < 1.5, "refused at once, not when a slot frees"
    assert status == 429 and body["error"]["code"] == "spend_limit_reached" and "'web'" in body["error"]["message"]
    assert abs(int(headers["Retry-After"]) - seconds_to_midnight()) < 5
    assert not docs_long.done() and not docs_last.done(), "the slots are still held; docs's queued one waits on"
    await slots(proxy, 2, 1)
    assert [(await task)[0] for task in (docs_long, docs_next, docs_last)] == [200, 200, 200]


async def test_a_reload_that_lowers_the_cap_below_today_s_spend_refuses_the_queued_at_once(
        start_upstream, start_proxy, client, tmp_path) -> None:
    up = await start_upstream()
    proxy = await start_proxy(rig(up, tmp_path / "l.sqlite", capped(1.0), limit="1"))
    assert (await post(client, proxy, "chat", "capped-1"))[0] == 200
    docs_long = asyncio.ensure_future(post(client, proxy, "chat", "capped-1", workspace="docs",
                                           **{"x-fake-stall-ms": "2000"}))
    await slots(proxy, 1, 0)
    web_queued = asyncio.ensure_future(post(client, proxy, "chat", "capped-1"))
    await slots(proxy, 1, 1)
    proxy.state.apply(parse_config(rig(up, tmp_path / "l.sqlite", capped(0.1), limit="1")))
    status, body, _ = await asyncio.wait_for(web_queued, 1)
    assert status == 429 and body["error"]["code"] == "spend_limit_reached" and not docs_long.done()
    assert (await docs_long)[0] == 200


async def test_each_replica_refuses_its_queued_requests_when_the_fleet_s_spend_reaches_the_cap(
        start_upstream, start_proxy, client, tmp_path) -> None:
    require_redis()
    prefix = f"slotproxy-test-{os.urandom(5).hex()}"
    backend = f"backend: {{kind: redis, url: '{REDIS_URL}', key_prefix: {prefix}, lease_ttl: 2s}}\n"
    try:
        up = await start_upstream()
        one = await start_proxy(rig(up, tmp_path / "one.sqlite", capped(0.1), backend=backend, limit="2"))
        two = await start_proxy(rig(up, tmp_path / "two.sqlite", capped(0.1), backend=backend, limit="2"))
        docs_long = asyncio.ensure_future(post(client, one, "chat", "capped-1", workspace="docs",
                                               **{"x-fake-stall-ms": "6000"}))
        crossing = asyncio.ensure_future(post(client, two, "chat", "capped-1", **{"x-fake-stall-ms": "800"}))
        await slots(one, 2, 0)
        docs_next = asyncio.ensure_future(post(client, one, "chat", "capped-1", workspace="docs", **STALL))
        await slots(one, 2, 1)
        web_queued = asyncio.ensure_future(post(client, one, "chat", "capped-1"))
        await slots(one, 2, 2)
        assert (await crossing)[0] == 200, "crossed on the other replica"
        crossed_at = time.monotonic()
        status, body, _ = await asyncio.wait_for(web_queued, 4)
        assert status == 429 and body["error"]["code"] == "spend_limit_reached"
        assert time.monotonic() - crossed_at < 4 and not docs_long.done(), "refused while both slots are held"
        await slots(one, 2, 0)  # it left the shared queue; docs's queued one got the slot the crossing freed
        assert [(await task)[0] for task in (docs_long, docs_next)] == [200, 200]
    finally:
        delete_prefix(REDIS_URL, prefix)


async def test_a_restart_keeps_the_day_s_spend(start_upstream, start_proxy, client, tmp_path) -> None:
    up = await start_upstream()
    ledger = tmp_path / "l.sqlite"
    before = await start_proxy(rig(up, ledger, capped(0.1)))
    assert (await post(client, before, "chat", "capped-1"))[0] == 200
    await before.runner.cleanup()
    after = await start_proxy(rig(up, ledger, capped(0.1)))
    status, body, _ = await post(client, after, "chat", "capped-1")
    assert status == 429 and body["error"]["code"] == "spend_limit_reached"
    assert after.state.spend.spent("web") == pytest.approx(0.11)


async def test_a_reload_that_raises_the_cap_lifts_the_refusal_at_once(start_upstream, start_proxy, client,
                                                                      tmp_path) -> None:
    up = await start_upstream()
    proxy = await start_proxy(rig(up, tmp_path / "l.sqlite", capped(0.1)))
    assert (await post(client, proxy, "chat", "capped-1"))[0] == 200
    assert (await post(client, proxy, "chat", "capped-1"))[0] == 429
    proxy.state.apply(parse_config(rig(up, tmp_path / "l.sqlite", capped(1.0))))
    assert (await post(client, proxy, "chat", "capped-1"))[0] == 200


async def test_two_replicas_on_redis_share_the_day_s_spend(start_upstream, start_proxy, client, tmp_path) -> None:
    require_redis()
    prefix = f"slotproxy-test-{os.urandom(5).hex()}"
    backend = f"backend: {{kind: redis, url: '{REDIS_URL}', key_prefix: {prefix}, lease_ttl: 2s}}\n"
    try:
        up = await start_upstream()
        one = await start_proxy(rig(up, tmp_path / "one.sqlite", capped(0.1), backend=backend))
        two = await start_proxy(rig(up, tmp_path / "two.sqlite", capped(0.1), backend=backend))
        assert (await post(client, one, "chat", "capped-1"))[0] == 200
        await wait_until(lambda: two.state.spend.spent("web") >= 0.1, timeout=5,
                         what="the other replica to read the fleet's spend")
        status, body, _ = await post(client, two, "chat", "capped-1")
        assert status == 429 and body["error"]["code"] == "spend_limit_reached"
        assert (await post(client, two, "chat", "capped-1", workspace="docs"))[0] == 200
        await two.runner.cleanup()
        again = await start_proxy(rig(up, tmp_path / "again.sqlite", capped(0.1), backend=backend))
        assert (await post(client, again, "chat", "capped-1"))[0] == 429, "a new replica reads the fleet's day"
    finally:
        delete_prefix(REDIS_URL, prefix)


async def test_a_websocket_response_create_past_the_cap_gets_an_error_event(start_upstream, start_proxy, client,
                                                                           tmp_path) -> None:
    up = await start_upstream(chunks=1)
    proxy = await start_proxy(rig(up, tmp_path / "l.sqlite", capped(0.1)))
    async with client.ws_connect(f"{proxy.url}/openai/responses",
                                 headers={"OpenAI-Beta": "responses_websockets=2026-02-06",
                                          "X-Workspace-Id": "web"}) as ws:
        for expected in ("response.completed", "error"):
            await ws.send_str(json.dumps({"type": "response.create", "model": "capped-1", "input": [],
                                          "x_fake": {"usage": {"input": 10, "output": 1}}}))
            while True:
                message = await ws.receive(timeout=10)
                assert message.type is WSMsgType.TEXT
                event = json.loads(message.data)
                if event["type"] in ("response.completed", "response.failed", "error"):
                    break
            assert event["type"] == expected, event
        assert event["status"] == 429 and event["error"]["code"] == "spend_limit_reached"
        assert event["retry_after_seconds"] >= 1
