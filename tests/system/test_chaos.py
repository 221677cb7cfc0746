"""Chaos: many clients, faulty upstreams, cancels, reloads and admin changes, invariants throughout.

Seeded (``CHAOS_SEED``, default below) and bounded (``CHAOS_SECONDS``, default 40 s;
``CHAOS_CLIENTS``, default 40). Run it with ``-s`` to see the figures; for long runs
add ``-p no:logging``, since pytest's log capture keeps every warning the proxy logs
in memory (~2 KiB each) and that would count in the VmRSS check::

    CHAOS_SEED=7 CHAOS_SECONDS=300 python -m pytest tests/system/test_chaos.py::test_chaos -s -q -p no:logging

Two fake upstreams and the proxy run in this process and this event loop:
``openai`` (limit 3/5 by reloads, 2-5 by the admin API, auto-reduced by 429s,
``recovery.after`` 3 s; fake cap 6, counter lag 0-80 ms) takes 3/4 of the clients;
``gated`` (limit 2/3, 1-3; a ``usage:`` gate polling the fake's own count; fake
cap 4, lag 0-300 ms) takes the rest. Every request picks a fault (the fake's
``x-fake-*`` request headers) and maybe a cancel; other tasks reload the config
(file + ConfigWatcher.reload, file + the watcher's poll, ``state.apply``, and
invalid edits that must be refused), change limits (``PUT
/_slotproxy/providers/{id}/limit`` and ``backend.set_limit``), star and unstar
workspaces, read status and metrics, and move the fakes' lag and Retry-After.

Invariants asserted:

I1  upstream concurrency, at every upstream admission and every 20 ms, per provider.
    ``real`` = the fake's model requests whose handler is running (counted at
    its admission and at its handler's end, so without the fake's lag_ms).
        real(t) <= B(t) = max{ effective limit in force at any instant of
                               [t - slot_timeout - release_cooldown - 0.5 s, t] }
    Why sound: the proxy grants only while in_flight < limit, so in_flight can
    exceed the current limit only after the limit was lowered, and what was
    granted before the lowering is gone within slot_timeout (the watchdog)
    plus the cooldown; 0.5 s is for an abort to reach the upstream. The limit's
    history is exact: set_limit, the auto-reduction and the recovery step are
    wrapped to record each change, and every check adds the current value. The
    proxy's own in_flight obeys the same bound. For ``gated`` the fake's own,
    lagged count obeys it too, with the window widened by the largest lag
    (300 ms): that is the usage gate's promise (admit only while count +
    unseen < limit); its cap 429s must be 0.
I2  no hung client: each request runs under ``asyncio.wait_for(HANG_BOUND)``,
    hangs == 0; every request ends with a full relay (200, body complete and
    intact) or a clean error that fits its fault: a JSON error body (the
    proxy's ``slotproxy_error`` shape or the upstream's relayed error), or a cut
    connection after the first byte only where the upstream failed mid-stream.
    A truncated body that ends cleanly, a non-JSON error, an exception before
    the response or a proxy 500 counts as unexpected (must be 0). Every
    response carries ``X-Slotproxy-Queue-Ms``.
I3  a cancel releases at once: a client that leaves (queued, before headers,
    after the first byte, mid-stream) is out of the queue and holds no lease
    within 1 s.
I4  after the drain: in_flight == 0 and queued == 0 everywhere, the fakes idle,
    no lease object left, no request still counted active, no upstream
    connection still checked out of the proxy's pool; then, with the client
    session and the proxy's upstream pool closed, no more asyncio tasks and no
    more TCP sockets of this process (/proc/self/fd matched in /proc/net/tcp,
    listeners excluded) than before the first request; VmRSS after gc.collect()
    within +30 MiB of the warm start; no unhandled exception in the loop and no
    ERROR log from aiohttp, asyncio or slotproxy (refused reloads excepted).
I5  at least 5 fault kinds injected; cancels while queued, after the first byte
    and mid-stream all happened; reloads and admin changes happened.

The tests named ``test_bug_*`` at the end are bugs this test found, reduced to
deterministic regression tests.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import random
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.config import parse_config
from proxy.server.run import ConfigWatcher

from ..conftest import Proxy, Upstream, serve_app, wait_until

SEED = int(os.environ.get("CHAOS_SEED", "20261129"))
SECONDS = float(os.environ.get("CHAOS_SECONDS", "40"))
CLIENTS = int(os.environ.get("CHAOS_CLIENTS", "40"))

IDLE_TIMEOUT = 1.0
SLOT_TIMEOUT = 4.0
QUEUE_TIMEOUT = 5.0
DEFAULT_PAUSE = 0.2
COOLDOWN = 0.05
RETRY_ON_429 = 2
CAP = 6
RECOVERY_AFTER = "3s"
TEARDOWN_MARGIN = 0.5
WINDOW = SLOT_TIMEOUT + COOLDOWN + TEARDOWN_MARGIN
GATED_LAGS_MS = (0, 100, 300)
GATED_WINDOW = WINDOW + max(GATED_LAGS_MS) / 1000
# Worst legitimate life of one request: (retry_on_429 + 1) x (queue_timeout + slot_timeout) plus pauses.
HANG_BOUND = (RETRY_ON_429 + 1) * (QUEUE_TIMEOUT + SLOT_TIMEOUT) + 15.0
RELEASE_BOUND = 1.0
RSS_MARGIN_KIB = 30 * 1024
WORKSPACES = ("ws-a", "ws-b", "ws-c", "release-team")

# fault kind -> weight
FAULTS: dict[str, int] = {
    "none": 34,
    "stall_short": 8,      # headers after 100-600 ms (< idle_timeout): full relay
    "stall_long": 4,       # headers after 1.3-2 s (> idle_timeout): 504 upstream_timeout
    "reset": 7,            # stream: reset after 1-4 chunks (cut); non-stream: reset (502)
    "status_5xx": 7,       # 500/502/503 relayed as is
    "429_retry_after": 2,  # 429 + Retry-After (the fake's short retry_after): retried, then relayed
    "429_no_retry_after": 2,  # 429 without Retry-After: default_pause
    "stream_error": 3,     # 200 stream with an in-stream rate-limit / overloaded error
    "stall_mid_stream": 3,  # headers, then 1.2-1.6 s to the first chunk (> idle_timeout): the stream is cut
    "slow": 6,             # 3-6 chunks 150-450 ms apart (< idle, < slot_timeout): full relay
    "slow_over_slot": 2,   # 8 chunks 650-800 ms apart (> slot_timeout): watchdog cuts the stream
}
# cancel kind -> probability
CANCELS: dict[str, float] = {"cancel_early": 0.10, "cancel_first_byte": 0.05, "cancel_mid_stream": 0.05}
STREAM_ONLY = {"stream_error", "slow", "slow_over_slot", "stall_mid_stream"}

def allowed_outcomes(kind: str, stream: bool, status: int | None) -> set[str]:
    """What a request with this fault may legitimately end with (besides the common ones)."""
    common = {"http_503_queue_timeout", "http_429_cap"}
    if kind in ("none", "stall_short", "slow"):
        return common | {"full"}
    if kind == "stall_long":
        return common | {"http_504_upstream_timeout"}
    if kind == "reset":
        return common | ({"cut"} if stream else {"http_502_upstream_unreachable"})
    if kind == "status_5xx":
        return common | {f"http_{status}_injected"}
    if kind in ("429_retry_after", "429_no_retry_after"):
        return common | {"http_429_injected"}
    if kind == "stream_error":
        return common | {"full_stream_error"}
    if kind in ("slow_over_slot", "stall_mid_stream"):
        return common | {"cut"}
    raise AssertionError(kind)


# ----- process introspection ------------------------------------------------------


def tcp_sockets() -> dict[str, str]:
    """This process's TCP sockets: inode -> state (hex, as in /proc/net/tcp; 0A is LISTEN)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found: dict[str, str] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as handle:
                next(handle)
                for line in handle:
                    parts = line.split()
                    if len(parts) > 9 and parts[9] in inodes:
                        found[parts[9]] = parts[3]
        except OSError:
            continue
    return found


