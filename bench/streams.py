"""Many concurrent long SSE streams: what does slotproxy add to the gaps between chunks? (a benchmark, not a test)

Upstream: ``--fakes`` (default 2) ``slotproxy fake-upstream --chunks K --delay-ms D``
processes, each on its own port (the fake does not share a port). Every stream
is a streaming chat completion (``POST /v1/chat/completions``, ``"stream": true``,
``x-fake-chunks: K``, ``x-fake-delay-ms: D``): K content chunks (default 100),
each written D ms (default 50, 20 chunks a second) after the previous one was
written, then the finish chunk and ``data: [DONE]``. Stream ``j`` goes to fake
``j mod fakes``, directly or through slotproxy.

Proxy: one ``python -m proxy serve --log-level WARNING`` (uvloop), ``state:
{path: null}``, one provider per fake (``f0``, ``f1``, ...) with ``limit:
null``: nothing queues, so this measures the relay, not the limiter.

Clients: ``--clients`` (default 2) spawned client processes (uvloop, one
aiohttp ``ClientSession`` with ``TCPConnector(limit=0)`` per run, so every run
opens fresh connections); each runs an equal share of the streams, both paths.
A stream reads its answer SSE event by SSE event (``readuntil(b"\\n\\n")``)
and stamps each with ``time.monotonic()`` as it arrives. The starts of one
run's N streams are spread evenly over ``--ramp`` seconds (default 1), so the
streams' chunk times are spread over the 50 ms period, as real streams'
would be. Every client process also runs a loop-lag probe (a 10 ms sleep,
timed): its p99 says whether the client itself fell behind.

Levels (``--levels``, default 250,500,1000 concurrent streams). Each round runs,
for each level, the direct path then the proxied path (direct, proxy, direct,
proxy, ...), ``--rounds`` rounds (default 3). Per run:

- chunk gap: the time between two consecutive content chunks of a stream (K−1
  gaps per stream, pooled over the run's streams): p50, p99 and max. The
  nominal gap is D plus the fake's own time to write a chunk. Also the p99
  of the gaps inside the "all open" window (from the last start + 0.3 s to
  the first scheduled end − 0.3 s), when no stream is being set up;
- TTFB: from just before the POST to the first content chunk (the fake's
  first D ms delay included): p50, p99 and the streams over 1 s;
- errors: non-200 answers, exceptions (by type: resets show here) and streams
  that ended without all K chunks and ``[DONE]``;
- connections: this network namespace's ``ListenOverflows`` (a full accept
  queue) and ``TCPSynRetrans`` from ``/proc/net/netstat`` over the run;
- CPU (utime+stime from ``/proc/<pid>/stat``) of the proxy, the fakes and
  each client process as % of a core in the "all open" window (the proxy's
  also during the ramp, from the first start to that window), and the whole
  machine's busy share from ``/proc/stat`` (softirq included, where loopback
  TCP is processed and which no process is charged for);
- proxy CPU per chunk: the proxy's CPU over the proxied run ÷ the SSE events it
  relayed (K + 2 per stream). Connection set-up is included.

Reported per level: the median over rounds (min–max) of each path's figures,
and the *added* gap p50/p99 and TTFB p50/p99 (proxied − direct, paired by
round, then the median). The direct path's gap spread is the fakes' and the
clients' own jitter; the added gap is what the proxy puts on top of it.

Target (from the issue): at 1 000 streams, added chunk-gap p99 ≤ 5 ms, with no
errors. PASS/MISS is printed for the largest level run.

Every server is started by this script on 127.0.0.1, each in its own process
group; the client processes are spawned children; all are stopped on the way
out. The open-file limit is raised to the hard limit (the proxy holds 2 × N
sockets). Needs slotproxy installed (``pip install -e .``).

``--workers N`` (N ≥ 2) measures ``slotproxy serve --workers N`` against one
process, in the same run, both on the Redis backend at ``--redis-url`` (each with
its own key prefix, deleted at the end): a third path, ``workers``, joins
``direct`` and ``proxied``, and both proxies give each provider ``limit: 100000``
instead of ``null``, so every stream takes and gives back a slot in Redis
(nothing queues). Reported besides: each worker's share of the workers' CPU in
the "all open" window, and the added TTFB p99 of N workers against one. Then, on
the N workers, a kill: provider ``held`` (``limit: 4``, backend ``lease_ttl``
``--lease-ttl`` s) gets 4 long streams; the worker holding most of them is
SIGKILLed; measured from the kill: the supervisor's new worker listening on the
port, and 4 new requests on ``held`` all answered (the dead worker's slots
came back: its leases ran out). Targets: added TTFB p99 with N workers ≤ half
of one worker's at 1 000 streams; every worker ≥ half its fair share of the CPU;
the slots back within ``lease_ttl``.

Run from the repository root::

    python bench/streams.py                  # levels 250,500,1000, 3 rounds, 100 chunks (~2.5 min on 2 cores)
    python bench/streams.py --levels 1000 --workers 2   # one process vs two workers on Redis, then the kill
    python bench/streams.py --quick          # smoke run: levels 100,250, 1 round, 40 chunks, ramp 0.5 s (~25 s)
    python bench/streams.py --levels 1000 --rounds 5 --fakes 1

The last thing printed is a markdown section for bench/RESULTS.md. Progress
goes to stderr.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import datetime
import itertools
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis
from common import (  # bench/common.py: this directory is sys.path[0] when run as a script
    HOST,
    ClientPool,
    Processes,
    Spread,
    children_of,
    command_line,
    cpu_seconds,
    delete_redis_keys,
    enough_open_files,
    free_port,
    log,
    machine_note,
    pass_miss_table,
    pct,
    raise_on_sigterm,
    redis_keys,
    serve_client,
    start_fake_upstream,
    start_serve,
    wait_http,
)
from overhead import start_slotproxy

PATHS = ("direct", "proxied")
WORKERS_PATH = "workers"
WORKERS_LIMIT = 100_000     # every stream takes a slot in Redis; nothing queues
HELD_PROVIDER = "held"
HELD_LIMIT = 4
HELD_STREAM_S = 60.0        # the held streams outlast the kill's measurement
TARGET_TTFB_SHARE = 0.5     # N workers' added TTFB p99 ≤ this × one worker's
TARGET_CPU_FAIR = 0.5       # every worker ≥ this × 1/N of the workers' CPU
BODY = json.dumps({"model": "fake-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
EXTRA_EVENTS = 2            # after the K content chunks: the finish chunk and data: [DONE]
LEAD_S = 0.5                # the run's t0 is this far after the command is sent
STEADY_MARGIN_S = 0.3
LAG_PROBE_S = 0.010
SETTLE_S = 1.0
TCP_COUNTERS = ("ListenOverflows", "TCPSynRetrans")
TARGET_LEVEL = 1000
TARGET_ADDED_P99_MS = 5.0


# --- client processes ----------------------------------------------------------------
#
# Each client process runs one event loop and answers commands from a pipe:
#   ("run", jobs, t0, chunks, delay_ms, timeout)  jobs = [(url, start), ...]; reply when all ended
#   ("stop",)                                      exit


@dataclass
class _Stream:
    status: int = 0
    sent: float = 0.0
    stamps: list[float] = field(default_factory=list)
    done: bool = False
    error: str | None = None


async def _one_stream(session: aiohttp.ClientSession, url: str, start: float, headers: dict[str, str],
                      record: _Stream) -> None:
    await asyncio.sleep(max(0.0, start - time.monotonic()))
    record.sent = time.monotonic()
    try:
        async with session.post(url, data=BODY, headers=headers) as response:
            record.status = response.status
            if response.status != 200:
                await response.read()
                return
            stamps = record.stamps
            while True:
                event = await response.content.readuntil(b"\n\n")
                if not event.endswith(b"\n\n"):
                    break
                stamps.append(time.monotonic())
                if event.startswith(b"data: [DONE]"):
                    record.done = True
                    break
    except asyncio.CancelledError:
        record.error = "timeout"
        raise
    except Exception as exc:  # noqa: BLE001 - counted and reported
        record.error = type(exc).__name__


async def _lag_probe(stop: asyncio.Event, lags: list[float]) -> None:
    while not stop.is_set():
        before = time.monotonic()
        await asyncio.sleep(LAG_PROBE_S)
        lags.append((time.monotonic() - before - LAG_PROBE_S) * 1000)


async def run_streams(jobs: list[tuple[str, float]], t0: float, steady: tuple[float, float], chunks: int,
                      delay_ms: float, timeout: float) -> dict[str, Any]:
    headers = {"Content-Type": "application/json", "x-fake-chunks": str(chunks), "x-fake-delay-ms": f"{delay_ms:g}"}
    records = [_Stream() for _ in jobs]
    stop, lags = asyncio.Event(), list[float]()
    await asyncio.sleep(max(0.0, t0 - time.monotonic()))
    probe = asyncio.create_task(_lag_probe(stop, lags))
    connector = aiohttp.TCPConnector(limit=0)
    timeouts = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeouts) as session:
        tasks = [asyncio.create_task(_one_stream(session, url, start, headers, record))
                 for (url, start), record in zip(jobs, records)]
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    stop.set()
    await probe
    gaps, steady_gaps, ttfb = array.array("d"), array.array("d"), array.array("d")
    errors: Counter[str] = Counter()
    events = 0
    ended = 0.0
    for record in records:
        events += len(record.stamps)
        content = record.stamps[:chunks]
        for a, b in itertools.pairwise(content):
            gaps.append((b - a) * 1000)
            if steady[0] <= a and b <= steady[1]:
                steady_gaps.append((b - a) * 1000)
        if content:
            ttfb.append((content[0] - record.sent) * 1000)
            ended = max(ended, record.stamps[-1])
        if record.error is not None:
            errors[record.error] += 1
        elif record.status != 200:
            errors[f"status {record.status}"] += 1
        elif not record.done or len(record.stamps) != chunks + EXTRA_EVENTS:
            errors["incomplete"] += 1
    return {"gaps": gaps, "steady_gaps": steady_gaps, "ttfb": ttfb, "errors": dict(errors), "events": events, "streams": len(records),
            "ended": ended, "lag_p99": pct(lags, 99), "lag_max": max(lags, default=float("nan"))}


async def _client_loop(conn: multiprocessing.connection.Connection) -> None:
    loop = asyncio.get_running_loop()
    while True:
        try:
            command = await loop.run_in_executor(None, conn.recv)
        except EOFError:
            return
        if command[0] == "run":
            conn.send(await run_streams(*command[1:]))
        elif command[0] == "stop":
            return


def client_main(conn: multiprocessing.connection.Connection) -> None:
    """Entry point of a spawned client process."""
    serve_client(_client_loop(conn))


class Clients(ClientPool):
    """The spawned client processes; a run's streams are dealt to them in turn."""

    def __init__(self, count: int) -> None:
        super().__init__(count, client_main)

    def send_run(self, jobs: list[tuple[str, float]], t0: float, steady: tuple[float, float], chunks: int,
                 delay_ms: float, timeout: float) -> None:
        count = len(self.pipes)
        for index, pipe in enumerate(self.pipes):
            pipe.send(("run", jobs[index::count], t0, steady, chunks, delay_ms, timeout))

    def replies(self, timeout: float) -> list[dict[str, Any]]:
        return [self.reply(pipe, timeout) for pipe in self.pipes]

    def kill(self) -> None:
        self.send_stop()
        super().kill()


