"""``slotproxy clients`` where no config file is found (asking the running proxy at --url), and the Codex guide
saying whose key goes upstream: the proxy's when its key variable is set, the agent's own when not."""

from __future__ import annotations

import asyncio
import tomllib
from pathlib import Path

from proxy.cli.clients import guide, render, setup_from_config, setup_from_status
from proxy.config import parse_config

from ..ports import free_port
from .test_cli import run_cli
from .test_clients_command import EXAMPLE, URL, clients, toml_blocks, write

NO_CONFIG = {"SLOTPROXY_CONFIG": ""}


# --- the Codex guide and the proxy's own key ----------------------------------------------------------------


def test_the_codex_guide_with_the_key_variable_set() -> None:
    codex = clients("--agent", "codex", env={"OPENAI_API_KEY": "sk-set"})
    assert "# Key: the proxy sends its own key ($OPENAI_API_KEY); when Codex asks for one, any will do:" in codex
    assert "env_key = \"OPENAI_API_KEY\"  # any value while the proxy sends its own" in codex


def test_the_codex_guide_without_the_key_variable_says_codex_s_own_key_goes_upstream() -> None:
    codex = clients("--agent", "codex", env={"OPENAI_API_KEY": ""})
    assert "sends its own key" not in codex and "any value while" not in codex
    assert ("# Key: $OPENAI_API_KEY is unset here: a proxy started here has no key of its own for openai,\n"
            "# so Codex's own key goes upstream. Log Codex in with your OpenAI key, given on stdin:\n"
            "# codex login --with-api-key  (codex exec also reads CODEX_API_KEY)\n") in codex
    assert "env_key = \"OPENAI_API_KEY\"  # your OpenAI key" in codex
    builtin, custom = toml_blocks(codex)
    assert builtin == {"openai_base_url": "http://127.0.0.1:8787/openai"}
    assert custom["model_providers"]["slotproxy"]["base_url"] == "http://127.0.0.1:8787/openai"  # type: ignore[index]
    assert "the proxy forwards your own key" in clients("--agent", "openai-sdk", env={"OPENAI_API_KEY": ""})


def test_client_keys_with_the_key_variable_unset_need_codex_s_own_provider(tmp_path: Path) -> None:
    """The proxy takes Authorization as the client key only where it sends a key of its own."""
    config = write(tmp_path, """\
        access: {keys_env: SLOTPROXY_CLIENT_KEYS}
        providers:
          openai: {upstream: "https://api.openai.com/v1", api_key_env: OPENAI_API_KEY}
        """)
    codex = clients("--agent", "codex", config=config, env={"OPENAI_API_KEY": ""})
    (only,) = toml_blocks(codex)
    assert only["model_provider"] == "slotproxy"
    assert "openai forwards the agent's own key ($OPENAI_API_KEY is unset here)" in codex
    assert clients("--agent", "aider", config=config, env={"OPENAI_API_KEY": ""}).startswith(
        "# aider cannot send X-Slotproxy-Key and openai forwards the agent's own key ($OPENAI_API_KEY is unset here)")
    assert len(toml_blocks(clients("--agent", "codex", config=config, env={"OPENAI_API_KEY": "sk-set"}))) == 2


def test_a_pool_counts_as_the_proxy_s_key_when_one_of_its_variables_is_set() -> None:
    config = parse_config("providers:\n  openai:\n    upstream: https://api.openai.com/v1\n    keys:\n"
                          "      - {name: a, api_key_env: POOL_A}\n      - {name: b, api_key_env: POOL_B}\n")
    assert "the proxy sends a key of its pool" in guide(config, "codex", URL, {"POOL_B": "sk"}).text
    unset = guide(config, "codex", URL, {}).text
    assert "# Key: every key variable of its pool is unset here: a proxy started here has no key of its own" in unset
    assert "Codex's own key goes upstream" in unset


# --- no config file: ask the proxy at --url ---------------------------------------------------------------


