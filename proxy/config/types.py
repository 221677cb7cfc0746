"""The config's validated value types: durations and sizes (parsed, formatted back, and described in the
JSON Schema), limits, counts, ports and statuses, names (provider ids, key names, environment variable
names, header names), URLs, hosts and origins. Each rejects a bad value with a message that states the
rule (``must be a duration such as 250ms, 30s, 5m or 1h``).
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeAlias
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    PlainSerializer,
    WithJsonSchema,
)

from ..limiter.policy import MAX_LIMIT, validate_limit

__all__ = [
    "MASK",
    "PROVIDER_NAMES_SCHEMA",
    "RESERVED_PROVIDER_IDS",
    "AllowedHost",
    "Auth",
    "BackendUrl",
    "ConnectionCount",
    "Count",
    "DottedPath",
    "Duration",
    "EnvName",
    "HeaderName",
    "Headroom",
    "KeyName",
    "Limit",
    "Method",
    "Methods",
    "ModelPattern",
    "NonEmptyStr",
    "Origin",
    "Port",
    "PositiveDuration",
    "PositiveIntOrNull",
    "ProviderId",
    "RedisAddress",
    "Seconds",
    "Share",
    "Size",
    "Status",
    "Statuses",
    "Upstream",
    "UsageUrl",
    "Usd",
    "WindowLimit",
    "env_name_for_display",
    "format_duration",
    "format_size",
    "looks_like_a_key",
    "parse_duration",
    "parse_size",
]

RESERVED_PROVIDER_IDS = frozenset({"metrics", "healthz", "readyz"})

_NUMBER = r"\d+(?:\.\d+)?"
_DURATION_TEXT = re.compile(rf"(?:{_NUMBER}(?:ms|s|m|h|d))+")
_DURATION_PART = re.compile(rf"({_NUMBER})(ms|s|m|h|d)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_HINT = "must be a duration such as 250ms, 30s, 5m, 1h or 30d"

_SIZE_TEXT = re.compile(rf"({_NUMBER})\s*([KMGT]i?B|B)?", re.IGNORECASE)
_SIZE_UNITS = {
    "b": 1,
    **{f"{p}b": 1000 ** (i + 1) for i, p in enumerate("kmgt")},
    **{f"{p}ib": 1024 ** (i + 1) for i, p in enumerate("kmgt")},
}
_SIZE_HINT = "must be a size such as 512KiB or 32MiB, or a number of bytes"

_PROVIDER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HTTP_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_DOTTED_PATH = re.compile(r"[^.\s]+(?:\.[^.\s]+)*")
MASK = "***"


# --- durations and sizes -------------------------------------------------------------


def parse_duration(value: object) -> float:
    """Seconds from a number or a string such as ``250ms``, ``30s``, ``5m``, ``1h``, ``1m30s``."""
    if isinstance(value, str):
        seconds = _duration_from_text(value.strip())
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise ValueError(_DURATION_HINT)  # noqa: TRY004 - pydantic reports ValueError, not TypeError
    if not math.isfinite(seconds):
        raise ValueError(_DURATION_HINT)
    if seconds < 0:
        raise ValueError("must not be negative")
    return seconds


def _duration_from_text(text: str) -> float:
    sign = -1.0 if text.startswith("-") else 1.0
    text = text.removeprefix("-")
    if re.fullmatch(_NUMBER, text):
        return sign * float(text)
    if _DURATION_TEXT.fullmatch(text):
        parts = _DURATION_PART.findall(text)
        return sign * sum(float(n) * _DURATION_UNITS[unit] for n, unit in parts)
    raise ValueError(_DURATION_HINT)


def _positive_duration(value: object) -> float:
    seconds = parse_duration(value)
    if seconds == 0:
        raise ValueError("must be longer than 0s")
    return seconds


def format_duration(seconds: float) -> str:
    """The shortest exact spelling: ``0s``, ``250ms``, ``1.5s``, ``90s``, ``5m``, ``1h``, ``30d``."""
    ms = seconds * 1000
    if abs(ms - round(ms)) > 1e-6:
        return f"{seconds:g}s"
    whole_ms = round(ms)
    if whole_ms == 0:
        return "0s"
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if whole_ms % size == 0:
            return f"{whole_ms // size}{unit}"
    return f"{seconds:g}s" if whole_ms >= 1000 else f"{whole_ms}ms"


def parse_size(value: object) -> int:
    """Bytes from an integer or a string such as ``512KiB``, ``32MiB``, ``1GiB`` or ``10MB``."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (match := _SIZE_TEXT.fullmatch(value.strip())):
        number, unit = match.groups()
        size = round(float(number) * _SIZE_UNITS[(unit or "b").lower()])
    else:
        raise ValueError(_SIZE_HINT)
    if size < 0:
        raise ValueError("must not be negative")
    return size


