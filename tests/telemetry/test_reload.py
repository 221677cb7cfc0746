"""A reload changes telemetry while the proxy runs: the next requests are traced by the new settings, and the
requests already traced end their spans on the old exporter, which then closes. Without the ``otel`` extra a
reload asking for telemetry is refused as an invalid file is."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from proxy.config import load_config
from proxy.http.runtime import ProxyState
from proxy.server.app import start_server
from proxy.server.run import ConfigWatcher
from proxy.telemetry import INSTALL_LINE

from ..conftest import wait_healthy, wait_until
from ..ports import free_port
from .conftest import Collector, start_collector, telemetry_yaml
from .test_off import HIDE_OPENTELEMETRY, environment


def write_config(path: Path, upstream_url: str, telemetry: str = "") -> None:
    temp = path.with_suffix(".tmp")
    temp.write_text(f"state: {{path: null}}\nledger: {{path: null}}\n{telemetry}"
                    f"providers:\n  openai: {{upstream: '{upstream_url}/v1', limit: 4}}\n")
    os.replace(temp, path)


async def serve_watched(path: Path, upstream_url: str, telemetry: str
                        ) -> tuple[ProxyState, web.AppRunner, int, ConfigWatcher]:
    """A proxy on ``path``'s config (written here), which it reloads as the file changes."""
    write_config(path, upstream_url, telemetry)
    state = ProxyState(load_config(path), config_path=str(path))
    runner, port = await start_server(state, "127.0.0.1", 0)
    watcher = ConfigWatcher(state, str(path), interval=0.1)
    watcher.start()
    return state, runner, port, watcher


def chat(stream: bool) -> dict[str, object]:
    return {"model": "fake", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}


async def test_a_reload_moves_telemetry_to_its_new_endpoint_and_the_streams_under_way_end_on_the_old(
        collector: Collector, start_upstream, client: aiohttp.ClientSession, tmp_path: Path) -> None:
    up = await start_upstream(chunks=10, delay_ms=60)
    second, second_runner = await start_collector()
    path = tmp_path / "slotproxy.yaml"
    state, runner, port, watcher = await serve_watched(path, up.url, telemetry_yaml(collector.url))
    url = f"http://127.0.0.1:{port}/openai/chat/completions"
    try:
        first = state.telemetry
        async with client.post(url, json=chat(stream=True)) as under_way:
            assert under_way.status == 200
            await under_way.content.readany()
            write_config(path, up.url, telemetry_yaml(second.url))
            await wait_until(lambda: state.telemetry is not first, timeout=5, what="the new telemetry")
            assert state.config_error is None
            async with client.post(url, json=chat(stream=False)) as after:
                assert after.status == 200
                await after.read()
            await second.wait_for_spans(3)
            assert not collector.kind("SERVER"), "the stream under way has not ended yet"
            assert first in state._retiring.values()
            await under_way.read()
        await collector.wait_for_spans(3)
        assert len(collector.kind("SERVER")) == len(second.kind("SERVER")) == 1
        assert {span.trace_id for span in collector.spans}.isdisjoint({span.trace_id for span in second.spans})
        await wait_until(lambda: not state._retiring, timeout=10, what="the old telemetry closed")

        write_config(path, up.url)
        await wait_until(lambda: state.telemetry is None, timeout=5, what="telemetry off")
        async with client.post(url, json=chat(stream=False)) as off:
            assert off.status == 200
            await off.read()
        await wait_until(lambda: not state._retiring, timeout=10, what="the second telemetry closed")
        assert len(second.kind("SERVER")) == 1

        write_config(path, up.url, telemetry_yaml(collector.url))
        await wait_until(lambda: state.telemetry is not None, timeout=5, what="telemetry on again")
        async with client.post(url, json=chat(stream=False)) as on:
            assert on.status == 200
            await on.read()
        await collector.wait_for_spans(6)
        assert len(collector.kind("SERVER")) == 2
    finally:
        await watcher.stop()
        await runner.cleanup()
        await second_runner.cleanup()


async def test_closing_the_proxy_does_not_wait_for_a_retired_telemetrys_requests(
        collector: Collector, start_upstream, client: aiohttp.ClientSession, tmp_path: Path) -> None:
    up = await start_upstream(chunks=100, delay_ms=100)
    path = tmp_path / "slotproxy.yaml"
    state, runner, port, watcher = await serve_watched(path, up.url, telemetry_yaml(collector.url))
    response = await client.post(f"http://127.0.0.1:{port}/openai/chat/completions", json=chat(stream=True))
    await response.content.readany()
    write_config(path, up.url)
    await wait_until(lambda: state.telemetry is None, timeout=5, what="telemetry off")
    assert len(state._retiring) == 1
    await watcher.stop()
    response.close()
    started = time.monotonic()
    await runner.cleanup()
    assert time.monotonic() - started < 8
    assert not state._retiring


def serve_without_opentelemetry(config: Path, port: int) -> subprocess.Popen[str]:
    """``slotproxy serve`` in a Python where the OpenTelemetry packages cannot be imported."""
    return subprocess.Popen([sys.executable, "-c", HIDE_OPENTELEMETRY, "serve", "--config", str(config),
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=environment())


async def test_without_the_otel_extra_a_reload_asking_for_telemetry_is_refused_naming_the_install(
        start_upstream, client: aiohttp.ClientSession, tmp_path: Path) -> None:
    up = await start_upstream()
    path = tmp_path / "slotproxy.yaml"
    write_config(path, up.url)
    port = free_port()
    serve = serve_without_opentelemetry(path, port)
    try:
        base = f"http://127.0.0.1:{port}"
        await wait_healthy(client, base, process=serve)
        write_config(path, up.url, telemetry_yaml("http://127.0.0.1:4318"))

        async def config_error() -> str | None:
            async with client.get(f"{base}/_slotproxy/status") as resp:
                return (await resp.json())["config"]["error"]

        deadline = time.monotonic() + 10
        while (error := await config_error()) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert error is not None and INSTALL_LINE in error and "http://127.0.0.1:4318" in error
        async with client.post(f"{base}/openai/chat/completions", json=chat(stream=False)) as resp:
            assert resp.status == 200
    finally:
        serve.terminate()
        output, _ = serve.communicate(timeout=30)
    assert "config reload refused" in output and INSTALL_LINE in output
