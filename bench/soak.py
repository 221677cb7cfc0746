"""Memory per held stream and per queued waiter, and does a full queue slow the admitted streams? (a benchmark, not a test)

One slotproxy process (``python -m proxy serve --log-level WARNING``, ``state:
{path: null}``, provider ``soak`` with ``limit: null``, ``max_queue`` sized for
the run, ``queue_timeout``/``slot_timeout`` 1h; a second provider ``probe``, see d) in front of one
``slotproxy fake-upstream --chunks 600 --delay-ms 1000`` (no cap: a stream
lasts 10 min, one chunk a second). Client sockets come from ``--workers``
(default 4) spawned client processes, each an aiohttp ``ClientSession`` with
``TCPConnector(limit=0)``; the measured streams of (d) run in this process.
Steps, in this order, on the same proxy:

a. **Idle.** VmRSS of the proxy after start (base), and after a warm-up of 32
   short streams (warm idle).
b. **Held streams.** ``--streams`` (default 2000) streaming chat completions
   through the proxy, all held open: every one must have received its first
   chunk. The clients read slowly (they drain what has arrived every 5 s).
   KiB per held stream = (RSS held − RSS warm idle) / streams held.
c. **Queued waiters.** The limit is set live to the number of held streams
   (``PUT /_slotproxy/providers/soak/limit``), so they hold every slot; then
   ``--waiters`` (default 10000) more streaming requests (~200-byte JSON body,
   workspace/conversation/prompt-start headers like an agent's) are sent and
   queue. Once ``/metrics`` shows them all queued and 2 s have passed, VmRSS
   is read again. KiB per waiter beyond its own request body = (RSS queued −
   RSS just before the waiters were sent) / waiters − body size. Then
   ``GET /_slotproxy/status`` is checked (``queued`` = waiters, and its
   ``queue`` lists them all) and timed (3 calls), as is ``GET /metrics``
   (which builds the same status snapshot).
d. **Admitted streams with and without the queue.** ``--measured`` (default
   20) streams with ``x-fake-chunks: 40`` and ``x-fake-delay-ms: 50``, sent
   starred (``X-Workspace-Starred: 1``) so that they queue at the head; once
   ``/metrics`` shows them queued, the limit is raised by their number (they
   are admitted at once, ahead of every other waiter) and at once lowered back
   (so that their slots are not handed on when they end). Chunk gaps are
   timestamped in this process as each SSE event arrives; a gap counts when
   its first chunk arrived after the second limit call answered (the admin
   answers carry the whole queue, so they are kept out of the window). This
   is done ``--rounds`` times (default 3) before the waiters are sent (the
   held streams are there, the queue is empty), ``--rounds`` times with the
   waiters queued, and ``--rounds`` times with the waiters queued while
   another task polls ``/_slotproxy/status`` once a second, as the dashboard
   does (informative, no target). Also informative: while the waiters of (c)
   arrive, rounds of the same streams run on a second provider ``probe``
   (same upstream, ``limit: null``, so they never queue) in the same proxy
   process ("queue filling"). Reported: gap p50/p99 pooled over rounds,
   per-round p99 range and the largest gap, vs the 50 ms nominal.

At the end the clients close everything; the proxy must get back to
``in_flight`` 0 and ``queued`` 0, and its RSS is read once more.

Targets (PASS/MISS): under 64 KiB RSS per held stream; under 16 KiB per queued
waiter beyond its own request body; no slowdown of the admitted streams:
chunk-gap p99 with the queue − without ≤ 5 ms (10% of the nominal gap) and
every measured stream complete.

Every server is started by this script on 127.0.0.1, each in its own process
group; the client processes are spawned children; all are stopped on the way
out. The open-file limit is raised to the hard limit for this process and its
children (the proxy holds streams + waiters client sockets plus streams
upstream sockets). Needs slotproxy installed (``pip install -e .``).

Run from the repository root::

    python bench/soak.py                  # 2000 streams, 10000 waiters, 3 rounds (~1 min on 2 cores)
    python bench/soak.py --quick          # smoke run: 200 streams, 1000 waiters, 1 round
    python bench/soak.py --streams 4000 --waiters 10000 --workers 4

The last thing printed is a markdown section for bench/RESULTS.md. Progress
goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import multiprocessing
import multiprocessing.connection
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from common import (  # bench/common.py: this directory is sys.path[0] when run as a script
    HOST,
    ClientPool,
    Processes,
    command_line,
    enough_open_files,
    free_port,
    get_json,
    log,
    machine_note,
    pass_miss_table,
    pct,
    raise_on_sigterm,
    rss_kib,
    run_loop,
    serve_client,
    split,
    start_fake_upstream,
    start_serve,
)

PROVIDER = "soak"
PROBE = "probe"            # same upstream, no limit: streams that never queue, for the fill-time probe
HOLD_CHUNKS = 600
HOLD_DELAY_MS = 1000
MEASURED_CHUNKS = 40
MEASURED_DELAY_MS = 50
SLOW_READ_S = 5.0
OPEN_AT_ONCE = 64          # per client process: held streams waiting for their response headers
SEND_AT_ONCE = 32          # per client process: waiters whose request is not yet on the wire
QUEUE_SETTLE_S = 2.0
STATUS_CALLS = 3
DASHBOARD_POLL_S = 1.0
STREAM_BODY = json.dumps({"model": "fake-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]})


def _waiter_body(size: int = 200) -> bytes:
    """A streaming chat request padded to exactly ``size`` bytes."""
    message = {"role": "user", "content": ""}
    shell = {"model": "fake-model", "stream": True, "messages": [message]}
    pad = size - len(json.dumps(shell, separators=(",", ":")))
    message["content"] = ("please refactor the soak module " * 10)[:pad]
    body = json.dumps(shell, separators=(",", ":")).encode()
    assert len(body) == size, len(body)
    return body


WAITER_BODY = _waiter_body()

TARGET_KIB_PER_STREAM = 64.0
TARGET_KIB_PER_WAITER = 16.0
TARGET_GAP_P99_ADDED_MS = 5.0


# --- small helpers -------------------------------------------------------------------


# --- servers -------------------------------------------------------------------------


def slotproxy_yaml(port: int, upstream: str, max_queue: int) -> str:
    return (
        f"server: {{host: {HOST}, port: {port}, shutdown_grace: 1s}}\n"
        "state: {path: null}\n"
        "providers:\n"
        f"  {PROVIDER}: {{upstream: '{upstream}', limit: null, max_queue: {max_queue}, "
        "queue_timeout: 1h, slot_timeout: 1h}\n"
        f"  {PROBE}: {{upstream: '{upstream}', limit: null}}\n"
    )


def start_fake(procs: Processes) -> tuple[subprocess.Popen[bytes], int]:
    options = ["--chunks", str(HOLD_CHUNKS), "--delay-ms", str(HOLD_DELAY_MS)]
    return start_fake_upstream(procs, "fake", options, what="fake-upstream")


def start_slotproxy(procs: Processes, upstream: str, max_queue: int) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    return start_serve(procs, "slotproxy", port, slotproxy_yaml(port, upstream, max_queue)), port


# --- client processes ----------------------------------------------------------------
#
# Each client process runs one event loop and answers commands from a pipe:
#   ("hold", url, count, timeout)   open `count` streams; reply when each got its first chunk
#   ("queue", url, count, timeout)  send `count` waiters; reply when every request is on the wire
#   ("stop",)                       close everything, reply with what happened, exit


class _Client:
    def __init__(self) -> None:
        trace = aiohttp.TraceConfig()
        trace.on_request_chunk_sent.append(self._on_sent)
        trace.on_request_headers_sent.append(self._on_headers_sent)
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), trace_configs=[trace])
        self.tasks: list[asyncio.Task[None]] = []
        self.opened = 0
        self.sent = 0
        self.held_ended = 0
        self.failures: Counter[str] = Counter()
        self.waiter_statuses: Counter[int] = Counter()

    @staticmethod
    async def _on_sent(session: Any, ctx: Any, params: Any) -> None:
        done = (ctx.trace_request_ctx or {}).get("sent")
        if done is not None:
            done()

    @staticmethod
    async def _on_headers_sent(session: Any, ctx: Any, params: Any) -> None:
        return None

    async def _hold_one(self, url: str, gate: asyncio.Semaphore, index: int) -> None:
        try:
            async with gate:
                response = await self.session.post(
                    url, data=STREAM_BODY,
                    headers={"Content-Type": "application/json", "X-Workspace-Id": f"held{index % 50}"},
                )
            try:
                if response.status != 200:
                    self.failures[f"held: status {response.status}"] += 1
                    return
                await response.content.readuntil(b"\n\n")
                self.opened += 1
                while not response.content.at_eof():
                    await asyncio.sleep(SLOW_READ_S)
                    response.content.read_nowait(-1)
                self.held_ended += 1
            finally:
                response.close()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - counted and reported
            self.failures[f"held: {type(exc).__name__}"] += 1

    async def _wait_one(self, url: str, gate: asyncio.Semaphore, index: int) -> None:
        released = False

        def sent() -> None:
            nonlocal released
            if not released:
                released = True
                self.sent += 1
                gate.release()

        await gate.acquire()
        headers = {
            "Content-Type": "application/json",
            "X-Workspace-Id": f"ws{index % 50}",
            "X-Conversation-Id": f"conv-{os.getpid()}-{index}",
            "X-Prompt-Started-At": str(int(time.time() * 1000) - index % 60_000),
        }
        try:
            response = await self.session.post(url, data=WAITER_BODY, headers=headers,
                                               trace_request_ctx={"sent": sent})
            try:
                # A waiter is not meant to be answered while the run lasts; if it is,
                # say how (200 = it was admitted, 503 = queue full or timeout).
                self.waiter_statuses[response.status] += 1
                await asyncio.Event().wait()
            finally:
                response.close()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - counted and reported
            self.failures[f"waiter: {type(exc).__name__}"] += 1
        finally:
            sent()

    async def hold(self, url: str, count: int, timeout: float) -> dict[str, Any]:
        gate = asyncio.Semaphore(OPEN_AT_ONCE)
        start, tasks = self.opened, [asyncio.create_task(self._hold_one(url, gate, i)) for i in range(count)]
        self.tasks += tasks
        deadline = time.monotonic() + timeout
        while self.opened - start < count and time.monotonic() < deadline and not all(t.done() for t in tasks):
            await asyncio.sleep(0.1)
        return {"opened": self.opened - start, "failures": dict(self.failures)}

    async def queue(self, url: str, count: int, timeout: float) -> dict[str, Any]:
        gate = asyncio.Semaphore(SEND_AT_ONCE)
        start = self.sent
        tasks = []
        for i in range(count):
            tasks.append(asyncio.create_task(self._wait_one(url, gate, i)))
            await asyncio.sleep(0)
        self.tasks += tasks
        deadline = time.monotonic() + timeout
        while self.sent - start < count and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return {"sent": self.sent - start, "failures": dict(self.failures)}

    async def stop(self) -> dict[str, Any]:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.session.close()
        return {
            "held_ended_early": self.held_ended,
            "waiter_statuses": dict(self.waiter_statuses),
            "failures": dict(self.failures),
        }


async def _client_loop(conn: multiprocessing.connection.Connection) -> None:
    loop = asyncio.get_running_loop()
    client = _Client()
    try:
        while True:
            try:
                command = await loop.run_in_executor(None, conn.recv)
            except EOFError:
                return
            if command[0] == "hold":
                conn.send(await client.hold(*command[1:]))
            elif command[0] == "queue":
                conn.send(await client.queue(*command[1:]))
            elif command[0] == "stop":
                conn.send(await client.stop())
                return
    finally:
        if not client.session.closed:
            await client.stop()


def client_main(conn: multiprocessing.connection.Connection) -> None:
    """Entry point of a spawned client process."""
    serve_client(_client_loop(conn))


class Clients(ClientPool):
    """The spawned client processes; every command goes to all of them, split evenly."""

    def __init__(self, count: int) -> None:
        super().__init__(count, client_main)

    def command(self, kind: str, url: str, total: int, timeout: float) -> list[dict[str, Any]]:
        for pipe, share in zip(self.pipes, split(total, len(self.pipes))):
            pipe.send((kind, url, share, timeout))
        return [self.reply(pipe, timeout + 30) for pipe in self.pipes]

    def stop(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        self.send_stop()
        replies = []
        for pipe in self.pipes:
            try:
                replies.append(self.reply(pipe, timeout))
            except (RuntimeError, EOFError, OSError) as exc:
                replies.append({"error": str(exc)})
        return replies


# --- this process: admin calls and the measured streams ------------------------------


_GAUGE = re.compile(r'^slotproxy_(in_flight|queued)\{provider="' + PROVIDER + r'"\} (\S+)$', re.MULTILINE)


async def gauges(session: aiohttp.ClientSession, base: str) -> dict[str, int]:
    async with session.get(f"{base}/metrics") as response:
        text = await response.text()
    return {name: int(float(value)) for name, value in _GAUGE.findall(text)}


async def put_limit(session: aiohttp.ClientSession, base: str, limit: int | None) -> float:
    """Set the limit; returns how long the call took (the answer carries the whole queue), ms."""
    started = time.perf_counter()
    async with session.put(f"{base}/_slotproxy/providers/{PROVIDER}/limit", json={"limit": limit}) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"PUT limit {limit}: status {response.status}")
    return (time.perf_counter() - started) * 1000


async def wait_gauge(session: aiohttp.ClientSession, base: str, name: str, want: int, timeout: float,
                     interval: float = 0.1) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while True:
        seen = await gauges(session, base)
        if seen.get(name) == want:
            return seen
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} stayed at {seen.get(name)} (wanted {want}) for {timeout:.0f}s")
        await asyncio.sleep(interval)


@dataclass
class StreamRecord:
    status: int = 0
    stamps: list[float] = field(default_factory=list)
    error: str | None = None


async def measured_stream(session: aiohttp.ClientSession, url: str, record: StreamRecord) -> None:
    headers = {
        "Content-Type": "application/json",
        "X-Workspace-Id": "measured",
        "X-Workspace-Starred": "1",
        "x-fake-chunks": str(MEASURED_CHUNKS),
        "x-fake-delay-ms": str(MEASURED_DELAY_MS),
    }
    try:
        async with session.post(url, data=STREAM_BODY, headers=headers) as response:
            record.status = response.status
            while True:
                event = await response.content.readuntil(b"\n\n")
                if not event.endswith(b"\n\n"):
                    break
                record.stamps.append(time.perf_counter())
                if event.startswith(b"data: [DONE]"):
                    break
    except Exception as exc:  # noqa: BLE001 - reported
        record.error = type(exc).__name__


@dataclass(frozen=True)
class Round:
    gaps_ms: list[float]
    complete: int
    streams: int
    put_ms: list[float]
    status_polls_ms: list[float]

    @property
    def p99(self) -> float:
        return pct(self.gaps_ms, 99)


async def _dashboard(session: aiohttp.ClientSession, base: str, stop: asyncio.Event, took: list[float]) -> None:
    """GET the status once a second, as the dashboard does; the body is read, not parsed."""
    while not stop.is_set():
        started = time.perf_counter()
        async with session.get(f"{base}/_slotproxy/status") as response:
            await response.read()
        took.append((time.perf_counter() - started) * 1000)
        try:
            await asyncio.wait_for(stop.wait(), DASHBOARD_POLL_S)
        except TimeoutError:
            pass


async def measured_round(base: str, count: int, poll_status: bool) -> Round:
    """Queue `count` starred streams at the head, admit them by a limit bump, time their chunks."""
    url = f"{base}/{PROVIDER}/chat/completions"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        before = await gauges(session, base)
        records = [StreamRecord() for _ in range(count)]
        tasks = [asyncio.create_task(measured_stream(session, url, r)) for r in records]
        await wait_gauge(session, base, "queued", before["queued"] + count, timeout=30, interval=0.05)
        in_flight = before["in_flight"]
        put_ms = [await put_limit(session, base, in_flight + count), await put_limit(session, base, in_flight)]
        window = time.perf_counter()
        stop, polls = asyncio.Event(), list[float]()
        poller = asyncio.create_task(_dashboard(session, base, stop, polls)) if poll_status else None
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=60 + MEASURED_CHUNKS * MEASURED_DELAY_MS / 1000)
        stop.set()
        if poller is not None:
            await poller
    return _round(records, window, put_ms, polls)


def _round(records: list[StreamRecord], window: float, put_ms: list[float], polls: list[float]) -> Round:
    gaps: list[float] = []
    complete = 0
    for record in records:
        chunks = record.stamps[:MEASURED_CHUNKS]
        if record.status == 200 and record.error is None and len(record.stamps) >= MEASURED_CHUNKS + 1:
            complete += 1
        gaps += [(b - a) * 1000 for a, b in itertools.pairwise(chunks) if a >= window]
    return Round(gaps, complete, len(records), put_ms, polls)


async def probe_rounds(base: str, count: int, stop: threading.Event, rounds: list[Round]) -> None:
    """While the waiters arrive: rounds of `count` streams on the unlimited probe provider (same process)."""
    url = f"{base}/{PROBE}/chat/completions"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        while not stop.is_set():
            records = [StreamRecord() for _ in range(count)]
            window = time.perf_counter()
            await asyncio.wait_for(asyncio.gather(*(measured_stream(session, url, r) for r in records)),
                                   timeout=60 + MEASURED_CHUNKS * MEASURED_DELAY_MS / 1000)
            rounds.append(_round(records, window, [], []))


async def warm_up(base: str, count: int = 32) -> None:
    headers = {"Content-Type": "application/json", "x-fake-chunks": "3", "x-fake-delay-ms": "1"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one() -> None:
            async with session.post(f"{base}/{PROVIDER}/chat/completions", data=STREAM_BODY, headers=headers) as r:
                await r.read()

        await asyncio.wait_for(asyncio.gather(*(one() for _ in range(count))), timeout=30)


def timed_get(url: str, calls: int) -> tuple[list[float], bytes]:
    took, body = [], b""
    for _ in range(calls):
        started = time.perf_counter()
        with urllib.request.urlopen(url, timeout=60) as response:
            body = response.read()
        took.append((time.perf_counter() - started) * 1000)
    return took, body


def soak_status(base: str) -> dict[str, Any]:
    for entry in get_json(f"{base}/_slotproxy/status", timeout=60)["providers"]:
        if entry["provider"] == PROVIDER:
            return dict(entry)
    raise RuntimeError(f"provider {PROVIDER} missing from status")


# --- the run -------------------------------------------------------------------------


@dataclass
class Results:
    streams: int = 0
    waiters: int = 0
    base_kib: int = 0
    warm_kib: int = 0
    held_kib: int = 0
    opened: int = 0
    before_waiters_kib: int = 0
    queued_kib: int = 0
    queued_seen: int = 0
    queue_listed: int = 0
    sent: int = 0
    status_ms: list[float] = field(default_factory=list)
    status_bytes: int = 0
    metrics_ms: list[float] = field(default_factory=list)
    rounds: dict[str, list[Round]] = field(default_factory=dict)
    after_kib: int = 0
    drained: dict[str, Any] = field(default_factory=dict)
    fake_kib: int = 0
    client_reports: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def per_stream_kib(self) -> float:
        return (self.held_kib - self.warm_kib) / max(self.opened, 1)

    @property
    def per_waiter_total_kib(self) -> float:
        return (self.queued_kib - self.before_waiters_kib) / max(self.queued_seen, 1)

    @property
    def per_waiter_kib(self) -> float:
        return self.per_waiter_total_kib - len(WAITER_BODY) / 1024


VARIANTS = {
    "no queue": "held streams only, queue empty",
    "queue": "held streams + waiters queued",
    "queue + status 1/s": "the same, status polled once a second as the dashboard does",
    "queue filling": f"unlimited provider `{PROBE}`, same process, while the waiters arrive",
}


def run_rounds(results: Results, base: str, name: str, rounds: int, count: int, poll: bool) -> None:
    for number in range(1, rounds + 1):
        one = run_loop(measured_round(base, count, poll))
        results.rounds.setdefault(name, []).append(one)
        polls = f"  status polls {', '.join(f'{p:.0f}' for p in one.status_polls_ms)} ms" if poll else ""
        log(f"(d) {name:<18} round {number}: gap p50/p99 {pct(one.gaps_ms, 50):.2f}/{one.p99:.2f} ms over "
            f"{len(one.gaps_ms)} gaps, {one.complete}/{one.streams} complete, limit calls "
            f"{'/'.join(f'{p:.0f}' for p in one.put_ms)} ms{polls}")


def run_all(args: argparse.Namespace, workdir: Path) -> Results:
    results = Results(streams=args.streams, waiters=args.waiters)
    procs = Processes(workdir, term_timeout=10.0)
    clients: Clients | None = None
    began = time.monotonic()
    try:
        fake, fake_port = start_fake(procs)
        proxy, port = start_slotproxy(procs, f"http://{HOST}:{fake_port}/v1",
                                      max_queue=args.waiters + args.measured + 100)
        base = f"http://{HOST}:{port}"
        url = f"{base}/{PROVIDER}/chat/completions"
        clients = Clients(args.workers)
        time.sleep(1.0)
        results.base_kib = rss_kib(proxy.pid)
        run_loop(warm_up(base))
        time.sleep(0.5)
        results.warm_kib = rss_kib(proxy.pid)
        log(f"(a) idle RSS {results.base_kib / 1024:.1f} MiB, after warm-up {results.warm_kib / 1024:.1f} MiB")

        started = time.monotonic()
        replies = clients.command("hold", url, args.streams, timeout=60 + args.streams / 50)
        results.opened = sum(r["opened"] for r in replies)
        results.timings["open streams s"] = time.monotonic() - started
        time.sleep(1.0)
        results.held_kib = rss_kib(proxy.pid)
        results.fake_kib = rss_kib(fake.pid)
        log(f"(b) {results.opened}/{args.streams} streams got their first chunk in "
            f"{results.timings['open streams s']:.1f} s; RSS {results.held_kib / 1024:.1f} MiB, "
            f"{results.per_stream_kib:.1f} KiB per held stream")
        if results.opened < args.streams:
            log(f"only {results.opened} of {args.streams} streams opened: {replies}")
        status = soak_status(base)
        in_flight = int(status["in_flight"])
        urllib.request.urlopen(urllib.request.Request(
            f"{base}/_slotproxy/providers/{PROVIDER}/limit", data=json.dumps({"limit": in_flight}).encode(),
            method="PUT", headers={"Content-Type": "application/json"}), timeout=30).close()
        log(f"limit set to {in_flight} (the held streams hold every slot)")

        run_rounds(results, base, "no queue", args.rounds, args.measured, poll=False)

        time.sleep(1.0)
        results.before_waiters_kib = rss_kib(proxy.pid)
        filling: list[Round] = []
        stop_probe = threading.Event()
        prober = threading.Thread(
            target=lambda: run_loop(probe_rounds(base, args.measured, stop_probe, filling)), daemon=True)
        prober.start()
        started = time.monotonic()
        try:
            replies = clients.command("queue", url, args.waiters, timeout=60 + args.waiters / 100)
            results.sent = sum(r["sent"] for r in replies)
            seen = run_loop(_wait_queued(base, args.waiters, timeout=60 + args.waiters / 100))
            results.timings["queue waiters s"] = time.monotonic() - started
        finally:
            stop_probe.set()
            prober.join(timeout=120)
        results.rounds["queue filling"] = filling
        if filling:
            log(f"(d) queue filling: {len(filling)} probe round(s), gap p50/p99/max "
                f"{pct([g for f in filling for g in f.gaps_ms], 50):.2f}/{_pooled_p99(filling):.2f}/"
                f"{max(g for f in filling for g in f.gaps_ms):.1f} ms")
        time.sleep(QUEUE_SETTLE_S)
        results.queued_kib = rss_kib(proxy.pid)
        results.queued_seen = seen
        log(f"(c) {results.sent} waiters sent, {seen} queued in {results.timings['queue waiters s']:.1f} s; "
            f"RSS {results.queued_kib / 1024:.1f} MiB, {results.per_waiter_total_kib:.2f} KiB per waiter "
            f"({results.per_waiter_kib:.2f} beyond its {len(WAITER_BODY)}-byte body)")
        results.status_ms, body = timed_get(f"{base}/_slotproxy/status", STATUS_CALLS)
        results.status_bytes = len(body)
        entry = next(p for p in json.loads(body)["providers"] if p["provider"] == PROVIDER)
        results.queued_seen = int(entry["queued"])
        results.queue_listed = len(entry["queue"])
        results.metrics_ms, _ = timed_get(f"{base}/metrics", STATUS_CALLS)
        log(f"(c) status: queued {entry['queued']}, {results.queue_listed} listed, {len(body) / 1e6:.2f} MB, "
            f"{', '.join(f'{t:.0f}' for t in results.status_ms)} ms; /metrics "
            f"{', '.join(f'{t:.0f}' for t in results.metrics_ms)} ms")

        run_rounds(results, base, "queue", args.rounds, args.measured, poll=False)
        run_rounds(results, base, "queue + status 1/s", args.rounds, args.measured, poll=True)

        started = time.monotonic()
        results.client_reports = clients.stop()
        results.drained = run_loop(_wait_drained(base))
        results.timings["drain s"] = time.monotonic() - started
        time.sleep(1.0)
        results.after_kib = rss_kib(proxy.pid)
        log(f"clients closed; proxy in_flight {results.drained.get('in_flight')}, queued "
            f"{results.drained.get('queued')} after {results.timings['drain s']:.1f} s; RSS "
            f"{results.after_kib / 1024:.1f} MiB")
    finally:
        if clients is not None:
            clients.kill()
        procs.stop_all()
    results.timings["total s"] = time.monotonic() - began
    return results


async def _wait_queued(base: str, want: int, timeout: float) -> int:
    """Poll /metrics (once a second: each call snapshots the whole queue) until `want` are queued."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            queued = (await gauges(session, base)).get("queued", 0)
            if queued >= want or time.monotonic() > deadline:
                if queued < want:
                    log(f"only {queued} of {want} waiters queued after {timeout:.0f}s")
                return queued
            await asyncio.sleep(1.0)


