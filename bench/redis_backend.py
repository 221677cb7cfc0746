"""What does the Redis backend cost, and does a fleet of replicas keep the provider busy? (a benchmark, not a test)

Three measurements, taken in ONE run against a Redis on 127.0.0.1
(``--redis-url``, default ``redis://127.0.0.1:6379/0``):

1. **In-process limiter round trips.** ``RedisBackend(url, key_prefix=<unique>,
   lease_ttl=30)`` vs ``MemoryBackend()``, each ``await start()``, then
   ``configure({"bench": LimiterSettings(limit=10_000)}, frozenset())`` and
   ``await flush()``. Every worker loops
   ``lease = await b.acquire("bench", Priority(prompt_started_at=time.time()))``,
   ``lease.release()``, ``await b.flush()``, for ``--inproc-seconds`` per cell,
   with 1 worker (sequential) and with 16 concurrent workers. The Redis
   release is fire-and-forget (a background task), so the flush is what makes
   the pair a full round trip. Reported: pairs/s (with the flush), the
   latency of ``acquire`` alone, and of acquire+release+flush (p50/p99).
   With 16 workers ``flush()`` waits for every release issued so far, the
   other workers' included, so that column is an upper bound of one pair.
   The loop is uvloop when it is installed (``slotproxy serve`` uses it).
2. **Added latency per proxied request.** A static nginx upstream (``return
   200`` with a fixed small JSON, ``worker_processes 1``) behind two
   ``python -m proxy serve`` processes, one ``backend: {kind: memory}``, one
   ``backend: {kind: redis, ...}``, provider ``bench`` with ``limit: 10000``
   (nothing queues, but every request takes and gives back a slot). wrk
   (``-t1``, a Lua script POSTing a ~200-byte JSON body) at 1 and 16
   connections, ``--wrk-seconds`` per run, interleaved memory, redis, memory,
   redis ... for ``--rounds`` rounds. Reported: req/s, p50/p99, slotproxy CPU
   per request, Redis CPU per request (``INFO cpu``, the whole server), and the
   added p50 (redis − memory, paired per round).
3. **Three-replica fleet utilisation.** ``slotproxy fake-upstream --cap 8
   --chunks 20 --delay-ms 50`` (one stream ≈ 1 s) behind 3 replicas (redis
   backend, one key prefix, provider ``fake`` with ``limit: 8``). 40 agents,
   agent i on replica i mod 3, each a loop of streaming chat completions read
   to ``[DONE]``, for ``--duration`` s. The fake's ``GET /stats`` ``active`` is
   sampled every 50 ms from ``--warmup`` s on; utilisation = mean active / 8.
   Also reported: the fake's 429s (must be 0) and ``max_concurrency`` (must be
   ≤ 8), completed streams, mean queue wait, and the idle time per hand-over
   implied by the utilisation. The same fleet against ONE memory-backend
   slotproxy is run right after as a reference (``--no-reference`` skips it).

Targets (PASS/MISS): added p50 per proxied request (redis − memory) < 1 ms at
each connection count; fleet utilisation ≥ 0.95 with 0 upstream 429s and
max_concurrency ≤ 8.

Every server is started by this script on 127.0.0.1, each in its own process
group, and stopped on the way out. Each run uses a fresh key prefix
(``slotproxy-bench-<hex>-...``) and deletes its keys at the end. Needs
``nginx`` and ``wrk`` on PATH, a Redis at ``--redis-url`` and slotproxy
installed (``pip install -e .``).

Run from the repository root::

    python bench/redis_backend.py              # ~2 min on 2 cores
    python bench/redis_backend.py --quick      # smoke run: 1 round, short runs (~40 s)
    python bench/redis_backend.py --duration 30 --rounds 5

The last thing printed is a markdown section for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis
from common import (  # bench/common.py: this directory is sys.path[0] when run as a script
    HOST,
    WRK_LUA,
    Processes,
    Spread,
    WrkFigures,
    agent_body,
    command_line,
    count_refusal,
    cpu_seconds,
    fmt,
    free_port,
    get_json,
    launch_nginx,
    log,
    machine_note,
    missing_tools,
    nginx_version,
    pass_miss_table,
    pct,
    raise_nofile,
    raise_on_sigterm,
    read_to_done,
    run_loop,
    run_wrk,
    start_fake_upstream,
    start_serve,
    static_nginx_conf,
    wait_http,
    wrk_version,
)

from proxy.backends import MemoryBackend
from proxy.backends.redis import RedisBackend
from proxy.limiter import LimiterSettings, Priority

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

INPROC_PROVIDER = "bench"
INPROC_LIMIT = 10_000
INPROC_CONCURRENCY = (1, 16)
INPROC_MAX_PAIRS = 2_000_000
INPROC_LEASE_TTL = 30.0

WRK_CONNS = (1, 16)
SERVE_LIMIT = 10_000
BACKENDS = ("memory", "redis")
PATH_PROXIED = "/bench/chat/completions"
BODY = json.dumps(
    {
        "model": "bench-model",
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Reply with the single word ok, nothing else, please."},
        ],
        "max_tokens": 4,
        "temperature": 0,
        "user": "bench-redis",
    },
    separators=(",", ":"),
)

CAP = 8
CHUNKS = 20
DELAY_MS = 50
REPLICAS = 3
AGENTS = 40
FLEET_PROVIDER = "fake"
SAMPLE_EVERY = 0.05

TARGET_ADDED_P50_MS = 1.0
TARGET_UTILISATION = 0.95


# --- small helpers -------------------------------------------------------------------


def loop_name() -> str:
    try:
        import uvloop
    except ImportError:
        return "asyncio"
    return f"uvloop {uvloop.__version__}"


# --- Redis ---------------------------------------------------------------------------


class RedisInfo:
    """A small synchronous client for checks, CPU readings and the key clean-up."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)

    def ping(self) -> None:
        self.client.ping()

    def version(self) -> str:
        return str(self.client.info("server").get("redis_version", "?"))

    def cpu_seconds(self) -> float:
        info = self.client.info("cpu")
        return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])

    def delete_prefix(self, prefix: str, max_keys: int = 200_000) -> int:
        """Delete every key under ``prefix`` (bounded); returns how many."""
        deleted = 0
        batch: list[bytes] = []
        for key in self.client.scan_iter(match=f"{prefix}*", count=1000):
            batch.append(key)
            if len(batch) >= 500:
                deleted += int(self.client.delete(*batch))
                batch.clear()
            if deleted + len(batch) >= max_keys:
                log(f"redis: stopped deleting after {max_keys} keys under {prefix}")
                break
        if batch:
            deleted += int(self.client.delete(*batch))
        return deleted

    def count_prefix(self, prefix: str, max_keys: int = 200_000) -> int:
        count = 0
        for _ in self.client.scan_iter(match=f"{prefix}*", count=1000):
            count += 1
            if count >= max_keys:
                break
        return count

    def close(self) -> None:
        self.client.close()


