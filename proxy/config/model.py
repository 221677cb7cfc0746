"""The config model: frozen, validated sections and each provider's resolved settings.

Every section is a frozen pydantic model that forbids unknown keys. Validators
raise ``ValueError`` with a message that states the rule (``must be a duration
such as 250ms, 30s, 5m or 1h``); the loader adds the key path and the line.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeAlias
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PrivateAttr,
    WithJsonSchema,
    field_serializer,
    model_validator,
)

from ..limiter.policy import MAX_LIMIT, validate_limit

__all__ = [
    "RESERVED_PROVIDER_IDS",
    "Access",
    "Admin",
    "Backend",
    "Config",
    "Defaults",
    "Duration",
    "Headers",
    "Ledger",
    "Logging",
    "ModelLimit",
    "PoolKey",
    "PositiveDuration",
    "Provider",
    "ProviderSettings",
    "Recovery",
    "Server",
    "Size",
    "State",
    "Usage",
    "Workspaces",
    "config_json_schema",
    "format_duration",
    "format_size",
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
_SECRET_KEY = re.compile(
    r"(?:^|[_-])"
    r"(?:authorization|api[_-]?key|key|token|secret|password|passwd|credentials?|cookie)$",
    re.IGNORECASE,
)
_MASK = "***"


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

if TYPE_CHECKING:
    Limit: TypeAlias = int | None
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
AllowedHost = Annotated[str, AfterValidator(_check_allowed_host)]
Origin = Annotated[str, AfterValidator(_check_origin)]
Auth = Literal["bearer", "x-api-key"]


# --- sections ------------------------------------------------------------------------


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Server(_Frozen):
    host: NonEmptyStr = "127.0.0.1"
    port: Port = 8787
    max_body: Size = 32 * 1024**2
    shutdown_grace: Duration = 30.0
    allowed_hosts: tuple[AllowedHost, ...] = ()
    allowed_origins: tuple[Origin, ...] = ()
    header_timeout: PositiveDuration = 10.0
    body_timeout: PositiveDuration = 30.0
    write_timeout: PositiveDuration = 60.0
    max_connections: ConnectionCount = 4096


class Admin(_Frozen):
    token_env: EnvName = "SLOTPROXY_ADMIN_TOKEN"
    allow_unauthenticated: bool = False


class Access(_Frozen):
    keys_env: EnvName | None = None


class Recovery(_Frozen):
    after: PositiveDuration


class Usage(_Frozen):
    url: UsageUrl
    field: DottedPath
    headers: dict[HeaderName, str] = Field(default_factory=dict)
    interval: PositiveDuration = 1.0
    busy_interval: PositiveDuration = 0.1


class Defaults(_Frozen):
    limit: Limit = None
    slot_methods: Methods = ("POST",)
    release_cooldown: Duration = 0.0
    default_pause: Duration = 30.0
    backoff_statuses: Statuses = (429,)
    reduce_statuses: Statuses = (429,)
    overload_pause: Duration = 5.0
    retry_on_429: Count = 2
    slot_timeout: PositiveDuration = 900.0
    idle_timeout: PositiveDuration = 120.0
    connect_timeout: PositiveDuration = 10.0
    queue_timeout: PositiveDuration = 600.0
    max_queue: Count = 10000
    recovery: Recovery | None = None


# A placeholder, never read: whether a provider wrote a key is taken from
# ``model_fields_set``, because ``None`` is a real value for ``limit``.
_INHERIT: Any = None


_KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
KeyName = Annotated[str, _matching(_KEY_NAME, "a key name must start with a letter or digit and contain only "
                                              "letters, digits, '.', '_' and '-'")]
ModelPattern = Annotated[str, Field(min_length=1, max_length=200)]


class PoolKey(_Frozen):
    """One key of a provider's pool: its own slots, pause and reduction."""

    name: KeyName
    api_key_env: EnvName
    limit: Limit = None


class ModelLimit(_Frozen):
    limit: Limit = None


def _distinct_key_names(keys: tuple[PoolKey, ...]) -> tuple[PoolKey, ...]:
    names = [key.name for key in keys]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"key name '{name}' is used twice: each key of a pool needs its own name")
    return keys


PoolKeys = Annotated[tuple[PoolKey, ...], AfterValidator(_distinct_key_names)]


