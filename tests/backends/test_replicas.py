"""Several `slotproxy serve` processes sharing one Redis: one limit, one queue order, one pause."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
import redis

from ..conftest import chat, wait_healthy
from ..ports import free_port
from .conftest import REDIS_URL, require_redis

pytestmark = pytest.mark.asyncio


class Replica:
    def __init__(self, config: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", "--config", str(config), "--port", str(self.port),
             "--log-level", "WARNING"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
        )

    async def status(self, client, provider: str = "openai") -> dict:
        async with client.get(f"{self.url}/_slotproxy/status") as resp:
            body = await resp.json()
        return next(p for p in body["providers"] if p["provider"] == provider)

    def stop(self) -> str:
        """SIGTERM, and what it logged."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        logged = ""
        if self.process.stderr and not self.process.stderr.closed:
            logged = self.process.stderr.read()
            self.process.stderr.close()
        return logged


def replica_config(tmp_path: Path, upstream_url: str, prefix: str, *, limit: int = 4, redis_url: str = REDIS_URL,
                   extra_backend: str = "", provider_extra: str = "") -> Path:
    path = tmp_path / f"replica-{prefix}-{limit}.yaml"
    path.write_text(textwrap.dedent(f"""\
        state: {{path: null}}
        backend: {{kind: redis, url: '{redis_url}', key_prefix: '{prefix}', lease_ttl: 2s{extra_backend}}}
        providers:
          openai: {{upstream: '{upstream_url}/v1', limit: {limit}{provider_extra}}}
        """))
    return path


@pytest.fixture
async def replicas(client) -> AsyncIterator[Callable[..., asyncio.Future]]:
    started: list[Replica] = []

    async def start(config: Path, count: int = 1, env: dict[str, str] | None = None) -> list[Replica]:
        batch = [Replica(config, env) for _ in range(count)]
        started.extend(batch)
        for replica in batch:
            await wait_healthy(client, replica.url, process=replica.process)
        return batch

    yield start
    for replica in started:
        replica.stop()


async def wait_for(predicate, timeout: float = 10.0, what: str = "condition") -> float:
    started = time.monotonic()
    while not await predicate():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)
    return time.monotonic() - started


def leases_in_redis(prefix: str, url: str = REDIS_URL) -> int:
    client = redis.Redis.from_url(url)
    try:
        return client.zcard(f"{{{prefix}:openai}}:leases") + client.zcard(f"{{{prefix}:openai}}:cooling")
    finally:
        client.close()


async def test_three_replicas_share_one_limit(start_upstream, client, replicas, key_prefix, tmp_path) -> None:
    require_redis()
    upstream = await start_upstream(cap=4, chunks=4, delay_ms=25)
    fleet = await replicas(replica_config(tmp_path, upstream.url, key_prefix, limit=4), count=3)

    async def one(i: int) -> int:
        async with client.post(f"{fleet[i % 3].url}/openai/chat/completions", json=chat(user=f"u{i}")) as resp:
            body = await resp.read()
            assert body.endswith(b"data: [DONE]\n\n")
            return resp.status

    assert await asyncio.gather(*(one(i) for i in range(60))) == [200] * 60
    stats = upstream.fake.stats()
    assert stats["max_concurrency"] == 4
    assert stats["rate_limited"] == 0
    await wait_for(lambda: _zero(client, fleet[0]), what="in_flight 0 cluster-wide")
    assert leases_in_redis(key_prefix) == 0


async def _zero(client, replica: Replica) -> bool:
    status = await replica.status(client)
    return status["in_flight"] == 0 and status["queued"] == 0


