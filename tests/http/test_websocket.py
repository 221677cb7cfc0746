"""The WebSocket relay end to end: a real WebSocket client, the proxy and the fake provider's WebSocket mode,
on the memory and the Redis backend wherever a slot is involved."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import textwrap
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import WSMsgType, web

from ..conftest import Proxy, Upstream, chat, serve_app, wait_until
from ..ports import free_port

pytestmark = pytest.mark.asyncio

TERMINAL = {"response.completed", "response.failed", "response.incomplete", "error"}
BETA = {"OpenAI-Beta": "responses_websockets=2026-02-06"}
NOTICE = "Concurrency limit auto-reduced to 1 after a rate_limit_exceeded — restore manually when ready."


def ws_yaml(upstream: Upstream, backend: str = "", **settings: Any) -> str:
    lines = "".join(f"    {key}: {'null' if value is None else value}\n" for key, value in settings.items())
    return f"state: {{path: null}}\n{backend}providers:\n  openai:\n    upstream: {upstream.url}/v1\n{lines}"


async def status(proxy: Proxy) -> dict[str, Any]:
    await proxy.state.backend.flush()
    await proxy.state.backend.refresh()
    return proxy.status()


async def wait_status(proxy: Proxy, what: str, **expected: Any) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while True:
        current = await status(proxy)
        if all(current[key] == value for key, value in expected.items()):
            return current
        if loop.time() > deadline:
            raise AssertionError(f"{what}: wanted {expected}, status has "
                                 f"{ {key: current[key] for key in expected} }")
        await asyncio.sleep(0.02)


def connect(client: aiohttp.ClientSession, proxy: Proxy, **headers: str) -> Any:
    return client.ws_connect(f"{proxy.url}/openai/responses", headers={**BETA, **headers}, compress=15)


def turn_metadata(started_ms: int) -> dict[str, str]:
    return {"x-codex-turn-metadata": json.dumps({"turn_id": "t", "turn_started_at_unix_ms": started_ms})}


async def create(ws: aiohttp.ClientWebSocketResponse, *, turn_ms: int | None = None, **knobs: Any) -> None:
    frame: dict[str, Any] = {"type": "response.create", "model": "gpt-5", "input": [], "x_fake": knobs}
    if turn_ms is not None:
        frame["client_metadata"] = turn_metadata(turn_ms)
    await ws.send_str(json.dumps(frame))


async def until_terminal(ws: aiohttp.ClientWebSocketResponse, timeout: float = 10) -> list[dict[str, Any]]:
    events = []
    while True:
        message = await ws.receive(timeout=timeout)
        assert message.type is WSMsgType.TEXT, (message.type, message.data, message.extra)
        event = json.loads(message.data)
        events.append(event)
        if event["type"] in TERMINAL:
            return events


def now_ms() -> int:
    return int(time.time() * 1000)


# --- slots ---------------------------------------------------------------------------------------------------


async def test_a_second_socket_waits_for_the_first_responses_terminal_event(
        start_upstream, start_proxy, client, backend_yaml) -> None:
    up = await start_upstream(chunks=6, delay_ms=40)
    proxy = await start_proxy(ws_yaml(up, backend_yaml, limit=1))
    async with connect(client, proxy) as first, connect(client, proxy) as second:
        await create(first, tag="first")
        await wait_status(proxy, "first holds the slot", in_flight=1)
        await create(second, tag="second")
        queued = await wait_status(proxy, "second queued", queued=1)
        assert [(w["transport"], w["workspace"]) for w in queued["queue"]] == [("websocket", "default")]
        assert [(h["transport"], h["model"], h["workspace"]) for h in queued["holders"]] == \
            [("websocket", "gpt-5", "default")]
        assert queued["websockets"] == 2
        first_events = await until_terminal(first)
        second_events = await until_terminal(second)
    assert first_events[-1]["type"] == second_events[-1]["type"] == "response.completed"
    assert [a["tag"] for a in up.fake.arrivals] == ["first", "second"]
    assert up.fake.max_concurrency == 1
    await wait_status(proxy, "both released, sockets closed", in_flight=0, queued=0, websockets=0)


async def test_many_sockets_never_exceed_the_limit_upstream(start_upstream, start_proxy, client,
                                                            backend_yaml) -> None:
    up = await start_upstream(cap=2, chunks=3, delay_ms=15)
    proxy = await start_proxy(ws_yaml(up, backend_yaml, limit=2))

    async def session(n: int) -> list[str]:
        async with connect(client, proxy) as ws:
            endings = []
            for turn in range(3):
                await create(ws, tag=f"s{n}-{turn}")
                endings.append((await until_terminal(ws))[-1]["type"])
            return endings

    results = await asyncio.gather(*(session(n) for n in range(6)))
    assert results == [["response.completed"] * 3] * 6
    assert up.fake.max_concurrency == 2
    assert up.fake.rate_limited == 0
    await wait_status(proxy, "all released", in_flight=0)


async def test_queued_responses_go_oldest_turn_first_across_sockets(start_upstream, start_proxy, client,
                                                                    backend_yaml) -> None:
    up = await start_upstream(chunks=4, delay_ms=30)
    proxy = await start_proxy(ws_yaml(up, backend_yaml, limit=1))
    started = now_ms()
    async with connect(client, proxy) as holder, connect(client, proxy) as a, connect(client, proxy) as b, \
            connect(client, proxy) as c:
        await create(holder, tag="holder")
        await wait_status(proxy, "the slot is held", in_flight=1)
        await create(a, tag="newest", turn_ms=started - 1_000)
        await wait_status(proxy, "one queued", queued=1)
        await create(b, tag="oldest", turn_ms=started - 60_000)
        await wait_status(proxy, "two queued", queued=2)
        await create(c, tag="middle", turn_ms=started - 30_000)
        listed = await wait_status(proxy, "three queued", queued=3)
        assert [w["prompt_started_at"] for w in listed["queue"]] == [started - 60_000, started - 30_000,
                                                                     started - 1_000]
        for ws in (holder, a, b, c):
            await until_terminal(ws)
    assert [a["tag"] for a in up.fake.arrivals] == ["holder", "oldest", "middle", "newest"]


async def test_a_socket_without_turn_metadata_ages_each_response_from_its_own_arrival(
        start_upstream, start_proxy, client) -> None:
    """A socket lives for a whole session: its handshake time is never the age of a later turn."""
    up = await start_upstream(chunks=4, delay_ms=30)
    proxy = await start_proxy(ws_yaml(up, limit=1))
    async with connect(client, proxy) as early, connect(client, proxy) as holder:
        await asyncio.sleep(0.05)
        await create(holder, tag="holder")
        await wait_status(proxy, "the slot is held", in_flight=1)
        await create(early, tag="early-socket")
        listed = await wait_status(proxy, "queued", queued=1)
        assert listed["queue"][0]["prompt_started_at"] >= now_ms() - 1000
        await until_terminal(holder)
        await until_terminal(early)


async def test_the_http_body_turn_metadata_orders_requests_when_the_header_is_absent(
        start_upstream, start_proxy, client) -> None:
    up = await start_upstream(chunks=4, delay_ms=40)
    proxy = await start_proxy(ws_yaml(up, limit=1))
    url = f"{proxy.url}/openai/responses"

    async def post(tag: str, turn_ms: int | None) -> int:
        body = {"model": "m", "input": "hi", "stream": True}
        if turn_ms is not None:
            body["client_metadata"] = turn_metadata(turn_ms)
        async with client.post(url, json=body, headers={"x-fake-tag": tag}) as resp:
            await resp.read()
            return resp.status

    holder = asyncio.create_task(post("holder", None))
    await wait_status(proxy, "held", in_flight=1)
    newer = asyncio.create_task(post("newer", now_ms() - 1_000))
    await wait_status(proxy, "one queued", queued=1)
    older = asyncio.create_task(post("older", now_ms() - 90_000))
    await wait_status(proxy, "two queued", queued=2)
    assert await asyncio.gather(holder, newer, older) == [200, 200, 200]
    assert [a["tag"] for a in up.fake.arrivals] == ["holder", "older", "newer"]


async def test_a_socket_keeps_its_key_and_its_responses_wait_for_that_keys_slot(
        start_upstream, start_proxy, client, backend_yaml, monkeypatch) -> None:
    monkeypatch.setenv("SP_WS_KEY_A", "sk-ws-key-a")
    monkeypatch.setenv("SP_WS_KEY_B", "sk-ws-key-b")
    up = await start_upstream(chunks=4, delay_ms=40)
    keys = ("[{name: a, api_key_env: SP_WS_KEY_A, limit: 1}, {name: b, api_key_env: SP_WS_KEY_B, limit: 1}]")
    proxy = await start_proxy(ws_yaml(up, backend_yaml, keys=keys))
    async with connect(client, proxy, Authorization="Bearer client-own") as ws:
        assert up.fake.last_headers["authorization"] == "Bearer sk-ws-key-a"
        holder = asyncio.create_task(client.post(f"{proxy.url}/openai/chat/completions", json=chat(),
                                                 headers={"x-fake-chunks": "10", "x-fake-delay-ms": "40"}))
        await wait_status(proxy, "the http request holds key a", in_flight=1)
        await create(ws, tag="ws")
        waiting = await wait_status(proxy, "the socket's response waits for key a", queued=1)
        assert [k["in_flight"] for k in waiting["keys"]] == [1, 0]
        events = await until_terminal(ws)
        assert events[-1]["type"] == "response.completed"
        async with await holder as resp:
            assert resp.status == 200
            await resp.read()
    assert up.fake.keys["sk-ws-key-a"].max_concurrent == 1
    assert "client-own" not in up.fake.keys


async def test_a_model_cap_holds_socket_responses_by_the_frames_model(start_upstream, start_proxy, client) -> None:
    up = await start_upstream(chunks=4, delay_ms=30)
    proxy = await start_proxy(ws_yaml(up, limit=4, models='{"big-*": {limit: 1}}'))
    async with connect(client, proxy) as a, connect(client, proxy) as b:
        await a.send_str(json.dumps({"type": "response.create", "model": "big-1"}))
        await wait_status(proxy, "big-1 in flight", in_flight=1)
        await b.send_str(json.dumps({"type": "response.create", "model": "big-2"}))
        await wait_status(proxy, "big-2 queued under the cap", queued=1)
        await until_terminal(a)
        await until_terminal(b)
    assert up.fake.max_concurrency == 1


async def test_a_queue_timeout_answers_an_error_frame_and_the_socket_stays_open(
        start_upstream, start_proxy, client, backend_yaml) -> None:
    up = await start_upstream(chunks=20, delay_ms=50)
    proxy = await start_proxy(ws_yaml(up, backend_yaml, limit=1, queue_timeout="300ms"))
    async with connect(client, proxy) as holder, connect(client, proxy) as late:
        await create(holder)
        await wait_status(proxy, "held", in_flight=1)
        await create(late)
        refused = await until_terminal(late)
        assert refused[-1]["type"] == "error"
        assert refused[-1]["status"] == 503
        assert refused[-1]["error"]["code"] == "queue_timeout"
        await until_terminal(holder)
        await create(late, chunks=1)
        assert (await until_terminal(late))[-1]["type"] == "response.completed"
    metrics = proxy.state.metrics.render().decode()
    assert 'slotproxy_requests_total{provider="openai",status="503"} 1.0' in metrics


# --- every way a socket ends releases its slot ----------------------------------------------------------


async def test_a_client_close_mid_response_releases_the_slot_at_once(start_upstream, start_proxy, client,
                                                                     backend_yaml) -> None:
    up = await start_upstream(chunks=100, delay_ms=50)
    proxy = await start_proxy(ws_yaml(up, backend_yaml, limit=1))
    ws = await connect(client, proxy)
    await create(ws)
    await ws.receive(timeout=5)
    await wait_status(proxy, "held", in_flight=1)
    await ws.close(code=4000, message=b"bye")
    await wait_status(proxy, "released", in_flight=0, websockets=0)
    await wait_until(lambda: up.fake.active == 0, what="the upstream socket closed too")
    assert "499" in proxy.state.metrics.render().decode()


async def test_an_upstream_close_mid_response_releases_and_closes_the_client_with_its_code(
        start_upstream, start_proxy, client, backend_yaml) -> None:
    up = await start_upstream(chunks=10, delay_ms=20)
    proxy = await start_proxy(ws_yaml(up, backend_yaml, limit=1))
    async with connect(client, proxy) as ws:
        await create(ws, **{"close-after": 2})
        while True:
            message = await ws.receive(timeout=5)
            if message.type is not WSMsgType.TEXT:
                break
        assert message.type is WSMsgType.CLOSE
        assert ws.close_code == 1011
    await wait_status(proxy, "released", in_flight=0, websockets=0)


async def test_an_upstream_that_vanishes_mid_response_releases_the_slot(start_upstream, start_proxy, client,
                                                                       backend_yaml) -> None:
    up = await start_upstream(chunks=10, delay_ms=20)
    proxy = await start_proxy(ws_yaml(up, backend_yaml, limit=1))
    async with connect(client, proxy) as ws:
        await create(ws, **{"drop-after": 2})
        while (await ws.receive(timeout=5)).type is WSMsgType.TEXT:
            pass
    await wait_status(proxy, "released", in_flight=0, websockets=0)


async def test_a_killed_client_releases_its_slot_at_once(start_upstream, start_proxy, backend_yaml) -> None:
    up = await start_upstream(chunks=200, delay_ms=50)
    proxy = await start_proxy(ws_yaml(up, backend_yaml, limit=1))
    script = textwrap.dedent(f"""
        import asyncio, json, aiohttp
        async def main():
            async with aiohttp.ClientSession() as s:
                ws = await s.ws_connect("{proxy.url}/openai/responses")
                await ws.send_str(json.dumps({{"type": "response.create", "model": "m"}}))
                await ws.receive()
                print("streaming", flush=True)
                await asyncio.sleep(60)
        asyncio.run(main())
    """)
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE)
    try:
        assert child.stdout is not None
        assert (await asyncio.wait_for(child.stdout.readline(), 20)).strip() == b"streaming"
        await wait_status(proxy, "held", in_flight=1)
        killed_at = time.monotonic()
        child.send_signal(signal.SIGKILL)
        await wait_status(proxy, "released after SIGKILL", in_flight=0, websockets=0)
        assert time.monotonic() - killed_at < 2
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()


async def test_idle_timeout_closes_both_sockets_with_1011_and_releases(start_upstream, start_proxy, client,
                                                                      backend_yaml) -> None:
    up = await start_upstream(chunks=3, delay_ms=10)
    proxy = await start_proxy(ws_yaml(up, backend_yaml, limit=1, idle_timeout="300ms"))
    async with connect(client, proxy) as ws:
        await create(ws, **{"stall-ms": 3000})
        message = await ws.receive(timeout=5)
        assert message.type is WSMsgType.CLOSE
        assert ws.close_code == 1011
        assert message.extra == "idle_timeout"
    await wait_status(proxy, "released", in_flight=0, websockets=0)
    assert 'status="504"' in proxy.state.metrics.render().decode()


async def test_pings_are_answered_by_the_proxy_and_do_not_keep_a_stalled_response_alive(
        start_upstream, start_proxy, client) -> None:
    up = await start_upstream(chunks=3, delay_ms=10)
    proxy = await start_proxy(ws_yaml(up, limit=1, idle_timeout="400ms"))
    async with client.ws_connect(f"{proxy.url}/openai/responses", autoping=False) as ws:
        await ws.ping(b"are-you-there")
        pong = await ws.receive(timeout=5)
        assert (pong.type, pong.data) == (WSMsgType.PONG, b"are-you-there")
        await create(ws, **{"stall-ms": 3000})
        created = time.monotonic()

        async def keep_pinging() -> None:
            while not ws.closed:
                await ws.ping()
                await asyncio.sleep(0.1)

        pinging = asyncio.create_task(keep_pinging())
        while (message := await ws.receive(timeout=5)).type is WSMsgType.PONG:
            pass
        pinging.cancel()
        await asyncio.gather(pinging, return_exceptions=True)
        assert message.type is WSMsgType.CLOSE
        assert ws.close_code == 1011
        assert 0.35 < time.monotonic() - created < 3


async def test_slot_timeout_closes_both_sockets_with_1011(start_upstream, start_proxy, client) -> None:
    up = await start_upstream(chunks=100, delay_ms=50)
    proxy = await start_proxy(ws_yaml(up, limit=1, slot_timeout="400ms"))
    async with connect(client, proxy) as ws:
        await create(ws)
        while (message := await ws.receive(timeout=5)).type is WSMsgType.TEXT:
            pass
        assert message.type is WSMsgType.CLOSE
        assert (ws.close_code, message.extra) == (1011, "slot_timeout")
    await wait_status(proxy, "released", in_flight=0, websockets=0)


# --- signals in frames ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["failed", "event"])
async def test_an_in_frame_rate_limit_pauses_and_reduces_with_the_notice(start_upstream, start_proxy, client,
                                                                        backend_yaml, form) -> None:
    up = await start_upstream(chunks=3, delay_ms=10)
    proxy = await start_proxy(ws_yaml(up, backend_yaml, limit=2, retry_on_429=2))
    async with connect(client, proxy) as ws:
        await create(ws, **{"stream-error": "rate_limit_exceeded", "stream-error-form": form})
        events = await until_terminal(ws)
    assert events[-1]["type"] == ("response.failed" if form == "failed" else "error")
    state = await wait_status(proxy, "paused and reduced", paused=True, limit=1)
    assert state["notice"] == NOTICE
    assert 6_000 < state["paused_until"] - now_ms() <= 6_400  # "Please try again in 6.379s"
    assert len(up.fake.arrivals) == 1  # relayed, not retried
    assert state["in_flight"] == 0


async def test_an_in_frame_overload_pauses_without_reducing(start_upstream, start_proxy, client,
                                                           backend_yaml) -> None:
    up = await start_upstream(chunks=3, delay_ms=10)
    proxy = await start_proxy(ws_yaml(up, backend_yaml, limit=2, overload_pause="2s"))
    async with connect(client, proxy) as ws:
        await create(ws, **{"stream-error": "server_is_overloaded", "stream-error-form": "event"})
        await until_terminal(ws)
    state = await wait_status(proxy, "paused", paused=True)
    assert (state["limit"], state["auto_reduced"], state["notice"]) == (2, False, None)


async def test_the_fakes_cap_error_frame_pauses_the_provider(start_upstream, start_proxy, client) -> None:
    """Over the upstream's own cap (a proxy limit set too high), the 429 error frame is a backoff signal."""
    up = await start_upstream(cap=1, chunks=10, delay_ms=30, retry_after=3)
    proxy = await start_proxy(ws_yaml(up, limit=3))
    async with connect(client, proxy) as a, connect(client, proxy) as b:
        await create(a)
        await a.receive(timeout=5)
        await create(b)
        refused = await until_terminal(b)
        assert (refused[-1]["type"], refused[-1]["status"]) == ("error", 429)
        await until_terminal(a)
    state = await wait_status(proxy, "paused and reduced", paused=True, limit=2)
    assert state["auto_reduced_from"] == 3


