"""The policy in Python and the policy in Lua, held together: one table of event sequences, two backends.

Each scenario is run on the memory backend over a fake clock (the policy applied
directly) and on the Redis backend against a real Redis (the Lua scripts, real
time, short waits). After each checkpoint both status objects are compared field
by field, counters included, and the fields the scenario names are pinned to
literal values, notice texts included. Rejections are compared by type and by
the Retry-After header they would carry.

The rules compared: admission at the limit, the same-burst rule, one reduction
per burst, recovery steps and their notices, pause lengths (stated and default),
release cooldown, queue timeouts and queue-full (counted, with the pause-aware
hint), queue order (starred, prompt start in whole ms, then arrival), the
queue listing's length, and the nested limits: key choice (stickiness, then
the most free slots, ties in config order), a backoff on one key, every key
paused, model caps, budget holds and ``max_share``; and the token windows' bucket math and limits rule
(``window.Bucket`` and ``WindowBook.limits_for`` against the functions of ``lua_windows``, on given times).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from proxy.backends import MemoryBackend
from proxy.backends.redis import RedisBackend
from proxy.errors import ProxyError
from proxy.limiter import (
    QUEUE_LISTED,
    FakeClock,
    KeySettings,
    LimiterSettings,
    ModelCap,
    Priority,
    SlotLease,
)
from proxy.limiter import Budget as LimitBudget

from .conftest import REDIS_URL, require_redis

pytestmark = pytest.mark.asyncio

T0 = 1_800_000_000.0
P = "p"


# --- the two sides -----------------------------------------------------------------


@dataclass
class Side:
    name: str
    backend: Any
    base: float
    clock: FakeClock | None = None
    leases: dict[str, SlotLease] = field(default_factory=dict)
    waiting: dict[str, asyncio.Task[SlotLease]] = field(default_factory=dict)
    rejected: dict[str, tuple[str, int | None]] = field(default_factory=dict)
    picked: dict[str, str | None] = field(default_factory=dict)

    def now(self) -> float:
        return self.clock.time() if self.clock is not None else time.time()

    async def settle(self) -> None:
        await self.backend.flush()
        for _ in range(5):
            await asyncio.sleep(0)
        for name, task in list(self.waiting.items()):
            if task.done():
                del self.waiting[name]
                error = task.exception()
                if error is None:
                    self.leases[name] = task.result()
                else:
                    assert isinstance(error, ProxyError), error
                    retry = None if error.retry_after is None else max(1, math.ceil(error.retry_after))
                    self.rejected[name] = (type(error).__name__, retry)

    async def advance(self, seconds: float) -> None:
        if self.clock is not None:
            self.clock.advance(seconds)
        else:
            await asyncio.sleep(seconds)
        await self.settle()

    async def status(self) -> dict[str, Any]:
        await self.settle()
        await self.backend.refresh()
        status = self.backend.provider_status(P)
        doc = status.to_dict()
        doc.pop("local_in_flight", None)
        doc["paused_until"] = doc["paused_until"] is not None
        base_ms = math.floor(self.base * 1000)
        doc["queue"] = [{**w, "prompt_started_at": w["prompt_started_at"] - base_ms, "waited_ms": None}
                        for w in doc["queue"]]
        doc["holders"] = [{**h, "granted_at": None, "held_ms": None} for h in doc["holders"]]
        doc["counters"] = dict(status.counters)
        for key in doc["keys"]:
            key["paused_until"] = key["paused_until"] is not None
            if "budget" in key:
                key["budget"] = {**key["budget"], "reset_at": key["budget"]["reset_at"] is not None,
                                 "held_until": key["budget"]["held_until"] is not None}
        return doc


async def memory_side() -> Side:
    clock = FakeClock(T0)
    return Side("memory", MemoryBackend(clock), T0, clock)


async def redis_side(prefix: str) -> Side:
    require_redis()
    backend = RedisBackend(REDIS_URL, key_prefix=prefix, lease_ttl=2.0)
    await backend.start()
    return Side("redis", backend, time.time())


# --- steps ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Configure:
    settings: dict[str, Any]


@dataclass(frozen=True)
class Acquire:
    """A request arrives, its prompt ``age`` seconds older than the side's start (a whole ms), starred or not."""

    name: str
    age: float = 0.0
    starred: bool = False
    workspace: str = "default"
    client_wait: float | None = None
    model: str | None = None
    conversation: str | None = None
    key: str | None = None
    """The pool key it must be granted on (a WebSocket's response)."""
    transport: str = "http"


