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

Run from the repository root::

    python bench/streams.py                  # levels 250,500,1000, 3 rounds, 100 chunks (~2.5 min on 2 cores)
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
import signal
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from common import (  # bench/common.py: this directory is sys.path[0] when run as a script
    HOST,
    ClientPool,
    Processes,
    Spread,
    command_line,
    cpu_seconds,
    log,
    machine_note,
    pass_miss_table,
    pct,
    raise_nofile,
    raise_on_sigterm,
    serve_client,
    start_fake_upstream,
)
from overhead import start_slotproxy

PATHS = ("direct", "proxied")
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

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def proxy_us_per_event(self) -> float:
        return self.proxy_cpu_s * 1e6 / max(self.events, 1)


@dataclass
class Setup:
    fake_pids: list[int]
    proxy_pid: int
    urls: dict[str, list[str]]  # path -> one URL per fake
    proxy_metrics: str


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
    proxy_before = cpu_seconds([setup.proxy_pid])
    gc_before = GcPauses.scrape(setup.proxy_metrics) if path == "proxied" else None
    tcp_before = tcp_counters()
    clients.send_run(jobs, t0, steady, chunks, delay_ms, timeout)
    window: dict[str, tuple[float, float, float, list[float], tuple[int, int, int]]] = {}
    if steady[1] - steady[0] >= 0.5:
        for name, at in (("start", t0), ("from", steady[0]), ("to", steady[1])):
            time.sleep(max(0.0, at - time.monotonic()))
            window[name] = (time.monotonic(), cpu_seconds([setup.proxy_pid]), cpu_seconds(setup.fake_pids),
                            _cpu(clients.pids), machine_ticks())
    replies = clients.replies(timeout + 30)
    proxy_used = cpu_seconds([setup.proxy_pid]) - proxy_before
    gc = None if gc_before is None else GcPauses.between(gc_before, GcPauses.scrape(setup.proxy_metrics))
    tcp = {name: count - tcp_before[name] for name, count in tcp_counters().items()}
    if window:
        (w0, p0, f0, c0, m0), (w1, p1, f1, c1, m1) = window["from"], window["to"]
        seconds = w1 - w0
        proxy_pct, fakes_pct = (p1 - p0) * 100 / seconds, (f1 - f0) * 100 / seconds
        clients_pct = [(b - a) * 100 / seconds for a, b in zip(c0, c1)]
        ticks = max(m1[2] - m0[2], 1)
        busy_pct, softirq_pct = (m1[0] - m0[0]) * 100 / ticks, (m1[1] - m0[1]) * 100 / ticks
        ws, ps, _, _, ms = window["start"]
        ramp_proxy_pct = (p0 - ps) * 100 / (w0 - ws)
        ramp_busy_pct = (m0[0] - ms[0]) * 100 / max(m0[2] - ms[2], 1)
    else:
        proxy_pct = fakes_pct = busy_pct = softirq_pct = ramp_proxy_pct = ramp_busy_pct = float("nan")
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
        errors=dict(errors), proxy_cpu_s=proxy_used if path == "proxied" else 0.0,
        proxy_steady_pct=proxy_pct if path == "proxied" else float("nan"), fakes_steady_pct=fakes_pct,
        clients_steady_pct=clients_pct, machine_busy_pct=busy_pct, machine_softirq_pct=softirq_pct,
        proxy_ramp_pct=ramp_proxy_pct if path == "proxied" else float("nan"), machine_ramp_busy_pct=ramp_busy_pct,
        client_lag_p99=max(r["lag_p99"] for r in replies), client_lag_max=max(r["lag_max"] for r in replies),
        span_s=max(r["ended"] for r in replies) - t0, tcp=tcp, gc=gc,
    )


# --- the run -------------------------------------------------------------------------


@dataclass
class Results:
    runs: dict[tuple[str, int], list[Run]] = field(default_factory=dict)
    total_s: float = 0.0


def start_servers(procs: Processes, fakes: int, chunks: int, delay_ms: float) -> Setup:
    fake_pids, fake_ports = [], []
    for index in range(fakes):
        proc, port = start_fake_upstream(procs, f"fake-{index}", ["--chunks", str(chunks), "--delay-ms",
                                                                   f"{delay_ms:g}"], what=f"fake-upstream {index}")
        fake_pids.append(proc.pid)
        fake_ports.append(port)
    providers = {f"f{index}": f"http://{HOST}:{port}/v1" for index, port in enumerate(fake_ports)}
    proxy, proxy_port = start_slotproxy(procs, "slotproxy", providers)
    urls = {
        "direct": [f"http://{HOST}:{port}/v1/chat/completions" for port in fake_ports],
        "proxied": [f"http://{HOST}:{proxy_port}/f{index}/chat/completions" for index in range(fakes)],
    }
    return Setup(fake_pids, proxy.pid, urls, f"http://{HOST}:{proxy_port}/metrics")