# --- one run -------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One path at one level in one round."""

    gap_p50: float
    gap_p99: float
    gap_max: float
    steady_p50: float
    steady_p99: float
    ttfb_p50: float
    ttfb_p99: float
    ttfb_over_1s: int
    streams: int
    events: int
    errors: dict[str, int]
    proxy_cpu_s: float
    proxy_steady_pct: float
    fakes_steady_pct: float
    clients_steady_pct: list[float]
    machine_busy_pct: float     # of all CPUs: 100 = every core busy
    machine_softirq_pct: float
    proxy_ramp_pct: float       # from t0 to the all-open window: while the streams are being set up
    machine_ramp_busy_pct: float
    client_lag_p99: float
    client_lag_max: float
    span_s: float
    tcp: dict[str, int]
    gc: GcPauses | None = None  # the proxy's, over the run (proxied runs only)
    proxy_processes_pct: list[float] = field(default_factory=list)  # each proxy process, all open (workers first)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def proxy_us_per_event(self) -> float:
        return self.proxy_cpu_s * 1e6 / max(self.events, 1)


@dataclass
class Setup:
    fake_pids: list[int]
    proxy_pids: dict[str, list[int]]  # path -> the proxy's processes (with --workers: the workers, then the parent)
    urls: dict[str, list[str]]  # path -> one URL per fake
    proxy_metrics: str  # the one-process proxy's
    fleet: Fleet | None = None

    def pids(self, path: str) -> list[int]:
        """Whose CPU is the proxy's on this path (on the direct path: the idle one-process proxy's)."""
        return self.proxy_pids.get(path) or self.proxy_pids["proxied"]