# --- the handshake -------------------------------------------------------------------------------------------


async def test_the_handshake_is_relayed_with_the_proxys_key_and_without_priority_headers(
        start_upstream, start_proxy, client, monkeypatch) -> None:
    monkeypatch.setenv("SP_WS_OPENAI_KEY", "sk-proxy-key")
    up = await start_upstream(chunks=2, delay_ms=5)
    proxy = await start_proxy(ws_yaml(up, limit=1, api_key_env="SP_WS_OPENAI_KEY"))
    headers = {"X-Workspace-Id": "web-app", "X-Workspace-Starred": "1", "session-id": "codex-session-1",
               "Sec-WebSocket-Protocol": "realtime"}
    async with client.ws_connect(f"{proxy.url}/openai/responses", headers={**BETA, **headers},
                                 protocols=("realtime",)) as ws:
        seen = dict(up.fake.last_headers)
        assert ws.protocol == "realtime"
        await create(ws)
        await until_terminal(ws)
    assert seen["authorization"] == "Bearer sk-proxy-key"
    assert seen["openai-beta"] == "responses_websockets=2026-02-06"
    assert seen["session-id"] == "codex-session-1"
    assert "x-workspace-id" not in seen and "x-workspace-starred" not in seen


async def test_a_socket_carries_its_handshakes_workspace_star_and_session(start_upstream, start_proxy,
                                                                         client) -> None:
    up = await start_upstream(chunks=6, delay_ms=40)
    proxy = await start_proxy(ws_yaml(up, limit=1))
    async with connect(client, proxy) as holder, \
            connect(client, proxy, **{"X-Workspace-Id": "docs", "X-Workspace-Starred": "yes",
                                      "session-id": "s-42"}) as ws:
        await create(holder)
        await wait_status(proxy, "held", in_flight=1)
        await create(ws)
        waiter = (await wait_status(proxy, "queued", queued=1))["queue"][0]
        assert (waiter["workspace"], waiter["starred"], waiter["conversation"], waiter["transport"]) == \
            ("docs", True, "s-42", "websocket")
        await until_terminal(holder)
        await until_terminal(ws)


