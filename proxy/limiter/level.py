"""One limit: the slots counted against one limit key, and that key's pause, reduction and recovery.

A request takes one slot at every level that applies to it, at once or not at
all (the provider's limiter decides that, and holds the one queue): the
provider's own limit, the model cap its model matches, one key of the pool.
Each is a level with these same rules, which come from the policy; nothing here
is written for "the provider" in particular.

A budget hold (the provider announced that a key's request window is spent) is
not a backoff: it stops new grants until the window resets, with no pause,
reduction or notice.

Pure: time and timers come from the injected clock; the limiter that owns a level
is told through ``on_room`` (a slot may be free now: grant waiters) and
``on_change`` (the state file should be written). A backoff's pause and reduction
are not logged here: the backend that reported it logs them, summarised per
provider (``proxy.logs.BackoffLog``), the same way for memory and Redis.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import policy
from .clock import Clock, Timer
from .policy import LimitKey, validate_limit

__all__ = ["Budget", "LimitLevel"]

log = logging.getLogger("slotproxy.limiter")


def _optional_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


@dataclass(frozen=True, slots=True)
class Budget:
    """What the provider's rate-limit headers last said about one key's windows (times: epoch seconds)."""

    remaining_requests: int | None = None
    remaining_tokens: int | None = None
    reset_at: float | None = None
    """The reset of the window that holds the key, else the earliest one announced."""
    held_until: float | None = None
    """No new request before this (its request window is spent, or its unified status is rejected)."""
    requests_reset: float | None = None
    """When the request window resets: the requests granted after this report count against
    ``remaining_requests`` until then, so the window is not overrun before the next answer says so."""

    def to_dict(self, held: float | None) -> dict[str, int | None]:
        """As status shows it, with the hold in force now (``held``), which may outlast this report's."""
        return {
            "remaining_requests": self.remaining_requests,
            "remaining_tokens": self.remaining_tokens,
            "reset_at": None if self.reset_at is None else round(self.reset_at * 1000),
            "held_until": None if held is None else round(held * 1000),
        }


