"""``slotproxy demo``: a capped fake provider, the proxy and a fleet of agents, in one process.

Everything runs in this event loop on 127.0.0.1 (no network, no keys):

- a :class:`~proxy.tools.fake_upstream.FakeUpstream` with a hard concurrency cap,
  answering 429 + Retry-After over it, like a real provider;
- slotproxy (``ProxyState`` + ``start_server``) with provider ``openai``
  limited to that cap, in front of the fake;
- a fleet of simulated agents, each a loop of streamed chat completions read
  to ``[DONE]`` with a short "tool run" between them. Agents differ in
  workspace (``X-Workspace-Id``), star (``X-Workspace-Starred: 1``) and prompt
  age (``X-Prompt-Started-At``): some resume prompts that began many minutes
  ago, the rest start fresh prompts as they go. One agent in three works as
  Codex does: one WebSocket for its whole session (``/responses``), a
  ``response.create`` frame per turn carrying the turn's start in its
  ``client_metadata``, read to the response's last event.

While it runs, a live view (redrawn 4x a second on a terminal, a line every few
seconds otherwise) shows the provider's limit, in-flight, queue and 429s. At the
end a summary reports the requests, the 429s the agents saw, the upstream's
highest concurrency against its cap, and queue waits (``X-Slotproxy-Queue-Ms``)
by priority class. ``--no-proxy`` points the same fleet straight at the fake:
agents then get 429s and back off as the SDKs do (honouring ``retry-after-ms``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

import aiohttp

from ...config import parse_config
from ...http.runtime import ProxyState
from ...server.app import start_server
from ..fake_upstream import FakeUpstream, start_fake_upstream

__all__ = ["DemoOptions", "add_arguments", "main", "run_demo"]

HOST = "127.0.0.1"
PROVIDER = "openai"
QUEUE_MS_HEADER = "X-Slotproxy-Queue-Ms"
STARRED_WORKSPACE = "release-team"
WORKSPACES = ("web-app", "data-pipeline", "docs-site", "infra")
# One role per agent index, cycling: about 1 in 8 starred, 1 in 4 resuming an old prompt.
ROLES = ("starred", "new", "old", "new", "new", "old", "new", "new")
WEBSOCKET_EVERY = 3  # one agent in this many talks over a WebSocket, as Codex does
WS_TERMINAL = frozenset({"response.completed", "response.failed", "response.incomplete", "error"})
OLD_PROMPT_AGE = 60.0  # seconds: a prompt older than this counts as "old" in the summary
CHUNKS = 8
DELAY_MS = 40.0
THINK = (0.05, 0.4)  # seconds an agent "runs tools" between two requests
TURNS_PER_PROMPT = (2, 6)
DRAIN_TIMEOUT = 10.0  # after the deadline, how long requests already sent may take to finish
REQUEST_TIMEOUT = 60.0
BACKOFF_CAP = 2.0  # the longest an agent sleeps after one 429 (seconds)
TTY_REFRESH = 0.25
GLYPHS = {"full": "█", "empty": "░", "star": "★", "arrow": "→", "dash": "—", "unlimited": "∞"}
ASCII_GLYPHS = {"full": "#", "empty": ".", "star": "*", "arrow": "->", "dash": "-", "unlimited": "inf"}
LINE_EVERY = 3.0
BAR_WIDTH = 30


@dataclass(frozen=True, kw_only=True)
class DemoOptions:
    duration: float = 20.0
    agents: int = 16
    cap: int = 4
    use_proxy: bool = True
    chunks: int = CHUNKS
    delay_ms: float = DELAY_MS
    seed: int = 7

    def __post_init__(self) -> None:
        if not 0 < self.duration <= 600:
            raise ValueError(f"duration must be > 0 and <= 600 seconds, got {self.duration!r}")
        if not 1 <= self.agents <= 500:
            raise ValueError(f"agents must be 1-500, got {self.agents!r}")
        if not 1 <= self.cap <= 1000:
            raise ValueError(f"cap must be 1-1000, got {self.cap!r}")


# --- the fleet ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Agent:
    index: int
    role: str  # "starred", "old" or "new"
    workspace: str
    websocket: bool = False
    """Codex-style: one WebSocket for the session, a ``response.create`` frame per turn."""

    @property
    def name(self) -> str:
        return f"agent-{self.index:02d}"

    @property
    def starred(self) -> bool:
        return self.role == "starred"


def make_fleet(count: int) -> list[Agent]:
    fleet = []
    for index in range(count):
        role = ROLES[index % len(ROLES)]
        workspace = STARRED_WORKSPACE if role == "starred" else WORKSPACES[index % len(WORKSPACES)]
        fleet.append(Agent(index, role, workspace, websocket=index % WEBSOCKET_EVERY == WEBSOCKET_EVERY - 1))
    return fleet


@dataclass(frozen=True)
class Outcome:
    """One logical request that got its answer to the last chunk."""

    starred: bool
    old: bool
    queue_ms: int  # X-Slotproxy-Queue-Ms (0 without the proxy); over a WebSocket, the wait for the first event
    backoff_ms: int  # time spent sleeping after 429s before the answer
    websocket: bool = False


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)
    agent_429s: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    in_flight: int = 0

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 3:
            self.error_samples.append(what)


def _retry_after(headers: Mapping[str, str]) -> float:
    """The wait a 429 states, as the SDKs read it (milliseconds first), capped for the demo."""
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            value = float(raw) * scale
        except ValueError:
            continue
        if math.isfinite(value) and value >= 0:
            return min(value, BACKOFF_CAP)
    return 0.5


class Fleet:
    """The agents: each a loop of streamed requests until ``stop`` is set."""

    def __init__(self, options: DemoOptions, base_url: str, started_at: float) -> None:
        self.options = options
        self.url = f"{base_url}/chat/completions"
        self.socket_url = f"{base_url}/responses"
        self.started_at = started_at  # epoch seconds
        self.agents = make_fleet(options.agents)
        self.tally = Tally()
        self.stop = asyncio.Event()

    async def _pause(self, seconds: float) -> bool:
        """Sleep, or return early (False) when the fleet is told to stop."""
        try:
            await asyncio.wait_for(self.stop.wait(), timeout=seconds)
        except TimeoutError:
            return True
        return False

    async def run_agent(self, session: aiohttp.ClientSession, agent: Agent) -> None:
        rng = random.Random(self.options.seed * 1000 + agent.index)
        # Start the agents spread over the first half second, as a real fleet would.
        if not await self._pause(rng.uniform(0, 0.5)):
            return
        socket = None
        if agent.websocket:
            try:
                socket = await session.ws_connect(self.socket_url, headers=self._socket_headers(agent))
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.tally.error(f"WebSocket: {type(exc).__name__}: {exc}")
                return
        try:
            await self._turns(session, socket, agent, rng)
        finally:
            if socket is not None:
                await socket.close()

    async def _turns(self, session: aiohttp.ClientSession, socket: aiohttp.ClientWebSocketResponse | None,
                     agent: Agent, rng: random.Random) -> None:
        prompt_started = self.started_at - rng.uniform(5 * 60, 30 * 60) if agent.role == "old" else 0.0
        turns_left = 0
        while not self.stop.is_set():
            if agent.role != "old" and turns_left <= 0:
                prompt_started, turns_left = time.time(), rng.randint(*TURNS_PER_PROMPT)
            turns_left -= 1
            if socket is None:
                await self.request(session, agent, prompt_started, rng)
            elif not await self.respond(socket, agent, prompt_started, rng):
                return
            if not await self._pause(rng.uniform(*THINK)):
                return

    def _headers(self, agent: Agent, prompt_started: float) -> dict[str, str]:
        headers = {
            "Authorization": "Bearer sk-demo-not-a-real-key",
            "X-Workspace-Id": agent.workspace,
            "X-Prompt-Started-At": str(int(prompt_started * 1000)),
            "X-Conversation-Id": agent.name,
        }
        if agent.starred:
            headers["X-Workspace-Starred"] = "1"
        return headers

    def _socket_headers(self, agent: Agent) -> dict[str, str]:
        """Codex's handshake: its session id; the prompt start travels in each frame, not here."""
        headers = {"Authorization": "Bearer sk-demo-not-a-real-key", "X-Workspace-Id": agent.workspace,
                   "session-id": agent.name, "OpenAI-Beta": "responses_websockets=2026-02-06"}
        if agent.starred:
            headers["X-Workspace-Starred"] = "1"
        return headers

    async def respond(self, socket: aiohttp.ClientWebSocketResponse, agent: Agent, prompt_started: float,
                      rng: random.Random) -> bool:
        """One turn over the agent's WebSocket; False when the socket is gone."""
        turn = json.dumps({"turn_id": f"{agent.name}-{int(prompt_started * 1000)}",
                           "turn_started_at_unix_ms": int(prompt_started * 1000)})
        frame = json.dumps({"type": "response.create", "model": "fake-model", "user": agent.name,
                            "input": [{"role": "user", "content": f"{agent.name}: next step of the plan"}],
                            "client_metadata": {"x-codex-turn-metadata": turn}})
        old = time.time() - prompt_started >= OLD_PROMPT_AGE
        backoff = 0.0
        while True:
            self.tally.in_flight += 1
            try:
                sent = time.monotonic()
                await socket.send_str(frame)
                ending, first_ms = await _read_events(socket, sent)
            except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
                self.tally.error(f"WebSocket: {type(exc).__name__}: {exc}")
                return False
            finally:
                self.tally.in_flight -= 1
            if ending is None:
                self.tally.error("WebSocket closed before the response's last event")
                return False
            if ending.get("type") != "error" or ending.get("status") != 429:
                if ending.get("type") != "response.completed":
                    self.tally.error(f"WebSocket: {json.dumps(ending)[:200]}")
                    return True
                self.tally.outcomes.append(Outcome(agent.starred, old, first_ms, round(backoff * 1000), True))
                return True
            self.tally.agent_429s += 1
            wait = _retry_after(ending.get("headers") or {}) * rng.uniform(1.0, 1.25)
            if not await self._pause(wait):
                return True
            backoff += wait

    async def request(
        self, session: aiohttp.ClientSession, agent: Agent, prompt_started: float, rng: random.Random
    ) -> None:
        body = {
            "model": "fake-model",
            "stream": True,
            "user": agent.name,
            "messages": [{"role": "user", "content": f"{agent.name}: next step of the plan"}],
        }
        headers = self._headers(agent, prompt_started)
        old = time.time() - prompt_started >= OLD_PROMPT_AGE
        backoff = 0.0
        while True:
            self.tally.in_flight += 1
            try:
                async with session.post(self.url, json=body, headers=headers) as response:
                    if response.status == 429:
                        self.tally.agent_429s += 1
                        wait = _retry_after(response.headers)
                        await response.read()
                    elif response.status != 200:
                        self.tally.error(f"HTTP {response.status}: {(await response.text())[:200]}")
                        return
                    else:
                        queue_ms = int(response.headers.get(QUEUE_MS_HEADER, "0"))
                        if not await _read_stream(response):
                            self.tally.error("stream ended before [DONE]")
                            return
                        self.tally.outcomes.append(Outcome(agent.starred, old, queue_ms, round(backoff * 1000)))
                        return
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.tally.error(f"{type(exc).__name__}: {exc}")
                return
            finally:
                self.tally.in_flight -= 1
            # A 429: back off the way the SDKs do, with jitter; give up once the demo is over.
            wait *= rng.uniform(1.0, 1.25)
            if not await self._pause(wait):
                return
            backoff += wait