class Provider(_Frozen):
    """One upstream provider.

    A key it shares with ``defaults`` overrides it; a key left out inherits it,
    so ``limit: null`` (unlimited) differs from no ``limit`` at all.
    """

    upstream: Upstream
    api_key_env: EnvName | None = None
    auth: Auth = "bearer"
    tls_verify: bool = True
    usage: Usage | None = None
    limit: Limit = None
    slot_methods: Methods = _INHERIT
    release_cooldown: Duration = _INHERIT
    default_pause: Duration = _INHERIT
    backoff_statuses: Statuses = _INHERIT
    reduce_statuses: Statuses = _INHERIT
    overload_pause: Duration = _INHERIT
    retry_on_429: Count = _INHERIT
    slot_timeout: PositiveDuration = _INHERIT
    idle_timeout: PositiveDuration = _INHERIT
    connect_timeout: PositiveDuration = _INHERIT
    queue_timeout: PositiveDuration = _INHERIT
    max_queue: Count = _INHERIT
    recovery: Recovery | None = None
    keys: PoolKeys = ()
    models: dict[ModelPattern, ModelLimit] = Field(default_factory=dict)
    budgets: bool = False
    websocket: bool = True
    """Relay WebSocket upgrades (the Responses API's WebSocket mode), a slot per response; false: 426."""

    @model_validator(mode="after")
    def _one_way_to_name_the_key(self) -> Provider:
        if self.keys and self.api_key_env is not None:
            raise ValueError("set either api_key_env (one key) or keys (a pool), not both: a pool replaces "
                             "api_key_env")
        return self


class Workspaces(_Frozen):
    model_config = ConfigDict(coerce_numbers_to_str=True)

    starred: tuple[NonEmptyStr, ...] = ()
    max_share: Share | None = None


class Headers(_Frozen):
    workspace: HeaderName = "X-Workspace-Id"
    starred: HeaderName = "X-Workspace-Starred"
    prompt_started_at: HeaderName = "X-Prompt-Started-At"
    conversation: HeaderName = "X-Conversation-Id"
    max_prompt_age: PositiveDuration = 86400.0

    @model_validator(mode="after")
    def _distinct(self) -> Headers:
        names = [name.lower() for name in self.model_dump(exclude={"max_prompt_age"}).values()]
        if len(set(names)) != len(names):
            raise ValueError("each priority header needs its own name")
        return self


class State(_Frozen):
    path: NonEmptyStr | None = "slotproxy-state.json"


class Ledger(_Frozen):
    path: NonEmptyStr | None = "slotproxy-ledger.sqlite"
    """The SQLite file every request's row is written to (relative to the config file's folder); null: none."""
    retention: PositiveDuration = 30 * 86400.0
    """Rows older than this are deleted (hourly); with Redis, the fleet's hourly aggregates expire with it."""


class Backend(_Frozen):
    kind: Literal["memory", "redis"] = "memory"
    url: BackendUrl = "redis://127.0.0.1:6379/0"
    key_prefix: NonEmptyStr = "slotproxy"
    lease_ttl: PositiveDuration = 30.0
    on_backend_error: Literal["fail_closed", "local"] = "fail_closed"
    local_limit: PositiveIntOrNull = None


class Logging(_Frozen):
    slow_grant: Duration = 5.0


# --- the resolved view ---------------------------------------------------------------


class ProviderSettings(_Frozen):
    """One provider with every setting resolved: its own value if written, else ``defaults``."""

    name: str
    upstream: str
    api_key_env: str | None
    auth: Auth
    tls_verify: bool
    usage: Usage | None
    limit: int | None
    slot_methods: frozenset[str]
    release_cooldown: Seconds
    default_pause: Seconds
    backoff_statuses: frozenset[int]
    reduce_statuses: frozenset[int]
    overload_pause: Seconds
    retry_on_429: int
    slot_timeout: Seconds
    idle_timeout: Seconds
    connect_timeout: Seconds
    queue_timeout: Seconds
    max_queue: int
    recovery: Recovery | None
    keys: tuple[PoolKey, ...] = ()
    models: dict[str, ModelLimit] = Field(default_factory=dict)
    budgets: bool = False
    websocket: bool = True

    @field_serializer("slot_methods", "backoff_statuses", "reduce_statuses", when_used="json")
    def _sorted(self, values: frozenset[Any]) -> list[Any]:
        return sorted(values)


def _resolve(name: str, provider: Provider, defaults: Defaults) -> ProviderSettings:
    inherited = {
        key: getattr(provider if key in provider.model_fields_set else defaults, key)
        for key in Defaults.model_fields
    }
    own = provider.model_dump(include={"upstream", "api_key_env", "auth", "tls_verify", "budgets",
                                                "websocket"})
    return ProviderSettings(name=name, usage=provider.usage, keys=provider.keys, models=provider.models,
                            **own, **inherited)


_PROVIDER_NAMES_SCHEMA: dict[str, Any] = {
    "propertyNames": {
        "pattern": f"^{_PROVIDER_ID.pattern}$",
        "not": {"enum": sorted(RESERVED_PROVIDER_IDS)},
    }
}