async def test_clients_url_from_an_empty_folder_asks_the_running_proxy(start_upstream, start_proxy,
                                                                       tmp_path) -> None:
    up = await start_upstream()
    config = (f"providers:\n  openai: {{upstream: '{up.url}/v1', api_key_env: OPENAI_API_KEY}}\n"
              f"  anthropic: {{upstream: '{up.url}', auth: x-api-key}}\n"
              f"  pooled: {{upstream: '{up.url}/v1', keys: [{{name: a, api_key_env: POOL_KEY_UNSET_HERE}}]}}\n")
    proxy = await start_proxy(config)
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    result = await asyncio.to_thread(run_cli, "clients", "--url", proxy.url + "/", cwd=empty, env=NO_CONFIG)
    assert result.returncode == 0, result.stderr
    assert result.stderr == (f"slotproxy: no config file here: the guides are for the providers of the proxy at "
                             f"{proxy.url} (its status shows neither its header names nor whether it needs client "
                             "keys: the defaults are shown)\n")
    from_config = render(setup_from_config(parse_config(config), {"OPENAI_API_KEY": "sk"}), proxy.url)
    heads = [line for line in result.stdout.splitlines() if line.startswith("== ")]
    assert heads == [line for line in from_config.splitlines() if line.startswith("== ")]
    for agent in ("claude-code", "aider", "env"):  # the same guides as the proxy's own config gives
        one = await asyncio.to_thread(run_cli, "clients", "--url", proxy.url, "--agent", agent, cwd=empty,
                                      env=NO_CONFIG)
        assert one.stdout == guide(parse_config(config), agent, proxy.url).text, agent
    assert f"export ANTHROPIC_BASE_URL={proxy.url}/anthropic\n" in result.stdout
    codex = result.stdout.split("== Codex CLI (--agent codex) ==\n", 1)[1].split("\n== ", 1)[0]
    assert tomllib.loads(codex.split("\n\n# Or ")[0]) == {"openai_base_url": f"{proxy.url}/openai"}
    # its status does not say whether openai has a key of its own: the guide says both
    assert "the proxy sends its own key for openai if it has one, else Codex's own goes up." in codex


def test_whose_key_a_status_document_shows() -> None:
    setup = setup_from_status({"providers": [
        {"provider": "openai", "keys": []},
        {"provider": "claude-pool", "keys": [{"name": "a", "available": False}]},
        {"provider": "gpt-pool", "keys": [{"name": "a", "available": True}]},
    ]})
    assert [(served.name, served.anthropic, served.key) for served in setup.providers] == [
        ("openai", False, "unknown"), ("claude-pool", True, "unset"), ("gpt-pool", False, "own")]


def test_neither_a_config_nor_url_says_what_was_tried_in_one_line(tmp_path: Path) -> None:
    result = run_cli("clients", cwd=tmp_path, env=NO_CONFIG)
    assert result.returncode == 2
    assert result.stderr == ("slotproxy: no config file found and no --url to ask a running proxy: tried --config "
                             "(not given), $SLOTPROXY_CONFIG (unset), ./slotproxy.yaml (missing); run it where the "
                             "config is, or pass --url with the proxy's base URL (such as http://127.0.0.1:8787)\n")


def test_a_url_where_nothing_answers_says_both_in_one_line(tmp_path: Path) -> None:
    port = free_port()
    result = run_cli("clients", "--url", f"http://127.0.0.1:{port}", cwd=tmp_path, env=NO_CONFIG)
    assert result.returncode == 1
    assert result.stderr == ("slotproxy: no config file found (--config (not given), $SLOTPROXY_CONFIG (unset), "
                             "./slotproxy.yaml (missing)), and the proxy could not be asked for its providers "
                             f"instead: no slotproxy answers at http://127.0.0.1:{port} (connection refused); start "
                             "it with `slotproxy serve`\n")


def test_a_config_here_wins_over_asking_the_proxy(tmp_path: Path) -> None:
    (tmp_path / "slotproxy.yaml").write_text(EXAMPLE.read_text())
    result = run_cli("clients", "--agent", "env", "--url", f"http://127.0.0.1:{free_port()}", cwd=tmp_path,
                     env=NO_CONFIG)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "" and "export ANTHROPIC_BASE_URL=http://127.0.0.1:" in result.stdout