async def upgrade(client: aiohttp.ClientSession, url: str, **headers: str) -> tuple[int, dict[str, Any]]:
    """An upgrade whose refusal is read whole."""
    wire = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==", **BETA, **headers}
    async with client.get(url, headers=wire) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_an_upgrade_the_upstream_refuses_with_404_gets_426_at_once(start_upstream, start_proxy,
                                                                        client) -> None:
    up = await start_upstream(websocket=False)
    proxy = await start_proxy(ws_yaml(up, retry_on_429=3))
    started = time.monotonic()
    code, body = await upgrade(client, f"{proxy.url}/openai/responses")
    assert (code, body["error"]["code"]) == (426, "websocket_unsupported")
    assert "404" in body["error"]["message"]
    assert time.monotonic() - started < 1
    assert up.fake.requests == 0


@pytest.mark.parametrize("refusal", ["405", "400"])
async def test_any_other_refusal_gets_426(start_upstream, start_proxy, client, refusal) -> None:
    up = await start_upstream()
    proxy = await start_proxy(ws_yaml(up))
    code, body = await upgrade(client, f"{proxy.url}/openai/responses", **{"x-fake-ws-refuse": refusal})
    assert (code, body["error"]["code"]) == (426, "websocket_unsupported")


async def test_websocket_false_answers_426_without_reaching_upstream(start_upstream, start_proxy, client) -> None:
    up = await start_upstream()
    proxy = await start_proxy(ws_yaml(up, websocket="false"))
    code, body = await upgrade(client, f"{proxy.url}/openai/responses")
    assert (code, body["error"]["code"]) == (426, "websocket_unsupported")
    assert "providers.openai.websocket is false" in body["error"]["message"]
    assert up.fake.websockets_opened == 0 and not up.fake.last_headers


