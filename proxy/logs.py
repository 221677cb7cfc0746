"""Log setup: one line per event worth knowing, as text or JSON, with secrets masked."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp.http_exceptions import HttpProcessingError

__all__ = ["JsonFormatter", "QuietParserErrors", "ReportPacer", "ThrottledLog", "mask_secrets", "setup_logging"]

_SECRET = re.compile(
    r"(?i)(authorization|x-api-key|api[_-]?key|token|bearer)(\"?\s*[:=]?\s*\"?)(bearer\s+)?([A-Za-z0-9._~+/=-]{8,})"
)
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


class _MaskingFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return mask_secrets(super().format(record))


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": mask_secrets(record.getMessage()),
        }
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


def setup_logging(fmt: str = "text", level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(_MaskingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    for name in ("aiohttp.server", "aiohttp.web"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, QuietParserErrors) for f in logger.filters):
            logger.addFilter(QuietParserErrors())
