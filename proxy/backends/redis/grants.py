"""A grant as the scripts write it, read back: "lease granted_at key", then ``w`` when its window cost was
taken with it (``-`` when not, before what held it), then what held it while it waited, as a holder's code
(``limiter.holding``: a level's code, or ``w:`` and the windows as JSON ``[[key, window], ...]``)."""

from __future__ import annotations

import json
from typing import NamedTuple

from ...limiter.holding import level_words, window_words

__all__ = ["Grant", "read_grant"]


class Grant(NamedTuple):
    lease_id: str
    granted_at: str
    key: str | None
    """The pool key it was granted on (None without a pool)."""
    took: bool
    """Its window cost was taken with the slot."""
    holder: str | None
    """What held it, in the words both backends use (None: it went straight through)."""


def read_grant(grant: str) -> Grant:
    lease_id, granted_at, *rest = grant.split(" ", 4)
    key = (rest[0] or None) if rest else None
    held = rest[2] if len(rest) > 2 else None
    return Grant(lease_id, granted_at, key, rest[1:2] == ["w"], None if held is None else holder_words(held))


def holder_words(code: str) -> str:
    """A holder's code, as a grant names it, in words."""
    if not code.startswith("w:"):
        return level_words(code)
    try:
        return window_words((key or None, window) for key, window in json.loads(code[2:]))
    except (ValueError, TypeError):
        return code