async def test_an_unreachable_upstream_gets_426(start_proxy, client) -> None:
    proxy = await start_proxy(f"state: {{path: null}}\nproviders:\n  openai:\n"
                              f"    upstream: http://127.0.0.1:{free_port()}/v1\n")
    code, body = await upgrade(client, f"{proxy.url}/openai/responses")
    assert (code, body["error"]["code"]) == (426, "websocket_unsupported")
    assert "could not be reached" in body["error"]["message"]


async def test_a_429_on_the_upgrade_pauses_is_retried_after_the_pause_then_relayed(
        start_upstream, start_proxy, client, backend_yaml) -> None:
    up = await start_upstream()
    proxy = await start_proxy(ws_yaml(up, backend_yaml, limit=3, retry_on_429=1))
    started = time.monotonic()
    code, body = await upgrade(client, f"{proxy.url}/openai/responses",
                               **{"x-fake-ws-refuse": "429"})
    assert code == 429
    assert body["error"]["type"] in ("rate_limit_error", "requests", "tokens")
    assert time.monotonic() - started >= 0.9  # the fake's Retry-After is 1 s: one retry after the pause
    assert up.fake.rate_limited == 2
    state = await wait_status(proxy, "reduced once per attempt, each a burst of its own", limit=1)
    assert state["auto_reduced_from"] == 3


