"""The running process: graceful SIGTERM, JSON logs with secrets masked."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis

from proxy.config import parse_config
from proxy.http.runtime import ProxyState
from proxy.server.app import start_server

from ..backends.conftest import REDIS_URL, require_redis
from ..conftest import chat, wait_healthy
from ..ports import free_port

pytestmark = pytest.mark.asyncio


def spawn(config: Path, port: int, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--config", str(config), "--port", str(port), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
    )


async def test_sigterm_finishes_streams_answers_queued_503_and_exits_0(start_upstream, client, tmp_path: Path) -> None:
    upstream = await start_upstream(chunks=10, delay_ms=100)
    config = tmp_path / "slotproxy.yaml"
    config.write_text(textwrap.dedent(f"""\
        server: {{shutdown_grace: 10s}}
        state: {{path: null}}
        providers:
          openai: {{upstream: '{upstream.url}/v1', limit: 1}}
        """))
    port = free_port()
    process = spawn(config, port)
    try:
        await wait_healthy(client, f"http://127.0.0.1:{port}", process=process)
        url = f"http://127.0.0.1:{port}/openai/chat/completions"
        streaming = await client.post(url, json=chat())
        assert streaming.status == 200
        queued = asyncio.create_task(client.post(url, json=chat()))
        await asyncio.sleep(0.2)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        rejected = await queued
        assert rejected.status == 503
        assert rejected.headers["Retry-After"] == "1"
        assert (await rejected.json())["error"]["code"] == "shutting_down"
        async with client.get(f"http://127.0.0.1:{port}/readyz") as resp:
            assert resp.status == 503
        async with client.post(url, json=chat()) as resp:
            assert resp.status == 503
        body = await streaming.read()
        assert body.endswith(b"data: [DONE]\n\n")
        returncode = await asyncio.to_thread(process.wait, 15)
        assert returncode == 0
        assert time.monotonic() - signalled < 10
    finally:
        if process.poll() is None:
            process.kill()
        _, err = process.communicate(timeout=10)
    assert "shutting down" in err


async def test_json_logs_mask_secrets(start_upstream, client, tmp_path: Path) -> None:
    upstream = await start_upstream(retry_after=0.05)
    config = tmp_path / "slotproxy.yaml"
    config.write_text(textwrap.dedent(f"""\
        state: {{path: null}}
        providers:
          openai: {{upstream: '{upstream.url}/v1', limit: 2, api_key_env: TEST_PROVIDER_KEY, retry_on_429: 0}}
        """))
    port = free_port()
    secret = "sk-test-provider-key-abcdef123456"
    process = spawn(config, port, "--log-format", "json", "--log-level", "DEBUG", env={"TEST_PROVIDER_KEY": secret})
    try:
        await wait_healthy(client, f"http://127.0.0.1:{port}", process=process)
        url = f"http://127.0.0.1:{port}/openai/chat/completions"
        async with client.post(url, json=chat(), headers={"x-fake-status": "429",
                                                          "Authorization": "Bearer sk-client-key-987654321"}) as resp:
            assert resp.status == 429
        process.send_signal(signal.SIGTERM)
        _, err = await asyncio.to_thread(process.communicate, None, 15)
    finally:
        if process.poll() is None:
            process.kill()
    lines = [json.loads(line) for line in err.splitlines() if line.strip()]
    assert lines and all({"ts", "level", "logger", "message"} <= set(line) for line in lines)
    messages = " ".join(line["message"] for line in lines)
    assert "openai: upstream 429; limit 2 → 1; paused until" in messages
    assert secret not in err and "sk-client-key-987654321" not in err


async def test_a_port_already_taken_fails_start_up_without_leaving_redis_connections_open() -> None:
    """start_server opens the backend first; when the listener then cannot bind, what it opened is closed."""
    require_redis()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    state = ProxyState(parse_config(f"backend: {{kind: redis, url: '{REDIS_URL}', key_prefix: port-taken}}\n"
                                    "providers: {p: {upstream: 'http://127.0.0.1:9/v1'}}\nledger: {path: null}\n"))
    client = redis.Redis.from_url(REDIS_URL)
    try:
        with pytest.raises(OSError):
            await start_server(state, "127.0.0.1", port)
        name = f"slotproxy-{state.backend.replica}"  # type: ignore[attr-defined]
        assert [c for c in client.client_list() if c.get("name") == name] == []
    finally:
        client.close()
        taken.close()