def _positive_size(value: object) -> int:
    size = parse_size(value)
    if size == 0:
        raise ValueError("must be larger than 0 bytes")
    return size


def format_size(size: int) -> str | int:
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if size and size % factor == 0:
            return f"{size // factor}{unit}"
    return size


def _duration_schema(exclusive: bool) -> dict[str, Any]:
    bound = {"exclusiveMinimum": 0} if exclusive else {"minimum": 0}
    return {
        "anyOf": [
            {"type": "number", **bound},
            {"type": "string", "pattern": rf"^(?:{_NUMBER}|(?:{_NUMBER}(?:ms|s|m|h|d))+)$"},
        ],
        "description": "seconds, or a duration such as 250ms, 30s, 5m, 1h, 30d",
    }


def _size_schema() -> dict[str, Any]:
    return {
        "anyOf": [
            {"type": "integer", "minimum": 1},
            {"type": "string", "pattern": r"^\d+(?:\.\d+)?\s*(?:[KkMmGgTt][Ii]?)?[Bb]$|^\d+$"},
        ],
        "description": "bytes, or a size such as 512KiB, 32MiB, 1GiB (KB/MB/GB are powers of 1000)",
    }


_AS_DURATION = PlainSerializer(format_duration, return_type=str, when_used="json-unless-none")
_AS_SIZE = PlainSerializer(format_size, return_type=str | int, when_used="json-unless-none")

Seconds = Annotated[float, _AS_DURATION]
Duration = Annotated[
    float, BeforeValidator(parse_duration), _AS_DURATION, WithJsonSchema(_duration_schema(False))
]
PositiveDuration = Annotated[
    float, BeforeValidator(_positive_duration), _AS_DURATION, WithJsonSchema(_duration_schema(True))
]
Size = Annotated[int, BeforeValidator(_positive_size), _AS_SIZE, WithJsonSchema(_size_schema())]


# --- small validated types -----------------------------------------------------------


def _int_type(message: str, low: int, high: int | None = None, *, nullable: bool = False) -> Any:
    """An int type whose every failure (wrong type, out of range) reads as ``message``."""

    def check(value: object) -> int | None:
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(message)  # noqa: TRY004 - pydantic reports ValueError, not TypeError
        if value < low or (high is not None and value > high):
            raise ValueError(message)
        return value

    schema: dict[str, Any] = {"type": "integer", "minimum": low}
    if high is not None:
        schema["maximum"] = high
    if nullable:
        nullable_schema = {"anyOf": [schema, {"type": "null"}]}
        return Annotated[int | None, BeforeValidator(check), WithJsonSchema(nullable_schema)]
    return Annotated[int, BeforeValidator(check), WithJsonSchema(schema)]


def _matching(pattern: re.Pattern[str], message: str) -> AfterValidator:
    def check(value: str) -> str:
        if not pattern.fullmatch(value):
            raise ValueError(message)
        return value

    return AfterValidator(check)


