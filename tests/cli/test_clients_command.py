"""``slotproxy clients``: what it prints for a few configs, and that the README's guides are its output."""

from __future__ import annotations

import io
import os
import re
import textwrap
import tomllib
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from unittest import mock

import pytest

from proxy.cli import build_parser, main
from proxy.cli.clients import AGENTS, default_url, guide, normalize_url
from proxy.config import parse_config

from .test_cli import REPO, run_cli

EXAMPLE = REPO / "config.example.yaml"
AGENTS_DOC = (REPO / "docs" / "agents.md").read_text()
URL = "http://127.0.0.1:8787"
KEYS_SET = {"OPENAI_API_KEY": "sk-test-not-printed", "ANTHROPIC_API_KEY": "sk-ant-test-not-printed"}
"""The guides are for a proxy started where they are printed: unless a test says otherwise, it has its keys."""


def clients(*args: str, config: Path = EXAMPLE, env: dict[str, str] | None = None) -> str:
    """The command's output, run in this process (the README test below runs it as a subprocess)."""
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, {**KEYS_SET, **(env or {})}), redirect_stdout(out), redirect_stderr(err):
        code = main(["clients", "--config", str(config), *args])
    assert code == 0, err.getvalue()
    assert err.getvalue() == ""
    return out.getvalue()


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "slotproxy.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def toml_blocks(text: str) -> list[dict[str, object]]:
    """The Codex guide's config.toml forms, each parsed as Codex would parse it."""
    first, *others = text.split("\n\n# Or ")
    return [tomllib.loads(part) for part in (first, *("# Or " + other for other in others))]


# --- the example config ---------------------------------------------------------------------------


def test_every_agent_under_its_heading_for_the_example_config() -> None:
    out = clients()
    headings = re.findall(r"^== .+ \(--agent ([a-z-]+)\) ==$", out, re.MULTILINE)
    assert headings == list(AGENTS)
    for agent in AGENTS:
        assert clients("--agent", agent) in out


def test_the_example_config_guides() -> None:
    assert clients("--agent", "claude-code") == (
        "export ANTHROPIC_BASE_URL=http://127.0.0.1:8787/anthropic\n"
        '# optional, one "Name: Value" per line: a workspace and a star, fixed for the session\n'
        "export ANTHROPIC_CUSTOM_HEADERS=$'X-Workspace-Id: web-app\\nX-Workspace-Starred: 1'\n"
        "claude\n"
    )
    builtin, custom = toml_blocks(clients("--agent", "codex"))
    assert builtin == {"openai_base_url": "http://127.0.0.1:8787/openai"}
    assert custom == {
        "model_provider": "slotproxy",
        "model_providers": {"slotproxy": {
            "name": "OpenAI via slotproxy", "base_url": "http://127.0.0.1:8787/openai", "env_key": "OPENAI_API_KEY",
            "wire_api": "responses", "supports_websockets": True, "http_headers": {"X-Workspace-Id": "web-app"},
            "env_http_headers": {"X-Workspace-Starred": "SLOTPROXY_STARRED"}}},
    }
    assert 'base_url="http://127.0.0.1:8787/openai"' in clients("--agent", "openai-sdk")
    assert 'base_url="http://127.0.0.1:8787/anthropic"' in clients("--agent", "anthropic-sdk")
    assert "export OPENAI_API_BASE=http://127.0.0.1:8787/openai\naider --model openai/" in clients("--agent", "aider")
    exports = [line for line in clients("--agent", "env").splitlines() if line.startswith("export ")]
    assert exports == ["export OPENAI_BASE_URL=http://127.0.0.1:8787/openai",
                       "export OPENAI_API_BASE=http://127.0.0.1:8787/openai",
                       "export ANTHROPIC_BASE_URL=http://127.0.0.1:8787/anthropic"]


def test_the_python_snippets_compile() -> None:
    for agent in ("openai-sdk", "anthropic-sdk"):
        compile(clients("--agent", agent), agent, "exec")


# --- other configs ----------------------------------------------------------------------------------


def test_a_custom_port_and_renamed_headers(tmp_path: Path) -> None:
    config = write(tmp_path, """\
        server: {port: 9911}
        headers: {workspace: X-Team, starred: X-Urgent}
        providers:
          gpt: {upstream: "https://api.openai.com/v1"}
          claude: {upstream: "https://api.anthropic.com"}
        """)
    assert clients("--agent", "claude-code", config=config).startswith(
        "export ANTHROPIC_BASE_URL=http://127.0.0.1:9911/claude\n")
    assert "X-Team: web-app\\nX-Urgent: 1" in clients("--agent", "claude-code", config=config)
    builtin, custom = toml_blocks(clients("--agent", "codex", config=config))
    assert builtin == {"openai_base_url": "http://127.0.0.1:9911/gpt"}
    provider = custom["model_providers"]["slotproxy"]  # type: ignore[index]
    assert provider["http_headers"] == {"X-Team": "web-app"}
    assert provider["env_http_headers"] == {"X-Urgent": "SLOTPROXY_STARRED"}


