"""Does slotproxy keep a saturated, lagging provider busy without 429s? (a benchmark, not a test)

A fleet of agents (``--agents``, default 50), each a loop of streaming chat
completions read to the last chunk, runs for ``--duration`` seconds (default
20, fleet started together) against ``slotproxy fake-upstream --cap 8
--chunks 20 --delay-ms 50 --lag-ms L`` (one stream lasts ~1 s; the fake keeps a
finished stream counted L ms longer, like a provider's accounting lag), for
every L in ``--lags`` (default 0,200,1000) and every mode in ``--modes``:

``direct``    the fleet straight at the fake with the openai SDK
              (``AsyncOpenAI(max_retries=2)``: its own retries with backoff,
              which honour the fake's ``retry-after-ms``), what users have today;
``plain``     through slotproxy, provider ``limit: 8``, nothing else;
``cooldown``  the same plus ``release_cooldown`` = L + 100 ms (100 ms at L=0);
``usage``     the same plus the usage gate polling the fake's ``/v1/usage``
              (``interval: 1s, busy_interval: 100ms``), no cooldown.

Three more modes, not in the default run (ask for them with ``--modes``):

``pool``        a key pool: the fake also caps each API key (``--key-limit 4``,
                the global ``--cap 8`` staying), slotproxy has no provider limit
                and ``keys: [k1 limit 4, k2 limit 4]`` (``BENCH_KEY_1``/``_2``,
                set in the proxy's environment), so the keys carry the whole cap;
``budgets``     a request window: the fake also admits ``N`` requests per key
                per ``S`` s (``--window-requests N --window-seconds S``, from
                ``--window``, default 30/5 = 6 req/s, below the ~7.6 req/s the
                cap allows: the cap binds for the first ~4 s of each window,
                the window for the last ~1 s; four windows per 20 s run) and
                announces it in the ``x-ratelimit-*`` headers; slotproxy
                ``limit: 8, budgets: true`` (one key, ``BENCH_KEY_1``). The
                fleet runs in waves of about 8 (it starts together), and 30 is
                not a multiple of 8: the last wave of a window asks for more
                than is left of it (``--window 32/5`` makes the waves fit);
``budgets-off`` the same fake and slotproxy without ``budgets``, for contrast.

Proxied agents use aiohttp (``POST /fake/chat/completions``, ``"stream": true``).
Every (lag, mode) run gets a fresh fake upstream and, when proxied, a fresh
slotproxy (``python -m proxy serve --log-level WARNING``, ``state: {path: null}``),
each in its own process group, all stopped on the way out.

Reported per run:

- completed: streams read to ``[DONE]`` before the deadline (in-flight ones are
  cancelled at the deadline);
- upstream 429s: ``rate_limited`` from the fake's ``GET /stats`` (fresh fake per run);
- agent 429s: answers with status 429 the agents saw (proxied), or
  ``openai.RateLimitError`` raised after the SDK's retries (direct); other
  failures are counted as errors;
- utilisation: the fake's concurrency sampled from ``GET /v1/usage`` every 50 ms
  from ``--warmup`` s (default 2) to the deadline, only while the agents
  wanting an answer outnumber the cap, averaged and divided by the cap. The
  fake's count includes its lag period: it is the provider's own view of
  concurrency, the one its 429s are based on. In the ``budgets`` and
  ``budgets-off`` rows, where the window is the binding limit, utilisation is
  instead the used share of what the window allows: requests the fake admitted
  in the run (its ``requests`` less its 429s) ÷ the requests its window allows
  in the run (``N × duration / S``; with ``--duration`` a multiple of ``S``,
  as by default, that is ``N`` per window that fits in the run). The
  concurrency figure of those rows is shown beside it in the details table;
- mean queue wait: the ``X-Slotproxy-Queue-Ms`` header of completed streams
  (n/a for direct);
- final limit: the provider's effective limit in ``/_slotproxy/status`` at the
  end (below 8 when 429s auto-reduced it); in the ``pool`` row, the keys'
  limits (``4+4``).

For the ``pool``, ``budgets`` and ``budgets-off`` rows a details table
follows: per key (the fake's ``GET /stats`` ``keys``), the requests, the
highest concurrency admitted and the 429s; the window's 429s
(``window_rejected``), the requests admitted and the requests allowed; the
cap's utilisation; and the slots the proxy still holds and the waiters it
still has queued 1 s after the fleet stopped (``/_slotproxy/status``; 0 and 0
unless something leaked; the progress log shows them for every row).

Targets: zero agent-visible 429s in the cooldown and usage-gate modes; usage-gate
utilisation >= 0.95 at every lag. Pool: zero agent-visible and upstream 429s,
at most 4 in flight per key upstream, utilisation >= 0.95. Budgets (on): zero
agent-visible and upstream 429s, utilisation (of the window) >= 0.95.

Run from the repository root (slotproxy installed, ``pip install -e .``)::

    python bench/saturation.py                       # 4 modes x 3 lags x 20 s (~5 min on 2 cores)
    python bench/saturation.py --quick               # smoke run: 20 agents, 6 s, lags 0,200
    python bench/saturation.py --modes usage --lags 200 --duration 30
    python bench/saturation.py --modes pool,budgets,budgets-off --lags 0   # ~1.5 min
    python bench/saturation.py --modes budgets,budgets-off --lags 0 --window 32/5 --logs /tmp/sat

``--logs DIR`` keeps every server's log and config in DIR (tracebacks land
in the proxy's log); by default they go to a temporary directory.

The last thing printed is a markdown section for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
from common import (  # bench/common.py: this directory is sys.path[0] when run as a script
    AGENT_MESSAGES,
    HOST,
    Processes,
    agent_body,
    command_line,
    count_refusal,
    fmt,
    free_port,
    get_json,
    log,
    machine_note,
    pass_miss_table,
    raise_on_sigterm,
    read_to_done,
    start_fake_upstream,
    start_serve,
)

CAP = 8
CHUNKS = 20
DELAY_MS = 50
PROVIDER = "fake"
MODEL = "fake-model"
DEFAULT_MODES = ("direct", "plain", "cooldown", "usage")
MODES = (*DEFAULT_MODES, "pool", "budgets", "budgets-off")
WINDOW_MODES = ("budgets", "budgets-off")
DETAIL_MODES = ("pool", *WINDOW_MODES)
SAMPLE_EVERY = 0.05
SETTLE = 1.0
TARGET_UTILISATION = 0.95
KEY_LIMIT = 4
POOL = (("k1", "BENCH_KEY_1", "bench-key-1"), ("k2", "BENCH_KEY_2", "bench-key-2"))
"""The pool's keys: name in the config, the variable holding it, its value (what the fake sees)."""


