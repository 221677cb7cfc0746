"""Shared fixtures: a real fake provider and a real proxy, both on 127.0.0.1 in this loop."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import subprocess
import tempfile
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import settings

from proxy.admin.status import status_document
from proxy.config import parse_config
from proxy.http.runtime import ProxyState
from proxy.server.app import start_server
from proxy.tools.fake_upstream import FakeUpstream, start_fake_upstream

# Hypothesis: "ci" is fixed-seed and quick; HYPOTHESIS_PROFILE=long searches harder.
settings.register_profile("ci", derandomize=True, max_examples=200, deadline=None, print_blob=True)
settings.register_profile("long", max_examples=5000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@dataclass
class Upstream:
    fake: FakeUpstream
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Proxy:
    state: ProxyState
    port: int
    runner: web.AppRunner

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def status(self, provider: str = "openai") -> dict[str, Any]:
        for entry in status_document(self.state)["providers"]:
            if entry["provider"] == provider:
                return entry
        raise KeyError(provider)


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    """Poll a cheap in-process predicate; generous bound, short step."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


@pytest.fixture
async def start_upstream() -> AsyncIterator[Callable[..., Awaitable[Upstream]]]:
    runners: list[web.AppRunner] = []

    async def start(**options: Any) -> Upstream:
        fake = FakeUpstream(**options)
        runner, port = await start_fake_upstream(fake)
        runners.append(runner)
        return Upstream(fake, port)

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def start_proxy(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Callable[..., Awaitable[Proxy]]]:
    """A proxy in this loop; its ledger (on by default) goes to a folder of the test's own unless the config
    says where."""
    proxies: list[Proxy] = []

    async def start(yaml_text: str) -> Proxy:
        text = textwrap.dedent(yaml_text)
        if "ledger:" not in text:
            folder = tmp_path_factory.mktemp("ledger")
            text += f"\nledger: {{path: '{folder / 'ledger.sqlite'}'}}\n"
        config = parse_config(text)
        state = ProxyState(config)
        runner, port = await start_server(state, "127.0.0.1", 0)
        proxy = Proxy(state, port, runner)
        proxies.append(proxy)
        return proxy

    yield start
    for proxy in proxies:
        await proxy.runner.cleanup()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        yield session


@contextlib.contextmanager
def machine_lock(name: str) -> Iterator[None]:
    """Held by one test at a time on this machine, whichever process runs it (the suite's xdist workers, or the
    suite of another checkout): for what two must not do at once. The lock goes when its process does."""
    with open(Path(tempfile.gettempdir()) / f"slotproxy-test-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


async def serve_app(app: web.Application) -> tuple[web.AppRunner, int]:
    """Serve a test's own aiohttp app on 127.0.0.1; the caller cleans the runner up."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, runner.addresses[0][1]


async def wait_healthy(client: aiohttp.ClientSession, url: str, *, process: subprocess.Popen[str] | None = None,
                       timeout: float = 15) -> None:
    """Poll ``{url}/healthz`` until it answers 200; fail early if the serving process died."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            async with client.get(f"{url}/healthz") as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if (process is not None and process.poll() is not None) or time.monotonic() > deadline:
            detail = process.stderr.read() if process is not None and process.stderr else ""
            raise AssertionError(f"proxy at {url} did not become healthy {detail}")
        await asyncio.sleep(0.05)


def provider_yaml(upstream: Upstream, **settings: Any) -> str:
    """A minimal config with one provider `openai` in front of the fake."""
    lines = [f"    upstream: {upstream.url}/v1"]
    for key, value in settings.items():
        lines.append(f"    {key}: {'null' if value is None else value}")
    body = "\n".join(lines)
    return f"state: {{path: null}}\nproviders:\n  openai:\n{body}\n"


def chat(stream: bool = True, user: str = "") -> dict[str, Any]:
    return {"model": "fake", "stream": stream, "user": user, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(params=["memory", "redis"])
def backend_yaml(request: pytest.FixtureRequest) -> Iterator[str]:
    """The ``backend:`` line of a proxy's config: none (memory), then a Redis of its own key prefix (removed
    afterwards), so a test taking it runs on both backends."""
    from .backends.conftest import REDIS_URL, delete_prefix, require_redis

    if request.param == "memory":
        yield ""
        return
    require_redis()
    prefix = f"slotproxy-test-{os.urandom(5).hex()}"
    yield f"backend: {{kind: redis, url: '{REDIS_URL}', key_prefix: {prefix}, lease_ttl: 2s}}\n"
    delete_prefix(REDIS_URL, prefix)


async def ledger_rows(proxy: Proxy) -> list[dict[str, Any]]:
    """Every row of the proxy's ledger file so far, oldest first, as dicts by column."""
    import sqlite3

    from proxy.ledger.store import COLUMNS

    await proxy.state.ledger.flush()
    path = proxy.state.ledger.path
    assert path is not None
    with sqlite3.connect(path) as connection:
        cursor = connection.execute(f"SELECT {', '.join(COLUMNS)} FROM requests ORDER BY rowid")
        return [dict(zip(COLUMNS, values, strict=True)) for values in cursor]
