"""What does the Redis backend cost, and does a fleet of replicas keep the provider busy? (a benchmark, not a test)

Four measurements, taken in ONE run against the Redis topologies of ``--topologies`` (default all three):
``single``, the Redis on 127.0.0.1 at ``--redis-url`` (default ``redis://127.0.0.1:6379/0``); ``sentinel``,
a primary, a replica and three sentinels; ``cluster``, a three-primary Redis Cluster. The last two are
started by this run from Debian's ``redis-server`` on free ports, with ``tests/backends/topology.py`` (the
tests' own topologies: sentinels with ``down-after-milliseconds 1000``), and stopped at its end.

1. **In-process limiter round trips.** ``RedisBackend(target, key_prefix=<unique>,
   lease_ttl=30)`` on each topology vs ``MemoryBackend()``, each ``await start()``, then
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
2. **CPU and added latency per proxied request.** A static nginx upstream (``return
   200`` with a fixed small JSON, ``worker_processes 1``) behind one
   ``python -m proxy serve`` process per backend: ``backend: {kind: memory}``, and
   ``backend: {kind: redis, ...}`` on each topology (``url``, ``sentinels`` + ``service``,
   ``cluster``), provider ``bench`` with ``limit: 10000`` (nothing queues, but every request
   takes and gives back a slot). wrk (``-t1``, a Lua script POSTing a ~200-byte JSON body) at
   1 and 16 connections, ``--wrk-seconds`` per run, interleaved memory, redis, sentinel,
   cluster, memory ... for ``--rounds`` rounds. Reported: req/s, p50/p99, slotproxy CPU per
   request and its ratio to the memory backend's (paired per round), Redis CPU per request
   (the shared server's ``INFO cpu``; for a started topology, every one of its processes from
   /proc, sentinels included), and the added p50 (redis − memory, paired per round).
3. **Three-replica fleet utilisation** (with ``single`` only). ``slotproxy fake-upstream --cap 8
   --chunks 20 --delay-ms 50`` (one stream ≈ 1 s) behind 3 replicas (redis
   backend, one key prefix, provider ``fake`` with ``limit: 8``). 40 agents,
   agent i on replica i mod 3, each a loop of streaming chat completions read
   to ``[DONE]``, for ``--duration`` s. The fake's ``GET /stats`` ``active`` is
   sampled every 50 ms from ``--warmup`` s on; utilisation = mean active / 8.
   Also reported: the fake's 429s (must be 0) and ``max_concurrency`` (must be
   ≤ 8), completed streams, mean queue wait, and the idle time per hand-over
   implied by the utilisation. The same fleet against ONE memory-backend
   slotproxy is run right after as a reference (``--no-reference`` skips it).
4. **Sentinel failover** (``--failovers`` trials, default 5; 0 skips). Each trial starts a
   FRESH Sentinel topology (no failing back: every trial kills a primary that has served
   nothing but this trial) and one in-process ``RedisBackend`` on it (``lease_ttl`` 30 s, the
   config's default, ``on_backend_error: fail_closed``). A steady light load: a new
   ``acquire`` every 10 ms, each lease released as soon as it is granted. After 1 s of
   grants the arrivals pause until nothing is in flight (no answer of the old primary can
   arrive late), the primary is SIGKILLed and the arrivals resume at once. Measured from the
   kill: when the sentinels name another primary (polled every 10 ms), the first grant after
   the kill (its lease is then looked up in the new primary's ``leases`` set before it is
   released: it must be there), and when the backend counts the failover
   (``backend.failovers``). Also: the longest a request waited through the failover, and
   the acquires that failed. Reported per trial and the median over trials.

Targets (PASS/MISS): slotproxy CPU per request at 16 connections on every Redis topology
≤ 1.5× the memory backend's (paired per round); added p50 per proxied request (single Redis −
memory) < 1 ms at each connection count; fleet utilisation ≥ 0.95 with 0 upstream 429s and
max_concurrency ≤ 8; every failover trial granted again on the new primary. The failover time
itself has no target: it is mostly the sentinels' detection (``down-after-milliseconds``).

``--py-spy`` adds one more 16-connection wrk run per backend with ``py-spy record`` (raw,
non-blocking, 250 Hz) on the slotproxy process, and reports the functions with the most own
samples (what ``py-spy top`` lists first). Needs ``py-spy`` (``pip install py-spy``).

Every server is started by this script on 127.0.0.1, each in its own process
group, and stopped on the way out. Each run uses a fresh key prefix
(``slotproxy-bench-<hex>-...``) and deletes its keys on the shared Redis at the end. Needs
``nginx`` and ``wrk`` on PATH, ``redis-server`` and ``redis-cli`` for the started topologies,
a Redis at ``--redis-url`` for ``single`` and slotproxy installed (``pip install -e .``).

Run from the repository root::

    python bench/redis_backend.py              # ~5 min on 2 cores
    python bench/redis_backend.py --quick      # smoke run: 1 round, short runs, 1 failover (~1.5 min)
    python bench/redis_backend.py --topologies sentinel,cluster --failovers 5
    python bench/redis_backend.py --duration 30 --rounds 5 --py-spy

Progress goes to stderr; the last thing printed (stdout) is a markdown section for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import math
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis
import redis.asyncio as aioredis
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
    delete_redis_keys,
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
    process_tree,
    raise_nofile,
    raise_on_sigterm,
    read_to_done,
    redis_keys,
    run_loop,
    run_wrk,
    start_fake_upstream,
    start_serve,
    static_nginx_conf,
    wait_http,
    wrk_version,
)

from proxy.backends import MemoryBackend
from proxy.backends.redis import RedisBackend, RedisTarget
from proxy.errors import SlotproxyError
from proxy.limiter import LimiterSettings, Priority

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # the tests' topologies: tests/backends/topology.py
    sys.path.insert(1, str(REPO))
from tests.backends.topology import SERVICE, ClusterTopology, SentinelTopology

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
TOPOLOGIES = ("single", "sentinel", "cluster")
KIND_OF = {"single": "redis", "sentinel": "sentinel", "cluster": "cluster"}
"""The row name of each topology (``redis`` is the single server, as in the earlier RESULTS sections)."""
LABEL = {"memory": "memory", "redis": "redis (one server)", "sentinel": "redis sentinel", "cluster": "redis cluster"}

INPROC_PROVIDER = "bench"
INPROC_LIMIT = 10_000
INPROC_CONCURRENCY = (1, 16)
INPROC_MAX_PAIRS = 2_000_000
INPROC_LEASE_TTL = 30.0

WRK_CONNS = (1, 16)
SERVE_LIMIT = 10_000
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

FAILOVER_EVERY = 0.01
"""One acquire every 10 ms during a failover trial: a steady light load."""
FAILOVER_WARMUP = 1.0
FAILOVER_TIMEOUT = 30.0
FAILOVER_LEASE_TTL = 30.0
FAILOVER_POLL = 0.01

PYSPY_RATE = 250
PYSPY_TOP = 12

TARGET_ADDED_P50_MS = 1.0
TARGET_UTILISATION = 0.95
TARGET_CPU_RATIO = 1.5
TARGET_CPU_CONNS = 16


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
        return delete_redis_keys(self.client, prefix, max_keys)

    def count_prefix(self, prefix: str, max_keys: int = 200_000) -> int:
        return sum(1 for _ in itertools.islice(redis_keys(self.client, prefix), max_keys))

    def close(self) -> None:
        self.client.close()


def check_local_url(url: str) -> str:
    host = urllib.parse.urlsplit(url).hostname
    if host not in ("127.0.0.1", "localhost"):
        raise argparse.ArgumentTypeError(f"the Redis URL must point at 127.0.0.1, got {url!r}")
    return url


def parse_topologies(text: str) -> tuple[str, ...]:
    chosen = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [name for name in chosen if name not in TOPOLOGIES]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"--topologies takes a comma-separated subset of {','.join(TOPOLOGIES)}, "
                                         f"got {text!r}")
    return chosen


# --- where Redis is: the shared server, or a topology this run started ----------------


@dataclass
class RedisPlace:
    """One Redis row's Redis: how the backend reaches it (``target``, ``where``: the YAML fields that say the
    same), how much CPU it has used so far, and how to stop it (a topology this run started)."""

    kind: str
    target: RedisTarget | str
    where: str
    cpu: Callable[[], float]
    note: str
    stop: Callable[[], None] = lambda: None

    def backend_yaml(self, prefix: str) -> str:
        return f"backend: {{kind: redis, {self.where}, key_prefix: '{prefix}', lease_ttl: 30s}}"


def _addresses(ports: Sequence[int]) -> str:
    return "[" + ", ".join(f"'{HOST}:{port}'" for port in ports) + "]"


def sentinel_target(topology: SentinelTopology) -> RedisTarget:
    return RedisTarget(sentinels=tuple((HOST, s.port) for s in topology.sentinels), service=SERVICE)


def single_place(info: RedisInfo, url: str) -> RedisPlace:
    return RedisPlace("redis", url, f"url: '{url}'", info.cpu_seconds,
                      f"one server, {url} (the shared local server, no persistence); Redis CPU from its INFO cpu")


def sentinel_place(topology: SentinelTopology) -> RedisPlace:
    processes = [topology.primary, topology.replica, *topology.sentinels]
    ports = [s.port for s in topology.sentinels]
    return RedisPlace(
        "sentinel", sentinel_target(topology), f"sentinels: {_addresses(ports)}, service: {SERVICE}",
        lambda: cpu_seconds([p.process.pid for p in processes if p.process is not None]),
        (f"a primary ({topology.primary.address}), its replica and three sentinels started by this run "
         "(tests/backends/topology.py); Redis CPU: the five processes, from /proc"),
        topology.stop)


def cluster_place(topology: ClusterTopology) -> RedisPlace:
    return RedisPlace(
        "cluster", RedisTarget(cluster=tuple((HOST, node.port) for node in topology.nodes)),
        f"cluster: {_addresses([node.port for node in topology.nodes])}",
        lambda: cpu_seconds([node.process.pid for node in topology.nodes if node.process is not None]),
        ("three primaries, no replicas, started by this run (tests/backends/topology.py); a provider's keys "
         "share one hash tag, so its scripts run on one node; Redis CPU: the three nodes, from /proc"),
        topology.stop)


def start_places(topologies: Sequence[str], info: RedisInfo | None, url: str) -> dict[str, RedisPlace]:
    """A place per topology, in the order asked; the started ones are stopped by ``place.stop``."""
    places: dict[str, RedisPlace] = {}
    try:
        for name in topologies:
            if name == "single":
                assert info is not None
                places["redis"] = single_place(info, url)
            elif name == "sentinel":
                log("starting a Sentinel topology (primary, replica, three sentinels)")
                places["sentinel"] = sentinel_place(SentinelTopology.start())
            else:
                log("starting a three-primary Redis Cluster")
                places["cluster"] = cluster_place(ClusterTopology.start())
    except BaseException:
        stop_places(places)
        raise
    return places


def stop_places(places: dict[str, RedisPlace]) -> None:
    for place in places.values():
        place.stop()


def server_version(places: dict[str, RedisPlace], info: RedisInfo | None) -> str:
    if info is not None:
        return info.version()
    found = shutil.which("redis-server")
    if found is None:
        return "?"
    words = subprocess.run([found, "--version"], capture_output=True, text=True, check=False).stdout.split()
    return next((word[2:] for word in words if word.startswith("v=")), "?")


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


async def _inproc_all(places: dict[str, RedisPlace], prefix: str, seconds: float) -> list[InprocCell]:
    cells: list[InprocCell] = []
    settings = {INPROC_PROVIDER: LimiterSettings(limit=INPROC_LIMIT)}
    backends: dict[str, Any] = {"memory": MemoryBackend()}
    for kind, place in places.items():
        backends[kind] = RedisBackend(place.target, key_prefix=f"{prefix}-{kind}", lease_ttl=INPROC_LEASE_TTL)
    try:
        for backend in backends.values():
            await backend.start()
            backend.configure(settings, frozenset())
            await backend.flush()
        for kind in places:
            if not backends[kind].ready():
                raise RuntimeError(f"the {kind} backend is not ready: {backends[kind].backend_status()}")
        for name, backend in backends.items():  # warm-up: connections, script loading
            await _inproc_cell(backend, name, 4, min(0.5, seconds))
        for concurrency in INPROC_CONCURRENCY:
            for name, backend in backends.items():
                cell = await _inproc_cell(backend, name, concurrency, seconds)
                cells.append(cell)
                log(f"in-process {name:<8} x{concurrency:<2} {cell.rate:9.0f} pairs/s  acquire p50 "
                    f"{pct(cell.acquire_us, 50):8.1f} µs  pair p50/p99 {pct(cell.pair_us, 50):8.1f}/"
                    f"{pct(cell.pair_us, 99):8.1f} µs")
    finally:
        for backend in backends.values():
            await backend.close()
    return cells


def measure_inproc(places: dict[str, RedisPlace], prefix: str, seconds: float) -> list[InprocCell]:
    return list(run_loop(_inproc_all(places, prefix, seconds)))


# --- 2. wrk through one slotproxy process per backend --------------------------------

@dataclass(frozen=True)
class WrkRun:
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    proxy_us_per_req: float
    redis_us_per_req: float


def measure_wrk(url: str, pid: int, redis_cpu: Callable[[], float], conns: int, duration: float,
                lua: Path) -> WrkRun:
    pids = process_tree(pid)
    proxy_before, redis_before = cpu_seconds(pids), redis_cpu()
    figures = WrkFigures.of(run_wrk(url, conns, duration, lua))
    proxy_used, redis_used = cpu_seconds(pids) - proxy_before, redis_cpu() - redis_before
    requests = max(figures.requests, 1)
    return WrkRun(
        rps=figures.rps,
        p50_ms=figures.p50_ms,
        p99_ms=figures.p99_ms,
        errors=figures.errors,
        proxy_us_per_req=proxy_used * 1e6 / requests,
        redis_us_per_req=redis_used * 1e6 / requests,
    )


@dataclass
class Proxied:
    runs: dict[tuple[str, int], list[WrkRun]] = field(default_factory=dict)
    profiles: dict[str, Profile] = field(default_factory=dict)


def measure_proxied(procs: Processes, places: dict[str, RedisPlace], prefix: str,
                    args: argparse.Namespace) -> Proxied:
    lua = procs.workdir / "post.lua"
    lua.write_text(WRK_LUA % BODY)
    kinds = ["memory", *places]
    cpu: dict[str, Callable[[], float]] = {"memory": lambda: 0.0}
    cpu.update({kind: place.cpu for kind, place in places.items()})
    result = Proxied()
    try:
        static_port = start_static_nginx(procs)
        upstream = f"http://{HOST}:{static_port}"
        servers: dict[str, tuple[subprocess.Popen[bytes], int]] = {}
        for kind in kinds:
            backend = backend_yaml("memory", "", "") if kind == "memory" else \
                places[kind].backend_yaml(f"{prefix}-{kind}")
            servers[kind] = start_slotproxy(procs, f"slotproxy-{kind}", backend, "bench", upstream, SERVE_LIMIT)
        urls = {kind: f"http://{HOST}:{port}{PATH_PROXIED}" for kind, (_, port) in servers.items()}
        log(f"wrk: servers up ({', '.join(kinds)}); warming up")
        for kind in kinds:
            run_wrk(urls[kind], 16, 1, lua)
        for number in range(1, args.rounds + 1):
            for conns in WRK_CONNS:
                for kind in kinds:
                    run = measure_wrk(urls[kind], servers[kind][0].pid, cpu[kind], conns, args.wrk_seconds, lua)
                    result.runs.setdefault((kind, conns), []).append(run)
                    ratio = run.proxy_us_per_req / result.runs[("memory", conns)][-1].proxy_us_per_req
                    log(f"round {number} wrk c={conns:<2} {kind:<8} {run.rps:8.0f} req/s  p50 {run.p50_ms:.3f} ms  "
                        f"p99 {run.p99_ms:.3f} ms  proxy {run.proxy_us_per_req:.0f} µs/req ({ratio:.2f}× memory)  "
                        f"redis {run.redis_us_per_req:.0f} µs/req  errors {run.errors}")
        if args.py_spy:
            for kind in kinds:
                result.profiles[kind] = profile_server(urls[kind], servers[kind][0].pid, args.wrk_seconds, lua,
                                                       procs.workdir / f"py-spy-{kind}.txt")
                log(f"py-spy {kind}: {result.profiles[kind].samples} samples, top: "
                    + "; ".join(f"{name} {share:.1%}" for name, share, _ in result.profiles[kind].top[:3]))
    finally:
        procs.stop_all()
    return result


# --- py-spy: where a server's samples are, while wrk runs at 16 connections ----------


@dataclass(frozen=True)
class Profile:
    samples: int
    rps: float
    top: list[tuple[str, float, float]]  # (function (file), own share, total share)


def _frame_name(frame: str) -> str:
    """``function (/abs/path/file.py:line)`` → ``function (pkg/file.py)``: one entry per function, as py-spy top
    lists them; paths shortened to the repository, site-packages or the standard library."""
    name, _, where = frame.partition(" (")
    where = where.removesuffix(")")
    path = where.rpartition(":")[0] or where
    for marker in (f"{REPO}/", "site-packages/", f"python{sys.version_info.major}.{sys.version_info.minor}/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{name} ({path})"


def py_spy_path() -> str | None:
    """py-spy beside this Python (a venv's ``pip install py-spy``), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def profile_server(url: str, pid: int, seconds: float, lua: Path, out: Path) -> Profile:
    """One 16-connection wrk run with ``py-spy record`` on ``pid``; the functions with the most own samples."""
    argv = [py_spy_path() or "py-spy", "record", "--pid", str(pid), "--rate", str(PYSPY_RATE),
            "--duration", f"{max(1, int(seconds))}",
            "--format", "raw", "--nonblocking", "--output", str(out)]
    spy = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(0.3)  # py-spy attached before the load starts
    figures = WrkFigures.of(run_wrk(url, TARGET_CPU_CONNS, max(1, int(seconds)) + 1, lua))  # outlasts py-spy
    _, err = spy.communicate(timeout=seconds + 30)
    if spy.returncode != 0 or not out.exists():
        raise RuntimeError(f"py-spy failed (exit {spy.returncode}): {err.decode(errors='replace')[-500:]}")
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    samples = 0
    for line in out.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_frame_name(frame) for frame in stack.split(";")]
        if not frames:
            continue
        samples += count
        own[frames[-1]] += count
        for name in set(frames):
            total[name] += count
    top = [(name, n / samples, total[name] / samples) for name, n in own.most_common(PYSPY_TOP)] if samples else []
    return Profile(samples, figures.rps, top)


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


