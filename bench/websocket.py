"""The Responses API over WebSocket: what slotproxy's relay costs per frame, per response and per idle socket.

Upstream: one ``slotproxy fake-upstream`` (no cap) speaking the WebSocket mode on
``/v1/responses``. Every ``response.create`` frame carries its knobs in
``"x_fake": {"chunks": K, "delay-ms": D}``; the fake answers with K delta
events and 8 others (``response.created`` … ``response.completed``), one text
frame each.

Relays, each its own process on 127.0.0.1, both on uvloop:

- slotproxy (``python -m proxy serve --log-level WARNING``), memory backend,
  one provider ``openai`` with ``limit: 100000``: every ``response.create``
  takes a slot and holds it to ``response.completed``, but none ever waits;
- the bare aiohttp WebSocket relay (the floor): ``web.WebSocketResponse`` for
  the client, ``ClientSession.ws_connect`` to the same upstream path, and the
  frames pumped both ways as they are (``send_frame`` of the undecoded bytes,
  one direction in the handler's own task); no limiter, no parsing, no headers
  passed on, no timeouts (``ClientTimeout(total=None)``, as slotproxy's upstream
  WebSocket session).

Compression: the client offers none by default, so neither relay compresses
on either hop; ``--deflate`` makes the client offer permessage-deflate, which
slotproxy and the bare relay both mirror upstream (and the fake accepts).

The clients run in this process (uvloop, one aiohttp ``ClientSession`` with
``TCPConnector(limit=0)``). Each round runs the three measures in turn, the
paths of each interleaved:

1. CPU per relayed frame: ``--sockets`` sockets (default 50) opened, then
   ``--responses`` responses (default 20) on each, one after another,
   ``--chunks`` deltas (default 20) ``--delay-ms`` apart (default 5); through
   slotproxy and through the bare relay (their order alternates by round).
   The relay process's utime+stime (``/proc``) from the first frame to the last
   one, divided by the frames it relayed: the events to the client plus the
   ``response.create`` frames to the upstream (handshakes and closes are not
   in the window). Target: slotproxy at most 1.2× the bare relay, paired per
   round, the median of the rounds.
2. First-event latency at a free slot: one socket per path (direct to the
   fake, through slotproxy, through the bare relay), ``--samples`` responses
   (default 400; 1 delta, no delay) each, taken in turn across the three
   sockets; the time from sending ``response.create`` to the first event
   (``response.created``). p50 and p99 per path; added = path − direct,
   paired per round. Target: slotproxy's p50 at most direct's + 1 ms.
3. Memory of idle sockets: a fresh relay process (each round, each relay),
   warmed by 20 sockets with 2 responses each (then closed); its RSS, then
   ``--idle`` sockets (default 1000) opened and left idle, its RSS, then one
   short response on each and idle again, its RSS; then as many sockets more
   opened beside them, its RSS. KiB per socket = the growth over the warm RSS ÷
   the sockets (the fake's ``/stats`` must count them all open upstream); the
   second batch's growth ÷ its sockets is the marginal figure, which does not
   depend on how much free memory the warm heap happened to hold (that moves
   the first figure by about a KiB). Target: slotproxy at most 30 KiB per socket
   opened (the figures after a response, about 1.5 KiB more on both relays, and
   the marginal one are shown beside it).

    python bench/websocket.py                    # 3 rounds (~2 min on 2 cores)
    python bench/websocket.py --quick            # smoke run (~30 s)
    python bench/websocket.py --rounds 5 --sockets 100 --responses 20 --chunks 20 --deflate

The open-file limit is raised to the hard limit (the relay holds 4 × ``--idle`` sockets).
Needs slotproxy installed (``pip install -e .``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import WSMsgType, web
from common import (
    HOST,
    Processes,
    Spread,
    command_line,
    cpu_seconds,
    enough_open_files,
    free_port,
    get_json,
    log,
    machine_note,
    pass_miss_table,
    pct,
    process_tree,
    raise_on_sigterm,
    rss_kib,
    run_loop,
    serve_forever,
    start_fake_upstream,
    start_serve,
    stop_group,
    wait_http,
)

TARGET_CPU_RATIO = 1.2
TARGET_ADDED_P50_MS = 1.0
TARGET_KIB_PER_SOCKET = 30.0
SLOT_LIMIT = 100_000
EVENTS_BESIDE_DELTAS = 8
BETA = {"OpenAI-Beta": "responses_websockets=2026-02-06"}
TERMINAL = frozenset({b"response.completed", b"response.failed", b"response.incomplete", b"error"})
TYPE_AT_START = re.compile(rb'\s*\{\s*"type"\s*:\s*"([a-z_.]{1,64})"')
OPEN_CONCURRENCY = 50
WARM_SOCKETS = 20
WARM_SAMPLES = 20
SETTLE_S = 1.0
RELAYS = ("slotproxy", "bare relay")
LATENCY_PATHS = ("direct", "slotproxy", "bare relay")

ClientSocket = aiohttp.ClientWebSocketResponse[bool]
"""A client-side socket; its text frames are bytes here (``decode_text=False``)."""


# --- the bare aiohttp WebSocket relay (the floor) ---------------------------------------


async def pump(source: web.WebSocketResponse[bool] | ClientSocket,
               sink: web.WebSocketResponse[bool] | ClientSocket) -> None:
    """Send ``source``'s data frames on to ``sink`` as they are; close ``sink`` once ``source`` ends."""
    receive, send = source.receive, sink.send_frame
    while True:
        message = await receive()
        kind = message.type
        if kind is WSMsgType.TEXT or kind is WSMsgType.BINARY:
            await send(message.data, kind)
        else:
            await sink.close()
            return