@pytest.mark.parametrize(("host", "url"), [("0.0.0.0", "http://127.0.0.1:8787"), ("::", "http://127.0.0.1:8787"),
                                           ("::1", "http://[::1]:8787"), ("10.1.2.3", "http://10.1.2.3:8787")])
def test_the_default_url_from_server_host(host: str, url: str) -> None:
    config = parse_config(f'server: {{host: "{host}"}}\nproviders: {{openai: {{upstream: "https://api.openai.com/v1"}}}}\n')
    assert default_url(config) == url


def test_a_wildcard_host_is_printed_as_loopback(tmp_path: Path) -> None:
    config = write(tmp_path, """\
        server: {host: 0.0.0.0, port: 8800}
        providers:
          openai: {upstream: "https://api.openai.com/v1"}
        """)
    assert "export OPENAI_BASE_URL=http://127.0.0.1:8800/openai\n" in clients("--agent", "env", config=config)


def test_url_overrides_the_config(tmp_path: Path) -> None:
    out = clients("--agent", "env", "--url", "http://slotproxy.agents.svc:8787/")
    assert "export OPENAI_BASE_URL=http://slotproxy.agents.svc:8787/openai\n" in out
    result = run_cli("clients", "--config", str(EXAMPLE), "--url", "127.0.0.1:8787")
    assert result.returncode == 2
    assert "--url must be the proxy's base URL, such as http://127.0.0.1:8787" in result.stderr
    with pytest.raises(ValueError):
        normalize_url("ftp://example.com")


def test_the_config_is_found_like_serve_finds_it(tmp_path: Path) -> None:
    (tmp_path / "slotproxy.yaml").write_text('server: {port: 8123}\nproviders: {openai: {upstream: "https://api.openai.com/v1"}}\n')
    result = run_cli("clients", "--agent", "env", cwd=tmp_path, env={"SLOTPROXY_CONFIG": ""})
    assert result.returncode == 0, result.stderr
    assert "127.0.0.1:8123/openai" in result.stdout
    missing = run_cli("clients", cwd=tmp_path, env={"SLOTPROXY_CONFIG": str(tmp_path / "nope.yaml")})
    assert missing.returncode == 0  # a missing $SLOTPROXY_CONFIG falls back to ./slotproxy.yaml, as for serve
    empty = tmp_path / "empty"
    empty.mkdir()
    none = run_cli("clients", cwd=empty, env={"SLOTPROXY_CONFIG": ""})
    assert none.returncode == 2 and "no config file found" in none.stderr


CLIENT_KEYS = """\
    access: {keys_env: SLOTPROXY_CLIENT_KEYS}
    providers:
      openai: {upstream: "https://api.openai.com/v1", api_key_env: OPENAI_API_KEY}
      anthropic: {upstream: "https://api.anthropic.com", auth: x-api-key}
    """


def test_client_keys_are_sent_from_a_variable_never_printed(tmp_path: Path) -> None:
    config = write(tmp_path, CLIENT_KEYS)
    secret = "ck-do-not-print-me"
    out = clients(config=config, env={"SLOTPROXY_CLIENT_KEYS": secret, "SLOTPROXY_KEY": secret,
                                      "OPENAI_API_KEY": "sk-" + secret})
    assert secret not in out
    claude = clients("--agent", "claude-code", config=config)
    assert "export ANTHROPIC_CUSTOM_HEADERS=$'X-Workspace-Id: web-app\\nX-Workspace-Starred: 1\\n'" \
           '"X-Slotproxy-Key: $SLOTPROXY_KEY"\n' in claude
    assert "$SLOTPROXY_CLIENT_KEYS" in claude
    # openai injects its own key: the client key can be Codex's API key, or a header of its own provider.
    codex = clients("--agent", "codex", config=config)
    builtin, custom = toml_blocks(codex)
    assert builtin == {"openai_base_url": "http://127.0.0.1:8787/openai"}
    assert "printenv SLOTPROXY_KEY | codex login --with-api-key" in codex
    assert custom["model_providers"]["slotproxy"]["env_http_headers"] == {  # type: ignore[index]
        "X-Workspace-Starred": "SLOTPROXY_STARRED", "X-Slotproxy-Key": "SLOTPROXY_KEY"}
    for agent in ("openai-sdk", "anthropic-sdk"):
        assert '"X-Slotproxy-Key": os.environ["SLOTPROXY_KEY"],' in clients("--agent", agent, config=config)
    env = clients("--agent", "env", config=config)
    assert 'export OPENAI_API_KEY="$SLOTPROXY_KEY"' in env  # the proxy sends its own OpenAI key
    assert "ANTHROPIC_API_KEY" not in env  # anthropic forwards the agent's own: the key cannot be the API key
    assert "anthropic forwards the agent's own key" in env
    assert 'export OPENAI_API_KEY="$SLOTPROXY_KEY"' in clients("--agent", "aider", config=config)


