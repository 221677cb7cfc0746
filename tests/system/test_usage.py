"""What each request cost, end to end: the ledger's rows through a real proxy in front of the fake provider,
``GET /_slotproxy/usage``, ``slotproxy usage``, the token metrics, and the fleet's aggregates on Redis."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from ..backends.conftest import REDIS_URL, delete_prefix, require_redis
from ..conftest import Proxy, Upstream, chat, wait_healthy, wait_until
from ..conftest import ledger_rows as rows
from ..ports import free_port

REPO = Path(__file__).resolve().parents[2]
TOKENS = ("input_tokens", "cached_input_tokens", "cache_write_tokens", "output_tokens", "reasoning_tokens")


def ledger_yaml(upstream: Upstream, ledger: Path, *, extra: str = "", provider: str = "") -> str:
    return (f"state: {{path: null}}\nledger: {{path: '{ledger}'}}\nproviders:\n"
            f"  openai:\n    upstream: {upstream.url}/v1\n{provider}"
            f"  anthropic:\n    upstream: {upstream.url}\n    auth: x-api-key\n{extra}")


async def post(client: aiohttp.ClientSession, url: str, body: dict[str, Any], **headers: str) -> tuple[int, bytes]:
    async with client.post(url, json=body, headers=headers) as resp:
        return resp.status, await resp.read()


def tokens(row: dict[str, Any]) -> tuple[int | None, ...]:
    return tuple(row[name] for name in TOKENS)


async def usage(client: aiohttp.ClientSession, proxy: Proxy, **params: str) -> tuple[int, dict[str, Any]]:
    async with client.get(f"{proxy.url}/_slotproxy/usage", params=params) as resp:
        return resp.status, await resp.json()


# --- rows for every way a request ends ------------------------------------------------------------------------


async def test_a_chat_stream_with_include_usage_is_one_row_with_its_tokens(start_upstream, start_proxy, client,
                                                                          tmp_path) -> None:
    up = await start_upstream(chunks=3, delay_ms=5)
    proxy = await start_proxy(ledger_yaml(up, tmp_path / "l.sqlite"))
    body = {**chat(), "model": "gpt-5", "stream_options": {"include_usage": True}}
    status, _ = await post(client, f"{proxy.url}/openai/chat/completions", body,
                           **{"X-Workspace-Id": "web", "X-Conversation-Id": "c-1", "X-Workspace-Starred": "1"})
    assert status == 200
    (row,) = await rows(proxy)
    assert (row["provider"], row["model"], row["workspace"], row["starred"], row["conversation"], row["transport"],
            row["status"], row["outcome"], row["retries"]) == ("openai", "gpt-5", "web", 1, "c-1", "http", 200, "ok", 0)
    assert row["output_tokens"] == 3 and row["input_tokens"] > 0
    assert row["ttfb_ms"] is not None and 0 <= row["ttfb_ms"] <= row["duration_ms"]
    assert abs(row["ended_at"] - time.time() * 1000) < 10_000


async def test_a_chat_stream_without_include_usage_has_unknown_tokens(start_upstream, start_proxy, client,
                                                                     tmp_path) -> None:
    up = await start_upstream(chunks=3, delay_ms=5)
    proxy = await start_proxy(ledger_yaml(up, tmp_path / "l.sqlite"))
    assert (await post(client, f"{proxy.url}/openai/chat/completions", chat()))[0] == 200
    (row,) = await rows(proxy)
    assert tokens(row) == (None,) * 5 and row["outcome"] == "ok"
    status, doc = await usage(client, proxy)
    assert status == 200
    assert doc["rows"][0]["unknown_usage"] == 1 and doc["rows"][0]["input_tokens"] == 0


async def test_a_429_relayed_after_its_retries_is_one_row(start_upstream, start_proxy, client, tmp_path) -> None:
    up = await start_upstream(retry_after=0.05)
    proxy = await start_proxy(ledger_yaml(up, tmp_path / "l.sqlite",
                                          provider="    retry_on_429: 2\n    default_pause: 50ms\n"))
    status, _ = await post(client, f"{proxy.url}/openai/chat/completions", chat(stream=False),
                           **{"x-fake-status": "429"})
    assert status == 429
    (row,) = await rows(proxy)
    assert (row["status"], row["outcome"], row["retries"]) == (429, "ok", 2)
    assert tokens(row) == (None,) * 5


async def test_a_client_gone_mid_stream_is_a_row(start_upstream, start_proxy, tmp_path) -> None:
    up = await start_upstream(chunks=100, delay_ms=30)
    proxy = await start_proxy(ledger_yaml(up, tmp_path / "l.sqlite"))
    async with aiohttp.ClientSession() as session:
        resp = await session.post(f"{proxy.url}/openai/chat/completions", json=chat())
        await resp.content.readline()
        resp.close()
    await wait_until(lambda: proxy.status()["in_flight"] == 0, what="the slot released")
    await wait_until(lambda: bool(proxy.state.ledger._pending), what="the row recorded")
    (row,) = await rows(proxy)
    assert (row["status"], row["outcome"]) == (200, "client_gone"), "its 200 headers had reached the client"


async def test_a_queue_timeout_is_a_rejected_row_with_its_wait(start_upstream, start_proxy, client,
                                                               tmp_path) -> None:
    up = await start_upstream(chunks=20, delay_ms=30)
    proxy = await start_proxy(ledger_yaml(up, tmp_path / "l.sqlite",
                                          provider="    limit: 1\n    queue_timeout: 200ms\n"))
    url = f"{proxy.url}/openai/chat/completions"
    holder = asyncio.create_task(post(client, url, chat(), **{"X-Workspace-Id": "holder"}))
    await wait_until(lambda: proxy.status()["in_flight"] == 1)
    assert (await post(client, url, chat(), **{"X-Workspace-Id": "late"}))[0] == 503
    await holder
    late = next(r for r in await rows(proxy) if r["workspace"] == "late")
    assert (late["status"], late["outcome"], late["ttfb_ms"]) == (503, "rejected", None)
    assert 150 <= late["queue_ms"] <= 2000


async def test_an_unreachable_upstream_is_an_upstream_error_row(start_proxy, client, tmp_path) -> None:
    proxy = await start_proxy(f"state: {{path: null}}\nledger: {{path: '{tmp_path / 'l.sqlite'}'}}\n"
                              f"providers:\n  openai:\n    upstream: http://127.0.0.1:{free_port()}/v1\n")
    assert (await post(client, f"{proxy.url}/openai/chat/completions", chat()))[0] == 502
    (row,) = await rows(proxy)
    assert (row["status"], row["outcome"]) == (502, "upstream_error")


async def test_each_websocket_response_is_a_row(start_upstream, start_proxy, client, tmp_path) -> None:
    up = await start_upstream(chunks=3, delay_ms=5)
    proxy = await start_proxy(ledger_yaml(up, tmp_path / "l.sqlite", provider="    limit: 2\n"))
    async with client.ws_connect(f"{proxy.url}/openai/responses",
                                 headers={"X-Workspace-Id": "codex-ws", "session-id": "s-9"}) as ws:
        for _ in range(2):
            await ws.send_str(json.dumps({"type": "response.create", "model": "gpt-5-codex", "input": []}))
            while json.loads((await ws.receive(timeout=5)).data)["type"] != "response.completed":
                pass
    await wait_until(lambda: proxy.status()["websockets"] == 0)
    found = await rows(proxy)
    assert [(r["transport"], r["status"], r["outcome"], r["model"], r["workspace"], r["conversation"])
            for r in found] == [("websocket", 200, "ok", "gpt-5-codex", "codex-ws", "s-9")] * 2
    assert all(r["output_tokens"] == 3 and r["input_tokens"] > 0 for r in found)


async def test_a_refused_upgrade_is_a_rejected_websocket_row(start_upstream, start_proxy, client, tmp_path) -> None:
    up = await start_upstream(websocket=False)
    proxy = await start_proxy(ledger_yaml(up, tmp_path / "l.sqlite"))
    async with client.get(f"{proxy.url}/openai/responses", headers={
            "Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}) as resp:
        assert resp.status == 426
    (row,) = await rows(proxy)
    assert (row["transport"], row["status"], row["outcome"]) == ("websocket", 426, "rejected")


async def test_a_gzip_json_answer_is_read_decoded(start_upstream, start_proxy, client, tmp_path) -> None:
    up = await start_upstream()
    proxy = await start_proxy(ledger_yaml(up, tmp_path / "l.sqlite"))
    async with client.post(f"{proxy.url}/openai/chat/completions", json=chat(stream=False),
                           headers={"x-fake-gzip": "1", "Accept-Encoding": "gzip"}) as resp:
        raw = await resp.read()
    assert json.loads(gzip.decompress(raw))["usage"]["completion_tokens"] == 5
    (row,) = await rows(proxy)
    assert row["output_tokens"] == 5


FIGURES = {"input": 1200, "cached": 1000, "cache_write": 50, "output": 90, "reasoning": 30}
CHAT = {"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": "claude-x", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}
ANTHROPIC_HEADERS = {"x-api-key": "k", "anthropic-version": "2023-06-01"}


@pytest.mark.parametrize(("path", "body", "headers", "expected"), [
    pytest.param("openai/chat/completions", {**CHAT, "stream": False}, {}, (1200, 1000, 0, 90, 30), id="chat-json"),
    pytest.param("openai/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True}}, {},
                 (1200, 1000, 0, 90, 30), id="chat-stream"),
    pytest.param("openai/completions", {"model": "m", "prompt": "hi", "stream": False}, {}, (1200, 1000, 0, 90, 30),
                 id="completions-json"),
    pytest.param("openai/responses", {"model": "gpt-5", "input": "hi"}, {}, (1200, 1000, 0, 90, 30),
                 id="responses-json"),
    pytest.param("openai/responses", {"model": "gpt-5", "input": "hi", "stream": True}, {},
                 (1200, 1000, 0, 90, 30), id="responses-stream"),
    pytest.param("anthropic/v1/messages", {**MESSAGES, "stream": False}, ANTHROPIC_HEADERS, (1200, 1000, 50, 90, 0),
                 id="anthropic-json"),
    pytest.param("anthropic/v1/messages", {**MESSAGES, "stream": True},
                 {**ANTHROPIC_HEADERS, "x-fake-usage-deltas": "3"}, (1200, 1000, 50, 90, 0),
                 id="anthropic-stream-three-deltas-not-added"),
    pytest.param("anthropic/v1/messages", {**MESSAGES, "stream": True},
                 {**ANTHROPIC_HEADERS, "x-fake-encoding": "gzip", "x-fake-usage-deltas": "2"},
                 (1200, 1000, 50, 90, 0), id="anthropic-gzip-stream"),
    pytest.param("openai/chat/completions", {**CHAT, "stream": False}, {"x-fake-gzip": "1"}, (1200, 1000, 0, 90, 30),
                 id="chat-gzip-json"),
    pytest.param("openai/responses", {"model": "gpt-5", "input": "hi", "stream": True}, {"x-fake-encoding": "br"},
                 (1200, 1000, 0, 90, 30), id="responses-br-stream"),
])
async def test_each_answer_shape_lands_in_the_ledger_normalised(start_upstream, start_proxy, client, tmp_path,
                                                                path, body, headers, expected) -> None:
    up = await start_upstream(chunks=4, delay_ms=2)
    proxy = await start_proxy(ledger_yaml(up, tmp_path / "l.sqlite"))
    async with client.post(f"{proxy.url}/{path}", json=body,
                           headers={**headers, "x-fake-usage": json.dumps(FIGURES)}) as resp:
        assert resp.status == 200
        await resp.read()
    (row,) = await rows(proxy)
    assert tokens(row) == expected
    assert row["outcome"] == "ok"


async def test_a_websocket_response_lands_normalised(start_upstream, start_proxy, client, tmp_path) -> None:
    up = await start_upstream(chunks=3, delay_ms=2)
    proxy = await start_proxy(ledger_yaml(up, tmp_path / "l.sqlite"))
    async with client.ws_connect(f"{proxy.url}/openai/responses") as ws:
        await ws.send_str(json.dumps({"type": "response.create", "model": "gpt-5", "x_fake": {"usage": FIGURES}}))
        while json.loads((await ws.receive(timeout=5)).data)["type"] != "response.completed":
            pass
    await wait_until(lambda: proxy.status()["websockets"] == 0)
    (row,) = await rows(proxy)
    assert (row["transport"], tokens(row)) == ("websocket", (1200, 1000, 0, 90, 30))


# --- the API, the command, the metrics --------------------------------------------------------------------------


async def test_usage_groups_filters_and_refuses_bad_parameters(start_upstream, start_proxy, client,
                                                               tmp_path) -> None:
    up = await start_upstream(chunks=2, delay_ms=1)
    proxy = await start_proxy(ledger_yaml(up, tmp_path / "l.sqlite"))
    for workspace, model, conversation in [("web", "gpt-5", "a"), ("web", "gpt-5", "b"), ("docs", "gpt-4o", "c")]:
        await post(client, f"{proxy.url}/openai/responses", {"model": model, "input": "hi"},
                   **{"X-Workspace-Id": workspace, "X-Conversation-Id": conversation})
    await post(client, f"{proxy.url}/anthropic/v1/messages",
               {"model": "claude-x", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
               **{"X-Workspace-Id": "docs", "x-api-key": "k", "anthropic-version": "2023-06-01"})
    status, doc = await usage(client, proxy)
    assert status == 200
    assert (doc["by"], doc["scope"]) == (["workspace"], "replica")
    assert doc["until"] - doc["since"] == 24 * 3600 * 1000
    assert sorted((r["workspace"], r["requests"]) for r in doc["rows"]) == [("docs", 2), ("web", 2)]
    totals = [r["input_tokens"] + r["output_tokens"] for r in doc["rows"]]
    assert totals == sorted(totals, reverse=True)
    assert set(doc["rows"][0]) == {"workspace", "requests", "errors", *TOKENS, "unknown_usage", "queue_ms_p50",
                                   "queue_ms_max", "cost_usd", "unpriced"}
    _, by_model = await usage(client, proxy, by="provider,model", since="1h")
    assert sorted((r["provider"], r["model"], r["requests"]) for r in by_model["rows"]) == [
        ("anthropic", "claude-x", 1), ("openai", "gpt-4o", 1), ("openai", "gpt-5", 2)]
    _, filtered = await usage(client, proxy, by="conversation", workspace="web", provider="openai")
    assert sorted(r["conversation"] for r in filtered["rows"]) == ["a", "b"]
    _, hourly = await usage(client, proxy, by="hour", since=str(int(time.time() * 1000) - 60_000))
    (hour,) = hourly["rows"]
    assert hour["hour"] % 3_600_000 == 0 and hour["requests"] == 4
    _, nothing = await usage(client, proxy, until=str(int(time.time() * 1000) - 3_600_000))
    assert nothing["rows"] == []
    for params, words in [({"by": "colour"}, "by: 'colour' is not a field"), ({"since": "last week"}, "since must"),
                          ({"team": "x"}, "unknown parameter 'team'")]:
        status, error = await usage(client, proxy, **params)
        assert status == 400, params
        assert words in error["error"]["message"]


async def test_the_token_metrics_count_by_provider_key_model_pattern_and_type(start_upstream, start_proxy, client,
                                                                               tmp_path) -> None:
    up = await start_upstream(chunks=4, delay_ms=1)
    proxy = await start_proxy(ledger_yaml(up, tmp_path / "l.sqlite",
                                          provider='    models: {"gpt-5*": {limit: 3}}\n'))
    for model in ("gpt-5-codex", "gpt-4o"):
        await post(client, f"{proxy.url}/openai/responses", {"model": model, "input": "hi"})
    metrics = proxy.state.metrics.render().decode()
    assert 'slotproxy_tokens_total{key="",model="gpt-5*",provider="openai",type="output"} 4.0' in metrics
    assert 'slotproxy_tokens_total{key="",model="other",provider="openai",type="output"} 4.0' in metrics
    assert 'slotproxy_ledger_dropped_total 0.0' in metrics


async def test_the_usage_command_prints_a_table_and_json(start_upstream, start_proxy, client, tmp_path) -> None:
    up = await start_upstream(chunks=2, delay_ms=1)
    proxy = await start_proxy(ledger_yaml(up, tmp_path / "l.sqlite"))
    await post(client, f"{proxy.url}/openai/responses", {"model": "gpt-5", "input": "hi"},
               **{"X-Workspace-Id": "web-app"})
    argv = [sys.executable, "-m", "proxy", "usage", "--url", proxy.url, "--since", "5h", "--by", "workspace,model"]
    table = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=30)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:2] == ["WORKSPACE", "MODEL"]
    assert any(line.split()[:3] == ["web-app", "gpt-5", "1"] for line in lines[1:]), table.stdout
    raw = await asyncio.to_thread(subprocess.run, [*argv, "--json"], capture_output=True, text=True, timeout=30)
    document = json.loads(raw.stdout)
    assert document["by"] == ["workspace", "model"] and document["rows"][0]["workspace"] == "web-app"
    bad = await asyncio.to_thread(subprocess.run, [*argv[:-2], "--by", "colour"], capture_output=True, text=True,
                                  timeout=30, check=False)
    assert bad.returncode == 2 and "by: 'colour' is not a field" in bad.stderr


# --- restarts, failures, the fleet ------------------------------------------------------------------------------


def serve(config: Path, port: int, *, wrap: list[str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([*(wrap or []), sys.executable, "-m", "proxy", "serve", "--config", str(config),
                             "--port", str(port)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def stop(process: subprocess.Popen[str]) -> str:
    process.send_signal(signal.SIGTERM)
    try:
        _, err = process.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate()
    return err


async def test_sigterm_flushes_and_a_restart_keeps_every_row(start_upstream, client, tmp_path) -> None:
    up = await start_upstream(chunks=2, delay_ms=1)
    config = tmp_path / "slotproxy.yaml"
    config.write_text(f"state: {{path: null}}\nledger: {{path: ledger.sqlite}}\n"
                      f"providers:\n  openai: {{upstream: '{up.url}/v1'}}\n")
    for round_ in range(2):
        port = free_port()
        process = serve(config, port)
        try:
            await wait_healthy(client, f"http://127.0.0.1:{port}", process=process)
            for _ in range(3):
                assert (await post(client, f"http://127.0.0.1:{port}/openai/chat/completions",
                                   chat(stream=False)))[0] == 200
        finally:
            stop(process)
        with sqlite3.connect(tmp_path / "ledger.sqlite") as connection:  # relative to the config's folder
            assert connection.execute("SELECT COUNT(*) FROM requests").fetchone()[0] == 3 * (round_ + 1)


async def test_a_read_only_ledger_folder_serves_every_request_and_counts_what_it_drops(
        start_upstream, client, tmp_path) -> None:
    up = await start_upstream(chunks=2, delay_ms=1)
    folder = tmp_path / "ledger"
    folder.mkdir()
    config = tmp_path / "slotproxy.yaml"
    config.write_text(f"state: {{path: null}}\nledger: {{path: '{folder / 'ledger.sqlite'}'}}\n"
                      f"providers:\n  openai: {{upstream: '{up.url}/v1'}}\n")
    port = free_port()
    if os.geteuid() == 0:  # root writes through file modes: mount the folder read-only in a namespace of its own
        mount = f"mount -t tmpfs -o ro tmpfs {folder} && exec \"$@\""
        process = serve(config, port, wrap=["unshare", "-m", "sh", "-c", mount, "sh"])
    else:
        os.chmod(folder, 0o500)
        process = serve(config, port)
    try:
        await wait_healthy(client, f"http://127.0.0.1:{port}", process=process)
        codes = [(await post(client, f"http://127.0.0.1:{port}/openai/chat/completions", chat(stream=False)))[0]
                 for _ in range(5)]
        assert codes == [200] * 5

        async def dropped() -> float:
            async with client.get(f"http://127.0.0.1:{port}/metrics") as resp:
                for line in (await resp.text()).splitlines():
                    if line.startswith("slotproxy_ledger_dropped_total"):
                        return float(line.split()[1])
            return 0.0

        deadline = time.monotonic() + 5
        while await dropped() < 5 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert await dropped() == 5
    finally:
        err = stop(process)
        os.chmod(folder, 0o700)
    failures = [line for line in err.splitlines() if "could not be written" in line]
    assert len(failures) == 1, err


@pytest.fixture
def redis_prefix() -> Any:
    require_redis()
    prefix = f"slotproxy-test-{os.urandom(5).hex()}"
    yield prefix
    client = __import__("redis").Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(f"{{{prefix}:*"))
    if keys:
        client.delete(*keys)
    client.close()
    delete_prefix(REDIS_URL, prefix)


async def test_two_replicas_on_one_redis_each_answer_for_the_fleet(start_upstream, start_proxy, client,
                                                                  tmp_path, redis_prefix) -> None:
    up = await start_upstream(chunks=2, delay_ms=1)
    backend = f"backend: {{kind: redis, url: '{REDIS_URL}', key_prefix: {redis_prefix}, lease_ttl: 2s}}\n"
    replicas = [await start_proxy(f"{backend}state: {{path: null}}\nledger: {{path: '{tmp_path / f'r{n}.sqlite'}'}}\n"
                                  f"providers:\n  openai: {{upstream: '{up.url}/v1'}}\n") for n in range(2)]
    for n, replica in enumerate(replicas):
        for _ in range(n + 1):
            await post(client, f"{replica.url}/openai/responses", {"model": "gpt-5", "input": "hi"},
                       **{"X-Workspace-Id": f"team-{n}", "X-Conversation-Id": f"conv-{n}"})
    for replica in replicas:  # each replica adds its rows to the fleet's within a second
        deadline = time.monotonic() + 5
        while True:
            status, doc = await usage(client, replica, by="workspace")
            assert status == 200 and doc["scope"] == "fleet"
            counted = sorted((r["workspace"], r["requests"]) for r in doc["rows"])
            if counted == [("team-0", 1), ("team-1", 2)] or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert counted == [("team-0", 1), ("team-1", 2)]
        assert all(r["output_tokens"] == 2 * r["requests"] for r in doc["rows"])
    _, own = await usage(client, replicas[1], by="conversation")
    assert own["scope"] == "replica" and [(r["conversation"], r["requests"]) for r in own["rows"]] == [("conv-1", 2)]
    keys = __import__("redis").Redis.from_url(REDIS_URL).keys(f"{{{redis_prefix}:openai}}:usage:*")
    assert len(keys) == 1


def test_check_and_serve_refuse_a_ledger_folder_that_does_not_exist(tmp_path) -> None:
    config = tmp_path / "slotproxy.yaml"
    config.write_text(textwrap.dedent("""\
        providers:
          openai: {upstream: 'http://127.0.0.1:9/v1'}
        ledger:
          path: no-such-folder/ledger.sqlite
    """))
    for command in (["check"], ["serve", "--port", str(free_port())]):
        result = subprocess.run([sys.executable, "-m", "proxy", *command, "--config", str(config)], cwd=REPO,
                                capture_output=True, text=True, timeout=30, check=False)
        assert result.returncode == 2, (command, result.stderr)
        assert f"ledger.path: the folder {tmp_path / 'no-such-folder'} does not exist" in result.stderr