async def bare_ws_relay(port: int, upstream: str) -> None:
    """Serve ``GET {path}`` WebSocket upgrades on ``port``, each relayed to ``{upstream}{path}``: no limiter, no
    parsing, no headers passed on. permessage-deflate on both hops when the client offers it (as slotproxy)."""
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False,
                                    cookie_jar=aiohttp.DummyCookieJar(), timeout=aiohttp.ClientTimeout(total=None))

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def handler(request: web.Request) -> web.StreamResponse:
        deflate = "permessage-deflate" in request.headers.get("Sec-WebSocket-Extensions", "")
        upstream_ws = await session.ws_connect(upstream + request.path, compress=15 if deflate else 0,
                                               max_msg_size=0, decode_text=False)
        client = web.WebSocketResponse(compress=deflate, max_msg_size=0, decode_text=False)
        try:
            await client.prepare(request)
        except BaseException:
            await upstream_ws.close()
            raise
        to_upstream = asyncio.get_running_loop().create_task(pump(client, upstream_ws))
        try:
            await pump(upstream_ws, client)
        finally:
            to_upstream.cancel()
            await upstream_ws.close()
        return client

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/{rest:.*}", handler)
    await serve_forever(app, port)


# --- the servers -----------------------------------------------------------------------


def slotproxy_yaml(port: int, fake_port: int) -> str:
    return (f"server: {{host: {HOST}, port: {port}, shutdown_grace: 1s}}\nstate: {{path: null}}\n"
            f"providers:\n  openai: {{upstream: 'http://{HOST}:{fake_port}/v1', limit: {SLOT_LIMIT}}}\n")


@dataclass(frozen=True)
class Relay:
    """A relay process and the WebSocket URL of the Responses API through it."""

    proc: subprocess.Popen[bytes]
    url: str


def start_slotproxy(procs: Processes, name: str, fake_port: int) -> Relay:
    port = free_port()
    proc = start_serve(procs, name, port, slotproxy_yaml(port, fake_port))
    return Relay(proc, f"http://{HOST}:{port}/openai/responses")


def start_bare(procs: Processes, name: str, fake_port: int) -> Relay:
    port = free_port()
    proc = procs.start(name, [sys.executable, __file__, "--relay", str(port), f"http://{HOST}:{fake_port}"])
    wait_http(f"http://{HOST}:{port}/healthz", proc, name, require_200=True)
    return Relay(proc, f"http://{HOST}:{port}/v1/responses")


