"""What each agent needs to use the proxy, for one config: the text ``slotproxy clients`` prints.

Every guide is built from the config alone (provider ids, header names, client keys); nothing here
reads the environment, so no secret can end up in the output: keys are named by their variables.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from ..config import Config
from ..config.model import Provider

__all__ = ["AGENTS", "CLIENT_KEY_VAR", "Guide", "Snippet", "default_url", "guide", "normalize_url", "render"]

AGENTS: tuple[str, ...] = ("claude-code", "codex", "openai-sdk", "anthropic-sdk", "aider", "env")
TITLES = {
    "claude-code": "Claude Code",
    "codex": "Codex CLI",
    "openai-sdk": "OpenAI Python SDK",
    "anthropic-sdk": "Anthropic Python SDK",
    "aider": "aider",
    "env": "Other tools",
}
ANTHROPIC_AGENTS = frozenset({"claude-code", "anthropic-sdk"})
CLIENT_KEY_VAR = "SLOTPROXY_KEY"
"""The agent-side variable the guides read the client key from (one of the proxy's ``access.keys_env`` keys)."""
CLIENT_KEY_HEADER = "X-Slotproxy-Key"
STARRED_VAR = "SLOTPROXY_STARRED"
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", ""})
NO_ANTHROPIC = "none has auth: x-api-key, an api.anthropic.com upstream or an id naming anthropic or claude"
NO_OPENAI = ("every provider is an Anthropic one (auth: x-api-key, an api.anthropic.com upstream or an id naming "
             "anthropic or claude)")


@dataclass(frozen=True)
class Snippet:
    lang: str  # the README's fence language: sh, toml, python ("" for a one-line note)
    text: str  # ends with a newline


@dataclass(frozen=True)
class Guide:
    agent: str
    title: str
    snippets: tuple[Snippet, ...]

    @property
    def text(self) -> str:
        return "\n".join(snippet.text for snippet in self.snippets)


@dataclass(frozen=True)
class _Side:
    """One provider as the agents of one API family see it."""

    provider_id: str
    url: str  # the proxy's route to it
    injects: bool  # the proxy may send its own key (api_key_env or a key pool)
    own_key: str  # that key, in words: "its own key ($OPENAI_API_KEY)" or "a key of its pool"
    websocket: bool


@dataclass(frozen=True)
class _Names:
    workspace: str
    starred: str
    conversation: str
    prompt_started_at: str
    keys_env: str | None  # access.keys_env: client keys required


# --- the proxy's URL and which provider serves whom ---------------------------------------------


def default_url(config: Config) -> str:
    """The proxy's base URL from ``server.host`` and ``server.port`` (a wildcard address → 127.0.0.1)."""
    host = config.server.host
    if host in WILDCARD_HOSTS:
        host = "127.0.0.1"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{config.server.port}"


def normalize_url(url: str) -> str:
    """``url`` without a trailing slash; ValueError unless it is an absolute http(s) URL."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--url must be the proxy's base URL, such as http://127.0.0.1:8787 (got {url!r})")
    return url.strip().rstrip("/")


def _is_anthropic(name: str, provider: Provider) -> bool:
    """Anthropic's API: its auth style, its upstream, or a provider named for it (a local or proxied
    upstream keeps the id that says what it serves)."""
    return provider.auth == "x-api-key" or urlsplit(provider.upstream).hostname == "api.anthropic.com" \
        or any(word in name.lower() for word in ("anthropic", "claude"))


def _provider_for(config: Config, anthropic: bool) -> str | None:
    """The first provider of that family: the one named for it (``openai``, ``anthropic``), else one whose
    upstream is the provider's own, else the first in the config."""
    candidates = [name for name, provider in config.providers.items()
                  if _is_anthropic(name, provider) == anthropic]
    host = "api.anthropic.com" if anthropic else "api.openai.com"
    wanted = "anthropic" if anthropic else "openai"
    candidates.sort(key=lambda name: (name != wanted, urlsplit(config.providers[name].upstream).hostname != host))
    return candidates[0] if candidates else None