def _unique(values: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(dict.fromkeys(values))


def _check_method(value: str) -> str:
    if not _HTTP_TOKEN.fullmatch(value):
        raise ValueError("must be an HTTP method name such as POST")
    return value.upper()


def _check_provider_id(name: str) -> str:
    if name.startswith("_") or name.lower() in RESERVED_PROVIDER_IDS:
        raise ValueError(
            "reserved for the proxy's own routes "
            "(ids starting with _, metrics, healthz, readyz)"
        )
    if not _PROVIDER_ID.fullmatch(name):
        raise ValueError(
            "a provider id must start with a letter or digit and contain only "
            "letters, digits, '.', '_' and '-'"
        )
    return name


def _http_url(value: str, *, allow_query: bool) -> str:
    value = value.strip()
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise ValueError("must be an http:// or https:// URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an http:// or https:// URL")
    if parts.username is not None or parts.password is not None:
        raise ValueError("must not contain credentials (use api_key_env or usage.headers)")
    if not allow_query and ("?" in value or "#" in value):
        raise ValueError("must not have a query string or fragment")
    return value


def _check_upstream(value: str) -> str:
    return _http_url(value, allow_query=False).rstrip("/")


def _check_usage_url(value: str) -> str:
    return _http_url(value, allow_query=True)


def _check_backend_url(value: str) -> str:
    if not value.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError("must be a redis://, rediss:// or unix:// URL")
    return value


_HOST_NAME = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)(?::[0-9]{1,5})?")
_ORIGIN = re.compile(r"https?://(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)(?::[0-9]{1,5})?")


def _check_allowed_host(value: str) -> str:
    value = value.strip().lower()
    if value != "*" and not _HOST_NAME.fullmatch(value):
        raise ValueError('must be a host name as clients send it in Host (such as slotproxy.agents.svc or '
                         'proxy.local:8787), or "*" for any')
    return value


def _check_origin(value: str) -> str:
    value = value.strip().lower()
    if not _ORIGIN.fullmatch(value):
        raise ValueError("must be a browser origin: scheme://host[:port] with no path, such as http://localhost:3000")
    return value


def _checked_limit(value: object) -> int | None:
    """The limiter's own rule (``policy.validate_limit``), in the config's words."""
    try:
        return validate_limit(value)
    except ValueError:
        raise ValueError("must be a positive integer or null") from None


_URL_SCHEMA = WithJsonSchema({"type": "string", "format": "uri", "pattern": "^https?://"})

NonEmptyStr = Annotated[str, Field(min_length=1)]