async def test_queue_order_is_global_across_replicas(start_upstream, client, replicas, key_prefix, tmp_path) -> None:
    require_redis()
    upstream = await start_upstream(chunks=1, delay_ms=1)
    a, b, c = await replicas(replica_config(tmp_path, upstream.url, key_prefix, limit=1), count=3)
    url = "/openai/chat/completions"
    holder = asyncio.create_task(client.post(a.url + url, json=chat(), headers={"x-fake-stall-ms": "1200",
                                                                                "x-fake-tag": "holder"}))
    await wait_for(lambda: _in_flight(client, a, 1), what="holder admitted")
    now_ms = int(time.time() * 1000)
    waiting = []
    for replica, tag, headers in (
        (a, "new", {"X-Prompt-Started-At": str(now_ms)}),
        (b, "old", {"X-Prompt-Started-At": str(now_ms - 600_000)}),
        (c, "starred", {"X-Prompt-Started-At": str(now_ms), "X-Workspace-Starred": "1"}),
    ):
        waiting.append(asyncio.create_task(client.post(replica.url + url, json=chat(),
                                                       headers={**headers, "x-fake-tag": tag})))
        count = len(waiting)
        await wait_for(lambda n=count: _queued(client, a, n), what=f"{tag} queued")
    for response in await asyncio.gather(holder, *waiting):
        assert response.status == 200
        await response.read()
        response.release()
    assert [x["tag"] for x in upstream.fake.stats()["arrivals"]] == ["holder", "starred", "old", "new"]


async def _in_flight(client, replica: Replica, count: int) -> bool:
    return (await replica.status(client))["in_flight"] == count


async def _queued(client, replica: Replica, count: int) -> bool:
    return (await replica.status(client))["queued"] == count


async def test_a_killed_replicas_slots_come_back_within_the_lease_ttl(
    start_upstream, client, replicas, key_prefix, tmp_path
) -> None:
    require_redis()
    upstream = await start_upstream(chunks=100, delay_ms=100)
    doomed, survivor = await replicas(replica_config(tmp_path, upstream.url, key_prefix, limit=2), count=2)
    url = "/openai/chat/completions"
    held = [asyncio.create_task(client.post(doomed.url + url, json=chat())) for _ in range(2)]
    await wait_for(lambda: _in_flight(client, survivor, 2), what="two slots held on the doomed replica")
    waiting = asyncio.create_task(client.post(survivor.url + url, json=chat(), headers={"x-fake-chunks": "1"}))
    await wait_for(lambda: _queued(client, survivor, 1), what="a waiter on the survivor")
    doomed.process.kill()
    killed_at = time.monotonic()
    response = await asyncio.wait_for(waiting, 10)
    assert response.status == 200
    assert time.monotonic() - killed_at < 2.0 + 2.0
    await response.read()
    for task in held:
        # The doomed replica died mid-stream: these ended with a connection error.
        with contextlib.suppress(aiohttp.ClientError):
            (await task).close()


async def test_a_429_on_one_replica_pauses_all_and_reduces_once(
    start_upstream, client, replicas, key_prefix, tmp_path
) -> None:
    require_redis()
    upstream = await start_upstream(retry_after=0.5)
    a, b = await replicas(replica_config(tmp_path, upstream.url, key_prefix, limit=4, provider_extra=", retry_on_429: 0"),
                          count=2)
    url = "/openai/chat/completions"
    # One burst: each 429 is held upstream for a second, so all three are granted before the first comes back
    # and lowers the limit (one granted after it would belong to a burst of its own), however busy the machine.
    burst = {"x-fake-status": "429", "x-fake-stall-ms": "1000"}
    results = await asyncio.gather(*(client.post(a.url + url, json=chat(), headers=burst) for _ in range(3)))
    assert [r.status for r in results] == [429] * 3
    assert upstream.fake.stats()["max_concurrency"] == 3, "the three were upstream at once"
    for r in results:
        r.release()
    # Replica a reports the backoff to Redis in the background, after answering: b sees it a moment later.
    deadline = time.monotonic() + 2.0
    while not (status := await b.status(client))["paused"] and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert status["paused"] and (status["limit"], status["auto_reduced_from"]) == (3, 4)
    started = time.monotonic()
    async with client.post(b.url + url, json=chat()) as resp:
        assert resp.status == 200
        await resp.read()
    assert time.monotonic() - started >= 0.2, "replica b waited out the pause replica a saw"


