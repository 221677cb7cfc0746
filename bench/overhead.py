"""How much does slotproxy add on top of a direct call or of nginx? (a benchmark, not a test)

Three measurements, taken in ONE interleaved run (A B C A B C ..., ``--rounds``
rounds; each figure is the median over rounds with the spread min-max):

1. **Small non-streaming POSTs.** wrk (``-t1``, a Lua script that POSTs a
   ~200-byte JSON body and prints its percentiles) at 1, 16 and 64
   connections, ``--duration`` seconds each, three ways:
   ``direct`` to a static upstream (nginx answering a fixed small JSON with
   ``return 200``), through ``slotproxy`` (provider ``bench``, ``limit: null``,
   so nothing ever queues) and through ``nginx`` as a plain reverse proxy
   (``proxy_pass``, keepalive upstream, ``proxy_buffering off``). Both nginx
   run with ``worker_processes 1`` so each proxy has one core's worth of
   workers, like the single-process slotproxy. Reported: requests/s, p50 and
   p99 latency, and the CPU the proxy and the upstream used during the run
   (utime+stime from ``/proc/<pid>/stat``, before and after).
2. **SSE streams.** 32 concurrent aiohttp clients (in this process), each
   streaming a chat completion of 50 chunks 5 ms apart from
   ``slotproxy fake-upstream --chunks 50 --delay-ms 5``, direct and through
   slotproxy (provider ``sse``), through nginx (``proxy_pass`` to the fake,
   ``proxy_buffering off``) and through a bare aiohttp relay (``--sse-relay``:
   one pooled ClientSession, each upstream chunk written on as it arrives, no
   limiter, no header rules: the floor aiohttp itself sets), three waves per
   round. Reported: time to the
   first SSE event (TTFB), total stream time, the gaps between chunks
   (p50/p99 over all streams of the round), and each proxy's CPU per stream
   (its processes' utime+stime over the round ÷ streams): the per-chunk relay
   cost, against nginx's for the same bytes.
3. **Memory.** A fresh slotproxy: VmRSS at idle after start (base RSS), again
   after a small warm-up, then while 500 streams (30 chunks 1 s apart) are
   held open through it; KiB per held stream = (held - warm idle) / 500.

Every server is started by this script on 127.0.0.1 (nginx with a generated
config, ``-g 'daemon off;'`` and a temporary prefix; slotproxy as
``python -m proxy serve``; the fake upstream as ``python -m proxy fake-upstream``),
each in its own process group, and all of them are stopped on the way out.
Needs ``nginx`` and ``wrk`` on PATH and slotproxy installed (``pip install -e .``).

Run from the repository root::

    python bench/overhead.py                 # 3 rounds, 5 s per wrk run (~4 min on 2 cores)
    python bench/overhead.py --quick         # smoke run: 1 round, 2 s per wrk run
    python bench/overhead.py --rounds 5 --duration 10

The last thing printed is a markdown section for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp
from common import (  # bench/common.py: this directory is sys.path[0] when run as a script
    HOST,
    WRK_LUA,
    WRK_THREADS,
    Processes,
    Spread,
    WrkFigures,
    bare_relay,
    children_of,
    command_line,
    cpu_seconds,
    free_port,
    launch_nginx,
    log,
    machine_note,
    missing_tools,
    nginx_head,
    nginx_version,
    pass_miss_table,
    pct,
    process_tree,
    raise_nofile,
    raise_on_sigterm,
    rss_kib,
    run_loop,
    run_wrk,
    start_fake_upstream,
    start_serve,
    static_nginx_conf,
    wait_http,
    wrk_version,
)

CONNS = (1, 16, 64)
TARGETS = ("direct", "slotproxy", "nginx")
PATH_DIRECT = "/chat/completions"
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
        "user": "bench-overhead",
    },
    separators=(",", ":"),
)
SSE_CLIENTS = 32
SSE_CHUNKS = 50
SSE_DELAY_MS = 5
SSE_WAVES = 3
SSE_PATHS = ("direct", "slotproxy", "nginx", "aiohttp")
PROXIES = ("slotproxy", "nginx", "aiohttp")
TARGET_SSE_CPU_RATIO = 1.5
SSE_BODY = json.dumps({"model": "fake-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
HELD_STREAMS = 500
HOLD_CHUNKS = 30
HOLD_DELAY_MS = 1000
OPEN_AT_ONCE = 64

TARGET_RPS_RATIO = 0.20
TARGET_P50_ADDED_MS = {1: 0.5, 16: 1.0}
TARGET_TTFB_ADDED_MS = 1.0
TARGET_GAP_P99_ADDED_MS = 1.0
TARGET_KIB_PER_STREAM = 32.0
TARGET_BASE_RSS_MIB = 60.0


# --- nginx ---------------------------------------------------------------------------


def proxy_conf(prefix: Path, port: int, upstream_port: int) -> str:
    """nginx as a plain reverse proxy: /bench/x -> static upstream /x, keepalive, no buffering."""
    return nginx_head(prefix) + (
        f"    upstream static {{\n        server {HOST}:{upstream_port};\n        keepalive 128;\n"
        "        keepalive_requests 1000000;\n    }\n"
        f"    server {{\n        listen {HOST}:{port};\n"
        "        location /bench/ {\n            proxy_pass http://static/;\n"
        "            proxy_http_version 1.1;\n            proxy_set_header Connection \"\";\n"
        "            proxy_buffering off;\n        }\n    }\n}\n"
    )


def start_nginx(procs: Processes, name: str, conf: str, probe_path: str) -> tuple[subprocess.Popen[bytes], int]:
    """Start nginx in the foreground with its own prefix; returns the master and its one worker."""
    proc = launch_nginx(procs, name, conf)
    port = int(conf.split(f"listen {HOST}:")[1].split(";")[0])
    wait_http(f"http://{HOST}:{port}{probe_path}", proc, name)
    workers = children_of(proc.pid)
    if len(workers) != 1:
        raise RuntimeError(f"{name}: expected one worker process, found {workers}")
    return proc, workers[0]


# --- slotproxy and the fake upstream -------------------------------------------------


def slotproxy_yaml(port: int, providers: dict[str, str]) -> str:
    lines = [f"server: {{host: {HOST}, port: {port}, shutdown_grace: 1s}}", "state: {path: null}", "providers:"]
    lines += [f"  {name}: {{upstream: '{url}', limit: null}}" for name, url in providers.items()]
    return "\n".join(lines) + "\n"


def start_slotproxy(procs: Processes, name: str, providers: dict[str, str]) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    return start_serve(procs, name, port, slotproxy_yaml(port, providers)), port


def start_fake(procs: Processes, name: str, chunks: int, delay_ms: int) -> int:
    _, port = start_fake_upstream(procs, name, ["--chunks", str(chunks), "--delay-ms", str(delay_ms)])
    return port


# --- 1. wrk --------------------------------------------------------------------------


@dataclass(frozen=True)
class WrkRun:
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    proxy_cpu_s: float | None
    upstream_cpu_s: float


@dataclass
class Target:
    """Where wrk sends its POSTs, and which pids to bill for the proxy's and the upstream's CPU."""

    name: str
    url: str
    proxy_pids: list[int]
    upstream_pids: list[int]


def measure_wrk(target: Target, conns: int, duration: float, lua: Path) -> WrkRun:
    proxy_before = cpu_seconds(target.proxy_pids)
    upstream_before = cpu_seconds(target.upstream_pids)
    figures = WrkFigures.of(run_wrk(target.url, conns, duration, lua))
    proxy_used = cpu_seconds(target.proxy_pids) - proxy_before
    upstream_used = cpu_seconds(target.upstream_pids) - upstream_before
    return WrkRun(
        rps=figures.rps,
        p50_ms=figures.p50_ms,
        p99_ms=figures.p99_ms,
        errors=figures.errors,
        proxy_cpu_s=proxy_used if target.proxy_pids else None,
        upstream_cpu_s=upstream_used,
    )


# --- 2. SSE --------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamTiming:
    ttfb_ms: float
    total_ms: float
    gaps_ms: list[float]


@dataclass(frozen=True)
class SseRound:
    ttfb_p50: float
    total_p50: float
    gap_p50: float
    gap_p99: float
    streams: int
    cpu_ms_per_stream: float | None = None


async def one_stream(session: aiohttp.ClientSession, url: str) -> StreamTiming:
    """POST a streaming chat completion; timestamp each SSE event as its terminator arrives."""
    started = time.perf_counter()
    stamps: list[float] = []
    async with session.post(url, data=SSE_BODY, headers={"Content-Type": "application/json"}) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: status {response.status}")
        while True:
            event = await response.content.readuntil(b"\n\n")
            if not event.endswith(b"\n\n"):
                break
            stamps.append(time.perf_counter())
            if event.startswith(b"data: [DONE]"):
                break
    ended = time.perf_counter()
    chunks = stamps[:SSE_CHUNKS]
    gaps = [(later - earlier) * 1000 for earlier, later in itertools.pairwise(chunks)]
    return StreamTiming((stamps[0] - started) * 1000, (ended - started) * 1000, gaps)


def sse_round_billed(url: str, waves: int, pids: Sequence[int]) -> SseRound:
    """A round of streams, with the CPU the proxy's processes used for it (None for the direct path)."""
    before = cpu_seconds(pids) if pids else 0.0
    result = asyncio.run(sse_round(url, waves))
    if not pids:
        return result
    return replace(result, cpu_ms_per_stream=(cpu_seconds(pids) - before) * 1000 / result.streams)