@dataclass(frozen=True)
class GcPauses:
    """The proxy's garbage-collection pauses (``slotproxy_gc_pause_seconds``, every generation): how many,
    how many over 10 ms, the bucket bound the longest fell under, and their sum."""

    count: int
    over_10ms: int
    longest_under_ms: float
    total_ms: float

    @staticmethod
    def scrape(metrics_url: str) -> dict[tuple[str, str], float]:
        """The histogram's samples by (name, le), summed over the generations."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(metrics_url, timeout=10) as answer:
            text = answer.read().decode()
        summed: dict[tuple[str, str], float] = {}
        for family in text_string_to_metric_families(text):
            if family.name == "slotproxy_gc_pause_seconds":
                for sample in family.samples:
                    key = (sample.name, sample.labels.get("le", ""))
                    summed[key] = summed.get(key, 0.0) + sample.value
        return summed

    @classmethod
    def between(cls, before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]) -> GcPauses:
        grown: dict[tuple[str, str], float] = {key: after[key] - before.get(key, 0.0) for key in after}
        count = grown.get(("slotproxy_gc_pause_seconds_count", ""), 0.0)
        bounds = sorted((float(le), value) for (name, le), value in grown.items()
                        if name == "slotproxy_gc_pause_seconds_bucket")
        longest = next((bound for bound, value in bounds if value >= count), float("inf"))
        under_10ms = next((value for bound, value in bounds if bound == 0.01), 0.0)
        return cls(int(count), int(count - under_10ms), longest * 1000,
                   grown.get(("slotproxy_gc_pause_seconds_sum", ""), 0.0) * 1000)


def tcp_counters() -> dict[str, int]:
    """This network namespace's accept-queue overflows and SYN retransmits (from /proc/net/netstat)."""
    lines = [line.split() for line in Path("/proc/net/netstat").read_text().splitlines() if line.startswith("TcpExt:")]
    values = dict(zip(lines[0][1:], map(int, lines[1][1:])))
    return {name: values.get(name, 0) for name in TCP_COUNTERS}


def machine_ticks() -> tuple[int, int, int]:
    """All CPUs' (busy, softirq, total) ticks from /proc/stat; busy is everything but idle and iowait."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    total = sum(fields)
    return total - fields[3] - fields[4], fields[6], total


def _cpu(pids: Sequence[int]) -> list[float]:
    return [cpu_seconds([pid]) for pid in pids]


def measure(setup: Setup, clients: Clients, path: str, level: int, chunks: int, delay_ms: float,
            ramp: float) -> Run:
    urls = setup.urls[path]
    t0 = time.monotonic() + LEAD_S
    jobs = [(urls[j % len(urls)], t0 + ramp * j / level) for j in range(level)]
    stream_s = chunks * delay_ms / 1000
    timeout = LEAD_S + ramp + stream_s + 60
    steady = (t0 + ramp + STEADY_MARGIN_S, t0 + stream_s - STEADY_MARGIN_S)
    pids = setup.pids(path)
    proxy_before = cpu_seconds(pids)
    gc_before = GcPauses.scrape(setup.proxy_metrics) if path == "proxied" else None
    tcp_before = tcp_counters()
    clients.send_run(jobs, t0, steady, chunks, delay_ms, timeout)
    window: dict[str, tuple[float, list[float], float, list[float], tuple[int, int, int]]] = {}
    if steady[1] - steady[0] >= 0.5:
        for name, at in (("start", t0), ("from", steady[0]), ("to", steady[1])):
            time.sleep(max(0.0, at - time.monotonic()))
            window[name] = (time.monotonic(), _cpu(pids), cpu_seconds(setup.fake_pids),
                            _cpu(clients.pids), machine_ticks())
    replies = clients.replies(timeout + 30)
    proxy_used = cpu_seconds(pids) - proxy_before
    gc = None if gc_before is None else GcPauses.between(gc_before, GcPauses.scrape(setup.proxy_metrics))
    tcp = {name: count - tcp_before[name] for name, count in tcp_counters().items()}
    if window:
        (w0, p0, f0, c0, m0), (w1, p1, f1, c1, m1) = window["from"], window["to"]
        seconds = w1 - w0
        processes_pct = [(b - a) * 100 / seconds for a, b in zip(p0, p1)]
        proxy_pct, fakes_pct = sum(processes_pct), (f1 - f0) * 100 / seconds
        clients_pct = [(b - a) * 100 / seconds for a, b in zip(c0, c1)]
        ticks = max(m1[2] - m0[2], 1)
        busy_pct, softirq_pct = (m1[0] - m0[0]) * 100 / ticks, (m1[1] - m0[1]) * 100 / ticks
        ws, ps, _, _, ms = window["start"]
        ramp_proxy_pct = (sum(p0) - sum(ps)) * 100 / (w0 - ws)
        ramp_busy_pct = (m0[0] - ms[0]) * 100 / max(m0[2] - ms[2], 1)
    else:
        proxy_pct = fakes_pct = busy_pct = softirq_pct = ramp_proxy_pct = ramp_busy_pct = float("nan")
        processes_pct = [float("nan")] * len(pids)
        clients_pct = [float("nan")] * len(clients.pids)
    gaps = [g for reply in replies for g in reply["gaps"]]
    steady_gaps = [g for reply in replies for g in reply["steady_gaps"]]
    ttfb = [t for reply in replies for t in reply["ttfb"]]
    errors: Counter[str] = Counter()
    for reply in replies:
        errors.update(reply["errors"])
    return Run(
        gap_p50=pct(gaps, 50), gap_p99=pct(gaps, 99), gap_max=max(gaps, default=float("nan")),
        steady_p50=pct(steady_gaps, 50), steady_p99=pct(steady_gaps, 99),
        ttfb_p50=pct(ttfb, 50), ttfb_p99=pct(ttfb, 99), ttfb_over_1s=sum(1 for t in ttfb if t > 1000),
        streams=sum(r["streams"] for r in replies), events=sum(r["events"] for r in replies),
        errors=dict(errors), proxy_cpu_s=proxy_used if path != "direct" else 0.0,
        proxy_steady_pct=proxy_pct if path != "direct" else float("nan"), fakes_steady_pct=fakes_pct,
        clients_steady_pct=clients_pct, machine_busy_pct=busy_pct, machine_softirq_pct=softirq_pct,
        proxy_ramp_pct=ramp_proxy_pct if path != "direct" else float("nan"), machine_ramp_busy_pct=ramp_busy_pct,
        client_lag_p99=max(r["lag_p99"] for r in replies), client_lag_max=max(r["lag_max"] for r in replies),
        span_s=max(r["ended"] for r in replies) - t0, tcp=tcp, gc=gc,
        proxy_processes_pct=processes_pct if path == WORKERS_PATH else [],
    )


# --- the run -------------------------------------------------------------------------


@dataclass
class Results:
    paths: tuple[str, ...] = PATHS
    workers: int = 0
    runs: dict[tuple[str, int], list[Run]] = field(default_factory=dict)
    kill: Kill | None = None
    keys_left: int | None = None
    total_s: float = 0.0


# --- serve --workers N: the fleet's processes, and one of them killed ----------------


def _port_inodes(port: int, state: str, remote_port: int | None = None) -> set[str]:
    """The sockets (as /proc/<pid>/fd links read) bound to ``port`` on 127.0.0.1 in a TCP state
    (``0A`` listening, ``01`` established), from ``remote_port`` if given."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = int(fields[1].split(":")[1], 16), int(fields[2].split(":")[1], 16)
        if local == port and fields[3] == state and (remote_port is None or remote == remote_port):
            found.add(f"socket:[{fields[9]}]")
    return found