class LimitLevel:
    """Slots of one limit key. ``settings`` is any object with the limit's fields (``LimiterSettings``)."""

    def __init__(self, key: LimitKey, settings: Any, clock: Clock, *,
                 on_room: Callable[[], None], on_change: Callable[[], None]) -> None:
        self.key = key
        self._clock = clock
        self._settings = settings
        self._on_room = on_room
        self._on_change = on_change
        self._limit = validate_limit(settings.limit)
        self._cooldown: float = settings.release_cooldown
        self._held = 0
        self._cooling = 0
        self._paused_until: float | None = None
        self._pause_timer: Timer | None = None
        self._last_reduction_at = -math.inf
        self._auto_reduced_from: int | None = None
        self._notice: str | None = None
        self._recovery_timer: Timer | None = None
        self._quiet_since: float | None = None
        self._held_until: float | None = None
        self._hold_timer: Timer | None = None
        self.budget: Budget | None = None
        self._requests_left: int | None = None
        self._requests_reset = 0.0
        self.counters = {"backoffs": 0, "auto_reductions": 0}

    # ----- slots -----------------------------------------------------------------

    @property
    def limit(self) -> int | None:
        return self._limit

    @property
    def configured_limit(self) -> int | None:
        return self._settings.limit  # type: ignore[no-any-return]

    @property
    def in_flight(self) -> int:
        """Held slots, and released ones still in their release cooldown."""
        return self._held + self._cooling

    @property
    def paused_until(self) -> float | None:
        return self._paused_until

    @property
    def cooldown(self) -> float:
        return self._cooldown

    @property
    def auto_reduced_from(self) -> int | None:
        return self._auto_reduced_from

    @property
    def notice(self) -> str | None:
        return self._notice

    @property
    def held_until(self) -> float | None:
        """The end of a budget hold, while one lasts."""
        return self._held_until

    def has_room(self) -> bool:
        limit = self._limit
        return self._paused_until is None and self._held_until is None and (
            limit is None or self._held + self._cooling < limit)

    def free_slots(self) -> int | None:
        """Slots free now (None: no limit)."""
        limit = self._limit
        return None if limit is None else max(0, limit - self._held - self._cooling)

    def available_at(self) -> float | None:
        """When a pause or a budget hold that blocks this level ends (None: neither blocks it)."""
        ends = [t for t in (self._paused_until, self._held_until) if t is not None]
        return max(ends) if ends else None

    def take(self) -> None:
        self._held += 1
        if self._requests_left is not None:
            self._requests_left -= 1
            if self._requests_left <= 0:
                self._requests_left = None
                self._hold_until(self._requests_reset)

    def give_back(self) -> bool:
        """A slot is released; True when it is free at once (no release cooldown to sit out)."""
        self._held -= 1
        if self._cooldown > 0:
            self._cooling += 1
            self._clock.call_later(self._cooldown, self._end_cooldown)
            return False
        return True

    def _end_cooldown(self) -> None:
        self._cooling -= 1
        self._on_room()

    # ----- backoff ---------------------------------------------------------------

    def report_backoff(self, cause: str, wait: float | None = None, *, sent_at: float | None = None,
                       reduce: bool = True) -> None:
        """Upstream said "slow down": pause, and when ``reduce``, lower the limit once per burst
        (``policy.same_burst``). An overload pauses for ``overload_pause`` when no wait is stated."""
        now = self._clock.time()
        self.counters["backoffs"] += 1
        same_burst = policy.same_burst(now, self._paused_until, sent_at, self._last_reduction_at)
        default = policy.default_pause(reduce, self._settings.default_pause, self._settings.overload_pause)
        self._pause_until(now + policy.pause_length(wait, default))
        self._quiet_since = now
        if reduce and not same_burst:
            self._last_reduction_at = now
            self._auto_reduce(cause)
        self._arm_recovery()
        self._on_change()

    def retry_after_hint(self) -> float:
        return policy.retry_after_hint(self._clock.time(), self._paused_until)

    def _pause_until(self, until: float) -> None:
        if self._paused_until is not None and until <= self._paused_until:
            return
        if self._pause_timer is not None:
            self._pause_timer.cancel()
        self._paused_until = until
        self._pause_timer = self._clock.call_later(until - self._clock.time(), self._end_pause)

    def _end_pause(self) -> None:
        self._paused_until = None
        self._pause_timer = None
        self._on_room()

    def _auto_reduce(self, cause: str) -> None:
        reduced = policy.reduced_limit(self._limit)
        if reduced is None:
            return
        if self._auto_reduced_from is None:
            self._auto_reduced_from = self._limit
        self._limit = reduced
        self._notice = policy.auto_reduce_notice(self._limit, cause)
        self.counters["auto_reductions"] += 1

    def _arm_recovery(self) -> None:
        """Time the next recovery step: ``recovery_after`` past the later of the last backoff and the last step."""
        if self._recovery_timer is not None:
            self._recovery_timer.cancel()
            self._recovery_timer = None
        after = self._settings.recovery_after
        if after is None or self._auto_reduced_from is None:
            return
        since = self._quiet_since if self._quiet_since is not None else self._clock.time()
        delay = max(0.0, since + after - self._clock.time())
        self._recovery_timer = self._clock.call_later(delay, self._recover_step)

    def _recover_step(self) -> None:
        """recovery.after passed with no backoff: raise the limit one step toward its old value."""
        self._recovery_timer = None
        self._quiet_since = self._clock.time()
        target = self._auto_reduced_from
        if target is None or self._limit is None:
            return
        self._limit, recovered = policy.recovery_step(self._limit, target)
        if recovered:
            self._auto_reduced_from = None
            self._notice = None
            log.info("%s limit recovered to %d; auto-reduction cleared", self._label(), self._limit)
        else:
            self._notice = policy.recovering_notice(self._limit, target, self._settings.recovery_after or 0.0)
            log.info("%s limit recovering to %d of %d", self._label(), self._limit, target)
            self._arm_recovery()
        self._on_room()
        self._on_change()

    # ----- budgets ---------------------------------------------------------------

    def report_budget(self, budget: Budget) -> None:
        """The provider's latest word on this level's windows; a ``held_until`` still ahead holds it."""
        self.budget = budget
        reset, remaining, now = budget.requests_reset, budget.remaining_requests, self._clock.time()
        if remaining is not None and reset is not None and reset > now:
            if self._requests_left is not None and now < self._requests_reset:
                # The same window: an answer to an earlier request does not count the grants made since.
                remaining = min(remaining, self._requests_left)
            self._requests_left, self._requests_reset = remaining, reset
        if budget.held_until is not None:
            self._hold_until(budget.held_until)

    def _hold_until(self, until: float) -> None:
        now = self._clock.time()
        if until <= now or (self._held_until is not None and until <= self._held_until):
            return
        if self._hold_timer is not None:
            self._hold_timer.cancel()
        self._held_until = until
        self._hold_timer = self._clock.call_later(until - now, self._end_hold)
        log.info("%s held for %.1fs: its budget is spent until the provider's reset", self._label(), until - now)

    def _end_hold(self) -> None:
        self._held_until = None
        self._hold_timer = None
        self._requests_left = None  # a new window: unknown until the next answer
        self._on_room()

    # ----- control ---------------------------------------------------------------

    def set_limit(self, limit: int | None) -> None:
        """A manual limit (admin API or a YAML edit): applies at once and clears any auto-reduction."""
        self._limit = validate_limit(limit)
        self._auto_reduced_from = None
        self._notice = None
        self._arm_recovery()
        self._on_room()
        self._on_change()

    def set_cooldown(self, seconds: float) -> None:
        if not (seconds >= 0 and math.isfinite(seconds)):
            raise ValueError(f"cooldown must be a non-negative number of seconds, got {seconds!r}")
        self._cooldown = seconds
        self._on_change()

    def apply_settings(self, settings: Any) -> None:
        """A config reload. A changed YAML limit or cooldown counts as a manual change."""
        old, self._settings = self._settings, settings
        if settings.release_cooldown != old.release_cooldown:
            self._cooldown = settings.release_cooldown
        if settings.limit != old.limit:
            self.set_limit(settings.limit)
            return
        if settings.recovery_after != old.recovery_after:
            self._arm_recovery()
        self._on_room()

    def export_state(self) -> dict[str, Any]:
        return {
            "limit": self._limit,
            "configured_limit": self._settings.limit,
            "auto_reduced_from": self._auto_reduced_from,
            "notice": self._notice,
            "cooldown": self._cooldown,
            "configured_cooldown": self._settings.release_cooldown,
        }

    def restore_state(self, state: dict[str, Any]) -> None:
        """Apply persisted runtime state over the config; a value whose YAML counterpart changed since
        it was saved is skipped (an edit of the YAML is a manual act and wins)."""
        if state.get("configured_limit", self._settings.limit) == self._settings.limit:
            self._limit = validate_limit(state.get("limit", self._limit))
            self._auto_reduced_from = _optional_int(state.get("auto_reduced_from"))
            notice = state.get("notice")
            self._notice = notice if isinstance(notice, str) and self._auto_reduced_from is not None else None
        cooldown = state.get("cooldown")
        same_cooldown = state.get("configured_cooldown", self._settings.release_cooldown) == \
            self._settings.release_cooldown
        if same_cooldown and isinstance(cooldown, (int, float)) and cooldown >= 0:
            self._cooldown = float(cooldown)
        self._arm_recovery()
        self._on_room()

    def _label(self) -> str:
        return str(self.key)