def vm_rss_kib() -> int:
    with open("/proc/self/status") as handle:
        match = re.search(r"VmRSS:\s+(\d+) kB", handle.read())
    assert match is not None
    return int(match.group(1))


def task_names() -> Counter[str]:
    names: Counter[str] = Counter()
    for task in asyncio.all_tasks():
        coro = task.get_coro()
        names[getattr(coro, "__qualname__", repr(coro))] += 1
    return names


# ----- bookkeeping -----------------------------------------------------------------


@dataclass
class LimitHistory:
    """The effective limit over time: (loop time it took effect, value)."""

    entries: list[tuple[float, int | None]] = field(default_factory=list)

    def record(self, when: float, value: int | None) -> None:
        if not self.entries or self.entries[-1][1] != value:
            self.entries.append((when, value))

    def bound(self, now: float, current: int | None, window: float) -> float:
        """max of the limits in force at any instant of [now - window, now] (None = unlimited)."""
        start = now - window
        values = [current]
        for index, (since, value) in enumerate(self.entries):
            until = self.entries[index + 1][0] if index + 1 < len(self.entries) else now
            if until >= start:
                values.append(value)
        return float("inf") if any(v is None for v in values) else float(max(v for v in values if v is not None))


@dataclass
class Figures:
    requests: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    streams: int = 0
    non_streams: int = 0
    cancels: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    slow_releases: list[str] = field(default_factory=list)
    missing_queue_ms: list[str] = field(default_factory=list)
    reloads: Counter[str] = field(default_factory=Counter)
    admin: Counter[str] = field(default_factory=Counter)
    knob_changes: int = 0
    violations: list[str] = field(default_factory=list)
    samples: int = 0
    loop_errors: list[str] = field(default_factory=list)
    error_logs: list[str] = field(default_factory=list)
    durations: list[float] = field(default_factory=list)
    rss_trace: list[int] = field(default_factory=list)


@dataclass(eq=False)
class Target:
    """One provider under test, its fake upstream and what was measured about it."""

    name: str
    upstream: Upstream
    window: float
    lagged_bound: bool  # also hold the fake's own (lagged) count to the bound: the usage gate's promise
    reload_limits: tuple[int, int]
    admin_limits: tuple[int, ...]
    lags_ms: tuple[int, ...]
    limiter: Any = None
    history: LimitHistory = field(default_factory=LimitHistory)
    real_active: int = 0
    upstream_admissions: int = 0
    max_real: int = 0
    max_real_over_current_limit: int = 0
    max_lagged: int = 0
    max_lagged_over_current_limit: int = 0
    max_bound: float = 0
    cap_429s: int = 0
    requests: int = 0
    limits_seen: Counter[int | None] = field(default_factory=Counter)

    def line(self) -> str:
        limits = dict(sorted(self.limits_seen.items(), key=lambda kv: str(kv[0])))
        return (f"  [{self.name}] requests={self.requests} upstream admissions={self.upstream_admissions} "
                f"max real={self.max_real} (over the current limit: {self.max_real_over_current_limit}) "
                f"max lagged={self.max_lagged} (over the current limit: {self.max_lagged_over_current_limit}) "
                f"max bound={self.max_bound:g} cap={self.upstream.fake.cap} cap 429s={self.cap_429s} "
                f"limit samples={limits}")