# --- 4. Sentinel failover: SIGKILL of the primary → the first grant on the new one --------


@dataclass(frozen=True)
class FailoverTrial:
    old: str
    new: str | None
    promoted_s: float | None
    """Kill → the sentinels name another primary (polled every FAILOVER_POLL s)."""
    grant_s: float | None
    """Kill → the first grant after it."""
    noticed_s: float | None
    """Kill → the backend counts the failover (``backend.failovers``)."""
    on_new_primary: bool | None
    """The first grant's lease was in the new primary's ``leases`` set."""
    grants_before: int
    longest_wait_s: float
    """The longest any acquire waited, start to grant (those caught by the failover)."""
    caught: int
    """Acquires still waiting when the first grant came (they retry on their own)."""
    errors: dict[str, int]


def _poll_promotion(topology: SentinelTopology, old: str, deadline: float) -> tuple[str | None, float | None]:
    """In a thread: the first address other than ``old`` the sentinels name, and when (perf_counter)."""
    client = redis.Redis(port=topology.sentinels[0].port, socket_timeout=1, socket_connect_timeout=1)
    try:
        while time.perf_counter() < deadline:
            try:
                answer: Any = client.sentinel_get_master_addr_by_name(SERVICE)
                host, port = answer
            except redis.RedisError:
                time.sleep(FAILOVER_POLL)
                continue
            address = f"{host.decode() if isinstance(host, bytes) else host}:{port}"
            if address != old:
                return address, time.perf_counter()
            time.sleep(FAILOVER_POLL)
        return None, None
    finally:
        client.close()


