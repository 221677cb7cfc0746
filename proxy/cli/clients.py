"""What each agent needs to use the proxy: the text ``slotproxy clients`` prints.

The guides are built from a ``Setup``: a config's providers, header names and client keys, or, where no
config file is at hand, the providers a running proxy's status lists. Whether the proxy sends a key of
its own decides what an agent must send: from a config, that is whether the provider's key variable is
set in the environment given (the guides name variables and never read a value into the output); from a
status, it is known for key pools only.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

from ..config import Config
from ..config.model import Headers, Provider

__all__ = ["AGENTS", "CLIENT_KEY_VAR", "Guide", "Served", "Setup", "Snippet", "default_url", "guide",
           "normalize_url", "render", "setup_from_config", "setup_from_status"]

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


KeyState = Literal["own", "unset", "none", "unknown"]
"""Whether the proxy sends a key of its own to a provider: it does (``own``); it has one configured whose
variable is unset, so it passes the client's on (``unset``); none is configured (``none``); or a running
proxy's status does not say (``unknown``: a provider with one key, not a pool)."""


@dataclass(frozen=True)
class Served:
    """One provider, as much of it as the guides need."""

    name: str
    anthropic: bool  # Anthropic's API (auth x-api-key, its upstream, or an id naming it)
    official: bool  # the upstream is the provider's own host (api.openai.com, api.anthropic.com)
    key: KeyState
    own_key: str  # the proxy's key in words: "its own key ($OPENAI_API_KEY)", "a key of its pool" or ""
    key_var: str  # what sets it: "$OPENAI_API_KEY", "every key variable of its pool" or ""
    websocket: bool = True


@dataclass(frozen=True)
class _Names:
    workspace: str
    starred: str
    conversation: str
    prompt_started_at: str
    keys_env: str | None  # access.keys_env: client keys required


@dataclass(frozen=True)
class Setup:
    """The providers and header names the guides are written for."""

    providers: tuple[Served, ...]
    names: _Names


@dataclass(frozen=True)
class _Side:
    """One provider as the agents of one API family see it."""

    provider_id: str
    url: str  # the proxy's route to it
    key: KeyState
    own_key: str
    key_var: str
    websocket: bool

    @property
    def injects(self) -> bool:
        """The proxy sends its own key, so the agent's Authorization or x-api-key can carry a client key."""
        return self.key == "own"


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
        or _named_anthropic(name)


def _named_anthropic(name: str) -> bool:
    return any(word in name.lower() for word in ("anthropic", "claude"))


def _served(name: str, provider: Provider, environ: Mapping[str, str] | None) -> Served:
    anthropic = _is_anthropic(name, provider)
    official = urlsplit(provider.upstream).hostname == ("api.anthropic.com" if anthropic else "api.openai.com")
    websocket = bool(getattr(provider, "websocket", True))
    if provider.keys:
        variables = [key.api_key_env for key in provider.keys]
        has_key = environ is None or any(environ.get(variable) for variable in variables)
        return Served(name, anthropic, official, "own" if has_key else "unset", "a key of its pool",
                      "every key variable of its pool", websocket)
    if provider.api_key_env:
        has_key = environ is None or bool(environ.get(provider.api_key_env))
        return Served(name, anthropic, official, "own" if has_key else "unset",
                      f"its own key (${provider.api_key_env})", f"${provider.api_key_env}", websocket)
    return Served(name, anthropic, official, "none", "", "", websocket)


def _names(config: Config) -> _Names:
    headers = config.headers
    return _Names(workspace=headers.workspace, starred=headers.starred, conversation=headers.conversation,
                  prompt_started_at=headers.prompt_started_at, keys_env=config.access.keys_env)


def setup_from_config(config: Config, environ: Mapping[str, str] | None = None) -> Setup:
    """The guides for ``config``. With ``environ``, a provider's key counts as the proxy's only where its
    variable is set there (as for a proxy started from that environment); without, wherever one is configured."""
    return Setup(tuple(_served(name, provider, environ) for name, provider in config.providers.items()),
                 _names(config))


def setup_from_status(document: Mapping[str, Any]) -> Setup:
    """The guides for a running proxy, from its status document: its providers' ids (an id naming anthropic or
    claude serves Anthropic's clients), and whether a key pool has a key (a single key is not shown there).
    Header names are the defaults and no client key is assumed: the status shows neither."""
    providers = []
    for entry in document.get("providers", []):
        name = str(entry.get("provider", ""))
        if not name:
            continue
        pool = entry.get("keys") or []
        if pool:
            key: KeyState = "own" if any(item.get("available") for item in pool) else "unset"
            providers.append(Served(name, _named_anthropic(name), False, key, "a key of its pool",
                                    "every key variable of its pool"))
        else:
            providers.append(Served(name, _named_anthropic(name), False, "unknown", "its own key", ""))
    defaults = Headers()
    names = _Names(workspace=defaults.workspace, starred=defaults.starred, conversation=defaults.conversation,
                   prompt_started_at=defaults.prompt_started_at, keys_env=None)
    return Setup(tuple(providers), names)