class ErrorLogs(logging.Handler):
    """Collects ERROR records from aiohttp, asyncio and slotproxy (refused reloads are expected)."""

    def __init__(self, sink: list[str]) -> None:
        super().__init__(logging.ERROR)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        name = record.name
        if not name.startswith(("aiohttp", "asyncio", "slotproxy")):
            return
        message = record.getMessage()
        if name.startswith("slotproxy") and message.startswith("config reload refused"):
            return
        self.sink.append(f"{name}: {message[:300]}" + (f" [{record.exc_info[1]!r}]" if record.exc_info else ""))


def config_text(targets: list[Target], limits: dict[str, int | str], starred: list[str]) -> str:
    """Both providers; ``gated`` admits by the fake's own count (the usage gate), ``openai`` recovers."""
    lines = [
        "state: {path: null}",
        f"workspaces: {{starred: {json.dumps(starred)}}}",
        "defaults:",
        f"  idle_timeout: {IDLE_TIMEOUT}",
        f"  slot_timeout: {SLOT_TIMEOUT}",
        f"  queue_timeout: {QUEUE_TIMEOUT}",
        f"  default_pause: {int(DEFAULT_PAUSE * 1000)}ms",
        f"  release_cooldown: {int(COOLDOWN * 1000)}ms",
        f"  retry_on_429: {RETRY_ON_429}",
        "providers:",
    ]
    for target in targets:
        lines += [f"  {target.name}:", f"    upstream: {target.upstream.url}/v1", f"    limit: {limits[target.name]}"]
        if target.lagged_bound:
            lines.append(f"    usage: {{url: '{target.upstream.url}/v1/usage', field: concurrent.sessions, "
                         "interval: 500ms, busy_interval: 20ms}")
        else:
            lines.append(f"    recovery: {{after: {RECOVERY_AFTER}}}")
    return "\n".join(lines) + "\n"


@dataclass
class Plan:
    rid: str
    target: Target
    kind: str
    stream: bool
    route: str  # "chat" or "messages"
    headers: dict[str, str]
    chunks: int
    status: int | None = None
    cancel: str | None = None
    cancel_after: float = 0.0
    mid_chunks: int = 2


def make_plan(rng: random.Random, rid: str, target: Target) -> Plan:
    kind = rng.choices(list(FAULTS), weights=list(FAULTS.values()))[0]
    stream = kind in STREAM_ONLY or rng.random() < 0.8
    route = "messages" if rng.random() < 0.25 else "chat"
    chunks = rng.randint(3, 6)
    headers = {"x-fake-tag": rid, "X-Conversation-Id": rid, "x-fake-chunks": str(chunks),
               "x-fake-delay-ms": str(rng.choice((5, 10, 20)))}
    if rng.random() < 0.9:
        headers["X-Workspace-Id"] = rng.choice(WORKSPACES)
    if rng.random() < 0.1:
        headers["X-Workspace-Starred"] = "1"
    roll = rng.random()
    if roll < 0.7:
        headers["X-Prompt-Started-At"] = str(int(time.time() * 1000) - rng.randint(0, 120_000))
    elif roll < 0.75:
        headers["X-Prompt-Started-At"] = rng.choice(("garbage", "-5", "99999999999999999999", ""))
    plan = Plan(rid, target, kind, stream, route, headers, chunks)
    if kind == "stall_short":
        headers["x-fake-stall-ms"] = str(rng.randint(100, 600))
    elif kind == "stall_long":
        headers["x-fake-stall-ms"] = str(rng.randint(1300, 2000))
    elif kind == "reset":
        headers["x-fake-chunks"] = str(chunks + 4)
        headers["x-fake-reset-after"] = str(rng.randint(1, 4))
    elif kind == "status_5xx":
        plan.status = rng.choice((500, 502, 503))
        headers["x-fake-status"] = str(plan.status)
    elif kind == "429_retry_after":
        headers["x-fake-status"] = "429"
    elif kind == "429_no_retry_after":
        headers["x-fake-status"] = "429"
        headers["x-fake-no-retry-after"] = "1"
    elif kind == "stream_error":
        if route == "messages":
            headers["x-fake-stream-error"] = rng.choice(("rate_limit_error", "overloaded_error"))
        else:
            headers["x-fake-stream-error"] = "rate_limit_exceeded"
    elif kind == "slow":
        headers["x-fake-delay-ms"] = str(rng.randint(150, 450))
    elif kind == "stall_mid_stream":
        headers["x-fake-delay-ms"] = str(rng.randint(1200, 1600))
    elif kind == "slow_over_slot":
        plan.chunks = 8
        headers["x-fake-chunks"] = "8"
        headers["x-fake-delay-ms"] = str(rng.randint(650, 800))
    roll = rng.random()
    for cancel, probability in CANCELS.items():
        if roll < probability:
            if cancel == "cancel_early" or stream:
                plan.cancel = cancel
            break
        roll -= probability
    plan.cancel_after = rng.uniform(0.0, 1.5)
    plan.mid_chunks = rng.randint(2, 3)
    return plan


