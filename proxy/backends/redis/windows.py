"""Token windows held fleet-wide: what answers say of a provider's windows (usage to settle with, window
429s, the limits and room the headers announce) sent to the scripts that keep its buckets in Redis
(``lua_windows``), the window limits in force, which the relay asks before it estimates a cost, and this
replica's waiters costed again when their model group's estimates moved."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ...limiter import Lease, ProviderStatus, SlotLease
from ...limiter.window import OTHER_GROUP, ROUNDED_REMAINING, WindowBook
from .client import text
from .leases import RedisLease, SlotKeeper

__all__ = ["WindowKeeper"]

_FULL_IN_LUA = 1e300
"""``window.FULL`` as the scripts read it (a number; the bucket takes at most its capacity)."""


class WindowKeeper(SlotKeeper):
    """The window reports of the ``Backend`` interface on Redis. Each provider's limits in force are
    worked out here by a ``WindowBook`` that holds no bucket (the configured limits, and the learned ones
    this replica heard of: from its own answers, and from the fleet's status), as the scripts work them out."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._books: dict[str, WindowBook] = {}

    def _book(self, provider: str) -> WindowBook | None:
        settings = self._settings.get(provider)
        if settings is None or settings.windows is None:
            return None
        book = self._books.get(provider)
        if book is None:
            book = self._books[provider] = WindowBook(settings.windows)
        elif book.settings != settings.windows:
            book.apply(settings.windows, self.clock.time())
        return book

    def _windowed(self, provider: str) -> bool:
        return self._book(provider) is not None

    def settle_windows(self, provider: str, lease: SlotLease, actual: Mapping[str, float],
                       rules: Mapping[str, str], admitted: Mapping[str, float] | None = None) -> None:
        if isinstance(lease, Lease):  # granted by this replica's own limiter while Redis was away
            self._local.settle_windows(provider, lease, actual, rules, admitted)
            return
        if not isinstance(lease, RedisLease) or lease.cost is None or lease.group is None or lease.windows_settled:
            return
        lease.windows_settled = True
        admitted = admitted or {}
        fives = [part for window, charged in lease.cost.items() if window in actual and window in rules
                 for part in (window, repr(float(charged)), repr(float(actual[window])), rules[window],
                              repr(float(admitted[window])) if window in admitted else "")]
        if fives:
            self._send("WINDOW_SETTLE", provider, (self._lease_ttl_ms, self._channel, lease.key or "", lease.group,
                                                   lease.granted_at_ms, *fives), self._dispatch_at(provider))

    def recost_windows(self, provider: str, group: str) -> None:
        """Only this replica's own waiters (it knows their ids; each replica's estimator learns from its own
        answers), all in one WINDOW_RECOST, which keeps their places and dispatches at once, as a release
        would. Each new cost is a new version of the waiter's cost: the grant names the version it took, so a
        grant that was on its way while the script was (its message may arrive before the script's answer)
        takes the cost Redis took. A waiter served from this replica's own limiter is costed there."""
        self._local.recost_windows(provider, group)
        triples: list[str | int] = []
        for waiter_id, waiter in self._waiters.items():
            costs, recost = waiter.costs, waiter.recost
            if costs is None or recost is None or waiter.provider != provider or waiter.group != group \
                    or not waiter.queued:
                continue
            fresh = recost()
            if fresh and fresh != costs[-1]:
                costs.append(dict(fresh))
                triples += (waiter_id, len(costs) - 1, json.dumps(costs[-1]))
        if triples:
            self._send("WINDOW_RECOST", provider, (self._lease_ttl_ms, self._channel, *triples),
                       self._dispatch_at(provider))

    def report_window_hit(self, provider: str, key: str | None, group: str | None, window: str,
                          until: float, then: float = 0.0) -> None:
        if self._windowed(provider):
            self._send("WINDOW_HIT", provider, (key or "", group or OTHER_GROUP, window, int(until * 1000),
                                                repr(min(then, _FULL_IN_LUA))))
            if not self.healthy:
                self._local.report_window_hit(provider, key, group, window, until, then)

    def report_window_limits(self, provider: str, key: str | None, group: str | None,
                             limits: Mapping[str, int]) -> None:
        book = self._book(provider)
        if book is None or not limits:
            return
        for window, limit in limits.items():
            book.learn(key, group or OTHER_GROUP, window, limit)
        pairs = [part for window, limit in limits.items() for part in (window, int(limit))]
        self._send("WINDOW_LEARN", provider, (self._lease_ttl_ms, self._channel, key or "", group or OTHER_GROUP,
                                              *pairs), self._dispatch_at(provider))
        if not self.healthy:
            self._local.report_window_limits(provider, key, group, limits)

    def report_window_remaining(self, provider: str, key: str | None, group: str | None,
                                remaining: Mapping[str, float], answered_at: float) -> None:
        if not self._windowed(provider) or not remaining:
            return
        pairs = [part for window, left in remaining.items()
                 for part in (window, repr(float(left)), repr(ROUNDED_REMAINING.get(window, 0.0)))]
        self._send("WINDOW_CORRECT", provider, (key or "", group or OTHER_GROUP, repr(answered_at * 1000), *pairs))
        if not self.healthy:
            self._local.report_window_remaining(provider, key, group, remaining, answered_at)

    def window_limits(self, provider: str, key: str | None, group: str | None) -> dict[str, int]:
        book = self._book(provider)
        return {} if book is None else book.limits_for(key, group or OTHER_GROUP)

    def _learned_from(self, status: ProviderStatus) -> None:
        """Limits other replicas learned, as the fleet's status shows them: this replica's requests then
        name those windows in their costs too."""
        book = self._book(status.provider)
        if book is None or not book.settings.learn:
            return
        owners: list[tuple[str | None, tuple[dict[str, Any], ...] | None]] = [(None, status.windows)]
        owners += [(key.name, key.windows) for key in status.keys]
        for key, rows in owners:
            for row in rows or ():
                if row["source"] in ("headers", "both") and row["limit"] is not None:
                    book.learn(key, row["group"], row["window"], int(row["limit"]))

    def _dispatch_at(self, provider: str) -> Any:
        return lambda answer: self._schedule_dispatch(provider, int(text(answer)))
