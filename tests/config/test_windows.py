"""The ``windows:`` config: the SPEC's YAML, every mistake named by its key path, what the limiter is given,
what ``check`` prints, and the Redis backend refused until it holds windows."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from proxy.config import ConfigError, parse_config
from proxy.config.diff import config_changes
from proxy.config.model import config_json_schema
from proxy.http.runtime import limiter_settings
from proxy.limiter import LimiterSettings
from proxy.limiter.window import WINDOW_NAMES, WindowSettings

from ..cli.test_cli import run_cli
from .test_model import _matches

REPO = Path(__file__).resolve().parents[2]

SPEC = """\
providers:
  anthropic:
    upstream: https://api.anthropic.com
    auth: x-api-key
    limit: 8
    windows:
      input_tokens_per_minute: 450000
      output_tokens_per_minute: 90000
      requests_per_minute: 4000
      learn: true
      headroom: 0.05
    models:
      "claude-opus-*": {limit: 2, windows: {input_tokens_per_minute: 200000}}
    keys:
      - {name: team-a, api_key_env: KEY_A, windows: {output_tokens_per_minute: 40000}}
      - {name: team-b, api_key_env: KEY_B}
"""
SPEC_WINDOWS = WindowSettings(
    provider={"input_tokens_per_minute": 450000, "output_tokens_per_minute": 90000, "requests_per_minute": 4000},
    models={"claude-opus-*": {"input_tokens_per_minute": 200000}},
    keys={"team-a": {"output_tokens_per_minute": 40000}},
    learn=True,
    headroom=0.05,
)


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        parse_config(textwrap.dedent(text))
    return exc.value.problems


def provider(windows: str = "", models: str = "", keys: str = "", extra: str = "") -> str:
    lines = ["providers:", "  p:", "    upstream: 'http://127.0.0.1:1'"]
    lines += [f"    {part}" for part in (windows, models, keys) if part]
    return "\n".join(lines) + "\n" + extra


def test_the_spec_s_windows_reach_the_limiter() -> None:
    settings = parse_config(SPEC).provider("anthropic")
    assert settings.window_settings() == SPEC_WINDOWS
    assert settings.dialect == "anthropic"
    limiter = limiter_settings(settings, {"KEY_A": "a", "KEY_B": "b"})
    assert limiter.windows == SPEC_WINDOWS
    assert hash(limiter) == hash(limiter_settings(settings, {"KEY_A": "a", "KEY_B": "b"}))


def test_no_windows_written_holds_none() -> None:
    settings = parse_config(provider()).provider("p")
    assert settings.window_settings() is None and settings.windows is None
    assert limiter_settings(settings, {}) == LimiterSettings(), "as before windows existed"
    assert settings.dialect == "openai"


def test_an_empty_windows_block_learns_every_limit_from_the_answers() -> None:
    windows = parse_config(provider("windows: {}")).provider("p").window_settings()
    assert windows == WindowSettings(provider={}, models={}, keys={}, learn=True, headroom=0.0)


def test_a_model_s_windows_alone_switch_windows_on_with_the_provider_defaults() -> None:
    text = provider(models="models: {'gpt-4o*': {windows: {tokens_per_minute: 30000}}}")
    windows = parse_config(text).provider("p").window_settings()
    assert windows == WindowSettings(models={"gpt-4o*": {"tokens_per_minute": 30000}}, learn=True, headroom=0.0)


def test_a_key_s_windows_alone_switch_windows_on() -> None:
    text = provider(keys="keys: [{name: a, api_key_env: A, windows: {requests_per_minute: 3}}, "
                         "{name: b, api_key_env: B}]")
    windows = parse_config(text).provider("p").window_settings()
    assert windows == WindowSettings(keys={"a": {"requests_per_minute": 3}})


def test_window_settings_are_frozen_and_hashable() -> None:
    with pytest.raises(TypeError):
        SPEC_WINDOWS.provider["tokens_per_minute"] = 1  # type: ignore[index]
    with pytest.raises(TypeError):
        SPEC_WINDOWS.models["claude-opus-*"]["tokens_per_minute"] = 1  # type: ignore[index]
    assert len({SPEC_WINDOWS, parse_config(SPEC).provider("anthropic").window_settings()}) == 1
    assert WINDOW_NAMES == ("input_tokens_per_minute", "output_tokens_per_minute", "tokens_per_minute",
                            "requests_per_minute")


LIMIT_RULE = "must be a whole number per minute, 1 or more (leave the window out to hold none)"
HEADROOM_RULE = "must be the fraction of each window left unused: a number from 0 up to (not including) 1"


@pytest.mark.parametrize(("text", "message"), [
    (provider("windows: {input_tokens_per_minute: 0}"), f"providers.p.windows.input_tokens_per_minute: {LIMIT_RULE}"),
    (provider("windows: {tokens_per_minute: -5}"), f"providers.p.windows.tokens_per_minute: {LIMIT_RULE}"),
    (provider("windows: {tokens_per_minute: 1.5}"), f"providers.p.windows.tokens_per_minute: {LIMIT_RULE}"),
    (provider("windows: {tokens_per_minute: 450k}"), f"providers.p.windows.tokens_per_minute: {LIMIT_RULE}"),
    (provider("windows: {tokens_per_minute: true}"), f"providers.p.windows.tokens_per_minute: {LIMIT_RULE}"),
    (provider("windows: {requests_per_minute: null}"), f"providers.p.windows.requests_per_minute: {LIMIT_RULE}"),
    (provider("windows: {headroom: 1}"), f"providers.p.windows.headroom: {HEADROOM_RULE}"),
    (provider("windows: {headroom: -0.1}"), f"providers.p.windows.headroom: {HEADROOM_RULE}"),
    (provider("windows: {headroom: 5%}"), f"providers.p.windows.headroom: {HEADROOM_RULE}"),
    (provider("windows: {learn: sometimes}"), "providers.p.windows.learn: must be true or false"),
    (provider("windows: {tokens_per_min: 5}"),
     "providers.p.windows.tokens_per_min: unknown key (did you mean 'tokens_per_minute'?)"),
    (provider("windows: 450000"), "providers.p.windows: must be a mapping"),
    (provider(models="models: {'o*': {windows: {requests_per_minute: 0}}}"),
     f"providers.p.models.o*.windows.requests_per_minute: {LIMIT_RULE}"),
    (provider(models="models: {'o*': {windows: {learn: false}}}"),
     ("providers.p.models.o*.windows.learn: learn is provider-wide: set it in the provider's own windows: block, "
      "where it applies to every key and model")),
    (provider(keys="keys: [{name: a, api_key_env: A, windows: {headroom: 0.1}}]"),
     "providers.p.keys[0].windows.headroom: headroom is provider-wide: set it in the provider's own windows: block"),
    (provider(keys="keys: [{name: a, api_key_env: A, windows: {output_tokens_per_mintue: 4}}]"),
     "providers.p.keys[0].windows.output_tokens_per_mintue: unknown key (did you mean 'output_tokens_per_minute'?)"),
])
def test_window_mistakes_name_the_key_path_and_the_fix(text: str, message: str) -> None:
    found = problems(text)
    assert any(problem.startswith(message) for problem in found), found
    assert all(re.search(r"\(line \d+\)$", problem) for problem in found), found


def test_a_provider_wide_setting_in_a_model_block_is_named_beside_the_block_s_other_mistakes() -> None:
    found = problems(provider(models="models: {'o*': {windows: {headroom: 0.1, output_tokens_per_minute: 0}}}",
                              keys="keys: [{name: a, api_key_env: A, windows: {requests_per_minute: x, learn: false}}]"))
    assert sorted(problem.split(":")[0] for problem in found) == [
        "providers.p.keys[0].windows.learn", "providers.p.keys[0].windows.requests_per_minute",
        "providers.p.models.o*.windows.headroom", "providers.p.models.o*.windows.output_tokens_per_minute"], found


def test_a_mistake_in_a_pool_key_gets_a_did_you_mean() -> None:
    """A key of a pool is a list item: the hint follows it (it used to say only "unknown key")."""
    assert problems(provider(keys="keys: [{name: a, api_key_env: A, limt: 4}]")) == [
        "providers.p.keys[0].limt: unknown key (did you mean 'limit'?) (line 4)"]


def test_windows_with_the_redis_backend_are_held_there() -> None:
    """The Redis backend holds windows fleet-wide: the config that once was refused is taken as it is."""
    config = parse_config(SPEC + "backend: {kind: redis, url: 'redis://127.0.0.1:6379/0'}\n")
    assert config.backend.kind == "redis"
    assert config.provider("anthropic").window_settings() == SPEC_WINDOWS


def test_a_window_the_provider_s_api_does_not_have_is_a_warning() -> None:
    text = provider("windows: {input_tokens_per_minute: 5, tokens_per_minute: 9}",
                    models="models: {'o*': {windows: {output_tokens_per_minute: 3}}}")
    rest = ("is not a window of OpenAI's (auth: bearer) API, whose windows are tokens_per_minute, "
            "requests_per_minute: it is held as written, but never learned from answers or recognised in a 429")
    assert parse_config(text).warnings() == [
        f"providers.p.windows.input_tokens_per_minute {rest}",
        f'providers.p.models["o*"].windows.output_tokens_per_minute {rest}',
    ]
    assert parse_config(SPEC).warnings() == []


def test_a_reload_says_which_window_changed() -> None:
    old = parse_config(SPEC)
    new = parse_config(SPEC.replace("input_tokens_per_minute: 450000", "input_tokens_per_minute: 400000")
                       .replace("headroom: 0.05", "headroom: 0.1"))
    assert config_changes(old, new) == ["anthropic.windows.input_tokens_per_minute 450000 → 400000",
                                        "anthropic.windows.headroom 0.05 → 0.1"]
    added = config_changes(parse_config(provider()), parse_config(provider("windows: {tokens_per_minute: 9}")))
    assert added == ["p.windows null → {tokens_per_minute: 9, learn: true, headroom: 0.0}"]


def test_the_schema_knows_the_windows() -> None:
    schema = config_json_schema()
    spec = {"providers": {"anthropic": {
        "upstream": "https://api.anthropic.com", "auth": "x-api-key",
        "windows": {"input_tokens_per_minute": 450000, "learn": True, "headroom": 0.05},
        "models": {"claude-opus-*": {"limit": 2, "windows": {"input_tokens_per_minute": 200000}}},
        "keys": [{"name": "team-a", "api_key_env": "KEY_A", "windows": {"output_tokens_per_minute": 40000}}]}}}
    assert _matches(schema, spec, schema)
    assert schema["$defs"]["ProviderWindows"]["properties"]["headroom"]["exclusiveMaximum"] == 1
    for bad in ({"input_tokens_per_minute": 0}, {"tokens_per_min": 5}, {"learn": "yes"}):
        wrong = {"providers": {"p": {"upstream": "http://x", "windows": bad}}}
        assert not _matches(schema, wrong, schema), bad
    learned_on_a_model = {"providers": {"p": {"upstream": "http://x", "models": {"m": {"windows": {"learn": True}}}}}}
    assert not _matches(schema, learned_on_a_model, schema)


def _with_windows_written_in(text: str) -> str:
    """The example with its commented ``windows:`` block written in (the comments after each value dropped)."""
    lines = text.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("    # windows:"))
    end, block = start, []
    while lines[end].startswith("    # ") and not lines[end].startswith("    # keys:"):
        body = lines[end][len("    # "):].split("#", 1)[0].rstrip()
        if body:
            block.append(f"    {body}\n")
        end += 1
    return "".join(lines[:start] + block + lines[end:])


def test_the_example_holds_no_window_and_its_commented_block_is_valid() -> None:
    text = (REPO / "config.example.yaml").read_text()
    assert parse_config(text).provider("anthropic").window_settings() is None, "the example serves as before"
    written = parse_config(_with_windows_written_in(text))
    assert written.provider("anthropic").window_settings() == WindowSettings(
        provider={"input_tokens_per_minute": 450000, "output_tokens_per_minute": 90000, "requests_per_minute": 4000},
        learn=True, headroom=0.05)


def test_check_prints_the_windows_with_either_backend(tmp_path: Path) -> None:
    config = tmp_path / "windows.yaml"
    config.write_text(SPEC)
    result = run_cli("check", "--config", str(config))
    assert result.returncode == 0, result.stderr
    printed = result.stdout
    assert "    windows:\n      input_tokens_per_minute: 450000\n" in printed
    assert "      learn: true\n      headroom: 0.05\n" in printed
    assert "output_tokens_per_minute: 40000" in printed

    config.write_text(SPEC + "backend: {kind: redis, url: 'redis://127.0.0.1:6379/0'}\n")
    result = run_cli("check", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert "    windows:\n      input_tokens_per_minute: 450000\n" in result.stdout