@dataclass(frozen=True)
class PickKey:
    """A WebSocket opens: the key its upstream socket would open with, kept as ``name``."""

    name: str
    conversation: str | None = None


@dataclass(frozen=True)
class Release:
    name: str


@dataclass(frozen=True)
class Backoff:
    """An upstream backoff; on the key ``sent_by``'s lease was taken on, when it has one."""

    cause: str
    wait: float | None
    sent_by: str | None = None
    reduce: bool = True


@dataclass(frozen=True)
class SpentBudget:
    """The answer on ``sent_by``'s key said its requests are spent until ``reset`` seconds from now."""

    sent_by: str
    reset: float
    tokens: int = 1000


@dataclass(frozen=True)
class SetKeyLimit:
    key: str
    limit: int | None


@dataclass(frozen=True)
class Granted:
    """``name`` holds a slot on ``key``."""

    name: str
    key: str | None


@dataclass(frozen=True)
class SetLimit:
    limit: int | None


@dataclass(frozen=True)
class Advance:
    seconds: float


@dataclass(frozen=True)
class Expect:
    """Compare both sides; ``pinned`` fields must also equal these literal values."""

    pinned: dict[str, Any] = field(default_factory=dict)
    held: tuple[str, ...] | None = None
    rejected: dict[str, tuple[str, int | None]] | None = None
    keys: dict[str, str | None] = field(default_factory=dict)
    """Which key each named lease holds (checked on both)."""
    picked: dict[str, str | None] = field(default_factory=dict)
    """Which key each ``PickKey`` chose (checked on both)."""


async def apply(side: Side, step: Any, prefix_settings: dict[str, Any]) -> None:
    backend = side.backend
    if isinstance(step, Configure):
        backend.configure({P: LimiterSettings(**{**prefix_settings, **step.settings})}, frozenset())
    elif isinstance(step, Acquire):
        started = math.floor(side.base * 1000) / 1000 - step.age
        priority = Priority(prompt_started_at=started, workspace=step.workspace, starred=step.starred,
                            conversation=step.conversation, transport=step.transport)
        before = await _queued(side)
        side.waiting[step.name] = asyncio.create_task(backend.acquire(P, priority, client_wait=step.client_wait,
                                                                      model=step.model, key=step.key))
        for _ in range(200):  # granted, rejected or queued before the next step: arrival order is the steps'
            await side.settle()
            if step.name not in side.waiting or await _queued(side) > before:
                break
            await asyncio.sleep(0.01)
    elif isinstance(step, PickKey):
        side.picked[step.name] = await backend.socket_key(P, step.conversation)
    elif isinstance(step, Release):
        side.leases.pop(step.name).release()
    elif isinstance(step, Backoff):
        sent_at = side.leases[step.sent_by].granted_at if step.sent_by else side.now()
        key = side.leases[step.sent_by].key if step.sent_by else None
        backend.report_backoff(P, step.cause, step.wait, sent_at, reduce=step.reduce, key=key)
    elif isinstance(step, SpentBudget):
        reset = side.now() + step.reset
        backend.report_budget(P, LimitBudget(remaining_requests=0, remaining_tokens=step.tokens, reset_at=reset,
                                             held_until=reset), side.leases[step.sent_by].key)
    elif isinstance(step, SetKeyLimit):
        backend.set_key_limit(P, step.key, step.limit)
    elif isinstance(step, SetLimit):
        backend.set_limit(P, step.limit)
    elif isinstance(step, Advance):
        await side.advance(step.seconds)
    await side.settle()


