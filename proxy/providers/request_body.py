"""A request's JSON body as the token windows read it: parsed on first look, and its output maximum, read from
its bytes when they settle it (OpenAI's windows need only that and the body's length).

Pure: bytes in, values out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["RequestBody", "as_parsed", "max_output"]

_MAX_KEYS = ("max_tokens", "max_output_tokens", "max_completion_tokens")


def max_output(request: Mapping[str, Any]) -> int | None:
    """The request's own output maximum (a WebSocket frame may nest it in its ``response``); the largest
    when it names several."""
    nested = request.get("response")
    places = (request, nested) if isinstance(nested, dict) else (request,)
    found = [value for place in places for name in _MAX_KEYS
             if type(value := place.get(name)) is int and value > 0]
    return max(found) if found else None


_MAX_MARK = b'"max_'
_BACKSLASH = ord("\\")
_LAST_MAX = re.compile(
    rb'"(?:max_tokens|max_output_tokens|max_completion_tokens)"\s*:\s*(-?\d{1,18})(?=[\s,}])[^}]*\}\s*\Z')
"""A maximum followed by one ``}``, the body's last byte but whitespace: the object it is in is the body's."""


class RequestBody(Mapping[str, Any]):
    """A request's JSON body, parsed on first look ({} when it is not a JSON object). OpenAI's windows need
    only its bytes and its output maximum, which ``max_output`` reads without a parse when the body names
    one once, after its objects (as SDKs write it, after the messages)."""

    __slots__ = ("_data", "body")

    def __init__(self, body: bytes) -> None:
        self.body = body
        self._data: dict[str, Any] | None = None

    def parsed(self) -> dict[str, Any]:
        data = self._data
        if data is None:
            data = self._data = _parsed(self.body)
        return data

    def __getitem__(self, name: str) -> Any:
        return self.parsed()[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.parsed().get(name, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self.parsed())

    def __len__(self) -> int:
        return len(self.parsed())

    def max_output(self) -> int | None:
        """``max_output`` of the parsed body, read from its bytes when they settle it: the body names one
        maximum, and the only ``}`` after it is the body's last byte, so the object it is in is the body's."""
        if self._data is None:
            body = self.body
            at = body.find(_MAX_MARK)
            if at < 0:
                return None
            if body.find(_MAX_MARK, at + 1) < 0 and (at == 0 or body[at - 1] != _BACKSLASH):
                found = _LAST_MAX.match(body, at)
                if found is not None:
                    value = int(found.group(1))
                    return value if value > 0 else None
        return max_output(self.parsed())


def as_parsed(request: Mapping[str, Any]) -> Mapping[str, Any]:
    return request.parsed() if type(request) is RequestBody else request


def _parsed(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}