async def _lease_on(address: str, key: str, member: str) -> bool:
    host, _, port = address.rpartition(":")
    client = aioredis.Redis(host=host, port=int(port), socket_timeout=2, socket_connect_timeout=2)
    try:
        return await client.zscore(key, member) is not None
    finally:
        await client.aclose()


async def _failover_trial(number: int, prefix: str) -> FailoverTrial:
    topology = await asyncio.to_thread(SentinelTopology.start)
    backend = RedisBackend(sentinel_target(topology), key_prefix=prefix, lease_ttl=FAILOVER_LEASE_TTL)
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()
    waiting: dict[int, float] = {}  # acquires in flight: id → started
    errors: Counter[str] = Counter()
    killed_at: float | None = None
    first_at: float | None = None
    first_lease: Any = None
    first_granted = asyncio.Event()
    paused = False
    grants_before = 0
    longest = 0.0
    caught = 0
    ids = iter(range(1 << 62))

    async def one() -> None:
        nonlocal first_at, first_lease, grants_before, longest, caught
        me, started = next(ids), time.perf_counter()
        waiting[me] = started
        try:
            lease = await backend.acquire(INPROC_PROVIDER, Priority(prompt_started_at=time.time()))
        except (SlotproxyError, redis.RedisError) as exc:
            errors[type(exc).__name__] += 1
            return
        finally:
            del waiting[me]
        at = time.perf_counter()
        longest = max(longest, at - started)
        if killed_at is None:
            grants_before += 1
        elif first_at is None:
            first_at, first_lease, caught = at, lease, len(waiting)
            first_granted.set()
            return  # held until it is looked up in the new primary
        lease.release()

    async def arrivals() -> None:
        next_at = loop.time()
        while True:
            if not paused:
                task = asyncio.create_task(one())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            next_at += FAILOVER_EVERY
            await asyncio.sleep(max(0.0, next_at - loop.time()))

    feeder: asyncio.Task[None] | None = None
    try:
        await backend.start()
        backend.configure({INPROC_PROVIDER: LimiterSettings(limit=INPROC_LIMIT)}, frozenset())
        await backend.flush()
        if not backend.ready():
            raise RuntimeError(f"the Sentinel backend is not ready: {backend.backend_status()}")
        old = await asyncio.to_thread(topology.current_primary)
        feeder = asyncio.create_task(arrivals())
        await asyncio.sleep(FAILOVER_WARMUP)
        paused = True  # nothing in flight at the kill: every grant after it comes from a script sent after it
        async with asyncio.timeout(10):
            while waiting or any(not task.done() for task in tasks):
                await asyncio.sleep(0.001)
            await backend.flush()
        poll = asyncio.create_task(asyncio.to_thread(_poll_promotion, topology, old,
                                                     time.perf_counter() + FAILOVER_TIMEOUT))
        killed_at = time.perf_counter()
        topology.primary.kill()
        paused = False
        noticed_at: float | None = None
        try:
            async with asyncio.timeout(FAILOVER_TIMEOUT):
                await first_granted.wait()
                while backend.failovers < 1:
                    await asyncio.sleep(FAILOVER_POLL)
                noticed_at = time.perf_counter()
                # the acquires the failover caught retry on their own: wait for the last of them (longest wait)
                while first_at is not None and any(started <= first_at for started in waiting.values()):
                    await asyncio.sleep(FAILOVER_POLL)
        except TimeoutError:
            log(f"failover {number}: no grant, no failover counted, or acquires caught by it still waiting, "
                f"{FAILOVER_TIMEOUT:g} s after the kill")
        new, promoted_at = await poll
        on_new: bool | None = None
        if first_lease is not None:
            where: str = new if new is not None else await asyncio.to_thread(topology.current_primary)
            on_new = await _lease_on(where, f"{{{prefix}:{INPROC_PROVIDER}}}:leases", first_lease.lease_id)
            first_lease.release()
    finally:
        if feeder is not None:
            feeder.cancel()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*(t for t in [feeder, *tasks] if t is not None), return_exceptions=True)
        await backend.close()
        await asyncio.to_thread(topology.stop)

    def since(at: float | None) -> float | None:
        return None if at is None or killed_at is None else at - killed_at

    trial = FailoverTrial(old=old, new=new, promoted_s=since(promoted_at), grant_s=since(first_at),
                          noticed_s=since(noticed_at), on_new_primary=on_new, grants_before=grants_before,
                          longest_wait_s=longest, caught=caught, errors=dict(errors))
    log(f"failover {number}: {old} → {new}; sentinels named it after {fmt(trial.promoted_s, 3)} s, first grant "
        f"after {fmt(trial.grant_s, 3)} s (lease on the new primary: {on_new}), failover counted after "
        f"{fmt(trial.noticed_s, 3)} s; {grants_before} grants before, {caught} acquires waiting at the first "
        f"grant, longest wait {longest:.3f} s, errors {dict(errors) or 0}")
    return trial