def check_local_url(url: str) -> str:
    host = urllib.parse.urlsplit(url).hostname
    if host not in ("127.0.0.1", "localhost"):
        raise argparse.ArgumentTypeError(f"the Redis URL must point at 127.0.0.1, got {url!r}")
    return url


# --- processes -----------------------------------------------------------------------


def log_lines(procs: Processes, name: str, needle: str) -> list[str]:
    try:
        text = (procs.workdir / f"{name}.log").read_text(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if needle in line]


def start_static_nginx(procs: Processes) -> int:
    port = free_port()
    conf = static_nginx_conf(procs.workdir / "nginx-static", port)
    wait_http(f"http://{HOST}:{port}/", launch_nginx(procs, "nginx-static", conf, exist_ok=True), "nginx-static",
              require_200=True)
    return port


def backend_yaml(kind: str, redis_url: str, prefix: str) -> str:
    if kind == "memory":
        return "backend: {kind: memory}"
    return f"backend: {{kind: redis, url: '{redis_url}', key_prefix: '{prefix}', lease_ttl: 30s}}"


def config_yaml(port: int, backend: str, provider: str, upstream: str, limit: int) -> str:
    """One provider's config on ``backend`` (a ``backend_yaml`` line)."""
    return "\n".join([
        f"server: {{host: {HOST}, port: {port}, shutdown_grace: 1s}}",
        "state: {path: null}",
        backend,
        "providers:",
        f"  {provider}: {{upstream: '{upstream}', limit: {limit}}}",
    ]) + "\n"