def body_for(plan: Plan) -> dict[str, Any]:
    messages = [{"role": "user", "content": f"chaos {plan.rid}"}]
    if plan.route == "messages":
        return {"model": "fake", "stream": plan.stream, "max_tokens": 32, "messages": messages}
    return {"model": "fake", "stream": plan.stream, "user": plan.rid, "messages": messages}


def full_relay(plan: Plan, body: bytes) -> str:
    """'full' / 'full_stream_error' when a 200 body is complete and intact, else 'truncated...'."""
    text = body.decode("utf-8", "replace")
    if plan.kind == "stream_error":
        ok = plan.headers["x-fake-stream-error"] in text and "tok0 " in text
        return "full_stream_error" if ok else f"truncated_stream_error:{text[-120:]!r}"
    pieces_ok = all(f"tok{i} " in text for i in range(plan.chunks))
    if plan.stream:
        end = "event: message_stop" if plan.route == "messages" else "data: [DONE]"
        ok = pieces_ok and end in text[-300:]
    else:
        try:
            document = json.loads(text)
        except ValueError:
            return f"truncated_json:{text[-120:]!r}"
        ok = pieces_ok and isinstance(document, dict) and ("choices" in document or "content" in document)
    return "full" if ok else f"truncated:{text[-160:]!r}"


def error_outcome(status: int, body: bytes) -> str:
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return f"bad_error_body_{status}:{body[:160]!r}"
    if not isinstance(error, dict):
        return f"bad_error_body_{status}:{body[:160]!r}"
    if error.get("type") == "slotproxy_error":
        return f"http_{status}_{error.get('code')}"
    message = str(error.get("message", ""))
    if message.startswith("Injected status"):
        return f"http_{status}_injected"
    if message.startswith("Concurrency limit exceeded"):
        return f"http_{status}_cap"
    return f"bad_error_shape_{status}:{body[:160]!r}"