async def _read_events(socket: aiohttp.ClientWebSocketResponse, sent: float) -> tuple[dict[str, Any] | None, int]:
    """Read one response's events to its last; that event (None: the socket closed first) and the ms from
    sending to the first event (the queue wait, as the agent sees it)."""
    first_ms = -1
    while True:
        message = await socket.receive(timeout=REQUEST_TIMEOUT)
        if message.type is not aiohttp.WSMsgType.TEXT:
            return None, first_ms
        if first_ms < 0:
            first_ms = round((time.monotonic() - sent) * 1000)
        event = json.loads(message.data)
        if isinstance(event, dict) and event.get("type") in WS_TERMINAL:
            return event, first_ms


async def _read_stream(response: aiohttp.ClientResponse) -> bool:
    async for line in response.content:
        if line.strip() == b"data: [DONE]":
            return True
    return False


# --- what is shown -----------------------------------------------------------------------


def _percentile(values: list[int], fraction: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return float(ordered[rank - 1])


@dataclass(frozen=True)
class Snapshot:
    """What the live view and the summary read, taken at one moment."""

    elapsed: float
    draining: bool
    done: bool
    providers: list[dict[str, Any]]
    upstream: dict[str, Any]
    completed: int
    agent_429s: int
    errors: int
    in_flight: int


class Style:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, text: str, code: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.enabled else text


class LiveView:
    """A few lines redrawn in place on a terminal; a progress line every few seconds otherwise."""

    def __init__(self, out: TextIO, options: DemoOptions, tty: bool) -> None:
        self.out = out
        self.options = options
        self.tty = tty
        self.style = Style(tty and not os.environ.get("NO_COLOR"))
        encoding = (getattr(out, "encoding", None) or "").lower().replace("-", "")
        self.glyphs = GLYPHS if encoding == "utf8" else ASCII_GLYPHS
        self._drawn = 0
        self._last_line = -math.inf

    def interval(self) -> float:
        return TTY_REFRESH if self.tty else 0.5

    def update(self, snap: Snapshot, *, final: bool = False) -> None:
        if self.tty:
            self._redraw(self.frame(snap))
        elif final or snap.elapsed - self._last_line >= LINE_EVERY:
            self._last_line = snap.elapsed
            print(self.line(snap), file=self.out, flush=True)

    def close(self) -> None:
        if self.tty:
            self.out.write("\x1b[?25h")
            self.out.flush()

    def _redraw(self, lines: list[str]) -> None:
        parts = ["\x1b[?25l"]
        if self._drawn:
            parts.append(f"\x1b[{self._drawn}F")
        parts.extend(f"\x1b[2K{line}\n" for line in lines)
        self.out.write("".join(parts))
        self.out.flush()
        self._drawn = len(lines)

    def _bar(self, snap: Snapshot) -> str:
        fraction = min(1.0, snap.elapsed / self.options.duration)
        filled = round(fraction * BAR_WIDTH)
        g = self.glyphs
        bar = self.style(g["full"] * filled, "32") + self.style(g["empty"] * (BAR_WIDTH - filled), "2")
        tail = " done" if snap.done else f" draining {snap.in_flight} in flight" if snap.draining else ""
        return f"[{bar}] {min(snap.elapsed, self.options.duration):5.1f}s / {self.options.duration:g}s{tail}"

    def frame(self, snap: Snapshot) -> list[str]:
        s = self.style
        g = self.glyphs
        title = describe(self.options, g["arrow"])
        lines = [s("slotproxy demo", "1") + f" {g['dash']} " + title, self._bar(snap), ""]
        if snap.providers:
            header = f"  {'PROVIDER':<10}{'LIMIT':>6}{'IN-FLIGHT':>11}{'QUEUED':>8}{'PAUSED':>8}{'429s':>6}   QUEUE NOW"
            lines.append(s(header, "1"))
            for p in snap.providers:
                limit = g["unlimited"] if p["limit"] is None else str(p["limit"])
                starred, old, new = p["queue_mix"]
                # Pad before styling: escape codes have no width on screen.
                paused = s(f"{'yes':>8}", "33") if p["paused"] else f"{'no':>8}"
                lines.append(
                    f"  {p['provider']:<10}{limit:>6}{p['in_flight']:>11}{p['queued']:>8}"
                    f"{paused}{p['backoffs']:>6}   {g['star']} {starred}  old {old}  new {new}"
                )
                if p.get("notice"):
                    lines.append("  " + s("! " + p["notice"], "33"))
        else:
            lines.append(s("  no proxy: the fleet talks straight to the upstream", "33"))
        up = snap.upstream
        sent = up["rate_limited"]
        lines.append("")
        lines.append(
            f"  upstream  in-flight {up['active']}/{up['cap']}   max seen {up['max_concurrency']}   "
            f"429s sent {s(str(sent), '31') if sent else s('0', '32')}"
        )
        seen = snap.agent_429s
        lines.append(
            f"  agents    {snap.completed} answers streamed   "
            f"429s seen {s(str(seen), '31') if seen else s('0', '32')}   errors {snap.errors}"
        )
        return lines

    def line(self, snap: Snapshot) -> str:
        head = f"[{min(snap.elapsed, self.options.duration):5.1f}s/{self.options.duration:g}s]"
        if snap.done:
            head += " done"
        elif snap.draining:
            head += " draining"
        parts = [
            f"{p['provider']}: limit {p['limit']}, in-flight {p['in_flight']}, queued {p['queued']}, "
            f"paused {'yes' if p['paused'] else 'no'}, 429s {p['backoffs']}"
            for p in snap.providers
        ]
        up = snap.upstream
        parts.append(f"upstream: in-flight {up['active']}/{up['cap']}, 429s sent {up['rate_limited']}")
        parts.append(f"agents: {snap.completed} done, 429s seen {snap.agent_429s}")
        return head + " " + " | ".join(parts)


def describe(options: DemoOptions, arrow: str = "->") -> str:
    path = f"slotproxy ({PROVIDER} limit {options.cap})" if options.use_proxy else "no proxy"
    return f"{options.agents} agents {arrow} {path} {arrow} fake upstream (cap {options.cap})"


def _queue_mix(queue: list[dict[str, Any]], now_ms: int) -> tuple[int, int, int]:
    """How many waiters are starred, unstarred with an old prompt, unstarred with a new one."""
    starred = sum(1 for w in queue if w["starred"])
    old = sum(1 for w in queue if not w["starred"] and now_ms - w["prompt_started_at"] >= OLD_PROMPT_AGE * 1000)
    return starred, old, len(queue) - starred - old


def _wait_rows(outcomes: list[Outcome], metric: Callable[[Outcome], int]) -> Iterator[tuple[str, list[int]]]:
    unstarred = [o for o in outcomes if not o.starred]
    yield "starred", [metric(o) for o in outcomes if o.starred]
    yield "unstarred", [metric(o) for o in unstarred]
    yield "old prompts (unstarred)", [metric(o) for o in unstarred if o.old]
    yield "new prompts (unstarred)", [metric(o) for o in unstarred if not o.old]


def summary(options: DemoOptions, snap: Snapshot, tally: Tally, wall: float) -> str:
    up = snap.upstream
    mode = "with slotproxy" if options.use_proxy else "without a proxy (--no-proxy)"
    socket_responses = sum(1 for o in tally.outcomes if o.websocket)
    socket_agents = sum(1 for a in make_fleet(options.agents) if a.websocket)
    lines = [
        "",
        f"slotproxy demo summary: {mode}, {options.agents} agents, {options.duration:g}s (wall {wall:.1f}s)",
        f"  requests completed:        {snap.completed}",
        f"  over WebSockets:           {socket_responses} (responses, by {socket_agents} Codex-style agents)",
        f"  429s the agents saw:       {snap.agent_429s}",
        f"  429s the upstream sent:    {up['rate_limited']}",
        f"  upstream max concurrency:  {up['max_concurrency']} (cap {up['cap']})",
        f"  errors:                    {snap.errors}",
    ]
    lines += [f"    {sample}" for sample in tally.error_samples]
    for p in snap.providers:
        lines.append(
            f"  {p['provider']} limit at the end: {p['limit']} (configured {p['configured_limit']}), "
            f"upstream backoffs seen by the proxy: {p['backoffs']}"
        )
    if options.use_proxy:
        title = "queue wait (X-Slotproxy-Queue-Ms)"

        def metric(o: Outcome) -> int:
            return o.queue_ms
    else:
        title = "time lost backing off after 429s"

        def metric(o: Outcome) -> int:
            return o.backoff_ms
    lines.append(f"  {title:<36}{'n':>6}{'mean ms':>10}{'p95 ms':>10}")
    for label, values in _wait_rows(tally.outcomes, metric):
        if values:
            mean = sum(values) / len(values)
            lines.append(f"    {label:<34}{len(values):>6}{mean:>10.0f}{_percentile(values, 0.95):>10.0f}")
        else:
            lines.append(f"    {label:<34}{0:>6}{'-':>10}{'-':>10}")
    if options.use_proxy:
        lines.append("  Same fleet straight at the upstream, for comparison: slotproxy demo --no-proxy")
    else:
        lines.append("  The same fleet through slotproxy: slotproxy demo")
    return "\n".join(lines)


# --- running it --------------------------------------------------------------------------


def proxy_yaml(upstream_port: int, cap: int) -> str:
    return (
        "state: {path: null}\n"
        "ledger: {path: null}\n"
        "providers:\n"
        f"  {PROVIDER}:\n"
        f"    upstream: http://{HOST}:{upstream_port}/v1\n"
        f"    limit: {cap}\n"
    )


class _Demo:
    def __init__(self, options: DemoOptions, out: TextIO, tty: bool) -> None:
        self.options = options
        self.view = LiveView(out, options, tty)
        self.fake = FakeUpstream(cap=options.cap, chunks=options.chunks, delay_ms=options.delay_ms)
        self.state: ProxyState | None = None
        self.fleet: Fleet | None = None
        self.t0 = 0.0
        self.draining = False

    def snapshot(self, *, done: bool = False) -> Snapshot:
        now_ms = int(time.time() * 1000)
        providers = []
        if self.state is not None:
            for status in self.state.backend.statistics():
                entry = status.to_dict()
                entry["backoffs"] = status.counters.get("backoffs", 0)
                entry["queue_mix"] = _queue_mix(entry["queue"], now_ms)
                providers.append(entry)
        assert self.fleet is not None
        tally = self.fleet.tally
        return Snapshot(
            elapsed=asyncio.get_running_loop().time() - self.t0,
            draining=self.draining,
            done=done,
            providers=providers,
            upstream=self.fake.stats(),
            completed=len(tally.outcomes),
            agent_429s=tally.agent_429s,
            errors=tally.errors,
            in_flight=tally.in_flight,
        )

    async def _render(self) -> None:
        while True:
            self.view.update(self.snapshot())
            await asyncio.sleep(self.view.interval())

    async def run(self) -> str:
        loop = asyncio.get_running_loop()
        try:
            fake_runner, fake_port = await start_fake_upstream(self.fake, HOST, 0)
        except OSError as exc:
            raise _bind_failed(exc) from None
        proxy_runner = None
        try:
            if self.options.use_proxy:
                self.state = ProxyState(parse_config(proxy_yaml(fake_port, self.options.cap)))
                try:
                    proxy_runner, proxy_port = await start_server(self.state, HOST, 0)
                except OSError as exc:
                    raise _bind_failed(exc) from None
                base_url = f"http://{HOST}:{proxy_port}/{PROVIDER}"
            else:
                base_url = f"http://{HOST}:{fake_port}/v1"
            self.t0 = loop.time()
            self.fleet = Fleet(self.options, base_url, time.time())
            return await self._drive(self.fleet)
        finally:
            self.view.close()
            if proxy_runner is not None:
                await proxy_runner.cleanup()
            await fake_runner.cleanup()

    async def _drive(self, fleet: Fleet) -> str:
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as session:
            tasks = [asyncio.create_task(fleet.run_agent(session, agent)) for agent in fleet.agents]
            renderer = asyncio.create_task(self._render())
            try:
                await asyncio.sleep(self.options.duration)
                # Over: no new requests; the ones already sent (queued or streaming) finish.
                self.draining = True
                fleet.stop.set()
                _, pending = await asyncio.wait(tasks, timeout=DRAIN_TIMEOUT)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                renderer.cancel()
                for task in tasks:
                    task.cancel()
                await asyncio.gather(renderer, *tasks, return_exceptions=True)
            snap = self.snapshot(done=True)
            self.view.update(snap, final=True)
        return summary(self.options, snap, fleet.tally, asyncio.get_running_loop().time() - self.t0)


async def run_demo(options: DemoOptions, out: TextIO | None = None, tty: bool | None = None) -> str:
    """Run the demo; the live view goes to ``out`` (stdout); returns the summary text."""
    stream = sys.stdout if out is None else out
    is_tty = stream.isatty() if tty is None else tty
    return await _Demo(options, stream, is_tty).run()


def _number(kind: type[int | float], low: float, high: float, what: str) -> Callable[[str], Any]:
    def convert(raw: str) -> int | float:
        try:
            value = kind(raw)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be {what}, got {raw!r}")
        return value

    return convert


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``demo`` flags (dests: duration, agents, cap, no_proxy)."""
    defaults = DemoOptions()
    add = parser.add_argument
    add("--duration", type=_number(float, 0.1, 600, "seconds, 0.1-600"), default=defaults.duration,
        help=f"seconds the fleet sends requests (default {defaults.duration:g})")
    add("--agents", type=_number(int, 1, 500, "an integer 1-500"), default=defaults.agents,
        help=f"simulated agents (default {defaults.agents})")
    add("--cap", type=_number(int, 1, 1000, "an integer 1-1000"), default=defaults.cap,
        help=f"the fake upstream's concurrency cap, and the proxy's limit (default {defaults.cap})")
    add("--no-proxy", action="store_true",
        help="send the same fleet straight to the fake upstream, to compare (default: through the proxy)")


def _bind_failed(exc: OSError) -> Exception:
    """The demo listens on HOST, on free ports: a failure to bind is one line (``BindFailed``), not a traceback."""
    from ...server.bind import failure

    return failure(exc, HOST, 0, port_flag=None, host_flag=None) or exc


def main(args: argparse.Namespace) -> int:
    options = DemoOptions(duration=args.duration, agents=args.agents, cap=args.cap, use_proxy=not args.no_proxy)
    text = asyncio.run(run_demo(options))
    print(text, flush=True)
    return 0
