"""The usage gate: admit by the provider's own concurrency count, not only our own.

A provider's counter can lag (a finished stream still counts for a while). The
gate admits one request per successful poll of the provider's usage endpoint,
and only while ``count + unseen < limit``, where ``unseen`` counts the slots
this proxy holds that the polled figure may not include yet (admitted after the
poll was sent, or still waiting for response headers when it was sent). The
polling itself is I/O and lives in the shell; this class only decides.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .clock import Clock

__all__ = ["UsageGate"]

log = logging.getLogger("slotproxy.limiter")


class UsageGate:
    def __init__(
        self,
        name: str,
        clock: Clock,
        *,
        limit: Callable[[], int | None],
        unseen_since: Callable[[float], int],
        request_poll: Callable[[], None],
        permit_ttl: float,
    ) -> None:
        self.name = name
        self._clock = clock
        self._limit = limit
        self._unseen_since = unseen_since
        self._request_poll = request_poll
        self._permit_ttl = permit_ttl
        self._permit_until: float | None = None
        self.failing = False
        self.error: str | None = None
        self.last_count: float | None = None
        self.last_unseen = 0
        self.polls = 0

    def admits(self) -> bool:
        """A fresh permit from the last poll, or the poll is failing (cooldown-only then)."""
        if self.failing:
            return True
        return self._permit_until is not None and self._clock.time() <= self._permit_until

    def admitted(self) -> None:
        self._permit_until = None
        self._request_poll()

    def request_poll(self) -> None:
        self._request_poll()

    def poll_succeeded(self, count: float, sent_at: float) -> None:
        self.polls += 1
        if self.failing:
            log.info("provider=%s usage gate recovered: polls answer again", self.name)
        self.failing, self.error = False, None
        limit = self._limit()
        self.last_count = count
        self.last_unseen = self._unseen_since(sent_at)
        if limit is None or count + self.last_unseen < limit:
            self._permit_until = self._clock.time() + self._permit_ttl
        else:
            self._permit_until = None

    def poll_failed(self, reason: str) -> None:
        self.polls += 1
        if not self.failing:
            log.warning("provider=%s usage poll failed (%s); admitting on cooldown only until it answers", self.name, reason)
        self.failing, self.error = True, reason
        self._permit_until = None

    def status(self) -> dict[str, object]:
        return {
            "state": "failing" if self.failing else ("ok" if self.polls else "starting"),
            "last_count": self.last_count,
            "unseen": self.last_unseen,
            "error": self.error,
        }
