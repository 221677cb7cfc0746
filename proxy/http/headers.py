"""Request and response headers: hop-by-hop filtering, priority headers, provider auth."""

from __future__ import annotations

import functools
import json
import logging
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from multidict import CIMultiDict

from ..errors import BadRequest
from ..limiter import Priority
from ..limiter.policy import CLIENT_DEADLINE_MARGIN
from ..logs import ThrottledLog

__all__ = [
    "HOP_BY_HOP",
    "InvalidHeaderLog",
    "PriorityHeaders",
    "body_turn_started_at",
    "check_header_bytes",
    "client_wait_limit",
    "forward_request_headers",
    "forward_response_headers",
    "frame_turn_started_at",
    "parse_priority",
    "turn_started_at",
    "valid_label",
]

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade",
})
_NOT_FORWARDED_UP = HOP_BY_HOP | {"host", "content-length", "expect"}
_NOT_RELAYED_DOWN = HOP_BY_HOP | {"content-length"}
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})
_MAX_LABEL = 256
_LABEL = re.compile(r"^[\x21-\x7e][\x20-\x7e]*$")
_EPOCH_MS = re.compile(r"^[0-9]{10,16}(\.[0-9]+)?$")
_RFC3339 = re.compile(
    r"^[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,9})?([Zz]|[+-][0-9]{2}:[0-9]{2})$"
)
_EARLIEST = datetime(2000, 1, 1, tzinfo=UTC).timestamp()
_FUTURE_SLACK = 300.0
_PRIORITY_KEYS = ("workspace", "starred", "prompt_started_at", "conversation")

log = logging.getLogger("slotproxy.headers")