STARTERS: dict[str, Callable[[Processes, str, int], Relay]] = {"slotproxy": start_slotproxy,
                                                               "bare relay": start_bare}


def stop(procs: Processes, relay: Relay) -> None:
    stop_group(relay.proc, procs.term_timeout)
    procs.started.remove(relay.proc)


# --- the client ------------------------------------------------------------------------


def create_frame(chunks: int, delay_ms: float) -> str:
    return json.dumps({"type": "response.create", "model": "gpt-5",
                       "input": [{"role": "user", "content": "Write the next step of the plan."}],
                       "x_fake": {"chunks": chunks, "delay-ms": delay_ms}}, separators=(",", ":"))


def event_type(data: bytes) -> bytes | None:
    match = TYPE_AT_START.match(data)
    return match.group(1) if match is not None else None


@dataclass(frozen=True)
class Reply:
    """One response as the client saw it."""

    events: int
    first_s: float
    completed: bool


async def respond(ws: ClientSocket, frame: str) -> Reply:
    """Send ``frame``, read the events up to the terminal one."""
    sent = time.perf_counter()
    await ws.send_str(frame)
    first = 0.0
    events = 0
    while True:
        message = await ws.receive()
        if message.type is not WSMsgType.TEXT:
            raise RuntimeError(f"the socket ended mid-response ({message.type.name}, {message.extra})")
        if not events:
            first = time.perf_counter() - sent
        events += 1
        kind = event_type(message.data)
        if kind in TERMINAL:
            return Reply(events, first, kind == b"response.completed")


def connect(session: aiohttp.ClientSession, url: str, deflate: bool) -> Awaitable[ClientSocket]:
    return session.ws_connect(url, headers=BETA, compress=15 if deflate else 0, max_msg_size=0, decode_text=False)


async def open_sockets(session: aiohttp.ClientSession, url: str, count: int, deflate: bool) \
        -> list[ClientSocket]:
    gate = asyncio.Semaphore(OPEN_CONCURRENCY)

    async def one() -> ClientSocket:
        async with gate:
            return await connect(session, url, deflate)

    return list(await asyncio.gather(*(one() for _ in range(count))))


async def close_sockets(sockets: Sequence[ClientSocket]) -> None:
    await asyncio.gather(*(ws.close() for ws in sockets), return_exceptions=True)


async def each_respond(sockets: Sequence[ClientSocket], frame: str, times: int) -> list[Reply]:
    """``times`` responses one after another on every socket, the sockets side by side."""

    async def converse(ws: ClientSocket) -> list[Reply]:
        return [await respond(ws, frame) for _ in range(times)]

    gate = asyncio.Semaphore(OPEN_CONCURRENCY) if times == 1 else None

    async def gated(ws: ClientSocket) -> list[Reply]:
        if gate is None:
            return await converse(ws)
        async with gate:
            return await converse(ws)

    batches = await asyncio.gather(*(gated(ws) for ws in sockets))
    return [reply for batch in batches for reply in batch]


# --- 1. CPU per relayed frame ------------------------------------------------------------


@dataclass(frozen=True)
class CpuRun:
    frames: int
    wall_s: float
    cpu_s: float
    failed: int

    @property
    def us_per_frame(self) -> float:
        return self.cpu_s / max(self.frames, 1) * 1e6


async def cpu_run(session: aiohttp.ClientSession, relay: Relay, args: argparse.Namespace) -> CpuRun:
    sockets = await open_sockets(session, relay.url, args.sockets, args.deflate)
    frame = create_frame(args.chunks, args.delay_ms)
    try:
        pids = process_tree(relay.proc.pid)
        before, started = cpu_seconds(pids), time.perf_counter()
        replies = await each_respond(sockets, frame, args.responses)
        cpu, wall = cpu_seconds(pids) - before, time.perf_counter() - started
    finally:
        await close_sockets(sockets)
    frames = sum(reply.events for reply in replies) + len(replies)
    return CpuRun(frames, wall, cpu, sum(not reply.completed for reply in replies))


