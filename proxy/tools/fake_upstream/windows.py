"""The providers' per-minute windows, as the fake enforces them (``itpm``, ``otpm``, ``tpm``, ``rpm``).

Each window is a token bucket per API key and model (the request's ``model``):
its capacity is the per-minute limit, it starts full and refills continuously
at limit/60 per second. Anthropic's route (``/v1/messages``) is held by the
input, output and request windows, the OpenAI routes by the tokens and request
windows; a window that does not apply to a route is not charged by it.

A request's input tokens are counted from its text: its blocks, in cache
order (``tools``, ``system``, ``instructions``, then ``messages``, ``input``
or ``prompt``; each message's content parts), each worth ``ceil(UTF-8 bytes /
4)`` of its ``text`` (a block without text: of its compact JSON, without
``cache_control``), at least 1 in all. A Responses API request continuing a
response (``previous_response_id``) also counts that response's input and
output, as OpenAI charges the whole conversation.

What each window charges, from the usage the answer reports (``x-fake-usage``
overrides it, and so what is charged):

- ``input_tokens_per_minute`` (Anthropic ITPM): the input less the cache
  reads (cache writes count), taken when the request is admitted;
- ``output_tokens_per_minute`` (Anthropic OTPM): admitted while the bucket
  holds at least one token; the output produced is taken when the answer
  ends, so the bucket may go below zero;
- ``tokens_per_minute`` (OpenAI TPM): the larger of the request's maximum
  output (``max_tokens``, ``max_completion_tokens``, ``max_output_tokens``)
  and its input, taken when admitted; when the answer ends, the input and
  output beyond that are taken too (nothing is given back);
- ``requests_per_minute``: 1 when admitted.

A request whose charge exceeds what a bucket holds is refused (429) with the
wait until it would fit; one above a bucket's whole capacity never fits and is
refused with the wait until the bucket is full.

Anthropic prompt caching is simulated per key and model: a request's blocks
ending at a ``cache_control`` breakpoint form a prefix that is remembered for 5
minutes (``"ttl": "1h"``: an hour) once the request is admitted. The longest
remembered prefix ending at or before the request's last breakpoint (blocks
compared without ``cache_control``) is read from the cache (its lifetime
renewed); what lies between it and the last breakpoint is written. There is no
minimum cacheable length. Without a window, none of this applies (the input is
the body's size // 4, nothing is cached).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "INPUT",
    "OUTPUT",
    "REQUESTS",
    "TOKENS",
    "WINDOW_NAMES",
    "Bucket",
    "Counted",
    "Plan",
    "Reading",
    "Refusal",
    "TokenWindows",
    "count_text",
    "request_blocks",
]

INPUT = "input_tokens_per_minute"
OUTPUT = "output_tokens_per_minute"
TOKENS = "tokens_per_minute"
REQUESTS = "requests_per_minute"
WINDOW_NAMES = (INPUT, OUTPUT, TOKENS, REQUESTS)

CACHE_TTL = 300.0
CACHE_TTL_LONG = 3600.0
CACHE_ENTRIES = 10_000
RESPONSES_KEPT = 10_000
_SECTIONS = ("tools", "system", "instructions", "messages", "input", "prompt")
_MAX_OUTPUT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


class Bucket:
    """A token bucket on the caller's clock: ``limit`` deep, refilled at limit/60 per second, starting full."""

    def __init__(self, limit: int, now: float) -> None:
        self.limit = limit
        self._level = float(limit)
        self._at = now

    @property
    def rate(self) -> float:
        return self.limit / 60.0

    def level(self, now: float) -> float:
        return min(float(self.limit), self._level + max(0.0, now - self._at) * self.rate)

    def take(self, amount: float, now: float) -> None:
        self._level = self.level(now) - amount
        self._at = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until the bucket holds ``amount`` (above its capacity: until it is full)."""
        return max(0.0, (min(amount, self.limit) - self.level(now)) / self.rate)

    def full_in(self, now: float) -> float:
        return self.wait_for(self.limit, now)


def count_text(text: str) -> int:
    return math.ceil(len(text.encode()) / 4)


@dataclass(frozen=True)
class Block:
    """One block of a prompt in cache order: what identifies it, its tokens, and its breakpoint's lifetime."""

    identity: str
    tokens: int
    ttl: float | None


def _without_cache_control(item: Any) -> Any:
    return {k: v for k, v in item.items() if k != "cache_control"} if isinstance(item, dict) else item


