"""Token windows: the per-minute input, output, token and request limits providers hold each key to.

A window is a token bucket as the providers run them: its capacity is the per-minute limit (less the
configured headroom), it refills continuously at capacity/60 per second, and a request takes its cost out
of it when it is sent. A window belongs to one key (None: the provider itself, without a pool) and one
model group (the ``models`` pattern the request's model matches, else the model name).

Pure: no I/O, no clock of its own; every method that needs the time is given ``now`` (epoch seconds).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = [
    "FULL",
    "MAX_GROUPS",
    "OTHER_GROUP",
    "ROUNDED_REMAINING",
    "SETTLE_RULES",
    "WINDOW_NAMES",
    "Bucket",
    "WindowBook",
    "WindowSettings",
]

WINDOW_NAMES: tuple[str, ...] = (
    "input_tokens_per_minute",
    "output_tokens_per_minute",
    "tokens_per_minute",
    "requests_per_minute",
)

SETTLE_RULES = ("give_back", "charge_beyond")
"""How an answer's usage reconciles a window: Anthropic's input and output windows give back an
over-estimate and charge an under-estimate; OpenAI's tokens_per_minute only charges what went beyond."""

ROUNDED_REMAINING: Mapping[str, float] = {"input_tokens_per_minute": 500.0, "output_tokens_per_minute": 500.0}
"""Half the rounding of each window's announced ``-remaining``: Anthropic, whose windows these are, rounds them
to the nearest thousand (its request count and OpenAI's counts are exact)."""

FULL = math.inf
"""What a window holds at its reset, for a window hit (``Bucket.empty_until``): all of its capacity."""

OTHER_GROUP = "other"
"""The group of a request that names no model."""

MAX_GROUPS = 512
"""(key, group) pairs kept at most; beyond it an idle pair (full buckets, nothing reserved) is forgotten
first. Groups come from the models clients name, so their number is bounded here."""

_REFILL_SECONDS = 60.0
_SLACK_SECONDS = 1e-3
"""Room counts as there when a millisecond's refill would make it: a timer set for the refill (the time the
whole amount is there) may fire a hair early (float time), and must not need a second one."""
_RECENT_SECONDS = 120.0
"""How long a bucket remembers what it took, for ``correct`` (what was sent since an answer)."""
_RESERVED_RESIDUE = 1e-6
"""What float sums of costs taken and given back (estimates are not whole tokens) may leave over: status's
``reserved`` rounds up only beyond it (a window with nothing reserved shows 0, not 1)."""


def _frozen(limits: Mapping[str, int]) -> Mapping[str, int]:
    return MappingProxyType(dict(limits))


def _pairs(limits: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(limits.items()))


@dataclass(frozen=True, slots=True)
class WindowSettings:
    """The configured windows of one provider (``windows:`` on the provider, its ``models`` patterns and its
    ``keys``), limits by window name; whether limits are also learned from answers, and the headroom.
    Frozen and hashable (read-only mappings), as ``LimiterSettings`` is."""

    provider: Mapping[str, int] = field(default_factory=dict)
    models: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    keys: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    learn: bool = True
    headroom: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "provider", _frozen(self.provider))
        object.__setattr__(self, "models", MappingProxyType({p: _frozen(m) for p, m in self.models.items()}))
        object.__setattr__(self, "keys", MappingProxyType({k: _frozen(m) for k, m in self.keys.items()}))

    def __hash__(self) -> int:
        return hash(self._identity())

    def _identity(self) -> tuple[object, ...]:
        return (_pairs(self.provider), tuple((p, _pairs(m)) for p, m in self.models.items()),
                tuple((k, _pairs(m)) for k, m in self.keys.items()), self.learn, self.headroom)