def _holders(pids: Sequence[int], inodes: set[str]) -> list[int]:
    """The pids among ``pids`` with one of these sockets open."""
    holding = []
    for pid in pids:
        try:
            links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        except OSError:
            continue
        if links & inodes:
            holding.append(pid)
    return holding


@dataclass
class Fleet:
    """``slotproxy serve --workers N``: the parent (the supervisor) and its workers."""

    parent: int
    port: int
    count: int

    def workers(self) -> list[int]:
        return sorted(children_of(self.parent))

    def listening(self) -> list[int]:
        """The workers with a listening socket on the port."""
        return _holders(self.workers(), _port_inodes(self.port, "0A"))

    def serving(self, client_port: int) -> int | None:
        """The worker holding the proxy's end of the connection from ``client_port``."""
        holders = _holders(self.workers(), _port_inodes(self.port, "01", client_port))
        return holders[0] if holders else None

    def wait_listening(self, timeout: float = 30) -> list[int]:
        deadline = time.monotonic() + timeout
        while len(listening := self.listening()) < self.count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(listening)} of {self.count} workers listen on port {self.port} "
                                   f"after {timeout:g} s")
            time.sleep(0.05)
        return listening


def redis_yaml(port: int, providers: dict[str, str], args: argparse.Namespace, prefix: str, ledger: str,
               held: str | None = None) -> str:
    """Every provider ``limit: WORKERS_LIMIT`` on the Redis backend; ``held`` (a URL), the provider the kill
    uses."""
    lines = [f"server: {{host: {HOST}, port: {port}, shutdown_grace: 1s}}", "state: {path: null}",
             f"ledger: {{path: {ledger}}}",
             f"backend: {{kind: redis, url: '{args.redis_url}', key_prefix: '{prefix}', lease_ttl: {args.lease_ttl:g}s}}",
             "providers:"]
    lines += [f"  {name}: {{upstream: '{url}', limit: {WORKERS_LIMIT}}}" for name, url in providers.items()]
    if held is not None:
        lines.append(f"  {HELD_PROVIDER}: {{upstream: '{held}', limit: {HELD_LIMIT}, queue_timeout: 600s}}")
    return "\n".join(lines) + "\n"


def start_fleet(procs: Processes, count: int, port: int, config_text: str) -> Fleet:
    config = procs.workdir / "slotproxy-workers.yaml"
    config.write_text(config_text)
    proc = procs.start("slotproxy-workers", [sys.executable, "-m", "proxy", "serve", "--config", str(config),
                                             "--port", str(port), "--workers", str(count), "--log-level", "WARNING"])
    wait_http(f"http://{HOST}:{port}/healthz", proc, f"slotproxy --workers {count}")
    fleet = Fleet(proc.pid, port, count)
    fleet.wait_listening()
    return fleet


@dataclass(frozen=True)
class Kill:
    """One worker SIGKILLed while it held some of ``held``'s slots; times from the kill."""

    lease_ttl: float
    held_by_victim: int
    restarted_s: float | None
    """A new worker listening on the port."""
    reclaimed_s: float | None
    """The last of ``held_by_victim`` new requests answered: the dead worker's slots came back."""
    survivors_ok: int
    """Held streams on the other workers still streaming after the kill."""
    in_flight_after: int | None
    """``held``'s in_flight in status once everything was closed (0: no slot leaked)."""


async def _held_stream(session: aiohttp.ClientSession, url: str, chunks: int, delay_ms: float) \
        -> aiohttp.ClientResponse:
    response = await session.post(url, data=BODY, headers={"Content-Type": "application/json",
                                                           "x-fake-chunks": str(chunks),
                                                           "x-fake-delay-ms": f"{delay_ms:g}"})
    if response.status != 200:
        raise RuntimeError(f"a held stream got {response.status}: {(await response.read())[:200]!r}")
    await response.content.readuntil(b"\n\n")
    return response


async def _answered_after(session: aiohttp.ClientSession, url: str, since: float, deadline: float) -> float | None:
    """Seconds from ``since`` to a 200 for a one-chunk request, retried while the dead worker's
    connections are reset (what an agent's SDK does)."""
    while time.monotonic() < deadline:
        try:
            async with session.post(url, data=BODY, headers={"Content-Type": "application/json",
                                                             "x-fake-chunks": "1"}) as response:
                answered = time.monotonic()
                await response.read()
                if response.status == 200:
                    return answered - since
        except aiohttp.ClientConnectionError:
            pass
        await asyncio.sleep(0.05)
    return None