@pytest.mark.parametrize("mode", ["fail_closed", "local"])
async def test_redis_stopped_mid_run(start_upstream, client, replicas, private_redis, tmp_path, mode) -> None:
    upstream = await start_upstream(chunks=2, delay_ms=10)
    prefix = f"outage-{mode}"
    config = replica_config(tmp_path, upstream.url, prefix, limit=4, redis_url=private_redis.url,
                            extra_backend=f", on_backend_error: {mode}, local_limit: 1",
                            provider_extra=", queue_timeout: 1s")
    (replica,) = await replicas(config)
    url = f"{replica.url}/openai/chat/completions"
    async with client.post(url, json=chat()) as resp:
        assert resp.status == 200
        await resp.read()
    private_redis.stop()

    async def readyz_status() -> int:
        async with client.get(f"{replica.url}/readyz") as resp:
            return resp.status

    async def unready() -> bool:
        async with client.post(url, json=chat()) as resp:
            await resp.read()
        return await readyz_status() == 503

    await wait_for(unready, timeout=10, what="readyz 503 after redis went away")
    async with client.get(f"{replica.url}/metrics") as resp:
        assert 'slotproxy_backend_degraded{kind="redis",mode="' + mode + '"} 1.0' in await resp.text()
    if mode == "fail_closed":
        async with client.post(url, json=chat()) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "queue_timeout"
    else:
        before = upstream.fake.stats()["max_concurrency"]
        upstream.fake.reset()
        statuses = []
        for response in await asyncio.gather(*(client.post(url, json=chat()) for _ in range(6))):
            statuses.append(response.status)
            await response.read()
            response.release()
        assert statuses == [200] * 6
        assert upstream.fake.stats()["max_concurrency"] <= 1 <= before
    private_redis.start()

    async def ready() -> bool:
        return await readyz_status() == 200

    await wait_for(ready, timeout=10, what="readyz 200 after redis came back")

    async def served() -> bool:
        """Redis came back empty: grants resume once the replicas had a renew round to put back their slots."""
        async with client.post(url, json=chat()) as resp:
            await resp.read()
            return resp.status == 200

    await wait_for(served, timeout=10, what="a request served after redis came back")
    status = await replica.status(client)
    assert (status["limit"], status["configured_limit"]) == (4, 4), "the settings are back in the new redis"
    await wait_for(lambda: _zero(client, replica), what="nothing held after recovery")
    assert leases_in_redis(prefix, private_redis.url) == 0


async def test_fail_closed_cuts_a_stream_whose_lease_redis_can_no_longer_renew(start_upstream, client, replicas,
                                                                             private_redis, tmp_path) -> None:
    """Redis hangs mid-stream. Before the lease could expire there (and its slot go to another
    replica), fail_closed gives the slot up: the client's stream is cut and the upstream request closed."""
    upstream = await start_upstream(chunks=40, delay_ms=100)
    config = replica_config(tmp_path, upstream.url, "hang", limit=1, redis_url=private_redis.url,
                            extra_backend=", on_backend_error: fail_closed")
    (replica,) = await replicas(config)
    assert private_redis.process is not None
    async with client.post(f"{replica.url}/openai/chat/completions", json=chat(stream=True)) as resp:
        assert resp.status == 200
        await resp.content.readline()
        private_redis.process.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        try:
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()
            cut_after = time.monotonic() - started
        finally:
            private_redis.process.send_signal(signal.SIGCONT)
    assert cut_after < 2.0, "cut within 90% of lease_ttl (2 s) of the last renewal"
    await wait_for(lambda: _upstream_idle(upstream), what="the upstream request closed")
    logged = replica.stop()
    assert ("provider=openai the slot this answer held was given up: its lease could not be renewed in redis "
            "before it expired; the client's connection was cut") in logged
    assert "slot_timeout" not in logged


async def _upstream_idle(upstream) -> bool:
    return upstream.fake.stats()["active"] == 0