class Chaos:
    def __init__(self, targets: list[Target], proxy: Proxy, session: aiohttp.ClientSession, figures: Figures) -> None:
        self.targets = targets
        self.proxy = proxy
        self.session = session
        self.figures = figures
        self.loop = asyncio.get_running_loop()
        self.stop_at = self.loop.time() + SECONDS
        for target in targets:
            target.limiter = proxy.state.backend.limiter(target.name)
            target.history.record(self.loop.time(), target.limiter.limit)

    # -- what the proxy holds, for I3 --
    @staticmethod
    def where(target: Target, rid: str) -> str:
        if rid in {w.conversation for w in target.limiter.statistics().queue}:
            return "queued"
        # The limiter's held leases (internal, read only): a leaving client must not keep one.
        if rid in {lease.priority.conversation for lease in getattr(target.limiter, "_active", ())}:
            return "held"
        return "gone"

    async def released(self, target: Target, rid: str, what: str) -> None:
        deadline = self.loop.time() + RELEASE_BOUND
        while self.where(target, rid) != "gone":
            if self.loop.time() > deadline:
                self.figures.slow_releases.append(
                    f"{rid} {what}: still {self.where(target, rid)} after {RELEASE_BOUND}s")
                return
            await asyncio.sleep(0.01)

    # -- I1 --
    def check_concurrency(self, target: Target, where: str) -> None:
        now = self.loop.time()
        limiter = target.limiter
        current = limiter.limit
        target.history.record(now, current)
        bound = target.history.bound(now, current, WINDOW)
        real, lagged, in_flight = target.real_active, target.upstream.fake.active, limiter.in_flight
        target.max_real = max(target.max_real, real)
        target.max_lagged = max(target.max_lagged, lagged)
        target.max_bound = max(target.max_bound, bound)
        if current is not None:
            target.max_real_over_current_limit = max(target.max_real_over_current_limit, real - current)
            target.max_lagged_over_current_limit = max(target.max_lagged_over_current_limit, lagged - current)
        broken = real > bound or in_flight > bound or in_flight < 0 or limiter.queued < 0
        if target.lagged_bound:
            broken = broken or lagged > target.history.bound(now, current, GATED_WINDOW)
        if broken:
            recent = [(round(t - now, 3), v) for t, v in target.history.entries if t >= now - GATED_WINDOW]
            self.figures.violations.append(
                f"[{target.name}] {where} t={now:.3f}: upstream real={real} lagged={lagged} (lag "
                f"{target.upstream.fake.lag_ms:g} ms) proxy in_flight={in_flight} queued={limiter.queued} "
                f"bound={bound} current limit={current} limits in window={recent}"
            )

    def instrument(self, target: Target) -> None:
        """Count real upstream concurrency and record every change of the effective limit."""
        fake = target.upstream.fake
        admit, schedule_release, error = fake._admit, fake._schedule_release, fake._error

        def counted_admit(*args: Any) -> None:
            target.real_active += 1
            target.upstream_admissions += 1
            admit(*args)
            self.check_concurrency(target, "upstream admission")

        def counted_release(*args: Any) -> None:
            target.real_active -= 1
            schedule_release(*args)

        def counted_error(dialect: Any, status: int, message: str, **kwargs: Any) -> Any:
            if message.startswith("Concurrency limit exceeded"):
                target.cap_429s += 1
            return error(dialect, status, message, **kwargs)

        fake._admit = counted_admit  # type: ignore[method-assign]
        fake._schedule_release = counted_release  # type: ignore[method-assign]
        fake._error = counted_error  # type: ignore[method-assign]

        limiter = target.limiter

        def recorded(method: Callable[..., None]) -> Callable[..., None]:
            def call(*args: Any) -> None:
                method(*args)
                target.history.record(self.loop.time(), limiter.limit)
            return call

        # Every path that changes the effective limit (the instance attribute shadows the method).
        level = limiter.level
        level.set_limit = recorded(level.set_limit)  # type: ignore[method-assign]
        level._auto_reduce = recorded(level._auto_reduce)  # type: ignore[method-assign]
        level._recover_step = recorded(level._recover_step)  # type: ignore[method-assign]

    async def sampler(self) -> None:
        while True:
            self.figures.samples += 1
            if self.figures.samples % 500 == 1:  # every ~10 s: memory over time
                self.figures.rss_trace.append(vm_rss_kib())
            for target in self.targets:
                target.limits_seen[target.limiter.limit] += 1
                self.check_concurrency(target, "sampler")
            await asyncio.sleep(0.02)

    # -- clients --
    async def client(self, index: int, target: Target, rng: random.Random) -> None:
        number = 0
        while self.loop.time() < self.stop_at:
            number += 1
            plan = make_plan(rng, f"{target.name}-c{index}-{number}", target)
            target.requests += 1
            self.figures.requests += 1
            self.figures.faults[plan.kind] += 1
            if plan.stream:
                self.figures.streams += 1
            else:
                self.figures.non_streams += 1
            started = self.loop.time()
            try:
                outcome = await asyncio.wait_for(self.one(plan), HANG_BOUND)
            except TimeoutError:
                self.figures.hangs.append(
                    f"{plan.rid} kind={plan.kind} cancel={plan.cancel} where={self.where(target, plan.rid)}")
                continue
            self.figures.durations.append(self.loop.time() - started)
            self.figures.outcomes[outcome] += 1
            expected = outcome.startswith("cancelled") or outcome in allowed_outcomes(plan.kind, plan.stream, plan.status)
            if not expected:
                self.figures.unexpected.append(
                    f"{plan.rid} kind={plan.kind} stream={plan.stream} route={plan.route} -> {outcome}")
            await asyncio.sleep(rng.uniform(0, 0.05))

    async def one(self, plan: Plan) -> str:
        path = "messages" if plan.route == "messages" else "chat/completions"
        url = f"{self.proxy.url}/{plan.target.name}/{path}"
        request = asyncio.ensure_future(self.session.post(url, json=body_for(plan), headers=plan.headers))
        if plan.cancel == "cancel_early":
            done, _ = await asyncio.wait({request}, timeout=plan.cancel_after)
            if not done:
                kind = "cancel_queued" if self.where(plan.target, plan.rid) == "queued" else "cancel_before_headers"
                request.cancel()
                try:
                    response = await request
                except asyncio.CancelledError:
                    self.figures.cancels[kind] += 1
                    await self.released(plan.target, plan.rid, kind)
                    return f"cancelled:{kind}"
                response.close()
                self.figures.cancels["cancel_too_late"] += 1
                return "cancelled:too_late"
            self.figures.cancels["cancel_too_late"] += 1
        try:
            response = await request
        except (aiohttp.ClientError, OSError) as exc:
            return f"bad_no_response:{type(exc).__name__}:{exc}"
        async with response:
            if "X-Slotproxy-Queue-Ms" not in response.headers:
                self.figures.missing_queue_ms.append(f"{plan.rid} status={response.status}")
            if response.status != 200:
                try:
                    body = await response.read()
                except aiohttp.ClientError as exc:
                    return f"bad_error_read_{response.status}:{type(exc).__name__}"
                return error_outcome(response.status, body)
            if plan.cancel in ("cancel_first_byte", "cancel_mid_stream"):
                wanted = 1 if plan.cancel == "cancel_first_byte" else plan.mid_chunks
                got = 0
                try:
                    while got < wanted and await response.content.readany():
                        got += 1
                except aiohttp.ClientError:
                    pass
                response.close()
                self.figures.cancels[plan.cancel] += 1
                await self.released(plan.target, plan.rid, plan.cancel)
                return f"cancelled:{plan.cancel}"
            try:
                body = await response.read()
            except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError):
                return "cut"
            except aiohttp.ClientError as exc:
                return f"bad_read:{type(exc).__name__}:{exc}"
            return full_relay(plan, body)

    # -- reloads, admin changes, upstream knobs --
    async def reloader(self, rng: random.Random, path: Path, watcher: ConfigWatcher) -> None:
        limits: dict[str, int | str] = {t.name: t.reload_limits[0] for t in self.targets}
        while True:
            await asyncio.sleep(rng.uniform(0.4, 2.5))
            if self.loop.time() >= self.stop_at:
                return
            starred = rng.sample(list(WORKSPACES), rng.randint(0, 2))
            mode = rng.choices(("file+reload", "file+poll", "apply", "invalid"), weights=(3, 3, 3, 1))[0]
            if mode == "invalid":
                path.write_text(config_text(self.targets, {**limits, self.targets[0].name: -1}, starred))
                before = [t.limiter.limit for t in self.targets]
                assert not watcher.reload("chaos: invalid edit"), "an invalid config was accepted"
                assert self.proxy.state.config_error is not None
                assert [t.limiter.limit for t in self.targets] == before, "a refused reload changed a limit"
                self.figures.reloads["invalid_refused"] += 1
                continue
            for target in rng.sample(self.targets, rng.randint(1, len(self.targets))):
                low, high = target.reload_limits
                limits[target.name] = high if limits[target.name] == low else low
            text = config_text(self.targets, limits, starred)
            if mode == "apply":
                self.proxy.state.apply(parse_config(text))
            else:
                path.write_text(text)
                if mode == "file+reload":
                    assert watcher.reload("chaos")
            self.figures.reloads[mode] += 1

    async def admin(self, rng: random.Random) -> None:
        while True:
            await asyncio.sleep(rng.uniform(0.3, 2.0))
            if self.loop.time() >= self.stop_at:
                return
            target = rng.choice(self.targets)
            roll = rng.random()
            if roll < 0.15:
                # Reads while everything moves: the status document and the metrics render.
                async with self.session.get(f"{self.proxy.url}/_slotproxy/status") as resp:
                    assert resp.status == 200
                    names = {entry["provider"] for entry in (await resp.json())["providers"]}
                    assert names == {t.name for t in self.targets}
                async with self.session.get(f"{self.proxy.url}/metrics") as resp:
                    assert resp.status == 200
                    assert "slotproxy_in_flight" in await resp.text()
                self.figures.admin["get_status_metrics"] += 1
            elif roll < 0.6:
                limit = rng.choice(target.admin_limits)
                async with self.session.put(f"{self.proxy.url}/_slotproxy/providers/{target.name}/limit",
                                            json={"limit": limit}) as resp:
                    assert resp.status == 200, await resp.text()
                    await resp.read()
                self.figures.admin["http_put_limit"] += 1
            elif roll < 0.82:
                self.proxy.state.backend.set_limit(target.name, rng.choice(target.admin_limits))
                self.figures.admin["backend_set_limit"] += 1
            else:
                method = rng.choice(("PUT", "DELETE"))
                url = f"{self.proxy.url}/_slotproxy/workspaces/{rng.choice(WORKSPACES)}/star"
                async with self.session.request(method, url) as resp:
                    assert resp.status in (200, 404), await resp.text()
                    await resp.read()
                self.figures.admin[f"star_{method.lower()}"] += 1

    async def knobs(self, rng: random.Random) -> None:
        """The fakes' counter lag and stated Retry-After move while the clients run."""
        while True:
            await asyncio.sleep(rng.uniform(1.0, 4.0))
            if self.loop.time() >= self.stop_at:
                return
            for target in self.targets:
                target.upstream.fake.lag_ms = rng.choice(target.lags_ms)
                target.upstream.fake.retry_after = rng.choice((0.1, 0.2, 0.3, 0.5))
            self.figures.knob_changes += 1