def _side(config: Config, base_url: str, anthropic: bool) -> _Side | None:
    name = _provider_for(config, anthropic)
    if name is None:
        return None
    provider = config.providers[name]
    if provider.keys:
        own_key = "a key of its pool"
    elif provider.api_key_env:
        own_key = f"its own key (${provider.api_key_env})"
    else:
        own_key = ""
    return _Side(provider_id=name, url=f"{base_url}/{name}", injects=bool(own_key), own_key=own_key,
                 websocket=bool(getattr(provider, "websocket", True)))


def _missing(agent: str) -> Guide:
    why = NO_ANTHROPIC if agent in ANTHROPIC_AGENTS else NO_OPENAI
    note = f"# no provider in this config serves {TITLES[agent]}: {why}\n"
    return Guide(agent, TITLES[agent], (Snippet("", note),))


# --- small quoting helpers ----------------------------------------------------------------------


def _q(value: str) -> str:
    """A double-quoted string, valid in Python and in TOML."""
    return json.dumps(value)


def _toml_table(pairs: Sequence[tuple[str, str]]) -> str:
    return "{ " + ", ".join(f"{_q(name)} = {_q(value)}" for name, value in pairs) + " }"


def _key_note(names: _Names) -> str:
    return f"your client key, one of the proxy's ${names.keys_env}"


# --- one function per agent ---------------------------------------------------------------------


def _claude_code(side: _Side, names: _Names) -> tuple[Snippet, ...]:
    custom = f"{names.workspace}: web-app\\n{names.starred}: 1"
    lines = [f"export ANTHROPIC_BASE_URL={shlex.quote(side.url)}"]
    if names.keys_env:
        lines.append(f"# {CLIENT_KEY_HEADER}: ${CLIENT_KEY_VAR}, {_key_note(names)};")
        lines.append("# the workspace and star lines are optional")
        lines.append(f"export ANTHROPIC_CUSTOM_HEADERS=$'{custom}\\n'\"{CLIENT_KEY_HEADER}: ${CLIENT_KEY_VAR}\"")
    else:
        lines.append('# optional, one "Name: Value" per line: a workspace and a star, fixed for the session')
        lines.append(f"export ANTHROPIC_CUSTOM_HEADERS=$'{custom}'")
    lines.append("claude")
    return (Snippet("sh", "\n".join(lines) + "\n"),)


def _codex_key_lines(side: _Side, names: _Names) -> list[str]:
    if names.keys_env:
        return [f"# Key: {_key_note(names)}, in {CLIENT_KEY_VAR} here:",
                f"# printenv {CLIENT_KEY_VAR} | codex login --with-api-key  (codex exec also reads CODEX_API_KEY)"]
    if side.injects:
        return [f"# Key: the proxy sends {side.own_key}; when Codex asks for one, any will do:",
                "# echo via-slotproxy | codex login --with-api-key  (codex exec also reads CODEX_API_KEY)"]
    return ["# Key (Codex does not read OPENAI_API_KEY): printenv OPENAI_API_KEY | codex login --with-api-key",
            "# (codex exec also reads CODEX_API_KEY)"]


def _codex_builtin(side: _Side, names: _Names) -> Snippet:
    lines = [
        f"# ~/.codex/config.toml, or once: codex -c openai_base_url={_q(side.url)}",
        "# (Codex 0.171 reads its base URL here, not from OPENAI_BASE_URL).",
        *_codex_key_lines(side, names),
        f"openai_base_url = {_q(side.url)}",
    ]
    return Snippet("toml", "\n".join(lines) + "\n")