async def sse_round(url: str, waves: int) -> SseRound:
    timings: list[StreamTiming] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for _ in range(waves):
            wave = [one_stream(session, url) for _ in range(SSE_CLIENTS)]
            timings += await asyncio.wait_for(asyncio.gather(*wave), timeout=60)
    gaps = [gap for timing in timings for gap in timing.gaps_ms]
    return SseRound(
        ttfb_p50=pct([t.ttfb_ms for t in timings], 50),
        total_p50=pct([t.total_ms for t in timings], 50),
        gap_p50=pct(gaps, 50),
        gap_p99=pct(gaps, 99),
        streams=len(timings),
    )


# --- 3. RSS --------------------------------------------------------------------------


@dataclass(frozen=True)
class RssResult:
    base_kib: int
    warm_kib: int
    held_kib: int
    after_kib: int
    held: int

    @property
    def per_stream_kib(self) -> float:
        return (self.held_kib - self.warm_kib) / self.held


async def _hold_one(session: aiohttp.ClientSession, url: str, gate: asyncio.Semaphore,
                    opened: list[int], release: asyncio.Event) -> None:
    async with gate:
        response = await session.post(url, data=SSE_BODY, headers={"Content-Type": "application/json"})
    try:
        await response.content.readuntil(b"\n\n")
        opened.append(1)
        await release.wait()
    finally:
        response.close()


