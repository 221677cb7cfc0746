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

``--windows [N]`` adds a per-minute token window: the fake enforces OpenAI's
tokens-per-minute bucket of N tokens (``fake-upstream --tpm N``), the proxy has
it configured (``windows: {tokens_per_minute: N, headroom: 0.02}``: the headroom the
configuration guide advises, for the moment between the proxy's grant and the
provider's count) and holds requests until the window has room, and each request carries ~500 tokens of context. The window
starts full (a minute's worth), so the fleet runs at full speed until it has
spent it, then is held to the refill. When the demo ends, requests still held
are abandoned (they would wait for the window), not drained.

The agents are in ``fleet``, the live view and the summary in ``view``; this module runs them.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import aiohttp

from ...config import parse_config
from ...http.runtime import ProxyState
from ...server.app import start_server
from ..fake_upstream import FakeUpstream, start_fake_upstream
from .fleet import MAX_WINDOW, PROVIDER, REQUEST_TIMEOUT, DemoOptions, Fleet
from .view import LiveView, Snapshot, queue_mix, summary

__all__ = ["DemoOptions", "add_arguments", "main", "run_demo"]

HOST = "127.0.0.1"
DRAIN_TIMEOUT = 10.0  # after the deadline, how long requests already sent may take to finish


DEFAULT_WINDOW = 30_000  # tokens per minute: about a request a second once the first minute's worth is spent
WINDOW_HEADROOM = 0.02  # docs/configuration.md: "to absorb the moment between the proxy's grant and the provider's count"
WINDOW_DRAIN = 1.0  # with a window, how long the answers streaming at the deadline get; held ones are abandoned


def proxy_yaml(upstream_port: int, cap: int, windows: int | None = None) -> str:
    text = (
        "state: {path: null}\n"
        "ledger: {path: null}\n"
        "providers:\n"
        f"  {PROVIDER}:\n"
        f"    upstream: http://{HOST}:{upstream_port}/v1\n"
        f"    limit: {cap}\n"
    )
    if windows is not None:
        text += f"    windows: {{tokens_per_minute: {windows}, headroom: {WINDOW_HEADROOM}}}\n"
    return text


class _Demo:
    def __init__(self, options: DemoOptions, out: TextIO, tty: bool) -> None:
        self.options = options
        self.view = LiveView(out, options, tty)
        self.fake = FakeUpstream(cap=options.cap, chunks=options.chunks, delay_ms=options.delay_ms,
                                 tpm=options.windows)
        self.state: ProxyState | None = None
        self.fleet: Fleet | None = None
        self.t0 = 0.0
        self.draining = False
        self.held_at_end = 0

    def _queued(self) -> int:
        """The requests the proxy holds now (queued for a slot or a window)."""
        if self.state is None:
            return 0
        return sum(status.to_dict()["queued"] for status in self.state.backend.statistics())

    def snapshot(self, *, done: bool = False) -> Snapshot:
        now_ms = int(time.time() * 1000)
        providers = []
        if self.state is not None:
            for status in self.state.backend.statistics():
                entry = status.to_dict()
                entry["backoffs"] = status.counters.get("backoffs", 0)
                entry["queue_mix"] = queue_mix(entry["queue"], now_ms)
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
            held_at_end=self.held_at_end,
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
                config = parse_config(proxy_yaml(fake_port, self.options.cap, self.options.windows))
                self.state = ProxyState(config)
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
                # Over: no new requests; the ones already sent (queued or streaming) finish. With a window,
                # the ones it holds would wait for its refill: they are abandoned once the streams are done.
                self.draining = True
                fleet.stop.set()
                self.held_at_end = self._queued()
                drain = DRAIN_TIMEOUT if self.options.windows is None else WINDOW_DRAIN
                _, pending = await asyncio.wait(tasks, timeout=drain)
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
    """Add the ``demo`` flags (dests: duration, agents, cap, no_proxy, windows)."""
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
    add("--windows", nargs="?", const=DEFAULT_WINDOW, default=None, metavar="TPM",
        type=_number(int, 1, MAX_WINDOW, f"tokens per minute, 1-{MAX_WINDOW}"),
        help=f"the fake also enforces a tokens-per-minute window (default {DEFAULT_WINDOW} when no TPM is "
             "given) and the proxy holds requests until it has room; each request carries ~500 tokens "
             "(default: no window)")


def _bind_failed(exc: OSError) -> Exception:
    """The demo listens on HOST, on free ports: a failure to bind is one line (``BindFailed``), not a traceback."""
    from ...server.bind import failure

    return failure(exc, HOST, 0, port_flag=None, host_flag=None) or exc


def main(args: argparse.Namespace) -> int:
    options = DemoOptions(duration=args.duration, agents=args.agents, cap=args.cap, use_proxy=not args.no_proxy,
                          windows=args.windows)
    text = asyncio.run(run_demo(options))
    print(text, flush=True)
    return 0
