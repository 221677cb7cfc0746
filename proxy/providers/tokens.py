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
from collections.abc import Callable
from json.scanner import make_scanner
from typing import Any, ClassVar, NamedTuple, cast

__all__ = ["USAGE_MARK", "TokenCounts", "UsageReader"]

USAGE_MARK = b'"usage"'
"""Text without this cannot carry usage: the scanners look for it before anything else."""
_MARK_LENGTH = len(USAGE_MARK)
_OBJECT_OPENS = re.compile(rb'\s*:\s*\{')
_FIRST_WINDOW = 2048
_SCAN_ONCE: Callable[[str, int], tuple[Any, int]] = make_scanner(cast(Any, json.JSONDecoder()))
"""The decoder's C scanner: one JSON value at an index, without ``raw_decode``'s wrapper around it."""
_MAX_OBJECT = 64 * 1024
_MAX_COUNT = 1 << 53
_new_counts = tuple.__new__
_MODEL = re.compile(rb'"model"\s*:\s*"([^"\\]{1,200})"')
"""An object's ``model`` key (one inside a JSON string is escaped, and does not match)."""


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

    __slots__ = ("_fields", "_totals", "model")

    with_model: ClassVar[bool] = False
    """Also note the model the answer names (traces show it): read from the text a usage object was found in."""

    def __init__(self) -> None:
        self._fields: dict[str, Any] = {}
        self._totals: tuple[int, int, int, int, int] | None = None
        """``totals()`` once asked, until another usage object comes (the windows and the ledger both ask)."""
        self.model: str | None = None

    def add(self, usage: object) -> None:
        if isinstance(usage, dict) and usage:
            self._fields.update(usage)
            self._totals = None

    def read(self, text: bytes) -> None:
        """Every ``"usage": {...}`` object in one complete JSON text (an event's line, a frame, a whole body),
        found by a byte search and parsed alone (the rest of the text, a long answer's content say, is never
        parsed). A key inside a JSON string is escaped (``\\"usage\\"``), so what is found is an object's key."""
        fields = self._fields
        at = text.find(USAGE_MARK)
        while at >= 0:
            at += _MARK_LENGTH
            usage = _object_at(text, at)
            if usage:
                fields.update(usage)
                self._totals = None
                if self.with_model and self.model is None:
                    self._note_model(text)
            at = text.find(USAGE_MARK, at)

    def _note_model(self, text: bytes) -> None:
        found = _MODEL.search(text)
        if found is not None:
            self.model = found.group(1).decode("utf-8", "replace")

    def counts(self) -> TokenCounts | None:
        """The normalised counts, or None when the answer stated none."""
        totals = _normalised(self._fields) if self._fields else None
        return None if totals is None else _new_counts(TokenCounts, totals)

    def totals(self) -> tuple[int, int, int, int, int] | None:
        """``counts()`` as a plain tuple, in its order: what a ledger row is made of, without the named tuple."""
        totals = self._totals
        if totals is None and self._fields:
            totals = self._totals = _normalised(self._fields)
        return totals


def _object_at(text: bytes, after_key: int) -> dict[str, Any] | None:
    """The JSON object after a ``"usage"`` key's colon, parsed alone (read from a small window first: usage
    objects are a few hundred bytes)."""
    if text[after_key:after_key + 2] == b":{":  # as providers write it: no spaces
        start = after_key + 1
    else:
        opening = _OBJECT_OPENS.match(text, after_key)
        if opening is None:
            return None
        start = opening.end() - 1
    try:
        value = _SCAN_ONCE(text[start:start + _FIRST_WINDOW].decode("utf-8", "replace"), 0)[0]
    except (StopIteration, ValueError, RecursionError):
        if start + _FIRST_WINDOW >= len(text):
            return None
        try:
            value = _SCAN_ONCE(text[start:start + _MAX_OBJECT].decode("utf-8", "replace"), 0)[0]
        except (StopIteration, ValueError, RecursionError):
            return None
    return value if type(value) is dict else None


def _normalised(fields: dict[str, Any]) -> tuple[int, int, int, int, int] | None:
    """The five counts of ``TokenCounts``, as a plain tuple. Each count is checked where it is read, written out:
    this runs at the end of every request that stated its usage, and a call per count is a frame per count."""
    get = fields.get
    if "prompt_tokens" in fields or "completion_tokens" in fields:
        total_in, total_out = get("prompt_tokens"), get("completion_tokens")
        sent, received = get("prompt_tokens_details"), get("completion_tokens_details")
    elif "input_tokens" in fields or "output_tokens" in fields:
        creation, read = get("cache_creation_input_tokens"), get("cache_read_input_tokens")
        if creation is not None or read is not None:  # Anthropic: input_tokens leaves the cache's out
            return _anthropic(get("input_tokens"), read, creation, get("output_tokens"))
        total_in, total_out = get("input_tokens"), get("output_tokens")
        sent, received = get("input_tokens_details"), get("output_tokens_details")
    else:
        return None
    cached = sent.get("cached_tokens") if type(sent) is dict else None
    reasoning = received.get("reasoning_tokens") if type(received) is dict else None
    return (total_in if type(total_in) is int and 0 <= total_in < _MAX_COUNT else 0,
            cached if type(cached) is int and 0 <= cached < _MAX_COUNT else 0,
            0,
            total_out if type(total_out) is int and 0 <= total_out < _MAX_COUNT else 0,
            reasoning if type(reasoning) is int and 0 <= reasoning < _MAX_COUNT else 0)


def _anthropic(uncached: object, cached: object, written: object, output: object) -> tuple[int, int, int, int, int]:
    """Token counts as stated; anything else (null, a string, a bool, a negative or absurd number) is 0."""
    uncached = uncached if type(uncached) is int and 0 <= uncached < _MAX_COUNT else 0
    cached = cached if type(cached) is int and 0 <= cached < _MAX_COUNT else 0
    written = written if type(written) is int and 0 <= written < _MAX_COUNT else 0
    return (uncached + cached + written, cached, written,
            output if type(output) is int and 0 <= output < _MAX_COUNT else 0, 0)