async def hold_streams(url: str, count: int, pid: int, timeout: float = 30.0) -> tuple[int, int]:
    """Open ``count`` streams, wait until each got its first chunk, read RSS; returns (held, opened)."""
    release = asyncio.Event()
    opened: list[int] = []
    gate = asyncio.Semaphore(OPEN_AT_ONCE)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.create_task(_hold_one(session, url, gate, opened, release)) for _ in range(count)]
        deadline = time.monotonic() + timeout
        while len(opened) < count and time.monotonic() < deadline and not all(t.done() for t in tasks):
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        held = rss_kib(pid)
        release.set()
        await asyncio.wait(tasks, timeout=10)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return held, len(opened)


async def warm_up_streams(url: str, count: int = 32) -> None:
    headers = {"Content-Type": "application/json", "x-fake-chunks": "3", "x-fake-delay-ms": "1"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one() -> None:
            async with session.post(url, data=SSE_BODY, headers=headers) as response:
                await response.read()

        await asyncio.wait_for(asyncio.gather(*(one() for _ in range(count))), timeout=30)


def measure_rss(procs: Processes) -> RssResult:
    fake_port = start_fake(procs, "fake-hold", HOLD_CHUNKS, HOLD_DELAY_MS)
    proc, port = start_slotproxy(procs, "slotproxy-rss", {"hold": f"http://{HOST}:{fake_port}/v1"})
    time.sleep(1.0)
    base = rss_kib(proc.pid)
    url = f"http://{HOST}:{port}/hold/chat/completions"
    asyncio.run(warm_up_streams(url))
    time.sleep(0.5)
    warm = rss_kib(proc.pid)
    held, opened = asyncio.run(hold_streams(url, HELD_STREAMS, proc.pid))
    if opened < HELD_STREAMS:
        log(f"only {opened} of {HELD_STREAMS} streams got their first chunk in time")
    time.sleep(1.0)
    return RssResult(base, warm, held, rss_kib(proc.pid), max(opened, 1))


# --- the run -------------------------------------------------------------------------


@dataclass
class Results:
    wrk: dict[tuple[str, int], list[WrkRun]] = field(default_factory=dict)
    sse: dict[str, list[SseRound]] = field(default_factory=dict)
    rss: RssResult | None = None


@dataclass
class Setup:
    targets: dict[str, Target]
    sse_urls: dict[str, str]
    sse_pids: dict[str, list[int]]


def sse_proxy_conf(prefix: Path, port: int, upstream_port: int) -> str:
    """nginx in front of the fake upstream for streams: /sse/x -> /v1/x, keepalive, no buffering."""
    return proxy_conf(prefix, port, upstream_port).replace("location /bench/ {", "location /sse/ {").replace(
        "proxy_pass http://static/;", "proxy_pass http://static/v1/;")


def start_servers(procs: Processes) -> Setup:
    static_port, nginx_port = free_port(), free_port()
    static, static_worker = start_nginx(procs, "nginx-static", static_nginx_conf(procs.workdir / "nginx-static", static_port), "/")
    ngx, ngx_worker = start_nginx(procs, "nginx-proxy", proxy_conf(procs.workdir / "nginx-proxy", nginx_port, static_port),
                                  "/bench/")
    fake_port = start_fake(procs, "fake-sse", SSE_CHUNKS, SSE_DELAY_MS)
    providers = {"bench": f"http://{HOST}:{static_port}", "sse": f"http://{HOST}:{fake_port}/v1"}
    slot, slot_port = start_slotproxy(procs, "slotproxy", providers)
    upstream = [static.pid, static_worker]
    targets = {
        "direct": Target("direct", f"http://{HOST}:{static_port}{PATH_DIRECT}", [], upstream),
        "slotproxy": Target("slotproxy", f"http://{HOST}:{slot_port}{PATH_PROXIED}", process_tree(slot.pid), upstream),
        "nginx": Target("nginx", f"http://{HOST}:{nginx_port}{PATH_PROXIED}", [ngx.pid, ngx_worker], upstream),
    }
    sse_port = free_port()
    ngx_sse, ngx_sse_worker = start_nginx(procs, "nginx-sse", sse_proxy_conf(procs.workdir / "nginx-sse", sse_port,
                                                                              fake_port), "/sse/")
    sse_urls = {
        "direct": f"http://{HOST}:{fake_port}/v1/chat/completions",
        "slotproxy": f"http://{HOST}:{slot_port}/sse/chat/completions",
        "nginx": f"http://{HOST}:{sse_port}/sse/chat/completions",
    }
    relay_port = free_port()
    relay = procs.start("sse-relay", [sys.executable, __file__, "--sse-relay", str(relay_port),
                                      f"http://{HOST}:{fake_port}/v1/"])
    wait_http(f"http://{HOST}:{relay_port}/sse/", relay, "sse-relay", require_200=False)
    sse_urls["aiohttp"] = f"http://{HOST}:{relay_port}/sse/chat/completions"
    sse_pids = {"direct": [], "slotproxy": process_tree(slot.pid), "nginx": [ngx_sse.pid, ngx_sse_worker],
                "aiohttp": [relay.pid]}
    return Setup(targets, sse_urls, sse_pids)


def run_sse_relay(port: int, upstream: str) -> None:
    run_loop(bare_relay(port, upstream, "/sse/", streaming=True))


def warm_up(setup: Setup, lua: Path) -> None:
    for target in setup.targets.values():
        run_wrk(target.url, 16, 1, lua)
    for url in setup.sse_urls.values():
        asyncio.run(sse_round(url, 1))


def run_round(setup: Setup, results: Results, duration: float, lua: Path, number: int) -> None:
    for conns in CONNS:
        for name in TARGETS:
            run = measure_wrk(setup.targets[name], conns, duration, lua)
            results.wrk.setdefault((name, conns), []).append(run)
            log(f"round {number} wrk c={conns:<2} {name:<9} {run.rps:9.0f} req/s  p50 {run.p50_ms:.3f} ms  "
                f"p99 {run.p99_ms:.3f} ms  errors {run.errors}")
    for name, url in setup.sse_urls.items():
        sse = sse_round_billed(url, SSE_WAVES, setup.sse_pids[name])
        results.sse.setdefault(name, []).append(sse)
        log(f"round {number} sse {name:<9} ttfb p50 {sse.ttfb_p50:.2f} ms  total p50 {sse.total_p50:.1f} ms  "
            f"gap p50/p99 {sse.gap_p50:.2f}/{sse.gap_p99:.2f} ms")


def run_all(args: argparse.Namespace, workdir: Path) -> Results:
    lua = workdir / "post.lua"
    lua.write_text(WRK_LUA % BODY)
    results = Results()
    procs = Processes(workdir)
    try:
        setup = start_servers(procs)
        log("servers up; warming up")
        warm_up(setup, lua)
        for number in range(1, args.rounds + 1):
            run_round(setup, results, args.duration, lua, number)
        procs.stop_all()
        log(f"memory: base RSS, then {HELD_STREAMS} held streams")
        results.rss = measure_rss(procs)
    finally:
        procs.stop_all()
    return results


# --- report --------------------------------------------------------------------------


def _paired(results: Results, metric: Callable[[WrkRun], float], a: str, b: str, conns: int,
            combine: Callable[[float, float], float]) -> Spread:
    runs_a, runs_b = results.wrk[(a, conns)], results.wrk[(b, conns)]
    return Spread.of([combine(metric(x), metric(y)) for x, y in zip(runs_a, runs_b)])


def wrk_table(results: Results, duration: float) -> Iterator[str]:
    yield "| conns | path | req/s | p50 ms | p99 ms | proxy CPU % of a core | proxy CPU µs/req | upstream CPU % | errors |"
    yield "|---|---|---|---|---|---|---|---|---|"
    for conns in CONNS:
        for name in TARGETS:
            runs = results.wrk[(name, conns)]
            cpu = "—"
            per_req = "—"
            if runs[0].proxy_cpu_s is not None:
                cpu = Spread.of([r.proxy_cpu_s * 100 / duration for r in runs if r.proxy_cpu_s is not None]).fmt(0)
                per_req = Spread.of([r.proxy_cpu_s * 1e6 / (r.rps * duration) for r in runs
                                     if r.proxy_cpu_s is not None]).fmt(0)
            upstream = Spread.of([r.upstream_cpu_s * 100 / duration for r in runs]).fmt(0)
            yield (f"| {conns} | {name} | {Spread.of([r.rps for r in runs]).fmt(0)} | "
                   f"{Spread.of([r.p50_ms for r in runs]).fmt(3)} | {Spread.of([r.p99_ms for r in runs]).fmt(3)} | "
                   f"{cpu} | {per_req} | {upstream} | {sum(r.errors for r in runs)} |")


def _sse_spread(results: Results, name: str, metric: Callable[[SseRound], float]) -> Spread:
    return Spread.of([metric(r) for r in results.sse[name]])


def sse_table(results: Results) -> Iterator[str]:
    metrics: dict[str, Callable[[SseRound], float]] = {
        "TTFB p50": lambda r: r.ttfb_p50,
        "total p50": lambda r: r.total_p50,
        "chunk gap p50": lambda r: r.gap_p50,
        "chunk gap p99": lambda r: r.gap_p99,
    }
    yield "| ms | direct | slotproxy | nginx | aiohttp relay | slotproxy added (− direct, per round) | nginx added |"
    yield "|---|---|---|---|---|---|---|"
    for label, metric in metrics.items():
        added = {name: Spread.of([metric(p) - metric(d) for d, p in zip(results.sse["direct"], results.sse[name])])
                 for name in ("slotproxy", "nginx")}
        yield (f"| {label} | {_sse_spread(results, 'direct', metric).fmt()} | "
               f"{_sse_spread(results, 'slotproxy', metric).fmt()} | {_sse_spread(results, 'nginx', metric).fmt()} | "
               f"{_sse_spread(results, 'aiohttp', metric).fmt()} | "
               f"{added['slotproxy'].fmt()} | {added['nginx'].fmt()} |")
    cpu = {name: Spread.of([r.cpu_ms_per_stream or 0.0 for r in results.sse[name]]) for name in PROXIES}
    per_chunk = {name: Spread.of([(r.cpu_ms_per_stream or 0.0) * 1000 / SSE_CHUNKS for r in results.sse[name]])
                 for name in PROXIES}
    yield ""
    yield "| proxy CPU | slotproxy | nginx | bare aiohttp relay |"
    yield "|---|---|---|---|"
    yield "| ms per stream | " + " | ".join(cpu[name].fmt(3) for name in PROXIES) + " |"
    yield f"| µs per chunk ({SSE_CHUNKS} a stream) | " + " | ".join(per_chunk[name].fmt(1) for name in PROXIES) + " |"


def rss_table(rss: RssResult) -> Iterator[str]:
    yield "| slotproxy RSS | value |"
    yield "|---|---|"
    yield f"| base (idle after start) | {rss.base_kib / 1024:.1f} MiB |"
    yield f"| idle after a 32-stream warm-up | {rss.warm_kib / 1024:.1f} MiB |"
    yield f"| {rss.held} streams held open | {rss.held_kib / 1024:.1f} MiB |"
    yield f"| after they closed | {rss.after_kib / 1024:.1f} MiB |"
    yield f"| per held stream (held − warm idle) / {rss.held} | {rss.per_stream_kib:.1f} KiB |"


def targets_table(results: Results) -> Iterator[str]:
    rows: list[tuple[str, str, str, bool]] = []
    ratio = _paired(results, lambda r: r.rps, "slotproxy", "nginx", 16, lambda s, n: s / n)
    rows.append(("req/s at 16 conns, slotproxy / nginx", f"{ratio.fmt(2)}", f"≥ {TARGET_RPS_RATIO:.2f}",
                 ratio.median >= TARGET_RPS_RATIO))
    for conns, goal in TARGET_P50_ADDED_MS.items():
        added = _paired(results, lambda r: r.p50_ms, "slotproxy", "direct", conns, lambda s, d: s - d)
        rows.append((f"added p50 at {conns} conn(s) (slotproxy − direct)", f"{added.fmt(3)} ms", f"≤ {goal} ms",
                     added.median <= goal))
    pairs = list(zip(results.sse["direct"], results.sse["slotproxy"]))
    ttfb = Spread.of([p.ttfb_p50 - d.ttfb_p50 for d, p in pairs])
    gap = Spread.of([p.gap_p99 - d.gap_p99 for d, p in pairs])
    rows.append(("streaming TTFB p50 added", f"{ttfb.fmt()} ms", f"≤ {TARGET_TTFB_ADDED_MS} ms",
                 ttfb.median <= TARGET_TTFB_ADDED_MS))
    rows.append(("streaming chunk-gap p99 added", f"{gap.fmt()} ms", f"≤ {TARGET_GAP_P99_ADDED_MS} ms",
                 gap.median <= TARGET_GAP_P99_ADDED_MS))
    cpu = Spread.of([(p.cpu_ms_per_stream or 0.0) / (n.cpu_ms_per_stream or 1e-9)
                     for p, n in zip(results.sse["slotproxy"], results.sse["nginx"])])
    rows.append(("proxy CPU per stream, slotproxy / nginx (paired per round)", f"{cpu.fmt(2)}",
                 f"≤ {TARGET_SSE_CPU_RATIO:g}", cpu.median <= TARGET_SSE_CPU_RATIO))
    floor = Spread.of([(p.cpu_ms_per_stream or 0.0) / (a.cpu_ms_per_stream or 1e-9)
                       for p, a in zip(results.sse["slotproxy"], results.sse["aiohttp"])])
    rows.append(("proxy CPU per stream, slotproxy / bare aiohttp relay (paired)", f"{floor.fmt(2)}", "(floor)",
                 True))
    if results.rss is not None:
        rss = results.rss
        rows.append(("RSS per held stream", f"{rss.per_stream_kib:.1f} KiB", f"≤ {TARGET_KIB_PER_STREAM:g} KiB",
                     rss.per_stream_kib <= TARGET_KIB_PER_STREAM))
        rows.append(("base RSS", f"{rss.base_kib / 1024:.1f} MiB", f"≤ {TARGET_BASE_RSS_MIB:g} MiB",
                     rss.base_kib / 1024 <= TARGET_BASE_RSS_MIB))
    yield from pass_miss_table(rows, "measured: median (min–max)")


def _machine_note() -> str:
    return machine_note(nginx_version(), wrk_version(), with_model=True)


def report(results: Results, args: argparse.Namespace, command: str) -> str:
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "## Overhead (bench/overhead.py)",
        "",
        (f"`{command}` — {stamp}, {args.rounds} interleaved round(s), wrk {args.duration:g} s per run, "
        f"`-t{WRK_THREADS}`."),
        f"Machine: {_machine_note()}.",
        "Cells: median over rounds (min–max). Both nginx run `worker_processes 1`; slotproxy is one process.",
        ("CPU: utime+stime from /proc during each wrk run (proxy = slotproxy, or nginx master+worker; "
        "upstream = the static nginx). SSE TTFB = POST to the first SSE event, the fake upstream's first "
        f"{SSE_DELAY_MS} ms delay included."),
        "",
        "### Targets",
        "",
        *targets_table(results),
        "",
        f"### Small POSTs (~{len(BODY)}-byte JSON body, static nginx upstream)",
        "",
        *wrk_table(results, args.duration),
        "",
        (f"### SSE: {SSE_CLIENTS} concurrent streams × {SSE_CHUNKS} chunks {SSE_DELAY_MS} ms apart, "
        f"{SSE_WAVES} waves per round"),
        "",
        *sse_table(results),
    ]
    if results.rss is not None:
        lines += ["", f"### Memory ({HELD_STREAMS} streams of {HOLD_CHUNKS} chunks {HOLD_DELAY_MS} ms apart)", "",
                  *rss_table(results.rss)]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per wrk run (default 5)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 round, 2 s per wrk run")
    parser.add_argument("--sse-relay", nargs=2, metavar=("PORT", "UPSTREAM"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.duration = 1, 2.0
    if args.rounds < 1 or not 0 < args.duration <= 120:
        parser.error("--rounds must be >= 1 and --duration in (0, 120]")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.sse_relay:
        run_sse_relay(int(args.sse_relay[0]), args.sse_relay[1])
        return 0
    if missing_tools("overhead.py", ("nginx", "wrk"), "nginx wrk"):
        return 2
    signal.signal(signal.SIGTERM, raise_on_sigterm)
    log(f"open-file limit raised to {raise_nofile()}")
    command = command_line("overhead.py", argv)
    with tempfile.TemporaryDirectory(prefix="slotproxy-overhead-") as tmp:
        results = run_all(args, Path(tmp))
    print(report(results, args, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
