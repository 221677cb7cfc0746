"""Reading rate-limit answers from upstream providers.

Pure functions over headers and body bytes: no I/O, and time is an argument.
The relay asks :func:`classify_response` whether a response should pause the
provider, and feeds every chunk of a 200 stream to a :class:`StreamErrorScanner`
to catch rate-limit errors that arrive inside the stream.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC
from email.utils import parsedate_to_datetime
from typing import Any

from .budgets import lowercase_headers
from .decoders import StreamDecoder, decoder_for
from .tokens import USAGE_MARK, UsageReader

__all__ = [
    "MAX_WAIT",
    "Backoff",
    "DecodedStreamScanner",
    "StreamErrorScanner",
    "classify_response",
    "ends_event_stream",
    "event_backoff",
    "is_refusal",
    "readable_body",
    "stated_wait",
    "stream_scanner",
]

MAX_WAIT = 86400.0
"""Longest stated wait honoured, in seconds; longer ones are capped to this."""

_MAX_BODY = 1 << 20
"""Error bodies are small; a larger body is not parsed, so a hostile or broken
upstream cannot make every backoff cost a multi-megabyte JSON decode."""

_MAX_LINE = 64 * 1024
_ERROR_MARK = b"error"
_LONGEST_MARK = len(USAGE_MARK) - 1

_NUMBER = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*")
_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)s\s*")

_MS_HEADERS = ("retry-after-ms", "x-ms-retry-after-ms")
_RATE_LIMITS = frozenset({"rate_limit_error", "rate_limit_exceeded"})
_OVERLOADED = "overloaded"
"""An error whose type or code contains this is the provider's own overload (Anthropic's
``overloaded_error``, OpenAI's ``server_is_overloaded``): it pauses, never lowers the limit."""
_QUOTA_FAILURE = "google.rpc.QuotaFailure"
_TRY_AGAIN = re.compile(r"try again in\s+((?:\d+(?:\.\d+)?(?:h|ms|m|s))+)", re.IGNORECASE)
_WORD_UNITS = re.compile(r"(\d+(?:\.\d+)?)(h|ms|m|s)")
_UNIT_SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
RATE_LIMIT_STATUS = 429
OVERLOAD_STATUS = 529


@dataclass(frozen=True, slots=True)
class Backoff:
    """An upstream answer that should pause the provider.

    ``cause`` names it in the auto-reduce notice: the status code (``"429"``)
    or the in-stream error type (``"overloaded_error"``). ``wait`` is the
    upstream's stated wait in seconds, or None when it stated none.
    """

    cause: str
    wait: float | None
    status: int = RATE_LIMIT_STATUS
    """The status it counts as for ``reduce_statuses``: its own, or 429 for an in-stream rate limit
    and 529 for an in-stream overload."""


def readable_body(body: bytes, content_encoding: str | None) -> bytes:
    """A bounded, decoded copy of an error body for reading it; the bytes relayed stay as they came."""
    decoder = decoder_for(content_encoding)
    if decoder is None:
        return body
    pieces: list[bytes] = []
    size = 0
    try:
        for piece in decoder.decode(body):
            pieces.append(piece)
            size += len(piece)
            if size > _MAX_BODY:
                break
    except ValueError:
        return b""
    return b"".join(pieces)[:_MAX_BODY]


def stream_scanner(content_encoding: str | None, usage: UsageReader | None = None) \
        -> StreamErrorScanner | DecodedStreamScanner | None:
    """The scanner for one event stream: plain, or reading a decoded copy of a compressed one
    (gzip, deflate, br, zstd); None for an encoding it cannot read. With ``usage``, the lines that
    carry a usage object are read into it too."""
    encoding = (content_encoding or "").strip().lower()
    if encoding in ("", "identity"):
        return StreamErrorScanner(usage)
    decoder = decoder_for(encoding)
    return DecodedStreamScanner(decoder, usage) if decoder is not None else None