def test_client_keys_without_an_injected_key_need_codex_s_own_provider(tmp_path: Path) -> None:
    config = write(tmp_path, CLIENT_KEYS.replace(", api_key_env: OPENAI_API_KEY", ""))
    codex = clients("--agent", "codex", config=config)
    (only,) = toml_blocks(codex)
    assert "openai_base_url" not in codex.split("[model_providers")[0].replace("# ", "")
    assert only["model_provider"] == "slotproxy"
    assert "the built-in provider cannot send X-Slotproxy-Key" in codex
    aider = clients("--agent", "aider", config=config)
    assert aider.startswith("# aider cannot send X-Slotproxy-Key") and "export" not in aider


def test_no_anthropic_provider_says_so_in_one_line(tmp_path: Path) -> None:
    config = write(tmp_path, 'providers: {openai: {upstream: "https://api.openai.com/v1"}}\n')
    for agent in ("claude-code", "anthropic-sdk"):
        out = clients("--agent", agent, config=config)
        assert out.count("\n") == 1 and out.startswith("# no provider in this config serves"), out
    env = clients("--agent", "env", config=config)
    assert "ANTHROPIC_BASE_URL" not in env.replace("# (no provider", "")
    assert "export OPENAI_BASE_URL=http://127.0.0.1:8787/openai" in env
    assert "== Claude Code (--agent claude-code) ==\n# no provider" in clients(config=config)


def test_no_openai_provider_says_so_in_one_line(tmp_path: Path) -> None:
    config = write(tmp_path, 'providers: {claude: {upstream: "https://api.anthropic.com"}}\n')
    for agent in ("codex", "openai-sdk", "aider"):
        out = clients("--agent", agent, config=config)
        assert out.count("\n") == 1 and out.startswith("# no provider in this config serves"), out


def test_which_provider_serves_whom(tmp_path: Path) -> None:
    config = parse_config(textwrap.dedent("""\
        providers:
          local: {upstream: "http://127.0.0.1:9100/v1"}
          proxy-for-claude: {upstream: "https://llm.example.com", auth: x-api-key}
          openai: {upstream: "https://api.openai.com/v1"}
        """))
    assert "/proxy-for-claude" in guide(config, "claude-code", URL).text
    assert f'"{URL}/openai"' in guide(config, "codex", URL).text  # api.openai.com comes first
    websocket_off = parse_config('providers: {openai: {upstream: "https://api.openai.com/v1", websocket: false}}\n')
    assert "supports_websockets = false" in guide(websocket_off, "codex", URL).text


def test_an_unknown_agent_is_refused_by_argparse() -> None:
    result = run_cli("clients", "--config", str(EXAMPLE), "--agent", "cursor")
    assert result.returncode == 2
    assert "invalid choice: 'cursor'" in result.stderr


def test_every_option_states_its_default() -> None:
    result = run_cli("clients", "--help")
    assert result.returncode == 0
    for option in ("--config", "--url", "--agent"):
        text = result.stdout.split(option, 2)[-1]
        assert "default" in text.split("\n  -", 1)[0], option


def test_the_parser_offers_the_agents_the_guides_know() -> None:
    parser = build_parser()
    for agent in AGENTS:
        assert parser.parse_args(["clients", "--agent", agent]).agent == agent
    assert "{" + ",".join(AGENTS) + "}" in run_cli("clients", "--help").stdout


# --- the README -------------------------------------------------------------------------------------


def _readme_blocks(agent: str) -> list[str]:
    """The fenced blocks of the docs/agents.md section whose guide ``slotproxy clients --agent X`` prints."""
    marker = AGENTS_DOC.index(f"`slotproxy clients --agent {agent}` prints this guide")
    start = AGENTS_DOC.rindex("\n## ", 0, marker)
    end = AGENTS_DOC.find("\n## ", marker)
    part = AGENTS_DOC[start:end if end != -1 else len(AGENTS_DOC)]
    return [m.group(1) for m in re.finditer(r"^```\w*\n(.*?)^```", part, re.DOTALL | re.MULTILINE)]


@pytest.mark.parametrize("agent", AGENTS)
def test_the_readme_guide_is_the_command_s_output(agent: str) -> None:
    result = run_cli("clients", "--agent", agent, "--config", "config.example.yaml", env=KEYS_SET)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    blocks = _readme_blocks(agent)
    assert blocks, agent
    assert "\n".join(blocks) == out
    fences = [snippet.lang for snippet in guide(parse_config(EXAMPLE.read_text()), agent, URL).snippets]
    for lang, block in zip(fences, blocks, strict=True):
        assert f"```{lang}\n{block}```" in AGENTS_DOC


def test_a_local_anthropic_provider_is_known_by_its_id_and_codex_gets_the_openai_one(tmp_path) -> None:
    """A provider named anthropic in front of a local upstream, with the default auth, listed first."""
    from proxy.cli.clients import guide
    from proxy.config import parse_config

    config = parse_config("providers:\n  anthropic: {upstream: 'http://127.0.0.1:9100'}\n"
                          "  openai: {upstream: 'http://127.0.0.1:9100/v1'}\n")
    texts = {agent: guide(config, agent, "http://127.0.0.1:8787").text for agent in ("codex", "claude-code")}
    assert 'openai_base_url = "http://127.0.0.1:8787/openai"' in texts["codex"]
    assert "ANTHROPIC_BASE_URL=http://127.0.0.1:8787/anthropic" in texts["claude-code"]