class Config(_Frozen):
    """The whole config file. Sections left out (or left empty) take their defaults."""

    schema_ref: str | None = Field(default=None, alias="$schema", exclude=True, repr=False)
    server: Server = Field(default_factory=Server)
    admin: Admin = Field(default_factory=Admin)
    access: Access = Field(default_factory=Access)
    defaults: Defaults = Field(default_factory=Defaults)
    providers: dict[ProviderId, Provider] = Field(
        default_factory=dict,
        json_schema_extra=_PROVIDER_NAMES_SCHEMA,
    )
    workspaces: Workspaces = Field(default_factory=Workspaces)
    headers: Headers = Field(default_factory=Headers)
    state: State = Field(default_factory=State)
    ledger: Ledger = Field(default_factory=Ledger)
    backend: Backend = Field(default_factory=Backend)
    logging: Logging = Field(default_factory=Logging)

    _settings: dict[str, ProviderSettings] = PrivateAttr(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _drop_editor_hints_and_empty_sections(cls, data: Any) -> Any:
        """``$schema`` is for editors only, so it must not make two configs differ."""
        if not isinstance(data, dict):
            return data
        sections = set(cls.model_fields) - {"schema_ref"}
        return {
            key: value
            for key, value in data.items()
            if not (key == "$schema" and isinstance(value, str))
            and (value is not None or key not in sections)
        }

    def model_post_init(self, context: Any, /) -> None:
        self._settings = {
            name: _resolve(name, provider, self.defaults)
            for name, provider in self.providers.items()
        }

    def provider(self, name: str) -> ProviderSettings:
        """The resolved settings of one provider; ``KeyError`` when it is not configured."""
        return self._settings[name]

    def provider_names(self) -> list[str]:
        return list(self.providers)

    def warnings(self, environ: Mapping[str, str] | None = None) -> list[str]:
        """Valid settings that weaken or switch off something: ``check`` prints them, ``serve`` logs them.

        With ``environ``, also every ``api_key_env`` that names a variable unset or empty there.
        """
        found = []
        for name, settings in self._settings.items():
            if environ is not None and settings.api_key_env and not environ.get(settings.api_key_env):
                found.append(_missing_key_warning(f"providers.{name}.api_key_env", settings.api_key_env))
            if environ is not None:
                found.extend(_missing_pool_key_warning(f"providers.{name}.keys[{index}]", key)
                             for index, key in enumerate(settings.keys) if not environ.get(key.api_key_env))
            if not settings.tls_verify:
                found.append(f"providers.{name}.tls_verify is false: the upstream's TLS certificate is not "
                             "checked (meant for self-signed test setups only)")
            if settings.usage is not None and self.backend.kind != "memory":
                found.append(f"providers.{name}.usage is ignored with the {self.backend.kind} backend: the usage "
                             "gate needs backend.kind: memory (release_cooldown still applies)")
        return found

    def masked(self) -> dict[str, Any]:
        """The effective config as JSON-able data, with every secret value replaced by ``***``."""
        data = self.model_dump(mode="json")
        data["providers"] = {  # the resolved view, not the overrides as written
            name: _masked_provider(settings) for name, settings in self._settings.items()
        }
        result: dict[str, Any] = _mask_secrets(data)
        return result


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
    return f"{name[:4]}{_MASK}" if looks_like_a_key(name) else name


def _missing_key_warning(path: str, name: str) -> str:
    shown = env_name_for_display(name)
    if looks_like_a_key(name):
        return (f"{path} is '{shown}', which looks like a key value, not a variable name: put the key in an "
                "environment variable and name that variable here")
    return (f"{path} names ${shown}, which is unset or empty: requests to this provider carry the client's own "
            f"credentials until it is set")


def _missing_pool_key_warning(path: str, key: PoolKey) -> str:
    shown = env_name_for_display(key.api_key_env)
    if looks_like_a_key(key.api_key_env):
        return (f"{path}.api_key_env is '{shown}', which looks like a key value, not a variable name: put the "
                "key in an environment variable and name that variable here")
    return (f"{path}.api_key_env names ${shown}, which is unset or empty: key '{key.name}' is left out of the "
            "pool until it is set (with no key left, requests carry the client's own credentials)")


def _masked_provider(settings: ProviderSettings) -> dict[str, Any]:
    data = settings.model_dump(mode="json", exclude={"name"})
    if data["api_key_env"]:
        data["api_key_env"] = env_name_for_display(data["api_key_env"])
    for key in data["keys"]:
        key["api_key_env"] = env_name_for_display(key["api_key_env"])
    if data["usage"] is not None:
        data["usage"]["headers"] = {key: _MASK for key in data["usage"]["headers"]}
    return data


def _mask_secrets(value: Any, key: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _mask_secrets(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_mask_secrets(v, key) for v in value]
    if isinstance(value, str) and value and _SECRET_KEY.search(key):
        return _MASK
    if isinstance(value, str) and "://" in value:
        return _mask_url(value)
    return value


def _mask_url(url: str) -> str:
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    netloc = parts.netloc
    if parts.password is not None:
        netloc = f"{parts.username or ''}:{_MASK}@{netloc.rpartition('@')[2]}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, _MASK if _SECRET_KEY.search(k) else v) for k, v in pairs], safe="*")
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def config_json_schema() -> dict[str, Any]:
    """The JSON Schema of the config file, for editors (``$schema`` / yaml-language-server)."""
    schema = Config.model_json_schema()
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "slotproxy config",
        **{k: v for k, v in schema.items() if k != "title"},
    }
