"""The agents' guides (docs/agents.md), run against a real proxy in front of the fake.

Each Python snippet runs as is (only ``http://127.0.0.1:8787`` is swapped for the
test proxy's address) in a subprocess, while a long stream holds the provider's
only slot: so the snippet's request waits in the queue, where its priority
headers show in the status, and then streams its answer once the slot frees.
Shell snippets are run too: curl (or, without curl, the same request with
urllib), and the ``export`` lines of the tool guides, whose URLs and header
values are then used the way the tools use them. Both Codex ``config.toml``
forms are parsed and the request Codex makes with each is sent, headers and
all. LiteLLM and aider run when they are installed; otherwise the request they
make is made directly. (tests/cli/test_clients_command.py holds each guide to the
output of ``slotproxy clients``.)
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import os
import re
import shlex
import shutil
import sys
import time
import tomllib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from ..conftest import Proxy, Upstream, wait_until

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
AGENTS_DOC = (REPO / "docs" / "agents.md").read_text()
DOC_URL = "http://127.0.0.1:8787"
PRIORITY_HEADERS = {"x-workspace-id", "x-workspace-starred", "x-prompt-started-at", "x-conversation-id"}
KEY = "sk-guide-test"


def section() -> str:
    """The guides: from the first (Claude Code) to the section after the last (curl)."""
    start = AGENTS_DOC.index("## Claude Code")
    end = AGENTS_DOC.index("\n## Over a WebSocket", start)
    return AGENTS_DOC[start:end]


@dataclass(frozen=True)
class Block:
    lang: str
    code: str


def blocks(lang: str | None = None) -> list[Block]:
    found = [Block(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", section(), re.DOTALL | re.MULTILINE)]
    return [b for b in found if lang is None or b.lang == lang]


def python_block(module: str) -> str:
    (code,) = [b.code for b in blocks("python") if re.search(rf"^import {module}$|^from {module} import", b.code, re.MULTILINE)]
    return code


def sh_block(containing: str) -> str:
    (code,) = [b.code for b in blocks("sh") if containing in b.code]
    return code


# --- a proxy with one slot per provider, and a way to hold it ------------------------------


@dataclass
class Stage:
    proxy: Proxy
    upstream: Upstream
    session: aiohttp.ClientSession

    def rewrite(self, code: str) -> str:
        assert DOC_URL in code
        return code.replace(DOC_URL, self.proxy.url)

    async def hold_slot(self, provider: str) -> aiohttp.ClientResponse:
        """A stream that holds ``provider``'s only slot until it is closed."""
        path = "/openai/chat/completions" if provider == "openai" else "/anthropic/v1/messages"
        body = {"model": "fake-model", "stream": True, "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
        response = await self.session.post(self.proxy.url + path, json=body,
                                           headers={"x-fake-chunks": "2000", "x-fake-delay-ms": "10"})
        assert response.status == 200
        await response.content.readline()
        return response

    def queue(self, provider: str) -> list[dict[str, Any]]:
        queue: list[dict[str, Any]] = self.proxy.status(provider)["queue"]
        return queue

    async def queued_entry(self, provider: str, work: Awaitable[Any]) -> tuple[dict[str, Any], Any]:
        """Run ``work`` while the slot is held; the queue entry it made, and its result once it ran."""
        blocker = await self.hold_slot(provider)
        task = asyncio.ensure_future(work)
        try:
            await wait_until(lambda: bool(self.queue(provider)) or task.done(), timeout=20, what="a queued request")
            assert not task.done(), f"finished without queueing: {task.result()!r}"
            (entry,) = self.queue(provider)
        finally:
            blocker.close()
        return entry, await asyncio.wait_for(task, timeout=30)


@pytest.fixture
async def stage(start_upstream: Callable[..., Awaitable[Upstream]],
                start_proxy: Callable[[str], Awaitable[Proxy]]) -> AsyncIterator[Stage]:
    upstream = await start_upstream(chunks=3, delay_ms=5)
    proxy = await start_proxy(f"""
        state: {{path: null}}
        providers:
          openai: {{upstream: "{upstream.url}/v1", limit: 1}}
          anthropic: {{upstream: "{upstream.url}", limit: 1, auth: x-api-key}}
        """)
    async with aiohttp.ClientSession() as session:
        yield Stage(proxy, upstream, session)


async def run_python(code: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, cwd=REPO, env=os.environ | (env or {}),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def assert_recent_ms(value: int) -> None:
    assert abs(time.time() * 1000 - value) < 120_000, value


def assert_stripped(stage: Stage) -> None:
    seen = stage.upstream.fake.last_headers
    assert not PRIORITY_HEADERS & set(seen), seen


# --- the section itself --------------------------------------------------------------------


def test_the_readme_points_to_the_guides_which_cover_each_client() -> None:
    headings = re.findall(r"^## (.+)$", README, re.MULTILINE)
    assert headings[headings.index("Run it") + 2] == "Point your agents at it"
    pointing = README.split("## Point your agents at it", 1)[1].split("\n## ", 1)[0]
    assert "](docs/agents.md)" in pointing and "slotproxy clients" in pointing
    text = section()
    for needle in ("default_headers", "ANTHROPIC_BASE_URL", "OPENAI_BASE_URL", "Claude Code", "Codex CLI",
                   "openai_base_url", "aider", "OPENAI_API_BASE", "LiteLLM", "api_base", "curl"):
        assert needle in text, needle
    assert {b.lang for b in blocks()} == {"python", "sh", "toml"}
    assert len(blocks("python")) == 3


# --- Python SDKs ---------------------------------------------------------------------------


async def test_openai_sdk_snippet_queues_with_its_headers_and_streams(stage: Stage) -> None:
    code = stage.rewrite(python_block("openai"))
    entry, (code_rc, out, err) = await stage.queued_entry("openai", run_python(code, {"OPENAI_API_KEY": KEY}))
    assert code_rc == 0, err
    assert out.startswith("tok0 tok1 tok2"), out
    assert (entry["workspace"], entry["starred"], entry["conversation"]) == ("web-app", True, "agent-7")
    assert_recent_ms(entry["prompt_started_at"])
    assert stage.upstream.fake.last_headers["authorization"] == f"Bearer {KEY}"
    assert_stripped(stage)


async def test_anthropic_sdk_snippet_queues_with_its_headers_and_streams(stage: Stage) -> None:
    code = stage.rewrite(python_block("anthropic"))
    entry, (code_rc, out, err) = await stage.queued_entry("anthropic", run_python(code, {"ANTHROPIC_API_KEY": KEY}))
    assert code_rc == 0, err
    assert out.startswith("tok0 tok1 tok2"), out
    assert (entry["workspace"], entry["starred"], entry["conversation"]) == ("docs-site", False, "agent-3")
    assert_recent_ms(entry["prompt_started_at"])
    seen = stage.upstream.fake.last_headers  # the client's own key goes through (SDK versions differ in header)
    assert KEY in (seen.get("x-api-key"), seen.get("authorization", "").removeprefix("Bearer ")), seen
    assert_stripped(stage)


def _litellm_call(code: str) -> dict[str, Any]:
    """The keyword arguments of the snippet's ``litellm.completion(...)`` call (literals only)."""
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "litellm.completion":
            return {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords
                    if kw.arg and not isinstance(kw.value, ast.Call)}
    raise AssertionError("no litellm.completion(...) call in the LiteLLM snippet")


async def test_litellm_snippet(stage: Stage) -> None:
    code = stage.rewrite(python_block("litellm"))
    call = _litellm_call(code)
    assert call["model"].startswith("openai/")  # LiteLLM's OpenAI-compatible route: POST {api_base}/chat/completions
    assert call["api_base"] == f"{stage.proxy.url}/openai"
    assert set(map(str.lower, call["extra_headers"])) <= PRIORITY_HEADERS
    if importlib.util.find_spec("litellm") is not None:
        env = {"OPENAI_API_KEY": KEY, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}  # no fetch from the network
        work: Awaitable[Any] = run_python(code, env)
    else:
        # Not installed here: make the request LiteLLM makes for this call, with its headers.
        async def direct() -> tuple[int, str, str]:
            body = {"model": call["model"].removeprefix("openai/"), "messages": call["messages"],
                    "stream": call["stream"]}
            headers = call["extra_headers"] | {"Authorization": f"Bearer {KEY}"}
            async with stage.session.post(call["api_base"] + "/chat/completions", json=body,
                                          headers=headers) as response:
                return (0 if response.status == 200 else response.status), await response.text(), ""

        work = direct()
    entry, (code_rc, out, err) = await stage.queued_entry("openai", work)
    assert code_rc == 0, err
    assert "tok0" in out
    assert (entry["workspace"], entry["starred"]) == ("web-app", True)
    assert_stripped(stage)


# --- shell snippets ------------------------------------------------------------------------


def _curl_request(snippet: str, env: dict[str, str]) -> tuple[str, dict[str, str], str]:
    """The URL, headers and body of the curl snippet, with its shell expansions done as bash would."""
    words = shlex.split(snippet.replace("\\\n", " "))
    assert words[0] == "curl"
    url, headers, body = "", {}, ""
    expand = {"${OPENAI_API_KEY:-via-slotproxy}": env.get("OPENAI_API_KEY") or "via-slotproxy",
              "$(date +%s)": str(int(time.time()))}
    index = 1
    while index < len(words):
        word = words[index]
        if word in ("-H", "-d"):
            value = words[index + 1]
            for pattern, replacement in expand.items():
                value = value.replace(pattern, replacement)
            assert "$" not in value, value
            if word == "-H":
                name, _, header_value = value.partition(":")
                headers[name.strip()] = header_value.strip()
            else:
                body = value
            index += 2
        elif word.startswith("http"):
            url = word
            index += 1
        else:
            assert word == "-N", word
            index += 1
    return url, headers, body


async def test_curl_snippet(stage: Stage) -> None:
    snippet = stage.rewrite(sh_block("curl "))
    env = {"OPENAI_API_KEY": KEY}
    curl = shutil.which("curl")
    if curl is not None:
        async def run() -> tuple[int, str, str]:
            bash = shutil.which("bash") or "/bin/bash"
            proc = await asyncio.create_subprocess_exec(bash, "-c", snippet, env=os.environ | env,
                                                        stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), timeout=30)
            assert proc.returncode is not None
            return proc.returncode, out.decode(), err.decode()
    else:
        url, headers, body = _curl_request(snippet, env)

        async def run() -> tuple[int, str, str]:
            def fetch() -> str:
                import urllib.request

                request = urllib.request.Request(url, data=body.encode(), headers=headers, method="POST")
                with urllib.request.urlopen(request, timeout=30) as response:
                    return str(response.read().decode())

            return 0, await asyncio.to_thread(fetch), ""

    entry, (rc, out, err) = await stage.queued_entry("openai", run())
    assert rc == 0, err
    assert "data: [DONE]" in out and '"content":"tok0 "' in out
    assert (entry["workspace"], entry["starred"]) == ("web-app", True)
    assert_recent_ms(entry["prompt_started_at"])
    assert stage.upstream.fake.last_headers["authorization"] == f"Bearer {KEY}"
    assert_stripped(stage)


def test_curl_snippet_parses_the_same_without_curl() -> None:
    """The urllib fallback above reads the snippet the way bash and curl do."""
    url, headers, body = _curl_request(sh_block("curl "), {"OPENAI_API_KEY": KEY})
    assert url == f"{DOC_URL}/openai/chat/completions"
    assert headers["Authorization"] == f"Bearer {KEY}" and headers["X-Workspace-Starred"] == "1"
    assert re.fullmatch(r"\d{13}", headers["X-Prompt-Started-At"])
    assert '"stream": true' in body


async def _exported(snippet: str) -> dict[str, str]:
    """The variables the snippet's ``export`` lines set, evaluated by bash (comments aside, other lines run
    the tool)."""
    lines = [line for line in snippet.splitlines() if line and not line.startswith("#")]
    exports = [line for line in lines if line.startswith("export ")]
    tools = [line for line in lines if not line.startswith("export ")]
    assert exports and all(re.fullmatch(r"[a-z]+( [-a-z0-9/.]+)*", tool) for tool in tools), tools
    names = [line.split()[1].split("=")[0] for line in exports]
    script = "\n".join(exports) + "\n" + "".join(f'printf "%s\\0" "${name}"\n' for name in names)
    bash = shutil.which("bash") or "/bin/bash"
    proc = await asyncio.create_subprocess_exec(bash, "-c", script, stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=10)
    assert proc.returncode == 0
    return dict(zip(names, out.decode().split("\0")[:-1], strict=True))


def _tool_line(snippet: str) -> str:
    (line,) = [line for line in snippet.splitlines() if line and not line.startswith(("#", "export "))]
    return line


async def test_claude_code_env_reaches_the_proxy_with_its_custom_headers(stage: Stage) -> None:
    """ANTHROPIC_BASE_URL is used as the Anthropic SDK uses it (Claude Code is built on it), and
    ANTHROPIC_CUSTOM_HEADERS is read as Claude Code documents it: one ``Name: Value`` per line."""
    snippet = stage.rewrite(sh_block("ANTHROPIC_CUSTOM_HEADERS"))
    assert _tool_line(snippet) == "claude"
    exported = await _exported(snippet)
    assert exported["ANTHROPIC_BASE_URL"] == f"{stage.proxy.url}/anthropic"
    lines = exported["ANTHROPIC_CUSTOM_HEADERS"].split("\n")
    custom = {name.strip(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    assert set(map(str.lower, custom)) <= PRIORITY_HEADERS
    lines = [
        "import json, os, anthropic",
        "headers = dict(line.split(': ', 1) for line in os.environ['ANTHROPIC_CUSTOM_HEADERS'].split('\\n'))",
        "client = anthropic.Anthropic(default_headers=headers)",  # base URL and key from the environment
        "message = client.messages.create(model='claude-sonnet-4-5', max_tokens=64,",
        "                                 messages=[{'role': 'user', 'content': 'hi'}])",
        "print(message.content[0].text)",
    ]
    code = "\n".join(lines)
    env = {name: value for name, value in exported.items()} | {"ANTHROPIC_API_KEY": KEY}
    entry, (rc, out, err) = await stage.queued_entry("anthropic", run_python(code, env))
    assert rc == 0, err
    assert out.startswith("tok0")
    assert (entry["workspace"], entry["starred"]) == ("web-app", True)
    assert_stripped(stage)


async def test_the_env_exports_reach_the_proxy(stage: Stage) -> None:
    exported = await _exported(stage.rewrite(sh_block("OPENAI_BASE_URL")))
    openai_url = f"{stage.proxy.url}/openai"
    assert exported == {"OPENAI_BASE_URL": openai_url, "OPENAI_API_BASE": openai_url,
                        "ANTHROPIC_BASE_URL": f"{stage.proxy.url}/anthropic"}
    openai_lines = [
        "from openai import OpenAI",
        "client = OpenAI()",  # base URL and key from the environment
        "reply = client.chat.completions.create(model='gpt-4o-mini', messages=[{'role': 'user', 'content': 'hi'}])",
        "print(reply.choices[0].message.content)",
    ]
    anthropic_lines = [
        "import anthropic",
        "client = anthropic.Anthropic()",  # base URL and key from the environment
        "message = client.messages.create(model='claude-sonnet-4-5', max_tokens=64,",
        "                                 messages=[{'role': 'user', 'content': 'hi'}])",
        "print(message.content[0].text)",
    ]
    env = exported | {"OPENAI_API_KEY": KEY, "ANTHROPIC_API_KEY": KEY}
    for provider, lines in (("openai", openai_lines), ("anthropic", anthropic_lines)):
        code = "\n".join(lines)
        entry, (rc, out, err) = await stage.queued_entry(provider, run_python(code, env))
        assert rc == 0, err
        assert out.startswith("tok0")
        assert (entry["workspace"], entry["starred"]) == ("default", False)  # no headers: the defaults


async def test_aider_env_reaches_the_proxy(stage: Stage) -> None:
    """aider (through LiteLLM) sends ``openai/<model>`` to ``$OPENAI_API_BASE/chat/completions`` as ``<model>``."""
    snippet = stage.rewrite(sh_block("aider "))
    exported = await _exported(snippet)
    assert exported == {"OPENAI_API_BASE": f"{stage.proxy.url}/openai"}
    words = _tool_line(snippet).split()
    assert words[:2] == ["aider", "--model"] and words[2].startswith("openai/"), words
    body = {"model": words[2].removeprefix("openai/"), "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}

    async def send() -> str:
        async with stage.session.post(exported["OPENAI_API_BASE"] + "/chat/completions", json=body,
                                      headers={"Authorization": f"Bearer {KEY}"}) as response:
            assert response.status == 200
            return await response.text()

    entry, out = await stage.queued_entry("openai", send())
    assert "data: [DONE]" in out
    assert entry["workspace"] == "default"


def _codex_configs() -> tuple[dict[str, Any], dict[str, Any]]:
    """The two ``~/.codex/config.toml`` forms: the built-in provider's base URL, and a provider of one's own."""
    configs = [tomllib.loads(block.code) for block in blocks("toml")]
    (builtin,) = [config for config in configs if "openai_base_url" in config]
    (custom,) = [config for config in configs if "model_providers" in config]
    return builtin, custom


async def _codex_request(stage: Stage, base_url: str, headers: dict[str, str]) -> tuple[dict[str, Any], str]:
    """What Codex sends over HTTP (its fallback from the WebSocket): a streamed Responses API request."""
    body = {"model": "gpt-5-codex", "stream": True, "input": [{"role": "user", "content": "hi"}]}

    async def send() -> str:
        async with stage.session.post(base_url + "/responses", json=body, headers=headers) as response:
            assert response.status == 200
            return await response.text()

    entry, out = await stage.queued_entry("openai", send())
    assert "response.completed" in out
    return entry, out


async def test_codex_builtin_provider_config_points_at_the_proxy(stage: Stage) -> None:
    builtin, _ = _codex_configs()
    assert builtin == {"openai_base_url": f"{DOC_URL}/openai"}  # one key: Codex 0.171 ignores OPENAI_BASE_URL
    (block,) = [b.code for b in blocks("toml") if "openai_base_url =" in b.code]
    assert f'codex -c openai_base_url="{DOC_URL}/openai"' in block
    url = tomllib.loads(stage.rewrite(block))["openai_base_url"]
    entry, _ = await _codex_request(stage, url, {"Authorization": f"Bearer {KEY}"})
    assert (entry["workspace"], entry["starred"]) == ("default", False)


async def test_codex_provider_config_points_at_the_proxy_with_priority_headers(stage: Stage) -> None:
    _, config = _codex_configs()
    provider = config["model_providers"][config["model_provider"]]
    assert provider["base_url"] == f"{DOC_URL}/openai"
    assert provider["env_key"] == "OPENAI_API_KEY"
    assert provider["wire_api"] == "responses"
    assert provider["supports_websockets"] is True
    assert provider["name"] != "OpenAI"  # that name would make Codex treat it as its built-in provider
    static, from_env = provider["http_headers"], provider["env_http_headers"]
    assert set(map(str.lower, static | from_env)) <= PRIORITY_HEADERS
    assert all(re.fullmatch(r"[A-Z][A-Z0-9_]*", name) for name in from_env.values())
    # The headers Codex would send with SLOTPROXY_STARRED=1, on a request to the provider's base_url.
    headers = static | {name: "1" for name in from_env} | {"Authorization": f"Bearer {KEY}"}
    entry, _ = await _codex_request(stage, stage.rewrite(provider["base_url"]), headers)
    assert (entry["workspace"], entry["starred"]) == ("web-app", True)
    assert_stripped(stage)
