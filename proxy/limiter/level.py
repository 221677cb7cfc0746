"""One limit: the slots counted against one limit key, and that key's pause, reduction and recovery.

A request takes one slot at every level that applies to it, at once or not at
all (the provider's limiter decides that, and holds the one queue). Today a
provider has one level, itself. A key of a pool or a model cap is another level
with these same rules, which come from the policy; nothing here is written for
"the provider" in particular.

Pure: time and timers come from the injected clock; the limiter that owns a level
is told through ``on_room`` (a slot may be free now: grant waiters) and
``on_change`` (the state file should be written).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from . import policy
from .clock import Clock, Timer
from .policy import LimitKey, validate_limit

__all__ = ["LimitLevel"]

log = logging.getLogger("slotproxy.limiter")


def _optional_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


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

    def has_room(self) -> bool:
        limit = self._limit
        return self._paused_until is None and (limit is None or self._held + self._cooling < limit)

    def take(self) -> None:
        self._held += 1

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
        self._pause_until(now + policy.pause_length(wait, default), cause)
        self._quiet_since = now
        if reduce and not same_burst:
            self._last_reduction_at = now
            self._auto_reduce(cause)
        self._arm_recovery()
        self._on_change()

    def retry_after_hint(self) -> float:
        return policy.retry_after_hint(self._clock.time(), self._paused_until)

    def _pause_until(self, until: float, cause: str) -> None:
        if self._paused_until is not None and until <= self._paused_until:
            return
        if self._pause_timer is not None:
            self._pause_timer.cancel()
        self._paused_until = until
        self._pause_timer = self._clock.call_later(until - self._clock.time(), self._end_pause)
        log.warning("%s paused for %.1fs after a %s", self._label(), until - self._clock.time(), cause)

    def _end_pause(self) -> None:
        self._paused_until = None
        self._pause_timer = None
        log.info("%s pause ended", self._label())
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
        log.warning("%s %s", self._label(), self._notice)

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
        return f"provider={self.key}"