# --- 2. first-event latency ----------------------------------------------------------------


async def latency_run(session: aiohttp.ClientSession, urls: dict[str, str], args: argparse.Namespace) \
        -> dict[str, list[float]]:
    """Seconds to the first event per path, the paths taken in turn, one socket each, nothing else in flight."""
    frame = create_frame(1, 0)
    sockets = {name: await connect(session, url, args.deflate) for name, url in urls.items()}
    try:
        for ws in sockets.values():
            for _ in range(WARM_SAMPLES):
                await respond(ws, frame)
        samples: dict[str, list[float]] = {name: [] for name in urls}
        for _ in range(args.samples):
            for name, ws in sockets.items():
                reply = await respond(ws, frame)
                if not reply.completed:
                    raise RuntimeError(f"{name}: a latency sample did not complete")
                samples[name].append(reply.first_s)
        return samples
    finally:
        await close_sockets(list(sockets.values()))


# --- 3. idle sockets ------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryRun:
    warm_kib: int
    open_kib: int
    used_kib: int
    more_kib: int
    sockets: int

    def per_socket(self, kib: int) -> float:
        return (kib - self.warm_kib) / self.sockets

    @property
    def marginal(self) -> float:
        """KiB per socket of a second batch opened beside the first: free of what the warm heap had spare."""
        return (self.more_kib - self.used_kib) / self.sockets


async def settle() -> None:
    await asyncio.sleep(SETTLE_S)


async def upstream_sockets(fake_port: int) -> int:
    stats = await asyncio.to_thread(get_json, f"http://{HOST}:{fake_port}/stats")
    return int(stats["websockets"])


async def open_idle(session: aiohttp.ClientSession, relay: Relay, fake_port: int, args: argparse.Namespace,
                    sockets: list[ClientSocket]) -> int:
    """Open ``--idle`` more sockets (into ``sockets``), check that the fake holds them all; the relay's RSS."""
    sockets += await open_sockets(session, relay.url, args.idle, args.deflate)
    await settle()
    seen = await upstream_sockets(fake_port)
    if seen < len(sockets):
        raise RuntimeError(f"the fake holds {seen} sockets, not the {len(sockets)} opened through {relay.url}")
    return rss_kib(relay.proc.pid)


async def memory_run(session: aiohttp.ClientSession, relay: Relay, fake_port: int, args: argparse.Namespace) \
        -> MemoryRun:
    short = create_frame(2, 0)
    warm = await open_sockets(session, relay.url, WARM_SOCKETS, args.deflate)
    await each_respond(warm, short, 2)
    await close_sockets(warm)
    await settle()
    warm_kib = rss_kib(relay.proc.pid)
    sockets: list[ClientSocket] = []
    try:
        open_kib = await open_idle(session, relay, fake_port, args, sockets)
        replies = await each_respond(sockets, short, 1)
        if not all(reply.completed for reply in replies):
            raise RuntimeError("a response on an idle socket did not complete")
        await settle()
        used_kib = rss_kib(relay.proc.pid)
        more_kib = await open_idle(session, relay, fake_port, args, sockets)
    finally:
        await close_sockets(sockets)
    return MemoryRun(warm_kib, open_kib, used_kib, more_kib, args.idle)


# --- the rounds -----------------------------------------------------------------------------


@dataclass
class Results:
    cpu: dict[str, list[CpuRun]] = field(default_factory=lambda: {name: [] for name in RELAYS})
    latency: dict[str, list[list[float]]] = field(default_factory=lambda: {name: [] for name in LATENCY_PATHS})
    memory: dict[str, list[MemoryRun]] = field(default_factory=lambda: {name: [] for name in RELAYS})
    seconds: float = 0.0


def in_turn(names: Sequence[str], number: int) -> list[str]:
    """The paths' order in round ``number`` (from 1): rotated each round, so no path always goes first."""
    shift = (number - 1) % len(names)
    return [*names[shift:], *names[:shift]]


