"""``slotproxy serve --workers N`` (SPEC, "All the cores of one host"): real processes on one port, a real Redis.

Which worker served a connection is read where the OS says it: the proxy's end of the test's connection is a
socket in ``/proc/net/tcp`` whose inode one worker's ``/proc/<pid>/fd`` points at. Every scrape of ``/metrics``
and every ``/usage`` is on a connection of its own, so on whichever worker the kernel picks: each must answer
for the whole host.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.server.workers import Supervisor

from ..backends.conftest import REDIS_URL, delete_prefix, require_redis
from ..conftest import chat
from ..ports import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    require_redis()
    prefix = f"slotproxy-test-{uuid.uuid4().hex[:10]}"
    yield prefix
    delete_prefix(REDIS_URL, prefix)


def write_config(path: Path, upstream_url: str, prefix: str, limit: int) -> None:
    path.write_text(textwrap.dedent(f"""\
        server: {{shutdown_grace: 5s}}
        state: {{path: null}}
        ledger: {{path: ledger.sqlite}}
        backend: {{kind: redis, url: '{REDIS_URL}', key_prefix: {prefix}, lease_ttl: 2s}}
        providers:
          openai: {{upstream: '{upstream_url}/v1', limit: {limit}}}
        """))


class Fleet:
    """``serve --workers N`` in a process of its own; its stderr goes to a file the test reads as it goes."""

    def __init__(self, config: Path, workers: int = 2) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = config.parent / "stderr.log"
        with open(self.log, "w") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "proxy", "serve", "--config", str(config), "--port", str(self.port),
                 "--workers", str(workers)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, text=True)

    def stderr(self) -> str:
        return self.log.read_text()

    def workers(self) -> list[int]:
        """The pids of the parent's children (its workers)."""
        children = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == self.process.pid:
                children.append(int(entry))
        return sorted(children)

    def serving(self, client_port: int) -> int:
        """The worker holding the proxy's end of the connection from ``client_port``."""
        inodes = set()
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            local, remote = fields[1].split(":")[1], fields[2].split(":")[1]
            if int(local, 16) == self.port and int(remote, 16) == client_port:
                inodes.add(f"socket:[{fields[9]}]")
        for pid in self.workers():
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                        return pid
                except OSError:
                    continue
        raise AssertionError(f"no worker holds the connection from port {client_port}")

    async def up(self, timeout: float = 20) -> None:
        """Until the parent has printed its start-up line (every worker listens)."""
        deadline = time.monotonic() + timeout
        while "dashboard: " not in self.stderr():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the fleet did not start:\n{self.stderr()}")
            await asyncio.sleep(0.05)

    async def wait_for(self, text: str, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.stderr():
            if time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} in:\n{self.stderr()}")
            await asyncio.sleep(0.05)

    async def status(self) -> dict[str, Any]:
        """``/_slotproxy/status`` on a connection of its own (so on any worker); the provider's entry and the
        backend's."""
        async with aiohttp.ClientSession() as session, session.get(f"{self.url}/_slotproxy/status") as resp:
            document = await resp.json()
        return {**document["providers"][0], "replica": document["backend"]["replica"]}

    async def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return await asyncio.to_thread(self.process.wait, 20)

    def kill(self) -> None:
        if self.process.poll() is None:
            for pid in self.workers():
                os.kill(pid, signal.SIGKILL)
            self.process.kill()
            self.process.wait()


@pytest.fixture
def fleets() -> Iterator[list[Fleet]]:
    started: list[Fleet] = []
    yield started
    for fleet in started:
        fleet.kill()


def ledger_rows(path: Path) -> int:
    with sqlite3.connect(path) as db:
        return int(db.execute("SELECT count(*) FROM requests").fetchone()[0])


