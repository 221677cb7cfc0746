"""Live config: edits apply while streams run, broken edits are refused whole, SIGHUP and symlink swaps."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from proxy.admin.status import status_document
from proxy.config import load_config
from proxy.http.runtime import ProxyState
from proxy.limiter import FakeClock
from proxy.server.app import start_server
from proxy.server.run import ConfigWatcher

from ..cli.test_cli import wait_http
from ..conftest import chat, wait_until
from ..ports import free_port


def write_config(path: Path, upstream_url: str, limit: int | str, extra: str = "") -> None:
    text = textwrap.dedent(f"""\
        state: {{path: null}}
        providers:
          openai: {{upstream: '{upstream_url}/v1', limit: {limit}}}
        """) + extra
    temp = path.with_suffix(".tmp")
    temp.write_text(text)
    os.replace(temp, path)


async def test_yaml_limit_edit_applies_live_without_dropping_streams(start_upstream, client, tmp_path: Path) -> None:
    upstream = await start_upstream(chunks=20, delay_ms=50)
    path = tmp_path / "slotproxy.yaml"
    write_config(path, upstream.url, 2)
    state = ProxyState(load_config(path), config_path=str(path))
    runner, port = await start_server(state, "127.0.0.1", 0)
    watcher = ConfigWatcher(state, str(path), interval=0.2)
    watcher.start()
    try:
        url = f"http://127.0.0.1:{port}/openai/chat/completions"

        async def stream() -> bytes:
            async with client.post(url, json=chat()) as resp:
                assert resp.status == 200
                return await resp.read()

        streams = [asyncio.create_task(stream()) for _ in range(20)]
        await wait_until(lambda: state.backend.provider_status("openai").in_flight == 2)
        edited = time.monotonic()
        write_config(path, upstream.url, 5)
        await wait_until(lambda: state.backend.provider_status("openai").limit == 5, timeout=3, what="limit 5 live")
        assert time.monotonic() - edited < 3
        assert state.config_error is None

        write_config(path, upstream.url, "lots")
        await wait_until(lambda: state.config_error is not None, timeout=3, what="config.error set")
        assert "providers.openai.limit" in state.config_error and "line" in state.config_error
        assert state.backend.provider_status("openai").limit == 5
        async with client.get(f"http://127.0.0.1:{port}/_slotproxy/status") as resp:
            assert (await resp.json())["config"]["error"] == state.config_error

        write_config(path, upstream.url, 4)
        await wait_until(lambda: state.config_error is None, timeout=3, what="config.error cleared")
        assert state.backend.provider_status("openai").limit == 4

        bodies = await asyncio.gather(*streams)
        assert all(body.endswith(b"data: [DONE]\n\n") for body in bodies)
        assert upstream.fake.stats()["max_concurrency"] <= 5
    finally:
        await watcher.stop()
        await runner.cleanup()


async def test_a_removed_provider_finishes_what_it_has_and_takes_nothing_new(
    start_upstream, client, tmp_path: Path
) -> None:
    upstream = await start_upstream(chunks=10, delay_ms=30)
    path = tmp_path / "slotproxy.yaml"
    write_config(path, upstream.url, 1, extra=f"  extra: {{upstream: '{upstream.url}/v1', limit: 1}}\n")
    state = ProxyState(load_config(path), config_path=str(path))
    runner, port = await start_server(state, "127.0.0.1", 0)
    watcher = ConfigWatcher(state, str(path))
    try:
        url = f"http://127.0.0.1:{port}/extra/chat/completions"
        running = asyncio.create_task(client.post(url, json=chat()))
        await wait_until(lambda: state.backend.provider_status("extra").in_flight == 1)
        queued = asyncio.create_task(client.post(url, json=chat()))
        await wait_until(lambda: state.backend.provider_status("extra").queued == 1)
        write_config(path, upstream.url, 1)
        assert watcher.reload("test")
        async with client.post(url, json=chat()) as resp:
            assert resp.status == 404
            assert (await resp.json())["error"]["code"] == "unknown_provider"
        for task in (running, queued):
            response = await task
            assert response.status == 200
            assert (await response.read()).endswith(b"data: [DONE]\n\n")
        new_names = [p["provider"] for p in status_document(state)["providers"]]
        assert "extra" not in new_names
    finally:
        await runner.cleanup()


async def test_changed_priority_header_names_apply_to_new_requests(start_upstream, client, tmp_path: Path) -> None:
    upstream = await start_upstream()
    path = tmp_path / "slotproxy.yaml"
    write_config(path, upstream.url, 2)
    state = ProxyState(load_config(path), config_path=str(path))
    runner, port = await start_server(state, "127.0.0.1", 0)
    try:
        write_config(path, upstream.url, 2, extra="headers: {workspace: X-Team}\n")
        assert ConfigWatcher(state, str(path)).reload("test")
        async with client.post(f"http://127.0.0.1:{port}/openai/chat/completions", json=chat(stream=False),
                               headers={"X-Team": "blue", "X-Workspace-Id": "kept"}) as resp:
            assert resp.status == 200
        seen = upstream.fake.stats()["last_headers"]
        assert "x-team" not in seen and seen["x-workspace-id"] == "kept"
    finally:
        await runner.cleanup()


def missing_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records
            if record.name == "slotproxy" and "is missing" in record.getMessage()]


async def test_a_deleted_config_file_is_one_warning_and_status_until_it_is_back(
    start_upstream, client, tmp_path: Path, caplog
) -> None:
    upstream = await start_upstream()
    path = tmp_path / "slotproxy.yaml"
    write_config(path, upstream.url, 2)
    state = ProxyState(load_config(path), config_path=str(path))
    runner, port = await start_server(state, "127.0.0.1", 0)
    clock = FakeClock(1_700_000_000.0)
    watcher = ConfigWatcher(state, str(path), clock=clock.time)
    caplog.set_level(logging.INFO, logger="slotproxy")
    try:
        path.unlink()
        for _ in range(5):  # five polls and a SIGHUP: one line
            watcher.check()
            clock.advance(1)
        assert not watcher.reload("SIGHUP")
        assert missing_lines(caplog) == [(
            f"config file {path} is missing (deleted or moved away); keeping the running config, and reading the "
            "file again as soon as it is back")]
        async with client.get(f"http://127.0.0.1:{port}/_slotproxy/status") as resp:
            config = (await resp.json())["config"]
        assert (config["missing_since"], config["error"]) == (1_700_000_000_000, None)
        async with client.post(f"http://127.0.0.1:{port}/openai/chat/completions", json=chat(stream=False)) as resp:
            assert resp.status == 200, "the running config is kept"
        assert state.backend.provider_status("openai").limit == 2

        caplog.clear()
        write_config(path, upstream.url, 5)
        watcher.check()
        assert state.config_missing_since is None and state.config_error is None
        assert state.backend.provider_status("openai").limit == 5
        assert "config reloaded (file is back): openai.limit 2 → 5" in [r.getMessage() for r in caplog.records]
        assert status_document(state)["config"]["missing_since"] is None

        caplog.clear()
        path.unlink()
        watcher.check()
        watcher.check()
        assert len(missing_lines(caplog)) == 1, "gone again: said again, once"
        write_config(path, upstream.url, 5)
        watcher.check()
        assert state.config_missing_since is None, "back with the same content: the warning is cleared all the same"
    finally:
        await runner.cleanup()


async def test_the_watchers_own_poll_says_a_missing_file_once(tmp_path: Path, caplog) -> None:
    path = tmp_path / "slotproxy.yaml"
    write_config(path, "http://127.0.0.1:9", 2)
    state = ProxyState(load_config(path), config_path=str(path))
    watcher = ConfigWatcher(state, str(path), interval=0.02)
    caplog.set_level(logging.INFO, logger="slotproxy")
    watcher.start()
    try:
        path.unlink()
        await wait_until(lambda: state.config_missing_since is not None, timeout=3, what="the file seen gone")
        await asyncio.sleep(0.2)  # ten more polls
        assert len(missing_lines(caplog)) == 1
        write_config(path, "http://127.0.0.1:9", 3)
        await wait_until(lambda: state.config_missing_since is None, timeout=3, what="the file seen back")
        assert state.backend.provider_status("openai").limit == 3
    finally:
        await watcher.stop()
        await state.close()


def _status(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/_slotproxy/status", timeout=5) as response:
        return json.load(response)


def _limit(port: int) -> int:
    return _status(port)["providers"][0]["limit"]


def _wait_for(predicate, timeout: float) -> float:
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise AssertionError("timed out")
        time.sleep(0.02)
    return time.monotonic() - started


@pytest.fixture
def serve(tmp_path: Path):
    processes: list[subprocess.Popen[str]] = []

    def start(config: Path) -> int:
        port = free_port()
        process = subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", "--config", str(config), "--port", str(port)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        processes.append(process)
        wait_http(f"http://127.0.0.1:{port}/healthz")
        return port

    yield start, processes
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=10)


def test_sighup_applies_the_file_at_once(serve, tmp_path: Path) -> None:
    start, processes = serve
    path = tmp_path / "slotproxy.yaml"
    write_config(path, "http://127.0.0.1:9", 2)
    port = start(path)
    # Write without changing content-visible timing: SIGHUP must apply before the next poll would.
    write_config(path, "http://127.0.0.1:9", 7)
    processes[0].send_signal(signal.SIGHUP)
    took = _wait_for(lambda: _limit(port) == 7, timeout=3)
    assert took < 1.0
    processes[0].send_signal(signal.SIGTERM)
    _, err = processes[0].communicate(timeout=30)
    assert "config reloaded (SIGHUP)" in err
    assert "config reloaded (file changed)" not in err


def test_configmap_style_symlink_swap_is_picked_up(serve, tmp_path: Path) -> None:
    start, _ = serve
    mount = tmp_path / "config"
    mount.mkdir()
    first = mount / "..2026_11_29_a"
    first.mkdir()
    write_config(first / "slotproxy.yaml", "http://127.0.0.1:9", 2)
    (mount / "..data").symlink_to(first.name)
    (mount / "slotproxy.yaml").symlink_to("..data/slotproxy.yaml")
    port = start(mount / "slotproxy.yaml")
    second = mount / "..2026_11_29_b"
    second.mkdir()
    write_config(second / "slotproxy.yaml", "http://127.0.0.1:9", 6)
    (mount / "..data_tmp").symlink_to(second.name)
    os.replace(mount / "..data_tmp", mount / "..data")
    took = _wait_for(lambda: _limit(port) == 6, timeout=3)
    assert took < 3