async def one_round(number: int, session: aiohttp.ClientSession, relays: dict[str, Relay], direct: str,
                    procs: Processes, fake_port: int, args: argparse.Namespace, results: Results) -> None:
    for name in in_turn(RELAYS, number):
        run = await cpu_run(session, relays[name], args)
        results.cpu[name].append(run)
        log(f"round {number} cpu     {name:<10} {run.frames} frames in {run.wall_s:5.2f} s, "
            f"{run.us_per_frame:5.1f} µs CPU/frame, {run.cpu_s / run.wall_s * 100:3.0f}% of a core, "
            f"{run.failed} failed")
    urls = {"direct": direct, **{name: relays[name].url for name in RELAYS}}
    samples = await latency_run(session, {name: urls[name] for name in in_turn(LATENCY_PATHS, number)}, args)
    for name in LATENCY_PATHS:
        results.latency[name].append(samples[name])
        log(f"round {number} latency {name:<10} p50 {pct(samples[name], 50) * 1e3:.3f} ms, "
            f"p99 {pct(samples[name], 99) * 1e3:.3f} ms")
    for name in in_turn(RELAYS, number):
        relay = STARTERS[name](procs, f"{name.replace(' ', '-')}-memory-{number}", fake_port)
        try:
            mem = await memory_run(session, relay, fake_port, args)
        finally:
            stop(procs, relay)
        results.memory[name].append(mem)
        log(f"round {number} memory  {name:<10} warm {mem.warm_kib / 1024:.1f} MiB, {mem.sockets} idle "
            f"{mem.per_socket(mem.open_kib):.2f} KiB/socket, after a response {mem.per_socket(mem.used_kib):.2f}, "
            f"{mem.sockets} more {mem.marginal:.2f}")


async def measure(args: argparse.Namespace, workdir: Path) -> Results:
    procs = Processes(workdir)
    results = Results()
    started = time.monotonic()
    try:
        _, fake_port = start_fake_upstream(procs, "fake", [], what="the fake upstream")
        relays = {name: STARTERS[name](procs, name.replace(" ", "-"), fake_port) for name in RELAYS}
        direct = f"http://{HOST}:{fake_port}/v1/responses"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            for relay in relays.values():  # warm-up: imports, first sockets, the fake's first answers
                sockets = await open_sockets(session, relay.url, 10, args.deflate)
                await each_respond(sockets, create_frame(args.chunks, 0), 3)
                await close_sockets(sockets)
            for number in range(1, args.rounds + 1):
                await one_round(number, session, relays, direct, procs, fake_port, args, results)
    finally:
        procs.stop_all()
    results.seconds = time.monotonic() - started
    return results


# --- the report -------------------------------------------------------------------------------


def cpu_ratios(results: Results) -> list[float]:
    pairs = zip(results.cpu["slotproxy"], results.cpu["bare relay"])
    return [slot.us_per_frame / bare.us_per_frame for slot, bare in pairs]


def latency_ms(results: Results, name: str, q: float) -> list[float]:
    return [pct(samples, q) * 1e3 for samples in results.latency[name]]


def added_ms(results: Results, name: str, q: float) -> list[float]:
    return [path - direct for path, direct in zip(latency_ms(results, name, q), latency_ms(results, "direct", q))]


def per_socket(results: Results, name: str, used: bool) -> list[float]:
    return [run.per_socket(run.used_kib if used else run.open_kib) for run in results.memory[name]]


