"""Status, health and readiness as a client reads them."""

from __future__ import annotations

import asyncio
import time

import pytest

from ..conftest import chat, provider_yaml, wait_until

pytestmark = pytest.mark.asyncio

PROVIDER_FIELDS = {
    "provider", "limit", "configured_limit", "in_flight", "queued", "paused", "paused_until", "cooldown_ms",
    "auto_reduced", "auto_reduced_from", "notice", "queue", "usage", "rejected", "keys", "models", "websockets",
    "holders", "manual", "manual_set_at", "relayed_429",
}


async def test_status_shows_every_field_and_the_queue_in_admission_order(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream(chunks=1, delay_ms=1)
    proxy = await start_proxy(provider_yaml(upstream, limit=1, release_cooldown="250ms"))
    url = f"{proxy.url}/openai/chat/completions"
    holder = asyncio.create_task(client.post(url, json=chat(), headers={"x-fake-stall-ms": "500"}))
    await wait_until(lambda: proxy.status()["in_flight"] == 1)
    started = int(time.time() * 1000) - 60_000
    queued = [
        asyncio.create_task(client.post(url, json=chat(), headers={"X-Workspace-Id": "alpha", "X-Conversation-Id": "c-1"})),
        asyncio.create_task(client.post(url, json=chat(), headers={
            "X-Workspace-Id": "beta", "X-Prompt-Started-At": str(started)})),
    ]
    await wait_until(lambda: proxy.status()["queued"] == 2)
    async with client.get(f"{proxy.url}/_slotproxy/status") as resp:
        assert resp.status == 200
        body = await resp.json()
    assert set(body) == {"providers", "backend", "config", "spend"}
    assert set(body["config"]) == {"path", "loaded_at", "error", "missing_since"}
    (entry,) = body["providers"]
    assert set(entry) == PROVIDER_FIELDS
    assert (entry["limit"], entry["configured_limit"], entry["in_flight"], entry["queued"]) == (1, 1, 1, 2)
    assert (entry["paused"], entry["paused_until"], entry["cooldown_ms"]) == (False, None, 250)
    assert [w["workspace"] for w in entry["queue"]] == ["beta", "alpha"]
    assert entry["queue"][0]["prompt_started_at"] == started
    assert entry["queue"][1]["conversation"] == "c-1"
    assert all(isinstance(w["waited_ms"], int) for w in entry["queue"])
    assert [w["transport"] for w in entry["queue"]] == ["http", "http"]
    assert entry["websockets"] == 0
    (holding,) = entry["holders"]
    assert (holding["workspace"], holding["transport"], holding["key"]) == ("default", "http", None)
    assert holding["held_ms"] >= 0
    for response in await asyncio.gather(holder, *queued):
        await response.read()
        response.release()


async def test_health_and_readiness(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream()
    proxy = await start_proxy(provider_yaml(upstream, limit=1))
    async with client.get(f"{proxy.url}/healthz") as resp:
        assert resp.status == 200
    async with client.get(f"{proxy.url}/readyz") as resp:
        assert resp.status == 200
    proxy.state.shutting_down = True
    async with client.get(f"{proxy.url}/readyz") as resp:
        assert resp.status == 503
        assert "shutting down" in (await resp.json())["reasons"]
    async with client.post(f"{proxy.url}/openai/chat/completions", json=chat()) as resp:
        assert resp.status == 503
        assert resp.headers["Retry-After"] == "1"
        assert (await resp.json())["error"]["code"] == "shutting_down"


async def test_the_dashboard_path_without_its_slash_redirects_to_it(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream()
    proxy = await start_proxy(provider_yaml(upstream, limit=1))
    async with client.get(f"{proxy.url}/_slotproxy", allow_redirects=False) as resp:
        assert resp.status == 301
        assert resp.headers["Location"] == "/_slotproxy/"
    async with client.get(f"{proxy.url}/_slotproxy") as resp:
        assert resp.status == 200
        assert resp.content_type == "text/html"


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [("POST", "/_slotproxy/status", "GET, HEAD"),
     ("DELETE", "/_slotproxy/", "GET, HEAD"),
     ("POST", "/metrics", "GET, HEAD"),
     ("PUT", "/healthz", "GET, HEAD"),
     ("POST", "/_slotproxy/history", "GET, HEAD"),
     ("GET", "/_slotproxy/providers/openai/limit", "DELETE, PUT"),
     ("POST", "/_slotproxy/providers/openai/cooldown", "PUT"),
     ("GET", "/_slotproxy/workspaces/alpha/star", "DELETE, PUT")],
)
async def test_a_wrong_method_on_an_admin_route_is_405_with_allow(start_upstream, start_proxy, client,
                                                                  method, path, allowed) -> None:
    upstream = await start_upstream()
    proxy = await start_proxy(provider_yaml(upstream, limit=2))
    async with client.request(method, f"{proxy.url}{path}") as resp:
        assert resp.status == 405
        assert resp.headers["Allow"] == allowed
        body = await resp.json()
    assert body["error"]["message"] == f"{method} is not allowed on {path}; use {allowed}"


async def test_429s_relayed_to_clients_are_counted_in_status_beside_rejected(start_upstream, start_proxy,
                                                                             client) -> None:
    upstream = await start_upstream(retry_after=0.05)
    proxy = await start_proxy(provider_yaml(upstream, limit=4, retry_on_429=1))
    url = f"{proxy.url}/openai/chat/completions"
    for _ in range(2):  # each is retried once, then its second 429 is relayed
        async with client.post(url, json=chat(stream=False), headers={"x-fake-status": "429"}) as resp:
            assert resp.status == 429
            await resp.read()
    async with client.post(url, json=chat(stream=False)) as resp:
        assert resp.status == 200
    async with client.get(f"{proxy.url}/_slotproxy/status") as resp:
        (provider,) = (await resp.json())["providers"]
    assert provider["relayed_429"] == 2
    assert provider["rejected"] == {"queue_full": 0, "queue_timeout": 0}
    assert len(upstream.fake.stats()["arrivals"]) == 5