# --- small helpers -------------------------------------------------------------------


def cooldown_ms(lag_ms: int) -> int:
    return lag_ms + 100


@dataclass(frozen=True)
class Window:
    """The fake's request window in the budgets modes: ``requests`` per key per ``seconds``."""

    requests: int
    seconds: float

    def allowed(self, duration: float) -> float:
        """Requests the window allows in a run of ``duration`` s."""
        return self.requests * duration / self.seconds


# --- processes -----------------------------------------------------------------------


def fake_options(mode: str, lag_ms: int, window: Window) -> list[str]:
    options = ["--cap", str(CAP), "--chunks", str(CHUNKS), "--delay-ms", str(DELAY_MS), "--lag-ms", str(lag_ms)]
    if mode == "pool":
        options += ["--key-limit", str(KEY_LIMIT)]
    if mode in WINDOW_MODES:
        options += ["--window-requests", str(window.requests), "--window-seconds", f"{window.seconds:g}"]
    return options


def start_fake(procs: Processes, name: str, mode: str, lag_ms: int, window: Window) -> int:
    _, port = start_fake_upstream(procs, name, fake_options(mode, lag_ms, window))
    return port


def proxy_yaml(port: int, fake_port: int, mode: str, lag_ms: int) -> str:
    provider = [f"    upstream: http://{HOST}:{fake_port}/v1"]
    if mode == "pool":  # no provider limit: the keys carry it
        provider.append("    keys:")
        provider += [f"      - {{name: {name}, api_key_env: {env}, limit: {KEY_LIMIT}}}" for name, env, _ in POOL]
    else:
        provider.append(f"    limit: {CAP}")
    if mode in WINDOW_MODES:
        provider.append(f"    api_key_env: {POOL[0][1]}")
    if mode == "budgets":
        provider.append("    budgets: true")
    if mode == "cooldown":
        provider.append(f"    release_cooldown: {cooldown_ms(lag_ms)}ms")
    if mode == "usage":
        provider.append(f"    usage: {{url: 'http://{HOST}:{fake_port}/v1/usage', field: concurrent.sessions, "
                        "interval: 1s, busy_interval: 100ms}")
    head = [f"server: {{host: {HOST}, port: {port}, shutdown_grace: 1s}}", "state: {path: null}", "providers:",
            f"  {PROVIDER}:"]
    return "\n".join(head + provider) + "\n"


