"""Log setup: one line per event worth knowing, as text or JSON, with secrets masked."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp.http_exceptions import HttpProcessingError

__all__ = ["BackoffLog", "JsonFormatter", "QuietParserErrors", "ReportPacer", "ThrottledLog", "mask_secrets",
           "setup_logging"]

_SECRET = re.compile(
    r"(?i)(authorization|x-api-key|api[_-]?key|token|bearer)(?![A-Za-z0-9_])"
    r"(\"?\s*[:=]?\s*\"?)(bearer\s+)?([A-Za-z0-9._~+/=-]{8,})"
)
"""A credential's name, then its value. The name must end there: ``tokens_per_minute`` and ``input_tokens`` are
the config's and the ledger's words, not a token followed by its value."""
_KEY_SHAPED = re.compile(r"\b(sk-[A-Za-z0-9_-]{8,}|sk-ant-[A-Za-z0-9_-]{8,})")


def mask_secrets(text: str) -> str:
    """Mask anything that looks like a credential; a last line of defence, not the only one."""
    text = _SECRET.sub(lambda m: f"{m.group(1)}{m.group(2)}{m.group(3) or ''}***", text)
    return _KEY_SHAPED.sub("***", text)


@dataclass(slots=True)
class ReportPacer:
    """Counts an event that repeats and says when one report may stand for it: at most once per ``interval``."""

    interval: float = 1.0
    last: float | None = None
    unreported: int = 0

    def count(self, now: float) -> int | None:
        """Count one event; how many a report made now stands for, or None while the last one is recent."""
        self.unreported += 1
        if self.last is not None and now - self.last < self.interval:
            return None
        return self.take(now)

    def take(self, now: float) -> int:
        """Report now: the events counted since the last report."""
        self.last = now
        count, self.unreported = self.unreported, 0
        return count


class ThrottledLog:
    """One log line per ``interval`` at most for an event an attacker could repeat at will.

    Each call counts the event; a line is written when the last one is at least
    ``interval`` old, and says how many events it stands for. Events held back are
    reported by one more line when the interval ends (inside an event loop), so a
    burst's tail is never lost.
    """

    def __init__(self, logger: logging.Logger, level: int, message: str, *,
                 interval: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._level = level
        self._message = message
        self._clock = clock
        self._pacer = ReportPacer(interval)
        self._args: tuple[object, ...] = ()
        self._flush_pending = False

    def event(self, *args: object) -> bool:
        """Count one event; log it (with the count) if the last line is old enough. True when logged."""
        self._args = args
        now = self._clock()
        count = self._pacer.count(now)
        if count is None:
            assert self._pacer.last is not None
            self._schedule_flush(self._pacer.last + self._pacer.interval - now)
            return False
        self._write(count)
        return True

    def flush(self) -> None:
        """Report the events held back since the last line, if any."""
        self._flush_pending = False
        if self._pacer.unreported:
            self._write(self._pacer.take(self._clock()))

    def _write(self, count: int) -> None:
        """The line; with how many events it stands for when they were more than this one."""
        if count == 1:
            self._logger.log(self._level, self._message, *self._args)
        else:
            self._logger.log(self._level, self._message + " (%d since the last report)", *self._args, count)

    def _schedule_flush(self, delay: float) -> None:
        if self._flush_pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._flush_pending = True
        loop.call_later(delay, self.flush)


_EARLY = 0.001
"""A timer may fire this much before its time by the wall clock (the loop keeps its own)."""


class _TimerClock(Protocol):
    """Wall-clock time in epoch seconds and one-shot timers (what ``proxy.limiter.Clock`` provides)."""

    def time(self) -> float: ...

    def call_later(self, delay: float, callback: Callable[[], None]) -> Any: ...


@dataclass(slots=True)
class _LevelMark:
    """One limit key's part of a storm: its limit before the storm and now, and its pause."""

    limit_from: int | None
    limit_to: int | None
    paused_until: float | None


@dataclass(slots=True)
class _Storm:
    started: float
    last_event: float
    pacer: ReportPacer
    causes: dict[str, int] = field(default_factory=dict)
    levels: dict[str | None, _LevelMark] = field(default_factory=dict)
    timer: Any = None
    relayed: int = 0
    """Backoff answers the proxy relayed to clients (no retry left) while the storm lasted."""

    @property
    def total(self) -> int:
        return sum(self.causes.values())

    def calm_at(self, interval: float) -> float:
        """One ``interval`` with no backoff after the last one and after every pause it caused ended."""
        pauses = [mark.paused_until for mark in self.levels.values() if mark.paused_until is not None]
        return max([self.last_event, *pauses]) + interval


