"""Issue 24's config findings: variable names (7), ``server.max_connections`` (8), an empty config (9).

Before: ``check`` called ``ANTHROPIC_API_KEY_TEAM_PLATFORM`` and ``ACC_POOL_B_UNSET_1a2b3c`` "a key value" and
masked them (``ANTH***``), so the unset-variable warning named no variable; ``max_connections: 4`` silently
became 16; an empty file (or ``providers: {}``) was "valid" and served nothing.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import aiohttp
import pytest

from proxy.config.types import env_name_for_display, looks_like_a_key
from proxy.http.connections import ConnectionGuard, ConnectionSettings, connection_cap

from ..conftest import chat

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str, cwd: Path = REPO, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "ACC_POOL_"))}
    return subprocess.run([sys.executable, "-m", "proxy", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60, check=False, env={**environ, **(env or {})})


# --- 7: a variable name is a variable name -----------------------------------------------------------


def test_check_names_long_and_mixed_case_variables_it_warns_about(tmp_path: Path) -> None:
    config = tmp_path / "names.yaml"
    config.write_text(textwrap.dedent("""\
        providers:
          anthropic:
            upstream: https://api.anthropic.com
            auth: x-api-key
            api_key_env: ANTHROPIC_API_KEY_TEAM_PLATFORM
          pooled:
            upstream: https://api.anthropic.com
            keys:
              - {name: b, api_key_env: ACC_POOL_B_UNSET_1a2b3c}
        """))
    result = cli("check", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        ("warning: providers.anthropic.api_key_env names $ANTHROPIC_API_KEY_TEAM_PLATFORM, which is unset or empty: "
         "requests to this provider carry the client's own credentials until it is set"),
        ("warning: providers.pooled.keys[0].api_key_env names $ACC_POOL_B_UNSET_1a2b3c, which is unset or empty: "
         "key 'b' is left out of the pool until it is set (with no key left, requests carry the client's own "
         "credentials)"),
    ]
    assert "    api_key_env: ANTHROPIC_API_KEY_TEAM_PLATFORM\n" in result.stdout
    assert "      api_key_env: ACC_POOL_B_UNSET_1a2b3c\n" in result.stdout
    assert "***" not in result.stdout.split("providers:", 1)[1].split("workspaces:", 1)[0]


@pytest.mark.parametrize("name", [
    "ANTHROPIC_API_KEY_TEAM_PLATFORM", "ACC_POOL_B_UNSET_1a2b3c", "_private", "openai_key", "X",
    "A_VERY_LONG_VARIABLE_NAME_THAT_GOES_ON_AND_ON_FOR_SIXTY_FOUR_CHARS", "MyTeamKey2024Production",
])
def test_a_name_of_letters_digits_and_underscores_is_a_variable_name(name: str) -> None:
    assert not looks_like_a_key(name)
    assert env_name_for_display(name) == name


@pytest.mark.parametrize("value", [
    "sk-proj-abc123def456", "sk-ant-api03-xyz", "my-key", "key.with.dots", "has space", "1LEADING_DIGIT",
    "AIzaSyD" + "x7Q2" * 8,  # a Google API key: could be a name, but is a known key format
])
def test_only_what_cannot_be_a_name_or_is_a_known_key_format_is_a_pasted_key(value: str) -> None:
    assert looks_like_a_key(value)
    assert env_name_for_display(value) == value[:4] + "***"


def test_a_pasted_key_with_a_dash_is_refused_without_being_echoed(tmp_path: Path) -> None:
    pasted = "sk-proj-" + "Ab3" * 12
    config = tmp_path / "pasted.yaml"
    config.write_text(f"providers:\n  openai: {{upstream: 'https://api.openai.com/v1', api_key_env: {pasted}}}\n")
    result = cli("check", "--config", str(config))
    assert result.returncode == 2
    assert result.stderr.splitlines()[1] == (
        "  providers.openai.api_key_env: must be the NAME of an environment variable (letters, digits and _), "
        "not its value (line 2)")
    assert pasted not in result.stdout + result.stderr


# --- 8: server.max_connections is honoured as written -----------------------------------------------


def test_connection_cap_honours_small_values_and_still_lowers_for_open_files() -> None:
    assert connection_cap(4, 1_000_000) == 4
    assert connection_cap(1, 1_000_000) == 1
    assert connection_cap(4096, 1024) == (1024 - 64) // 2  # the open-files lowering stays
    assert connection_cap(4096, 64) == 16  # ... and never goes below 16 by itself
    assert connection_cap(4, 64) == 4


def test_the_guard_takes_max_connections_4_as_4(caplog) -> None:
    guard = ConnectionGuard(ConnectionSettings(max_connections=4))
    assert guard.cap == 4
    assert not [r for r in caplog.records if "max_connections" in r.getMessage()]  # nothing was lowered


async def test_max_connections_2_refuses_a_third_connection_while_two_are_busy(start_upstream, start_proxy) -> None:
    upstream = await start_upstream(chunks=400, delay_ms=25)
    proxy = await start_proxy(f"state: {{path: null}}\nserver: {{max_connections: 2}}\n"
                              f"providers:\n  openai: {{upstream: '{upstream.url}/v1'}}\n")
    assert proxy.state.connections.cap == 2
    url = f"{proxy.url}/openai/chat/completions"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        streams = [await session.post(url, json=chat()) for _ in range(2)]  # headers in, bodies still streaming
        try:
            assert [s.status for s in streams] == [200, 200]
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            try:
                writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                answer = await asyncio.wait_for(reader.read(), 5)
            finally:
                writer.close()
        finally:
            for stream in streams:
                stream.close()
    assert answer.startswith(b"HTTP/1.1 503 "), answer
    assert b"too_many_connections" in answer


def test_the_open_files_lowering_is_still_logged(caplog) -> None:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = soft * 4
    guard = ConnectionGuard()
    guard.configure(ConnectionSettings(max_connections=wanted))
    assert guard.cap == connection_cap(wanted, soft) < wanted
    assert any(f"server.max_connections is {wanted}, but the open files limit ({soft}) leaves room for {guard.cap}"
               in r.getMessage() for r in caplog.records), caplog.text


# --- 9: an empty config is refused, naming providers ---------------------------------------------------

_ADD = ("add at least one provider, e.g. providers: {openai: {upstream: 'https://api.openai.com/v1', api_key_env: "
        "OPENAI_API_KEY}}, or run `slotproxy init` for a commented config that serves as is")


@pytest.mark.parametrize("command", ["check", "serve"])
@pytest.mark.parametrize(("text", "problem"), [
    ("", f"providers: required key is missing: {_ADD}"),
    ("# nothing yet\n", f"providers: required key is missing: {_ADD}"),
    ("server: {port: 1}\n", f"providers: required key is missing: {_ADD}"),
    ("state: {path: null}\nproviders: {}\n", f"providers: is empty: {_ADD} (line 2)"),
    ("state: {path: null}\nproviders:\n", f"providers: is empty: {_ADD} (line 2)"),
])
def test_a_config_with_no_provider_is_refused(tmp_path: Path, command: str, text: str, problem: str) -> None:
    config = tmp_path / "slotproxy.yaml"
    config.write_text(text)
    result = cli(command, "--config", str(config))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"slotproxy: {config}: invalid config", f"  {problem}"]
    assert result.stdout == ""


def test_no_provider_comes_with_the_other_problems(tmp_path: Path) -> None:
    config = tmp_path / "slotproxy.yaml"
    config.write_text("server: {prot: 1}\n")
    result = cli("check", "--config", str(config))
    assert result.returncode == 2
    assert result.stderr.splitlines()[1:] == [
        "  server.prot: unknown key (did you mean 'port'?) (line 1)",
        f"  providers: required key is missing: {_ADD}",
    ]