def _check_share(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError("must be a share of the provider's slots: a number above 0 and at most 1, such as 0.5")
    return float(value)


Share = Annotated[float, BeforeValidator(_check_share), WithJsonSchema(
    {"type": "number", "exclusiveMinimum": 0, "maximum": 1})]

def _check_usd(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError("must be an amount of US dollars: a number, 0 or more, such as 3.75")
    return float(value)


Usd = Annotated[float, BeforeValidator(_check_usd), WithJsonSchema({"type": "number", "minimum": 0})]
"""US dollars (a price per million tokens, a cap per day): a finite number, 0 or more."""


def _check_headroom(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError("must be the fraction of each window left unused: a number from 0 up to (not including) "
                         "1, such as 0.05")
    return float(value)


Headroom = Annotated[float, BeforeValidator(_check_headroom), WithJsonSchema(
    {"type": "number", "minimum": 0, "exclusiveMaximum": 1})]

if TYPE_CHECKING:
    Limit: TypeAlias = int | None
    WindowLimit: TypeAlias = int
    PositiveIntOrNull: TypeAlias = int | None
    Port: TypeAlias = int
    Count: TypeAlias = int
    Status: TypeAlias = int
    ConnectionCount: TypeAlias = int
else:
    Limit = Annotated[int | None, BeforeValidator(_checked_limit), WithJsonSchema(
        {"anyOf": [{"type": "integer", "minimum": 1, "maximum": MAX_LIMIT}, {"type": "null"}]})]
    PositiveIntOrNull = Limit
    Port = _int_type("must be a port number from 0 to 65535", 0, 65535)
    Count = _int_type("must be a whole number, 0 or more", 0)
    Status = _int_type("must be an HTTP status code from 400 to 599", 400, 599)
    ConnectionCount = _int_type("must be a whole number from 1 to 1000000", 1, 1_000_000)
    WindowLimit = _int_type("must be a whole number per minute, 1 or more (leave the window out to hold none)", 1)
EnvName = Annotated[
    str,
    _matching(
        _ENV_NAME,
        "must be the NAME of an environment variable (letters, digits and _), not its value",
    ),
]
HeaderName = Annotated[
    str, _matching(_HTTP_TOKEN, "must be an HTTP header name (letters, digits and !#$%&'*+-.^_`|~)")
]
Method = Annotated[str, AfterValidator(_check_method)]
Methods = Annotated[tuple[Method, ...], AfterValidator(_unique)]
Statuses = Annotated[tuple[Status, ...], AfterValidator(_unique)]
ProviderId = Annotated[str, AfterValidator(_check_provider_id)]
Upstream = Annotated[str, AfterValidator(_check_upstream), _URL_SCHEMA]
UsageUrl = Annotated[str, AfterValidator(_check_usage_url), _URL_SCHEMA]
DottedPath = Annotated[
    str, _matching(_DOTTED_PATH, "must be a dotted path such as data.sessions.active")
]
BackendUrl = Annotated[str, AfterValidator(_check_backend_url)]
_REDIS_ADDRESS = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):[0-9]{1,5}")
RedisAddress = Annotated[str, _matching(_REDIS_ADDRESS, "must be host:port, such as redis-1:6379")]
AllowedHost = Annotated[str, AfterValidator(_check_allowed_host)]
Origin = Annotated[str, AfterValidator(_check_origin)]
Auth = Literal["bearer", "x-api-key"]
_KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
KeyName = Annotated[str, _matching(_KEY_NAME, "a key name must start with a letter or digit and contain only "
                                              "letters, digits, '.', '_' and '-'")]
ModelPattern = Annotated[str, Field(min_length=1, max_length=200)]
PROVIDER_NAMES_SCHEMA: dict[str, Any] = {
    "propertyNames": {
        "pattern": f"^{_PROVIDER_ID.pattern}$",
        "not": {"enum": sorted(RESERVED_PROVIDER_IDS)},
    }
}


# --- names that may be keys ---------------------------------------------------------


_KEY_FORMATS = re.compile(
    # Provider and platform keys made only of letters, digits and _ (so they could be variable names): Google
    # (Gemini) API keys, Groq, GitHub, Hugging Face, AWS access key ids. Keys with a dash (sk-..., sk-ant-...)
    # cannot be variable names anyway.
    r"AIza[0-9A-Za-z_]{35}|gsk_[0-9A-Za-z]{40,}|gh[pousr]_[0-9A-Za-z]{36,}|github_pat_[0-9A-Za-z_]{40,}"
    r"|hf_[0-9A-Za-z]{30,}|A[KS]IA[0-9A-Z]{16}"
)


def looks_like_a_key(name: str) -> bool:
    """A pasted key, not a variable name: anything that cannot be a name (``sk-...``, dashes, dots, spaces),
    and the few key formats that could (a Google ``AIza...`` key, say). Any other name made of letters, digits
    and _ that starts with a letter or _ is a variable name, whatever its length or case."""
    return not _ENV_NAME.fullmatch(name) or _KEY_FORMATS.fullmatch(name) is not None


def env_name_for_display(name: str) -> str:
    """An ``api_key_env`` as ``check`` and the logs may print it: a pasted key shows only its first 4 characters."""
    return f"{name[:4]}{MASK}" if looks_like_a_key(name) else name