def _codex_custom(side: _Side, names: _Names, alone: bool) -> Snippet:
    from_env = [(names.starred, STARRED_VAR)]
    if alone:
        intro = [(f"# ~/.codex/config.toml: the built-in provider cannot send {CLIENT_KEY_HEADER} and "
                  f"{side.provider_id} forwards the"),
                 "# agent's own key, so Codex needs a provider of its own that sends a workspace, a star"]
    else:
        intro = ["# Or a provider of your own (~/.codex/config.toml) that sends a workspace"
                 + (", a star" if names.keys_env else " and a star")]
    if names.keys_env:
        from_env.append((CLIENT_KEY_HEADER, CLIENT_KEY_VAR))
        intro += [f"# (when {STARRED_VAR}=1) and ${CLIENT_KEY_VAR} ({_key_note(names)})",
                  "# with each request:"]
    else:
        intro.append(f"# (when {STARRED_VAR}=1) with each request:")
    key = "any value while the proxy sends its own" if side.injects else "your OpenAI key"
    lines = [
        *intro,
        'model_provider = "slotproxy"',
        "",
        "[model_providers.slotproxy]",
        'name = "OpenAI via slotproxy"',
        f"base_url = {_q(side.url)}",
        f'env_key = "OPENAI_API_KEY"  # {key}',
        'wire_api = "responses"',
        f"supports_websockets = {'true' if side.websocket else 'false'}",
        f"http_headers = {_toml_table([(names.workspace, 'web-app')])}",
        f"env_http_headers = {_toml_table(from_env)}",
    ]
    return Snippet("toml", "\n".join(lines) + "\n")


def _codex(side: _Side, names: _Names) -> tuple[Snippet, ...]:
    if names.keys_env and not side.injects:
        return (_codex_custom(side, names, alone=True),)
    return _codex_builtin(side, names), _codex_custom(side, names, alone=False)


def _python_headers(names: _Names, workspace: str, conversation: str, starred: bool) -> list[str]:
    pairs = [(names.workspace, _q(workspace))]
    if starred:
        pairs.append((names.starred, _q("1")))
    pairs.append((names.conversation, _q(conversation)))
    fixed = ", ".join(f"{_q(name)}: {value}" for name, value in pairs)
    if not names.keys_env:
        return [f"    default_headers={{{fixed}}},"]
    return [
        "    default_headers={",
        f"        {fixed},",
        f"        # {_key_note(names)}",
        f"        {_q(CLIENT_KEY_HEADER)}: os.environ[{_q(CLIENT_KEY_VAR)}],",
        "    },",
    ]


def _api_key_comment(side: _Side) -> str:
    return "the proxy's key, if it has one, wins" if side.injects else "the proxy forwards your own key"


def _openai_sdk(side: _Side, names: _Names) -> tuple[Snippet, ...]:
    lines = [
        "import os",
        "import time",
        "",
        "from openai import OpenAI",
        "",
        "client = OpenAI(",
        f"    base_url={_q(side.url)},",
        f'    api_key=os.environ.get("OPENAI_API_KEY", "via-slotproxy"),  # {_api_key_comment(side)}',
        *_python_headers(names, "web-app", "agent-7", starred=True),
        ")",
        "prompt_started_at = str(int(time.time() * 1000))  # when the user's prompt began (epoch ms)",
        "stream = client.chat.completions.create(",
        '    model="gpt-4o-mini",',
        '    messages=[{"role": "user", "content": "Say hi"}],',
        "    stream=True,",
        f"    extra_headers={{{_q(names.prompt_started_at)}: prompt_started_at}},",
        ")",
        "for chunk in stream:",
        "    if chunk.choices:",
        '        print(chunk.choices[0].delta.content or "", end="", flush=True)',
    ]
    return (Snippet("python", "\n".join(lines) + "\n"),)


def _anthropic_sdk(side: _Side, names: _Names) -> tuple[Snippet, ...]:
    lines = [
        "import os",
        "import time",
        "",
        "import anthropic",
        "",
        "client = anthropic.Anthropic(",
        f"    base_url={_q(side.url)},",
        f'    api_key=os.environ.get("ANTHROPIC_API_KEY", "via-slotproxy"),  # {_api_key_comment(side)}',
        *_python_headers(names, "docs-site", "agent-3", starred=False),
        ")",
        "with client.messages.stream(",
        '    model="claude-sonnet-4-5",',
        "    max_tokens=1024,",
        '    messages=[{"role": "user", "content": "Say hi"}],',
        f"    extra_headers={{{_q(names.prompt_started_at)}: str(int(time.time() * 1000))}},",
        ") as stream:",
        "    for text in stream.text_stream:",
        '        print(text, end="", flush=True)',
    ]
    return (Snippet("python", "\n".join(lines) + "\n"),)