async def _wait_drained(base: str, timeout: float = 30.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            seen = await gauges(session, base)
            if (seen.get("in_flight") == 0 and seen.get("queued") == 0) or time.monotonic() > deadline:
                return seen
            await asyncio.sleep(0.25)


# --- report --------------------------------------------------------------------------


def _gap_row(name: str, rounds: list[Round]) -> str:
    gaps = [g for r in rounds for g in r.gaps_ms]
    per_round = [r.p99 for r in rounds]
    spread = f"{min(per_round):.2f}–{max(per_round):.2f}" if len(per_round) > 1 else f"{per_round[0]:.2f}"
    complete = sum(r.complete for r in rounds)
    streams = sum(r.streams for r in rounds)
    return (f"| {name} | {len(gaps)} | {pct(gaps, 50):.2f} | {pct(gaps, 99):.2f} | {spread} | "
            f"{max(gaps):.1f} | {complete}/{streams} |")


def _pooled_p99(rounds: list[Round]) -> float:
    return pct([g for r in rounds for g in r.gaps_ms], 99)


def targets(results: Results) -> list[tuple[str, str, str, bool]]:
    rows = [
        ("RSS per held stream", f"{results.per_stream_kib:.1f} KiB", f"< {TARGET_KIB_PER_STREAM:g} KiB",
         results.per_stream_kib < TARGET_KIB_PER_STREAM and results.opened == results.streams),
        ("RSS per queued waiter beyond its body", f"{results.per_waiter_kib:.2f} KiB",
         f"< {TARGET_KIB_PER_WAITER:g} KiB",
         results.per_waiter_kib < TARGET_KIB_PER_WAITER and results.queued_seen == results.waiters),
    ]
    without, with_queue = results.rounds["no queue"], results.rounds["queue"]
    added = _pooled_p99(with_queue) - _pooled_p99(without)
    complete = all(r.complete == r.streams for r in without + with_queue)
    rows.append(("chunk-gap p99 added by the queue (queue − no queue)", f"{added:+.2f} ms",
                 f"≤ {TARGET_GAP_P99_ADDED_MS:g} ms, all streams complete",
                 added <= TARGET_GAP_P99_ADDED_MS and complete))
    return rows


def _ms_list(values: Sequence[float]) -> str:
    return ", ".join(f"{v:.0f}" for v in values)


def report(results: Results, args: argparse.Namespace, command: str) -> str:
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    r = results
    put_ms = [p for rnd in r.rounds["queue"] for p in rnd.put_ms]
    polls = [p for rnd in r.rounds["queue + status 1/s"] for p in rnd.status_polls_ms]
    waiter_statuses: Counter[str] = Counter()
    failures: Counter[str] = Counter()
    ended = 0
    for reply in r.client_reports:
        waiter_statuses.update({str(k): v for k, v in reply.get("waiter_statuses", {}).items()})
        failures.update(reply.get("failures", {}))
        ended += int(reply.get("held_ended_early", 0))
    lines = [
        "## Soak (bench/soak.py)",
        "",
        f"`{command}` — {stamp}, whole run {r.timings['total s']:.0f} s.",
        f"Machine: {machine_note(with_model=True)}.",
        (f"One slotproxy (uvloop) → `slotproxy fake-upstream --chunks {HOLD_CHUNKS} --delay-ms {HOLD_DELAY_MS}` "
        f"(no cap); {args.workers} client processes (aiohttp, `TCPConnector(limit=0)`); the {args.measured} "
        "measured streams run in the bench process. RSS = VmRSS of the proxy process."),
        "",
        "### Targets",
        "",
        *pass_miss_table(targets(r)),
        "",
        "### Memory",
        "",
        "| slotproxy RSS | value |",
        "|---|---|",
        f"| (a) idle after start | {r.base_kib / 1024:.1f} MiB |",
        f"| (a) idle after a 32-stream warm-up | {r.warm_kib / 1024:.1f} MiB |",
        (f"| (b) {r.opened} of {r.streams} streams held open (all had their first chunk: "
        f"{'yes' if r.opened == r.streams else 'NO'}) | {r.held_kib / 1024:.1f} MiB |"),
        f"| (b) per held stream: (held − warm idle) / {r.opened} | {r.per_stream_kib:.1f} KiB |",
        (f"| (c) just before the waiters, after the no-queue rounds (limit {r.opened}) | "
        f"{r.before_waiters_kib / 1024:.1f} MiB |"),
        f"| (c) + {r.queued_seen} waiters queued | {r.queued_kib / 1024:.1f} MiB |",
        f"| (c) per waiter: delta / {r.queued_seen} | {r.per_waiter_total_kib:.2f} KiB |",
        f"| (c) per waiter beyond its {len(WAITER_BODY)}-byte body | {r.per_waiter_kib:.2f} KiB |",
        (f"| after every client closed (in_flight {r.drained.get('in_flight')}, queued "
        f"{r.drained.get('queued')}) | {r.after_kib / 1024:.1f} MiB |"),
        f"| fake upstream holding {r.opened} streams (for reference) | {r.fake_kib / 1024:.1f} MiB |",
        "",
        f"### Status with {r.queued_seen} waiters",
        "",
        (f"- `GET /_slotproxy/status`: `queued: {r.queued_seen}`, `queue` lists {r.queue_listed} waiters, "
        f"{r.status_bytes / 1e6:.2f} MB of JSON; {STATUS_CALLS} calls took {_ms_list(r.status_ms)} ms."),
        f"- `GET /metrics` (builds the same snapshot, queue listing included): {_ms_list(r.metrics_ms)} ms.",
        (f"- `PUT /_slotproxy/providers/{PROVIDER}/limit` (answers with the provider's status, queue included): "
        f"{_ms_list(put_ms)} ms."),
        f"- Status polled once a second during the last variant below: {_ms_list(polls)} ms.",
        "",
        (f"### Admitted streams: {args.measured} streams × {MEASURED_CHUNKS} chunks {MEASURED_DELAY_MS} ms apart, "
        f"{args.rounds} round(s) per variant"),
        "",
        (f"All with the {r.opened} held streams relaying a chunk a second each. Gaps pooled over rounds; "
        f"nominal gap {MEASURED_DELAY_MS} ms."),
        "",
        "| variant | gaps | gap p50 ms | gap p99 ms | per-round p99 ms | max gap ms | complete |",
        "|---|---|---|---|---|---|---|",
        *(_gap_row(f"{name} ({VARIANTS[name]})", r.rounds[name]) for name in VARIANTS if r.rounds.get(name)),
        "",
        (f"Held streams opened in {r.timings['open streams s']:.1f} s; waiters queued in "
        f"{r.timings['queue waiters s']:.1f} s; closing everything and draining took {r.timings['drain s']:.1f} s. "
        f"Held streams that ended early: {ended}. Waiters answered during the run: "
        f"{dict(waiter_statuses) or 'none'}. Client errors: {dict(failures) or 'none'}."),
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=2000, help="streams held open (default 2000)")
    parser.add_argument("--waiters", type=int, default=10000, help="requests queued behind them (default 10000)")
    parser.add_argument("--measured", type=int, default=20, help="measured streams per round (default 20)")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per variant (default 3)")
    parser.add_argument("--workers", type=int, default=4, help="client processes (default 4)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 200 streams, 1000 waiters, 1 round")
    args = parser.parse_args(argv)
    if args.quick:
        args.streams, args.waiters, args.rounds = 200, 1000, 1
    if args.streams < 1 or args.waiters < 1 or args.measured < 1 or args.rounds < 1 or not 1 <= args.workers <= 16:
        parser.error("--streams, --waiters, --measured and --rounds must be >= 1, --workers in [1, 16]")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, raise_on_sigterm)
    if not enough_open_files("soak.py", 2 * args.streams + args.waiters + args.measured + 200):
        return 2
    command = command_line("soak.py", argv)
    with tempfile.TemporaryDirectory(prefix="slotproxy-soak-") as tmp:
        results = run_all(args, Path(tmp))
    print(report(results, args, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