def _ttl(item: Any) -> float | None:
    control = item.get("cache_control") if isinstance(item, dict) else None
    if not isinstance(control, dict):
        return None
    return CACHE_TTL_LONG if control.get("ttl") == "1h" else CACHE_TTL


def _block(role: str, item: Any) -> Block:
    if isinstance(item, str):
        item = {"type": "text", "text": item}
    bare = _without_cache_control(item)
    wire = json.dumps(bare, separators=(",", ":"), sort_keys=True)
    text = bare.get("text") if isinstance(bare, dict) else None
    tokens = count_text(text if isinstance(text, str) else wire)
    return Block(f"{role}:{wire}", tokens, _ttl(item))


def _section_blocks(section: str, value: Any) -> Iterator[Block]:
    if not isinstance(value, list):
        if value is not None:
            yield _block(section, value)
        return
    for item in value:
        content = item.get("content") if isinstance(item, dict) else None
        role = f"{section}.{item.get('role')}" if isinstance(item, dict) else section
        if isinstance(content, str):
            yield _block(role, content)
        elif isinstance(content, list):
            for part in content:
                yield _block(role, part)
        else:
            yield _block(section, item)


def request_blocks(body: Mapping[str, Any]) -> list[Block]:
    """A request's prompt as blocks, in cache order."""
    return [block for section in _SECTIONS for block in _section_blocks(section, body.get(section))]


def max_output(body: Mapping[str, Any]) -> int | None:
    for name in _MAX_OUTPUT_FIELDS:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


@dataclass
class _Entry:
    tokens: int
    ttl: float
    expires: float


@dataclass(frozen=True)
class Counted:
    """A request's input as counted: all of it, what the cache gives, and the prefixes it will remember."""

    input: int
    cached: int = 0
    cache_write: int = 0
    read: tuple[Any, ...] | None = None
    writes: tuple[tuple[Any, int, float], ...] = ()


class PromptCache:
    """Remembered prompt prefixes, per scope (key and model), bounded to the most recently used."""

    def __init__(self) -> None:
        self._entries: OrderedDict[tuple[Any, ...], _Entry] = OrderedDict()

    def clear(self) -> None:
        self._entries.clear()

    def count(self, scope: tuple[str, str], blocks: Sequence[Block], now: float) -> Counted:
        total, digest = 0, hashlib.sha256()
        prefixes: list[tuple[tuple[Any, ...], int, float | None]] = []
        for block in blocks:
            digest.update(block.identity.encode() + b"\0")
            total += block.tokens
            prefixes.append(((*scope, digest.hexdigest()), total, block.ttl))
        total = max(1, total)
        last = max((i for i, (_, _, ttl) in enumerate(prefixes) if ttl is not None), default=-1)
        read_at = next((i for i in range(last, -1, -1) if self._alive(prefixes[i][0], now)), -1)
        cached = prefixes[read_at][1] if read_at >= 0 else 0
        written = prefixes[last][1] - cached if last >= 0 else 0
        writes = tuple((name, tokens, ttl) for name, tokens, ttl in prefixes if ttl is not None)
        return Counted(total, cached, written, prefixes[read_at][0] if read_at >= 0 else None, writes)

    def remember(self, counted: Counted, now: float) -> None:
        read = None if counted.read is None else self._entries.get(counted.read)
        if read is not None and counted.read is not None:
            read.expires = now + read.ttl
            self._entries.move_to_end(counted.read)
        for name, tokens, ttl in counted.writes:
            entry = self._entries.get(name)
            if entry is None or entry.expires <= now:
                self._entries[name] = _Entry(tokens, ttl, now + ttl)
            else:
                entry.ttl = max(entry.ttl, ttl)
                entry.expires = max(entry.expires, now + ttl)
            self._entries.move_to_end(name)
        while len(self._entries) > CACHE_ENTRIES:
            self._entries.popitem(last=False)

    def _alive(self, name: tuple[Any, ...], now: float) -> bool:
        entry = self._entries.get(name)
        return entry is not None and entry.expires > now


@dataclass
class Plan:
    """One admitted-or-refused request's dealings with the windows: where, what it needs and what it took."""

    key: str
    model: str
    windows: tuple[str, ...]
    need: dict[str, float]
    counted: Counted
    taken: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Refusal:
    """The window that refuses a request: its limit, what it used, what was asked, and the wait stated."""

    window: str
    limit: int
    used: int
    requested: int
    wait: float
    oversize: bool


@dataclass(frozen=True)
class Reading:
    """A window as one answer announces it: its limit, what remains (floored, never below 0), the wait till full."""

    window: str
    limit: int
    remaining: int
    reset_in: float


