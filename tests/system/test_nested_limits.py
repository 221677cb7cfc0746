"""Nested limits end to end, on the memory and the Redis backend: key pools against a fake that caps each
key, model caps (body and Gemini path), budgets from the providers' rate-limit headers, fair shares."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.config import parse_config

from ..conftest import Proxy, chat, serve_app, wait_until

pytestmark = pytest.mark.asyncio

KEY_A, KEY_B = "sk-pool-key-a", "sk-pool-key-b"
LONG = {"x-fake-chunks": "8", "x-fake-delay-ms": "40"}


@pytest.fixture
def pool_env(monkeypatch) -> None:
    monkeypatch.setenv("SP_TEST_KEY_A", KEY_A)
    monkeypatch.setenv("SP_TEST_KEY_B", KEY_B)
    monkeypatch.delenv("SP_TEST_KEY_UNSET", raising=False)


async def status(proxy: Proxy, provider: str = "openai") -> dict[str, Any]:
    await proxy.state.backend.flush()
    await proxy.state.backend.refresh()
    return proxy.status(provider)


async def wait_queued(proxy: Proxy, count: int) -> None:
    for _ in range(500):
        if (await status(proxy))["queued"] == count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"expected {count} queued, status says {(await status(proxy))['queued']}")


async def post(client: aiohttp.ClientSession, url: str, body: dict[str, Any] | None = None,
               **headers: str) -> tuple[int, bytes]:
    async with client.post(url, json=body or chat(), headers=headers) as resp:
        return resp.status, await resp.read()


def pool_yaml(upstream_url: str, backend: str, *, extra: str = "", retry: int = 0,
              keys: str = "{name: team-a, api_key_env: SP_TEST_KEY_A, limit: 2},\n"
                          "            {name: team-b, api_key_env: SP_TEST_KEY_B, limit: 2}") -> str:
    return (f"state: {{path: null}}\n{backend}providers:\n  openai:\n    upstream: {upstream_url}/v1\n"
            f"    retry_on_429: {retry}\n    keys: [{keys}]\n{extra}")


async def test_a_pool_keeps_each_key_under_its_cap_and_sends_only_pool_keys(
        start_upstream, start_proxy, client, backend_yaml, pool_env) -> None:
    up = await start_upstream(key_limit=2)
    proxy = await start_proxy(pool_yaml(up.url, backend_yaml))
    url = f"{proxy.url}/openai/chat/completions"
    results = await asyncio.gather(*(post(client, url, Authorization="Bearer client-own-key", **LONG)
                                     for _ in range(8)))
    assert [code for code, _ in results] == [200] * 8
    stats = up.fake.stats()
    assert set(stats["keys"]) == {KEY_A, KEY_B}, "only pool keys reach the provider, never the client's"
    assert all(entry["max_concurrent"] <= 2 for entry in stats["keys"].values())
    assert sum(entry["requests"] for entry in stats["keys"].values()) == 8
    assert stats["rate_limited"] == 0
    keys = (await status(proxy))["keys"]
    assert [(k["name"], k["in_flight"], k["limit"], k["available"]) for k in keys] == [
        ("team-a", 0, 2, True), ("team-b", 0, 2, True)]


async def test_a_429_on_one_key_pauses_and_reduces_that_key_only(
        start_upstream, start_proxy, client, backend_yaml, pool_env) -> None:
    up = await start_upstream()
    proxy = await start_proxy(pool_yaml(up.url, backend_yaml))
    url = f"{proxy.url}/openai/chat/completions"
    code, _ = await post(client, url, **{"x-fake-status": "429"})
    assert code == 429
    s = await status(proxy)
    a, b = s["keys"]
    assert (a["name"], a["paused"], a["limit"], a["auto_reduced_from"]) == ("team-a", True, 1, 2)
    assert "auto-reduced to 1" in a["notice"]
    assert (b["paused"], b["limit"], b["notice"]) == (False, 2, None)
    assert (s["paused"], s["notice"]) == (False, None)
    up.fake.reset()
    code, _ = await post(client, url)
    assert code == 200
    assert set(up.fake.stats()["keys"]) == {KEY_B}, "the paused key's sibling serves"
    answer = await client.put(f"{proxy.url}/_slotproxy/providers/openai/keys/team-a/limit", json={"limit": 2})
    assert answer.status == 200
    assert (await answer.json())["keys"][0]["auto_reduced"] is False
    missing = await client.put(f"{proxy.url}/_slotproxy/providers/openai/keys/nope/limit", json={"limit": 2})
    assert missing.status == 404
    assert "no key 'nope'" in (await missing.json())["error"]["message"]


async def test_a_retried_429_takes_the_other_key(start_proxy, client, backend_yaml, pool_env) -> None:
    app = web.Application()
    seen: list[str] = []

    async def flaky(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", ""))
        if len(seen) == 1:
            return web.json_response({"error": {"type": "rate_limit_error"}}, status=429,
                                     headers={"retry-after": "0"})
        return web.json_response({"ok": True})

    app.router.add_post("/v1/chat/completions", flaky)
    runner, port = await serve_app(app)
    try:
        proxy = await start_proxy(pool_yaml(f"http://127.0.0.1:{port}", backend_yaml, retry=1))
        code, _ = await post(client, f"{proxy.url}/openai/chat/completions")
        assert code == 200
        assert seen == [f"Bearer {KEY_A}", f"Bearer {KEY_B}"]
    finally:
        await runner.cleanup()


async def test_a_conversation_sticks_to_its_key(start_upstream, start_proxy, client, backend_yaml,
                                                pool_env) -> None:
    up = await start_upstream()
    proxy = await start_proxy(pool_yaml(up.url, backend_yaml))
    url = f"{proxy.url}/openai/chat/completions"
    assert (await post(client, url, **{"X-Conversation-Id": "c1"}))[0] == 200
    holder = asyncio.create_task(post(client, url, **{"X-Conversation-Id": "c2", "x-fake-stall-ms": "600"}))
    await wait_until(lambda: up.fake.stats()["keys"].get(KEY_A, {}).get("in_flight") == 1, what="c2 on key a")
    assert (await post(client, url, **{"X-Conversation-Id": "c1"}))[0] == 200
    assert up.fake.stats()["keys"][KEY_A]["requests"] == 3, "c1 went back to key a though b had more room"
    assert (await post(client, url, **{"X-Conversation-Id": "c3"}))[0] == 200
    assert up.fake.stats()["keys"][KEY_B]["requests"] == 1, "a new conversation takes the freest key"
    assert (await holder)[0] == 200


async def test_a_key_missing_from_the_environment_is_left_out(start_upstream, start_proxy, client, backend_yaml,
                                                              pool_env, caplog) -> None:
    up = await start_upstream()
    keys = ("{name: team-a, api_key_env: SP_TEST_KEY_A, limit: 1},\n"
            "            {name: team-c, api_key_env: SP_TEST_KEY_UNSET, limit: 5}")
    with caplog.at_level("WARNING"):
        proxy = await start_proxy(pool_yaml(up.url, backend_yaml, keys=keys))
    assert any("SP_TEST_KEY_UNSET, which is unset or empty: key 'team-c' is left out" in r.getMessage()
               for r in caplog.records)
    url = f"{proxy.url}/openai/chat/completions"
    results = await asyncio.gather(*(post(client, url) for _ in range(3)))
    assert [code for code, _ in results] == [200] * 3
    assert set(up.fake.stats()["keys"]) == {KEY_A}
    assert up.fake.stats()["max_concurrency"] == 1
    keys_status = (await status(proxy))["keys"]
    assert [(k["name"], k["available"]) for k in keys_status] == [("team-a", True), ("team-c", False)]


async def test_a_model_cap_serialises_its_model_while_another_runs(start_upstream, start_proxy, client,
                                                                   backend_yaml) -> None:
    up = await start_upstream()
    proxy = await start_proxy(
        f"state: {{path: null}}\n{backend_yaml}providers:\n  openai:\n    upstream: {up.url}/v1\n    limit: 4\n"
        "    models:\n      'big-*': {limit: 1}\n")
    url = f"{proxy.url}/openai/chat/completions"
    big = {**chat(), "model": "big-1"}
    first = asyncio.create_task(post(client, url, big, **{"x-fake-stall-ms": "500", "x-fake-tag": "big-first"}))
    await wait_until(lambda: up.fake.stats()["active"] == 1, what="the first big request upstream")
    second = asyncio.create_task(post(client, url, big, **{"x-fake-tag": "big-second"}))
    await asyncio.sleep(0.1)
    started = time.monotonic()
    assert (await post(client, url, {**chat(), "model": "small-1"}, **{"x-fake-tag": "small"}))[0] == 200
    assert time.monotonic() - started < 0.4, "another model is not held up behind the capped one"
    s = await status(proxy)
    assert s["models"] == [{"pattern": "big-*", "limit": 1, "configured_limit": 1, "in_flight": 1, "manual": False,
                             "manual_set_at": None}]
    assert s["queued"] == 1 and not second.done()
    assert (await first)[0] == 200 and (await second)[0] == 200
    assert [a["tag"] for a in up.fake.stats()["arrivals"]] == ["big-first", "small", "big-second"]
    assert up.fake.stats()["max_concurrency"] == 2, "the two big ones never ran together"
    lowered = await client.put(f"{proxy.url}/_slotproxy/providers/openai/models/big-%2A/limit", json={"limit": 3})
    assert lowered.status == 200 and (await lowered.json())["models"][0]["limit"] == 3
    missing = await client.put(f"{proxy.url}/_slotproxy/providers/openai/models/gpt-%2A/limit", json={"limit": 3})
    assert missing.status == 404


async def test_a_model_cap_reads_a_gemini_style_path(start_proxy, client, backend_yaml) -> None:
    app = web.Application()
    running = {"now": 0, "most": 0}

    async def generate(request: web.Request) -> web.Response:
        running["now"] += 1
        running["most"] = max(running["most"], running["now"])
        await asyncio.sleep(0.15)
        running["now"] -= 1
        return web.json_response({"candidates": [], "path": request.path})

    app.router.add_post("/v1beta/models/{call}", generate)
    runner, port = await serve_app(app)
    try:
        proxy = await start_proxy(
            f"state: {{path: null}}\n{backend_yaml}providers:\n  gemini:\n"
            f"    upstream: http://127.0.0.1:{port}\n    models:\n      'gemini-*-pro': {{limit: 1}}\n")
        url = f"{proxy.url}/gemini/v1beta/models/gemini-2.5-pro:generateContent"
        body = {"contents": [{"parts": [{"text": "hi"}]}]}
        results = await asyncio.gather(*(post(client, url, body) for _ in range(3)))
        assert [code for code, _ in results] == [200] * 3
        assert running["most"] == 1
    finally:
        await runner.cleanup()


async def test_a_spent_request_window_holds_the_next_request_until_its_reset(
        start_upstream, start_proxy, client, backend_yaml) -> None:
    up = await start_upstream(window_requests=2, window_seconds=2.0)
    proxy = await start_proxy(
        f"state: {{path: null}}\n{backend_yaml}providers:\n  openai:\n    upstream: {up.url}/v1\n"
        "    budgets: true\n    retry_on_429: 0\n")
    url = f"{proxy.url}/openai/chat/completions"
    opened = time.monotonic()
    for _ in range(2):
        assert (await post(client, url, chat(stream=False)))[0] == 200
    s = await status(proxy)
    assert s["budget"]["remaining_requests"] == 0 and s["budget"]["held_until"] is not None
    assert not s["paused"] and s["notice"] is None
    code, _ = await post(client, url, chat(stream=False))
    waited = time.monotonic() - opened
    assert code == 200
    assert 1.5 <= waited < 5.0, f"held until the window's reset (2 s after it opened), waited {waited:.2f}s"
    assert up.fake.stats()["rate_limited"] == 0, "the upstream never had to answer 429"
    assert (await status(proxy))["rejected"] == {"queue_full": 0, "queue_timeout": 0}


async def test_an_anthropic_unified_rejection_holds_until_its_reset(start_upstream, start_proxy, client,
                                                                    backend_yaml) -> None:
    up = await start_upstream(window_requests=1, window_seconds=2.0, unified=True)
    proxy = await start_proxy(
        f"state: {{path: null}}\n{backend_yaml}providers:\n  anthropic:\n    upstream: {up.url}\n"
        "    auth: x-api-key\n    budgets: true\n    retry_on_429: 0\n")
    url = f"{proxy.url}/anthropic/v1/messages"
    body = {"model": "claude-x", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    opened = time.monotonic()
    assert (await post(client, url, body))[0] == 200
    assert (await status(proxy, "anthropic"))["budget"]["held_until"] is not None
    assert (await post(client, url, body))[0] == 200
    assert time.monotonic() - opened >= 1.0
    assert up.fake.stats()["rate_limited"] == 0


async def test_budgets_are_off_by_default(start_upstream, start_proxy, client, backend_yaml) -> None:
    up = await start_upstream(window_requests=1, window_seconds=5.0)
    proxy = await start_proxy(
        f"state: {{path: null}}\n{backend_yaml}providers:\n  openai:\n    upstream: {up.url}/v1\n"
        "    retry_on_429: 0\n")
    url = f"{proxy.url}/openai/chat/completions"
    assert (await post(client, url, chat(stream=False)))[0] == 200
    assert (await post(client, url, chat(stream=False)))[0] == 429
    assert "budget" not in await status(proxy)


async def test_max_share_keeps_a_workspace_to_its_share_while_another_waits(
        start_upstream, start_proxy, client, backend_yaml) -> None:
    up = await start_upstream()
    proxy = await start_proxy(
        f"state: {{path: null}}\n{backend_yaml}workspaces: {{max_share: 0.5}}\nproviders:\n  openai:\n"
        f"    upstream: {up.url}/v1\n    limit: 4\n")
    url = f"{proxy.url}/openai/chat/completions"

    def run(tag: str, stall: int = 0, age: float = 0.0) -> asyncio.Task[tuple[int, bytes]]:
        headers = {"X-Workspace-Id": tag[0], "x-fake-tag": tag, "x-fake-stall-ms": str(stall),
                   "X-Prompt-Started-At": str(int((time.time() - age) * 1000))}
        return asyncio.create_task(post(client, url, chat(stream=False), **headers))

    hog = [run(f"a-hog{i}", stall=300 + 200 * i) for i in range(4)]
    await wait_until(lambda: up.fake.stats()["active"] == 4, what="a, alone, takes every slot")
    older_a = [run(f"a-old{i}", age=100) for i in range(2)]
    await wait_queued(proxy, 2)
    newer_b = [run(f"b-new{i}", age=1) for i in range(2)]
    await wait_queued(proxy, 4)
    results = await asyncio.gather(*hog, *older_a, *newer_b)
    assert [code for code, _ in results] == [200] * 8
    arrivals = [a["tag"] for a in up.fake.stats()["arrivals"]]
    assert arrivals[4:] == ["b-new0", "b-new1", "a-old0", "a-old1"], \
        "a holds more than its share of 2 while b waits: b's newer prompts go first"
    assert up.fake.stats()["max_concurrency"] == 4, "the limit is never left idle"


async def test_check_warns_about_a_pool_key_missing_from_the_environment() -> None:
    config = parse_config(
        "providers:\n  openai:\n    upstream: https://api.openai.com/v1\n"
        "    keys: [{name: a, api_key_env: SET_ONE}, {name: b, api_key_env: UNSET_ONE}]\n")
    warnings = config.warnings({"SET_ONE": "x"})
    assert warnings == [("providers.openai.keys[1].api_key_env names $UNSET_ONE, which is unset or empty: key 'b' "
                         "is left out of the pool until it is set (with no key left, requests carry the client's "
                         "own credentials)")]
    assert json.dumps(config.masked())  # the masked view keeps the pool


async def test_a_429_for_a_spent_window_holds_without_lowering_the_limit(start_upstream, start_proxy, client,
                                                                         backend_yaml) -> None:
    up = await start_upstream(window_requests=1, window_seconds=1.0)
    proxy = await start_proxy(
        f"state: {{path: null}}\n{backend_yaml}providers:\n  openai:\n    upstream: {up.url}/v1\n"
        "    limit: 4\n    budgets: true\n    retry_on_429: 1\n")
    url = f"{proxy.url}/openai/chat/completions"
    results = await asyncio.gather(*(post(client, url, chat(stream=False), **{"x-fake-stall-ms": "100"})
                                     for _ in range(2)))
    assert [code for code, _ in results] == [200, 200], "the one sent before any answer is retried after the reset"
    assert up.fake.stats()["window_rejected"] == 1
    s = await status(proxy)
    assert (s["limit"], s["auto_reduced"], s["notice"]) == (4, False, None)
