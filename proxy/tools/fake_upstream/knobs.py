"""The fault-injection knobs: the ``x-fake-*`` request headers, validated; a WebSocket frame's ``x_fake``
object merged over its handshake's headers (the WebSocket mode and its own knobs are described in
``websocket``); the TCP reset that ``reset-after`` and ``drop-after`` end with (``abort``).

Request headers inject faults (so a test can reach them through a proxy):

==============================  ===============================================
``x-fake-tag``                  recorded in ``arrivals`` (else the body's ``user``)
``x-fake-status: N``            answer status N, once admitted, with the route's
                                error shape
``x-fake-no-retry-after``       ``1``: that 429 carries no Retry-After headers
``x-fake-error-code``           the error ``code``/``type`` of that answer
``x-fake-stall-ms: N``          wait N ms before sending the response headers
``x-fake-reset-after: K``       stream K chunks, then reset the connection
                                (non-streaming: reset before any answer)
``x-fake-gzip: 1``              gzip a non-streaming answer (with Content-Length)
``x-fake-encoding: E``          compress a streaming answer on the fly with
                                Content-Encoding E (``gzip``, ``deflate``, ``br``
                                or ``zstd``), flushed after every event
``x-fake-stream-error: T``      after one chunk, an in-stream error of type (or
                                code) T, then end
``x-fake-stream-error-form: F`` Responses API only: ``failed`` (default) sends
                                ``response.failed``, ``event`` a top-level
                                ``error`` event
``x-fake-chunks``               per-request ``chunks``
``x-fake-delay-ms``             per-request ``delay_ms``
``x-fake-ratelimit-headers``    a JSON object of header names to string values,
                                added verbatim to that answer (error or not),
                                over any header of the same name
``x-fake-usage``                the token usage that answer reports, as a JSON
                                object of normalised figures ``input`` (I, all
                                input), ``cached`` (C), ``cache_write`` (W),
                                ``output`` (O, all output) and ``reasoning``
                                (R): each an integer >= 0 and optional (I: the
                                body's size // 4, at least 1; O: the chunks;
                                the others 0); stated in the route's own shape
                                (``dialects``). Any other value, C + W above I,
                                or R above O is a 400
``x-fake-usage-deltas: N``      Anthropic streams: N ``message_delta`` events
                                (an integer >= 1, default 1), in ``dialects``
==============================  ===============================================

``br`` uses the ``brotli`` package and ``zstd`` the standard library's (or its
backport's) ``compression.zstd``, both installed with slotproxy.
"""

from __future__ import annotations

import json
import math
import re
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from .dialects import compact

__all__ = [
    "Cut",
    "Kind",
    "Knobs",
    "SocketKnobs",
    "abort",
    "flag",
    "in_range",
    "number_header",
    "socket_knob_headers",
    "socket_tag",
]

_STREAM_ERROR_FORMS = frozenset({"failed", "event"})
_ENCODINGS = frozenset({"gzip", "deflate", "br", "zstd"})
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_USAGE_FIGURES = ("input", "cached", "cache_write", "output", "reasoning")


class Defaults(Protocol):
    """Where a knob left unset takes its value from: the fake's own options."""

    chunks: int
    delay_ms: float


Kind = type[int] | type[float]


def in_range(raw: str, kind: Kind, low: float, high: float = math.inf) -> int | float | None:
    """``raw`` read as ``kind`` when it lies in [low, high] (NaN never does), else None."""
    try:
        value = kind(raw)
    except ValueError:
        return None
    return value if low <= value <= high else None


def number_header(
    headers: Mapping[str, str], name: str, kind: Kind, low: float, what: str, high: float = math.inf
) -> Any:
    raw = headers.get(name)
    if raw is None:
        return None
    value = in_range(raw, kind, low, high)
    if value is None:
        raise ValueError(f"{name} must be {what}, got {raw!r}")
    return value


def flag(headers: Mapping[str, str], name: str) -> bool:
    return headers.get(name, "").strip().lower() in {"1", "true", "yes"}


def _choice(headers: Mapping[str, str], name: str, allowed: Mapping[str, Any] | frozenset[str]) -> str | None:
    raw = headers.get(name)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(sorted(allowed))}, got {raw!r}")
    return value


def _encoding(headers: Mapping[str, str]) -> str | None:
    return _choice(headers, "x-fake-encoding", _ENCODINGS)


def _header_object(headers: Mapping[str, str], name: str) -> dict[str, str]:
    """The JSON object of header names to string values in header ``name``, each checked to be sendable."""
    raw = headers.get(name)
    if raw is None:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, dict) or not all(isinstance(item, str) for item in value.values()):
        raise ValueError(f"{name} must be a JSON object of header names to string values, got {raw!r}")
    for header, item in value.items():
        if not _HEADER_NAME.fullmatch(header) or any(c in item for c in "\r\n\0"):
            raise ValueError(f"{name} holds a header no answer can carry: {header!r}: {item!r}")
    return value


