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
from dataclasses import dataclass
from typing import Any

__all__ = ["USAGE_MARK", "TokenCounts", "UsageReader", "usage_in"]

USAGE_MARK = b'"usage"'
"""Text without this cannot carry usage: the scanners look for it before anything else."""
_USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')
_DECODER = json.JSONDecoder()
_MAX_OBJECT = 64 * 1024
_MAX_COUNT = 1 << 53


@dataclass(frozen=True, slots=True)
class TokenCounts:
    input_tokens: int = 0
    cached_input_tokens: int = 0
    cache_write_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"input_tokens": self.input_tokens, "cached_input_tokens": self.cached_input_tokens,
                "cache_write_tokens": self.cache_write_tokens, "output_tokens": self.output_tokens,
                "reasoning_tokens": self.reasoning_tokens}


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
    if USAGE_MARK not in text:
        return []
    found = []
    for match in _USAGE_OBJECT.finditer(text):
        start = match.end() - 1
        try:
            value, _ = _DECODER.raw_decode(text[start:start + _MAX_OBJECT].decode("utf-8", "replace"))
        except (ValueError, RecursionError):
            continue
        if isinstance(value, dict):
            found.append(value)
    return found


def _normalised(fields: dict[str, Any]) -> TokenCounts | None:
    if "prompt_tokens" in fields or "completion_tokens" in fields:
        return TokenCounts(
            input_tokens=_count(fields.get("prompt_tokens")),
            cached_input_tokens=_count(_detail(fields, "prompt_tokens_details", "cached_tokens")),
            output_tokens=_count(fields.get("completion_tokens")),
            reasoning_tokens=_count(_detail(fields, "completion_tokens_details", "reasoning_tokens")),
        )
    if "input_tokens" not in fields and "output_tokens" not in fields:
        return None
    creation, read = fields.get("cache_creation_input_tokens"), fields.get("cache_read_input_tokens")
    if creation is not None or read is not None:  # Anthropic
        return TokenCounts(
            input_tokens=_count(fields.get("input_tokens")) + _count(creation) + _count(read),
            cached_input_tokens=_count(read),
            cache_write_tokens=_count(creation),
            output_tokens=_count(fields.get("output_tokens")),
        )
    return TokenCounts(
        input_tokens=_count(fields.get("input_tokens")),
        cached_input_tokens=_count(_detail(fields, "input_tokens_details", "cached_tokens")),
        output_tokens=_count(fields.get("output_tokens")),
        reasoning_tokens=_count(_detail(fields, "output_tokens_details", "reasoning_tokens")),
    )


def _detail(fields: dict[str, Any], section: str, name: str) -> object:
    details = fields.get(section)
    return details.get(name) if isinstance(details, dict) else None


def _count(value: object) -> int:
    """A token count as stated; anything else (null, a string, a negative or absurd number) is 0."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX_COUNT:
        return 0
    return value