class TokenWindows:
    """The windows of a fake provider: limits by window name, a bucket per (key, model, window), the prompt
    cache, the responses a continuation may name, and the 429s per window."""

    def __init__(self, limits: Mapping[str, int]) -> None:
        self.limits = dict(limits)
        self.rejected = dict.fromkeys(self.limits, 0)
        self.cache = PromptCache()
        self._buckets: dict[tuple[str, str, str], Bucket] = {}
        self._responses: OrderedDict[str, int] = OrderedDict()

    def reset(self) -> None:
        self.rejected = dict.fromkeys(self.limits, 0)
        self.cache.clear()
        self._buckets.clear()
        self._responses.clear()

    def count(self, body: Mapping[str, Any], key: str, model: str, *, caching: bool, now: float) -> Counted:
        blocks = request_blocks(body)
        counted = self.cache.count((key, model), blocks, now) if caching else \
            Counted(max(1, sum(block.tokens for block in blocks)))
        previous = body.get("previous_response_id")
        if isinstance(previous, str) and previous in self._responses:
            counted = Counted(counted.input + self._responses[previous], counted.cached, counted.cache_write,
                              counted.read, counted.writes)
        return counted

    def plan(
        self, served: Sequence[str], key: str, model: str, counted: Counted, input_tokens: int, cached: int,
        body: Mapping[str, Any],
    ) -> Plan:
        """What the windows that hold this route and are set need to admit a request stating this input."""
        windows = tuple(name for name in served if name in self.limits)
        costs = {
            INPUT: input_tokens - cached,
            OUTPUT: 1,
            TOKENS: max(max_output(body) or 0, input_tokens),
            REQUESTS: 1,
        }
        return Plan(key, model, windows, {name: float(costs[name]) for name in windows}, counted)

    def refusal(self, plan: Plan, now: float) -> Refusal | None:
        """The window lacking room for ``plan`` that makes it wait longest, counted as a 429; None: room in all."""
        found: Refusal | None = None
        for name in plan.windows:
            bucket = self._bucket(plan, name, now)
            need = plan.need[name]
            if need <= 0 or (need <= bucket.level(now) and need <= bucket.limit):
                continue
            wait = max(bucket.wait_for(need, now), 0.001)
            used = round(bucket.limit - max(0.0, bucket.level(now)))
            refusal = Refusal(name, bucket.limit, used, math.ceil(need), wait, need > bucket.limit)
            if found is None or refusal.wait > found.wait:
                found = refusal
        if found is not None:
            self.rejected[found.window] += 1
        return found

    def admit(self, plan: Plan, now: float) -> None:
        for name in plan.windows:
            amount = 0.0 if name == OUTPUT else plan.need[name]
            self._bucket(plan, name, now).take(amount, now)
            plan.taken[name] = amount
        self.cache.remember(plan.counted, now)

    def settle(self, plan: Plan, input_tokens: int, output: int, now: float, response_id: str | None = None) -> None:
        """Charge what the answer produced: its output to the output window, what the tokens window was not
        charged when sent; remember a response a later request may continue."""
        if OUTPUT in plan.windows:
            self._bucket(plan, OUTPUT, now).take(output, now)
        if TOKENS in plan.windows:
            beyond = max(0.0, input_tokens + output - plan.taken.get(TOKENS, 0.0))
            self._bucket(plan, TOKENS, now).take(beyond, now)
        if response_id is not None:
            self._responses[response_id] = input_tokens + output
            while len(self._responses) > RESPONSES_KEPT:
                self._responses.popitem(last=False)

    def readings(self, plan: Plan, now: float) -> list[Reading]:
        readings = []
        for name in plan.windows:
            bucket = self._bucket(plan, name, now)
            remaining = max(0, math.floor(bucket.level(now)))
            readings.append(Reading(name, bucket.limit, remaining, bucket.full_in(now)))
        return readings

    def stats(self, now: float) -> dict[str, Any]:
        return {
            name: {
                "limit": limit,
                "rejected": self.rejected[name],
                "buckets": [
                    {"key": key, "model": model, "level": round(bucket.level(now), 3)}
                    for (key, model, window), bucket in self._buckets.items() if window == name
                ],
            }
            for name, limit in self.limits.items()
        }

    def _bucket(self, plan: Plan, name: str, now: float) -> Bucket:
        where = (plan.key, plan.model, name)
        bucket = self._buckets.get(where)
        if bucket is None:
            bucket = self._buckets[where] = Bucket(self.limits[name], now)
        return bucket