def start_slotproxy(procs: Processes, name: str, backend: str, provider: str, upstream: str, limit: int) \
        -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    config = config_yaml(port, backend, provider, upstream, limit)
    return start_serve(procs, name, port, config, ready_path="/readyz", require_200=True), port


def start_fake(procs: Processes, name: str) -> int:
    options = ["--cap", str(CAP), "--chunks", str(CHUNKS), "--delay-ms", str(DELAY_MS)]
    _, port = start_fake_upstream(procs, name, options)
    return port


# --- 1. in-process -------------------------------------------------------------------


@dataclass(frozen=True)
class InprocCell:
    backend: str
    concurrency: int
    pairs: int
    seconds: float
    acquire_us: list[float]
    pair_us: list[float]

    @property
    def rate(self) -> float:
        return self.pairs / self.seconds


async def _inproc_cell(backend: Any, name: str, concurrency: int, seconds: float) -> InprocCell:
    acquire_us: list[float] = []
    pair_us: list[float] = []
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        while time.perf_counter() < deadline and len(pair_us) < INPROC_MAX_PAIRS:
            started = time.perf_counter_ns()
            lease = await backend.acquire(INPROC_PROVIDER, Priority(prompt_started_at=time.time()))
            acquired = time.perf_counter_ns()
            lease.release()
            await backend.flush()
            done = time.perf_counter_ns()
            acquire_us.append((acquired - started) / 1000)
            pair_us.append((done - started) / 1000)

    began = time.perf_counter()
    async with asyncio.timeout(seconds + 30):
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - began
    return InprocCell(name, concurrency, len(pair_us), elapsed, acquire_us, pair_us)


async def _inproc_all(redis_url: str, prefix: str, seconds: float) -> list[InprocCell]:
    cells: list[InprocCell] = []
    settings = {INPROC_PROVIDER: LimiterSettings(limit=INPROC_LIMIT)}
    backends: dict[str, Any] = {
        "memory": MemoryBackend(),
        "redis": RedisBackend(redis_url, key_prefix=prefix, lease_ttl=INPROC_LEASE_TTL),
    }
    try:
        for backend in backends.values():
            await backend.start()
            backend.configure(settings, frozenset())
            await backend.flush()
        if not backends["redis"].ready():
            raise RuntimeError(f"the Redis backend is not ready: {backends['redis'].backend_status()}")
        for name, backend in backends.items():  # warm-up: connections, script loading
            await _inproc_cell(backend, name, 4, min(0.5, seconds))
        for concurrency in INPROC_CONCURRENCY:
            for name, backend in backends.items():
                cell = await _inproc_cell(backend, name, concurrency, seconds)
                cells.append(cell)
                log(f"in-process {name:<6} x{concurrency:<2} {cell.rate:9.0f} pairs/s  acquire p50 "
                    f"{pct(cell.acquire_us, 50):8.1f} µs  pair p50/p99 {pct(cell.pair_us, 50):8.1f}/"
                    f"{pct(cell.pair_us, 99):8.1f} µs")
    finally:
        for backend in backends.values():
            await backend.close()
    return cells


