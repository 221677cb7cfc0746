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
  concurrency, the one its 429s are based on;
- mean queue wait: the ``X-Slotproxy-Queue-Ms`` header of completed streams
  (n/a for direct);
- final limit: the provider's effective limit in ``/_slotproxy/status`` at the
  end (below 8 when 429s auto-reduced it).

Targets: zero agent-visible 429s in the cooldown and usage-gate modes; usage-gate
utilisation >= 0.95 at every lag.

Run from the repository root (slotproxy installed, ``pip install -e .``)::

    python bench/saturation.py                       # 4 modes x 3 lags x 20 s (~5 min on 2 cores)
    python bench/saturation.py --quick               # smoke run: 20 agents, 6 s, lags 0,200
    python bench/saturation.py --modes usage --lags 200 --duration 30

The last thing printed is a markdown section for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import signal
import statistics
import sys
import tempfile
import time
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
MODES = ("direct", "plain", "cooldown", "usage")
SAMPLE_EVERY = 0.05
TARGET_UTILISATION = 0.95


# --- small helpers -------------------------------------------------------------------


def cooldown_ms(lag_ms: int) -> int:
    return lag_ms + 100


# --- processes -----------------------------------------------------------------------


def start_fake(procs: Processes, name: str, lag_ms: int) -> int:
    options = ["--cap", str(CAP), "--chunks", str(CHUNKS), "--delay-ms", str(DELAY_MS), "--lag-ms", str(lag_ms)]
    _, port = start_fake_upstream(procs, name, options)
    return port


def proxy_yaml(port: int, fake_port: int, mode: str, lag_ms: int) -> str:
    provider = [f"    upstream: http://{HOST}:{fake_port}/v1", f"    limit: {CAP}"]
    if mode == "cooldown":
        provider.append(f"    release_cooldown: {cooldown_ms(lag_ms)}ms")
    if mode == "usage":
        provider.append(f"    usage: {{url: 'http://{HOST}:{fake_port}/v1/usage', field: concurrent.sessions, "
                        "interval: 1s, busy_interval: 100ms}")
    head = [f"server: {{host: {HOST}, port: {port}, shutdown_grace: 1s}}", "state: {path: null}", "providers:",
            f"  {PROVIDER}:"]
    return "\n".join(head + provider) + "\n"


def start_proxy(procs: Processes, name: str, fake_port: int, mode: str, lag_ms: int) -> int:
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


async def _proxied_request(session: aiohttp.ClientSession, url: str, index: int, tally: Tally) -> None:
    headers = {"X-Conversation-Id": f"agent-{index}"}
    async with session.post(url, json=agent_body(index, MODEL), headers=headers) as response:
        if response.status != 200:
            await count_refusal(response, tally)
            return
        if await read_to_done(response):
            tally.completed += 1
            tally.queue_ms.append(float(response.headers.get("X-Slotproxy-Queue-Ms", "nan")))
        else:
            tally.errors += 1


async def proxied_agent(session: aiohttp.ClientSession, url: str, index: int, tally: Tally, until: float) -> None:
    while time.monotonic() < until:
        tally.wanting += 1
        try:
            await _proxied_request(session, url, index, tally)
        except (aiohttp.ClientError, TimeoutError):
            tally.errors += 1
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
class Result:
    lag_ms: int
    mode: str
    duration: float
    completed: int
    upstream_429: int
    upstream_requests: int
    agent_429: int
    errors: int
    utilisation: float | None
    samples: int
    queue_ms: float | None
    final_limit: int | None

    @property
    def rps(self) -> float:
        return self.completed / self.duration


def final_limit(proxy_port: int | None) -> int | None:
    if proxy_port is None:
        return None
    status = get_json(f"http://{HOST}:{proxy_port}/_slotproxy/status")
    return next((p["limit"] for p in status["providers"] if p["provider"] == PROVIDER), None)


def summarise(lag_ms: int, mode: str, tally: Tally, stats: dict[str, Any], limit: int | None,
              duration: float) -> Result:
    waits = [w for w in tally.queue_ms if w == w]
    return Result(
        lag_ms=lag_ms, mode=mode, duration=duration, completed=tally.completed,
        upstream_429=int(stats["rate_limited"]), upstream_requests=int(stats["requests"]),
        agent_429=tally.agent_429, errors=tally.errors,
        utilisation=statistics.fmean(tally.samples) / CAP if tally.samples else None,
        samples=len(tally.samples),
        queue_ms=statistics.fmean(waits) if waits and mode != "direct" else None,
        final_limit=limit,
    )


def run_one(procs: Processes, lag_ms: int, mode: str, args: argparse.Namespace) -> Result:
    """A fresh fake (and proxy), the fleet for ``--duration`` s, the fake's stats; then stop both."""
    name = f"{mode}-lag{lag_ms}"
    try:
        fake_port = start_fake(procs, f"fake-{name}", lag_ms)
        proxy_port = None if mode == "direct" else start_proxy(procs, f"proxy-{name}", fake_port, mode, lag_ms)
        target = "direct" if proxy_port is None else f"http://{HOST}:{proxy_port}/{PROVIDER}/chat/completions"
        tally = asyncio.run(run_fleet(target, fake_port, args))
        stats = get_json(f"http://{HOST}:{fake_port}/stats")
        return summarise(lag_ms, mode, tally, stats, final_limit(proxy_port), args.duration)
    finally:
        procs.stop_all()


