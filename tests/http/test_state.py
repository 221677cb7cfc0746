"""Runtime state across restarts: restore, YAML wins, corrupt files set aside, kill -9 never tears it."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.admin.status import provider_document
from proxy.config import parse_config
from proxy.http.runtime import ProxyState
from proxy.http.state import STATE_VERSION
from proxy.limiter import auto_reduce_notice
from proxy.server.app import start_server

from ..cli.test_cli import wait_http
from ..ports import free_port


def config_text(state_path: Path, limit: int = 4, starred: str = "[]") -> str:
    """The ledger goes beside the state file: a config with no file would put it in the working directory."""
    return textwrap.dedent(f"""\
        state: {{path: '{state_path}'}}
        ledger: {{path: '{state_path.parent / "ledger.sqlite"}'}}
        workspaces: {{starred: {starred}}}
        providers:
          openai: {{upstream: 'http://127.0.0.1:9/v1', limit: {limit}}}
          other: {{upstream: 'http://127.0.0.1:9/v2', limit: 5}}
        """)


async def restart(text: str) -> ProxyState:
    state = ProxyState(parse_config(text))
    return state


async def test_restart_restores_reduction_manual_limit_cooldown_and_stars(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    first = await restart(config_text(path))
    first.backend.report_backoff("openai", "429", 0.01, sent_at=time.time())
    first.backend.set_limit("other", 2)
    first.backend.set_cooldown("other", 1.5)
    first.set_star("release-team", True)
    first.state_file.save()
    await first.close()

    second = await restart(config_text(path))
    openai_status = second.backend.provider_status("openai").to_dict()
    assert (openai_status["limit"], openai_status["auto_reduced"], openai_status["auto_reduced_from"]) == (3, True, 4)
    assert openai_status["notice"] == auto_reduce_notice(3, "429")
    other = second.backend.provider_status("other").to_dict()
    assert (other["limit"], other["configured_limit"], other["cooldown_ms"], other["auto_reduced"]) == (2, 5, 1500, False)
    assert "release-team" in second.backend.starred()
    await second.close()


async def test_a_yaml_limit_edit_wins_over_the_state_file(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    first = await restart(config_text(path, limit=4))
    first.backend.report_backoff("openai", "429", 0.01, sent_at=time.time())
    first.state_file.save()
    await first.close()
    second = await restart(config_text(path, limit=6))
    status = second.backend.provider_status("openai").to_dict()
    assert (status["limit"], status["auto_reduced"], status["notice"]) == (6, False, None)
    await second.close()


async def test_unstarring_a_yaml_star_survives_a_restart_until_the_yaml_changes(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    first = await restart(config_text(path, starred="[team-a]"))
    first.set_star("team-a", False)
    first.state_file.save()
    await first.close()
    second = await restart(config_text(path, starred="[team-a]"))
    assert "team-a" not in second.backend.starred()
    second.apply(parse_config(config_text(path, starred="[]")))
    second.apply(parse_config(config_text(path, starred="[team-a]")))
    assert "team-a" in second.backend.starred()
    await second.close()


@pytest.mark.parametrize("content", ["{torn", "[]", '{"version": 99}', '{"version": 1, "providers": 3}'])
async def test_a_corrupt_state_file_is_set_aside_not_fatal(tmp_path: Path, content: str, caplog) -> None:
    path = tmp_path / "state.json"
    path.write_text(content)
    state = await restart(config_text(path))
    assert state.backend.provider_status("openai").limit == 4
    aside = list(tmp_path.glob("state.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_text() == content
    assert "unreadable" in caplog.text
    state.backend.set_limit("openai", 2)
    state.state_file.save()
    assert json.loads(path.read_text())["version"] == STATE_VERSION
    await state.close()


def _hammer(port: int, stop: threading.Event) -> None:
    rng = random.Random(port)
    while not stop.is_set():
        kind = rng.randrange(3)
        if kind == 0:
            path, body, method = "/_slotproxy/providers/openai/limit", {"limit": rng.randrange(1, 50)}, "PUT"
        elif kind == 1:
            path, body, method = "/_slotproxy/providers/other/cooldown", {"cooldown_ms": rng.randrange(0, 5000)}, "PUT"
        else:
            path, body, method = f"/_slotproxy/workspaces/ws{rng.randrange(20)}/star", {}, "PUT"
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                         method=method, headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(request, timeout=1).read()
        except OSError:
            return


KILLS = 25
"""Proxies SIGKILLed mid-burst (each start costs most of a second)."""


def test_kill_9_during_a_burst_of_changes_never_tears_the_state_file(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    config = tmp_path / "slotproxy.yaml"
    config.write_text(config_text(path))
    rng = random.Random(50)
    valid_writes = 0
    versions_seen: set[int] = set()
    for _ in range(KILLS):
        port = free_port()
        process = subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", "--config", str(config), "--port", str(port),
             "--log-level", "WARNING"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        stop = threading.Event()
        try:
            wait_http(f"http://127.0.0.1:{port}/healthz")
            threads = [threading.Thread(target=_hammer, args=(port, stop)) for _ in range(3)]
            for thread in threads:
                thread.start()
            time.sleep(rng.uniform(0.02, 0.15))
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
        finally:
            stop.set()
            if process.poll() is None:
                process.kill()
                process.wait()
        for thread in threads:
            thread.join(timeout=5)
        document = json.loads(path.read_text())
        assert document["version"] == STATE_VERSION
        assert set(document["providers"]) == {"openai", "other"}
        versions_seen.add(document["written_at"])
        valid_writes += 1
    assert valid_writes == KILLS
    assert len(versions_seen) >= KILLS // 2, "the kills must land during bursts of writes"
    assert not list(tmp_path.glob("state.json.corrupt-*"))


async def test_a_pool_keys_reduction_and_a_model_caps_manual_limit_survive_a_restart(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    monkeypatch.setenv("SP_STATE_KEY_A", "a")
    monkeypatch.setenv("SP_STATE_KEY_B", "b")
    text = textwrap.dedent(f"""\
        state: {{path: '{tmp_path / "state.json"}'}}
        providers:
          openai:
            upstream: 'http://127.0.0.1:9/v1'
            keys: [{{name: a, api_key_env: SP_STATE_KEY_A, limit: 3}}, {{name: b, api_key_env: SP_STATE_KEY_B}}]
            models: {{'big-*': {{limit: 4}}}}
        """)
    first = await restart(text)
    first.backend.report_backoff("openai", "429", 0.01, sent_at=time.time(), key="a")
    first.backend.set_model_limit("openai", "big-*", 1)
    first.state_file.save()
    await first.close()

    second = await restart(text)
    status = second.backend.provider_status("openai").to_dict()
    assert [(k["name"], k["limit"], k["auto_reduced_from"], k["notice"]) for k in status["keys"]] == [
        ("a", 2, 3, auto_reduce_notice(2, "429")), ("b", None, None, None)]
    assert status["models"] == [{"pattern": "big-*", "limit": 1, "configured_limit": 4, "in_flight": 0}]
    await second.close()


async def _serve(text: str) -> tuple[Any, str]:
    state = ProxyState(parse_config(text))
    runner, port = await start_server(state, "127.0.0.1", 0)
    return runner, f"http://127.0.0.1:{port}/_slotproxy"


async def test_a_limit_set_by_hand_is_shown_as_such_after_a_restart_and_delete_restores_it(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    async with aiohttp.ClientSession() as client:
        runner, admin = await _serve(config_text(path))
        async with client.put(f"{admin}/providers/openai/limit", json={"limit": 7}) as resp:
            set_at = (await resp.json())["manual_set_at"]
        await runner.cleanup()

        runner, admin = await _serve(config_text(path))
        async with client.get(f"{admin}/status") as resp:
            openai, other = (await resp.json())["providers"]
        assert (openai["limit"], openai["configured_limit"], openai["manual"], openai["manual_set_at"]) == \
            (7, 4, True, set_at)
        assert (other["manual"], other["manual_set_at"]) == (False, None)
        async with client.delete(f"{admin}/providers/openai/limit") as resp:
            body = await resp.json()
        assert (body["limit"], body["manual"], body["manual_set_at"]) == (4, False, None)
        await runner.cleanup()
    assert json.loads(path.read_text())["manual_limits"] == {}


async def test_a_yaml_edit_of_a_limit_set_by_hand_wins_and_ends_the_manual_mark(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    first = await restart(config_text(path, limit=4))
    first.backend.set_limit("openai", 2)
    first.manual_limits.set(("openai", "provider", ""), 2, 4, 1_700_000_000_000)
    first.state_file.save()
    await first.close()
    assert json.loads(path.read_text())["manual_limits"]["openai"]["limit"] == \
        {"limit": 2, "set_at": 1_700_000_000_000, "configured": 4}
    second = await restart(config_text(path, limit=6))
    status = provider_document(second, second.backend.provider_status("openai"))
    assert (status["limit"], status["manual"], status["manual_set_at"]) == (6, False, None)
    await second.close()