def measure_inproc(redis_url: str, prefix: str, seconds: float) -> list[InprocCell]:
    return list(run_loop(_inproc_all(redis_url, prefix, seconds)))


# --- 2. wrk through two slotproxy processes -----------------------------------------

@dataclass(frozen=True)
class WrkRun:
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    proxy_us_per_req: float
    redis_us_per_req: float


def measure_wrk(url: str, pid: int, info: RedisInfo, conns: int, duration: float, lua: Path) -> WrkRun:
    proxy_before, redis_before = cpu_seconds([pid]), info.cpu_seconds()
    figures = WrkFigures.of(run_wrk(url, conns, duration, lua))
    proxy_used, redis_used = cpu_seconds([pid]) - proxy_before, info.cpu_seconds() - redis_before
    requests = max(figures.requests, 1)
    return WrkRun(
        rps=figures.rps,
        p50_ms=figures.p50_ms,
        p99_ms=figures.p99_ms,
        errors=figures.errors,
        proxy_us_per_req=proxy_used * 1e6 / requests,
        redis_us_per_req=redis_used * 1e6 / requests,
    )


def measure_proxied(procs: Processes, info: RedisInfo, redis_url: str, prefix: str,
                    args: argparse.Namespace) -> dict[tuple[str, int], list[WrkRun]]:
    lua = procs.workdir / "post.lua"
    lua.write_text(WRK_LUA % BODY)
    runs: dict[tuple[str, int], list[WrkRun]] = {}
    try:
        static_port = start_static_nginx(procs)
        upstream = f"http://{HOST}:{static_port}"
        servers = {kind: start_slotproxy(procs, f"slotproxy-{kind}", backend_yaml(kind, redis_url, prefix),
                                         "bench", upstream, SERVE_LIMIT) for kind in BACKENDS}
        urls = {kind: f"http://{HOST}:{port}{PATH_PROXIED}" for kind, (_, port) in servers.items()}
        log("wrk: servers up; warming up")
        for kind in BACKENDS:
            run_wrk(urls[kind], 16, 1, lua)
        for number in range(1, args.rounds + 1):
            for conns in WRK_CONNS:
                for kind in BACKENDS:
                    run = measure_wrk(urls[kind], servers[kind][0].pid, info, conns, args.wrk_seconds, lua)
                    runs.setdefault((kind, conns), []).append(run)
                    log(f"round {number} wrk c={conns:<2} {kind:<6} {run.rps:8.0f} req/s  p50 {run.p50_ms:.3f} ms  "
                        f"p99 {run.p99_ms:.3f} ms  proxy {run.proxy_us_per_req:.0f} µs/req  "
                        f"redis {run.redis_us_per_req:.0f} µs/req  errors {run.errors}")
    finally:
        procs.stop_all()
    return runs


# --- 3. the fleet --------------------------------------------------------------------


@dataclass
class Tally:
    completed: int = 0
    agent_429: int = 0
    errors: int = 0
    queue_ms: list[float] = field(default_factory=list)
    stream_ms: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class FleetResult:
    label: str
    replicas: int
    duration: float
    completed: int
    agent_429: int
    errors: int
    upstream_429: int
    upstream_requests: int
    max_concurrency: int
    utilisation: float | None
    samples: int
    queue_ms: float | None
    stream_ms: float | None
    unhealthy_logs: int
    reclaim_logs: int
    leftovers: tuple[int, int] | None  # (leases, queue members) in Redis after every replica stopped

    @property
    def idle_per_handover_ms(self) -> float | None:
        """If every slot cycles busy T then idle g, utilisation u = T/(T+g), so g = T(1/u − 1)."""
        if not self.utilisation or self.stream_ms is None:
            return None
        return self.stream_ms * (1 / self.utilisation - 1)