def stated_wait(headers: Mapping[str, str], body: bytes | None, now: float) -> float | None:
    """Seconds to wait as stated by upstream, or None when it stated nothing usable.

    Sources, first usable one wins: ``retry-after-ms``, ``x-ms-retry-after-ms``,
    ``retry-after`` (seconds or an HTTP date, relative to ``now`` in epoch
    seconds), a Gemini-style body ``error.details[].retryDelay``, then the
    error message's words (``Please try again in 6.379s``). An invalid or
    negative value falls through to the next source.
    """
    found = _header_wait(lowercase_headers(headers), now)
    if found is None:
        found = _body_wait(_load_json(body))
    return found


_FINAL_DATA = b"[DONE]"
_FINAL_EVENTS = frozenset({b"message_stop", b"response.completed", b"response.incomplete", b"response.failed"})


def ends_event_stream(tail: bytes) -> bool:
    """Whether ``tail``, the last bytes of an event stream (uncompressed), ends with the stream's final event:
    OpenAI's ``data: [DONE]``, Anthropic's ``message_stop``, the Responses API's ``response.completed`` (or
    ``.incomplete``, ``.failed``). A client may hang up once it has that event, before the body's end: the
    OpenAI SDK does, at ``[DONE]``."""
    if not tail.endswith((b"\n\n", b"\r\n\r\n", b"\r\r")):
        return False  # the last event is unfinished
    last = tail.replace(b"\r\n", b"\n").replace(b"\r", b"\n").rstrip(b"\n").rpartition(b"\n\n")[2]
    for line in last.split(b"\n"):
        field, _, value = line.partition(b":")
        value = value.strip()
        if (field == b"data" and value == _FINAL_DATA) or (field == b"event" and value in _FINAL_EVENTS):
            return True
    return False


def is_refusal(body: bytes | None) -> bool:
    """True when an error body says no wait will help: a quota used up, billing, a spend limit.

    Such an answer is relayed as it is: no pause, no reduction, no retry.
    """
    return any(_refuses(error) for error in _errors(_load_json(body)))


def classify_response(
    status: int,
    headers: Mapping[str, str],
    body: bytes | None,
    backoff_statuses: Collection[int],
    now: float,
) -> Backoff | None:
    """The backoff a response calls for, or None when it calls for none."""
    if status not in backoff_statuses or is_refusal(body):
        return None
    return Backoff(cause=str(status), wait=stated_wait(headers, body, now), status=status)


class StreamErrorScanner:
    """Watches one SSE stream for rate-limit errors sent after a 200 status, and for its usage.

    Feed it every chunk as relayed; it reports the first rate-limit error and
    nothing after that, and hands every usage object to its ``UsageReader`` (if
    given). Chunks are cut anywhere by the network, so only the unfinished last
    line is carried over (at most 64 KiB; a longer line is dropped). A chunk that
    cannot complete a line containing ``error`` or ``"usage"`` costs a few byte
    searches, which keeps the scanner off the relay's hot path.
    """

    __slots__ = ("_marks", "_reported", "_skipping", "_tail", "_tail_hit", "usage")

    def __init__(self, usage: UsageReader | None = None) -> None:
        self._tail = bytearray()
        self._tail_hit = False
        self._skipping = False
        self._reported = False
        self.usage = usage
        self._marks: tuple[bytes, ...] = (_ERROR_MARK, USAGE_MARK) if usage is not None else (_ERROR_MARK,)

    def feed(self, chunk: bytes) -> Backoff | None:
        """Scan the next chunk; the backoff if it completes a rate-limit error event."""
        if not self._marks or not chunk:
            return None
        if self._tail_hit or self._marked(chunk) or self._marks_span(chunk):
            return self._scan(chunk)
        self._carry(chunk)
        return None

    def _marked(self, text: bytes | bytearray) -> bool:
        for mark in self._marks:
            if mark in text:
                return True
        return False

    def _marks_span(self, chunk: bytes) -> bool:
        return bool(self._tail) and self._marked(self._tail[-_LONGEST_MARK:] + chunk[:_LONGEST_MARK])

    def _carry(self, chunk: bytes) -> None:
        cut = chunk.rfind(b"\n")
        if cut >= 0:
            self._start_line()
            chunk = chunk[cut + 1 :]
        self._append(chunk)

    def _scan(self, chunk: bytes) -> Backoff | None:
        cut = chunk.rfind(b"\n")
        if cut < 0:
            self._append(chunk)
            self._tail_hit = not self._skipping
            return None
        lines = chunk[:cut].split(b"\n")
        if self._skipping:
            lines[0] = b""
        else:
            lines[0] = bytes(self._tail) + lines[0]
        self._start_line()
        found = self._lines(lines)
        self._append(chunk[cut + 1 :])
        self._tail_hit = self._marked(self._tail)
        return found

    def _lines(self, lines: list[bytes]) -> Backoff | None:
        found = None
        usage = self.usage
        for line in lines:
            if usage is not None and USAGE_MARK in line:
                usage.read(line)
            if not self._reported and _ERROR_MARK in line:
                found = _stream_error(line.rstrip(b"\r"))
                if found is not None:
                    self._reported = True
                    self._marks = (USAGE_MARK,) if usage is not None else ()
        return found

    def _start_line(self) -> None:
        self._tail.clear()
        self._tail_hit = False
        self._skipping = False

    def _append(self, piece: bytes) -> None:
        if self._skipping:
            return
        self._tail += piece
        if len(self._tail) > _MAX_LINE:
            self._tail.clear()
            self._tail_hit = False
            self._skipping = True