def start_proxy(procs: Processes, name: str, fake_port: int, mode: str, lag_ms: int) -> int:
    """slotproxy for ``mode``; it inherits this process's environment, where the pool's variables are set."""
    for _, env, value in POOL:
        os.environ[env] = value
    port = free_port()
    start_serve(procs, name, port, proxy_yaml(port, fake_port, mode, lag_ms))
    return port


# --- the fleet -----------------------------------------------------------------------


@dataclass
class Tally:
    """What the agents of one run saw, and how many of them want an answer right now."""

    completed: int = 0
    agent_429: int = 0
    errors: int = 0
    wanting: int = 0
    queue_ms: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    error_kinds: Counter[str] = field(default_factory=Counter)
    """What the other errors were (status, or exception type), for the progress log."""


async def _proxied_request(session: aiohttp.ClientSession, url: str, index: int, tally: Tally) -> None:
    headers = {"X-Conversation-Id": f"agent-{index}"}
    async with session.post(url, json=agent_body(index, MODEL), headers=headers) as response:
        if response.status != 200:
            if response.status != 429:
                tally.error_kinds[f"{response.status} {(await response.read())[:120]!r}"] += 1
            await count_refusal(response, tally)
            return
        if await read_to_done(response):
            tally.completed += 1
            tally.queue_ms.append(float(response.headers.get("X-Slotproxy-Queue-Ms", "nan")))
        else:
            tally.errors += 1
            tally.error_kinds["stream ended without [DONE]"] += 1


async def proxied_agent(session: aiohttp.ClientSession, url: str, index: int, tally: Tally, until: float) -> None:
    while time.monotonic() < until:
        tally.wanting += 1
        try:
            await _proxied_request(session, url, index, tally)
        except (aiohttp.ClientError, TimeoutError) as exc:
            tally.errors += 1
            tally.error_kinds[type(exc).__name__] += 1
        finally:
            tally.wanting -= 1


async def _direct_request(client: openai.AsyncOpenAI, index: int, tally: Tally) -> None:
    stream = await client.chat.completions.create(
        model=MODEL, messages=AGENT_MESSAGES, stream=True, user=f"agent-{index}"  # type: ignore[arg-type]
    )
    async for _chunk in stream:
        pass
    tally.completed += 1


async def direct_agent(client: openai.AsyncOpenAI, index: int, tally: Tally, until: float) -> None:
    while time.monotonic() < until:
        tally.wanting += 1
        try:
            await _direct_request(client, index, tally)
        except openai.RateLimitError:
            tally.agent_429 += 1
        except openai.OpenAIError:
            tally.errors += 1
        finally:
            tally.wanting -= 1


async def sample_usage(session: aiohttp.ClientSession, url: str, tally: Tally, start: float, until: float) -> None:
    """The fake's concurrency every SAMPLE_EVERY s in [start, until), kept while demand exceeds the cap."""
    ticks = int((until - start) / SAMPLE_EVERY)
    for tick in range(ticks):
        await asyncio.sleep(max(0.0, start + tick * SAMPLE_EVERY - time.monotonic()))
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=1)) as response:
                sessions = (await response.json())["concurrent"]["sessions"]
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
            continue
        if tally.wanting > CAP:
            tally.samples.append(int(sessions))


async def _run_until(agents: list[asyncio.Task[None]], sampler: asyncio.Task[None], duration: float) -> None:
    """Let the fleet run for ``duration`` s, then cancel every agent still in a request."""
    try:
        await asyncio.sleep(duration)
        await sampler
    finally:
        for task in [*agents, sampler]:
            task.cancel()
        await asyncio.gather(*agents, sampler, return_exceptions=True)


