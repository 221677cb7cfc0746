"""The reload's diff: what changed in the effective config, one phrase each, secrets never printed."""

from __future__ import annotations

import textwrap

from proxy.config import Config, parse_config
from proxy.config.diff import config_changes, describe_changes

BASE = """\
state: {path: null}
providers:
  openai: {upstream: 'https://api.openai.com/v1', limit: 8, api_key_env: OPENAI_API_KEY}
  anthropic:
    upstream: https://api.anthropic.com
    auth: x-api-key
    api_key_env: ANTHROPIC_API_KEY
    limit: 4
    models: {"claude-opus-*": {limit: 2}}
"""


def config(text: str) -> Config:
    return parse_config(textwrap.dedent(text))


def edited(*replacements: tuple[str, str], extra: str = "") -> Config:
    text = BASE
    for old, new in replacements:
        assert old in text, old
        text = text.replace(old, new)
    return config(text + extra)


def test_the_briefs_example_limits_a_model_cap_and_a_new_provider() -> None:
    new = edited(("limit: 8", "limit: 3"), ('{"claude-opus-*": {limit: 2}}', '{"claude-opus-*": {limit: 1}}'),
                 extra="  gemini: {upstream: 'https://generativelanguage.googleapis.com/v1beta'}\n")
    assert config_changes(config(BASE), new) == [
        "openai.limit 8 → 3",
        'anthropic.models["claude-opus-*"].limit 2 → 1',
        "providers added: gemini",
    ]


def test_an_edit_that_changes_nothing_effective_is_no_change() -> None:
    reordered = config("# a comment\n" + BASE.replace("limit: 8, api_key_env: OPENAI_API_KEY",
                                                      "api_key_env: OPENAI_API_KEY, limit: 8"))
    assert config_changes(config(BASE), reordered) == []
    assert describe_changes([]) == "no effective change"


def test_a_removed_provider_and_a_section_value() -> None:
    new = config(BASE.replace("state: {path: null}", "state: {path: null}\nworkspaces: {starred: [release-team]}")
                 .split("  anthropic:")[0])
    assert config_changes(config(BASE), new) == ["providers removed: anthropic", "workspaces.starred [] → [release-team]"]


def test_a_changed_default_is_said_once_not_once_per_provider_that_inherits_it() -> None:
    new = config("defaults: {default_pause: 10s}\n" + BASE.replace(
        "    limit: 4\n", "    limit: 4\n    default_pause: 1m\n"))
    assert config_changes(config(BASE), new) == [
        "defaults.default_pause 30s → 10s",
        "anthropic.default_pause 30s → 1m",
    ]


def test_pool_keys_by_name_and_durations_as_written() -> None:
    pool = ("    api_key_env: ANTHROPIC_API_KEY\n",
            "    keys: [{name: team-a, api_key_env: KEY_A, limit: 2}]\n")
    old = edited(pool)
    new = edited(("    api_key_env: ANTHROPIC_API_KEY\n",
                  ("    keys: [{name: team-a, api_key_env: KEY_A, limit: 1}, {name: team-b, api_key_env: KEY_B}]\n"
                   "    recovery: {after: 10m}\n")))
    assert config_changes(old, new) == [
        "anthropic.recovery null → {after: 10m}",
        'anthropic.keys["team-a"].limit 2 → 1',
        "anthropic.keys added: team-b",
    ]


def test_a_masked_value_is_never_printed_only_said_to_have_changed() -> None:
    usage = "    usage: {{url: 'http://127.0.0.1:9/usage', field: data.active, headers: {{Authorization: {}}}}}\n"
    old = config(BASE + usage.format("Bearer sk-old-secret-1234"))
    new = config(BASE.replace("state: {path: null}",
                              "state: {path: null}\nbackend: {kind: redis, url: 'redis://:hunter22@127.0.0.1:6379/0'}")
                 + usage.format("Bearer sk-new-secret-5678"))
    changes = config_changes(old, new)
    assert changes == [
        "anthropic.usage.headers.Authorization changed",
        "backend.kind memory → redis",
        "backend.url redis://127.0.0.1:6379/0 → redis://:***@127.0.0.1:6379/0",
    ]
    assert not any(secret in " ".join(changes) for secret in ("sk-old", "sk-new", "hunter22"))


def test_a_long_list_of_changes_is_cut_with_a_count() -> None:
    changes = [f"p{n}.limit 1 → 2" for n in range(25)]
    assert describe_changes(changes, limit=3) == "p0.limit 1 → 2, p1.limit 1 → 2, p2.limit 1 → 2 and 22 more"
    assert describe_changes(changes[:2]) == "p0.limit 1 → 2, p1.limit 1 → 2"
