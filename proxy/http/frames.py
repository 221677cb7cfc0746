"""Reading the Responses API's WebSocket frames: an event's ``type`` from the frame's opening (where every
provider writes it), without parsing the frames the relay does not act on."""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["CREATE", "TERMINAL", "event_type", "is_create", "parsed_frame"]

TERMINAL = frozenset({b"response.completed", b"response.failed", b"response.incomplete", b"error"})
"""The events that end a response."""
CREATE = b"response.create"
_TYPE_AT_START = re.compile(rb'\s*\{\s*"type"\s*:\s*"([a-z_.]{1,64})"')


def is_create(frame: bytes) -> bool:
    if CREATE not in frame[:256]:
        return False
    return event_type(frame) == CREATE


def event_type(frame: bytes) -> bytes | None:
    """An event's ``type``, read from the frame's opening where every provider writes it; a frame that puts
    it elsewhere is parsed only when it names a type the relay acts on."""
    match = _TYPE_AT_START.match(frame)
    if match is not None:
        return match.group(1)
    if not any(name in frame for name in (*TERMINAL, CREATE)):
        return None
    try:
        document = json.loads(frame)
    except (ValueError, RecursionError):
        return None
    kind = document.get("type") if isinstance(document, dict) else None
    return kind.encode() if isinstance(kind, str) else None


def parsed_frame(frame: bytes) -> dict[str, Any] | None:
    try:
        document = json.loads(frame)
    except (ValueError, RecursionError):
        return None
    return document if isinstance(document, dict) else None