async def _queued(side: Side) -> int:
    await side.backend.refresh()
    return side.backend.provider_status(P).queued


async def run(scenario: list[Any], prefix: str, base_settings: dict[str, Any] | None = None) -> None:
    settings = {"slot_timeout": None, "default_pause": 30.0, **(base_settings or {})}
    sides = [await memory_side(), await redis_side(prefix)]
    try:
        for number, step in enumerate(scenario):
            if isinstance(step, Expect):
                await expect(sides, step, number)
                continue
            await asyncio.gather(*(apply(side, step, settings) for side in sides))
    finally:
        await close(sides)


async def close(sides: list[Side]) -> None:
    for side in sides:
        for task in side.waiting.values():
            task.cancel()
        await asyncio.gather(*side.waiting.values(), return_exceptions=True)
        for lease in side.leases.values():
            lease.release()
        await side.backend.close()


async def expect(sides: list[Side], step: Expect, number: int) -> None:
    """Memory answers at once; Redis may need a renew round for a grant to land: poll it a little."""
    memory, redis_ = sides
    def on_keys(side: Side) -> bool:
        return all(name in side.leases and side.leases[name].key == key for name, key in step.keys.items())

    assert on_keys(memory), f"step {number}: memory keys {[(n, lease.key) for n, lease in memory.leases.items()]}"
    for name, key in step.picked.items():
        assert memory.picked[name] == redis_.picked[name] == key, \
            f"step {number}: {name} picked {memory.picked[name]!r} (memory), {redis_.picked[name]!r} (redis)"
    wanted = await memory.status()
    for key, value in step.pinned.items():
        assert wanted[key] == value, f"step {number}: memory {key} = {wanted[key]!r}, pinned {value!r}"
    if step.held is not None:
        assert sorted(memory.leases) == sorted(step.held), f"step {number}: memory holds {sorted(memory.leases)}"
    if step.rejected is not None:
        assert memory.rejected == step.rejected, f"step {number}: memory rejected {memory.rejected}"
    got: dict[str, Any] = {}
    for _ in range(60):
        got = await redis_.status()
        same = got == wanted and (step.held is None or sorted(redis_.leases) == sorted(step.held)) \
            and (step.rejected is None or redis_.rejected == step.rejected) and on_keys(redis_)
        if same:
            return
        await asyncio.sleep(0.05)
    diff = {k: (wanted.get(k), got.get(k)) for k in set(wanted) | set(got) if wanted.get(k) != got.get(k)}
    raise AssertionError(f"step {number}: memory and redis differ (memory, redis): {diff}; "
                         f"held {sorted(memory.leases)} vs {sorted(redis_.leases)}; "
                         f"rejected {memory.rejected} vs {redis_.rejected}")


def notice_reduced(limit: int, cause: str) -> str:
    return f"Concurrency limit auto-reduced to {limit} after a {cause} — restore manually when ready."


# --- the table -----------------------------------------------------------------------

POOL = (KeySettings("a", 2), KeySettings("b", 2))