async def _still_streaming(response: aiohttp.ClientResponse) -> bool:
    try:
        async with asyncio.timeout(5):
            return (await response.content.readuntil(b"\n\n")).endswith(b"\n\n")
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return False


async def _held_in_flight(fleet: Fleet) -> int | None:
    async with aiohttp.ClientSession() as session, \
            session.get(f"http://{HOST}:{fleet.port}/_slotproxy/status") as response:
        document = await response.json()
    return next((p["in_flight"] for p in document["providers"] if p["provider"] == HELD_PROVIDER), None)


async def _kill(fleet: Fleet, lease_ttl: float, delay_ms: float) -> Kill:
    url = f"http://{HOST}:{fleet.port}/{HELD_PROVIDER}/chat/completions"
    chunks = math.ceil(HELD_STREAM_S * 1000 / delay_ms)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        held = await asyncio.gather(*(_held_stream(session, url, chunks, delay_ms) for _ in range(HELD_LIMIT)))
        by_worker: dict[int, list[aiohttp.ClientResponse]] = {}
        for response in held:
            assert response.connection is not None and response.connection.transport is not None
            worker = fleet.serving(response.connection.transport.get_extra_info("sockname")[1])
            if worker is None:  # never guess: os.kill(0, ...) would signal this whole process group
                raise RuntimeError("no worker holds the proxy's end of a held stream")
            by_worker.setdefault(worker, []).append(response)
        victim, victims_streams = max(by_worker.items(), key=lambda item: len(item[1]))
        before = set(fleet.workers())
        log(f"kill: {HELD_LIMIT} streams held on {HELD_PROVIDER} (limit {HELD_LIMIT}), "
            f"{ {pid: len(rs) for pid, rs in by_worker.items()} } by worker pid; SIGKILL {victim}")
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        deadline = killed + lease_ttl * 3 + 10
        again = [asyncio.create_task(_answered_after(session, url, killed, deadline))
                 for _ in victims_streams]
        restarted: float | None = None
        while restarted is None and time.monotonic() < deadline:
            if set(fleet.listening()) - before:
                restarted = time.monotonic() - killed
            else:
                await asyncio.sleep(0.02)
        answered = await asyncio.gather(*again)
        survivors = [r for worker, rs in by_worker.items() if worker != victim for r in rs]
        survivors_ok = sum(await asyncio.gather(*(_still_streaming(r) for r in survivors)))
        for response in held:
            response.close()
    reclaimed = None if None in answered else max(a for a in answered if a is not None)
    in_flight: int | None = None
    for _ in range(50):  # the closed streams' releases reach Redis
        in_flight = await _held_in_flight(fleet)
        if not in_flight:
            break
        await asyncio.sleep(0.1)
    kill = Kill(lease_ttl, len(victims_streams), restarted, reclaimed, survivors_ok, in_flight)
    log(f"kill: a new worker listened after {fmt_s(restarted)}; the {kill.held_by_victim} slot(s) came back "
        f"after {fmt_s(reclaimed)} (lease_ttl {lease_ttl:g} s); {survivors_ok}/{len(survivors)} streams on the "
        f"other workers kept streaming; {HELD_PROVIDER} in_flight after closing: {in_flight}")
    return kill


def fmt_s(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds:.2f} s"


def start_servers(procs: Processes, args: argparse.Namespace, prefix: str) -> Setup:
    fake_pids, fake_ports = [], []
    for index in range(args.fakes):
        proc, port = start_fake_upstream(procs, f"fake-{index}", ["--chunks", str(args.chunks), "--delay-ms",
                                                                   f"{args.delay_ms:g}"],
                                         what=f"fake-upstream {index}")
        fake_pids.append(proc.pid)
        fake_ports.append(port)
    providers = {f"f{index}": f"http://{HOST}:{port}/v1" for index, port in enumerate(fake_ports)}
    if args.workers:
        proxy_port = free_port()
        proxy = start_serve(procs, "slotproxy", proxy_port,
                            redis_yaml(proxy_port, providers, args, f"{prefix}-one", "one.sqlite"))
    else:
        proxy, proxy_port = start_slotproxy(procs, "slotproxy", providers)
    urls = {
        "direct": [f"http://{HOST}:{port}/v1/chat/completions" for port in fake_ports],
        "proxied": [f"http://{HOST}:{proxy_port}/f{index}/chat/completions" for index in range(args.fakes)],
    }
    setup = Setup(fake_pids, {"proxied": [proxy.pid]}, urls, f"http://{HOST}:{proxy_port}/metrics")
    if args.workers:
        fleet_port = free_port()
        setup.fleet = start_fleet(procs, args.workers, fleet_port, redis_yaml(
            fleet_port, providers, args, f"{prefix}-workers", "workers.sqlite", held=providers["f0"]))
        setup.proxy_pids[WORKERS_PATH] = [*setup.fleet.workers(), setup.fleet.parent]
        setup.urls[WORKERS_PATH] = [f"http://{HOST}:{setup.fleet.port}/f{index}/chat/completions"
                                    for index in range(args.fakes)]
    return setup


def _log_run(number: int, level: int, path: str, run: Run) -> None:
    clients = "/".join(f"{c:.0f}" for c in run.clients_steady_pct)
    proxy = (f"  proxy {run.proxy_steady_pct:.0f}% of a core ({run.proxy_ramp_pct:.0f}% during the ramp), "
             f"{run.proxy_us_per_event:.0f} µs/chunk") if path != "direct" else ""
    if run.proxy_processes_pct:
        proxy += " (by process, workers then parent: " + "/".join(f"{c:.0f}" for c in run.proxy_processes_pct) + "%)"
    if run.gc is not None:
        proxy += (f", GC pauses {run.gc.count} ({run.gc.over_10ms} over 10 ms, longest ≤ "
                  f"{run.gc.longest_under_ms:g} ms, {run.gc.total_ms:.0f} ms in all)")
    log(f"round {number} {level:>5} streams {path:<8} gap p50/p99/max {run.gap_p50:.2f}/{run.gap_p99:.2f}/"
        f"{run.gap_max:.1f} ms (all open: {run.steady_p50:.2f}/{run.steady_p99:.2f})  ttfb p50/p99 "
        f"{run.ttfb_p50:.1f}/{run.ttfb_p99:.1f} ms ({run.ttfb_over_1s} > 1 s)  "
        f"errors {run.errors or 0}{proxy}  fakes {run.fakes_steady_pct:.0f}%  clients {clients}%  machine busy "
        f"{run.machine_busy_pct:.0f}% (softirq {run.machine_softirq_pct:.0f}%; ramp {run.machine_ramp_busy_pct:.0f}%)  "
        f"client lag p99 {run.client_lag_p99:.1f} ms  accept-queue overflows {run.tcp['ListenOverflows']}  "
        f"SYN retransmits {run.tcp['TCPSynRetrans']}")


