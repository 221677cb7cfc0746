"""The config model: frozen, validated sections and each provider's resolved settings.

Every section is a frozen pydantic model that forbids unknown keys. Validators
raise ``ValueError`` with a message that states the rule (``must be a duration
such as 250ms, 30s, 5m or 1h``); the loader adds the key path and the line.
The value types the sections are made of are in ``types``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    WithJsonSchema,
    field_serializer,
    model_validator,
)

from ..limiter.window import WindowSettings
from .types import (
    MASK,
    PROVIDER_NAMES_SCHEMA,
    AllowedHost,
    Auth,
    BackendUrl,
    ConnectionCount,
    Count,
    DottedPath,
    Duration,
    EnvName,
    HeaderName,
    KeyName,
    Limit,
    Methods,
    ModelPattern,
    NonEmptyStr,
    Origin,
    Port,
    PositiveDuration,
    PositiveIntOrNull,
    ProviderId,
    RedisAddress,
    Seconds,
    Share,
    Size,
    Statuses,
    Upstream,
    UsageUrl,
    Usd,
    env_name_for_display,
    looks_like_a_key,
)
from .windows import (
    ProviderWindows,
    WindowLimits,
    foreign_window_warnings,
    written_windows,
)

__all__ = [
    "Access",
    "Admin",
    "Backend",
    "Config",
    "Defaults",
    "Headers",
    "Ledger",
    "Logging",
    "ModelLimit",
    "PoolKey",
    "Price",
    "Provider",
    "ProviderSettings",
    "Recovery",
    "RedisTls",
    "Server",
    "State",
    "Telemetry",
    "Usage",
    "Workspaces",
    "config_json_schema",
]

_SECRET_KEY = re.compile(
    r"(?:^|[_-])"
    r"(?:authorization|api[_-]?key|key|token|secret|password|passwd|credentials?|cookie)$",
    re.IGNORECASE,
)

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


class PoolKey(_Frozen):
    """One key of a provider's pool: its own slots, pause and reduction."""

    name: KeyName
    api_key_env: EnvName
    limit: Limit = None
    windows: WindowLimits | None = None


class ModelLimit(_Frozen):
    limit: Limit = None
    windows: WindowLimits | None = None


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
    windows: ProviderWindows | None = None
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
    spend_per_day_usd: dict[NonEmptyStr, Usd] = Field(default_factory=dict)
    """Caps per workspace per UTC day, in US dollars; ``"*"``: each workspace not named."""


class Price(_Frozen):
    """US dollars per million tokens. ``cache_read`` and ``cache_write`` left out cost what ``input`` costs."""

    input: Usd
    output: Usd
    cache_read: Usd | None = None
    cache_write: Usd | None = None


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


class RedisTls(_Frozen):
    """TLS to Redis (``rediss://``, or Sentinel and Cluster nodes): the system's CAs unless ``ca_file`` says
    otherwise; a client certificate when the server asks for one."""

    ca_file: NonEmptyStr | None = None
    cert_file: NonEmptyStr | None = None
    key_file: NonEmptyStr | None = None

    @model_validator(mode="after")
    def _cert_with_its_key(self) -> RedisTls:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together: set both (a client certificate) or neither")
        return self


class Backend(_Frozen):
    kind: Literal["memory", "redis"] = "memory"
    url: BackendUrl = "redis://127.0.0.1:6379/0"
    sentinels: tuple[RedisAddress, ...] | None = None
    """Sentinel addresses (host:port): the proxy asks them for the current primary of ``service``."""
    service: NonEmptyStr | None = None
    sentinel_password_env: EnvName | None = None
    """The variable holding the sentinels' own password (the data nodes' is ``password_env``'s)."""
    cluster: tuple[RedisAddress, ...] | None = None
    """Redis Cluster seed nodes (host:port)."""
    username: NonEmptyStr | None = None
    password_env: EnvName | None = None
    """The variable holding the data nodes' password, with ``sentinels`` or ``cluster`` (``url`` carries its own)."""
    tls: RedisTls | None = None
    key_prefix: NonEmptyStr = "slotproxy"
    lease_ttl: PositiveDuration = 30.0
    on_backend_error: Literal["fail_closed", "local"] = "fail_closed"
    local_limit: PositiveIntOrNull = None

    @model_validator(mode="after")
    def _one_way_to_reach_redis(self) -> Backend:
        given = [name for name in ("url", "sentinels", "cluster") if name in self.model_fields_set
                 and getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"set exactly one of url, sentinels and cluster, not {' and '.join(given)}: they are "
                             "three ways to reach Redis")
        if self.sentinels is not None and self.service is None:
            raise ValueError("sentinels needs service: the name the sentinels know the primary by (their "
                             "'sentinel monitor <service> ...' line)")
        if self.service is not None and self.sentinels is None:
            raise ValueError("service is the Sentinel service name: it needs sentinels (their host:port list)")
        if self.sentinels == () or self.cluster == ():
            raise ValueError("sentinels and cluster need at least one host:port")
        return self

    @property
    def topology(self) -> str:
        """``single`` (url), ``sentinel`` or ``cluster``."""
        return "sentinel" if self.sentinels is not None else "cluster" if self.cluster is not None else "single"