class BackoffLog:
    """Upstream backoffs (429s, overloads), one summary per provider instead of a line per event.

    The first backoff of a storm is logged at once; while the storm goes on, at most
    one line per ``interval`` says how many there were since it began, how each limit
    moved and until when it is paused; once it has calmed down (no backoff for one
    ``interval`` after the last one and after its pauses ended) one last line sums it
    up. The metrics count every event; this is only what the log says. Both backends
    feed it from their ``report_backoff``, so memory and Redis log alike. The relay tells it
    (``relayed``) of each 429 that reached a client: the lines say how many of the storm's
    did, and ``relayed_total`` is what status shows beside ``rejected``.
    """

    def __init__(self, clock: _TimerClock, logger: logging.Logger | None = None, *, interval: float = 1.0) -> None:
        self._clock = clock
        self._logger = logger or logging.getLogger("slotproxy.backoff")
        self._interval = interval
        self._storms: dict[str, _Storm] = {}
        self._relayed: dict[str, int] = {}
        self._early: dict[str, tuple[int, float]] = {}
        """Relays that came before their storm began: the Redis backend logs a backoff when Redis has
        answered, which may be after the relay. A storm that begins within ``interval`` takes them."""

    def relayed(self, provider: str) -> None:
        """A 429 from ``provider`` was relayed to the client: its retries ran out, or it had none."""
        self._relayed[provider] = self._relayed.get(provider, 0) + 1
        storm = self._storms.get(provider)
        if storm is not None:
            storm.relayed += 1
            return
        now = self._clock.time()
        count, at = self._early.get(provider, (0, now))
        self._early[provider] = (count + 1 if now - at <= self._interval else 1, now)

    def relayed_total(self, provider: str) -> int:
        """The 429s from ``provider`` relayed to clients since this process started."""
        return self._relayed.get(provider, 0)

    def event(self, provider: str, cause: str, *, key: str | None = None, limit_before: int | None = None,
              limit_after: int | None = None, paused_until: float | None = None) -> None:
        """One backoff answer from ``provider`` (on pool key ``key``): the limit of the level it reached before
        and after it was counted, and when that level's pause ends (epoch seconds)."""
        now = self._clock.time()
        storm = self._storms.get(provider)
        first = storm is None
        if storm is None:
            storm = self._storms[provider] = _Storm(now, now, ReportPacer(self._interval))
            early, at = self._early.pop(provider, (0, now))
            if now - at <= self._interval:
                storm.relayed = early
        storm.last_event = now
        storm.causes[cause] = storm.causes.get(cause, 0) + 1
        mark = storm.levels.get(key)
        if mark is None:
            storm.levels[key] = _LevelMark(limit_before, limit_after, paused_until)
        else:
            mark.limit_to = limit_after
            if paused_until is not None and (mark.paused_until is None or paused_until > mark.paused_until):
                mark.paused_until = paused_until
        if storm.pacer.count(now) is not None:
            self._logger.warning("%s", self._line(provider, storm, now, first=first))
        self._arm(provider, storm, now)

    def _arm(self, provider: str, storm: _Storm, now: float) -> None:
        """Wake up when held-back events may be reported, or when the storm may have calmed down."""
        due = storm.calm_at(self._interval)
        flush_at = self._flush_at(storm)
        if flush_at is not None:
            due = min(due, flush_at)
        if storm.timer is not None:
            storm.timer.cancel()
        storm.timer = self._clock.call_later(max(0.0, due - now), lambda: self._wake(provider, storm))

    def _flush_at(self, storm: _Storm) -> float | None:
        """When the events held back since the last line are reported by a line of their own: one ``interval``
        after that line, unless the storm's last line (it calmed down) is due by then anyway."""
        if not storm.pacer.unreported or storm.pacer.last is None:
            return None
        flush_at = storm.pacer.last + self._interval
        return flush_at if storm.calm_at(self._interval) - flush_at > self._interval else None

    def _wake(self, provider: str, storm: _Storm) -> None:
        if self._storms.get(provider) is not storm:
            return
        storm.timer = None
        now = self._clock.time()
        if now >= storm.calm_at(self._interval) - _EARLY:
            del self._storms[provider]
            if storm.total > 1:
                self._logger.info("%s", self._calm_line(provider, storm))
            return
        flush_at = self._flush_at(storm)
        if flush_at is not None and now >= flush_at - _EARLY:
            storm.pacer.take(now)
            self._logger.warning("%s", self._line(provider, storm, now, first=False))
        self._arm(provider, storm, now)

    def _line(self, provider: str, storm: _Storm, now: float, *, first: bool) -> str:
        if first:
            head = f"upstream {next(iter(storm.causes))}"
        else:
            head = f"{_counts(storm.causes)} in the last {_seconds(now - storm.started)} s{_relayed(storm)}"
        return "; ".join([f"{provider}: {head}", *_level_parts(storm.levels, now)])

    def _calm_line(self, provider: str, storm: _Storm) -> str:
        head = f"calm again after {_counts(storm.causes)} in {_seconds(storm.last_event - storm.started)} s" \
            f"{_relayed(storm)}"
        return "; ".join([f"{provider}: {head}", *_level_parts(storm.levels, None)])


