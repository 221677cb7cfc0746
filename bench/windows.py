"""Token windows held, not hit: a fleet against a provider enforcing per-minute token windows (a benchmark).

A fleet of ``--agents`` (default 12) runs for ``--duration`` seconds (default 60)
against ``slotproxy fake-upstream`` enforcing one window, well past what the
window allows, in two workloads:

``cached``  Claude-Code-like, Anthropic's Messages API (the anthropic SDK) against
            ``--itpm`` (default 60 000): each agent is a conversation whose every
            turn re-sends the shared tools and system prompt (~4 500 tokens, a
            ``cache_control`` breakpoint after each) and its growing history (a
            breakpoint on the last message), and adds a tool result of ~200
            tokens; after ``TURNS_PER_SESSION`` turns it starts a new session.
            Cache reads are free against ITPM, so a turn costs what it adds.
``plain``   independent prompts of 1 000-2 500 tokens, OpenAI's chat completions
            (the openai SDK) against ``--tpm`` (default 150 000).

Each workload runs four arms, each with a fresh fake (and a fresh slotproxy):

``direct``   the agents straight at the fake, the SDK's own retries (``max_retries``
             left at its default, 2; they honour ``retry-after-ms``);
``plain``    through slotproxy without windows (as before issue 34);
``windows``  through slotproxy with the fake's window configured
             (``windows: {input_tokens_per_minute: N}`` / ``{tokens_per_minute: N}``);
``whole``    the same, with slotproxy counting the whole prompt against the input
             window: no mirrored prompt cache, and answers reconciled as if cache
             reads counted. An ablation, made by a stand-in in the measured process
             (``--serve-whole``), not a configuration anyone should run.

One more arm runs when ``--arms`` names it: ``learned``, slotproxy with
``windows: {}``, the limit learned from the first answer's ``*-limit`` headers.

Every arm's agents are the same: an SDK call per turn, a short "tool run"
(``THINK``) between turns; a 429 the SDK gives up on is counted, waited out
(its Retry-After, else 1 s) and the turn sent again. Reported per arm, at the
deadline (in-flight turns are then cancelled):

- turns/min: turns completed before the deadline, per minute;
- upstream 429s: ``rate_limited`` of the fake's ``GET /stats``;
- 429s reaching agents: 429 answers the agents' HTTP client received (the
  SDK's retries included), and in brackets those the SDK gave up on;
- utilisation: the tokens the fake's bucket was charged before the deadline
  (counted in the fake's process by a counting bucket, ``--serve-fake``) over
  what the bucket allowed: limit x minutes + its initial capacity (the limit);
- p50 / p90 / mean turn time: from a turn's first send to its answer's end,
  retries and waits included: the turns completed before the deadline, and
  those still under way then at their age (the least they will take; without
  them, the agents a retry lottery starves would not count), whose number and
  oldest age are shown too;
- slotproxy's limit at the end, and its windows' requests held (``held_total``:
  that waited on one) and ``hits`` (status).

Targets (issue 34): 0 upstream 429s with windows; utilisation >= 0.95 with
windows; on the cached workload >= 3x the turns a minute of the whole-prompt
ablation; p50 turn time with windows no worse than direct.

    python bench/windows.py                           # 2 workloads x 4 arms x 60 s (~9 min)
    python bench/windows.py --duration 10 --workloads cached --arms direct,windows
    python bench/windows.py --agents 24 --itpm 30000 --logs /tmp/windows
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import (
    HOST,
    Processes,
    command_line,
    fmt,
    free_port,
    get_json,
    log,
    machine_note,
    pass_miss_table,
    pct,
    raise_on_sigterm,
    run_loop,
    start_serve,
    wait_http,
)

ARMS = {
    "direct": "straight at the fake, SDK retries",
    "plain": "slotproxy, no windows",
    "windows": "slotproxy, windows",
    "whole": "slotproxy, windows, whole prompt counted (ablation)",
    "learned": "slotproxy, windows learned from the answers",
}
DEFAULT_ARMS = ("direct", "plain", "windows", "whole")
WINDOW_ARMS = ("windows", "whole", "learned")
API_KEY = "sk-bench-windows"
THINK = (0.1, 0.4)  # seconds an agent "runs tools" between two turns
START_SPREAD = 0.2  # the agents start within this many seconds: sessions started together
TURNS_PER_SESSION = 60
GIVE_UP_WAIT = 1.0  # an agent's wait after a 429 its SDK gave up on, when the answer states none
REQUEST_TIMEOUT = 600.0
PROXY_LIMIT = 64  # the proxy's concurrency limit: above the fleet, so only the windows hold
TARGET_UTILISATION = 0.95
TARGET_ABLATION_RATIO = 3.0
WORDS = ("the", "file", "test", "module", "returns", "value", "error", "config", "handler", "request", "cache",
         "token", "window", "limit", "agent", "patch", "diff", "line", "function", "class", "import", "path")


# --- workloads -----------------------------------------------------------------------


def words(rng: random.Random, size: int) -> str:
    """About ``size`` bytes of words."""
    out: list[str] = []
    length = 0
    while length < size:
        word = rng.choice(WORDS)
        out.append(word)
        length += len(word) + 1
    return " ".join(out)


def _tools() -> list[dict[str, Any]]:
    rng = random.Random(1)
    tools: list[dict[str, Any]] = [
        {"name": f"tool_{i}", "description": words(rng, 1100),
         "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}
        for i in range(10)
    ]
    tools[-1]["cache_control"] = {"type": "ephemeral"}
    return tools


def _system() -> list[dict[str, Any]]:
    rng = random.Random(2)
    return [{"type": "text", "text": words(rng, 3000)},
            {"type": "text", "text": words(rng, 3000), "cache_control": {"type": "ephemeral"}}]


TOOLS = _tools()
SYSTEM = _system()


def with_breakpoint(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history as sent: a ``cache_control`` breakpoint on the last message's last block only."""
    last = history[-1]
    blocks = [*last["content"][:-1], {**last["content"][-1], "cache_control": {"type": "ephemeral"}}]
    return [*history[:-1], {"role": last["role"], "content": blocks}]