class DecodedStreamScanner:
    """A ``StreamErrorScanner`` fed with the decoded copy of a compressed stream, in bounded pieces.

    Its cost is per chunk only on compressed streams; a stream that cannot be
    decoded stops being scanned (the client still gets every byte)."""

    __slots__ = ("_decoder", "_scanner")

    def __init__(self, decoder: StreamDecoder, usage: UsageReader | None = None) -> None:
        self._decoder: StreamDecoder | None = decoder
        self._scanner = StreamErrorScanner(usage)

    def feed(self, chunk: bytes) -> Backoff | None:
        if self._decoder is None:
            return None
        found = None
        try:
            for piece in self._decoder.decode(chunk):
                found = self._scanner.feed(piece) or found
        except ValueError:
            self._decoder = None
        if found is not None and self._scanner.usage is None:
            self._decoder = None  # nothing more to read in it
        return found



def _header_wait(headers: Mapping[str, str], now: float) -> float | None:
    for name in _MS_HEADERS:
        millis = _number(headers.get(name))
        if millis is not None:
            return _capped(millis / 1000.0)
    value = headers.get("retry-after")
    if value is None:
        return None
    seconds = _number(value)
    if seconds is None:
        seconds = _seconds_until(value, now)
    return None if seconds is None else _capped(seconds)


def _number(value: str | None) -> float | None:
    """A non-negative decimal number; None for anything else (signs, nan, junk)."""
    if value is None:
        return None
    match = _NUMBER.fullmatch(value)
    return float(match.group(1)) if match else None


def _seconds_until(http_date: str, now: float) -> float | None:
    """Seconds from ``now`` to an HTTP date, 0 when it is past, None when invalid."""
    try:
        when = parsedate_to_datetime(http_date)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    try:
        return max(0.0, when.timestamp() - now)
    except (ValueError, OverflowError):
        return None


def _capped(seconds: float) -> float:
    return min(seconds, MAX_WAIT)


def _body_wait(document: Any) -> float | None:
    errors = list(_errors(document))
    for error in errors:
        for detail in _dicts(error.get("details")):
            delay = detail.get("retryDelay")
            match = _DURATION.fullmatch(delay) if isinstance(delay, str) else None
            if match:
                return _capped(float(match.group(1)))
    for error in errors:
        found = _words_wait(error.get("message"))
        if found is not None:
            return found
    return None


def _words_wait(message: object) -> float | None:
    """A wait stated in words: ``Please try again in 6.379s``, ``try again in 20ms``, ``in 1m30s``."""
    if not isinstance(message, str):
        return None
    match = _TRY_AGAIN.search(message)
    if match is None:
        return None
    seconds = sum(float(n) * _UNIT_SECONDS[unit] for n, unit in _WORD_UNITS.findall(match.group(1)))
    return _capped(seconds)