class Bucket:
    """One window. The level is kept as of ``_at``; before ``_at`` (a window hit's time) the window is empty and
    ``_level`` is what it will hold at ``_at``."""

    __slots__ = ("_at", "_level", "_recent", "capacity", "limit", "rate")

    def __init__(self, limit: float, now: float, headroom: float = 0.0) -> None:
        self.limit = limit
        self.capacity = _capacity(limit, headroom)
        self.rate = self.capacity / _REFILL_SECONDS
        self._level = self.capacity
        self._at = now
        self._recent: deque[tuple[float, float]] = deque()

    def level(self, now: float) -> float:
        elapsed = now - self._at
        if elapsed < 0:  # before a window hit's time: nothing (``_level`` is what there will be then)
            return min(self._level, 0.0)
        if elapsed == 0:
            return self._level
        return min(self.capacity, self._level + self.rate * elapsed)

    def _sync(self, now: float) -> None:
        at = self._at
        if now > at:
            level = self._level + self.rate * (now - at)
            self._level = min(self.capacity, level)
            self._at = now

    def take(self, amount: float, now: float) -> None:
        """Spend ``amount``; the level goes below 0 only for a request larger than the whole window."""
        at = self._at
        if now > at:
            level = self._level + self.rate * (now - at)
            self._level = min(self.capacity, level)
            self._at = now
        self._level -= amount
        recent = self._recent
        recent.append((now, amount))
        while recent and recent[0][0] < now - _RECENT_SECONDS:
            recent.popleft()

    def give(self, amount: float, now: float) -> None:
        self._sync(now)
        self._level = min(self.capacity, self._level + amount)

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` may be taken (0.0: now). More than the whole capacity waits for a full
        bucket, then may be taken."""
        at = self._at
        if at <= now:  # the usual case, without the calls
            level = self._level
            if level >= amount:  # room without the refill
                return 0.0
            if now > at:
                level += self.rate * (now - at)
                level = min(level, self.capacity)
            missing = (min(self.capacity, amount)) - level
            return 0.0 if missing <= self.rate * _SLACK_SECONDS else missing / self.rate
        need = min(amount, self.capacity)
        start = max(now, self._at)
        missing = need - self.level(start)
        if missing <= self.rate * _SLACK_SECONDS:
            return start - now
        return start - now + missing / self.rate

    def empty_until(self, until: float, now: float, then: float = 0.0) -> None:
        """A window hit: nothing left before ``until``, and ``then`` at ``until`` (what the provider said there
        will be: room for the refused request after its Retry-After, a full window at its reset; at most the
        capacity), refilling from there. Without ``then`` it refills from empty. A later time an earlier hit
        set is kept, with at most this room."""
        self._sync(now)
        room = min(then, self.capacity) if then > 0 and until > now else 0.0
        if self._at > until:
            self._level = min(self._level, room)
            return
        self._level = room if room > 0 else min(self._level, 0.0)
        self._at = max(until, now)

    def correct(self, remaining: float, now: float, slack: float = 0.0) -> bool:
        """The provider's word on what is left (already less what was sent since it said so): only lowers.

        ``slack`` is half the rounding of an announced count: only a level beyond what the announcement can
        stand for is corrected, and then to the least it can stand for (an estimate errs toward holding).
        The provider counts what is left of its whole limit: the headroom (``limit - capacity``) is left to
        others from that too, or a window run low would be corrected into it."""
        self._sync(now)
        remaining -= self.limit - self.capacity
        if self._at > now:  # after a window hit: ``_level`` is the level at ``_at``, refilled from now to then
            remaining += self.rate * (self._at - now)
        if self._level > remaining + slack:
            self._level = remaining - slack
            return True
        return False

    def taken_since(self, since: float) -> float:
        """What was taken after ``since``, read from the newest back: an answer asks about the requests sent
        while it was in flight, not the last two minutes' (thousands, on a busy key)."""
        taken = 0.0
        for at, amount in reversed(self._recent):
            if at <= since:
                break
            taken += amount
        return taken

    def set_limit(self, limit: float, headroom: float, now: float) -> None:
        """A new limit: what was spent stays spent (the level moves by the change of capacity), never below
        empty when the limit falls (a debt stays as it is) and never above the new capacity."""
        self._sync(now)
        capacity = _capacity(limit, headroom)
        self.limit = limit
        if capacity == self.capacity:
            return
        self._level = max(self._level + capacity - self.capacity, min(self._level, 0.0))
        self.capacity = capacity
        self.rate = capacity / _REFILL_SECONDS


def _capacity(limit: float, headroom: float) -> float:
    if not (limit > 0 and math.isfinite(limit)):
        raise ValueError(f"a window limit must be a positive number, got {limit!r}")
    if not 0 <= headroom < 1:
        raise ValueError(f"a window's headroom must be at least 0 and below 1, got {headroom!r}")
    return limit * (1.0 - headroom)


WindowId = tuple[str | None, str, str]
"""(key, group, window): one bucket of a provider."""


class _Window:
    """A bucket with what status and metrics count of it."""

    __slots__ = ("bucket", "held", "hits", "name", "rebased_at", "reserved")

    def __init__(self, name: str, bucket: Bucket) -> None:
        self.name = name
        self.bucket = bucket
        self.held = 0
        """Requests that waited on it."""
        self.hits = 0
        self.reserved = 0.0
        self.rebased_at = -math.inf
        """When the provider's word last lowered it (``correct_all``, ``hit``): what it said counted the requests
        granted before then as the provider charges them when it admits them, so they settle against that."""

    def rebase(self, at: float) -> None:
        """The provider's word lowered it, as of ``at`` (only ever later)."""
        self.rebased_at = max(self.rebased_at, at)


class WindowBook:
    """Every window of one provider, created when a request of its (key, group) first meets a limit."""

    def __init__(self, settings: WindowSettings) -> None:
        self._settings = settings
        self._sets: OrderedDict[tuple[str | None, str], list[_Window]] = OrderedDict()
        self._last: tuple[str | None, str, list[_Window]] | None = None
        """The (key, group) last looked up with ``_windows``, and its windows: the most recently used pair, so
        already last in ``_sets`` (a request's take, end, settling and its answer's correction find it without a
        lookup or a move). Forgotten whenever ``_sets`` changes otherwise."""
        self._learned: dict[WindowId, int] = {}
        self._hits: dict[WindowId, int] = {}

    @property
    def settings(self) -> WindowSettings:
        return self._settings

    # ----- limits ----------------------------------------------------------------

    def _configured(self, key: str | None, group: str) -> dict[str, int]:
        settings = self._settings
        limits = dict(settings.provider)
        model = settings.models.get(group)
        if model:
            limits.update(model)
        if key is not None and (own := settings.keys.get(key)):
            limits.update(own)
        return limits

    def _limits(self, key: str | None, group: str) -> dict[str, tuple[int, str]]:
        """Each window's limit and where it came from; when config and headers both give one, the smaller."""
        limits = {name: (limit, "config") for name, limit in self._configured(key, group).items()}
        if self._settings.learn:
            for name in WINDOW_NAMES:
                learned = self._learned.get((key, group, name))
                if learned is None:
                    continue
                configured = limits.get(name)
                limits[name] = (learned, "headers") if configured is None else (
                    min(learned, configured[0]), "both")
        return {name: limits[name] for name in WINDOW_NAMES if name in limits}

    def limits_for(self, key: str | None, group: str) -> dict[str, int]:
        return {name: limit for name, (limit, _) in self._limits(key, group).items()}

    def source(self, key: str | None, group: str, window: str) -> str | None:
        entry = self._limits(key, group).get(window)
        return None if entry is None else entry[1]

    def learn(self, key: str | None, group: str, window: str, limit: int, now: float | None = None) -> bool:
        """A limit an answer's headers announced; True when the limit in force changed (more room may exist)."""
        if not self._settings.learn or window not in WINDOW_NAMES or limit < 1:
            return False
        if self._learned.get((key, group, window)) == limit:
            return False
        self._learned[(key, group, window)] = limit
        return self._refresh(key, group, now)

    def apply(self, settings: WindowSettings, now: float) -> None:
        """A config reload: every bucket takes its new limit; a window no longer limited is dropped."""
        self._settings = settings
        if not settings.learn:
            self._learned.clear()
        for key, group in list(self._sets):
            self._refresh(key, group, now)

    def _refresh(self, key: str | None, group: str, now: float | None) -> bool:
        windows = self._sets.get((key, group))
        if windows is None:
            return False
        limits = self.limits_for(key, group)
        headroom = self._settings.headroom
        changed = False
        kept = []
        for window in windows:
            limit = limits.pop(window.name, None)
            if limit is None:
                changed = True
                continue
            before = window.bucket.capacity
            window.bucket.set_limit(limit, headroom, window.bucket._at if now is None else now)
            changed = changed or window.bucket.capacity != before
            kept.append(window)
        at = 0.0 if now is None else now
        for name, limit in limits.items():
            kept.append(self._new_window(key, group, name, limit, at))
            changed = True
        kept.sort(key=lambda window: WINDOW_NAMES.index(window.name))
        self._sets[(key, group)] = kept
        self._last = None
        return changed

    def _new_window(self, key: str | None, group: str, name: str, limit: int, now: float) -> _Window:
        window = _Window(name, Bucket(limit, now, self._settings.headroom))
        window.hits = self._hits.get((key, group, name), 0)
        return window

    def _windows(self, key: str | None, group: str, now: float) -> list[_Window]:
        """The windows of (key, group), made on first use; the least recently used idle pair is forgotten
        beyond ``MAX_GROUPS``."""
        last = self._last
        if last is not None and last[1] == group and last[0] == key:
            return last[2]
        sets = self._sets
        windows = sets.get((key, group))
        if windows is not None:
            sets.move_to_end((key, group))
            self._last = (key, group, windows)
            return windows
        windows = [self._new_window(key, group, name, limit, now)
                   for name, limit in self.limits_for(key, group).items()]
        sets[(key, group)] = windows
        if len(sets) > MAX_GROUPS:
            self._forget_idle(now)
        self._last = (key, group, windows) if (key, group) in sets else None
        return windows

    def _known(self, key: str | None, group: str) -> list[_Window]:
        """The windows of (key, group) if it has any, found without changing the order of use."""
        last = self._last
        if last is not None and last[1] == group and last[0] == key:
            return last[2]
        return self._sets.get((key, group)) or []

    def _forget_idle(self, now: float) -> None:
        for pair, windows in self._sets.items():
            if all(w.reserved <= 0 and w.bucket.level(now) >= w.bucket.capacity for w in windows):
                del self._sets[pair]
                self._last = None
                for name in WINDOW_NAMES:
                    self._learned.pop((*pair, name), None)
                    self._hits.pop((*pair, name), None)
                return

    def _window(self, key: str | None, group: str, window: str, now: float) -> _Window | None:
        for entry in self._windows(key, group, now):
            if entry.name == window:
                return entry
        return None

    # ----- admission -------------------------------------------------------------

    def wait_for(self, key: str | None, group: str, cost: Mapping[str, float], now: float) -> float:
        """Seconds until every window of (key, group) has room for ``cost`` (0.0: now)."""
        wait = 0.0
        for window in self._windows(key, group, now):
            amount = cost.get(window.name)
            if amount and (waited := window.bucket.wait_for(amount, now)):
                wait = max(wait, waited)
        return wait

    def blocked_by(self, key: str | None, group: str, cost: Mapping[str, float], now: float) -> list[WindowId]:
        """The windows of (key, group) that have no room for ``cost`` now."""
        return [(key, group, window.name) for window in self._windows(key, group, now)
                if (amount := cost.get(window.name)) and window.bucket.wait_for(amount, now) > 0]

    def beyond_capacity(self, key: str | None, group: str, cost: Mapping[str, float], now: float) -> list[str]:
        """The windows whose whole capacity is less than ``cost``: such a request is sent once they are full,
        and a 429 from one of them can never be cured by waiting."""
        return [window.name for window in self._windows(key, group, now)
                if cost.get(window.name, 0) > window.bucket.capacity]

    def take(self, key: str | None, group: str, cost: Mapping[str, float], now: float) -> None:
        """A request is sent: its cost is spent, and reserved until it ends."""
        for window in self._windows(key, group, now):
            amount = cost.get(window.name)
            if amount:
                window.bucket.take(amount, now)
                window.reserved += amount

    def ended(self, key: str | None, group: str, cost: Mapping[str, float]) -> None:
        """A request ended: its cost is no longer reserved (nothing is given back: a window is spent by sending)."""
        for window in self._known(key, group):
            amount = cost.get(window.name)
            if amount:
                left = window.reserved - amount
                window.reserved = left if left > 0.0 else 0.0  # noqa: FURB136 - max(0.0, left), without the call

    def count_held(self, ids: Iterable[WindowId]) -> None:
        """A request began waiting on these windows."""
        for key, group, name in ids:
            for window in self._sets.get((key, group)) or ():
                if window.name == name:
                    window.held += 1

    # ----- what the provider said ----------------------------------------------------

    def settle(self, key: str | None, group: str, window: str, charged: float, actual: float, rule: str,
               now: float, *, granted_at: float = -math.inf, admitted: float | None = None) -> bool:
        """Reconcile a window with what the answer reported; True when room was given back.

        A request granted before the provider's word last lowered the window (``rebased_at``) was counted in
        it as the provider charges a request it admits (``admitted``, ``estimate.admitted_for``), not as this
        proxy estimated it: only what the provider charges beyond that, when the answer ends, is taken."""
        if rule not in SETTLE_RULES:
            raise ValueError(f"unknown settle rule {rule!r}: use one of {', '.join(SETTLE_RULES)}")
        for entry in self._known(key, group):
            if entry.name == window:
                break
        else:
            return False
        if admitted is not None and granted_at <= entry.rebased_at:
            charged, rule = admitted, "charge_beyond"
        beyond = actual - charged
        if beyond > 0:
            entry.bucket.take(beyond, now)
        elif beyond < 0 and rule == "give_back":
            entry.bucket.give(-beyond, now)
            return True
        return False

    def hit(self, key: str | None, group: str, window: str, until: float, now: float, then: float = 0.0) -> None:
        """A 429 named this window: it is counted, and empty until ``until``, when it holds ``then``
        (``Bucket.empty_until``). What the provider said counted the requests it had taken as it charges them:
        those granted before now settle against that (``rebased_at``)."""
        wid = (key, group, window)
        entry = self._window(key, group, window, now)
        self._hits[wid] = hits = self._hits.get(wid, 0) + 1
        if entry is not None:
            entry.hits = hits
            entry.bucket.empty_until(until, now, then)
            entry.rebase(now)

    def correct_all(self, key: str | None, group: str, remaining: Mapping[str, float], now: float,
                    answered_at: float) -> None:
        """The provider announced ``remaining`` (by window) at ``answered_at``: the room believed is never more
        than that, less what was sent since, beyond the announcement's rounding (``ROUNDED_REMAINING``; an
        announced 0 stands for 0 and up)."""
        if not remaining:
            return
        for entry in self._windows(key, group, now):
            announced = remaining.get(entry.name)
            if announced is not None:
                bucket = entry.bucket
                rounded = ROUNDED_REMAINING.get(entry.name, 0.0)  # min(rounded, max(announced, 0.0)), without calls
                floor = 0.0 if 0.0 > announced else announced  # noqa: FURB136
                slack = floor if floor < rounded else rounded  # noqa: FURB136
                recent = bucket._recent
                if recent and recent[-1][0] > answered_at:  # sent since it answered
                    announced -= bucket.taken_since(answered_at)
                if bucket.correct(announced, now, slack):
                    entry.rebase(answered_at)

    # ----- observing -------------------------------------------------------------

    def status(self, key: str | None, group: str | None = None, *, now: float,
               holding: Mapping[WindowId, int] | None = None) -> list[dict[str, Any]]:
        """The windows of ``key`` (of one group, or all), as status shows them; ``holding`` is the waiters
        each window holds now. The estimator's ratio and errors are left None for the caller to fill."""
        rows = []
        for (owner, pair_group), windows in self._sets.items():
            if owner != key or (group is not None and pair_group != group):
                continue
            limits = self._limits(owner, pair_group)
            for window in windows:
                limit, source = limits.get(window.name, (None, None))
                rows.append({
                    "group": pair_group,
                    "window": window.name,
                    "limit": limit,
                    "source": source,
                    "available": math.floor(window.bucket.level(now)),
                    "reserved": math.ceil(window.reserved - _RESERVED_RESIDUE),
                    "held": (holding or {}).get((owner, pair_group, window.name), 0),
                    "held_total": window.held,
                    "hits": window.hits,
                    "ratio": None,
                    "estimate_error_p50": None,
                    "estimate_error_p90": None,
                })
        return rows
