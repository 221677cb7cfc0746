"""Admin API writes: auth, validation, limits, cooldowns, stars that re-order the queue."""

from __future__ import annotations

import asyncio
import time

import pytest

from ..conftest import chat, provider_yaml, wait_until

pytestmark = pytest.mark.asyncio

TOKEN = "admin-token-for-tests-123"


@pytest.fixture
async def proxy(start_upstream, start_proxy):
    upstream = await start_upstream(chunks=1, delay_ms=1)
    proxy = await start_proxy(provider_yaml(upstream, limit=3))
    proxy.upstream = upstream
    return proxy


@pytest.mark.parametrize(
    ("headers", "status"),
    [({}, 401), ({"Authorization": "Bearer wrong"}, 403), ({"Authorization": "Basic abc"}, 401),
     ({"Authorization": f"Bearer {TOKEN}"}, 200)],
)
async def test_writes_need_the_token_when_it_is_set(proxy, client, monkeypatch, headers, status) -> None:
    monkeypatch.setenv("SLOTPROXY_ADMIN_TOKEN", TOKEN)
    async with client.put(f"{proxy.url}/_slotproxy/providers/openai/limit", json={"limit": 5}, headers=headers) as resp:
        assert resp.status == status
        body = await resp.json()
    if status == 200:
        assert body["provider"] == "openai" and body["limit"] == 5 and body["configured_limit"] == 3
    else:
        assert body["error"]["code"] == "forbidden"
        assert TOKEN not in str(body)
        assert proxy.status()["limit"] == 3


async def test_reads_need_no_token(proxy, client, monkeypatch) -> None:
    monkeypatch.setenv("SLOTPROXY_ADMIN_TOKEN", TOKEN)
    async with client.get(f"{proxy.url}/_slotproxy/status") as resp:
        assert resp.status == 200