def _refuses(error: dict[str, Any]) -> bool:
    """Quota used up (OpenAI ``insufficient_quota``, a Gemini per-day QuotaFailure), billing
    (Anthropic ``billing_error``), or a spend limit in the type, code or ``details.error_code``."""
    kind, code = error.get("type"), error.get("code")
    if "insufficient_quota" in (code, kind) or kind == "billing_error":
        return True
    details = error.get("details")
    detail_code = details.get("error_code") if isinstance(details, dict) else None
    if any(isinstance(v, str) and "spend_limit" in v for v in (kind, code, detail_code)):
        return True
    return any(_is_daily_quota_failure(detail) for detail in _dicts(details))


def _is_daily_quota_failure(detail: dict[str, Any]) -> bool:
    kind = detail.get("@type")
    if not (isinstance(kind, str) and kind.endswith(_QUOTA_FAILURE)):
        return False
    for violation in _dicts(detail.get("violations")):
        for key in ("quotaId", "quotaMetric"):
            name = violation.get(key)
            if isinstance(name, str) and _names_daily_quota(name):
                return True
    return False


def _names_daily_quota(name: str) -> bool:
    """Gemini ids read ``GenerateRequestsPerDayPerProjectPerModel``; metrics use ``per_day``."""
    folded = name.lower()
    return "perday" in folded or "per_day" in folded


def _load_json(body: bytes | None) -> Any:
    if not body or len(body) > _MAX_BODY:
        return None
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def _errors(document: Any) -> Iterator[dict[str, Any]]:
    """The ``error`` objects of a body: one object, or a JSON array of them (Gemini)."""
    items = document if isinstance(document, list) else [document]
    for item in _dicts(items):
        error = item.get("error")
        if isinstance(error, dict):
            yield error


def _dicts(value: Any) -> Iterator[dict[str, Any]]:
    if isinstance(value, list):
        yield from (item for item in value if isinstance(item, dict))


def _first_stream_error(lines: list[bytes]) -> Backoff | None:
    for line in lines:
        if b"error" in line:
            found = _stream_error(line.rstrip(b"\r"))
            if found is not None:
                return found
    return None


def _stream_error(line: bytes) -> Backoff | None:
    """The backoff an SSE ``data:`` line calls for (see ``event_backoff``)."""
    if not line.startswith(b"data:"):
        return None
    document = _load_json(line[5:])
    return event_backoff(document) if isinstance(document, dict) else None


def event_backoff(document: dict[str, Any]) -> Backoff | None:
    """The backoff one stream event calls for: an SSE ``data:`` line's JSON, or a WebSocket frame's.

    Anthropic sends ``{"type": "error", "error": {"type": "overloaded_error"}}``;
    OpenAI-style servers send ``{"error": {"code": "rate_limit_exceeded"}}``; the
    Responses API a top-level ``{"type": "error", "code": ...}``, or a
    ``response.failed`` event carrying ``response.error``; its WebSocket mode an
    ``error`` frame with the answer's ``status`` (429) beside the error. Text deltas
    that merely mention "error" have no such object and are ignored, and so are
    refusals no wait helps (billing, spend limits).
    """
    error = _event_error(document)
    if error is None or _refuses(error):
        return None
    for value in (error.get("type"), error.get("code")):
        if not isinstance(value, str):
            continue
        if value in _RATE_LIMITS:
            return Backoff(cause=value, wait=_event_wait(document, error), status=RATE_LIMIT_STATUS)
        if _OVERLOADED in value:
            return Backoff(cause=value, wait=_event_wait(document, error), status=OVERLOAD_STATUS)
    if document.get("status") == RATE_LIMIT_STATUS:
        cause = error.get("code") or error.get("type")
        return Backoff(cause=cause if isinstance(cause, str) and cause else str(RATE_LIMIT_STATUS),
                       wait=_event_wait(document, error), status=RATE_LIMIT_STATUS)
    return None


def _event_error(document: dict[str, Any]) -> dict[str, Any] | None:
    error = document.get("error")
    if isinstance(error, dict):
        return error
    kind = document.get("type")
    if kind == "error":
        return document
    if kind == "response.failed":
        response = document.get("response")
        failed = response.get("error") if isinstance(response, dict) else None
        return failed if isinstance(failed, dict) else None
    return None


def _event_wait(document: dict[str, Any], error: dict[str, Any]) -> float | None:
    found = _body_wait(document)
    return found if found is not None else _words_wait(error.get("message"))
