"""Each workspace's spend today (UTC) against its daily cap (``workspaces.spend_per_day_usd``).

The day's spend is what was last read from the ledger (or, with Redis, the
fleet's day totals) plus what this replica has added since that read began, so
a restart starts from the day's real spend and other replicas' requests count
once they are read. A check is two dict lookups and an addition.

Pure: the caller reads the totals (``read_started`` / ``read_done``) and answers
the refusal; nothing here does I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import SpendLimitReached
from .prices import DAY_MS

__all__ = ["ALL_OTHERS", "DailySpend", "SpendUnread", "spend_query"]

ALL_OTHERS = "*"
"""The cap of each workspace not named."""


class SpendUnread(Exception):
    """The day's spend could not be read (Redis unreachable); the message says why, in words."""


def spend_query(day_start_ms: int) -> tuple[str, list[Any]]:
    """The ledger's spend per workspace since ``day_start_ms``."""
    sql = ("SELECT workspace, SUM(cost_usd) FROM requests WHERE ended_at >= ? AND cost_usd IS NOT NULL "
           "GROUP BY workspace")
    return sql, [day_start_ms]


class DailySpend:
    """The caps in force and the day's spend per workspace."""

    def __init__(self, caps: Mapping[str, float] | None = None, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self.caps: dict[str, float] = dict(caps or {})
        self.day = int(clock() * 1000) // DAY_MS
        self._read: dict[str, float] = {}
        self._since: dict[str, float] = {}
        self._capped: set[str] = set()
        """The workspaces known to have reached their cap today (their queued requests were refused then)."""

    def configure(self, caps: Mapping[str, float]) -> None:
        """New caps (a reload): in force for the next check, so a raised cap lifts a refusal at once."""
        self.caps = dict(caps)

    def cap(self, workspace: str) -> float | None:
        caps = self.caps
        cap = caps.get(workspace)
        return caps.get(ALL_OTHERS) if cap is None else cap

    def add(self, workspace: str, cost: float, ended_at_ms: int) -> None:
        """A request's cost, as it ended."""
        day = ended_at_ms // DAY_MS
        if day != self.day:
            if day < self.day:
                return
            self._roll(day)
        since = self._since
        since[workspace] = since.get(workspace, 0.0) + cost

    def spent(self, workspace: str) -> float:
        self._today()
        return self._read.get(workspace, 0.0) + self._since.get(workspace, 0.0)

    def refusal(self, workspace: str, provider: str, dialect: str) -> SpendLimitReached | None:
        """The answer for a new request of ``workspace``: a refusal once its spend today reached its cap."""
        cap = self.cap(workspace)
        if cap is None:
            return None
        spent = self.spent(workspace)
        if spent < cap:
            return None
        now_ms = self._clock() * 1000
        resets_at = (self.day + 1) * DAY_MS
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(resets_at / 1000))
        return SpendLimitReached(
            f"workspace '{workspace}' has spent ${spent:,.2f} today, reaching its cap of ${cap:,.2f} a day "
            f"(workspaces.spend_per_day_usd); new requests are refused until the cap resets at {when}",
            retry_after=max(1.0, (resets_at - now_ms) / 1000), dialect=dialect)

    def reached(self, workspace: str) -> bool:
        """Whether ``workspace``'s spend has just reached its cap: True once, when it happens (its queued
        requests are refused then), as cheap as a check."""
        cap = self.cap(workspace)
        if cap is None or self.spent(workspace) < cap or workspace in self._capped:
            return False
        self._capped.add(workspace)
        return True

    def newly_capped(self) -> list[str]:
        """The workspaces whose spend reached their cap since the last look (after a read of the fleet's spend,
        or a reload that lowered a cap); one whose cap was raised meanwhile may reach it again. O(workspaces
        that spent today)."""
        self._today()
        capped = set()
        for workspace in set(self._read) | set(self._since):
            cap = self.cap(workspace)
            if cap is not None and self.spent(workspace) >= cap:
                capped.add(workspace)
        new, self._capped = capped - self._capped, capped
        return sorted(new)

    def read_started(self) -> dict[str, float]:
        """A read of the day's totals begins: what this replica added so far is in it (the caller has written
        it first). Pass the answer to ``read_done`` or ``read_failed``."""
        self._today()
        taken, self._since = self._since, {}
        return taken

    def read_done(self, totals: Mapping[str, float], day: int) -> None:
        if day == self.day:
            self._read = {str(workspace): float(spent or 0.0) for workspace, spent in totals.items()}

    def read_failed(self, taken: Mapping[str, float], day: int) -> None:
        """Nothing was read: what was taken counts again."""
        if day != self.day:
            return
        for workspace, cost in taken.items():
            self._since[workspace] = self._since.get(workspace, 0.0) + cost

    def document(self) -> list[dict[str, Any]]:
        """``spend`` in the status document: each workspace with a cap that has spent today."""
        self._today()
        resets_at = (self.day + 1) * DAY_MS
        rows = []
        for workspace in sorted(set(self._read) | set(self._since)):
            cap = self.cap(workspace)
            spent = self.spent(workspace)
            if cap is not None and spent > 0:
                rows.append({"workspace": workspace, "spent_usd": round(spent, 6), "cap_usd": cap,
                             "resets_at": resets_at})
        return rows

    def _today(self) -> None:
        day = int(self._clock() * 1000) // DAY_MS
        if day != self.day:
            self._roll(day)

    def _roll(self, day: int) -> None:
        self.day = day
        self._read, self._since, self._capped = {}, {}, set()