def describe(result: Result) -> str:
    return (f"lag {result.lag_ms} ms, {result.mode}: {result.completed} completed, "
            f"{result.upstream_429} upstream 429s, {result.agent_429} agent 429s, {result.errors} errors, "
            f"utilisation {fmt(result.utilisation, 3)} ({result.samples} samples), "
            f"queue wait {fmt(result.queue_ms, 0)} ms, final limit {result.final_limit}")


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
    return {"direct": "direct (openai SDK)", "plain": "plain", "usage": "usage gate"}[mode]


def results_table(results: Sequence[Result]) -> Iterator[str]:
    yield ("| lag ms | mode | completed | req/s | upstream 429s | agent 429s | other errors | utilisation "
           "| mean queue wait ms | final limit |")
    yield "|---|---|---|---|---|---|---|---|---|---|"
    for r in results:
        limit = "—" if r.final_limit is None else str(r.final_limit)
        yield (f"| {r.lag_ms} | {mode_label(r.mode, r.lag_ms)} | {r.completed} | {r.rps:.2f} | {r.upstream_429} "
               f"| {r.agent_429} | {r.errors} | {fmt(r.utilisation, 3)} | {fmt(r.queue_ms, 0)} | {limit} |")


def target_rows(results: Sequence[Result]) -> Iterator[tuple[str, str, str, bool]]:
    for r in results:
        if r.mode in ("cooldown", "usage"):
            yield (f"agent 429s, {mode_label(r.mode, r.lag_ms)}, lag {r.lag_ms} ms", str(r.agent_429), "0",
                   r.agent_429 == 0)
        if r.mode == "usage":
            ok = r.utilisation is not None and r.utilisation >= TARGET_UTILISATION
            yield (f"utilisation, usage gate, lag {r.lag_ms} ms", fmt(r.utilisation, 3),
                   f"≥ {TARGET_UTILISATION}", ok)


def targets_table(results: Sequence[Result]) -> Iterator[str]:
    yield from pass_miss_table(target_rows(results))


def _machine_note() -> str:
    return machine_note(f"openai {openai.__version__}") + "; shared, noisy machine"


def report(results: Sequence[Result], args: argparse.Namespace, command: str) -> str:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "## Saturation (bench/saturation.py)",
        "",
        f"`{command}` — {stamp}. {args.agents} agents, {args.duration:g} s per run, "
        f"fake upstream `--cap {CAP} --chunks {CHUNKS} --delay-ms {DELAY_MS} --lag-ms L` (one stream ≈ 1 s), "
        "slotproxy `limit: 8`, a fresh fake and proxy per run.",
        f"Machine: {_machine_note()}.",
        f"Utilisation = mean of the fake's own concurrency count (`/v1/usage`, every {SAMPLE_EVERY * 1000:g} ms "
        f"from {args.warmup:g} s on, while more than {CAP} agents want an answer) / {CAP}. That count includes "
        "the lag period: it is the provider's view of concurrency, the one its 429s are based on.",
        "Agent 429s: 429 answers the agents saw (direct: `RateLimitError` after the SDK's 2 retries). "
        "Queue wait: mean `X-Slotproxy-Queue-Ms` of completed streams.",
        "",
        *results_table(results),
        "",
        *targets_table(results),
    ]
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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--agents", type=int, default=None, help="agents in the fleet (default 50; --quick 20)")
    add("--duration", type=float, default=None, help="seconds per run (default 20; --quick 6)")
    add("--warmup", type=float, default=None, help="seconds skipped before sampling (default 2; --quick 1)")
    add("--lags", type=_lags, default=None, help="fake upstream lags in ms (default 0,200,1000; --quick 0,200)")
    add("--modes", type=_modes, default=list(MODES), help=f"default {','.join(MODES)}")
    add("--quick", action="store_true", help="smoke run: 20 agents, 6 s per run, lags 0,200")
    args = parser.parse_args(argv)
    quick = {"agents": 20, "duration": 6.0, "warmup": 1.0, "lags": [0, 200]}
    full = {"agents": 50, "duration": 20.0, "warmup": 2.0, "lags": [0, 200, 1000]}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not 1 <= args.agents <= 1000 or not 0 < args.duration <= 600 or not 0 <= args.warmup < args.duration:
        parser.error("--agents must be in 1..1000, --duration in (0, 600], --warmup in [0, duration)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, raise_on_sigterm)
    command = " ".join(["python", "bench/saturation.py", *(sys.argv[1:] if argv is None else argv)])
    with tempfile.TemporaryDirectory(prefix="slotproxy-saturation-") as tmp:
        results = run_all(args, Path(tmp))
    print(report(results, args, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