class Logging(_Frozen):
    slow_grant: Duration = 5.0


def _check_sample(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError("must be the share of requests traced: a number from 0 to 1, such as 1.0 or 0.1")
    return float(value)


class Telemetry(_Frozen):
    """Traces and GenAI metrics over OTLP/HTTP; off unless an endpoint is given here or in the standard
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` variable."""

    otlp_endpoint: Upstream | None = None
    """The collector's OTLP/HTTP base URL: traces go to ``/v1/traces``, metrics to ``/v1/metrics``."""
    service_name: NonEmptyStr | None = None
    """null: ``OTEL_SERVICE_NAME``, else ``slotproxy``."""
    sample: Annotated[float, BeforeValidator(_check_sample),
                      WithJsonSchema({"type": "number", "minimum": 0, "maximum": 1})] = 1.0
    """The share of new traces kept; a client's ``traceparent`` that says sampled (or not) is followed."""


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
    windows: ProviderWindows | None = None
    budgets: bool = False
    websocket: bool = True

    @field_serializer("slot_methods", "backoff_statuses", "reduce_statuses", when_used="json")
    def _sorted(self, values: frozenset[Any]) -> list[Any]:
        return sorted(values)

    @property
    def dialect(self) -> Literal["anthropic", "openai"]:
        """Whose API the provider speaks, for counting tokens as it counts them: Anthropic's with
        ``auth: x-api-key``, else OpenAI's."""
        return "anthropic" if self.auth == "x-api-key" else "openai"

    def window_settings(self) -> WindowSettings | None:
        """The limiter's view of the windows; None when no ``windows:`` is written anywhere (none is held)."""
        models = {pattern: cap.windows.limits() for pattern, cap in self.models.items() if cap.windows is not None}
        keys = {key.name: key.windows.limits() for key in self.keys if key.windows is not None}
        if self.windows is None and not models and not keys:
            return None
        own = self.windows or ProviderWindows()
        return WindowSettings(provider=own.limits(), models=models, keys=keys, learn=own.learn,
                              headroom=own.headroom)


def _resolve(name: str, provider: Provider, defaults: Defaults) -> ProviderSettings:
    inherited = {
        key: getattr(provider if key in provider.model_fields_set else defaults, key)
        for key in Defaults.model_fields
    }
    own = provider.model_dump(include={"upstream", "api_key_env", "auth", "tls_verify", "budgets",
                                                "websocket"})
    return ProviderSettings(name=name, usage=provider.usage, keys=provider.keys, models=provider.models,
                            windows=provider.windows, **own, **inherited)




class Config(_Frozen):
    """The whole config file. Sections left out (or left empty) take their defaults."""

    schema_ref: str | None = Field(default=None, alias="$schema", exclude=True, repr=False)
    server: Server = Field(default_factory=Server)
    admin: Admin = Field(default_factory=Admin)
    access: Access = Field(default_factory=Access)
    defaults: Defaults = Field(default_factory=Defaults)
    providers: dict[ProviderId, Provider] = Field(
        default_factory=dict,
        json_schema_extra=PROVIDER_NAMES_SCHEMA,
    )
    workspaces: Workspaces = Field(default_factory=Workspaces)
    prices: dict[ModelPattern, Price] = Field(default_factory=dict)
    """Prices per model pattern (shell-style, the first that matches), before the genai-prices data."""
    headers: Headers = Field(default_factory=Headers)
    state: State = Field(default_factory=State)
    ledger: Ledger = Field(default_factory=Ledger)
    backend: Backend = Field(default_factory=Backend)
    logging: Logging = Field(default_factory=Logging)
    telemetry: Telemetry = Field(default_factory=Telemetry)

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
        if self.workspaces.spend_per_day_usd and self.ledger.path is None and self.backend.kind == "memory":
            found.append("workspaces.spend_per_day_usd with ledger.path null: the day's spend is counted from "
                         "when the proxy started (a restart starts it again from 0)")
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
            blocks = written_windows(name, settings.windows, settings.models, settings.keys)
            found.extend(foreign_window_warnings(name, settings.dialect, blocks))
        return found

    def masked(self) -> dict[str, Any]:
        """The effective config as JSON-able data, with every secret value replaced by ``***``."""
        data = self.model_dump(mode="json")
        data["providers"] = {  # the resolved view, not the overrides as written
            name: _masked_provider(settings) for name, settings in self._settings.items()
        }
        result: dict[str, Any] = _mask_secrets(data)
        return result




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
        data["usage"]["headers"] = {key: MASK for key in data["usage"]["headers"]}
    return data


def _mask_secrets(value: Any, key: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _mask_secrets(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_mask_secrets(v, key) for v in value]
    if isinstance(value, str) and value and _SECRET_KEY.search(key):
        return MASK
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
        netloc = f"{parts.username or ''}:{MASK}@{netloc.rpartition('@')[2]}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, MASK if _SECRET_KEY.search(k) else v) for k, v in pairs], safe="*")
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def config_json_schema() -> dict[str, Any]:
    """The JSON Schema of the config file, for editors (``$schema`` / yaml-language-server)."""
    schema = Config.model_json_schema()
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "slotproxy config",
        **{k: v for k, v in schema.items() if k != "title"},
    }