async def _one_stream(session: aiohttp.ClientSession, url: str, index: int, tally: Tally) -> None:
    headers = {"X-Conversation-Id": f"agent-{index}"}
    async with session.post(url, json=agent_body(index), headers=headers) as response:
        if response.status != 200:
            await count_refusal(response, tally)
            return
        first = time.perf_counter()
        if not await read_to_done(response):
            tally.errors += 1
            return
        tally.completed += 1
        tally.stream_ms.append((time.perf_counter() - first) * 1000)
        tally.queue_ms.append(float(response.headers.get("X-Slotproxy-Queue-Ms", "nan")))


async def agent(session: aiohttp.ClientSession, url: str, index: int, tally: Tally, until: float) -> None:
    while time.monotonic() < until:
        try:
            await _one_stream(session, url, index, tally)
        except (aiohttp.ClientError, TimeoutError):
            tally.errors += 1
            await asyncio.sleep(0.05)


async def sample_active(session: aiohttp.ClientSession, url: str, tally: Tally, start: float, until: float) -> None:
    """The fake's ``active`` every SAMPLE_EVERY s in [start, until)."""
    ticks = int((until - start) / SAMPLE_EVERY)
    for tick in range(ticks):
        await asyncio.sleep(max(0.0, start + tick * SAMPLE_EVERY - time.monotonic()))
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=1)) as response:
                tally.samples.append(int((await response.json())["active"]))
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
            continue


async def run_fleet(urls: list[str], stats_url: str, duration: float, warmup: float) -> Tally:
    tally = Tally()
    begin = time.monotonic()
    until = begin + duration
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=duration + 30)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=AGENTS + 8)) as session:
        agents = [asyncio.create_task(agent(session, urls[i % len(urls)], i, tally, until)) for i in range(AGENTS)]
        sampler = asyncio.create_task(sample_active(session, stats_url, tally, begin + warmup, until))
        try:
            await asyncio.sleep(duration)
            await asyncio.wait_for(sampler, timeout=5)
        finally:
            for task in [*agents, sampler]:
                task.cancel()
            await asyncio.gather(*agents, sampler, return_exceptions=True)
    return tally


def fleet_run(procs: Processes, label: str, replicas: int, args: argparse.Namespace, info: RedisInfo,
              prefix: str | None) -> FleetResult:
    """``prefix``: the replicas' Redis key prefix, or None for one memory-backend slotproxy."""
    backend = backend_yaml("memory", "", "") if prefix is None else backend_yaml("redis", args.redis_url, prefix)
    try:
        fake_port = start_fake(procs, f"fake-{label}")
        upstream = f"http://{HOST}:{fake_port}/v1"
        names = [f"replica-{label}-{i}" for i in range(replicas)]
        ports = [start_slotproxy(procs, name, backend, FLEET_PROVIDER, upstream, CAP)[1] for name in names]
        urls = [f"http://{HOST}:{port}/{FLEET_PROVIDER}/chat/completions" for port in ports]
        log(f"fleet {label}: {AGENTS} agents over {replicas} replica(s) for {args.duration:g} s")
        tally = asyncio.run(run_fleet(urls, f"http://{HOST}:{fake_port}/stats", args.duration, args.warmup))
        stats = get_json(f"http://{HOST}:{fake_port}/stats")
    finally:
        procs.stop_all()
    leftovers = None
    if prefix is not None:  # every replica has stopped (and released what it held): nothing should be left
        leftovers = (int(info.client.zcard(f"{{{prefix}:{FLEET_PROVIDER}}}:leases")),
                     int(info.client.zcard(f"{{{prefix}:{FLEET_PROVIDER}}}:waiters")))
    waits = [w for w in tally.queue_ms if not math.isnan(w)]
    unhealthy = [line for name in names for line in log_lines(procs, name, "redis backend unreachable")]
    if unhealthy:
        log(f"fleet {label}: {len(unhealthy)} 'unreachable' log lines, the first: {unhealthy[0]}")
    result = FleetResult(
        label=label, replicas=replicas, duration=args.duration, completed=tally.completed,
        agent_429=tally.agent_429, errors=tally.errors, upstream_429=int(stats["rate_limited"]),
        upstream_requests=int(stats["requests"]), max_concurrency=int(stats["max_concurrency"]),
        utilisation=statistics.fmean(tally.samples) / CAP if tally.samples else None, samples=len(tally.samples),
        queue_ms=statistics.fmean(waits) if waits else None,
        stream_ms=statistics.median(tally.stream_ms) if tally.stream_ms else None,
        unhealthy_logs=len(unhealthy),
        reclaim_logs=sum(len(log_lines(procs, name, "reclaimed")) for name in names),
        leftovers=leftovers,
    )
    log(f"fleet {label}: utilisation {fmt(result.utilisation, 3)} ({result.samples} samples), "
        f"{result.completed} completed, upstream 429s {result.upstream_429}, max_concurrency "
        f"{result.max_concurrency}, queue wait {fmt(result.queue_ms, 0)} ms, idle per hand-over "
        f"{fmt(result.idle_per_handover_ms, 1)} ms, redis leftovers (leases, queued) {result.leftovers}")
    return result


