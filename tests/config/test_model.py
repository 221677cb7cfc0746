"""The config model: value types, defaults, inheritance, masking and the JSON Schema."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from proxy.config import Config, ProviderSettings, config_json_schema
from proxy.config.model import Defaults, Provider
from proxy.config.types import format_duration, format_size, parse_duration, parse_size

EXAMPLE = Path(__file__).resolve().parents[2] / "config.example.yaml"


def make(**sections: Any) -> Config:
    return Config.model_validate(sections)


def messages(exc: pytest.ExceptionInfo[ValidationError]) -> list[str]:
    return [str(e.get("ctx", {}).get("error", e["msg"])) for e in exc.value.errors()]


# --- durations and sizes ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (0, 0.0),
        (7, 7.0),
        (1.5, 1.5),
        ("250ms", 0.25),
        ("30s", 30.0),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("30d", 30 * 86400.0),
        ("1d12h", 129600.0),
        ("1.5s", 1.5),
        ("1m30s", 90.0),
        (" 2s ", 2.0),
        ("10", 10.0),
    ],
)
def test_duration_parses(value: object, seconds: float) -> None:
    assert parse_duration(value) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("-1s", "must not be negative"),
        (-3, "must not be negative"),
        ("5 minutes", "must be a duration such as 250ms, 30s, 5m, 1h or 30d"),
        ("1w", "must be a duration such as 250ms, 30s, 5m, 1h or 30d"),
        ("", "must be a duration such as 250ms, 30s, 5m, 1h or 30d"),
        ("s", "must be a duration such as 250ms, 30s, 5m, 1h or 30d"),
        (True, "must be a duration such as 250ms, 30s, 5m, 1h or 30d"),
        (None, "must be a duration such as 250ms, 30s, 5m, 1h or 30d"),
        (math.inf, "must be a duration such as 250ms, 30s, 5m, 1h or 30d"),
    ],
)
def test_duration_rejects(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        parse_duration(value)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.25, "250ms"),
        (1.5, "1.5s"),
        (30, "30s"),
        (90, "90s"),
        (300, "5m"),
        (3600, "1h"),
        (86400 * 30, "30d"),
        (86400 + 3600, "25h"),
    ],
)
def test_duration_formats(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("value", "size"),
    [
        (1024, 1024),
        ("100", 100),
        ("512KiB", 512 * 1024),
        ("32MiB", 32 * 1024**2),
        ("1GiB", 1024**3),
        ("1.5KiB", 1536),
        ("10KB", 10_000),
        ("2MB", 2_000_000),
        ("32mib", 32 * 1024**2),
    ],
)
def test_size_parses(value: object, size: int) -> None:
    assert parse_size(value) == size


@pytest.mark.parametrize("value", [-1, "-5MiB", "12 parsecs", "MiB", True, 1.5, None])
def test_size_rejects(value: object) -> None:
    with pytest.raises(ValueError):
        parse_size(value)


@pytest.mark.parametrize(
    ("size", "text"),
    [(0, 0), (1000, 1000), (1024, "1KiB"), (32 * 1024**2, "32MiB"), (1024**3, "1GiB")],
)
def test_size_formats(size: int, text: str | int) -> None:
    assert format_size(size) == text


@pytest.mark.parametrize(
    ("server", "message"),
    [
        ({"max_body": 0}, "must be larger than 0 bytes"),
        ({"shutdown_grace": "soon"}, "must be a duration such as 250ms, 30s, 5m, 1h or 30d"),
        ({"port": 70000}, "must be a port number from 0 to 65535"),
        ({"port": True}, "must be a port number from 0 to 65535"),
    ],
)
def test_server_rejects(server: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as exc:
        make(server=server)
    assert messages(exc) == [message]


# --- defaults and inheritance ----------------------------------------------------------


def test_empty_config_has_spec_defaults() -> None:
    config = Config()
    assert (config.server.host, config.server.port) == ("127.0.0.1", 8787)
    assert config.server.max_body == 32 * 1024**2
    assert config.server.shutdown_grace == 30.0
    assert config.admin.token_env == "SLOTPROXY_ADMIN_TOKEN"
    assert config.admin.allow_unauthenticated is False
    assert config.access.keys_env is None
    assert config.providers == {}
    assert config.workspaces.starred == ()
    assert config.headers.workspace == "X-Workspace-Id"
    assert config.headers.prompt_started_at == "X-Prompt-Started-At"
    assert config.state.path == "slotproxy-state.json"
    assert (config.backend.kind, config.backend.on_backend_error) == ("memory", "fail_closed")
    assert config.backend.lease_ttl == 30.0
    assert config.logging.slow_grant == 5.0


def test_defaults_values() -> None:
    d = Defaults()
    assert d.limit is None
    assert d.slot_methods == ("POST",)
    assert (d.release_cooldown, d.default_pause) == (0.0, 30.0)
    assert d.backoff_statuses == (429,)
    assert (d.retry_on_429, d.max_queue) == (2, 10000)
    timeouts = (d.slot_timeout, d.idle_timeout, d.connect_timeout, d.queue_timeout)
    assert timeouts == (900, 120, 10, 600)
    assert d.recovery is None


def test_provider_can_override_every_default() -> None:
    assert set(Defaults.model_fields) <= set(Provider.model_fields)
    own = {"name", "upstream", "api_key_env", "auth", "tls_verify", "usage", "keys", "models", "windows", "budgets",
           "websocket"}
    assert set(ProviderSettings.model_fields) == set(Defaults.model_fields) | own


def test_provider_inherits_and_overrides() -> None:
    config = make(
        defaults={
            "limit": 5,
            "default_pause": "1m",
            "slot_methods": ["post", "put"],
            "recovery": {"after": "10m"},
        },
        providers={
            "inherits": {"upstream": "https://a.example/v1/"},
            "overrides": {
                "upstream": "http://b.example",
                "limit": 2,
                "default_pause": "250ms",
                "backoff_statuses": [429, 529, 429],
                "recovery": None,
            },
        },
    )
    inherits, overrides = config.provider("inherits"), config.provider("overrides")
    assert inherits == ProviderSettings(
        name="inherits",
        upstream="https://a.example/v1",
        api_key_env=None,
        auth="bearer",
        tls_verify=True,
        usage=None,
        limit=5,
        slot_methods=frozenset({"POST", "PUT"}),
        release_cooldown=0.0,
        default_pause=60.0,
        backoff_statuses=frozenset({429}),
        reduce_statuses=frozenset({429}),
        overload_pause=5.0,
        retry_on_429=2,
        slot_timeout=900.0,
        idle_timeout=120.0,
        connect_timeout=10.0,
        queue_timeout=600.0,
        max_queue=10000,
        recovery=config.defaults.recovery,
    )
    assert (overrides.limit, overrides.default_pause) == (2, 0.25)
    assert overrides.backoff_statuses == frozenset({429, 529})
    assert overrides.recovery is None


@pytest.mark.parametrize(
    ("provider", "limit"),
    [({"limit": None}, None), ({}, 5), ({"limit": 3}, 3)],
    ids=["explicit-null-is-unlimited", "absent-inherits", "own-value"],
)
def test_limit_null_differs_from_absent(provider: dict[str, Any], limit: int | None) -> None:
    config = make(defaults={"limit": 5}, providers={"p": {"upstream": "http://x", **provider}})
    assert config.provider("p").limit == limit


def test_provider_names_keep_file_order_and_unknown_is_keyerror() -> None:
    config = make(providers={"zeta": {"upstream": "http://z"}, "alpha": {"upstream": "http://a"}})
    assert config.provider_names() == ["zeta", "alpha"]
    with pytest.raises(KeyError):
        config.provider("nope")


def test_models_are_frozen() -> None:
    config = make(providers={"p": {"upstream": "http://x"}})
    with pytest.raises(ValidationError):
        config.server.port = 1  # type: ignore[misc]
    with pytest.raises(ValidationError):
        config.provider("p").limit = 1  # type: ignore[misc]


def test_null_sections_take_defaults_and_schema_key_is_ignored() -> None:
    data = {"$schema": "./slotproxy.schema.json", "server": None, "providers": None}
    config = Config.model_validate(data)
    assert config == Config()


# --- provider ids and values -------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["_admin", "_slotproxy", "metrics", "healthz", "readyz", "Metrics"]
)
def test_reserved_provider_ids(name: str) -> None:
    with pytest.raises(ValidationError) as exc:
        make(providers={name: {"upstream": "http://x"}})
    assert "reserved" in messages(exc)[0]


@pytest.mark.parametrize("name", ["-a", "a b", "a/b", ""])
def test_malformed_provider_ids(name: str) -> None:
    with pytest.raises(ValidationError, match="must start with a letter or digit"):
        make(providers={name: {"upstream": "http://x"}})


@pytest.mark.parametrize("name", ["openai", "azure-east.1", "A_b", "2024"])
def test_good_provider_ids(name: str) -> None:
    assert make(providers={name: {"upstream": "http://x"}}).provider_names() == [name]


@pytest.mark.parametrize(
    ("upstream", "message"),
    [
        ("ftp://x", "must be an http:// or https:// URL"),
        ("api.openai.com", "must be an http:// or https:// URL"),
        ("https://", "must be an http:// or https:// URL"),
        ("http://x:99999", "must be an http:// or https:// URL"),
        ("https://x/v1?a=1", "must not have a query string or fragment"),
        ("https://x/v1#top", "must not have a query string or fragment"),
        ("https://user:pw@x/v1", "must not contain credentials (use api_key_env or usage.headers)"),
    ],
)
def test_upstream_rejects(upstream: str, message: str) -> None:
    with pytest.raises(ValidationError) as exc:
        make(providers={"p": {"upstream": upstream}})
    assert messages(exc) == [message]


@pytest.mark.parametrize(
    ("provider", "message"),
    [
        ({"limit": 0}, "must be a positive integer or null"),
        ({"limit": "8"}, "must be a positive integer or null"),
        ({"limit": True}, "must be a positive integer or null"),
        ({"backoff_statuses": [200]}, "must be an HTTP status code from 400 to 599"),
        ({"retry_on_429": -1}, "must be a whole number, 0 or more"),
        ({"slot_timeout": 0}, "must be longer than 0s"),
        ({"slot_methods": ["PO ST"]}, "must be an HTTP method name such as POST"),
        ({"api_key_env": "sk-live-123"}, "must be the NAME of an environment variable"),
        ({"auth": "basic"}, "Input should be 'bearer' or 'x-api-key'"),
        ({"usage": {"url": "http://u", "field": "a..b"}}, "must be a dotted path"),
        ({"recovery": {"after": 0}}, "must be longer than 0s"),
    ],
)
def test_provider_value_rejects(provider: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as exc:
        make(providers={"p": {"upstream": "http://x", **provider}})
    assert messages(exc)[0].startswith(message)


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"headers": {"workspace": "X Workspace"}}, "must be an HTTP header name"),
        ({"headers": {"starred": "x-workspace-id"}}, "each priority header needs its own name"),
        ({"backend": {"url": "http://redis"}}, "must be a redis://, rediss:// or unix:// URL"),
        ({"backend": {"kind": "etcd"}}, "Input should be 'memory' or 'redis'"),
        ({"backend": {"local_limit": 0}}, "must be a positive integer or null"),
        ({"state": {"path": ""}}, "String should have at least 1 character"),
        ({"logging": {"slow_grant": "-1s"}}, "must not be negative"),
    ],
)
def test_section_rejects(sections: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as exc:
        make(**sections)
    assert messages(exc)[0].startswith(message)


def test_state_path_may_be_disabled_and_starred_names_are_text() -> None:
    config = make(state={"path": None}, workspaces={"starred": ["release-team", 2024]})
    assert config.state.path is None
    assert config.workspaces.starred == ("release-team", "2024")


# --- masked ---------------------------------------------------------------------------


def test_masked_hides_secrets_and_is_json() -> None:
    config = make(
        providers={
            "p": {
                "upstream": "https://x/v1",
                "api_key_env": "P_KEY",
                "usage": {
                    "url": "https://x/usage?api_key=abc&team=t1",
                    "field": "data.active",
                    "headers": {"Authorization": "Bearer sk-secret", "X-Team": "team-secret"},
                },
            }
        },
        backend={"kind": "redis", "url": "redis://:hunter2@db:6379/0"},
    )
    masked = config.masked()
    text = json.dumps(masked)
    for secret in ("sk-secret", "team-secret", "abc", "hunter2"):
        assert secret not in text
    provider = masked["providers"]["p"]
    assert provider["usage"]["headers"] == {"Authorization": "***", "X-Team": "***"}
    assert provider["usage"]["url"] == "https://x/usage?api_key=***&team=t1"
    assert provider["api_key_env"] == "P_KEY"
    assert masked["admin"]["token_env"] == "SLOTPROXY_ADMIN_TOKEN"
    assert masked["backend"]["url"] == "redis://:***@db:6379/0"


def test_masked_shows_resolved_values_readably() -> None:
    masked = make(defaults={"limit": 3}, providers={"p": {"upstream": "http://x"}}).masked()
    assert "$schema" not in masked
    assert masked["server"]["max_body"] == "32MiB"
    assert masked["defaults"]["slot_timeout"] == "15m"
    assert masked["providers"]["p"]["limit"] == 3
    assert masked["providers"]["p"]["queue_timeout"] == "10m"
    assert masked["providers"]["p"]["slot_methods"] == ["POST"]


# --- JSON Schema ----------------------------------------------------------------------


def _matches(schema: dict[str, Any], value: Any, root: dict[str, Any]) -> bool:
    """A small JSON Schema check covering the keywords the config schema uses."""
    if "$ref" in schema:
        return _matches(root["$defs"][schema["$ref"].rsplit("/", 1)[1]], value, root)
    if "anyOf" in schema and not any(_matches(s, value, root) for s in schema["anyOf"]):
        return False
    if "not" in schema and _matches(schema["not"], value, root):
        return False
    if "enum" in schema and value not in schema["enum"]:
        return False
    kinds = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    kind = schema.get("type")
    if kind in kinds and not isinstance(value, kinds[kind]):
        return False
    if kind in ("integer", "number"):
        numeric = (int,) if kind == "integer" else (int, float)
        if isinstance(value, bool) or not isinstance(value, numeric):
            return False
        if value < schema.get("minimum", -math.inf) or value > schema.get("maximum", math.inf):
            return False
        if value <= schema.get("exclusiveMinimum", -math.inf):
            return False
    if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
        return False
    if isinstance(value, str) and len(value) < schema.get("minLength", 0):
        return False
    if isinstance(value, list):
        return all(_matches(schema.get("items", {}), v, root) for v in value)
    if isinstance(value, dict):
        return _object_matches(schema, value, root)
    return True


def _object_matches(schema: dict[str, Any], value: dict[str, Any], root: dict[str, Any]) -> bool:
    properties = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    for key, item in value.items():
        if not _matches(schema.get("propertyNames", {}), key, root):
            return False
        if key in properties:
            ok = _matches(properties[key], item, root)
        elif extra is False:
            ok = False
        else:
            ok = _matches(extra if isinstance(extra, dict) else {}, item, root)
        if not ok:
            return False
    return all(key in value for key in schema.get("required", []))


def test_schema_forbids_unknown_keys_everywhere() -> None:
    schema = config_json_schema()
    assert schema["additionalProperties"] is False
    assert schema["$defs"]["Provider"]["additionalProperties"] is False
    assert all(d["additionalProperties"] is False for d in schema["$defs"].values())


def test_schema_accepts_the_example_and_rejects_mistakes() -> None:
    schema = config_json_schema()
    example = yaml.safe_load(EXAMPLE.read_text())
    assert _matches(schema, example, schema)
    assert _matches(schema, {"$schema": "./slotproxy.schema.json"}, schema)

    typo = json.loads(json.dumps(example))
    typo["providers"]["openai"]["limt"] = 8
    assert not _matches(schema, typo, schema)
    assert not _matches(schema, {**example, "provider": {}}, schema)
    assert not _matches(schema, {"providers": {"metrics": {"upstream": "http://x"}}}, schema)
    assert not _matches(schema, {"providers": {"p": {}}}, schema)
    assert not _matches(schema, {"defaults": {"slot_timeout": "5 minutes"}}, schema)


@pytest.mark.parametrize(("backend", "message"), [
    ({"kind": "redis", "url": "redis://r:6379", "sentinels": ["s:26379"], "service": "m"},
     "set exactly one of url, sentinels and cluster, not url and sentinels"),
    ({"kind": "redis", "sentinels": ["s:26379"], "cluster": ["r:7000"], "service": "m"},
     "set exactly one of url, sentinels and cluster, not sentinels and cluster"),
    ({"kind": "redis", "sentinels": ["s:26379"]}, "sentinels needs service"),
    ({"kind": "redis", "service": "m"}, "service is the Sentinel service name: it needs sentinels"),
    ({"kind": "redis", "cluster": ["no-port"]}, "must be host:port"),
    ({"kind": "redis", "cluster": ["r:7000"], "tls": {"cert_file": "c.pem"}}, "cert_file and key_file go together"),
])
def test_one_way_to_reach_redis(backend: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Config.model_validate({"backend": backend})


def test_sentinel_and_cluster_configs_are_read_and_their_password_names_a_variable() -> None:
    sentinel = Config.model_validate({"backend": {"kind": "redis", "sentinels": ["s1:26379", "s2:26379"],
                                                  "service": "mymaster", "password_env": "REDIS_PASSWORD"}}).backend
    assert (sentinel.topology, sentinel.sentinels, sentinel.service) == ("sentinel", ("s1:26379", "s2:26379"),
                                                                        "mymaster")
    cluster = Config.model_validate({"backend": {"kind": "redis", "cluster": ["[::1]:7000"]}}).backend
    assert cluster.topology == "cluster"
    assert Config.model_validate({}).backend.topology == "single"