def run_all(args: argparse.Namespace, workdir: Path) -> Results:
    results = Results(paths=(*PATHS, WORKERS_PATH) if args.workers else PATHS, workers=args.workers)
    procs = Processes(workdir)
    clients: Clients | None = None
    began = time.monotonic()
    prefix = f"slotproxy-bench-streams-{uuid.uuid4().hex[:8]}"
    try:
        setup = start_servers(procs, args, prefix)
        clients = Clients(args.clients)
        fleet = f", slotproxy --workers {args.workers} (Redis)" if args.workers else ""
        log(f"{args.fakes} fake upstream(s), slotproxy{fleet} and {args.clients} client process(es) up; warming up")
        for path in results.paths:
            measure(setup, clients, path, min(args.levels), max(10, args.chunks // 5), args.delay_ms, args.ramp)
        time.sleep(SETTLE_S)
        for number in range(1, args.rounds + 1):
            for level in args.levels:
                for path in results.paths:
                    run = measure(setup, clients, path, level, args.chunks, args.delay_ms, args.ramp)
                    results.runs.setdefault((path, level), []).append(run)
                    _log_run(number, level, path, run)
                    time.sleep(SETTLE_S)
        if setup.fleet is not None:
            results.kill = asyncio.run(_kill(setup.fleet, args.lease_ttl, args.delay_ms))
    finally:
        if clients is not None:
            clients.kill()
        procs.stop_all()
        if args.workers:
            results.keys_left = _clean_redis(args.redis_url, prefix)
    results.total_s = time.monotonic() - began
    return results


def _clean_redis(url: str, prefix: str) -> int:
    client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    try:
        deleted = delete_redis_keys(client, prefix)
        left = sum(1 for _ in redis_keys(client, prefix))
    finally:
        client.close()
    log(f"redis: deleted {deleted} keys under {prefix}, {left} left")
    return left


# --- report --------------------------------------------------------------------------


class _NoFigure:
    """Stands in for a Spread when no run had the figure (a run too short for a window with every stream open)."""

    def fmt(self, digits: int = 2) -> str:
        return "n/a"


def _spread(runs: list[Run], metric: Callable[[Run], float]) -> Spread | _NoFigure:
    values = [value for value in map(metric, runs) if not math.isnan(value)]
    return Spread.of(values) if values else _NoFigure()


def _added(results: Results, level: int, metric: Callable[[Run], float], path: str = "proxied") -> Spread | _NoFigure:
    pairs = zip(results.runs[("direct", level)], results.runs[(path, level)])
    values = [metric(proxied) - metric(direct) for direct, proxied in pairs]
    values = [value for value in values if not math.isnan(value)]
    return Spread.of(values) if values else _NoFigure()


def _errors(runs: list[Run]) -> str:
    total: Counter[str] = Counter()
    for run in runs:
        total.update(run.errors)
    return ", ".join(f"{kind} {count}" for kind, count in sorted(total.items())) or "0"


def gap_table(results: Results, levels: Sequence[int]) -> Iterator[str]:
    yield ("| streams | path | gap p50 ms | gap p99 ms | gap max ms | added gap p50 ms | added gap p99 ms | "
           "all open: gap p99 ms | all open: added p99 ms | proxy GC pauses over 10 ms / longest ≤ ms | errors |")
    yield "|---|---|---|---|---|---|---|---|---|---|---|"
    for level in levels:
        for path in results.paths:
            runs = results.runs[(path, level)]
            if path != "direct":
                added = (f"{_added(results, level, lambda r: r.gap_p50, path).fmt()} | "
                         f"**{_added(results, level, lambda r: r.gap_p99, path).fmt()}**")
                steady = _added(results, level, lambda r: r.steady_p99, path).fmt()
                pauses = " / ".join(_gc_cells(runs)) if path == "proxied" else "n/a"
            else:
                added, steady, pauses = "— | —", "—", "—"
            yield (f"| {level} | {path} | {_spread(runs, lambda r: r.gap_p50).fmt()} | "
                   f"{_spread(runs, lambda r: r.gap_p99).fmt()} | {_spread(runs, lambda r: r.gap_max).fmt(1)} | "
                   f"{added} | {_spread(runs, lambda r: r.steady_p99).fmt()} | {steady} | {pauses} | "
                   f"{_errors(runs)} |")


def _gc_cells(runs: list[Run]) -> tuple[str, str]:
    """Per round, comma-separated: the pauses over 10 ms, and the bound the longest fell under."""
    pauses = [run.gc for run in runs if run.gc is not None]
    return (",".join(str(p.over_10ms) for p in pauses) or "n/a",
            ",".join(f"{p.longest_under_ms:g}" for p in pauses) or "n/a")


def ttfb_table(results: Results, levels: Sequence[int]) -> Iterator[str]:
    yield ("| streams | path | TTFB p50 ms | TTFB p99 ms | added TTFB p50 / p99 ms | streams with TTFB > 1 s "
           "(all rounds) | accept-queue overflows (all rounds) | SYN retransmits (all rounds) |")
    yield "|---|---|---|---|---|---|---|---|"
    for level in levels:
        for path in results.paths:
            runs = results.runs[(path, level)]
            added = "—"
            if path != "direct":
                added = (f"{_added(results, level, lambda r: r.ttfb_p50, path).fmt(1)} / "
                         f"{_added(results, level, lambda r: r.ttfb_p99, path).fmt(1)}")
            yield (f"| {level} | {path} | {_spread(runs, lambda r: r.ttfb_p50).fmt(1)} | "
                   f"{_spread(runs, lambda r: r.ttfb_p99).fmt(1)} | {added} | "
                   f"{sum(r.ttfb_over_1s for r in runs)} | {sum(r.tcp['ListenOverflows'] for r in runs)} | "
                   f"{sum(r.tcp['TCPSynRetrans'] for r in runs)} |")


def cpu_table(results: Results, levels: Sequence[int], delay_ms: float) -> Iterator[str]:
    yield ("| streams | path | chunks/s (all open) | proxy CPU µs/chunk | proxy % of a core: ramp / all open | "
           "fakes % of a core (sum), all open | each client % of a core, all open | "
           "machine busy % of all CPUs: ramp / all open (softirq) | client loop lag p99 / max ms |")
    yield "|---|---|---|---|---|---|---|---|---|"
    for level in levels:
        for path in results.paths:
            runs = results.runs[(path, level)]
            rate = level * 1000 / delay_ms
            proxy_us = proxy_pct = "—"
            if path != "direct":
                proxy_us = _spread(runs, lambda r: r.proxy_us_per_event).fmt(1)
                proxy_pct = (f"{_spread(runs, lambda r: r.proxy_ramp_pct).fmt(0)} / "
                             f"{_spread(runs, lambda r: r.proxy_steady_pct).fmt(0)}")
            client_pct = _spread(runs, lambda r: max(r.clients_steady_pct)).fmt(0)
            yield (f"| {level} | {path} | {rate:.0f} | {proxy_us} | {proxy_pct} | "
                   f"{_spread(runs, lambda r: r.fakes_steady_pct).fmt(0)} | ≤ {client_pct} | "
                   f"{_spread(runs, lambda r: r.machine_ramp_busy_pct).fmt(0)} / "
                   f"{_spread(runs, lambda r: r.machine_busy_pct).fmt(0)} "
                   f"({_spread(runs, lambda r: r.machine_softirq_pct).fmt(0)}) | "
                   f"{_spread(runs, lambda r: r.client_lag_p99).fmt(1)} / "
                   f"{_spread(runs, lambda r: r.client_lag_max).fmt(0)} |")


def targets(results: Results, levels: Sequence[int]) -> list[tuple[str, str, str, bool]]:
    level = TARGET_LEVEL if TARGET_LEVEL in levels else max(levels)
    added = Spread.of([p.gap_p99 - d.gap_p99 for d, p in zip(results.runs[("direct", level)],
                                                            results.runs[("proxied", level)])])
    errors = sum(run.error_count for path in results.paths for run in results.runs[(path, level)])
    suffix = f" (the target is for {TARGET_LEVEL})" if level != TARGET_LEVEL else ""
    rows = [(f"added chunk-gap p99 at {level} streams (proxied − direct){suffix}", f"{added.fmt()} ms, {errors} errors",
             f"≤ {TARGET_ADDED_P99_MS:g} ms, no errors", added.median <= TARGET_ADDED_P99_MS and errors == 0)]
    if WORKERS_PATH in results.paths:
        rows += list(_workers_targets(results, level, suffix))
    return rows


def _workers_targets(results: Results, level: int, suffix: str) -> Iterator[tuple[str, str, str, bool]]:
    one = _added(results, level, lambda r: r.ttfb_p99)
    many = _added(results, level, lambda r: r.ttfb_p99, WORKERS_PATH)
    if isinstance(one, Spread) and isinstance(many, Spread):
        yield (f"added TTFB p99 at {level} streams: {results.workers} workers vs one process{suffix}",
               f"{many.fmt(1)} vs {one.fmt(1)} ms", f"≤ {TARGET_TTFB_SHARE:g} × one process's",
               many.median <= TARGET_TTFB_SHARE * one.median)
    shares = _cpu_shares(results.runs[(WORKERS_PATH, level)])
    if shares:
        fair = TARGET_CPU_FAIR / results.workers
        yield (f"each worker's share of the workers' CPU, all open, {level} streams (lowest per round)",
               ", ".join(f"{min(run):.0%}" for run in shares), f"≥ {fair:.0%} (half of 1/{results.workers})",
               all(min(run) >= fair for run in shares))
    kill = results.kill
    if kill is not None:
        back = kill.reclaimed_s is not None and kill.reclaimed_s <= kill.lease_ttl
        yield ((f"a SIGKILLed worker holding {kill.held_by_victim} of {HELD_LIMIT} slots: restarted; its slots "
               "granted again"), f"restarted {fmt_s(kill.restarted_s)}, slots back {fmt_s(kill.reclaimed_s)}",
               f"both, slots within lease_ttl {kill.lease_ttl:g} s", back and kill.restarted_s is not None)
        yield ("after the kill: streams on the other workers unharmed; no slot leaked",
               f"{kill.survivors_ok}/{HELD_LIMIT - kill.held_by_victim} streaming; in_flight {kill.in_flight_after}",
               f"{HELD_LIMIT - kill.held_by_victim}/{HELD_LIMIT - kill.held_by_victim}; 0",
               kill.survivors_ok == HELD_LIMIT - kill.held_by_victim and kill.in_flight_after == 0)


def _cpu_shares(runs: list[Run]) -> list[list[float]]:
    """Per run: each worker's share of the workers' CPU in the all-open window (the parent left out)."""
    shares = []
    for run in runs:
        workers = run.proxy_processes_pct[:-1]
        total = sum(workers)
        if workers and total > 0 and not math.isnan(total):
            shares.append([pct / total for pct in workers])
    return shares


def report(results: Results, args: argparse.Namespace, command: str) -> str:
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    stream_s = args.chunks * args.delay_ms / 1000
    lines = [
        "## Many concurrent streams (bench/streams.py)",
        "",
        f"`{command}` — {stamp}, {args.rounds} interleaved round(s), whole run {results.total_s:.0f} s.",
        f"Machine: {machine_note(with_model=True)}.",
        (f"{args.fakes} × `slotproxy fake-upstream` (one port each; stream j → fake j mod {args.fakes}), "
        f"{args.chunks} content chunks {args.delay_ms:g} ms apart per stream ({stream_s:g} s, "
        f"{1000 / args.delay_ms:g} chunks/s); slotproxy (uvloop) with one provider per fake, `limit: null`; "
        f"{args.clients} client processes (uvloop, aiohttp, `TCPConnector(limit=0)`, fresh connections per run), "
        f"the streams of a run started evenly over {args.ramp:g} s. Each level: direct, then proxied, per round."),
        ("Cells: median over rounds (min–max). Gaps: between consecutive content chunks of a stream, pooled over "
        "the run's streams; added = proxied − direct, paired by round, then the median. TTFB: POST to the first "
        f"content chunk, the fake's first {args.delay_ms:g} ms included. \"All open\": only the gaps (and the CPU) "
        "from the last stream's start + 0.3 s to the first one's scheduled end − 0.3 s, when every stream of the "
        "run was open and none was being set up; \"ramp\": from the first start to that window. CPU: utime+stime "
        "from /proc (softirq time, where loopback TCP is processed, is in no process's figure). Accept-queue overflows and SYN "
        "retransmits: this network namespace's TcpExt counters over the run. Proxy µs/chunk: its CPU over the "
        "whole proxied run ÷ SSE events relayed "
        f"({args.chunks} + {EXTRA_EVENTS} per stream), connection set-up included."),
        "",
        "### Target",
        "",
        *pass_miss_table(targets(results, args.levels), "measured: median (min–max)"),
        "",
        "### Chunk gaps",
        "",
        *gap_table(results, args.levels),
        "",
        "### TTFB and connections",
        "",
        *ttfb_table(results, args.levels),
        "",
        "### CPU",
        "",
        *cpu_table(results, args.levels, args.delay_ms),
    ]
    if WORKERS_PATH in results.paths:
        lines += ["", *workers_section(results, args)]
    return "\n".join(lines) + "\n"


def workers_section(results: Results, args: argparse.Namespace) -> Iterator[str]:
    yield f"### `serve --workers {args.workers}` against one process (both on Redis)"
    yield ""
    yield (f"Path `proxied`: one `slotproxy serve`; path `workers`: `slotproxy serve --workers {args.workers}` (one port, "
           f"`SO_REUSEPORT`); both `backend: {{kind: redis, url: {args.redis_url}}}` (each its own key prefix, "
           f"`lease_ttl: {args.lease_ttl:g}s`) with `limit: {WORKERS_LIMIT}` per provider, so every stream takes and "
           "gives back a slot in Redis and nothing queues. CPU of the workers in the all-open window, per worker (% of "
           "a core), and each worker's share of their sum:")
    yield ""
    yield "| streams | round | each worker % of a core (parent) | each worker's share |"
    yield "|---|---|---|---|"
    for level in args.levels:
        for number, run in enumerate(results.runs[(WORKERS_PATH, level)], 1):
            workers = run.proxy_processes_pct[:-1]
            total = sum(workers)
            shares = " / ".join(f"{w / total:.0%}" for w in workers) if total > 0 else "n/a"
            yield (f"| {level} | {number} | {' / '.join(f'{w:.0f}' for w in workers)} "
                   f"({run.proxy_processes_pct[-1]:.0f}) | {shares} |")
    kill = results.kill
    if kill is not None:
        yield ""
        yield (f"Kill: provider `{HELD_PROVIDER}` (`limit: {HELD_LIMIT}`) held by {HELD_LIMIT} long streams through the "
               f"workers; the worker holding most of them ({kill.held_by_victim}) SIGKILLed; at once "
               f"{kill.held_by_victim} new one-chunk requests on `{HELD_PROVIDER}` (retried on a reset connection, as "
               f"an SDK does). From the kill: a new worker listening on the port after {fmt_s(kill.restarted_s)}; "
               f"the last of the new requests answered (the dead worker's leases ran out, `lease_ttl` "
               f"{kill.lease_ttl:g} s) after {fmt_s(kill.reclaimed_s)}; {kill.survivors_ok} of "
               f"{HELD_LIMIT - kill.held_by_victim} streams on the other workers still streaming; `{HELD_PROVIDER}` "
               f"in_flight once all were closed: {kill.in_flight_after}.")
    if results.keys_left is not None:
        yield ""
        yield f"Redis keys left under the run's prefix after the clean-up: {results.keys_left}."


def _levels(raw: str) -> list[int]:
    try:
        levels = [int(part) for part in raw.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {raw!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"must be positive integers, got {raw!r}")
    return levels


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=_levels, default=[250, 500, 1000],
                        help="concurrent streams per run, comma-separated (default 250,500,1000)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--chunks", type=int, default=100, help="content chunks per stream (default 100)")
    parser.add_argument("--delay-ms", type=float, default=50.0, help="ms between chunks (default 50)")
    parser.add_argument("--ramp", type=float, default=1.0, help="seconds over which a run's streams start (default 1)")
    parser.add_argument("--fakes", type=int, default=2, help="fake upstream processes (default 2)")
    parser.add_argument("--clients", type=int, default=2, help="client processes (default 2)")
    parser.add_argument("--workers", type=int, default=0,
                        help="also run `serve --workers N` (N >= 2) against one process, both on Redis, then kill "
                             "a worker (default: off)")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0",
                        help="the Redis of --workers (default redis://127.0.0.1:6379/0)")
    parser.add_argument("--lease-ttl", type=float, default=10.0,
                        help="backend lease_ttl in seconds with --workers (default 10)")
    parser.add_argument("--quick", action="store_true", help="smoke run: levels 100,250, 1 round, 40 chunks, ramp 0.5 s")
    args = parser.parse_args(argv)
    if args.workers == 1 or args.workers < 0 or args.workers > 64 or not 1 <= args.lease_ttl <= 300:
        parser.error("--workers is 0 (off) or 2..64; --lease-ttl in [1, 300]")
    if not args.redis_url.startswith(("redis://127.0.0.1", "redis://localhost")):
        parser.error("--redis-url must be a Redis on this machine (redis://127.0.0.1...)")
    if args.quick:
        args.levels, args.rounds, args.chunks, args.ramp = [100, 250], 1, 40, 0.5
    if args.rounds < 1 or args.chunks < 2 or args.delay_ms <= 0 or args.ramp < 0 \
            or not 1 <= args.fakes <= 16 or not 1 <= args.clients <= 16:
        parser.error("--rounds >= 1, --chunks >= 2, --delay-ms > 0, --ramp >= 0, --fakes and --clients in [1, 16]")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, raise_on_sigterm)
    if not enough_open_files("streams.py", 2 * max(args.levels) + 200):
        return 2
    command = command_line("streams.py", argv)
    with tempfile.TemporaryDirectory(prefix="slotproxy-streams-") as tmp:
        results = run_all(args, Path(tmp))
    print(report(results, args, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
