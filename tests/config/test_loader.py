"""Loading YAML: every problem with its key path and line, and hostile files refused."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest
import yaml

from proxy.config import Config, ConfigError, load_config, parse_config
from proxy.config.model import Defaults

EXAMPLE = Path(__file__).resolve().parents[2] / "config.example.yaml"


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        parse_config(textwrap.dedent(text))
    return exc.value.problems


def test_reports_every_problem_with_path_and_line() -> None:
    text = """\
        server:
          port: 8787
        providers:
          openai:
            upstream: https://api.openai.com/v1
            limt: 8
            tls_verify: sometimes
          local:
            limit: 2
        """
    assert problems(text) == [
        "providers.openai.limt: unknown key (did you mean 'limit'?) (line 6)",
        "providers.openai.tls_verify: must be true or false (line 7)",
        "providers.local.upstream: required key is missing (line 8)",
    ]


def test_spec_wording_for_a_bad_limit() -> None:
    text = """\
        server: {port: 8787}
        defaults:
          limit: null
        providers:
          openai:
            upstream: https://api.openai.com/v1
            limit: 0
        """
    assert problems(text) == ["providers.openai.limit: must be a positive integer or null (line 7)"]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (
            "defaults: {slot_timeout: 5 minutes}",
            "defaults.slot_timeout: must be a duration such as 250ms, 30s, 5m, 1h or 30d (line 1)",
        ),
        (
            "defaults:\n  backoff_statuses:\n    - 429\n    - 200\n",
            "defaults.backoff_statuses[1]: must be an HTTP status code from 400 to 599 (line 4)",
        ),
        ("server: [a]", "server: must be a mapping (line 1)"),
        ("providers: {p: http://x}", "providers.p: must be a mapping (line 1)"),
        (
            "providers:\n  _x: {upstream: 'http://x'}",
            ("providers._x: reserved for the proxy's own routes "
             "(ids starting with _, metrics, healthz, readyz) (line 2)"),
        ),
        (
            "providers:\n  p: {upstream: 'http://x', auth: basic}",
            "providers.p.auth: must be 'bearer' or 'x-api-key' (line 2)",
        ),
        ("provider: {}", "provider: unknown key (did you mean 'providers'?) (line 1)"),
        (
            "server: {zzz: 1}",
            ("server.zzz: unknown key (allowed: host, port, max_body, shutdown_grace, allowed_hosts, allowed_origins, "
             "header_timeout, body_timeout, write_timeout, max_connections) (line 1)"),
        ),
        ("workspaces: {starred: release-team}", "workspaces.starred: must be a list (line 1)"),
    ],
)
def test_single_problem_messages(text: str, problem: str) -> None:
    assert problems(text) == [problem]


def test_problems_are_ordered_by_line() -> None:
    text = """\
        logging: {slow_grant: x}
        server: {port: -1}
        defaults: {max_queue: -1}
        """
    assert [p.rsplit("(line ", 1)[1] for p in problems(text)] == ["1)", "2)", "3)"]


def test_duplicate_keys() -> None:
    text = """\
        providers:
          openai:
            upstream: https://api.openai.com/v1
            limit: 8
            limit: 9
        server: {}
        server: {}
        """
    assert problems(text) == [
        "providers.openai: duplicate key 'limit' (line 5)",
        "duplicate key 'server' (line 7)",
    ]


def test_merge_keys_are_not_duplicates_and_lines_point_at_the_written_key() -> None:
    text = """\
        providers:
          a: &base
            upstream: http://a
            limit: 2
          b:
            <<: *base
            upstream: http://b
            limit: 0
        """
    assert problems(text) == ["providers.b.limit: must be a positive integer or null (line 8)"]
    config = parse_config(textwrap.dedent(text).replace("limit: 0", "limit: 3"))
    assert (config.provider("b").upstream, config.provider("b").limit) == ("http://b", 3)


def test_billion_laughs_is_refused_fast() -> None:
    lines = ['lol0: &lol0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, 10):
        refs = ", ".join([f"*lol{i - 1}"] * 9)
        lines.append(f"lol{i}: &lol{i} [{refs}]")
    started = time.perf_counter()
    with pytest.raises(ConfigError) as exc:
        parse_config("\n".join(lines))
    assert time.perf_counter() - started < 1.0
    assert exc.value.problems == ["YAML aliases expand to more than 100000 nodes (an alias bomb?)"]


def test_recursive_alias_is_refused() -> None:
    assert problems("a: &a [*a]") == [
        "invalid YAML: alias *a refers to a node that contains it (line 1, column 8)"
    ]


@pytest.mark.parametrize(
    ("text", "start"),
    [
        ("server:\n  port: [8787\n", "invalid YAML: while parsing a flow sequence"),
        ("server:\n\tport: 1\n", "invalid YAML: while scanning for the next token"),
        (
            "x: !!python/object/apply:os.system ['true']",
            "invalid YAML: could not determine a constructor",
        ),
        ("? [a, b]\n: 1\n", "invalid YAML: mapping keys must be plain strings"),
        ("a: 1\n---\nb: 2\n", "invalid YAML: expected a single document"),
    ],
)
def test_yaml_errors_name_line_and_column(text: str, start: str) -> None:
    [problem] = problems(text)
    assert problem.startswith(start)
    assert ", column " in problem


@pytest.mark.parametrize(("text", "kind"), [("- a\n- b\n", "a list"), ("just text", "a string")])
def test_top_level_must_be_a_mapping(text: str, kind: str) -> None:
    assert problems(text) == [
        f"the top level must be a mapping of sections (server:, providers:, ...), not {kind}"
    ]


@pytest.mark.parametrize("text", ["", "# only a comment\n", "---\n", "server:\nproviders:\n"])
def test_empty_config_is_all_defaults(text: str) -> None:
    assert parse_config(text) == Config()


def test_numeric_looking_keys_stay_text() -> None:
    config = parse_config("providers:\n  2024: {upstream: 'http://x'}\n")
    assert config.provider_names() == ["2024"]


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert exc.value.problems == [f"config file not found: {path}"]
    assert exc.value.source == str(path)


def test_unreadable_and_binary_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00server")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_config(binary)


def test_errors_from_a_file_carry_its_path(tmp_path: Path) -> None:
    path = tmp_path / "slotproxy.yaml"
    path.write_text("server:\n  port: x\n")
    with pytest.raises(ConfigError) as exc:
        load_config(str(path))
    assert exc.value.source == str(path)
    assert str(exc.value) == f"{path}: server.port: must be a port number from 0 to 65535 (line 2)"


def test_example_config_loads() -> None:
    first_line = EXAMPLE.read_text().splitlines()[0]
    assert first_line == "# yaml-language-server: $schema=./slotproxy.schema.json"
    config = load_config(EXAMPLE)
    assert (config.server.host, config.server.port) == ("127.0.0.1", 8787)
    assert config.provider_names() == ["openai", "anthropic"]
    openai, anthropic = config.provider("openai"), config.provider("anthropic")
    assert (openai.upstream, openai.limit, openai.api_key_env, openai.auth) == (
        "https://api.openai.com/v1", 8, "OPENAI_API_KEY", "bearer",
    )
    assert (anthropic.upstream, anthropic.limit, anthropic.auth) == (
        "https://api.anthropic.com", 4, "x-api-key",
    )
    assert anthropic.api_key_env == "ANTHROPIC_API_KEY"
    assert anthropic.backoff_statuses == frozenset({429, 529})
    assert config.workspaces.starred == ("release-team",)
    assert config.backend.kind == "memory"
    assert config.defaults == Defaults()


def test_example_config_spells_out_every_default() -> None:
    raw = yaml.safe_load(EXAMPLE.read_text())
    assert set(raw["defaults"]) == set(Defaults.model_fields)


def test_a_key_pool_model_caps_budgets_and_a_share_load() -> None:
    config = parse_config(textwrap.dedent("""\
        workspaces: {max_share: 0.5}
        providers:
          anthropic:
            upstream: https://api.anthropic.com
            auth: x-api-key
            limit: 8
            keys:
              - {name: team-a, api_key_env: ANTHROPIC_KEY_A, limit: 4}
              - {name: team-b, api_key_env: ANTHROPIC_KEY_B, limit: 4}
            models:
              "claude-opus-*": {limit: 2}
            budgets: true
        """))
    settings = config.provider("anthropic")
    assert [(k.name, k.api_key_env, k.limit) for k in settings.keys] == [
        ("team-a", "ANTHROPIC_KEY_A", 4), ("team-b", "ANTHROPIC_KEY_B", 4)]
    assert {p: m.limit for p, m in settings.models.items()} == {"claude-opus-*": 2}
    assert settings.budgets and config.workspaces.max_share == 0.5
    assert not parse_config("providers: {p: {upstream: 'http://127.0.0.1:1'}}").provider("p").budgets


@pytest.mark.parametrize(("text", "message"), [
    ("providers: {p: {upstream: 'http://127.0.0.1:1', api_key_env: K, keys: [{name: a, api_key_env: A}]}}",
     "providers.p: set either api_key_env (one key) or keys (a pool), not both"),
    ("providers: {p: {upstream: 'http://127.0.0.1:1', keys: [{name: a, api_key_env: A}, {name: a, api_key_env: B}]}}",
     "providers.p.keys: key name 'a' is used twice"),
    ("providers: {p: {upstream: 'http://127.0.0.1:1', keys: [{name: 'a b', api_key_env: A}]}}",
     "providers.p.keys[0].name: a key name must start with a letter or digit"),
    ("providers: {p: {upstream: 'http://127.0.0.1:1', keys: [{name: a, api_key_env: A, limit: 0}]}}",
     "providers.p.keys[0].limit: must be a positive integer or null"),
    ("providers: {p: {upstream: 'http://127.0.0.1:1', keys: [{name: a}]}}",
     "providers.p.keys[0].api_key_env"),
    ("providers: {p: {upstream: 'http://127.0.0.1:1', models: {'opus-*': {limit: -1}}}}",
     "providers.p.models.opus-*.limit: must be a positive integer or null"),
    ("workspaces: {max_share: 1.5}", "workspaces.max_share: must be a share of the provider's slots"),
    ("workspaces: {max_share: 0}", "workspaces.max_share: must be a share of the provider's slots"),
])
def test_nested_limit_mistakes_name_the_key_path(text: str, message: str) -> None:
    found = problems(text)
    assert any(problem.startswith(message) for problem in found), found