async def run_fleet(target: str, fake_port: int, args: argparse.Namespace) -> Tally:
    """``target`` is the proxy's chat completions URL, or ``direct``."""
    tally = Tally()
    begin = time.monotonic()
    until = begin + args.duration
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=args.duration + 30)
    connector = aiohttp.TCPConnector(limit=args.agents + 4)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        client = openai.AsyncOpenAI(base_url=f"http://{HOST}:{fake_port}/v1", api_key="bench", max_retries=2,
                                    timeout=args.duration + 30)
        try:
            if target == "direct":
                agents = [asyncio.create_task(direct_agent(client, i, tally, until)) for i in range(args.agents)]
            else:
                agents = [asyncio.create_task(proxied_agent(session, target, i, tally, until))
                          for i in range(args.agents)]
            usage_url = f"http://{HOST}:{fake_port}/v1/usage"
            sampler = asyncio.create_task(sample_usage(session, usage_url, tally, begin + args.warmup, until))
            await _run_until(agents, sampler, args.duration)
        finally:
            await client.close()
    return tally


# --- one run -------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyFigures:
    """One key as the fake counted it (``GET /stats`` ``keys``)."""

    name: str
    requests: int
    max_concurrent: int
    rejected: int


@dataclass(frozen=True)
class Result:
    lag_ms: int
    mode: str
    duration: float
    completed: int
    upstream_429: int
    upstream_requests: int
    agent_429: int
    errors: int
    concurrency: float | None
    """The fake's sampled concurrency / CAP (see the module's text)."""
    samples: int
    queue_ms: float | None
    final_limit: str | None
    held_after: int | None = None
    """Slots the proxy still held, and waiters it still had queued, SETTLE s after the fleet stopped."""
    queued_after: int | None = None
    keys: tuple[KeyFigures, ...] = ()
    window_rejected: int = 0
    allowed: float | None = None
    """Requests the window allows in the run (budgets modes)."""
    error_kinds: tuple[tuple[str, int], ...] = ()

    @property
    def rps(self) -> float:
        return self.completed / self.duration

    @property
    def admitted(self) -> int:
        """Requests the fake admitted (the ones its window counts): all it received less its 429s."""
        return self.upstream_requests - self.upstream_429

    @property
    def utilisation(self) -> float | None:
        """The row's utilisation: of the window in the budgets modes, else of the cap."""
        if self.allowed is not None:
            return self.admitted / self.allowed
        return self.concurrency


@dataclass(frozen=True)
class End:
    """The proxy's provider once the fleet has stopped: its limit, and what it still holds."""

    limit: str | None = None
    in_flight: int | None = None
    queued: int | None = None


def proxy_end(proxy_port: int | None) -> End:
    """The provider's limit at the end (for a pool, its keys' limits: ``4+4``), and its slots held and
    waiters queued SETTLE s after the fleet stopped (both 0 unless something leaked)."""
    if proxy_port is None:
        return End()
    time.sleep(SETTLE)
    status = get_json(f"http://{HOST}:{proxy_port}/_slotproxy/status")
    provider = next((p for p in status["providers"] if p["provider"] == PROVIDER), None)
    if provider is None:
        return End()
    if provider.get("keys"):
        limit = "+".join(str(key["limit"]) for key in provider["keys"])
    else:
        limit = str(provider["limit"])
    return End(limit, int(provider["in_flight"]), int(provider["queued"]))


def key_figures(stats: dict[str, Any]) -> tuple[KeyFigures, ...]:
    names = {value: name for name, _, value in POOL}
    return tuple(
        KeyFigures(name=names.get(value, value or "(none)"), requests=int(account["requests"]),
                   max_concurrent=int(account["max_concurrent"]), rejected=int(account["rejected"]))
        for value, account in sorted(stats.get("keys", {}).items())
    )