# --- the run -------------------------------------------------------------------------


@dataclass
class Results:
    inproc: list[InprocCell] = field(default_factory=list)
    wrk: dict[tuple[str, int], list[WrkRun]] = field(default_factory=dict)
    fleet: list[FleetResult] = field(default_factory=list)
    keys_deleted: int = 0
    keys_left: int = 0


def run_all(args: argparse.Namespace, workdir: Path, info: RedisInfo, base: str) -> Results:
    results = Results()
    procs = Processes(workdir)
    try:
        log(f"in-process: {args.inproc_seconds:g} s per cell, key prefix {base}-inproc")
        results.inproc = measure_inproc(args.redis_url, f"{base}-inproc", args.inproc_seconds)
        results.wrk = measure_proxied(procs, info, args.redis_url, f"{base}-serve", args)
        results.fleet.append(fleet_run(procs, "redis", REPLICAS, args, info, f"{base}-fleet"))
        if args.reference:
            results.fleet.append(fleet_run(procs, "memory", 1, args, info, None))
    finally:
        procs.stop_all()
        results.keys_deleted = info.delete_prefix(f"{base}-")
        results.keys_left = info.count_prefix(f"{base}-")
        log(f"redis: deleted {results.keys_deleted} keys under {base}-*, {results.keys_left} left")
    return results


# --- report --------------------------------------------------------------------------


def inproc_table(cells: Sequence[InprocCell]) -> Iterator[str]:
    yield ("| backend | tasks | pairs/s (acquire+release+flush) | acquire p50 µs | acquire p99 µs "
           "| acquire+release incl. flush p50 µs | p99 µs | pairs |")
    yield "|---|---|---|---|---|---|---|---|"
    for c in cells:
        yield (f"| {c.backend} | {c.concurrency} | {c.rate:.0f} | {pct(c.acquire_us, 50):.1f} | "
               f"{pct(c.acquire_us, 99):.1f} | {pct(c.pair_us, 50):.1f} | {pct(c.pair_us, 99):.1f} | {c.pairs} |")


def _added_p50(wrk: dict[tuple[str, int], list[WrkRun]], conns: int) -> Spread:
    return Spread.of([r.p50_ms - m.p50_ms for m, r in zip(wrk[("memory", conns)], wrk[("redis", conns)])])