def report(figures: Figures, targets: list[Target], extra: dict[str, Any]) -> str:
    durations = sorted(figures.durations) or [0.0]
    lines = [
        f"chaos: seed={SEED} seconds={SECONDS:g} clients={CLIENTS}",
        f"  requests={figures.requests} (stream {figures.streams}, non-stream {figures.non_streams})",
        f"  faults: {dict(sorted(figures.faults.items()))}",
        f"  fault kinds injected (not 'none'): {sum(1 for k, v in figures.faults.items() if k != 'none' and v)}",
        f"  cancels: {dict(sorted(figures.cancels.items()))}",
        f"  outcomes: {dict(sorted(figures.outcomes.items()))}",
        (f"  reloads: {dict(sorted(figures.reloads.items()))}; admin: {dict(sorted(figures.admin.items()))}; "
        f"upstream knob changes (lag, retry_after): {figures.knob_changes}"),
        *(target.line() for target in targets),
        (f"  request time: p50={durations[len(durations) // 2]:.2f}s max={durations[-1]:.2f}s "
        f"(hang bound {HANG_BOUND:g}s); sampler ticks={figures.samples}"),
        (f"  violations={len(figures.violations)} hangs={len(figures.hangs)} unexpected={len(figures.unexpected)} "
        f"slow releases={len(figures.slow_releases)} missing X-Slotproxy-Queue-Ms={len(figures.missing_queue_ms)} "
        f"loop errors={len(figures.loop_errors)} error logs={len(figures.error_logs)}"),
    ]
    lines += [f"  {key}: {value}" for key, value in extra.items()]
    return "\n".join(lines)