def targets(results: Results, args: argparse.Namespace) -> list[tuple[str, str, str, bool]]:
    ratio = Spread.of(cpu_ratios(results))
    added = Spread.of(added_ms(results, "slotproxy", 50))
    direct = Spread.of(latency_ms(results, "direct", 50))
    memory = Spread.of(per_socket(results, "slotproxy", False))
    used = Spread.of(per_socket(results, "slotproxy", True))
    marginal = Spread.of([run.marginal for run in results.memory["slotproxy"]])
    return [
        ("CPU per relayed frame, slotproxy / bare relay (paired per round)", ratio.fmt(3),
         f"≤ {TARGET_CPU_RATIO}", ratio.median <= TARGET_CPU_RATIO),
        ("first-event p50 at a free slot, slotproxy − direct", f"{added.fmt(3)} ms (direct {direct.fmt(3)} ms)",
         f"≤ {TARGET_ADDED_P50_MS:g} ms", added.median <= TARGET_ADDED_P50_MS),
        (f"slotproxy RSS per idle socket ({args.idle} sockets opened)",
         f"{memory.fmt(2)} KiB (after one response each: {used.fmt(2)} KiB)",
         f"≤ {TARGET_KIB_PER_SOCKET:g} KiB", memory.median <= TARGET_KIB_PER_SOCKET),
        (f"the same, marginal: {args.idle} more opened beside them", f"{marginal.fmt(2)} KiB",
         f"≤ {TARGET_KIB_PER_SOCKET:g} KiB", marginal.median <= TARGET_KIB_PER_SOCKET),
    ]


def cpu_table(results: Results) -> list[str]:
    lines = [("| path | frames relayed per run | failed responses | wall s | relay % of a core | relay CPU s | "
             "µs CPU / frame | / bare relay (paired) |"), "|---|---|---|---|---|---|---|---|"]
    ratios = cpu_ratios(results)
    for name in RELAYS:
        runs = results.cpu[name]
        ratio = Spread.of(ratios).fmt(3) if name == "slotproxy" else "1"
        lines.append(
            f"| {name} | {runs[0].frames} | {sum(run.failed for run in runs)} | "
            f"{Spread.of([run.wall_s for run in runs]).fmt(2)} | "
            f"{Spread.of([run.cpu_s / run.wall_s * 100 for run in runs]).fmt(0)} | "
            f"{Spread.of([run.cpu_s for run in runs]).fmt(2)} | {Spread.of([run.us_per_frame for run in runs]).fmt(1)} "
            f"| {ratio} |")
    lines += ["", "Per round (slotproxy µs / bare µs = ratio): " + ", ".join(
        f"{slot.us_per_frame:.1f} / {bare.us_per_frame:.1f} = {slot.us_per_frame / bare.us_per_frame:.3f}"
        for slot, bare in zip(results.cpu["slotproxy"], results.cpu["bare relay"]))]
    return lines


def latency_table(results: Results) -> list[str]:
    lines = ["| path | p50 ms | p99 ms | added p50 ms | added p99 ms |", "|---|---|---|---|---|"]
    for name in LATENCY_PATHS:
        added = "— | —" if name == "direct" else \
            f"{Spread.of(added_ms(results, name, 50)).fmt(3)} | {Spread.of(added_ms(results, name, 99)).fmt(3)}"
        lines.append(f"| {name} | {Spread.of(latency_ms(results, name, 50)).fmt(3)} | "
                     f"{Spread.of(latency_ms(results, name, 99)).fmt(3)} | {added} |")
    return lines


def memory_table(results: Results, args: argparse.Namespace) -> list[str]:
    lines = [(f"| relay | RSS warm MiB | RSS, {args.idle} idle sockets MiB | KiB / socket, opened | "
              "RSS after one response each MiB | KiB / socket, after one response | "
              f"KiB / socket of {args.idle} more opened (marginal) |"), "|---|---|---|---|---|---|---|"]
    for name in RELAYS:
        runs = results.memory[name]
        lines.append(
            f"| {name} | {Spread.of([run.warm_kib / 1024 for run in runs]).fmt(1)} | "
            f"{Spread.of([run.open_kib / 1024 for run in runs]).fmt(1)} | "
            f"{Spread.of(per_socket(results, name, False)).fmt(2)} | "
            f"{Spread.of([run.used_kib / 1024 for run in runs]).fmt(1)} | "
            f"{Spread.of(per_socket(results, name, True)).fmt(2)} | "
            f"{Spread.of([run.marginal for run in runs]).fmt(2)} |")
    return lines