def _log_run(number: int, level: int, path: str, run: Run) -> None:
    clients = "/".join(f"{c:.0f}" for c in run.clients_steady_pct)
    proxy = (f"  proxy {run.proxy_steady_pct:.0f}% of a core ({run.proxy_ramp_pct:.0f}% during the ramp), "
             f"{run.proxy_us_per_event:.0f} µs/chunk") if path == "proxied" else ""
    if run.gc is not None:
        proxy += (f", GC pauses {run.gc.count} ({run.gc.over_10ms} over 10 ms, longest ≤ "
                  f"{run.gc.longest_under_ms:g} ms, {run.gc.total_ms:.0f} ms in all)")
    log(f"round {number} {level:>5} streams {path:<7} gap p50/p99/max {run.gap_p50:.2f}/{run.gap_p99:.2f}/"
        f"{run.gap_max:.1f} ms (all open: {run.steady_p50:.2f}/{run.steady_p99:.2f})  ttfb p50/p99 "
        f"{run.ttfb_p50:.1f}/{run.ttfb_p99:.1f} ms ({run.ttfb_over_1s} > 1 s)  "
        f"errors {run.errors or 0}{proxy}  fakes {run.fakes_steady_pct:.0f}%  clients {clients}%  machine busy "
        f"{run.machine_busy_pct:.0f}% (softirq {run.machine_softirq_pct:.0f}%; ramp {run.machine_ramp_busy_pct:.0f}%)  "
        f"client lag p99 {run.client_lag_p99:.1f} ms  accept-queue overflows {run.tcp['ListenOverflows']}  "
        f"SYN retransmits {run.tcp['TCPSynRetrans']}")


def run_all(args: argparse.Namespace, workdir: Path) -> Results:
    results = Results()
    procs = Processes(workdir)
    clients: Clients | None = None
    began = time.monotonic()
    try:
        setup = start_servers(procs, args.fakes, args.chunks, args.delay_ms)
        clients = Clients(args.clients)
        log(f"{args.fakes} fake upstream(s), slotproxy and {args.clients} client process(es) up; warming up")
        for path in PATHS:
            measure(setup, clients, path, min(args.levels), max(10, args.chunks // 5), args.delay_ms, args.ramp)
        time.sleep(SETTLE_S)
        for number in range(1, args.rounds + 1):
            for level in args.levels:
                for path in PATHS:
                    run = measure(setup, clients, path, level, args.chunks, args.delay_ms, args.ramp)
                    results.runs.setdefault((path, level), []).append(run)
                    _log_run(number, level, path, run)
                    time.sleep(SETTLE_S)
    finally:
        if clients is not None:
            clients.kill()
        procs.stop_all()
    results.total_s = time.monotonic() - began
    return results


# --- report --------------------------------------------------------------------------


class _NoFigure:
    """Stands in for a Spread when no run had the figure (a run too short for a window with every stream open)."""

    def fmt(self, digits: int = 2) -> str:
        return "n/a"


def _spread(runs: list[Run], metric: Callable[[Run], float]) -> Spread | _NoFigure:
    values = [value for value in map(metric, runs) if not math.isnan(value)]
    return Spread.of(values) if values else _NoFigure()


def _added(results: Results, level: int, metric: Callable[[Run], float]) -> Spread | _NoFigure:
    pairs = zip(results.runs[("direct", level)], results.runs[("proxied", level)])
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
        for path in PATHS:
            runs = results.runs[(path, level)]
            if path == "proxied":
                added = (f"{_added(results, level, lambda r: r.gap_p50).fmt()} | "
                         f"**{_added(results, level, lambda r: r.gap_p99).fmt()}**")
                steady = _added(results, level, lambda r: r.steady_p99).fmt()
                pauses = " / ".join(_gc_cells(runs))
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
        for path in PATHS:
            runs = results.runs[(path, level)]
            added = "—"
            if path == "proxied":
                added = (f"{_added(results, level, lambda r: r.ttfb_p50).fmt(1)} / "
                         f"{_added(results, level, lambda r: r.ttfb_p99).fmt(1)}")
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
        for path in PATHS:
            runs = results.runs[(path, level)]
            rate = level * 1000 / delay_ms
            proxy_us = proxy_pct = "—"
            if path == "proxied":
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
    errors = sum(run.error_count for path in PATHS for run in results.runs[(path, level)])
    label = f"added chunk-gap p99 at {level} streams (proxied − direct)"
    if level != TARGET_LEVEL:
        label += f" (the target is for {TARGET_LEVEL})"
    return [(label, f"{added.fmt()} ms, {errors} errors", f"≤ {TARGET_ADDED_P99_MS:g} ms, no errors",
             added.median <= TARGET_ADDED_P99_MS and errors == 0)]


def report(results: Results, args: argparse.Namespace, command: str) -> str:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
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
    return "\n".join(lines) + "\n"


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
    parser.add_argument("--quick", action="store_true", help="smoke run: levels 100,250, 1 round, 40 chunks, ramp 0.5 s")
    args = parser.parse_args(argv)
    if args.quick:
        args.levels, args.rounds, args.chunks, args.ramp = [100, 250], 1, 40, 0.5
    if args.rounds < 1 or args.chunks < 2 or args.delay_ms <= 0 or args.ramp < 0 \
            or not 1 <= args.fakes <= 16 or not 1 <= args.clients <= 16:
        parser.error("--rounds >= 1, --chunks >= 2, --delay-ms > 0, --ramp >= 0, --fakes and --clients in [1, 16]")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, raise_on_sigterm)
    hard = raise_nofile()
    need = 2 * max(args.levels) + 200
    log(f"open-file limit raised to {hard} (the proxy needs about {need})")
    if hard < need:
        print(f"streams.py: the open-file hard limit {hard} is below the ~{need} sockets the proxy needs",
              file=sys.stderr)
        return 2
    command = command_line("streams.py", argv)
    with tempfile.TemporaryDirectory(prefix="slotproxy-streams-") as tmp:
        results = run_all(args, Path(tmp))
    print(report(results, args, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