def _provider_for(setup: Setup, anthropic: bool) -> Served | None:
    """The first provider of that family: the one named for it (``openai``, ``anthropic``), else one whose
    upstream is the provider's own, else the first listed."""
    wanted = "anthropic" if anthropic else "openai"
    candidates = [served for served in setup.providers if served.anthropic == anthropic]
    candidates.sort(key=lambda served: (served.name != wanted, not served.official))
    return candidates[0] if candidates else None


def _side(setup: Setup, base_url: str, anthropic: bool) -> _Side | None:
    served = _provider_for(setup, anthropic)
    if served is None:
        return None
    return _Side(provider_id=served.name, url=f"{base_url}/{served.name}", key=served.key,
                 own_key=served.own_key, key_var=served.key_var, websocket=served.websocket)


def _forwards(side: _Side) -> str:
    """Why the agent's own key goes upstream, in words."""
    unset = f" ({side.key_var} is unset here)" if side.key == "unset" else ""
    return f"{side.provider_id} forwards the agent's own key{unset}"


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
    login = "# codex login --with-api-key  (codex exec also reads CODEX_API_KEY)"
    if side.key == "unset":
        why = f"# Key: {side.key_var} is unset here: a proxy started here has no key of its own for {side.provider_id},"
        return [why, "# so Codex's own key goes upstream. Log Codex in with your OpenAI key, given on stdin:", login]
    if side.key == "unknown":
        why = f"# Key: the proxy sends its own key for {side.provider_id} if it has one, else Codex's own goes up."
        return [why, "# Log Codex in with your OpenAI key, given on stdin (any will do if the proxy has one):", login]
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
        intro = [f"# ~/.codex/config.toml: the built-in provider cannot send {CLIENT_KEY_HEADER} and",
                 f"# {_forwards(side)},",
                 "# so Codex needs a provider of its own that sends a workspace, a star"]
    else:
        intro = ["# Or a provider of your own (~/.codex/config.toml) that sends a workspace"
                 + (", a star" if names.keys_env else " and a star")]
    if names.keys_env:
        from_env.append((CLIENT_KEY_HEADER, CLIENT_KEY_VAR))
        intro += [f"# (when {STARRED_VAR}=1) and ${CLIENT_KEY_VAR} ({_key_note(names)})",
                  "# with each request:"]
    else:
        intro.append(f"# (when {STARRED_VAR}=1) with each request:")
    key = {"own": "any value while the proxy sends its own",
           "unknown": "your OpenAI key, unless the proxy sends its own"}.get(side.key, "your OpenAI key")
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
    if side.key in ("own", "unknown"):
        return "the proxy's key, if it has one, wins"
    return "the proxy forwards your own key"


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
    return [f"# {_forwards(side)}, so a tool that cannot send {CLIENT_KEY_HEADER} cannot use it"]


def _aider(side: _Side, names: _Names) -> tuple[Snippet, ...]:
    if names.keys_env and not side.injects:
        note = (f"# aider cannot send {CLIENT_KEY_HEADER} and {_forwards(side)}; with a key of the proxy's "
                f"for {side.provider_id}\n# (providers.{side.provider_id}.api_key_env, set), your client key can be "
                "aider's API key\n")
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


def guide(config: Config | Setup, agent: str, base_url: str, environ: Mapping[str, str] | None = None) -> Guide:
    """What ``agent`` needs to reach the proxy at ``base_url`` (no trailing slash); a ``Config`` is read as
    ``setup_from_config(config, environ)``."""
    if agent not in TITLES:
        raise ValueError(f"unknown agent {agent!r}: choose one of {', '.join(AGENTS)}")
    setup = config if isinstance(config, Setup) else setup_from_config(config, environ)
    names = setup.names
    openai, anthropic = _side(setup, base_url, anthropic=False), _side(setup, base_url, anthropic=True)
    if agent == "env":
        return Guide(agent, TITLES[agent], _env(openai, anthropic, names))
    side = anthropic if agent in ANTHROPIC_AGENTS else openai
    if side is None:
        return _missing(agent)
    build = {"claude-code": _claude_code, "codex": _codex, "openai-sdk": _openai_sdk,
             "anthropic-sdk": _anthropic_sdk, "aider": _aider}[agent]
    return Guide(agent, TITLES[agent], build(side, names))


def render(config: Config | Setup, base_url: str, agent: str | None = None,
           environ: Mapping[str, str] | None = None) -> str:
    """One agent's guide as is; without ``agent``, every guide under a short heading."""
    setup = config if isinstance(config, Setup) else setup_from_config(config, environ)
    if agent is not None:
        return guide(setup, agent, base_url).text
    parts = []
    for name in AGENTS:
        one = guide(setup, name, base_url)
        parts.append(f"== {one.title} (--agent {name}) ==\n{one.text}")
    return "\n".join(parts)