async def test_chaos(start_upstream, start_proxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLOTPROXY_ADMIN_TOKEN", raising=False)
    rng = random.Random(SEED)
    loop = asyncio.get_running_loop()
    figures = Figures()
    previous_handler = loop.get_exception_handler()

    def on_loop_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        figures.loop_errors.append(f"{context.get('message')}: {context.get('exception')!r}")

    loop.set_exception_handler(on_loop_error)
    log_handler = ErrorLogs(figures.error_logs)
    logging.getLogger().addHandler(log_handler)
    watcher: ConfigWatcher | None = None
    background: list[asyncio.Task[None]] = []
    try:
        plain = Target("openai", await start_upstream(cap=CAP, chunks=5, delay_ms=10, lag_ms=20, retry_after=0.2),
                       WINDOW, lagged_bound=False, reload_limits=(3, 5), admin_limits=(2, 3, 4, 5),
                       lags_ms=(0, 0, 20, 40, 80))
        gated = Target("gated", await start_upstream(cap=4, chunks=5, delay_ms=10, lag_ms=100, retry_after=0.2),
                       GATED_WINDOW, lagged_bound=True, reload_limits=(2, 3), admin_limits=(1, 2, 3),
                       lags_ms=GATED_LAGS_MS)
        targets = [plain, gated]
        text = config_text(targets, {t.name: t.reload_limits[0] for t in targets}, ["release-team"])
        path = tmp_path / "slotproxy.yaml"
        path.write_text(text)
        proxy = await start_proxy(text)
        watcher = ConfigWatcher(proxy.state, str(path), interval=0.2)

        await asyncio.sleep(0)
        tasks_before = len(asyncio.all_tasks())
        names_before = task_names()
        live_before = sum(1 for state in tcp_sockets().values() if state != "0A")
        session = aiohttp.ClientSession(auto_decompress=False, connector=aiohttp.TCPConnector(limit=0))
        chaos = Chaos(targets, proxy, session, figures)
        # Warm up (imports, pools, caches) so that the memory baseline is the steady state's start.
        for target in targets:
            for _ in range(10):
                async with session.post(f"{proxy.url}/{target.name}/chat/completions",
                                        json={"model": "fake", "stream": True, "messages": []}) as resp:
                    assert resp.status == 200
                    await resp.read()
        gc.collect()
        rss_before = vm_rss_kib()

        for target in targets:
            chaos.instrument(target)
        watcher.start()
        background = [asyncio.create_task(chaos.sampler())]
        helpers = [
            asyncio.create_task(chaos.reloader(random.Random(rng.random()), path, watcher)),
            asyncio.create_task(chaos.admin(random.Random(rng.random()))),
            asyncio.create_task(chaos.knobs(random.Random(rng.random()))),
        ]
        # A quarter of the clients go through the usage-gated provider.
        clients = [asyncio.create_task(chaos.client(i, gated if i % 4 == 3 else plain, random.Random(rng.random())))
                   for i in range(CLIENTS)]
        try:
            await asyncio.gather(*clients, *helpers)
        except BaseException:
            for task in (*clients, *helpers):
                task.cancel()
            await asyncio.gather(*clients, *helpers, return_exceptions=True)
            raise
        run_seconds = loop.time() - (chaos.stop_at - SECONDS)

        # ---- the drain ----
        def idle() -> bool:
            return all(t.limiter.in_flight == 0 and t.limiter.queued == 0 and t.upstream.fake.active == 0
                       and t.real_active == 0 for t in targets)

        try:
            await wait_until(idle, timeout=5, what="in_flight 0, queued 0, upstreams idle")
        except AssertionError:
            pass
        statuses = {t.name: proxy.status(t.name) for t in targets}
        # Internals, read only: no lease object left behind, no request still counted as active
        # (a leak there would make a graceful shutdown wait for its whole grace period).
        leases_left = {t.name: len(getattr(t.limiter, "_active", ())) for t in targets}
        active_requests = proxy.state.active_requests
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await watcher.stop()
        watcher = None
        await session.close()

        # Upstream connections still checked out of the proxy's pool would be a leak
        # (aiohttp internals, read only). Then the pool itself is closed so that the socket
        # and task counts can be compared with the baseline taken before it existed.
        acquired = sum(len(getattr(s.connector, "_acquired", ()) or ())
                       for s in proxy.state.upstreams._sessions.values() if s.connector is not None)
        await proxy.state.close()

        def live_sockets() -> dict[str, str]:
            return {inode: state for inode, state in tcp_sockets().items() if state != "0A"}

        try:
            await wait_until(lambda: len(asyncio.all_tasks()) <= tasks_before and len(live_sockets()) <= live_before,
                             timeout=5, what="tasks and sockets back to the baseline")
        except AssertionError:
            pass
        tasks_after = len(asyncio.all_tasks())
        extra_tasks = task_names() - names_before
        live_after = live_sockets()
        gc.collect()
        rss_after = vm_rss_kib()

        extra = {
            "run": f"{run_seconds:.1f}s",
            "after drain": "; ".join(
                f"{name}: in_flight={s['in_flight']} queued={s['queued']} limit={s['limit']}"
                for name, s in statuses.items())
                + "; upstream active=" + ",".join(f"{t.upstream.fake.active}/{t.real_active}" for t in targets),
            "leaks": f"leases left={leases_left}, requests still active={active_requests}, "
                     f"tasks {tasks_before}->{tasks_after} (extra {dict(extra_tasks)}), "
                     f"tcp sockets (not listening) {live_before}->{len(live_after)}, "
                     f"upstream connections still acquired={acquired}",
            "memory": f"VmRSS {rss_before / 1024:.1f} MiB -> {rss_after / 1024:.1f} MiB "
                      f"({(rss_after - rss_before) / 1024:+.1f} MiB); every ~10 s during the run (MiB): "
                      + " ".join(f"{kib / 1024:.1f}" for kib in figures.rss_trace),
            "proxy counters": "; ".join(f"{t.name}: {proxy.state.backend.provider_status(t.name).counters}"
                                        for t in targets),
        }
        print("\n" + report(figures, targets, extra))
        for name, items in (("violation", figures.violations), ("hang", figures.hangs),
                            ("unexpected", figures.unexpected), ("slow release", figures.slow_releases),
                            ("missing queue ms", figures.missing_queue_ms), ("loop error", figures.loop_errors),
                            ("error log", figures.error_logs)):
            for item in items[:10]:
                print(f"  {name}: {item}")

        # ---- the invariants ----
        for name, s in statuses.items():
            assert s["in_flight"] == 0 and s["queued"] == 0, (name, s)
        assert all(t.upstream.fake.active == 0 and t.real_active == 0 for t in targets)
        assert not any(leases_left.values()) and active_requests == 0, (leases_left, active_requests)
        assert not figures.violations, figures.violations[:5]
        assert not figures.hangs, figures.hangs[:5]
        assert not figures.unexpected, figures.unexpected[:5]
        assert not figures.slow_releases, figures.slow_releases[:5]
        assert not figures.missing_queue_ms, figures.missing_queue_ms[:5]
        assert acquired == 0
        assert tasks_after <= tasks_before, dict(extra_tasks)
        assert len(live_after) <= live_before, live_after
        assert rss_after - rss_before <= RSS_MARGIN_KIB
        assert not figures.loop_errors, figures.loop_errors[:5]
        assert not figures.error_logs, figures.error_logs[:5]
        assert sum(1 for kind, count in figures.faults.items() if kind != "none" and count) >= 5
        for kind in ("cancel_queued", "cancel_first_byte", "cancel_mid_stream"):
            assert figures.cancels[kind] > 0, f"no {kind} this run"
        assert figures.reloads and figures.admin
        assert figures.outcomes["full"] > figures.requests // 5, "too few full relays: the run measured nothing"
        assert gated.cap_429s == 0, "the usage gate let the gated upstream reach its cap"
    finally:
        for task in background:
            task.cancel()
        if watcher is not None:
            await watcher.stop()
        logging.getLogger().removeHandler(log_handler)
        loop.set_exception_handler(previous_handler)


# ----- bugs the chaos work found, reduced to deterministic tests -------------------------


async def _split_body_upstream(status: int, body: bytes, gap: float = 0.2) -> tuple[Any, int]:
    """An upstream that answers ``status`` with ``body`` sent in two writes ``gap`` seconds apart,
    as a real provider behind a CDN or a streaming server may do."""
    from aiohttp import web

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(status=status, headers={"Content-Type": "application/json"})
        await response.prepare(request)
        await response.write(body[:40])
        await asyncio.sleep(gap)
        await response.write(body[40:])
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    return await serve_app(app)


_QUOTA_BODY = json.dumps({"error": {
    "message": "You exceeded your current quota, please check your plan and billing details.",
    "type": "insufficient_quota", "code": "insufficient_quota"}}).encode()


async def test_bug_quota_429_in_two_pieces_is_relayed_whole_and_neither_pauses_nor_reduces(start_proxy,
                                                                                           client) -> None:
    runner, port = await _split_body_upstream(429, _QUOTA_BODY)
    try:
        proxy = await start_proxy(f"state: {{path: null}}\nproviders:\n  openai: {{upstream: "
                                  f"'http://127.0.0.1:{port}/v1', limit: 4, retry_on_429: 0}}\n")
        async with client.post(f"{proxy.url}/openai/chat/completions", json={"model": "m"}) as resp:
            assert resp.status == 429
            assert await resp.read() == _QUOTA_BODY
        status = proxy.status()
        assert (status["paused"], status["limit"], status["auto_reduced"]) == (False, 4, False)
    finally:
        await runner.cleanup()


def test_bug_unrelated_reload_does_not_postpone_recovery() -> None:
    from proxy.backends import MemoryBackend
    from proxy.limiter import FakeClock, LimiterSettings

    clock = FakeClock()
    backend = MemoryBackend(clock=clock)
    settings = {"openai": LimiterSettings(limit=4, default_pause=1.0, recovery_after=10.0)}
    backend.configure(settings, frozenset())
    backend.report_backoff("openai", "429", None, sent_at=clock.time())
    assert backend.provider_status("openai").limit == 3
    clock.advance(9.0)
    backend.configure(settings, frozenset({"release-team"}))  # a reload that only stars a workspace
    clock.advance(1.5)  # 10.5 s since the only backoff
    assert backend.provider_status("openai").limit == 4


async def _gzip_error_upstream(status: int, body: bytes) -> tuple[Any, int]:
    """An upstream that gzips its error answer when the client accepts gzip (as Google's front ends do)."""
    import gzip

    from aiohttp import web

    async def handler(request: web.Request) -> web.Response:
        await request.read()
        headers = {"Content-Type": "application/json"}
        data = body
        if "gzip" in request.headers.get("Accept-Encoding", ""):
            data, headers["Content-Encoding"] = gzip.compress(body), "gzip"
        return web.Response(status=status, body=data, headers=headers)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    return await serve_app(app)


_GEMINI_RETRY_BODY = json.dumps({"error": {
    "code": 429, "message": "Resource has been exhausted.", "status": "RESOURCE_EXHAUSTED",
    "details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "45.8s"}]}}).encode()


@pytest.mark.parametrize("body", [_GEMINI_RETRY_BODY, _QUOTA_BODY], ids=["gemini_retry_delay", "insufficient_quota"])
async def test_bug_gzip_encoded_429_body_is_classified(start_proxy, client, body: bytes) -> None:
    runner, port = await _gzip_error_upstream(429, body)
    try:
        proxy = await start_proxy(f"state: {{path: null}}\nproviders:\n  openai: {{upstream: "
                                  f"'http://127.0.0.1:{port}/v1', limit: 4, retry_on_429: 0, default_pause: 2s}}\n")
        async with client.post(f"{proxy.url}/openai/chat/completions", json={"model": "m"},
                               headers={"Accept-Encoding": "gzip, deflate"}) as resp:
            assert resp.status == 429
            assert resp.headers.get("Content-Encoding") == "gzip"  # relayed as is: right
            await resp.read()
        status = proxy.status()
        if body is _QUOTA_BODY:
            assert (status["paused"], status["limit"]) == (False, 4)
        else:
            assert status["paused_until"] is not None
            assert status["paused_until"] / 1000 - time.time() > 40  # the stated 45.8 s, not default_pause 2 s
    finally:
        await runner.cleanup()
