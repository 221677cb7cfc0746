"""What an answer says it cost: the token counts every provider states in its answers, normalised.

Pure functions over bytes and parsed JSON: no I/O. The relay finds the usage
objects in the bytes it already scans (a stream's lines, a whole answer's body,
a WebSocket's terminal event) and hands each one here; nothing is held back
from the client and no text that cannot carry usage is parsed.

Shapes read (each usage object's own keys say which it is):

- OpenAI chat: ``prompt_tokens`` (``prompt_tokens_details.cached_tokens``),
  ``completion_tokens`` (``completion_tokens_details.reasoning_tokens``). A
  stream carries them in its last chunk only when the client asked
  ``stream_options.include_usage``; otherwise the counts are unknown.
- Responses API: ``input_tokens`` (``input_tokens_details.cached_tokens``),
  ``output_tokens`` (``output_tokens_details.reasoning_tokens``), in the JSON
  answer or the terminal event's ``response``.
- Anthropic Messages: ``input_tokens``, ``cache_creation_input_tokens``,
  ``cache_read_input_tokens``, ``output_tokens``; a stream's ``message_start``
  carries them and each ``message_delta`` restates some of them cumulatively:
  the later value replaces the earlier, it is never added.

Normalised: ``input_tokens`` is all input, cached included (for Anthropic,
input + cache creation + cache read); ``cached_input_tokens`` was read from a
cache; ``cache_write_tokens`` was written to one; ``output_tokens`` includes
``reasoning_tokens``. A count the shape does not carry is 0.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

__all__ = ["USAGE_MARK", "TokenCounts", "UsageReader", "usage_in"]

USAGE_MARK = b'"usage"'
"""Text without this cannot carry usage: the scanners look for it before anything else."""
_OBJECT_OPENS = re.compile(rb'\s*:\s*\{')
_FIRST_WINDOW = 2048
_DECODER = json.JSONDecoder()
_MAX_OBJECT = 64 * 1024
_MAX_COUNT = 1 << 53


class TokenCounts(NamedTuple):
    """A tuple: one is built at the end of every request that stated its usage."""

    input_tokens: int = 0
    cached_input_tokens: int = 0
    cache_write_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0

    def to_dict(self) -> dict[str, int]:
        return self._asdict()


class UsageReader:
    """The usage objects of one answer, merged: a later object's fields replace an earlier one's."""

    __slots__ = ("_fields",)

    def __init__(self) -> None:
        self._fields: dict[str, Any] = {}

    def add(self, usage: object) -> None:
        if isinstance(usage, dict) and usage:
            self._fields.update(usage)

    def read(self, text: bytes) -> None:
        """Every usage object in one complete JSON text (an event's line, a frame, a whole body)."""
        for usage in usage_in(text):
            self.add(usage)

    def counts(self) -> TokenCounts | None:
        """The normalised counts, or None when the answer stated none."""
        return _normalised(self._fields) if self._fields else None


def usage_in(text: bytes) -> list[dict[str, Any]]:
    """The ``"usage": {...}`` objects in a JSON text, found by a byte search and parsed alone (the rest of
    the text, a long answer's content say, is never parsed). A key inside a JSON string is escaped
    (``\\"usage\\"``), so what is found is an object's key."""
    found = []
    at = text.find(USAGE_MARK)
    while at >= 0:
        value = _object_at(text, at + len(USAGE_MARK))
        if value is not None:
            found.append(value)
        at = text.find(USAGE_MARK, at + len(USAGE_MARK))
    return found


def _object_at(text: bytes, after_key: int) -> dict[str, Any] | None:
    """The JSON object after a ``"usage"`` key's colon, parsed alone (read from a small window first: usage
    objects are a few hundred bytes)."""
    opening = _OBJECT_OPENS.match(text, after_key)
    if opening is None:
        return None
    start = opening.end() - 1
    for window in (_FIRST_WINDOW, _MAX_OBJECT):
        try:
            value, _ = _DECODER.raw_decode(text[start:start + window].decode("utf-8", "replace"))
        except (ValueError, RecursionError):
            if start + window >= len(text):
                return None
            continue
        return value if isinstance(value, dict) else None
    return None


def _normalised(fields: dict[str, Any]) -> TokenCounts | None:
    get = fields.get
    if "prompt_tokens" in fields or "completion_tokens" in fields:
        return TokenCounts(_count(get("prompt_tokens")), _count(_detail(fields, "prompt_tokens_details", "cached_tokens")),
                           0, _count(get("completion_tokens")),
                           _count(_detail(fields, "completion_tokens_details", "reasoning_tokens")))
    if "input_tokens" not in fields and "output_tokens" not in fields:
        return None
    creation, read = get("cache_creation_input_tokens"), get("cache_read_input_tokens")
    if creation is not None or read is not None:  # Anthropic
        written, cached = _count(creation), _count(read)
        return TokenCounts(_count(get("input_tokens")) + written + cached, cached, written,
                           _count(get("output_tokens")), 0)
    return TokenCounts(_count(get("input_tokens")), _count(_detail(fields, "input_tokens_details", "cached_tokens")),
                       0, _count(get("output_tokens")),
                       _count(_detail(fields, "output_tokens_details", "reasoning_tokens")))


def _detail(fields: dict[str, Any], section: str, name: str) -> object:
    details = fields.get(section)
    return details.get(name) if isinstance(details, dict) else None


def _count(value: object) -> int:
    """A token count as stated; anything else (null, a string, a bool, a negative or absurd number) is 0."""
    return value if type(value) is int and 0 <= value < _MAX_COUNT else 0