SCENARIOS: dict[str, tuple[list[Any], dict[str, Any]]] = {
    "admission at the limit, then a release hands the slot on": ([
        Configure({"limit": 2}),
        Acquire("a"), Acquire("b"), Acquire("c"),
        Expect({"in_flight": 2, "queued": 1, "limit": 2, "configured_limit": 2}, held=("a", "b")),
        Release("a"),
        Expect({"in_flight": 2, "queued": 0, "counters": {"granted": 3, "queue_full": 0, "queue_timeouts": 0,
                                                          "reclaims": 0, "backoffs": 0, "auto_reductions": 0}},
               held=("b", "c")),
    ], {}),
    "one burst of 429s lowers the limit once, with the notice": ([
        Configure({"limit": 3}),
        Acquire("a"), Acquire("b"), Acquire("c"),
        Backoff("429", 0.3, "a"), Backoff("429", 0.3, "b"), Backoff("429", 0.3, "c"),
        Expect({"limit": 2, "configured_limit": 3, "auto_reduced": True, "auto_reduced_from": 3, "paused": True,
                "paused_until": True, "notice": notice_reduced(2, "429")}),
        Release("a"), Release("b"), Release("c"),
        Advance(0.4),
        Expect({"paused": False, "paused_until": False, "limit": 2}),
        Acquire("d"),
        Backoff("429", 0.2, "d"),  # granted after the reduction: a new burst
        Expect({"limit": 1, "auto_reduced_from": 3, "notice": notice_reduced(1, "429")}),
    ], {}),
    "a 429 from a request granted before the reduction extends the pause only": ([
        Configure({"limit": 4}),
        Acquire("a"), Acquire("b"),
        Backoff("429", 0.2, "a"),
        Advance(0.3),
        Backoff("529", 0.2, "b"),
        Expect({"limit": 3, "paused": True, "notice": notice_reduced(3, "429")}),
    ], {}),
    "no stated wait pauses for default_pause": ([
        Configure({"limit": 2, "default_pause": 0.3}),
        Backoff("529", None),
        Expect({"paused": True, "limit": 1, "notice": notice_reduced(1, "529")}),
        Advance(0.4),
        Expect({"paused": False}),
    ], {}),
    "an overload pauses for overload_pause and never lowers the limit": ([
        Configure({"limit": 3, "overload_pause": 0.3}),
        Acquire("a"),
        Backoff("529", None, "a", reduce=False),
        Expect({"paused": True, "limit": 3, "auto_reduced": False, "notice": None}),
        Advance(0.4),
        Expect({"paused": False}),
        Backoff("429", 0.05, "a"),  # a rate limit after the overload is a burst of its own
        Expect({"limit": 2, "notice": notice_reduced(2, "429")}),
    ], {}),
    "recovery raises the limit step by step with the policy's notice": ([
        Configure({"limit": 4, "recovery_after": 0.4}),
        Acquire("a"),
        Backoff("429", 0.05, "a"),
        Advance(0.1),
        Acquire("b"),
        Backoff("429", 0.05, "b"),
        Expect({"limit": 2, "auto_reduced_from": 4}),
        Advance(0.5),
        Expect({"limit": 3, "auto_reduced": True,
                "notice": "Concurrency limit auto-reduced, recovering: now 3 of 4 after 0.4s without a backoff."}),
        Advance(0.5),
        Expect({"limit": 4, "auto_reduced": False, "auto_reduced_from": None, "notice": None}),
    ], {}),
    "a manual limit clears the reduction": ([
        Configure({"limit": 3}),
        Backoff("429", 0.05),
        Expect({"limit": 2, "auto_reduced": True}),
        SetLimit(5),
        Expect({"limit": 5, "configured_limit": 3, "auto_reduced": False, "auto_reduced_from": None,
                "notice": None}),
    ], {}),
    "release cooldown keeps the slot counted": ([
        Configure({"limit": 1, "release_cooldown": 0.3}),
        Acquire("a"), Release("a"), Acquire("b"),
        Expect({"in_flight": 1, "queued": 1, "cooldown_ms": 300}, held=()),
        Advance(0.4),
        Expect({"in_flight": 1, "queued": 0}, held=("b",)),
    ], {}),
    "a queue timeout is counted and answered with the rest of the pause": ([
        Configure({"limit": 1, "queue_timeout": 0.3}),
        Acquire("holder"),
        Backoff("429", 5.0, "holder"),
        Acquire("late"),
        Advance(0.4),
        Expect({"queued": 0, "rejected": {"queue_full": 0, "queue_timeout": 1}},
               rejected={"late": ("QueueTimeout", 5)}),
    ], {}),
    "the client's own deadline answers before queue_timeout, counted as a queue timeout": ([
        Configure({"limit": 1, "queue_timeout": 600.0}),
        Acquire("holder"),
        Backoff("429", 4.0, "holder"),
        Acquire("sdk", client_wait=0.3), Acquire("no-time", client_wait=0.0), Acquire("patient"),
        Advance(0.4),
        Expect({"queued": 1, "rejected": {"queue_full": 0, "queue_timeout": 2}},
               rejected={"sdk": ("QueueTimeout", 4), "no-time": ("QueueTimeout", 4)}),
    ], {}),
    "queue full is counted, with the pause-aware hint": ([
        Configure({"limit": 1, "max_queue": 1}),
        Acquire("holder"),
        Backoff("429", 7.0, "holder"),
        Acquire("first"), Acquire("second"),
        Expect({"queued": 1, "rejected": {"queue_full": 1, "queue_timeout": 0}},
               rejected={"second": ("QueueFull", 7)}),
    ], {}),
    "order: starred, then the oldest prompt, ties at the same ms by arrival": ([
        Configure({"limit": 1}),
        Acquire("holder"),
        # The same millisecond; tie-2 is 0.4 ms older, but both backends compare whole ms: arrival decides.
        Acquire("tie-1", age=9.9994), Acquire("young", age=1.0), Acquire("tie-2", age=9.9998),
        Acquire("star", starred=True),
        Expect({"queued": 4}),
        Release("holder"),
        Expect(held=("star",)),
        Release("star"),
        Expect(held=("tie-1",)),
        Release("tie-1"),
        Expect(held=("tie-2",)),
    ], {}),
    "a pool: the freest key, ties in config order; a conversation keeps its key while it has room": ([
        Configure({"keys": POOL}),
        Acquire("a1", conversation="c1"), Acquire("b1"), Acquire("a2", conversation="c2"),
        Expect(held=("a1", "b1", "a2"), keys={"a1": "a", "b1": "b", "a2": "a"}),
        Release("a1"),
        Acquire("again", conversation="c1"),
        Expect(keys={"again": "a"}, pinned={"in_flight": 3, "queued": 0}),
        Acquire("last", conversation="c1"), Acquire("over"),
        Expect(keys={"last": "b"}, pinned={"in_flight": 4, "queued": 1}),
    ], {}),
    "a backoff pauses and reduces the key that got it; every key paused pauses the provider": ([
        Configure({"keys": POOL}),
        Acquire("x"), Acquire("y"),
        Expect(keys={"x": "a", "y": "b"}),
        Backoff("429", 0.5, "x"),
        Expect({"paused": False, "limit": None, "counters": {"granted": 2, "queue_full": 0, "queue_timeouts": 0,
                                                             "reclaims": 0, "backoffs": 1, "auto_reductions": 1}}),
        Acquire("z"),
        Expect(keys={"z": "b"}),
        Backoff("429", 0.5, "y"),
        Expect({"paused": True, "paused_until": True}),
        Release("x"), Release("y"), Release("z"),
        SetKeyLimit("a", 2),
        Advance(0.6),
        Expect({"paused": False}),
    ], {}),
    "a WebSocket's responses wait for its socket's key; others take any key meanwhile": ([
        Configure({"keys": POOL}),
        PickKey("first"),
        Acquire("x1", key="a"), Acquire("x2", key="a"),
        PickKey("second"),
        Acquire("ws", key="a", transport="websocket"), Acquire("http"),
        Expect({"in_flight": 3, "queued": 1}, held=("x1", "x2", "http"),
               keys={"x1": "a", "x2": "a", "http": "b"}, picked={"first": "a", "second": "b"}),
        Acquire("http-2"),
        Expect({"in_flight": 4, "queued": 1}, keys={"http-2": "b"}),
        PickKey("all-full", conversation="c9"),
        Backoff("429", 0.5, "http"),
        PickKey("b-paused"),
        Release("x1"),
        Expect({"in_flight": 4, "queued": 0}, keys={"ws": "a"}, picked={"all-full": "a", "b-paused": "a"}),
    ], {}),
    "a model cap holds its own model only": ([
        Configure({"limit": 3, "models": (ModelCap("big-*", 1),)}),
        Acquire("big", model="big-1"), Acquire("big-too", model="big-2"), Acquire("small", model="small"),
        Expect({"in_flight": 2, "queued": 1}, held=("big", "small")),
        Release("big"),
        Expect(held=("small", "big-too")),
    ], {}),
    "a spent budget holds its key, with no pause, reduction or notice": ([
        Configure({"keys": POOL, "budgets": True}),
        Acquire("first"),
        SpentBudget("first", reset=0.5),
        Release("first"),
        Acquire("second"), Acquire("third"), Acquire("fourth"),
        Expect({"paused": False, "queued": 1, "counters": {"granted": 3, "queue_full": 0, "queue_timeouts": 0,
                                                            "reclaims": 0, "backoffs": 0, "auto_reductions": 0}},
               keys={"second": "b", "third": "b"}),
        Advance(0.6),
        Expect({"queued": 0}, keys={"fourth": "a"}),
    ], {}),
    "holders granted in one instant are listed in the order they were granted": ([
        Configure({"limit": 1}),
        Acquire("h", workspace="h"),
        Acquire("w3", workspace="c", age=30), Acquire("w1", workspace="a", age=10),
        Acquire("w2", workspace="b", age=20),
        SetLimit(4),
        Expect({"in_flight": 4, "queued": 0}, held=("h", "w1", "w2", "w3")),
    ], {}),
    "max_share: a workspace at its share is passed over while another can go, else admitted": ([
        Configure({"limit": 2, "max_share": 0.5}),
        Acquire("a1", workspace="a"), Acquire("a2", workspace="a"),
        Acquire("a3", workspace="a", age=50), Acquire("b1", workspace="b"),
        Expect({"in_flight": 2, "queued": 2}),
        Release("a1"),
        Expect(held=("a2", "b1")),
        Release("a2"),
        Expect(held=("b1", "a3")),
    ], {}),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
async def test_policy_and_lua_agree(name: str, key_prefix: str) -> None:
    scenario, settings = SCENARIOS[name]
    await run(scenario, key_prefix, settings)


async def test_both_list_the_same_number_of_waiters(key_prefix: str) -> None:
    """The status listing is the policy's QUEUE_LISTED on both (the counts are always whole)."""
    waiters = QUEUE_LISTED + 5
    scenario = [Configure({"limit": 1}), Acquire("holder")]
    sides = [await memory_side(), await redis_side(key_prefix)]
    try:
        for step in scenario:
            await asyncio.gather(*(apply(side, step, {"slot_timeout": None}) for side in sides))
        for side in sides:
            for n in range(waiters):
                priority = Priority(prompt_started_at=side.base - n / 1000)
                side.waiting[f"w{n}"] = asyncio.create_task(side.backend.acquire(P, priority))
        for side in sides:
            for _ in range(200):
                doc = await side.status()
                if doc["queued"] == waiters:
                    break
                await asyncio.sleep(0.02)
            assert (doc["queued"], len(doc["queue"])) == (waiters, QUEUE_LISTED), side.name
            assert doc["queue"][0]["prompt_started_at"] == -(waiters - 1)
    finally:
        await close(sides)


# --- token windows: the bucket math and the limits rule, window.py against lua_windows -------------------

_BUCKET_DRIVER = r"""
-- ARGV: operations (JSON [[op, now_ms, x, y]...]), limit, headroom, start (ms). Returns, after each operation,
-- the level then (and for 'wait', the wait in ms first), as %.17g text.
local ops = cjson.decode(ARGV[1])
local cap = capacity(tonumber(ARGV[2]), tonumber(ARGV[3]))
local b = {hash = BASE .. 'w:probe', wid = 'probe', name = 'probe', cap = cap, level = cap, at = tonumber(ARGV[4]),
  limit = tonumber(ARGV[2])}
local out = {}
for _, op in ipairs(ops) do
  local kind, now, x, y = op[1], op[2], op[3], op[4]
  if kind == 'take' then bucket_take(b, x, now)
  elseif kind == 'give' then bucket_give(b, x, now)
  elseif kind == 'empty_until' then bucket_empty_until(b, x, now, y)
  elseif kind == 'correct' then bucket_correct(b, x - bucket_taken_since(b, y), op[5], now)
  elseif kind == 'set_limit' then bucket_set_limit(b, x, y, now)
  elseif kind == 'wait' then table.insert(out, f17(bucket_wait(b, x, now))) end
  table.insert(out, f17(bucket_level(b, now)))
end
return out
"""

_LIMITS_DRIVER = r"""
-- ARGV: learned (JSON [[key, group, window, limit]...]), then (key, group) pairs. Returns each pair's limits
-- as JSON {window: [limit, source]}.
for _, entry in ipairs(cjson.decode(ARGV[1])) do
  redis.call('HSET', BASE .. 'wlearn', entry[1] .. '\n' .. entry[2] .. '\n' .. entry[3], entry[4])
end
local out = {}
for i = 2, #ARGV, 2 do table.insert(out, cjson.encode(window_limits(ARGV[i], ARGV[i + 1]))) end
return out
"""

_BUCKET_OPS: list[tuple[Any, ...]] = [
    ("take", 0.0, 500.0), ("wait", 0.0, 300.0), ("wait", 10.0, 300.0), ("take", 20.5, 333.25),
    ("give", 21.0, 50.0), ("wait", 21.0, 5000.0), ("correct", 22.0, 100.0, 20.0, 0.0), ("take", 22.5, 10.0),
    ("correct", 23.0, 200.0, 22.25, 0.0), ("correct", 23.5, 150.0, 23.0, 30.0), ("take", 23.75, 5.0),
    ("correct", 23.875, 400.0, 23.5, 30.0), ("set_limit", 24.0, 1200.0, 0.05), ("wait", 24.0, 700.0),
    ("empty_until", 25.0, 40.0), ("wait", 30.0, 10.0), ("take", 41.0, 2000.0), ("set_limit", 42.0, 300.0, 0.0),
    ("wait", 42.0, 299.0), ("give", 200.0, 10.0), ("take", 200.125, 0.1), ("wait", 200.125, 600.0),
    ("empty_until", 201.0, 230.0, 250.0), ("wait", 205.0, 1.0), ("wait", 205.0, 260.0), ("take", 206.0, 0.5),
    ("correct", 210.0, 20.0, 209.0, 0.0), ("wait", 211.0, 100.0), ("empty_until", 212.0, 220.0, 1e300),
    ("wait", 231.0, 300.0), ("empty_until", 240.0, 250.0, 1e300), ("wait", 241.0, 300.0), ("take", 250.0, 300.0),
]


def _python_bucket(ops: list[tuple[Any, ...]], limit: float, headroom: float) -> list[tuple[str, float]]:
    """Each operation's outputs on ``window.Bucket``: ("wait", seconds) for a wait, then ("level", tokens)."""
    from proxy.limiter.window import Bucket

    bucket = Bucket(limit, T0, headroom)
    out: list[tuple[str, float]] = []
    for kind, at, *rest in ops:
        now = T0 + at
        if kind == "take":
            bucket.take(rest[0], now)
        elif kind == "give":
            bucket.give(rest[0], now)
        elif kind == "empty_until":
            bucket.empty_until(T0 + rest[0], now, *rest[1:])
        elif kind == "correct":
            bucket.correct(rest[0] - bucket.taken_since(T0 + rest[1]), now, rest[2])
        elif kind == "set_limit":
            bucket.set_limit(rest[0], rest[1], now)
        elif kind == "wait":
            out.append(("wait", bucket.wait_for(rest[0], now)))
        out.append(("level", bucket.level(now)))
    return out


def _lua_ops(ops: list[tuple[Any, ...]]) -> list[list[float]]:
    """The same operations in the scripts' units: times in ms (an empty_until's and a correct's time too)."""
    lua = []
    for kind, at, *rest in ops:
        args = list(rest)
        if kind == "empty_until":
            args[0] = (T0 + args[0]) * 1000
        elif kind == "correct":
            args[1] = (T0 + args[1]) * 1000
        lua.append([kind, (T0 + at) * 1000, *args])
    return lua


async def _eval(prefix: str, driver: str, *args: Any) -> list[str]:
    import redis.asyncio as aioredis

    from proxy.backends.redis.lua_prelude import PRELUDE

    require_redis()
    client = aioredis.Redis.from_url(REDIS_URL)
    base = f"{{{prefix}:p}}:"
    keys = [base + part for part in ("cfg", "leases", "cooling", "waiters", "winfo", "whb", "granted", "seq", "stars")]
    try:
        return [text.decode() for text in await client.eval(PRELUDE + driver, len(keys), *keys, *args)]
    finally:
        await client.aclose()


@pytest.mark.parametrize(("limit", "headroom"), [(600.0, 0.0), (1000.0, 0.1)])
async def test_the_window_bucket_math_is_the_same_in_lua(limit: float, headroom: float, key_prefix: str) -> None:
    """Levels and waits after each operation of one sequence: take, give, wait_for (an amount above the whole
    window too), correct less what was taken since, set_limit up and down, empty_until and the debt of an
    oversize take; Lua in ms, Python in seconds."""
    import json

    expected = _python_bucket(_BUCKET_OPS, limit, headroom)
    got = await _eval(key_prefix, _BUCKET_DRIVER, json.dumps(_lua_ops(_BUCKET_OPS)), limit, headroom, T0 * 1000)
    assert len(got) == len(expected)
    assert any(kind == "wait" and value > 0 for kind, value in expected)
    for index, (lua_text, (kind, python_value)) in enumerate(zip(got, expected, strict=True)):
        lua_value = float(lua_text) / 1000 if kind == "wait" else float(lua_text)
        assert lua_value == pytest.approx(python_value, rel=1e-9, abs=1e-6), (index, kind, lua_text, python_value)


async def test_the_window_limits_rule_is_the_same_in_lua(key_prefix: str) -> None:
    """Config (the provider's, overridden by the model pattern's, then the key's) and learned limits, the
    smaller holding when both give one, and the source of each, as ``WindowBook.limits_for`` finds them."""
    import json

    from proxy.backends.redis.arguments import windows_arg
    from proxy.limiter.window import WindowBook, WindowSettings

    settings = WindowSettings(provider={"input_tokens_per_minute": 600, "requests_per_minute": 50},
                              models={"claude-opus-*": {"input_tokens_per_minute": 200}},
                              keys={"a": {"requests_per_minute": 20}}, learn=True, headroom=0.05)
    learned = [["a", "claude-opus-*", "input_tokens_per_minute", 150], ["", "other", "tokens_per_minute", 900],
               ["a", "other", "requests_per_minute", 40], ["", "claude-opus-*", "output_tokens_per_minute", 70]]
    pairs = [("", "other"), ("a", "other"), ("a", "claude-opus-*"), ("", "claude-opus-*"), ("b", "sonnet")]
    book = WindowBook(settings)
    for key, group, window, limit in learned:
        book.learn(key or None, group, window, limit)
    require_redis()
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    client.hset(f"{{{key_prefix}:p}}:cfg", "windows", windows_arg(LimiterSettings(windows=settings)))
    client.close()
    got = await _eval(key_prefix, _LIMITS_DRIVER, json.dumps(learned), *(part for pair in pairs for part in pair))
    for (key, group), raw in zip(pairs, got, strict=True):
        lua = {window: (limit, source) for window, (limit, source) in json.loads(raw).items()}
        python = {window: (limit, book.source(key or None, group, window))
                  for window, limit in book.limits_for(key or None, group).items()}
        assert lua == python, (key, group)