def summarise(lag_ms: int, mode: str, tally: Tally, stats: dict[str, Any], end: End,
              args: argparse.Namespace) -> Result:
    waits = [w for w in tally.queue_ms if not math.isnan(w)]
    return Result(
        lag_ms=lag_ms, mode=mode, duration=args.duration, completed=tally.completed,
        upstream_429=int(stats["rate_limited"]), upstream_requests=int(stats["requests"]),
        agent_429=tally.agent_429, errors=tally.errors,
        concurrency=statistics.fmean(tally.samples) / CAP if tally.samples else None,
        samples=len(tally.samples),
        queue_ms=statistics.fmean(waits) if waits and mode != "direct" else None,
        final_limit=end.limit, held_after=end.in_flight, queued_after=end.queued,
        keys=key_figures(stats) if mode in DETAIL_MODES else (),
        window_rejected=int(stats.get("window_rejected", 0)),
        allowed=args.window.allowed(args.duration) if mode in WINDOW_MODES else None,
        error_kinds=tuple(tally.error_kinds.most_common()),
    )


def run_one(procs: Processes, lag_ms: int, mode: str, args: argparse.Namespace) -> Result:
    """A fresh fake (and proxy), the fleet for ``--duration`` s, the fake's stats; then stop both."""
    name = f"{mode}-lag{lag_ms}"
    try:
        fake_port = start_fake(procs, f"fake-{name}", mode, lag_ms, args.window)
        proxy_port = None if mode == "direct" else start_proxy(procs, f"proxy-{name}", fake_port, mode, lag_ms)
        target = "direct" if proxy_port is None else f"http://{HOST}:{proxy_port}/{PROVIDER}/chat/completions"
        tally = asyncio.run(run_fleet(target, fake_port, args))
        stats = get_json(f"http://{HOST}:{fake_port}/stats")
        return summarise(lag_ms, mode, tally, stats, proxy_end(proxy_port), args)
    finally:
        procs.stop_all()


def describe(result: Result) -> str:
    text = (f"lag {result.lag_ms} ms, {result.mode}: {result.completed} completed, "
            f"{result.upstream_429} upstream 429s, {result.agent_429} agent 429s, {result.errors} errors, "
            f"utilisation {fmt(result.utilisation, 3)} ({result.samples} samples), "
            f"queue wait {fmt(result.queue_ms, 0)} ms, final limit {result.final_limit}")
    if result.held_after is not None:
        text += f"; after the run: {result.held_after} slots held, {result.queued_after} queued"
    if result.keys:
        text += "; keys " + ", ".join(f"{k.name}: {k.requests} requests, max {k.max_concurrent}, "
                                      f"{k.rejected} 429s" for k in result.keys)
    if result.allowed is not None:
        text += (f"; window: {result.admitted} admitted of {result.allowed:g} allowed, "
                 f"{result.window_rejected} window 429s, concurrency {fmt(result.concurrency, 3)}")
    if result.error_kinds:
        text += "; errors: " + ", ".join(f"{count} × {kind}" for kind, count in result.error_kinds)
    return text


def run_all(args: argparse.Namespace, workdir: Path) -> list[Result]:
    procs = Processes(workdir)
    results = []
    try:
        for lag_ms in args.lags:
            for mode in args.modes:
                log(f"lag {lag_ms} ms, mode {mode}: {args.agents} agents for {args.duration:g} s")
                results.append(run_one(procs, lag_ms, mode, args))
                log(describe(results[-1]))
    finally:
        procs.stop_all()
    return results


# --- report --------------------------------------------------------------------------


def mode_label(mode: str, lag_ms: int) -> str:
    if mode == "cooldown":
        return f"cooldown {cooldown_ms(lag_ms)} ms"
    return {"direct": "direct (openai SDK)", "plain": "plain", "usage": "usage gate",
            "pool": f"key pool 2 × {KEY_LIMIT}", "budgets": "budgets", "budgets-off": "budgets off"}[mode]


def results_table(results: Sequence[Result]) -> Iterator[str]:
    yield ("| lag ms | mode | completed | req/s | upstream 429s | agent 429s | other errors | utilisation "
           "| mean queue wait ms | final limit |")
    yield "|---|---|---|---|---|---|---|---|---|---|"
    for r in results:
        limit = "—" if r.final_limit is None else r.final_limit
        yield (f"| {r.lag_ms} | {mode_label(r.mode, r.lag_ms)} | {r.completed} | {r.rps:.2f} | {r.upstream_429} "
               f"| {r.agent_429} | {r.errors} | {fmt(r.utilisation, 3)} | {fmt(r.queue_ms, 0)} | {limit} |")