async def test_two_workers_share_one_port_and_one_limit_and_stop_together(
        start_upstream, redis_prefix: str, fleets: list[Fleet], tmp_path: Path) -> None:
    upstream = await start_upstream(chunks=5, delay_ms=20)
    config = tmp_path / "slotproxy.yaml"
    write_config(config, upstream.url, redis_prefix, limit=2)
    fleet = Fleet(config)
    fleets.append(fleet)
    await fleet.up()
    workers = fleet.workers()
    assert len(workers) == 2
    replicas = {(await fleet.status())["replica"] for _ in range(20)}
    assert len(replicas) == 2, "each worker is a replica of its own, and both answer on the port"

    async def one() -> int:  # a connection of its own each: the kernel spreads them over the workers
        async with aiohttp.ClientSession() as session, \
                session.post(f"{fleet.url}/openai/chat/completions", json=chat()) as resp:
            await resp.read()
            return resp.status

    assert await asyncio.gather(*(one() for _ in range(20))) == [200] * 20
    assert upstream.fake.stats()["max_concurrency"] <= 2, "the limit of 2 holds across both workers"

    assert await fleet.stop() == 0
    assert fleet.workers() == []
    assert ledger_rows(tmp_path / "ledger.sqlite") == 20, "both workers write the host's one ledger"
    assert not list(tmp_path.glob("ledger-w*")), "no ledger of a worker's own"
    err = fleet.stderr()
    assert err.count("dashboard: ") == 1, err
    assert "worker=1 " in err and "worker=2 " in err
    assert "Traceback" not in err


async def test_a_killed_worker_is_replaced_and_its_slot_comes_back(
        start_upstream, redis_prefix: str, fleets: list[Fleet], tmp_path: Path) -> None:
    upstream = await start_upstream(chunks=200, delay_ms=50)  # 10 s: the stream outlives the test's wait
    config = tmp_path / "slotproxy.yaml"
    write_config(config, upstream.url, redis_prefix, limit=1)
    fleet = Fleet(config)
    fleets.append(fleet)
    await fleet.up()
    async with aiohttp.ClientSession() as session:
        resp = await session.post(f"{fleet.url}/openai/chat/completions", json=chat())
        await resp.content.readany()
        assert resp.connection is not None and resp.connection.transport is not None
        victim = fleet.serving(resp.connection.transport.get_extra_info("sockname")[1])
        assert (await fleet.status())["in_flight"] == 1
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        await fleet.wait_for(f"(pid {victim}) exited with signal 9; starting a new one", timeout=3)
        await fleet.wait_for(" is serving", timeout=5)
        workers = fleet.workers()
        assert len(workers) == 2 and victim not in workers
        while (await fleet.status())["in_flight"]:
            assert time.monotonic() - killed < 4, "the killed worker's slot is reclaimed within lease_ttl (2 s)"
            await asyncio.sleep(0.1)
        resp.close()
        async with session.post(f"{fleet.url}/openai/chat/completions", json=chat(),
                                headers={"x-fake-chunks": "1"}) as again:
            assert again.status == 200
    assert await fleet.stop() == 0


async def test_sighup_reloads_every_worker(start_upstream, redis_prefix: str, fleets: list[Fleet],
                                           tmp_path: Path) -> None:
    upstream = await start_upstream()
    config = tmp_path / "slotproxy.yaml"
    write_config(config, upstream.url, redis_prefix, limit=2)
    fleet = Fleet(config)
    fleets.append(fleet)
    await fleet.up()
    fleet.process.send_signal(signal.SIGHUP)  # the file is unchanged: only the signal makes them reload
    await fleet.wait_for("worker=1 slotproxy: config reloaded (SIGHUP)")
    await fleet.wait_for("worker=2 slotproxy: config reloaded (SIGHUP)")
    write_config(config, upstream.url, redis_prefix, limit=5)
    fleet.process.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 5
    while (await fleet.status())["limit"] != 5:
        assert time.monotonic() < deadline, fleet.stderr()
        await asyncio.sleep(0.05)
    assert await fleet.stop() == 0