async def _failovers(count: int, prefix: str) -> list[FailoverTrial]:
    return [await _failover_trial(number, f"{prefix}-{number}") for number in range(1, count + 1)]


def measure_failovers(count: int, prefix: str) -> list[FailoverTrial]:
    log(f"failover: {count} trial(s), a fresh Sentinel topology each, one acquire every "
        f"{FAILOVER_EVERY * 1000:g} ms")
    return list(run_loop(_failovers(count, prefix)))


# --- the run -------------------------------------------------------------------------


@dataclass
class Results:
    kinds: list[str] = field(default_factory=list)
    notes: dict[str, str] = field(default_factory=dict)
    version: str = "?"
    inproc: list[InprocCell] = field(default_factory=list)
    wrk: dict[tuple[str, int], list[WrkRun]] = field(default_factory=dict)
    profiles: dict[str, Profile] = field(default_factory=dict)
    fleet: list[FleetResult] = field(default_factory=list)
    failovers: list[FailoverTrial] = field(default_factory=list)
    keys_deleted: int | None = None
    keys_left: int | None = None


def run_all(args: argparse.Namespace, workdir: Path, info: RedisInfo | None, base: str) -> Results:
    results = Results()
    procs = Processes(workdir)
    places: dict[str, RedisPlace] = {}
    try:
        places = start_places(args.topologies, info, args.redis_url)
        results.kinds = list(places)
        results.notes = {kind: place.note for kind, place in places.items()}
        results.version = server_version(places, info)
        log(f"in-process: {args.inproc_seconds:g} s per cell, key prefix {base}-inproc-*")
        results.inproc = measure_inproc(places, f"{base}-inproc", args.inproc_seconds)
        proxied = measure_proxied(procs, places, f"{base}-serve", args)
        results.wrk, results.profiles = proxied.runs, proxied.profiles
        if info is not None:
            results.fleet.append(fleet_run(procs, "redis", REPLICAS, args, info, f"{base}-fleet"))
            if args.reference:
                results.fleet.append(fleet_run(procs, "memory", 1, args, info, None))
        stop_places(places)  # the failover trials start their own topologies: nothing else runs beside them
        places = {}
        if args.failovers:
            results.failovers = measure_failovers(args.failovers, f"{base}-failover")
    finally:
        procs.stop_all()
        stop_places(places)
        if info is not None:
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
        yield (f"| {LABEL[c.backend]} | {c.concurrency} | {c.rate:.0f} | {pct(c.acquire_us, 50):.1f} | "
               f"{pct(c.acquire_us, 99):.1f} | {pct(c.pair_us, 50):.1f} | {pct(c.pair_us, 99):.1f} | {c.pairs} |")