def wrk_table(wrk: dict[tuple[str, int], list[WrkRun]]) -> Iterator[str]:
    yield ("| conns | backend | req/s | p50 ms | p99 ms | slotproxy CPU µs/req | Redis CPU µs/req "
           "| added p50 ms (redis − memory) | errors |")
    yield "|---|---|---|---|---|---|---|---|---|"
    for conns in WRK_CONNS:
        for kind in BACKENDS:
            runs = wrk[(kind, conns)]
            added = _added_p50(wrk, conns).fmt(3) if kind == "redis" else "—"
            redis_cpu = Spread.of([r.redis_us_per_req for r in runs]).fmt(0) if kind == "redis" else "—"
            yield (f"| {conns} | {kind} | {Spread.of([r.rps for r in runs]).fmt(0)} | "
                   f"{Spread.of([r.p50_ms for r in runs]).fmt(3)} | {Spread.of([r.p99_ms for r in runs]).fmt(3)} | "
                   f"{Spread.of([r.proxy_us_per_req for r in runs]).fmt(0)} | {redis_cpu} | {added} | "
                   f"{sum(r.errors for r in runs)} |")


def fleet_table(fleet: Sequence[FleetResult]) -> Iterator[str]:
    yield ("| backend | replicas | utilisation | upstream 429s | max_concurrency | completed | streams/s "
           "| mean queue wait ms | stream p50 ms | idle per hand-over ms | agent errors | 'unreachable' logs "
           "| left in Redis: leases / queued |")
    yield "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    for f in fleet:
        left = "—" if f.leftovers is None else f"{f.leftovers[0]} / {f.leftovers[1]}"
        yield (f"| {f.label} | {f.replicas} | {fmt(f.utilisation, 3)} | {f.upstream_429} | {f.max_concurrency} | "
               f"{f.completed} | {f.completed / f.duration:.2f} | {fmt(f.queue_ms, 0)} | {fmt(f.stream_ms, 0)} | "
               f"{fmt(f.idle_per_handover_ms, 1)} | {f.errors + f.agent_429} | {f.unhealthy_logs} | {left} |")


def target_rows(results: Results) -> Iterator[tuple[str, str, str, bool]]:
    for conns in WRK_CONNS:
        added = _added_p50(results.wrk, conns)
        yield (f"added p50 per proxied request at {conns} conn(s), redis − memory", f"{added.fmt(3)} ms",
               f"< {TARGET_ADDED_P50_MS:g} ms", added.median < TARGET_ADDED_P50_MS)
    fleet = next((f for f in results.fleet if f.label == "redis"), None)
    if fleet is not None:
        ok = fleet.utilisation is not None and fleet.utilisation >= TARGET_UTILISATION
        yield ("fleet utilisation, 3 redis replicas", fmt(fleet.utilisation, 3), f"≥ {TARGET_UTILISATION}", ok)
        yield ("fleet upstream 429s", str(fleet.upstream_429), "0", fleet.upstream_429 == 0)
        yield ("fleet upstream max_concurrency", str(fleet.max_concurrency), f"≤ {CAP}", fleet.max_concurrency <= CAP)


def targets_table(results: Results) -> Iterator[str]:
    yield from pass_miss_table(target_rows(results))


def _machine_note(info: RedisInfo) -> str:
    return machine_note(f"redis-py {redis.__version__}", f"Redis {info.version()}", loop_name(), nginx_version(),
                        wrk_version())