def test_workers_with_the_memory_backend_are_refused_in_one_line(tmp_path: Path) -> None:
    config = tmp_path / "slotproxy.yaml"
    config.write_text("state: {path: null}\nproviders:\n  openai: {upstream: 'http://127.0.0.1:9/v1'}\n")
    result = subprocess.run([sys.executable, "-m", "proxy", "serve", "--config", str(config), "--workers", "2"],
                            cwd=REPO, capture_output=True, text=True, timeout=30, check=False)
    line = ("slotproxy: --workers 2 needs backend.kind: redis (with the memory backend each worker would have "
            "limits of its own)")
    assert result.stderr.splitlines() == [line]
    assert result.returncode == 2


def test_a_port_in_use_ends_the_fleet_in_one_line(redis_prefix: str, tmp_path: Path) -> None:
    config = tmp_path / "slotproxy.yaml"
    write_config(config, "http://127.0.0.1:9", redis_prefix, limit=1)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "proxy", "serve", "--config", str(config), "--port",
                                 str(port), "--workers", "2"], cwd=REPO, capture_output=True, text=True, timeout=30,
                                check=False)
    [line] = result.stderr.splitlines()
    assert line.startswith(f"slotproxy: cannot listen on 127.0.0.1:{port}: the port is in use (by pid {os.getpid()}")
    assert result.returncode == 2


FAILING_WORKER = "import sys; print('slotproxy: worker ' + sys.argv[1] + ' cannot start', file=sys.stderr); sys.exit(2)"


async def test_a_worker_that_cannot_start_ends_the_command_with_its_status_not_a_restart_loop(capfd) -> None:
    starts: list[int] = []

    def command(index: int, fd: int) -> list[str]:
        starts.append(index)
        return [sys.executable, "-c", FAILING_WORKER, str(index)]

    code = await asyncio.wait_for(Supervisor(2, command, grace=lambda: 1.0).run(), 20)
    assert code == 2
    assert len(starts) == len(set(starts)), f"each worker started once at most, none again: {starts}"
    err = capfd.readouterr().err
    assert "slotproxy: worker 1 cannot start" in err or "slotproxy: worker 2 cannot start" in err


# ----- /metrics and /usage answer for the whole host ----------------------------------------------------------


async def send(fleet: Fleet, conversation: str) -> int:
    """One streamed request (with its usage) on a connection of its own; the pid of the worker that served it."""
    body = {**chat(), "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as session, \
            session.post(f"{fleet.url}/openai/chat/completions", json=body,
                         headers={"X-Conversation-Id": conversation}) as resp:
        assert resp.connection is not None and resp.connection.transport is not None
        served_by = fleet.serving(resp.connection.transport.get_extra_info("sockname")[1])
        await resp.read()
        assert resp.status == 200
        return served_by