class InvalidHeaderLog:
    """Says why a priority header's value was refused, at most once a minute per header (a client may send
    the same bad value on every request; the metric counts each). Never the value: it is the client's."""

    def __init__(self, *, interval: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._logs = {key: ThrottledLog(log, logging.WARNING, "priority header %s (headers.%s) refused: %s; "
                                        "its default is used", interval=interval, clock=clock)
                      for key in _PRIORITY_KEYS}

    def refused(self, key: str, header: str, why: str) -> None:
        self._logs[key].event(header, key, why)


@dataclass(frozen=True, slots=True)
class PriorityHeaders:
    """Header names, keyed as under the config's ``headers:`` section."""

    workspace: str = "X-Workspace-Id"
    starred: str = "X-Workspace-Starred"
    prompt_started_at: str = "X-Prompt-Started-At"
    conversation: str = "X-Conversation-Id"
    max_prompt_age: float = 86400.0
    """An older prompt start counts as exactly this old, so no header puts a client ahead of every honest one."""
    refusals: InvalidHeaderLog | None = field(default=None, compare=False, repr=False)
    """Where a refused value is said (None: nowhere; the caller still counts it)."""

    def names(self) -> frozenset[str]:
        return frozenset(n.lower() for n in (self.workspace, self.starred, self.prompt_started_at, self.conversation))


def valid_label(value: str) -> bool:
    """A workspace or conversation id: printable ASCII, no leading space, at most 256 chars."""
    return len(value) <= _MAX_LABEL and bool(_LABEL.match(value))


def _label(value: str) -> str:
    value = value.strip()
    if not valid_label(value):
        raise ValueError(f"longer than {_MAX_LABEL} characters" if len(value) > _MAX_LABEL
                         else "empty, or not printable ASCII")
    return value


def _starred(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError("not one of 1, true, yes, on, 0, false, no, off")


def _prompt_started_at(value: str, now: float) -> float:
    """Epoch milliseconds or RFC 3339, within [2000-01-01, now + 5 min]; else ValueError (saying which rule,
    not the value)."""
    value = value.strip()
    if _EPOCH_MS.match(value):
        when = float(value) / 1000.0
    else:
        if not _RFC3339.match(value):
            raise ValueError("neither epoch milliseconds nor an RFC 3339 time")
        try:
            when = datetime.fromisoformat(value.upper().replace(" ", "T")).timestamp()
        except ValueError:  # its own message would quote the value
            raise ValueError("an RFC 3339 time that is no real date or time of day") from None
    if not _EARLIEST <= when <= now + _FUTURE_SLACK:
        raise ValueError("before 2000-01-01 or more than 5 minutes ahead of this proxy's clock")
    return when


def _refused(invalid: list[str], names: PriorityHeaders, key: str, header: str, why: ValueError) -> None:
    invalid.append(key)
    if names.refusals is not None:
        names.refusals.refused(key, header, str(why))


def parse_priority(
    headers: Mapping[str, str], names: PriorityHeaders, now: float, body: bytes = b"",
    transport: str = "http",
) -> tuple[Priority, list[str]]:
    """Read a request's priority; an invalid value falls back to its default.

    The prompt start is the header's, else Codex's turn metadata header's, else the
    same field in the JSON ``body`` (``client_metadata``), else ``now``.
    Returns the priority and the config keys (``workspace``, ``starred``,
    ``prompt_started_at``, ``conversation``) of the headers that were invalid.
    """
    invalid: list[str] = []
    get = headers.get
    workspace, starred, started, conversation = "default", False, now, None
    if (raw := get(names.workspace)) is not None:  # each absent header costs one lookup, not a call
        try:
            workspace = _label(raw)
        except ValueError as exc:
            _refused(invalid, names, "workspace", names.workspace, exc)
    if (raw := get(names.starred)) is not None:
        try:
            starred = _starred(raw)
        except ValueError as exc:
            _refused(invalid, names, "starred", names.starred, exc)
    if (raw := get(names.prompt_started_at)) is not None:
        try:
            started = _prompt_started_at(raw, now)
        except ValueError as exc:
            _refused(invalid, names, "prompt_started_at", names.prompt_started_at, exc)
    elif (raw := get(CODEX_TURN_METADATA)) is not None:
        started = _turn_started_at(raw, now)
    elif body and _TURN_METADATA_KEY in body:
        started = body_turn_started_at(body, now) or now
    started = max(started, now - names.max_prompt_age)
    if (raw := get(names.conversation)) is not None:
        try:
            conversation = _label(raw)
        except ValueError as exc:
            _refused(invalid, names, "conversation", names.conversation, exc)
    else:
        conversation = _agent_session(headers)
    return Priority(prompt_started_at=started, workspace=workspace, starred=starred, conversation=conversation,
                    transport=transport), invalid


CODEX_TURN_METADATA = "x-codex-turn-metadata"
_TURN_METADATA_KEY = b'"x-codex-turn-metadata"'
_MAX_TURN_METADATA = 4096
_JSON_VALUE = json.JSONDecoder()
AGENT_SESSION_HEADERS = ("X-Claude-Code-Session-Id", "session-id")
"""Where agents name their conversation themselves: Claude Code, then Codex."""
CLIENT_TIMEOUT_HEADERS = ("X-Stainless-Timeout", "X-Stainless-Read-Timeout")


def _turn_started_at(metadata: str, now: float) -> float:
    """Codex's ``x-codex-turn-metadata`` JSON: ``turn_started_at_unix_ms``, when valid; else ``now``."""
    found = turn_started_at(metadata, now)
    return now if found is None else found


def turn_started_at(metadata: object, now: float) -> float | None:
    """Codex's turn metadata (a JSON string): its ``turn_started_at_unix_ms`` in epoch seconds, None when
    absent or invalid (a warm-up's metadata carries none)."""
    if not isinstance(metadata, str) or not metadata or len(metadata) > _MAX_TURN_METADATA:
        return None
    try:
        document = json.loads(metadata)
    except (ValueError, RecursionError):
        return None
    value = document.get("turn_started_at_unix_ms") if isinstance(document, dict) else None
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    when = value / 1000.0
    return when if _EARLIEST <= when <= now + _FUTURE_SLACK else None


def frame_turn_started_at(document: Mapping[str, object], now: float) -> float | None:
    """The turn start a ``response.create`` frame (or a Responses API body) carries in
    ``client_metadata["x-codex-turn-metadata"]``; None when it carries none."""
    metadata = document.get("client_metadata")
    if not isinstance(metadata, dict):
        return None
    return turn_started_at(metadata.get(CODEX_TURN_METADATA), now)


def body_turn_started_at(body: bytes, now: float) -> float | None:
    """The body's ``"x-codex-turn-metadata": "<JSON>"`` value, found without parsing the whole body (it may
    be megabytes of conversation). A quoted key inside a JSON string is escaped (``\\"``), so what this
    finds is a key of the document."""
    at = body.find(_TURN_METADATA_KEY) + len(_TURN_METADATA_KEY)
    rest = body[at:at + 2 * _MAX_TURN_METADATA].lstrip()
    if not rest.startswith(b":"):
        return None
    try:
        value, _ = _JSON_VALUE.raw_decode(rest[1:].lstrip().decode("utf-8", "replace"))
    except (ValueError, RecursionError):
        return None
    return turn_started_at(value, now)


def _agent_session(headers: Mapping[str, str]) -> str | None:
    for name in AGENT_SESSION_HEADERS:
        value = headers.get(name)
        if value is not None:
            value = value.strip()
            if valid_label(value):
                return value
    return None


def client_wait_limit(headers: Mapping[str, str]) -> float | None:
    """How long a request may wait in the queue before its client gives up on its own (Anthropic and
    OpenAI SDKs send their timeout), less ``CLIENT_DEADLINE_MARGIN``; None when it said nothing usable."""
    limits = []
    for name in CLIENT_TIMEOUT_HEADERS:
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            seconds = float(raw.strip())
        except ValueError:
            continue  # NOT_GIVEN and other non-numbers
        if math.isfinite(seconds) and seconds > 0:
            limits.append(seconds)
    return max(0.0, min(limits) - CLIENT_DEADLINE_MARGIN) if limits else None


@functools.lru_cache(maxsize=256)
def _not_passed(names: tuple[str, ...], connection: str | None, always: frozenset[str],
                also: frozenset[str] = frozenset(), keep_cors: bool = True) -> tuple[str, ...]:
    """Which of ``names`` are not passed on: ``always``, ``also``, what the Connection header lists and,
    unless ``keep_cors``, ``Access-Control-*``.

    Cached by the names as sent: a client or an upstream sends the same headers in the same order on
    every request, so the per-request work is a copy and a few deletes, not a test of every name."""
    listed = frozenset(token.strip().lower() for token in connection.split(",") if token.strip()) \
        if connection else frozenset()
    drop = always | also | listed
    return tuple(dict.fromkeys(
        name for name in names
        if (lowered := name.lower()) in drop or (not keep_cors and lowered.startswith("access-control-"))))


def _passed_on(incoming: Mapping[str, str], always: frozenset[str], also: frozenset[str] = frozenset(),
               keep_cors: bool = True) -> CIMultiDict[str]:
    out = CIMultiDict(incoming)
    for name in _not_passed(tuple(incoming), incoming.get("Connection"), always, also, keep_cors):
        out.popall(name, None)
    return out


_DROP_UP_WITH_AUTH = _NOT_FORWARDED_UP | {"authorization", "x-api-key"}


def forward_request_headers(
    incoming: Mapping[str, str],
    *,
    strip: frozenset[str],
    auth: tuple[str, str] | None,
) -> CIMultiDict[str]:
    """Headers to send upstream: hop-by-hop, Host and priority headers dropped; auth replaced.

    ``strip`` holds lower-case names to drop (the priority headers). ``auth`` is
    (header, value) of the provider key; when given, the client's own
    Authorization and x-api-key are both removed first.
    """
    out = _passed_on(incoming, _NOT_FORWARDED_UP if auth is None else _DROP_UP_WITH_AUTH, strip)
    if auth is not None:
        out.add(*auth)
    return out


def check_header_bytes(incoming: Mapping[str, str], *, skip: frozenset[str]) -> None:
    """Refuse forwarded header values with bytes that are not UTF-8 (aiohttp keeps them as lone
    surrogates, and its client would drop them silently on the way upstream). ``skip`` holds the
    lower-case names that are never forwarded (the priority headers: those fall back instead)."""
    if all(map(str.isascii, incoming.values())):
        return
    for name, value in incoming.items():
        if not value.isascii() and name.lower() not in skip and any("\udc80" <= ch <= "\udcff" for ch in value):
            raise BadRequest(f"header {name[:64]} carries bytes that are not UTF-8; send it encoded")


def forward_response_headers(incoming: Mapping[str, str], *, keep_cors: bool = False) -> CIMultiDict[str]:
    """Headers to relay to the client: everything but hop-by-hop (Content-Length is set separately).

    ``Access-Control-*`` headers are relayed only when ``keep_cors``: the request came
    from a browser origin the config allows. Otherwise an upstream's
    ``Access-Control-Allow-Origin: *`` would let any page read the answer.
    """
    return _passed_on(incoming, _NOT_RELAYED_DOWN, keep_cors=keep_cors)