def report(results: Results, args: argparse.Namespace, command: str, info: RedisInfo) -> str:
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "## Redis backend (bench/redis_backend.py)",
        "",
        f"`{command}` — {stamp}. Redis on 127.0.0.1 (the shared local server, no persistence).",
        f"Machine: {_machine_note(info)}.",
        "",
        "### Targets",
        "",
        *targets_table(results),
        "",
        (f"### 1. In-process acquire+release ({args.inproc_seconds:g} s per cell, limit {INPROC_LIMIT}, "
         "nothing queues)"),
        "",
        ("Acquire = `await acquire()`. Pair = acquire, `release()`, `await flush()`: the Redis release is a "
         "background task, so the flush makes the pair a full round trip (the proxy itself never waits for it). "
         "With 16 tasks the flush also waits for the other tasks' releases: an upper bound."),
        "",
        *inproc_table(results.inproc),
        "",
        (f"### 2. Small POSTs through slotproxy, memory vs redis backend (wrk {args.wrk_seconds:g} s per run, "
         f"{args.rounds} interleaved round(s))"),
        "",
        (f"Static nginx upstream; provider `limit: {SERVE_LIMIT}`. Cells: median over rounds (min–max). "
         "Added p50 is paired per round. Redis CPU is the whole server's (`INFO cpu`) over the run / requests."),
        "",
        *wrk_table(results.wrk),
        "",
        (f"### 3. Fleet: {AGENTS} agents, {args.duration:g} s, fake `--cap {CAP} --chunks {CHUNKS} "
         f"--delay-ms {DELAY_MS}`, provider `limit: {CAP}`"),
        "",
        (f"Utilisation = mean of the fake's `active` (`GET /stats` every {SAMPLE_EVERY * 1000:g} ms from "
         f"{args.warmup:g} s on) / {CAP}. Idle per hand-over = stream p50 × (1/utilisation − 1): the time a slot "
         "stays empty between one stream ending and the next starting, if all of the shortfall is hand-over. "
         "Left in Redis = leases and queue members under the fleet's prefix after every replica stopped "
         "(0 / 0 expected). The memory row (one slotproxy) is the reference."),
        "",
        *fleet_table(results.fleet),
        "",
        f"Redis keys: {results.keys_deleted} deleted under the run's prefix, {results.keys_left} left.",
    ]
    return "\n".join(lines) + "\n"


# --- command line --------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--duration", type=float, default=None, help="seconds of the fleet run (default 20; --quick 6)")
    add("--warmup", type=float, default=None, help="fleet seconds skipped before sampling (default 2; --quick 1)")
    add("--rounds", type=int, default=None, help="interleaved wrk rounds (default 3; --quick 1)")
    add("--wrk-seconds", type=float, default=None, help="seconds per wrk run (default 5; --quick 2)")
    add("--inproc-seconds", type=float, default=None, help="seconds per in-process cell (default 3; --quick 1)")
    add("--no-reference", dest="reference", action="store_false", help="skip the memory-backend fleet reference")
    add("--redis-url", type=check_local_url, default=DEFAULT_REDIS_URL, help=f"default {DEFAULT_REDIS_URL}")
    add("--quick", action="store_true", help="smoke run: 1 round, 2 s wrk runs, 1 s cells, 6 s fleet")
    args = parser.parse_args(argv)
    quick = {"duration": 6.0, "warmup": 1.0, "rounds": 1, "wrk_seconds": 2.0, "inproc_seconds": 1.0}
    full = {"duration": 20.0, "warmup": 2.0, "rounds": 3, "wrk_seconds": 5.0, "inproc_seconds": 3.0}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not 0 < args.duration <= 600 or not 0 <= args.warmup < args.duration:
        parser.error("--duration must be in (0, 600] and --warmup in [0, duration)")
    if not 1 <= args.rounds <= 20 or not 0 < args.wrk_seconds <= 120 or not 0 < args.inproc_seconds <= 120:
        parser.error("--rounds must be in 1..20, --wrk-seconds and --inproc-seconds in (0, 120]")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if missing_tools("redis_backend.py", ("nginx", "wrk"), "nginx wrk"):
        return 2
    info = RedisInfo(args.redis_url)
    try:
        info.ping()
    except redis.RedisError as exc:
        print(f"redis_backend.py: no Redis at {args.redis_url}: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, raise_on_sigterm)
    log(f"open-file limit raised to {raise_nofile()}")
    command = command_line("redis_backend.py", argv)
    base = f"slotproxy-bench-{uuid.uuid4().hex[:10]}"
    try:
        with tempfile.TemporaryDirectory(prefix="slotproxy-redis-bench-") as tmp:
            results = run_all(args, Path(tmp), info, base)
        print(report(results, args, command, info))
    finally:
        info.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