def report(results: Results, args: argparse.Namespace, command: str) -> str:
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    compression = ("the client offers permessage-deflate, and both relays mirror it upstream" if args.deflate else
                   "no compression: the client offers no permessage-deflate, so neither relay uses it on either hop")
    frames_per_response = args.chunks + EVENTS_BESIDE_DELTAS + 1
    return "\n".join([
        "## WebSocket relay (bench/websocket.py)",
        "",
        f"`{command}` — {stamp}, {args.rounds} interleaved round(s), whole run {results.seconds:.0f} s.",
        f"Machine: {machine_note(with_model=True)}.",
        ("One `slotproxy fake-upstream` (no cap) for every path; slotproxy (uvloop, memory backend, provider "
        f"`limit: {SLOT_LIMIT}`: each response takes and releases a slot, none waits) and the bare aiohttp "
        "WebSocket relay (uvloop; `WebSocketResponse` + `ClientSession.ws_connect`, frames pumped as they are), "
        f"each its own process; the clients in the bench process (uvloop, aiohttp). Compression: {compression}."),
        ("Cells: median over rounds (min–max). CPU: utime+stime of the relay process from /proc while the "
        "responses ran (handshakes and closes outside the window), ÷ frames relayed "
        f"({frames_per_response} a response: {args.chunks} deltas + {EVENTS_BESIDE_DELTAS} other events + the "
        "`response.create`). Latency: `response.create` sent → first event received, sequential on one socket "
        "per path, the three paths in turn; added = path − direct, paired by round. Memory: VmRSS of a fresh relay "
        f"process, growth over its RSS after a warm-up ({WARM_SOCKETS} sockets × 2 responses, closed) ÷ the "
        f"sockets open; marginal: the growth from {args.idle} more sockets opened beside the first (which had "
        f"one response each) ÷ {args.idle}."),
        "",
        "### Targets",
        "",
        *pass_miss_table(targets(results, args)),
        "",
        (f"### 1. CPU per relayed frame: {args.sockets} sockets × {args.responses} responses × {args.chunks} deltas "
        f"{args.delay_ms:g} ms apart"),
        "",
        *cpu_table(results),
        "",
        f"### 2. First-event latency at a free slot: {args.samples} responses per path per round (1 delta, no delay)",
        "",
        *latency_table(results),
        "",
        f"### 3. Memory: {args.idle} idle sockets, a fresh relay process per round",
        "",
        *memory_table(results, args),
    ])


# --- main -------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    add("--sockets", type=int, default=50, help="sockets side by side in the CPU runs (default 50)")
    add("--responses", type=int, default=20, help="responses per socket in the CPU runs (default 20)")
    add("--chunks", type=int, default=20, help="delta events per response in the CPU runs (default 20)")
    add("--delay-ms", type=float, default=5.0, help="ms between deltas in the CPU runs (default 5)")
    add("--samples", type=int, default=400, help="latency samples per path per round (default 400)")
    add("--idle", type=int, default=1000, help="idle sockets in the memory runs (default 1000)")
    add("--deflate", action="store_true", help="the client offers permessage-deflate (default: no compression)")
    add("--quick", action="store_true", help="smoke run: 1 round, 10 sockets × 5 responses, 100 samples, 300 idle")
    add("--relay", nargs=2, metavar=("PORT", "UPSTREAM"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.sockets, args.responses, args.samples, args.idle = 1, 10, 5, 100, 300
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.relay:
        run_loop(bare_ws_relay(int(args.relay[0]), args.relay[1]))
        return 0
    signal.signal(signal.SIGTERM, raise_on_sigterm)
    if not enough_open_files("websocket.py", 4 * args.idle + 200, "a relay"):
        return 2
    command = command_line("websocket.py", argv)
    with tempfile.TemporaryDirectory(prefix="slotproxy-websocket-") as tmp:
        results = run_loop(measure(args, Path(tmp)))
    print(report(results, args, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