def _text_message(role: str, text: str) -> dict[str, Any]:
    return {"role": role, "content": [{"type": "text", "text": text}]}


@dataclass(frozen=True)
class Workload:
    name: str
    flag: str  # the fake's flag for the window
    window: str  # its name, in the fake's stats and the proxy's config
    provider: str  # the proxy's provider (and its dialect)
    model: str
    what: str

    def fake_args(self, limit: int) -> list[str]:
        return [self.flag, str(limit)]

    def upstream(self, fake_port: int) -> str:
        """The provider's upstream, as its SDK's base URL lacks or carries /v1."""
        return f"http://{HOST}:{fake_port}" + ("/v1" if self.provider == "openai" else "")

    def proxy_yaml(self, fake_port: int, windows: str | None) -> str:
        """The proxy's config; ``windows`` is the provider's ``windows:`` value (None: no windows)."""
        lines = ["state: {path: null}", "ledger: {path: null}", "providers:", f"  {self.provider}:",
                 f"    upstream: {self.upstream(fake_port)}", f"    limit: {PROXY_LIMIT}"]
        if self.provider == "anthropic":
            lines.append("    auth: x-api-key")
        if windows is not None:
            lines.append(f"    windows: {windows}")
        return "\n".join(lines) + "\n"


WORKLOADS = {
    "cached": Workload("cached", "--itpm", "input_tokens_per_minute", "anthropic", "claude-sonnet-4-5",
                       "conversations re-sending a cached prefix (anthropic SDK, ITPM)"),
    "plain": Workload("plain", "--tpm", "tokens_per_minute", "openai", "gpt-4.1",
                      "independent prompts (openai SDK, TPM)"),
}


# --- the agents ----------------------------------------------------------------------


@dataclass
class Tally:
    turns: list[float] = field(default_factory=list)  # seconds, first send to the answer's end
    sending: dict[int, float] = field(default_factory=dict)  # a turn under way -> when it was first sent
    http_429: int = 0  # 429 answers the agents' HTTP client received, the SDK's retries included
    gave_up: int = 0  # 429s the SDK raised after its retries
    errors: int = 0
    samples: list[str] = field(default_factory=list)
    open: bool = True  # False once the deadline passed: nothing more is counted
    unfinished: list[float] = field(default_factory=list)  # ages at the deadline of the turns then under way

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.samples) < 3:
            self.samples.append(what[:200])