def _counts(causes: dict[str, int]) -> str:
    """``15 upstream 429s``, ``12 upstream 429s and 3 upstream overloaded_errors``."""
    parts = [f"{count} upstream {_plural(cause, count)}" for cause, count in causes.items()]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _relayed(storm: _Storm) -> str:
    """``, 6 relayed to clients``; nothing when every one was retried away."""
    return f", {storm.relayed} relayed to clients" if storm.relayed else ""


def _plural(cause: str, count: int) -> str:
    """``429s``, ``overloaded_errors``; a code that names no error as such: ``rate_limit_exceeded errors``."""
    if count == 1:
        return cause
    return cause + "s" if cause.isdigit() or cause.endswith("error") else f"{cause} errors"


def _seconds(seconds: float) -> str:
    """Whole seconds; under one, tenths (a pause about to end is still ``0.1``, never ``0.0``)."""
    tenths = max(1 if seconds > 0 else 0, round(seconds * 10))
    return str(round(seconds)) if tenths >= 10 else f"{tenths / 10:.1f}"


def _level_parts(levels: dict[str | None, _LevelMark], now: float | None) -> list[str]:
    """Each level's limit move and pause (pauses only while they last: ``now`` None leaves them out)."""
    parts = []
    for key, mark in levels.items():
        said = []
        if mark.limit_from is not None and mark.limit_to is not None and mark.limit_from != mark.limit_to:
            said.append(f"limit {mark.limit_from} → {mark.limit_to}")
        if now is not None and mark.paused_until is not None and mark.paused_until > now:
            clock_time = time.strftime("%H:%M:%S", time.localtime(mark.paused_until))
            said.append(f"paused until {clock_time} (in {_seconds(mark.paused_until - now)} s)")
        if key is None:
            parts.extend(said)
        elif said:
            parts.append(f"key {key}: " + ", ".join(said))
    return parts


class _MaskingFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return mask_secrets(super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object a line; a worker of ``serve --workers N`` adds ``"worker": N``."""

    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": mask_secrets(record.getMessage()),
        }
        if self.worker is not None:
            entry["worker"] = self.worker
        if record.exc_info:
            entry["exc"] = mask_secrets(self.formatException(record.exc_info))
        return json.dumps(entry, ensure_ascii=False)


class QuietParserErrors(logging.Filter):
    """aiohttp logs a malformed request with its raw bytes (and any key in them): keep only the error class."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError):
            record.msg, record.args = "rejected a bad request (%s)", (type(error).__name__,)
            record.exc_info = None
            record.exc_text = None
        return True


def setup_logging(fmt: str = "text", level: str = "INFO", *, worker: int | None = None) -> None:
    """Log to stderr; a worker of ``serve --workers N`` says which it is on every line (``worker=2``, or
    ``"worker": 2`` in JSON), as its lines share the parent's stderr."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(worker))
    else:
        tag = "" if worker is None else f"worker={worker} "
        handler.setFormatter(_MaskingFormatter(f"%(asctime)s %(levelname)s {tag}%(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    for name in ("aiohttp.server", "aiohttp.web"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, QuietParserErrors) for f in logger.filters):
            logger.addFilter(QuietParserErrors())