def _usage_object(headers: Mapping[str, str]) -> dict[str, int]:
    """The token figures ``x-fake-usage`` sets: a JSON object of ``_USAGE_FIGURES`` to integers >= 0."""
    name = "x-fake-usage"
    raw = headers.get(name)
    if raw is None:
        return {}
    try:
        decoded = json.loads(raw)
    except ValueError:
        decoded = None
    value: dict[str, Any] | None = decoded if isinstance(decoded, dict) else None
    if value is None:
        raise ValueError(f"{name} must be a JSON object of token figures ({', '.join(_USAGE_FIGURES)}), got {raw!r}")
    for figure, count in value.items():
        if figure not in _USAGE_FIGURES:
            raise ValueError(f"{name} has no figure {figure!r}; the figures are {', '.join(_USAGE_FIGURES)}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"{name}: {figure} must be an integer >= 0, got {compact(count)}")
    return value


@dataclass(frozen=True)
class Knobs:
    """The fault-injection headers of one request, validated."""

    status: int | None
    retry_after: bool
    error_code: str | None
    stall_ms: float
    reset_after: int | None
    gzip: bool
    encoding: str | None
    stream_error: str | None
    stream_error_form: str
    chunks: int
    delay_ms: float
    ratelimit_headers: dict[str, str]
    usage: dict[str, int]
    usage_deltas: int

    @classmethod
    def parse(cls, headers: Mapping[str, str], defaults: Defaults) -> Knobs:
        chunks = number_header(headers, "x-fake-chunks", int, 1, "an integer >= 1")
        delay = number_header(headers, "x-fake-delay-ms", float, 0, "a number of ms >= 0")
        return cls(
            status=number_header(headers, "x-fake-status", int, 100, "an HTTP status code"),
            retry_after=not flag(headers, "x-fake-no-retry-after"),
            error_code=headers.get("x-fake-error-code") or None,
            stall_ms=number_header(headers, "x-fake-stall-ms", float, 0, "a number of ms >= 0") or 0.0,
            reset_after=number_header(headers, "x-fake-reset-after", int, 0, "an integer >= 0"),
            gzip=flag(headers, "x-fake-gzip"),
            encoding=_encoding(headers),
            stream_error=headers.get("x-fake-stream-error") or None,
            stream_error_form=_choice(headers, "x-fake-stream-error-form", _STREAM_ERROR_FORMS) or "failed",
            chunks=defaults.chunks if chunks is None else chunks,
            delay_ms=defaults.delay_ms if delay is None else delay,
            ratelimit_headers=_header_object(headers, "x-fake-ratelimit-headers"),
            usage=_usage_object(headers),
            usage_deltas=number_header(headers, "x-fake-usage-deltas", int, 1, "an integer >= 1") or 1,
        )


_KNOB_PREFIX = "x-fake-"
_SOCKET_KNOBS = frozenset({
    "chunks", "delay-ms", "stall-ms", "status", "no-retry-after", "error-code", "tag",
    "stream-error", "stream-error-form", "close-after", "drop-after", "usage",
})
_OBJECT_KNOBS = frozenset({"usage"})
"""Frame knobs given as a JSON object (their header holds its JSON text)."""
_REFUSAL_STATUSES = (200, 599)


def _knob_text(name: str, value: Any) -> str:
    """A frame knob's JSON value as the header value it stands for."""
    if name in _OBJECT_KNOBS:
        if isinstance(value, dict):
            return compact(value)
        raise ValueError(f"x_fake.{name} must be a JSON object, got {compact(value)}")
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, str | int | float):
        return str(value)
    raise ValueError(f"x_fake.{name} must be a string, a number or a boolean, got {compact(value)}")


def socket_knob_headers(handshake: Mapping[str, str], frame_knobs: Any) -> dict[str, str]:
    """One response's knobs as headers: the handshake's, overridden by the frame's ``x_fake`` (null unsets)."""
    merged = {name: value for name, value in handshake.items()
              if name.startswith(_KNOB_PREFIX) and name.removeprefix(_KNOB_PREFIX) in _SOCKET_KNOBS}
    if frame_knobs is None:
        return merged
    if not isinstance(frame_knobs, dict):
        raise TypeError(f"x_fake must be a JSON object, got {compact(frame_knobs)}")
    for name, value in frame_knobs.items():
        if name not in _SOCKET_KNOBS:
            raise ValueError(f"x_fake has no knob {name!r}; the knobs are {', '.join(sorted(_SOCKET_KNOBS))}")
        if value is None:
            merged.pop(_KNOB_PREFIX + name, None)
        else:
            merged[_KNOB_PREFIX + name] = _knob_text(name, value)
    return merged


def socket_tag(handshake: Mapping[str, str], frame_knobs: Any) -> str | None:
    if isinstance(frame_knobs, dict) and isinstance(frame_knobs.get("tag"), str):
        return str(frame_knobs["tag"])
    return handshake.get("x-fake-tag")


@dataclass(frozen=True)
class Cut:
    """Where a response is cut off: after ``after`` deltas, by a 1011 close or (``drop``) a TCP reset."""

    after: int
    drop: bool


@dataclass(frozen=True)
class SocketKnobs(Knobs):
    """One WebSocket response's knobs: the HTTP ones that apply, and the cut."""

    cut: Cut | None = None

    @classmethod
    def parse(cls, headers: Mapping[str, str], defaults: Defaults) -> SocketKnobs:
        close_after = number_header(headers, "x-fake-close-after", int, 0, "an integer >= 0")
        drop_after = number_header(headers, "x-fake-drop-after", int, 0, "an integer >= 0")
        if close_after is not None and drop_after is not None:
            raise ValueError("close-after and drop-after cannot both be set")
        cut = None if close_after is None and drop_after is None else \
            Cut(close_after if drop_after is None else drop_after, drop=drop_after is not None)
        return cls(**vars(Knobs.parse(headers, defaults)), cut=cut)


def abort(request: web.Request) -> None:
    """Close the connection with a TCP reset, so the client sees an abrupt failure, not an EOF."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    transport.abort()