def _added_p50(wrk: dict[tuple[str, int], list[WrkRun]], conns: int, kind: str = "redis") -> Spread:
    return Spread.of([r.p50_ms - m.p50_ms for m, r in zip(wrk[("memory", conns)], wrk[(kind, conns)])])


def cpu_ratio(wrk: dict[tuple[str, int], list[WrkRun]], conns: int, kind: str) -> Spread:
    """slotproxy CPU per request on ``kind`` ÷ on memory, paired per round."""
    return Spread.of([r.proxy_us_per_req / m.proxy_us_per_req
                      for m, r in zip(wrk[("memory", conns)], wrk[(kind, conns)])])


def wrk_table(wrk: dict[tuple[str, int], list[WrkRun]], kinds: Sequence[str]) -> Iterator[str]:
    yield ("| conns | backend | req/s | p50 ms | p99 ms | slotproxy CPU µs/req | CPU / memory (paired) "
           "| Redis CPU µs/req | added p50 ms (− memory) | errors |")
    yield "|---|---|---|---|---|---|---|---|---|---|"
    for conns in WRK_CONNS:
        for kind in ["memory", *kinds]:
            runs = wrk[(kind, conns)]
            redis_row = kind != "memory"
            added = _added_p50(wrk, conns, kind).fmt(3) if redis_row else "—"
            ratio = cpu_ratio(wrk, conns, kind).fmt(2) if redis_row else "—"
            redis_cpu = Spread.of([r.redis_us_per_req for r in runs]).fmt(0) if redis_row else "—"
            yield (f"| {conns} | {LABEL[kind]} | {Spread.of([r.rps for r in runs]).fmt(0)} | "
                   f"{Spread.of([r.p50_ms for r in runs]).fmt(3)} | {Spread.of([r.p99_ms for r in runs]).fmt(3)} | "
                   f"{Spread.of([r.proxy_us_per_req for r in runs]).fmt(0)} | {ratio} | {redis_cpu} | {added} | "
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


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def failover_median(trials: Sequence[FailoverTrial]) -> float | None:
    """The median of kill → first grant, over the trials that granted again (None if one did not)."""
    if not trials or any(t.grant_s is None for t in trials):
        return None
    return _median([t.grant_s for t in trials])


def _resumed(trial: FailoverTrial) -> bool:
    return trial.grant_s is not None and bool(trial.on_new_primary)


def failover_table(trials: Sequence[FailoverTrial]) -> Iterator[str]:
    yield ("| trial | primary: old → new | kill → sentinels name the new one s | kill → first grant s "
           "| first grant − sentinels' switch s | kill → failover counted s | first lease in new primary "
           "| longest wait s | acquires caught | errors |")
    yield "|---|---|---|---|---|---|---|---|---|---|"
    for number, t in enumerate(trials, 1):
        gap = None if t.grant_s is None or t.promoted_s is None else t.grant_s - t.promoted_s
        errors = ", ".join(f"{name} {n}" for name, n in sorted(t.errors.items())) or "0"
        yield (f"| {number} | {t.old} → {t.new or '?'} | {fmt(t.promoted_s, 3)} | {fmt(t.grant_s, 3)} | "
               f"{fmt(gap, 3)} | {fmt(t.noticed_s, 3)} | {'yes' if t.on_new_primary else 'no'} | "
               f"{t.longest_wait_s:.3f} | {t.caught} | {errors} |")
    gaps = [None if t.grant_s is None or t.promoted_s is None else t.grant_s - t.promoted_s for t in trials]
    yield (f"| **median** | | {fmt(_median([t.promoted_s for t in trials]), 3)} | "
           f"**{fmt(failover_median(trials), 3)}** | {fmt(_median(gaps), 3)} | "
           f"{fmt(_median([t.noticed_s for t in trials]), 3)} | {sum(_resumed(t) for t in trials)}/{len(trials)} | "
           f"{fmt(_median([t.longest_wait_s for t in trials]), 3)} | | |")


def profile_table(profiles: dict[str, Profile]) -> Iterator[str]:
    for kind, profile in profiles.items():
        yield (f"{LABEL[kind]}: {profile.samples} samples at {PYSPY_RATE} Hz, wrk {TARGET_CPU_CONNS} connections "
               f"({profile.rps:.0f} req/s while sampled)")
        yield ""
        yield "| own | total | function (file) |"
        yield "|---|---|---|"
        for name, own, total in profile.top:
            yield f"| {own:.1%} | {total:.1%} | `{name}` |"
        yield ""


def target_rows(results: Results) -> Iterator[tuple[str, str, str, bool]]:
    for kind in results.kinds:
        ratio = cpu_ratio(results.wrk, TARGET_CPU_CONNS, kind)
        yield (f"slotproxy CPU per request at {TARGET_CPU_CONNS} conns, {LABEL[kind]} / memory (paired per round)",
               f"{ratio.fmt(2)}", f"≤ {TARGET_CPU_RATIO:g}", ratio.median <= TARGET_CPU_RATIO)
    if "redis" in results.kinds:
        for conns in WRK_CONNS:
            added = _added_p50(results.wrk, conns)
            yield (f"added p50 per proxied request at {conns} conn(s), redis (one server) − memory",
                   f"{added.fmt(3)} ms", f"< {TARGET_ADDED_P50_MS:g} ms", added.median < TARGET_ADDED_P50_MS)
    fleet = next((f for f in results.fleet if f.label == "redis"), None)
    if fleet is not None:
        ok = fleet.utilisation is not None and fleet.utilisation >= TARGET_UTILISATION
        yield ("fleet utilisation, 3 redis replicas", fmt(fleet.utilisation, 3), f"≥ {TARGET_UTILISATION}", ok)
        yield ("fleet upstream 429s", str(fleet.upstream_429), "0", fleet.upstream_429 == 0)
        yield ("fleet upstream max_concurrency", str(fleet.max_concurrency), f"≤ {CAP}", fleet.max_concurrency <= CAP)
    if results.failovers:
        trials = results.failovers
        resumed = sum(_resumed(t) for t in trials)
        label = ("Sentinel failover: granted again, on the new primary, after the SIGKILL (median kill → first "
                 f"grant {fmt(failover_median(trials), 3)} s)")
        yield label, f"{resumed}/{len(trials)} trials", f"{len(trials)}/{len(trials)}", resumed == len(trials)


def targets_table(results: Results) -> Iterator[str]:
    yield from pass_miss_table(target_rows(results))


def _machine_note(version: str) -> str:
    return machine_note(f"redis-py {redis.__version__}", f"Redis {version}", loop_name(), nginx_version(),
                        wrk_version())


def report(results: Results, args: argparse.Namespace, command: str) -> str:
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    kinds = results.kinds
    lines = [
        "## Redis backend (bench/redis_backend.py)",
        "",
        f"`{command}` — {stamp}.",
        f"Machine: {_machine_note(results.version)}.",
        "",
        "Redis, per row:",
        "",
        *(f"- {LABEL[kind]}: {results.notes[kind]}." for kind in kinds),
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
        (f"### 2. Small POSTs through slotproxy, memory vs the Redis backends (wrk {args.wrk_seconds:g} s per run, "
         f"{args.rounds} interleaved round(s))"),
        "",
        (f"Static nginx upstream; provider `limit: {SERVE_LIMIT}`; one slotproxy per backend, all up for the whole "
         "section, the runs interleaved. Cells: median over rounds (min–max). The CPU ratio and the added p50 are "
         "paired per round with the memory run of the same round and connection count. Redis CPU is over the "
         "run / requests (see above for what is counted per row)."),
        "",
        *wrk_table(results.wrk, kinds),
        "",
    ]
    if results.profiles:
        lines += [
            "### py-spy: the slotproxy process's own samples, top functions",
            "",
            (f"`py-spy record --rate {PYSPY_RATE} --format raw --nonblocking` during one more wrk run at "
             f"{TARGET_CPU_CONNS} connections per backend, after the measured rounds. Own = samples with the function "
             "on top of the stack; total = samples with it anywhere in the stack (as `py-spy top`'s %Own and "
             "%Total). Python frames only: time in C (uvloop's loop, the socket calls, hiredis) is billed to the "
             "Python function that called it (`Runner.run` is uvloop's loop itself)."),
            "",
            *profile_table(results.profiles),
        ]
    if results.fleet:
        lines += [
            (f"### 3. Fleet: {AGENTS} agents, {args.duration:g} s, fake `--cap {CAP} --chunks {CHUNKS} "
             f"--delay-ms {DELAY_MS}`, provider `limit: {CAP}`"),
            "",
            (f"Utilisation = mean of the fake's `active` (`GET /stats` every {SAMPLE_EVERY * 1000:g} ms from "
             f"{args.warmup:g} s on) / {CAP}. Idle per hand-over = stream p50 × (1/utilisation − 1): the time a "
             "slot stays empty between one stream ending and the next starting, if all of the shortfall is "
             "hand-over. Left in Redis = leases and queue members under the fleet's prefix after every replica "
             "stopped (0 / 0 expected). The memory row (one slotproxy) is the reference."),
            "",
            *fleet_table(results.fleet),
            "",
        ]
    if results.failovers:
        lines += [
            (f"### 4. Sentinel failover: SIGKILL of the primary → the first grant on the new one "
             f"({len(results.failovers)} trials)"),
            "",
            ("A fresh topology per trial (a primary, a replica, three sentinels: `down-after-milliseconds 1000`, "
             "`failover-timeout 5000`, quorum 2; no failing back), one in-process `RedisBackend` on it "
             f"(`lease_ttl` {FAILOVER_LEASE_TTL:g} s, `fail_closed`), a new `acquire` every "
             f"{FAILOVER_EVERY * 1000:g} ms, each lease released when granted. After {FAILOVER_WARMUP:g} s the "
             "arrivals pause until nothing is in flight, the primary is SIGKILLed, the arrivals resume. Times from "
             f"the kill: the sentinels naming another primary (polled every {FAILOVER_POLL * 1000:g} ms), the first "
             "grant (its lease then looked up in the new primary's `leases` set), the backend counting the failover "
             "(`failovers`, from its ping twice a second). Longest wait: the longest any acquire took, start to "
             "grant. Caught: acquires still waiting at the first grant (each retries on its own)."),
            "",
            *failover_table(results.failovers),
            "",
        ]
    if results.keys_deleted is not None:
        lines.append(f"Redis keys on the shared server: {results.keys_deleted} deleted under the run's prefix, "
                     f"{results.keys_left} left.")
    return "\n".join(lines) + "\n"


# --- command line --------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--topologies", type=parse_topologies, default=TOPOLOGIES,
        help=f"comma-separated, any of {','.join(TOPOLOGIES)} (default all; the fleet runs with single)")
    add("--failovers", type=int, default=None,
        help="Sentinel failover trials, each on a fresh topology (default 5; --quick 1; 0 skips)")
    add("--duration", type=float, default=None, help="seconds of the fleet run (default 20; --quick 6)")
    add("--warmup", type=float, default=None, help="fleet seconds skipped before sampling (default 2; --quick 1)")
    add("--rounds", type=int, default=None, help="interleaved wrk rounds (default 3; --quick 1)")
    add("--wrk-seconds", type=float, default=None, help="seconds per wrk run (default 5; --quick 2)")
    add("--inproc-seconds", type=float, default=None, help="seconds per in-process cell (default 3; --quick 1)")
    add("--no-reference", dest="reference", action="store_false", help="skip the memory-backend fleet reference")
    add("--py-spy", action="store_true",
        help=f"profile each slotproxy during one more {TARGET_CPU_CONNS}-connection wrk run (needs py-spy)")
    add("--redis-url", type=check_local_url, default=DEFAULT_REDIS_URL, help=f"default {DEFAULT_REDIS_URL}")
    add("--quick", action="store_true", help="smoke run: 1 round, 2 s wrk runs, 1 s cells, 6 s fleet, 1 failover")
    args = parser.parse_args(argv)
    quick = {"duration": 6.0, "warmup": 1.0, "rounds": 1, "wrk_seconds": 2.0, "inproc_seconds": 1.0, "failovers": 1}
    full = {"duration": 20.0, "warmup": 2.0, "rounds": 3, "wrk_seconds": 5.0, "inproc_seconds": 3.0, "failovers": 5}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not 0 < args.duration <= 600 or not 0 <= args.warmup < args.duration:
        parser.error("--duration must be in (0, 600] and --warmup in [0, duration)")
    if not 1 <= args.rounds <= 20 or not 0 < args.wrk_seconds <= 120 or not 0 < args.inproc_seconds <= 120:
        parser.error("--rounds must be in 1..20, --wrk-seconds and --inproc-seconds in (0, 120]")
    if not 0 <= args.failovers <= 50:
        parser.error("--failovers must be in 0..50")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if missing_tools("redis_backend.py", ("nginx", "wrk"), "nginx wrk"):
        return 2
    if (args.failovers or set(args.topologies) - {"single"}) and \
            missing_tools("redis_backend.py", ("redis-server", "redis-cli"), "redis-server"):
        return 2
    if args.py_spy and py_spy_path() is None:
        print("redis_backend.py: --py-spy needs py-spy (pip install py-spy)", file=sys.stderr)
        return 2
    info: RedisInfo | None = None
    if "single" in args.topologies:
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
        print(report(results, args, command))
    finally:
        if info is not None:
            info.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