async def test_a_cross_site_handshake_gets_403_and_nothing_reaches_upstream(start_upstream, start_proxy,
                                                                           client) -> None:
    up = await start_upstream()
    proxy = await start_proxy(ws_yaml(up))
    code, body = await upgrade(client, f"{proxy.url}/openai/responses", Origin="http://evil.example")
    assert (code, body["error"]["code"]) == (403, "forbidden")
    code, _ = await upgrade(client, f"{proxy.url}/openai/responses", **{"Sec-Fetch-Site": "cross-site"})
    assert code == 403
    assert up.fake.websockets_opened == 0 and not up.fake.last_headers


async def test_binary_frames_and_other_events_pass_both_ways_without_a_slot(start_proxy, client) -> None:
    """Against an upstream of the test's own that echoes: nothing but response.create takes a slot."""
    async def echo(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for message in ws:
            if message.type is WSMsgType.BINARY:
                await ws.send_bytes(message.data[::-1])
            else:
                await ws.send_str(message.data.upper())
        return ws

    app = web.Application()
    app.router.add_get("/v1/responses", echo)
    runner, port = await serve_app(app)
    try:
        proxy = await start_proxy(f"state: {{path: null}}\nproviders:\n  openai:\n"
                                  f"    upstream: http://127.0.0.1:{port}/v1\n    limit: 1\n")
        async with connect(client, proxy) as ws:
            await ws.send_bytes(b"\x00\x01\x02")
            assert (await ws.receive(timeout=5)).data == b"\x02\x01\x00"
            await ws.send_str('{"type": "response.cancel"}')
            assert (await ws.receive(timeout=5)).data == '{"TYPE": "RESPONSE.CANCEL"}'
            assert (await status(proxy))["in_flight"] == 0
    finally:
        await runner.cleanup()


async def test_metrics_count_open_sockets_and_each_response(start_upstream, start_proxy, client) -> None:
    up = await start_upstream(chunks=2, delay_ms=5)
    proxy = await start_proxy(ws_yaml(up, limit=2))
    async with connect(client, proxy) as ws:
        for _ in range(2):
            await create(ws)
            await until_terminal(ws)
        metrics = proxy.state.metrics.render().decode()
        assert 'slotproxy_websockets{provider="openai"} 1.0' in metrics
        assert 'slotproxy_requests_total{provider="openai",status="200"} 2.0' in metrics
    await wait_status(proxy, "closed", websockets=0)
    assert 'slotproxy_websockets{provider="openai"} 0.0' in proxy.state.metrics.render().decode()


async def test_graceful_shutdown_closes_idle_sockets_and_lets_a_response_finish(start_upstream, start_proxy,
                                                                               client) -> None:
    from proxy.server.run import shutdown

    up = await start_upstream(chunks=8, delay_ms=40)
    proxy = await start_proxy(ws_yaml(up, limit=2))
    idle = await connect(client, proxy)
    busy = await connect(client, proxy)
    await create(busy)
    await wait_status(proxy, "in flight", in_flight=1)
    stopping = asyncio.create_task(shutdown(proxy.state, proxy.runner))
    closed = await idle.receive(timeout=5)
    assert (closed.type, idle.close_code) == (WSMsgType.CLOSE, 1001)
    events = await until_terminal(busy)
    assert events[-1]["type"] == "response.completed"
    await stopping


def tokens_window(proxy: Proxy) -> dict[str, Any]:
    rows = [row for row in proxy.status()["windows"] if row["window"] == "tokens_per_minute"]
    assert len(rows) == 1, proxy.status().get("windows")
    return rows[0]


async def test_a_continuation_is_charged_the_conversation_it_continues(start_upstream, start_proxy,
                                                                       client) -> None:
    """OpenAI charges a ``previous_response_id`` frame for the whole conversation: its estimate is the
    previous response's reported input and output, plus the new frame's bytes."""
    up = await start_upstream(tpm=1_000_000)
    proxy = await start_proxy(ws_yaml(up, windows="{tokens_per_minute: 1000000}"))
    async with connect(client, proxy) as ws:
        await create(ws, usage={"input": 50_000, "output": 3_000})
        first = (await until_terminal(ws))[-1]
        assert first["type"] == "response.completed"
        assert tokens_window(proxy)["reserved"] == 0
        await ws.send_str(json.dumps({"type": "response.create", "model": "gpt-5", "input": [],
                                      "previous_response_id": first["response"]["id"],
                                      "x_fake": {"delay-ms": 200, "chunks": 3}}))
        await wait_until(lambda: tokens_window(proxy)["reserved"] > 0, what="the continuation in flight")
        assert tokens_window(proxy)["reserved"] >= 53_000, "the previous response's 50000 in and 3000 out"
        last = (await until_terminal(ws))[-1]
        assert last["type"] == "response.completed"
    row = tokens_window(proxy)
    assert (row["reserved"], row["hits"]) == (0, 0)
    assert up.fake.stats()["rate_limited"] == 0


async def test_response_creates_held_on_the_prior_ratio_go_once_the_first_answer_teaches_the_real_one(
        start_upstream, start_proxy, client) -> None:
    """A cold start over WebSocket: six sessions each send a ``response.create`` of 100 000 bytes, estimated at
    the prior 0.30 tokens a byte (30 000) against a 100 000 TPM window, so three go and three are held (the
    refill would take 18 s more per waiter). The first answer reports 100 input tokens: the group's ratio
    moves, the held frames are costed again at once and go together."""
    up = await start_upstream(delay_ms=300, chunks=2)
    proxy = await start_proxy(ws_yaml(up, limit=10, windows="{tokens_per_minute: 100000, learn: false}"))
    frame = json.dumps({"type": "response.create", "model": "gpt-5", "input": "x" * 100_000,
                        "x_fake": {"usage": {"input": 100, "output": 5}}})

    async def session() -> str:
        async with connect(client, proxy) as ws:
            await ws.send_str(frame)
            return str((await until_terminal(ws, timeout=20))[-1]["type"])

    started = time.monotonic()
    sessions = [asyncio.create_task(session()) for _ in range(6)]
    await wait_until(lambda: [row["held"] for row in proxy.status()["windows"]] == [3],
                     what="three frames held by the window")
    assert await asyncio.gather(*sessions) == ["response.completed"] * 6
    elapsed = time.monotonic() - started
    assert elapsed < 5.0, f"the held frames went after the first answer, not after the refill: {elapsed:.2f} s"
    row = tokens_window(proxy)
    assert (row["reserved"], row["held"], row["hits"]) == (0, 0, 0)
    assert row["ratio"] is not None and row["ratio"] < 0.01, "learned from the first answers"


async def test_a_window_error_frame_empties_the_window_without_a_backoff(start_upstream, start_proxy,
                                                                          client) -> None:
    up = await start_upstream(tpm=10_000)
    proxy = await start_proxy(ws_yaml(up, limit=4, windows="{tokens_per_minute: 1000000, learn: false}"))
    async with connect(client, proxy) as ws:
        await create(ws, usage={"input": 9_990, "output": 1})
        assert (await until_terminal(ws))[-1]["type"] == "response.completed"
        await create(ws, usage={"input": 500, "output": 1})
        refused = (await until_terminal(ws))[-1]
        assert (refused["type"], refused["status"]) == ("error", 429)
        assert "tokens per min (TPM)" in refused["error"]["message"]
    document = await status(proxy)
    assert (document["limit"], document["auto_reduced"], document["notice"], document["paused"]) == \
        (4, False, None, False)
    row = tokens_window(proxy)
    assert (row["hits"], row["reserved"]) == (1, 0)
