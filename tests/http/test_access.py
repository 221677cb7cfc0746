"""Optional client keys: only holders of a configured key may use the proxy."""

from __future__ import annotations

import pytest

from ..conftest import chat, provider_yaml

pytestmark = pytest.mark.asyncio

KEYS = "team-key-one-123,team-key-two-456"


@pytest.fixture
async def guarded(start_upstream, start_proxy, monkeypatch):
    monkeypatch.setenv("TEST_CLIENT_KEYS", KEYS)
    monkeypatch.setenv("TEST_PROVIDER_KEY", "sk-provider-secret-789")
    upstream = await start_upstream()
    proxy = await start_proxy("access: {keys_env: TEST_CLIENT_KEYS}\n" + provider_yaml(
        upstream, limit=2, api_key_env="TEST_PROVIDER_KEY"))
    return upstream, proxy


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({}, 401),
        ({"X-Slotproxy-Key": "nope"}, 403),
        ({"Authorization": "Bearer team-key-one"}, 403),
        ({"X-Slotproxy-Key": "team-key-two-456"}, 200),
        ({"Authorization": "Bearer team-key-one-123"}, 200),
        ({"x-api-key": "team-key-two-456"}, 200),
    ],
)
async def test_client_key_required(guarded, client, headers, status) -> None:
    upstream, proxy = guarded
    async with client.post(f"{proxy.url}/openai/chat/completions", json=chat(stream=False), headers=headers) as resp:
        assert resp.status == status
        if status != 200:
            body = await resp.json()
            assert body["error"]["code"] == "forbidden" and body["error"]["type"] == "slotproxy_error"
    if status == 200:
        seen = upstream.fake.stats()["last_headers"]
        assert seen["authorization"] == "Bearer sk-provider-secret-789"
        assert "x-slotproxy-key" not in seen and "x-api-key" not in seen
    else:
        assert upstream.fake.stats()["requests"] == 0


async def test_a_client_key_beside_the_clients_own_provider_key(start_upstream, start_proxy, client, monkeypatch) -> None:
    """Pass-through providers: the client's Authorization is its provider key, so the client key rides apart."""
    monkeypatch.setenv("TEST_CLIENT_KEYS", KEYS)
    upstream = await start_upstream()
    proxy = await start_proxy("access: {keys_env: TEST_CLIENT_KEYS}\n" + provider_yaml(upstream, limit=2))
    headers = {"X-Slotproxy-Key": "team-key-one-123", "Authorization": "Bearer sk-clients-own"}
    async with client.post(f"{proxy.url}/openai/chat/completions", json=chat(stream=False), headers=headers) as resp:
        assert resp.status == 200
    seen = upstream.fake.stats()["last_headers"]
    assert seen["authorization"] == "Bearer sk-clients-own"
    assert "x-slotproxy-key" not in seen
