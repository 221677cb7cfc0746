"""The demo's fleet of simulated agents: each a loop of streamed chat completions (or, Codex-style, turns
over one WebSocket) with a short "tool run" between them, backing off after 429s as the SDKs do; and the
demo's options.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

__all__ = ["OLD_PROMPT_AGE", "PROVIDER", "REQUEST_TIMEOUT", "DemoOptions", "Fleet", "Outcome", "Tally", "make_fleet"]

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
REQUEST_TIMEOUT = 60.0
BACKOFF_CAP = 2.0  # the longest an agent sleeps after one 429 (seconds)
MAX_WINDOW = 10_000_000
WINDOW_PROMPT_BYTES = 2000  # with a token window, each request carries this much context (~500 tokens)
WINDOW_MAX_OUTPUT = 64


@dataclass(frozen=True, kw_only=True)
class DemoOptions:
    duration: float = 20.0
    agents: int = 16
    cap: int = 4
    use_proxy: bool = True
    chunks: int = CHUNKS
    delay_ms: float = DELAY_MS
    seed: int = 7
    windows: int | None = None
    """The fake's tokens-per-minute window (OpenAI's TPM), configured in the proxy; None: no window."""

    def __post_init__(self) -> None:
        if not 0 < self.duration <= 600:
            raise ValueError(f"duration must be > 0 and <= 600 seconds, got {self.duration!r}")
        if not 1 <= self.agents <= 500:
            raise ValueError(f"agents must be 1-500, got {self.agents!r}")
        if not 1 <= self.cap <= 1000:
            raise ValueError(f"cap must be 1-1000, got {self.cap!r}")
        if self.windows is not None and not 1 <= self.windows <= MAX_WINDOW:
            raise ValueError(f"windows must be 1-{MAX_WINDOW} tokens per minute, got {self.windows!r}")


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

    def _prompt(self, agent: Agent) -> str:
        """A turn's prompt: with a token window, it carries context worth ~500 tokens, as an agent's does."""
        ask = f"{agent.name}: next step of the plan"
        if self.options.windows is None:
            return ask
        context = " ".join(f"line {n} of {agent.workspace}/main.py" for n in range(WINDOW_PROMPT_BYTES // 28))
        return f"{context}\n{ask}"

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
        create: dict[str, Any] = {"type": "response.create", "model": "fake-model", "user": agent.name,
                                  "input": [{"role": "user", "content": self._prompt(agent)}],
                                  "client_metadata": {"x-codex-turn-metadata": turn}}
        if self.options.windows is not None:
            create["max_output_tokens"] = WINDOW_MAX_OUTPUT
        frame = json.dumps(create)
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
        body: dict[str, Any] = {
            "model": "fake-model",
            "stream": True,
            "user": agent.name,
            "messages": [{"role": "user", "content": self._prompt(agent)}],
        }
        if self.options.windows is not None:
            body["max_tokens"] = WINDOW_MAX_OUTPUT
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
