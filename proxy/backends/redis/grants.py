"""A grant as the scripts write it, read back: "lease granted_at key" (key empty without a pool), then
``w[version]`` when its window cost was taken with it (the cost of that version: 0 when none is written, see
WINDOW_RECOST; ``-`` when none was taken, before what held it), then what held it while it waited, as a
holder's code (``limiter.holding``: a level's code, or ``w:`` and the windows as JSON ``[[key, window], ...]``)."""

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
    version: int | None
    """The version of its window cost taken with the slot (None: no window cost was taken)."""
    holder: str | None
    """What held it, in the words both backends use (None: it went straight through)."""


def read_grant(grant: str) -> Grant:
    lease_id, granted_at, *rest = grant.split(" ", 4)
    key = (rest[0] or None) if rest else None
    took = rest[1] if len(rest) > 1 else ""
    held = rest[2] if len(rest) > 2 else None
    return Grant(lease_id, granted_at, key, int(took[1:] or 0) if took[:1] == "w" else None,
                 None if held is None else holder_words(held))


def holder_words(code: str) -> str:
    """A holder's code, as a grant names it, in words."""
    if not code.startswith("w:"):
        return level_words(code)
    try:
        return window_words((key or None, window) for key, window in json.loads(code[2:]))
    except (ValueError, TypeError):
        return code
