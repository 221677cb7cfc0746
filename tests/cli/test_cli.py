"""The command line as a user runs it: real subprocesses, real files, loopback only."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from ..ports import free_port

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
            timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy", *args],
        cwd=cwd or REPO, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout,
        check=False,
    )


def wait_http(url: str, timeout: float = 15) -> bytes:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.read()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_check_reports_every_problem_with_its_key_path(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(textwrap.dedent("""\
        providers:
          openai:
            upstream: https://api.openai.com/v1
            limit: many
          anthropic:
            limt: 4
        """))
    result = run_cli("check", "--config", str(config))
    assert result.returncode == 2
    err = result.stderr
    assert "providers.openai.limit: must be a positive integer or null (line 4)" in err
    assert "providers.anthropic.limt: unknown key (did you mean 'limit'?)" in err
    assert "providers.anthropic.upstream: required key is missing" in err


def test_check_prints_the_effective_config_with_secrets_masked(tmp_path: Path) -> None:
    config = tmp_path / "ok.yaml"
    config.write_text(textwrap.dedent("""\
        providers:
          openai:
            upstream: https://api.openai.com/v1
            limit: 3
            usage: {url: 'https://example.invalid/usage', field: a.b, headers: {Authorization: Bearer sk-secret-123456}}
        """))
    result = run_cli("check", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert "valid" in result.stdout
    assert "sk-secret-123456" not in result.stdout
    assert "limit: 3" in result.stdout


def test_the_effective_config_check_prints_with_windows_loads_as_it_is(tmp_path: Path) -> None:
    """Windows not written are left out of what ``check`` prints (a written null is refused), so the printed
    config is a config: loaded again, it holds the same windows."""
    config = tmp_path / "windows.yaml"
    config.write_text(textwrap.dedent("""\
        providers:
          openai:
            upstream: https://api.openai.com/v1
            windows: {tokens_per_minute: 1000000}
            models:
              "gpt-5*": {windows: {requests_per_minute: 100}}
        """))
    printed = run_cli("check", "--config", str(config))
    assert printed.returncode == 0, printed.stderr
    assert "null" not in "".join(line for line in printed.stdout.splitlines() if "per_minute" in line)
    again = tmp_path / "printed.yaml"
    again.write_text(printed.stdout)
    reloaded = run_cli("check", "--config", str(again))
    assert reloaded.returncode == 0, reloaded.stderr
    assert reloaded.stdout.splitlines()[2:] == printed.stdout.splitlines()[2:]
    assert "tokens_per_minute: 1000000" in printed.stdout and "requests_per_minute: 100" in printed.stdout


def test_check_warns_about_settings_that_switch_something_off(tmp_path: Path) -> None:
    config = tmp_path / "weak.yaml"
    config.write_text(textwrap.dedent("""\
        backend: {kind: redis, url: 'redis://127.0.0.1:6379/0'}
        providers:
          openai:
            upstream: https://api.openai.com/v1
            usage: {url: 'https://example.invalid/usage', field: a.b}
          local:
            upstream: https://127.0.0.1:8443/v1
            tls_verify: false
        """))
    result = run_cli("check", "--config", str(config))
    assert result.returncode == 0, result.stderr
    warnings = result.stderr.strip().splitlines()
    assert warnings == [
        ("warning: providers.openai.usage is ignored with the redis backend: the usage gate needs "
         "backend.kind: memory (release_cooldown still applies)"),
        ("warning: providers.local.tls_verify is false: the upstream's TLS certificate is not checked "
         "(meant for self-signed test setups only)"),
    ]


def test_serve_without_a_config_names_every_place_it_looked(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SLOTPROXY_CONFIG"}
    result = subprocess.run([sys.executable, "-m", "proxy", "serve"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "--config" in lines[0] and "$SLOTPROXY_CONFIG" in lines[0] and "slotproxy.yaml" in lines[0]


def test_serve_refuses_a_non_loopback_bind_without_an_admin_token() -> None:
    env = {"SLOTPROXY_ADMIN_TOKEN": ""}
    result = run_cli("serve", "--config", "config.example.yaml", "--host", "0.0.0.0", "--port", str(free_port()),
                     env=env)
    assert result.returncode == 2
    assert "SLOTPROXY_ADMIN_TOKEN" in result.stderr and "admin.allow_unauthenticated" in result.stderr


def test_readme_serve_command_runs_the_example_config_and_status_reads_it(tmp_path: Path) -> None:
    """README: `slotproxy serve --config config.example.yaml` (port overridden to stay out of the way)."""
    port = free_port()
    config = tmp_path / "example.yaml"
    config.write_text((REPO / "config.example.yaml").read_text().replace(
        "path: slotproxy-state.json", f"path: {tmp_path / 'state.json'}"))
    process = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--config", str(config), "--port", str(port)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert json.loads(wait_http(f"http://127.0.0.1:{port}/healthz"))["ok"] is True
        assert json.loads(wait_http(f"http://127.0.0.1:{port}/readyz"))["ready"] is True
        table = run_cli("status", "--url", f"http://127.0.0.1:{port}")
        assert table.returncode == 0, table.stderr
        lines = table.stdout.splitlines()
        assert lines[0].startswith(f"slotproxy at http://127.0.0.1:{port}, ")
        assert lines[2].split()[:3] == ["PROVIDER", "LIMIT", "CONFIGURED"]
        assert any(line.startswith("openai") and " 8 " in line for line in lines)
        as_json = json.loads(run_cli("status", "--url", f"http://127.0.0.1:{port}", "--json").stdout)
        assert [p["provider"] for p in as_json["providers"]] == ["openai", "anthropic"]
    finally:
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=40)
    assert process.returncode == 0, err
    assert "slotproxy stopped" in err


def test_status_against_nothing_fails_clearly() -> None:
    port = free_port()
    result = run_cli("status", "--url", f"http://127.0.0.1:{port}")
    assert result.returncode == 1
    assert result.stderr.splitlines() == [(f"slotproxy: no slotproxy answers at http://127.0.0.1:{port} (connection "
                                           "refused); start it with `slotproxy serve`, or pass --url")]


def test_schema_command_prints_the_committed_schema() -> None:
    result = run_cli("schema")
    assert result.returncode == 0
    assert json.loads(result.stdout) == json.loads((REPO / "slotproxy.schema.json").read_text())


@pytest.mark.parametrize("command", [["serve", "--help"], ["fake-upstream", "--help"], ["check", "--help"]])
def test_help_lists_the_spec_flags(command: list[str]) -> None:
    result = run_cli(*command)
    assert result.returncode == 0
    flags = {"serve": ["--config", "--host", "--port"], "fake-upstream": ["--port", "--cap", "--chunks",
             "--delay-ms", "--lag-ms", "--key-limit", "--window-requests", "--window-seconds", "--unified"], "check": ["--config"]}[command[0]]
    for flag in flags:
        assert flag in result.stdout


def test_status_table_lists_pool_keys_and_model_caps() -> None:
    from proxy.cli.status import format_status

    status = {"providers": [{
        "provider": "anthropic", "limit": 8, "configured_limit": 8, "in_flight": 3, "queued": 1,
        "paused_until": None, "cooldown_ms": 0, "notice": None,
        "keys": [{"name": "team-a", "available": True, "limit": 3, "configured_limit": 4, "in_flight": 2,
                  "paused": True, "paused_until": 1800000000000, "notice": "Concurrency limit auto-reduced to 3 after a 429"},
                 {"name": "team-b", "available": False, "limit": 4, "configured_limit": 4, "in_flight": 0,
                  "paused_until": None, "notice": None}],
        "models": [{"pattern": "claude-opus-*", "limit": 2, "configured_limit": 2, "in_flight": 1}],
    }]}
    lines = format_status(status, now_ms=1800000000000 - 90_000).splitlines()
    assert lines[1].split()[:5] == ["anthropic", "8", "8", "3", "1"]
    assert lines[2].split()[:8] == ["key", "team-a", "3", "4", "2", "-", "paused", "until"]
    assert lines[2].endswith(" (in 1 min 30 s)  -")
    assert "1800000000000" not in "\n".join(lines)
    assert lines[3].split()[:3] == ["key", "team-b", "(not"]
    assert lines[4].split() == ["model", "claude-opus-*", "2", "2", "1", "-", "-", "-"]
    assert lines[5] == "! anthropic key team-a: Concurrency limit auto-reduced to 3 after a 429"


def test_check_warns_about_a_pool_key_whose_variable_is_unset(tmp_path: Path) -> None:
    config = tmp_path / "pool.yaml"
    config.write_text(textwrap.dedent("""\
        providers:
          anthropic:
            upstream: https://api.anthropic.com
            auth: x-api-key
            keys:
              - {name: team-a, api_key_env: SP_CLI_POOL_KEY_UNSET, limit: 4}
        """))
    result = run_cli("check", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines() == [(
        "warning: providers.anthropic.keys[0].api_key_env names $SP_CLI_POOL_KEY_UNSET, which is unset or empty: "
        "key 'team-a' is left out of the pool until it is set (with no key left, requests carry the client's own "
        "credentials)")]
    assert "name: team-a" in result.stdout


_WITHOUT_REDIS = ("import sys; sys.modules['redis'] = None; sys.modules['redis.asyncio'] = None; "
                  "from proxy.cli import main; sys.exit(main(sys.argv[1:]))")


@pytest.mark.parametrize("command", ["check", "serve"])
def test_the_redis_backend_without_its_client_is_one_line_and_exit_2(tmp_path: Path, command: str) -> None:
    config = tmp_path / "redis.yaml"
    config.write_text("backend: {kind: redis}\nproviders: {openai: {upstream: 'https://api.openai.com/v1'}}\n")
    result = subprocess.run([sys.executable, "-c", _WITHOUT_REDIS, command, "--config", str(config)], cwd=REPO,
                            capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [(
        "slotproxy: backend.kind is redis but the redis client is not installed in this Python: "
        "pip install 'redis[hiredis]>=5' (or reinstall slotproxy with its dependencies)")]
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_serve_names_the_dashboard_url() -> None:
    from proxy.server.run import dashboard_url

    assert dashboard_url("127.0.0.1", 8787) == "http://127.0.0.1:8787/_slotproxy/"
    assert dashboard_url("0.0.0.0", 80) == "http://127.0.0.1:80/_slotproxy/"
    assert dashboard_url("::", 8787) == "http://[::1]:8787/_slotproxy/"
    assert dashboard_url("fd00::5", 1) == "http://[fd00::5]:1/_slotproxy/"


def test_version_prints_the_package_version() -> None:
    from proxy import __version__

    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"slotproxy {__version__}"


def test_check_says_where_prices_come_from_and_refuses_a_negative_cap(tmp_path: Path) -> None:
    config = tmp_path / "slotproxy.yaml"
    config.write_text("providers:\n  openai: {upstream: 'https://api.openai.com'}\n"
                      "prices:\n  'claude-sonnet-*': {input: 3.0, output: 15.0, cache_read: 0.30, cache_write: 3.75}\n"
                      "workspaces:\n  spend_per_day_usd: {'*': 50, web-app: 200}\n")
    result = run_cli("check", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert "# prices: 1 pattern from the config, then genai-prices " in result.stdout
    assert "spend caps per UTC day: * $50.00, web-app $200.00" in result.stdout
    config.write_text(config.read_text().replace("web-app: 200", "web-app: -1"))
    result = run_cli("check", "--config", str(config))
    assert result.returncode == 2
    assert "workspaces.spend_per_day_usd.web-app: must be an amount of US dollars" in result.stderr