def details_table(results: Sequence[Result]) -> Iterator[str]:
    """Per key and per window, for the pool and budgets rows."""
    yield ("| lag ms | mode | per key upstream: requests / max in flight / 429s | window 429s "
           f"| admitted / allowed by the window | utilisation of the cap | held / queued {SETTLE:g} s after |")
    yield "|---|---|---|---|---|---|---|"
    for r in results:
        if r.mode not in DETAIL_MODES:
            continue
        keys = "; ".join(f"{k.name} {k.requests} / {k.max_concurrent} / {k.rejected}" for k in r.keys) or "—"
        window = "—" if r.allowed is None else f"{r.admitted} / {r.allowed:g}"
        rejected = "—" if r.allowed is None else str(r.window_rejected)
        yield (f"| {r.lag_ms} | {mode_label(r.mode, r.lag_ms)} | {keys} | {rejected} | {window} "
               f"| {fmt(r.concurrency, 3)} | {r.held_after} / {r.queued_after} |")


def _utilisation_row(r: Result, what: str) -> tuple[str, str, str, bool]:
    ok = r.utilisation is not None and r.utilisation >= TARGET_UTILISATION
    return (f"utilisation{what}, {mode_label(r.mode, r.lag_ms)}, lag {r.lag_ms} ms", fmt(r.utilisation, 3),
            f"≥ {TARGET_UTILISATION}", ok)


def target_rows(results: Sequence[Result]) -> Iterator[tuple[str, str, str, bool]]:
    for r in results:
        label = f"{mode_label(r.mode, r.lag_ms)}, lag {r.lag_ms} ms"
        if r.mode in ("cooldown", "usage", "pool", "budgets"):
            yield f"agent 429s, {label}", str(r.agent_429), "0", r.agent_429 == 0
        if r.mode in ("pool", "budgets"):
            yield f"upstream 429s, {label}", str(r.upstream_429), "0", r.upstream_429 == 0
        if r.mode == "pool":
            most = max((k.max_concurrent for k in r.keys), default=0)
            yield (f"max in flight per key upstream, {label}", str(most), f"≤ {KEY_LIMIT}",
                   0 < most <= KEY_LIMIT and len(r.keys) == len(POOL))
        if r.mode in ("usage", "pool"):
            yield _utilisation_row(r, "")
        if r.mode == "budgets":
            yield _utilisation_row(r, " of the window")


def targets_table(results: Sequence[Result]) -> Iterator[str]:
    yield from pass_miss_table(target_rows(results))


def _machine_note() -> str:
    return machine_note(f"openai {openai.__version__}") + "; shared, noisy machine"


def _mode_notes(results: Sequence[Result], args: argparse.Namespace) -> list[str]:
    """What the pool and budgets rows ran against, for the modes that ran."""
    modes = {r.mode for r in results}
    notes = []
    if "pool" in modes:
        notes.append(f"Key pool: the fake also gets `--key-limit {KEY_LIMIT}` (per API key; `--cap {CAP}` stays); "
                     "slotproxy has no provider limit and `keys: [k1 limit 4, k2 limit 4]`, each key sent as "
                     "`Authorization: Bearer <value>`. Utilisation is of the cap, as above.")
    if modes & set(WINDOW_MODES):
        w = args.window
        notes.append(f"Budgets: the fake also gets `--window-requests {w.requests} --window-seconds {w.seconds:g}` "
                     f"({w.requests / w.seconds:g} req/s per key, announced in `x-ratelimit-*` headers); slotproxy "
                     "`limit: 8` with one key, `budgets: true` (budgets) or not (budgets off). Utilisation in these "
                     "rows = requests the fake admitted (its requests less its 429s) / requests the window allows "
                     f"in the run ({w.requests} × {args.duration:g} s / {w.seconds:g} s = "
                     f"{w.allowed(args.duration):g}); the cap's share is in the details table.")
    return notes