@pytest.mark.parametrize(
    ("path", "body", "reason"),
    [
        ("providers/openai/limit", b"not json", "not valid JSON"),
        ("providers/openai/limit", b"[1]", "JSON object"),
        ("providers/openai/limit", b'{"limit": "6"}', "positive integer or null"),
        ("providers/openai/limit", b'{"limit": -1}', "positive integer or null"),
        ("providers/openai/limit", b'{"limit": 0}', "positive integer or null"),
        ("providers/openai/limit", b'{"limit": true}', "positive integer or null"),
        ("providers/openai/limit", b'{"limit": 1.5}', "positive integer or null"),
        ("providers/openai/limit", b'{"limit": 10000000000}', "at most"),
        ("providers/openai/limit", b'{"limt": 5}', '{"limit"'),
        ("providers/openai/cooldown", b'{"cooldown_ms": -5}', "between 0 and"),
        ("providers/openai/cooldown", b'{"cooldown_ms": "1s"}', "cooldown_ms"),
        ("providers/openai/cooldown", b'{"cooldown_ms": 1e308}', "between 0 and"),
    ],
)
async def test_bad_bodies_get_400_with_the_reason(proxy, client, path, body, reason) -> None:
    async with client.put(f"{proxy.url}/_slotproxy/{path}", data=body,
                          headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
        assert error["code"] == "bad_request" and reason in error["message"]
    status = proxy.status()
    assert (status["limit"], status["cooldown_ms"]) == (3, 0)


async def test_unknown_provider_and_workspace_get_404(proxy, client) -> None:
    async with client.put(f"{proxy.url}/_slotproxy/providers/nope/limit", json={"limit": 2}) as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "unknown_provider"
    async with client.delete(f"{proxy.url}/_slotproxy/workspaces/never-starred/star") as resp:
        assert resp.status == 404


async def test_limit_and_cooldown_writes_apply_and_answer_the_provider_status(proxy, client) -> None:
    async with client.put(f"{proxy.url}/_slotproxy/providers/openai/limit", json={"limit": None}) as resp:
        assert (await resp.json())["limit"] is None
    async with client.put(f"{proxy.url}/_slotproxy/providers/openai/cooldown", json={"cooldown_ms": 1500}) as resp:
        body = await resp.json()
        assert resp.status == 200 and body["cooldown_ms"] == 1500
    assert proxy.status()["cooldown_ms"] == 1500


async def test_a_manual_limit_clears_the_auto_reduction(proxy, client) -> None:
    proxy.state.backend.report_backoff("openai", "429", 0.01, sent_at=time.time())
    assert proxy.status()["auto_reduced"]
    async with client.put(f"{proxy.url}/_slotproxy/providers/openai/limit", json={"limit": 3}) as resp:
        body = await resp.json()
    assert (body["limit"], body["auto_reduced"], body["auto_reduced_from"], body["notice"]) == (3, False, None, None)


async def test_starring_a_workspace_moves_its_waiting_request_to_the_front(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream(chunks=1, delay_ms=1)
    proxy = await start_proxy(provider_yaml(upstream, limit=1))
    url = f"{proxy.url}/openai/chat/completions"
    holder = asyncio.create_task(client.post(url, json=chat(), headers={"x-fake-stall-ms": "400", "x-fake-tag": "holder"}))
    await wait_until(lambda: proxy.status()["in_flight"] == 1)
    now_ms = int(time.time() * 1000)
    waiting = []
    for tag, age in (("old-a", 300_000), ("old-b", 200_000), ("new-c", 0)):
        waiting.append(asyncio.create_task(client.post(url, json=chat(), headers={
            "x-fake-tag": tag, "X-Workspace-Id": tag, "X-Prompt-Started-At": str(now_ms - age)})))
        count = len(waiting)
        await wait_until(lambda n=count: proxy.status()["queued"] == n)
    async with client.put(f"{proxy.url}/_slotproxy/workspaces/new-c/star") as resp:
        assert resp.status == 200
        assert (await resp.json())["starred_workspaces"] == ["new-c"]
    assert [w["workspace"] for w in proxy.status()["queue"]] == ["new-c", "old-a", "old-b"]
    assert proxy.status()["queue"][0]["starred"] is True
    for response in await asyncio.gather(holder, *waiting):
        await response.read()
        response.release()
    assert [a["tag"] for a in upstream.fake.stats()["arrivals"]] == ["holder", "new-c", "old-a", "old-b"]
    async with client.delete(f"{proxy.url}/_slotproxy/workspaces/new-c/star") as resp:
        assert (await resp.json())["starred"] is False


POOL_YAML = """\
state: {{path: null}}
providers:
  openai:
    upstream: {url}/v1
    limit: 4
    keys:
      - {{name: team-a, api_key_env: DASH_KEY_A, limit: 2}}
    models:
      "gpt-4*": {{limit: 2}}
"""


async def test_a_manual_limit_is_marked_with_when_and_delete_restores_the_configured_one(proxy, client) -> None:
    url = f"{proxy.url}/_slotproxy/providers/openai/limit"
    before = int(time.time() * 1000)
    async with client.put(url, json={"limit": 6}) as resp:
        body = await resp.json()
    assert (body["limit"], body["configured_limit"], body["manual"]) == (6, 3, True)
    assert before <= body["manual_set_at"] <= int(time.time() * 1000)
    assert proxy.status()["manual_set_at"] == body["manual_set_at"]

    async with client.delete(url) as resp:
        assert resp.status == 200
        body = await resp.json()
    assert (body["limit"], body["configured_limit"], body["manual"], body["manual_set_at"]) == (3, 3, False, None)


async def test_a_null_limit_still_means_unlimited_and_is_restored_by_delete(proxy, client) -> None:
    url = f"{proxy.url}/_slotproxy/providers/openai/limit"
    async with client.put(url, json={"limit": None}) as resp:
        body = await resp.json()
    assert (body["limit"], body["manual"]) == (None, True)
    async with client.delete(url) as resp:
        body = await resp.json()
    assert (body["limit"], body["manual"]) == (3, False)


async def test_delete_restores_an_auto_reduced_limit_and_a_put_of_the_configured_value_is_no_manual_one(
        proxy, client) -> None:
    proxy.state.backend.report_backoff("openai", "429", 0.01, sent_at=time.time())
    url = f"{proxy.url}/_slotproxy/providers/openai/limit"
    async with client.delete(url) as resp:
        body = await resp.json()
    assert (body["limit"], body["auto_reduced"], body["notice"], body["manual"]) == (3, False, None, False)
    async with client.put(url, json={"limit": 3}) as resp:
        assert (await resp.json())["manual"] is False


async def test_key_and_model_limits_are_marked_manual_and_restored_by_delete(start_upstream, start_proxy, client,
                                                                              monkeypatch) -> None:
    monkeypatch.setenv("DASH_KEY_A", "sk-a")
    upstream = await start_upstream()
    proxy = await start_proxy(POOL_YAML.format(url=upstream.url))
    base = f"{proxy.url}/_slotproxy/providers/openai"
    for path, field, name in (("keys/team-a/limit", "keys", "team-a"), ("models/gpt-4*/limit", "models", "gpt-4*")):
        async with client.put(f"{base}/{path}", json={"limit": 1}) as resp:
            assert resp.status == 200
            entry = (await resp.json())[field][0]
        assert (entry["limit"], entry["configured_limit"], entry["manual"]) == (1, 2, True), name
        assert isinstance(entry["manual_set_at"], int)
        async with client.delete(f"{base}/{path}") as resp:
            entry = (await resp.json())[field][0]
        assert (entry["limit"], entry["manual"], entry["manual_set_at"]) == (2, False, None), name
    async with client.delete(f"{base}/keys/nope/limit") as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "unknown_limit"


async def test_delete_of_a_limit_needs_the_token(proxy, client, monkeypatch) -> None:
    monkeypatch.setenv("SLOTPROXY_ADMIN_TOKEN", TOKEN)
    async with client.put(f"{proxy.url}/_slotproxy/providers/openai/limit", json={"limit": 5},
                          headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
        assert resp.status == 200
    async with client.delete(f"{proxy.url}/_slotproxy/providers/openai/limit") as resp:
        assert resp.status == 401
    assert proxy.status()["limit"] == 5