def _key_as_api_key(side: _Side, names: _Names, variable: str) -> list[str]:
    """Lines that let a tool which sends no extra header pass the client check, or say why it cannot."""
    if not names.keys_env:
        return []
    if side.injects:
        return [f"# the API key is {_key_note(names)}; the proxy sends {side.own_key} upstream",
                f'export {variable}="${CLIENT_KEY_VAR}"']
    return [(f"# {side.provider_id} forwards the agent's own key, so a tool that cannot send "
             f"{CLIENT_KEY_HEADER} cannot use it")]


def _aider(side: _Side, names: _Names) -> tuple[Snippet, ...]:
    if names.keys_env and not side.injects:
        note = (f"# aider cannot send {CLIENT_KEY_HEADER} and {side.provider_id} forwards the agent's own key; "
                f"with providers.{side.provider_id}.api_key_env set,\n# your client key can be aider's API key\n")
        return (Snippet("", note),)
    lines = [
        "# aider reads OPENAI_API_BASE (or --openai-api-base); name the model with the openai/ prefix",
        f"export OPENAI_API_BASE={shlex.quote(side.url)}",
        *_key_as_api_key(side, names, "OPENAI_API_KEY"),
        "aider --model openai/gpt-4o-mini",
    ]
    return (Snippet("sh", "\n".join(lines) + "\n"),)


def _env(openai: _Side | None, anthropic: _Side | None, names: _Names) -> tuple[Snippet, ...]:
    lines = ["# tools built on the OpenAI SDKs read OPENAI_BASE_URL; LiteLLM-based ones OPENAI_API_BASE too"]
    if openai is None:
        lines.append(f"# (no provider in this config serves OpenAI clients: {NO_OPENAI})")
    else:
        lines += [f"export OPENAI_BASE_URL={shlex.quote(openai.url)}",
                  f"export OPENAI_API_BASE={shlex.quote(openai.url)}",
                  *_key_as_api_key(openai, names, "OPENAI_API_KEY")]
    if anthropic is None:
        lines.append(f"# (no provider in this config serves Anthropic clients: {NO_ANTHROPIC})")
    else:
        lines += [f"export ANTHROPIC_BASE_URL={shlex.quote(anthropic.url)}",
                  *_key_as_api_key(anthropic, names, "ANTHROPIC_API_KEY")]
    return (Snippet("sh", "\n".join(lines) + "\n"),)


# --- the whole ----------------------------------------------------------------------------------


def _names(config: Config) -> _Names:
    headers = config.headers
    return _Names(workspace=headers.workspace, starred=headers.starred, conversation=headers.conversation,
                  prompt_started_at=headers.prompt_started_at, keys_env=config.access.keys_env)


def guide(config: Config, agent: str, base_url: str) -> Guide:
    """What ``agent`` needs to reach the proxy at ``base_url`` (no trailing slash) with this config."""
    if agent not in TITLES:
        raise ValueError(f"unknown agent {agent!r}: choose one of {', '.join(AGENTS)}")
    names = _names(config)
    openai, anthropic = _side(config, base_url, anthropic=False), _side(config, base_url, anthropic=True)
    if agent == "env":
        return Guide(agent, TITLES[agent], _env(openai, anthropic, names))
    side = anthropic if agent in ANTHROPIC_AGENTS else openai
    if side is None:
        return _missing(agent)
    build = {"claude-code": _claude_code, "codex": _codex, "openai-sdk": _openai_sdk,
             "anthropic-sdk": _anthropic_sdk, "aider": _aider}[agent]
    return Guide(agent, TITLES[agent], build(side, names))


def render(config: Config, base_url: str, agent: str | None = None) -> str:
    """One agent's guide as is; without ``agent``, every guide under a short heading."""
    if agent is not None:
        return guide(config, agent, base_url).text
    parts = []
    for name in AGENTS:
        one = guide(config, name, base_url)
        parts.append(f"== {one.title} (--agent {name}) ==\n{one.text}")
    return "\n".join(parts)