def report(results: Sequence[Result], args: argparse.Namespace, command: str) -> str:
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "## Saturation (bench/saturation.py)",
        "",
        (f"`{command}` — {stamp}. {args.agents} agents, {args.duration:g} s per run, "
        f"fake upstream `--cap {CAP} --chunks {CHUNKS} --delay-ms {DELAY_MS} --lag-ms L` (one stream ≈ 1 s), "
        "slotproxy `limit: 8`, a fresh fake and proxy per run."),
        f"Machine: {_machine_note()}.",
        (f"Utilisation = mean of the fake's own concurrency count (`/v1/usage`, every {SAMPLE_EVERY * 1000:g} ms "
        f"from {args.warmup:g} s on, while more than {CAP} agents want an answer) / {CAP}. That count includes "
        "the lag period: it is the provider's view of concurrency, the one its 429s are based on."),
        *_mode_notes(results, args),
        ("Agent 429s: 429 answers the agents saw (direct: `RateLimitError` after the SDK's 2 retries). "
        "Queue wait: mean `X-Slotproxy-Queue-Ms` of completed streams."),
        "",
        *results_table(results),
        "",
    ]
    if any(r.mode in DETAIL_MODES for r in results):
        lines += [*details_table(results), ""]
    lines += list(targets_table(results))
    return "\n".join(lines) + "\n"


# --- command line --------------------------------------------------------------------


def _lags(raw: str) -> list[int]:
    try:
        lags = [int(part) for part in raw.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers (ms), got {raw!r}") from exc
    if not lags or any(lag < 0 or lag > 10_000 for lag in lags):
        raise argparse.ArgumentTypeError(f"lags must be in 0..10000 ms, got {raw!r}")
    return lags


def _modes(raw: str) -> list[str]:
    modes = [part.strip() for part in raw.split(",") if part.strip()]
    unknown = [mode for mode in modes if mode not in MODES]
    if not modes or unknown:
        raise argparse.ArgumentTypeError(f"modes are {','.join(MODES)}; got {raw!r}")
    return modes


def _window(raw: str) -> Window:
    try:
        requests, seconds = raw.split("/")
        window = Window(int(requests), float(seconds.removesuffix("s")))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"must be N/S (requests per seconds), got {raw!r}") from exc
    if window.requests < 1 or not 0 < window.seconds <= 600:
        raise argparse.ArgumentTypeError(f"N must be >= 1 and S in (0, 600], got {raw!r}")
    return window


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--agents", type=int, default=None, help="agents in the fleet (default 50; --quick 20)")
    add("--duration", type=float, default=None, help="seconds per run (default 20; --quick 6)")
    add("--warmup", type=float, default=None, help="seconds skipped before sampling (default 2; --quick 1)")
    add("--lags", type=_lags, default=None, help="fake upstream lags in ms (default 0,200,1000; --quick 0,200)")
    add("--modes", type=_modes, default=list(DEFAULT_MODES),
        help=f"any of {','.join(MODES)} (default {','.join(DEFAULT_MODES)})")
    add("--window", type=_window, default=None,
        help="the budgets modes' fake window, N requests per S seconds (default 30/5; --quick 18/3)")
    add("--quick", action="store_true", help="smoke run: 20 agents, 6 s per run, lags 0,200")
    add("--logs", type=Path, default=None,
        help="keep the servers' logs and configs in this directory (default: a temporary one, removed)")
    args = parser.parse_args(argv)
    quick = {"agents": 20, "duration": 6.0, "warmup": 1.0, "lags": [0, 200], "window": Window(18, 3.0)}
    full = {"agents": 50, "duration": 20.0, "warmup": 2.0, "lags": [0, 200, 1000], "window": Window(30, 5.0)}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not 1 <= args.agents <= 1000 or not 0 < args.duration <= 600 or not 0 <= args.warmup < args.duration:
        parser.error("--agents must be in 1..1000, --duration in (0, 600], --warmup in [0, duration)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, raise_on_sigterm)
    command = command_line("saturation.py", argv)
    if args.logs is not None:
        args.logs.mkdir(parents=True, exist_ok=True)
        results = run_all(args, args.logs)
    else:
        with tempfile.TemporaryDirectory(prefix="slotproxy-saturation-") as tmp:
            results = run_all(args, Path(tmp))
    print(report(results, args, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