def _stated_wait(headers: Any) -> float:
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        try:
            return float(headers.get(name)) * scale
        except (TypeError, ValueError):
            continue
    return GIVE_UP_WAIT


class Agents:
    """One arm's fleet on one SDK client; ``run`` drives an agent until cancelled."""

    def __init__(self, workload: Workload, base_url: str, tally: Tally, agents: int) -> None:
        import httpx2

        self.workload = workload
        self.tally = tally

        async def count(response: httpx2.Response) -> None:
            if response.status_code == 429 and tally.open:
                tally.http_429 += 1

        self.http = httpx2.AsyncClient(event_hooks={"response": [count]}, timeout=REQUEST_TIMEOUT, trust_env=False,
                                       limits=httpx2.Limits(max_connections=agents * 4,
                                                            max_keepalive_connections=agents * 4))
        if workload.provider == "anthropic":
            import anthropic

            self.client: Any = anthropic.AsyncAnthropic(base_url=base_url, api_key=API_KEY, http_client=self.http)
            self.rate_limited: type[Exception] = anthropic.RateLimitError
            self.failed: tuple[type[Exception], ...] = (anthropic.APIError,)
        else:
            import openai

            self.client = openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, http_client=self.http)
            self.rate_limited = openai.RateLimitError
            self.failed = (openai.APIError,)

    async def close(self) -> None:
        await self.http.aclose()

    async def turn(self, call: Callable[[], Awaitable[str]]) -> str:
        """One turn to its answer: the SDK's retries, then the agent's own after a 429 the SDK gave up on.
        Under way, it is in ``sending`` (by ``call``, which lives as long as the turn)."""
        started = time.monotonic()
        self.tally.sending[id(call)] = started
        while True:
            try:
                text = await call()
                break
            except self.rate_limited as exc:
                if self.tally.open:
                    self.tally.gave_up += 1
                await asyncio.sleep(_stated_wait(exc.response.headers))  # type: ignore[attr-defined]
            except self.failed as exc:
                if self.tally.open:
                    self.tally.error(f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(GIVE_UP_WAIT)
        if self.tally.open:
            self.tally.turns.append(time.monotonic() - started)
            del self.tally.sending[id(call)]
        return text

    async def run(self, index: int) -> None:
        rng = random.Random(1000 + index)
        await asyncio.sleep(rng.uniform(0, START_SPREAD))
        if self.workload.provider == "anthropic":
            await self._conversations(index, rng)
        else:
            await self._prompts(index, rng)

    async def _conversations(self, index: int, rng: random.Random) -> None:
        session = 0
        while True:
            session += 1
            history = [_text_message("user", f"agent {index} session {session}: " + words(rng, 800))]
            for _ in range(TURNS_PER_SESSION):
                messages = with_breakpoint(history)
                reply = await self.turn(functools.partial(self._message, messages))
                history += [_text_message("assistant", reply or "ok"),
                            _text_message("user", f"tool result {len(history)}: " + words(rng, 800))]
                await asyncio.sleep(rng.uniform(*THINK))

    async def _message(self, messages: list[dict[str, Any]]) -> str:
        async with self.client.messages.stream(model=self.workload.model, max_tokens=1024, tools=TOOLS,
                                               system=SYSTEM, messages=messages) as stream:
            message = await stream.get_final_message()
        return "".join(getattr(block, "text", "") for block in message.content)

    async def _prompts(self, index: int, rng: random.Random) -> None:
        while True:
            prompt = f"agent {index}: " + words(rng, rng.randint(4000, 10000))
            await self.turn(functools.partial(self._completion, prompt))
            await asyncio.sleep(rng.uniform(*THINK))

    async def _completion(self, prompt: str) -> str:
        stream = await self.client.chat.completions.create(
            model=self.workload.model, messages=[{"role": "user", "content": prompt}], max_tokens=256, stream=True,
            stream_options={"include_usage": True})
        parts = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        return "".join(parts)


# --- one arm -------------------------------------------------------------------------


@dataclass
class Result:
    workload: str
    arm: str
    minutes: float
    turns: list[float]
    unfinished: list[float]
    upstream_429: int
    http_429: int
    gave_up: int
    errors: int
    samples: list[str]
    charged: float
    allowed: float
    final_limit: str = "—"
    held: int | None = None
    hits: int | None = None

    @property
    def turns_per_min(self) -> float:
        return len(self.turns) / self.minutes

    @property
    def times(self) -> list[float]:
        """Turn times: the completed turns', and the turns under way at the deadline at their age then (the
        least they will take: leaving them out would drop the agents a retry lottery starves)."""
        return self.turns + self.unfinished

    @property
    def utilisation(self) -> float:
        return self.charged / self.allowed if self.allowed else float("nan")


async def drive(workload: Workload, base_url: str, fake_port: int, args: argparse.Namespace) \
        -> tuple[Tally, dict[str, Any], float]:
    """Run the fleet for the duration; the tally, the fake's stats at the deadline, and the seconds run."""
    tally = Tally()
    fleet = Agents(workload, base_url, tally, args.agents)
    started = time.monotonic()
    tasks = [asyncio.create_task(fleet.run(index)) for index in range(args.agents)]
    try:
        await asyncio.sleep(args.duration)
        tally.open = False
        deadline = time.monotonic()
        elapsed = deadline - started
        tally.unfinished = [deadline - sent for sent in tally.sending.values()]
        stats = await asyncio.to_thread(get_json, f"http://{HOST}:{fake_port}/stats")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await fleet.close()
    return tally, stats, elapsed


def start_fake(procs: Processes, name: str, workload: Workload, limit: int) -> int:
    """The fake, in a process whose buckets count what they are charged (``--serve-fake``)."""
    port = free_port()
    argv = [sys.executable, __file__, "--serve-fake", "fake-upstream", "--port", str(port),
            *workload.fake_args(limit)]
    proc = procs.start(name, argv)
    wait_http(f"http://{HOST}:{port}/stats", proc, name)
    return port


def start_proxy(procs: Processes, name: str, arm: str, workload: Workload, fake_port: int, limit: int) -> int:
    port = free_port()
    windows = {"plain": None, "learned": "{}"}.get(arm, f"{{{workload.window}: {limit}}}")
    text = workload.proxy_yaml(fake_port, windows)
    if arm != "whole":
        start_serve(procs, name, port, text)
        return port
    config = procs.workdir / f"{name}.yaml"
    config.write_text(text)
    proc = procs.start(name, [sys.executable, __file__, "--serve-whole", "serve", "--config", str(config),
                              "--port", str(port), "--log-level", "WARNING"])
    wait_http(f"http://{HOST}:{port}/healthz", proc, name)
    return port


def proxy_end(port: int, workload: Workload) -> tuple[str, int | None, int | None]:
    """The provider's limit at the end, and its windows' requests held (that waited on one) and hits, summed
    (None without windows)."""
    status = get_json(f"http://{HOST}:{port}/_slotproxy/status")
    provider = next(p for p in status["providers"] if p["provider"] == workload.provider)
    windows = provider.get("windows") or [w for key in provider.get("keys") or [] for w in key.get("windows") or []]
    if not windows:
        return str(provider["limit"]), None, None
    return (str(provider["limit"]), sum(int(w.get("held_total") or 0) for w in windows),
            sum(int(w.get("hits") or 0) for w in windows))


def run_arm(workload: Workload, arm: str, args: argparse.Namespace, workdir: Path) -> Result:
    limit = args.itpm if workload.name == "cached" else args.tpm
    procs = Processes(workdir)
    name = f"{workload.name}-{arm}"
    try:
        fake_port = start_fake(procs, f"{name}-fake", workload, limit)
        proxy_port = None
        if arm == "direct":
            base_url = workload.upstream(fake_port)
        else:
            proxy_port = start_proxy(procs, f"{name}-proxy", arm, workload, fake_port, limit)
            base_url = f"http://{HOST}:{proxy_port}/{workload.provider}"
        log(f"{name}: {args.agents} agents for {args.duration:g}s")
        tally, stats, elapsed = run_loop(drive(workload, base_url, fake_port, args))
        window = stats["windows"][workload.window]
        buckets = max(1, len(window["buckets"]))
        result = Result(workload.name, arm, elapsed / 60, tally.turns, tally.unfinished, int(stats["rate_limited"]),
                        tally.http_429,
                        tally.gave_up, tally.errors, tally.samples, float(window.get("charged", 0.0)),
                        buckets * limit * (elapsed / 60 + 1))
        if proxy_port is not None:
            result.final_limit, result.held, result.hits = proxy_end(proxy_port, workload)
        log(f"{name}: {len(tally.turns)} turns, upstream 429s {result.upstream_429}, agents' 429s {tally.http_429} "
            f"({tally.gave_up} given up), utilisation {result.utilisation:.3f}, errors {tally.errors} "
            f"{tally.samples[:1]}")
        return result
    finally:
        procs.stop_all()


def windows_missing() -> str | None:
    """Why this tree's slotproxy cannot hold token windows yet (None: it can): its relay never settles them."""
    relay = Path(__file__).resolve().parents[1] / "proxy" / "http"
    if any("settle_windows" in path.read_text() for path in relay.glob("*.py")):
        return None
    return ("this tree's slotproxy does not hold token windows yet (its relay never settles them): the windows "
            "and whole arms need issue 34's relay wiring; run --arms direct,plain meanwhile")


# --- the stand-ins, in the measured processes only -------------------------------------


def serve_counting_fake(argv: list[str]) -> int:
    """``slotproxy fake-upstream`` whose buckets count every token they are charged (``/stats``:
    ``windows.<name>.charged``)."""
    from proxy.tools.fake_upstream import windows

    class CountingBucket(windows.Bucket):
        def __init__(self, limit: int, now: float) -> None:
            super().__init__(limit, now)
            self.charged = 0.0

        def take(self, amount: float, now: float) -> None:
            self.charged += amount
            super().take(amount, now)

    shown = windows.TokenWindows.stats

    def stats(self: windows.TokenWindows, now: float) -> dict[str, Any]:
        out = shown(self, now)
        for (_, _, name), bucket in self._buckets.items():
            out[name]["charged"] = out[name].get("charged", 0.0) + getattr(bucket, "charged", 0.0)
        return out

    windows.Bucket = CountingBucket  # type: ignore[misc]
    windows.TokenWindows.stats = stats  # type: ignore[method-assign]
    from proxy.cli import main
    return main(argv)


def serve_whole_prompt(argv: list[str]) -> int:
    """``slotproxy serve`` counting the whole prompt against Anthropic's input window: no mirrored cache,
    and an answer's cache reads counted as if the window charged them."""
    from proxy.providers import estimate

    counted = estimate.actual_for

    def whole(dialect: str, window: str, input_tokens: int, cached_read: int, cache_write: int,
              output_tokens: int) -> float:
        if window == estimate.INPUT_WINDOW:
            return float(input_tokens)
        return counted(dialect, window, input_tokens, cached_read, cache_write, output_tokens)

    estimate.Estimator._mirror = lambda self, *args, **kwargs: (0.0, None)  # type: ignore[method-assign]
    estimate.Estimator.actual_for = staticmethod(whole)  # type: ignore[assignment]
    for loaded in ("proxy.http.windows", "proxy.http.relay", "proxy.http.runtime"):  # the modules that may take actual_for by name
        importlib.import_module(loaded)
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("proxy.") and getattr(module, "actual_for", None) is counted:
            module.actual_for = whole  # type: ignore[attr-defined]
    from proxy.cli import main
    return main(argv)


# --- report --------------------------------------------------------------------------


def results_table(results: Sequence[Result]) -> Iterator[str]:
    yield ("| workload | arm | turns/min | upstream 429s | 429s reaching agents (SDK gave up) | utilisation "
           "| p50 turn s | p90 turn s | mean turn s | under way at the deadline (oldest s) | final limit "
           "| requests held / window hits | errors |")
    yield "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    for r in results:
        held = "—" if r.held is None else f"{r.held} / {r.hits}"
        yield (f"| {r.workload} | {ARMS[r.arm]} | {r.turns_per_min:.1f} | {r.upstream_429} | {r.http_429} "
               f"({r.gave_up}) | {fmt(r.utilisation, 3)} | {fmt(pct(r.times, 50), 2)} | {fmt(pct(r.times, 90), 2)} "
               f"| {fmt(statistics.fmean(r.times) if r.times else None, 2)} | {_unfinished(r)} | {r.final_limit} "
               f"| {held} | {r.errors} |")


def _unfinished(r: Result) -> str:
    return f"{len(r.unfinished)} ({max(r.unfinished):.1f})" if r.unfinished else "0"


def target_rows(results: Sequence[Result]) -> Iterator[tuple[str, str, str, bool]]:
    by = {(r.workload, r.arm): r for r in results}
    for workload in WORKLOADS:
        held = by.get((workload, "windows"))
        if held is None:
            continue
        yield f"upstream 429s, {workload}, windows", str(held.upstream_429), "0", held.upstream_429 == 0
        yield (f"utilisation, {workload}, windows", fmt(held.utilisation, 3), f"≥ {TARGET_UTILISATION}",
               held.utilisation >= TARGET_UTILISATION)
        whole = by.get((workload, "whole"))
        if workload == "cached" and whole is not None:
            ratio = held.turns_per_min / whole.turns_per_min if whole.turns_per_min else float("inf")
            yield (f"turns/min, {workload}, windows ÷ whole prompt", f"{ratio:.1f}×", f"≥ {TARGET_ABLATION_RATIO:g}×",
                   ratio >= TARGET_ABLATION_RATIO)
        learned = by.get((workload, "learned"))
        if learned is not None:
            yield (f"upstream 429s, {workload}, learned windows", str(learned.upstream_429), "0",
                   learned.upstream_429 == 0)
            yield (f"utilisation, {workload}, learned windows", fmt(learned.utilisation, 3),
                   f"≥ {TARGET_UTILISATION}", learned.utilisation >= TARGET_UTILISATION)
        direct = by.get((workload, "direct"))
        if direct is not None:
            mine, theirs = pct(held.times, 50), pct(direct.times, 50)
            yield (f"p50 turn time, {workload}, windows vs direct", f"{mine:.3f} s vs {theirs:.3f} s", "≤ direct",
                   mine <= theirs)


def report(results: Sequence[Result], args: argparse.Namespace, command: str) -> str:
    import anthropic
    import openai

    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [(f"`{command}` ({when}); {args.agents} agents, {args.duration:g} s per arm; "
              f"fake: `--itpm {args.itpm}` (cached), `--tpm {args.tpm}` (plain), one key, one model."),
             "Machine: " + machine_note(f"anthropic {anthropic.__version__}", f"openai {openai.__version__}")
             + "; shared, noisy.", ""]
    for name in args.workloads:
        lines.append(f"- {name}: {WORKLOADS[name].what}")
    lines += ["", *results_table(results), ""]
    targets = list(target_rows(results))
    if targets:
        lines += ["Targets:", "", *pass_miss_table(targets), ""]
    errors = [f"- {r.workload}/{r.arm}: {sample}" for r in results for sample in r.samples]
    if errors:
        lines += ["Errors (first of each arm):", "", *errors, ""]
    return "\n".join(lines)


def names(known: dict[str, Any]) -> Callable[[str], list[str]]:
    def convert(text: str) -> list[str]:
        chosen = text.split(",")
        unknown = sorted(set(chosen) - set(known))
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)} (known: {', '.join(known)})")
        return [name for name in known if name in chosen]

    return convert


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--serve-fake"]:
        return serve_counting_fake(argv[1:])
    if argv[:1] == ["--serve-whole"]:
        return serve_whole_prompt(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of overload per arm (default 60)")
    parser.add_argument("--agents", type=int, default=12)
    parser.add_argument("--itpm", type=int, default=60_000, help="the cached workload's input window")
    parser.add_argument("--tpm", type=int, default=150_000, help="the plain workload's tokens window")
    parser.add_argument("--workloads", type=names(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--arms", type=names(ARMS), default=list(DEFAULT_ARMS),
                        help=f"of {','.join(ARMS)} (default: {','.join(DEFAULT_ARMS)})")
    parser.add_argument("--logs", type=Path, help="keep the servers' logs and configs in this folder")
    args = parser.parse_args(argv)
    if set(args.arms) & set(WINDOW_ARMS):
        missing = windows_missing()
        if missing is not None:
            print(f"bench/windows.py: {missing}", file=sys.stderr)
            return 2
    signal.signal(signal.SIGTERM, raise_on_sigterm)
    results = []
    with tempfile.TemporaryDirectory(prefix="slotproxy-windows-") as tmp:
        try:
            for workload in args.workloads:
                for arm in args.arms:
                    results.append(run_arm(WORKLOADS[workload], arm, args, Path(tmp)))
        finally:
            if args.logs is not None:
                shutil.copytree(tmp, args.logs, dirs_exist_ok=True)
    print(report(results, args, command_line("windows.py", argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