def sample(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include ``labels`` (0 when there is none)."""
    total = 0.0
    for match in re.finditer(rf"^{name}{{([^}}]*)}} (\S+)$", text, re.MULTILINE):
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if all(found.get(key) == value for key, value in labels.items()):
            total += float(match.group(2))
    return total


async def scrape(fleet: Fleet) -> tuple[float, float, float]:
    """Requests answered, queue waits observed and input tokens, from ``/metrics`` on a connection of its own."""
    async with aiohttp.ClientSession() as session, session.get(f"{fleet.url}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    return (sample(text, "slotproxy_requests_total", provider="openai", status="200"),
            sample(text, "slotproxy_queue_wait_seconds_count", provider="openai"),
            sample(text, "slotproxy_tokens_total", provider="openai", type="input"))


async def usage(fleet: Fleet) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, \
            session.get(f"{fleet.url}/_slotproxy/usage", params={"by": "conversation"}) as resp:
        assert resp.status == 200
        document: dict[str, Any] = await resp.json()
    return document


async def settled(fleet: Fleet, sent: int) -> tuple[float, float, float]:
    """Until a scrape counts every request sent (each worker copies its counts out every second)."""
    deadline = time.monotonic() + 5
    while (reading := await scrape(fleet))[0] != sent:
        assert reading[0] < sent, f"more requests counted than sent: {reading}"
        assert time.monotonic() < deadline, f"{reading[0]} requests counted, {sent} sent"
        await asyncio.sleep(0.1)
    return reading


async def send_until_both_served(fleet: Fleet, prefix: str, at_least: int) -> tuple[int, set[int]]:
    """Requests until both workers served one and ``at_least`` were sent, scraping after each: the count
    never goes back."""
    served: set[int] = set()
    sent = 0
    last = 0.0
    while sent < at_least or len(served) < 2:
        assert sent < 60, "the kernel sent every connection to one worker"
        served.add(await send(fleet, f"{prefix}-{sent}"))
        sent += 1
        counted = (await scrape(fleet))[0]
        assert counted >= last, f"requests_total went back from {last} to {counted}"
        last = counted
    return sent, served


def host_folder(pid: int) -> Path:
    """The metrics folder the parent gave a worker (``PROMETHEUS_MULTIPROC_DIR`` in its environment)."""
    environ = dict(entry.split("=", 1) for entry in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in entry)
    return Path(environ["PROMETHEUS_MULTIPROC_DIR"])


async def test_metrics_and_usage_answer_for_the_whole_host_on_every_connection(
        start_upstream, redis_prefix: str, fleets: list[Fleet], tmp_path: Path) -> None:
    upstream = await start_upstream(chunks=3, delay_ms=20)  # a stream: its connection is open until the end
    config = tmp_path / "slotproxy.yaml"
    write_config(config, upstream.url, redis_prefix, limit=4)
    fleet = Fleet(config)
    fleets.append(fleet)
    await fleet.up()
    sent, _ = await send_until_both_served(fleet, "c", at_least=8)

    requests, waits, tokens = await settled(fleet, sent)
    assert waits == sent and tokens > 0
    for _ in range(12):
        assert await scrape(fleet) == (requests, waits, tokens), "every worker answers for the whole host"

    deadline = time.monotonic() + 5
    while len((await usage(fleet))["rows"]) != sent:  # each worker writes its rows every second
        assert time.monotonic() < deadline, await usage(fleet)
        await asyncio.sleep(0.1)
    for _ in range(8):
        rows = (await usage(fleet))["rows"]
        assert sorted(row["conversation"] for row in rows) == sorted(f"c-{n}" for n in range(sent))
        assert sum(row["input_tokens"] for row in rows) == tokens

    folder = host_folder(fleet.workers()[0])
    assert folder.is_dir() and folder.stat().st_mode & 0o077 == 0, "a private folder of the parent's"
    assert await fleet.stop() == 0
    assert not folder.exists(), "the parent removes the metrics folder when the fleet stops"
    assert "Traceback" not in fleet.stderr()


async def test_a_killed_worker_takes_no_count_back_and_its_replacement_adds_to_them(
        start_upstream, redis_prefix: str, fleets: list[Fleet], tmp_path: Path) -> None:
    upstream = await start_upstream(chunks=3, delay_ms=20)  # a stream: its connection is open until the end
    config = tmp_path / "slotproxy.yaml"
    write_config(config, upstream.url, redis_prefix, limit=4)
    fleet = Fleet(config)
    fleets.append(fleet)
    await fleet.up()
    sent, served = await send_until_both_served(fleet, "before", at_least=6)
    before = await settled(fleet, sent)

    victim = served.pop()
    os.kill(victim, signal.SIGKILL)
    await fleet.wait_for(f"(pid {victim}) exited with signal 9; starting a new one", timeout=3)
    while " is serving" not in fleet.stderr():
        assert (await scrape(fleet))[0] == sent, "the dead worker's counts stay in the host's"
        await asyncio.sleep(0.05)
    replacement = next(pid for pid in fleet.workers() if pid not in served)

    more, by = 0, set()
    while replacement not in by:
        assert more < 60, "the kernel sent no connection to the new worker"
        by.add(await send(fleet, f"after-{more}"))
        more += 1
    after = await settled(fleet, sent + more)
    assert after[1] == before[1] + more and after[2] > before[2]
    names = sorted(path.name for path in host_folder(replacement).iterdir())
    assert all(re.fullmatch(r"[a-z_]+_[12]\.db", name) for name in names), f"files by worker index: {names}"
    assert await fleet.stop() == 0
