"""The README and docs/: the README's two commands are the ones CI runs, and every command, config snippet,
curl line and link of the README and of docs/*.md works."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from ..conftest import machine_lock

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
README = (REPO / "README.md").read_text()
FRONT_PAGE_TOPICS = ("configuration.md", "operations.md", "scaling.md", "agents.md", "troubleshooting.md",
                     "benchmarks.md")


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted(DOCS.glob("*.md"))]


def doc(name: str) -> str:
    """``README.md``, or a page of docs/ by its file name (``agents.md``)."""
    return (REPO / name if name == "README.md" else DOCS / name).read_text()


def block_after(text: str, marker: str, fence: str) -> str:
    """The body of the first ``fence`` block after ``marker`` (its indentation kept)."""
    start = text.index(marker)
    opening = text.index(fence, start)
    body_start = text.index("\n", opening) + 1
    end = text.index("```", body_start)
    return text[body_start:end]


def fenced_blocks(text: str, lang: str | None = None) -> list[tuple[str, str]]:
    """Every fenced block as (language, body), also those indented inside a list item (body dedented)."""
    found = []
    for match in re.finditer(r"^( *)```(\w*)\n(.*?)^\1```", text, re.DOTALL | re.MULTILINE):
        indent = len(match.group(1))
        body = "".join(line[indent:] for line in match.group(3).splitlines(keepends=True))
        found.append((match.group(2), body))
    return [block for block in found if lang is None or block[0] == lang]


def all_blocks(lang: str) -> list[tuple[str, str]]:
    """(file name, body) of every ``lang`` block of the README and docs/."""
    return [(path.name, body) for path in doc_files() for _, body in fenced_blocks(path.read_text(), lang)]


def shell_commands(block: str) -> list[list[str]]:
    """Each simple command of a sh block as argv: continuation lines joined, comments dropped, split on
    ``&&``, ``||``, ``;`` and ``|``."""
    commands: list[list[str]] = []
    for line in block.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars="&|;")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        argv: list[str] = []
        for token in lexer:
            if token in {"&&", "||", ";", "|", "&"}:
                commands.append(argv)
                argv = []
            else:
                argv.append(token)
        commands.append(argv)
    return [argv for argv in commands if argv]


# --- the two commands ------------------------------------------------------------------------------


def test_ci_runs_the_readme_test_command() -> None:
    ci = (REPO / ".ci" / "run").read_text()
    command = "./scripts/test-setup && .venv/bin/python -m pytest"
    assert f"```sh\n{command}\n```" in README
    assert ci.splitlines()[-1] == command
    script = (REPO / "scripts" / "test-setup").read_text()
    assert "apt-get install" in script and "redis-server" in script and "chromium" in script
    assert "pip install --quiet -e '.[test]'" in script


def test_readme_serve_command_uses_the_example_config() -> None:
    assert "pip install -e . && slotproxy serve --config config.example.yaml" in README
    assert (REPO / "config.example.yaml").is_file()


README_PORT = 8787


def checkout_copy(into: Path) -> Path:
    """This checkout's files as a clone has them: .git, what .gitignore names (the virtualenv, builds, state
    files) and the linters' caches (which ignore themselves) left out."""
    ignored = [line.strip().rstrip("/") for line in (REPO / ".gitignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    shutil.copytree(REPO, into, ignore=shutil.ignore_patterns(".git", ".*_cache", *ignored))
    return into


def test_the_readme_serve_command_runs_exactly_as_written(tmp_path: Path) -> None:
    """The first Quick start command, verbatim, in a copy of this checkout as a clone has it (venv, install,
    serve on 8787). Not in the checkout itself: its .venv may be the one running the tests, and the command's
    ``pip install -e .`` reinstalls the package there, from under the tests running beside this one."""
    line = next(line for line in README.splitlines() if "slotproxy serve --config config.example.yaml" in line)
    work = checkout_copy(tmp_path / "clone")
    try:
        with machine_lock(f"port-{README_PORT}"):  # the one fixed port the suite serves on
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", README_PORT)) == 0:
                    raise AssertionError(f"port {README_PORT} is taken; the README command serves there (stop what "
                                         "holds it)")
            process = subprocess.Popen(["bash", "-c", line], cwd=work, start_new_session=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            try:
                deadline = time.monotonic() + 240
                while True:
                    try:
                        with urllib.request.urlopen(f"http://127.0.0.1:{README_PORT}/_slotproxy/status",
                                                    timeout=2) as response:
                            status = json.load(response)
                        break
                    except OSError:
                        if process.poll() is not None or time.monotonic() > deadline:
                            raise AssertionError("the README command did not serve: "
                                                 f"{process.communicate()[0][-2000:]}")
                        time.sleep(0.5)
                assert [p["provider"] for p in status["providers"]] == ["openai", "anthropic"]
            finally:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGTERM)
                process.communicate(timeout=60)
        assert process.returncode == 0
    finally:
        shutil.rmtree(work, ignore_errors=True)  # a virtualenv: too big to leave to pytest's tmp_path rotation


# --- the README is a front page ------------------------------------------------------------------------


def test_the_readme_is_a_front_page_that_links_each_topic() -> None:
    assert len(README.splitlines()) <= 200
    headings = re.findall(r"^## (.+)$", README, re.MULTILINE)
    assert headings[:4] == ["Run it", "Try it on the fake provider", "Point your agents at it", "Where to look"]
    for topic in FRONT_PAGE_TOPICS:
        assert f"](docs/{topic})" in README, topic
    assert "slotproxy init" in README


def test_the_client_versions_tried_are_stated_once() -> None:
    """The versions try-real-clis installs and the SDKs the guides ran with, in one table of docs/agents.md."""
    script = (REPO / "scripts" / "try-real-clis").read_text()
    claude = re.search(r"CLAUDE_CODE_VERSION:-([\d.]+)", script)
    codex = re.search(r"CODEX_VERSION:-([\d.]+)", script)
    assert claude and codex
    table = doc("agents.md").split("## Versions tried", 1)[1].split("\n## ", 1)[0]
    assert f"| {claude.group(1)} |" in table and f"| {codex.group(1)} |" in table
    for path in doc_files():
        prose = re.sub(r"^( *)```.*?^\1```", "", path.read_text(), flags=re.DOTALL | re.MULTILINE)
        if path.name == "agents.md":
            prose = prose.replace(table, "")
        for version in (claude.group(1), codex.group(1), "0.171"):
            assert version not in prose, (path.name, version)


# --- links -------------------------------------------------------------------------------------------


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation other than - and _ dropped, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    prose = re.sub(r"^( *)```.*?^\1```", "", text, flags=re.DOTALL | re.MULTILINE)
    return {github_slug(heading) for heading in re.findall(r"^#{1,6} (.+)$", prose, re.MULTILINE)}


def relative_links(text: str) -> list[str]:
    prose = re.sub(r"^( *)```.*?^\1```", "", text, flags=re.DOTALL | re.MULTILINE)
    prose = re.sub(r"`[^`\n]*`", "", prose)
    targets = re.findall(r"\]\(([^)\s]+)\)", prose)
    return [t for t in targets if not re.match(r"[a-z]+:", t)]


def test_github_slugs() -> None:
    assert github_slug("Every core of one host: `serve --workers N`") == "every-core-of-one-host-serve---workers-n"
    assert github_slug("Redis as your platform gives it: Sentinel, Cluster, TLS") == \
        "redis-as-your-platform-gives-it-sentinel-cluster-tls"


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: p.name)
def test_every_relative_link_and_anchor_resolves(path: Path) -> None:
    links = relative_links(path.read_text())
    if path.name == "README.md":
        assert links
    for link in links:
        target, _, anchor = link.partition("#")
        file = (path.parent / target).resolve() if target else path
        assert file.exists(), f"{path.name}: {link} names no file"
        if anchor:
            assert file.suffix == ".md", f"{path.name}: {link}"
            assert anchor in anchors(file.read_text()), f"{path.name}: {link}: no such heading in {file.name}"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {Path(t.partition("#")[0]).name for t in relative_links(README) if t.startswith("docs/")}
    assert linked == {path.name for path in DOCS.glob("*.md")}


# --- commands and configs ------------------------------------------------------------------------------


def slotproxy_commands() -> list[tuple[str, list[str]]]:
    return [(name, argv[1:]) for name, block in all_blocks("sh") for argv in shell_commands(block)
            if argv[0] == "slotproxy"]


def test_every_slotproxy_command_shown_parses() -> None:
    from proxy.cli import build_parser

    commands = slotproxy_commands()
    assert {argv[0] for _, argv in commands} >= {"serve", "fake-upstream", "check", "status", "usage"}
    for name, argv in commands:
        try:
            build_parser(argv).parse_args(argv)
        except SystemExit as exit:
            raise AssertionError(f"{name}: slotproxy {shlex.join(argv)} does not parse (exit {exit.code})") from None


def test_every_check_shown_passes_on_its_config() -> None:
    checks = [argv for _, argv in slotproxy_commands() if argv[0] == "check"]
    assert checks
    for argv in checks:
        done = subprocess.run([sys.executable, "-m", "proxy", *argv], cwd=REPO, capture_output=True, text=True,
                              timeout=60, check=False)
        assert done.returncode == 0, (argv, done.stderr)


def test_every_python_bench_command_shown_names_a_script() -> None:
    scripts = [argv[1] for _, block in all_blocks("sh") for argv in shell_commands(block)
               if argv[0] == "python" and argv[1:2] != ["-m"]]
    assert scripts
    for script in scripts:
        assert (REPO / script).is_file(), script


BASE = {"state": {"path": None}, "providers": {
    "openai": {"upstream": "https://api.openai.com/v1"},
    "anthropic": {"upstream": "https://api.anthropic.com", "auth": "x-api-key"}}}


def merged(base: Any, snippet: Any) -> Any:
    if isinstance(base, dict) and isinstance(snippet, dict):
        return {**base, **{key: merged(base.get(key), value) for key, value in snippet.items()}}
    return snippet


@pytest.mark.parametrize("name, block", all_blocks("yaml"), ids=lambda v: v if isinstance(v, str) and
                         v.endswith(".md") else "")
def test_every_yaml_block_is_a_config(name: str, block: str) -> None:
    """Each YAML snippet, put into a config of two providers, passes ``parse_config``; a Compose file (its
    ``services``) names an image and loopback-only ports for each service."""
    from proxy.config import parse_config

    snippet = yaml.safe_load(block)
    assert isinstance(snippet, dict), name
    if "services" in snippet:
        for service in snippet["services"].values():
            assert service["image"] and all(port.startswith("127.0.0.1:") for port in service.get("ports", []))
        return
    parse_config(yaml.safe_dump(merged(BASE, snippet)))


def test_the_redis_backend_snippet_is_a_valid_config() -> None:
    from proxy.config import parse_config

    block = block_after(doc("scaling.md"), "## Several replicas: the Redis backend", "```yaml")
    config = parse_config(block + "providers:\n  openai: {upstream: 'https://api.openai.com/v1', limit: 8}\n")
    assert (config.backend.kind, config.backend.lease_ttl, config.backend.on_backend_error) == ("redis", 30.0, "fail_closed")


# --- curl lines ----------------------------------------------------------------------------------------

ADMIN_MARKER = ("operations.md", "### Admin API")
USAGE_MARKER = ("operations.md", "slotproxy usage --since 5h")


def curl_lines(block: str) -> list[str]:
    return [line.split("#")[0].strip() for line in block.splitlines() if line.strip().startswith("curl")]


def test_every_curl_line_shown_is_one_a_test_runs() -> None:
    """The admin API's and the usage curl lines run below; the agents' curl guide runs in test_client_guides."""
    ran = {*curl_lines(block_after(doc(ADMIN_MARKER[0]), ADMIN_MARKER[1], "```sh")),
           *curl_lines(block_after(doc(USAGE_MARKER[0]), "**`slotproxy usage", "```sh"))}
    from .test_client_guides import sh_block

    guide = sh_block("curl ")
    for name, block in all_blocks("sh"):
        if block == guide:
            continue
        for line in curl_lines(block):
            assert line in ran, (name, line)


async def run(argv: list[str]) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                   stderr=asyncio.subprocess.PIPE, cwd=REPO)
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def require_curl() -> None:
    if shutil.which("curl") is None:
        raise AssertionError("curl is needed to run the docs' curl examples (apt-get install curl)")


async def test_the_admin_api_curl_lines_do_what_they_say(start_upstream, start_proxy) -> None:
    block = block_after(doc(ADMIN_MARKER[0]), ADMIN_MARKER[1], "```sh")
    lines = curl_lines(block)
    assert len(lines) == 6
    upstream = await start_upstream()
    proxy = await start_proxy(
        f"state: {{path: null}}\nproviders:\n  openai: {{upstream: '{upstream.url}/v1', limit: 3}}\n"
        f"  anthropic:\n    upstream: '{upstream.url}'\n    keys: [{{name: team-a, api_key_env: SP_README_KEY}}]\n"
        "    models: {'claude-opus-*': {limit: 1}}\n")
    require_curl()
    limits = []
    for line in lines:
        argv = shlex.split(line.replace("localhost:8787", f"127.0.0.1:{proxy.port}"))
        code, out, err = await run([*argv, "-sS", "-f"])
        assert code == 0, (line, out, err)
        if "/providers/openai/limit" in line:
            limits.append((proxy.status()["limit"], proxy.status()["manual"]))
    assert limits == [(6, True), (3, False)]
    status = proxy.status()
    assert (status["limit"], status["cooldown_ms"]) == (3, 1500)
    anthropic = proxy.status("anthropic")
    assert (anthropic["keys"][0]["limit"], anthropic["models"][0]["limit"]) == (4, 2)
    assert "release-team" in proxy.state.backend.starred()


async def test_the_usage_examples_answer_what_they_say(start_upstream, start_proxy, client) -> None:
    """``slotproxy usage --since 5h --by workspace,model`` and the usage curl line, after one request of
    workspace web-app."""
    block = block_after(doc(USAGE_MARKER[0]), "**`slotproxy usage", "```sh")
    (curl,) = curl_lines(block)
    (command,) = [line.strip() for line in block.splitlines() if line.strip().startswith("slotproxy usage")]
    upstream = await start_upstream()
    proxy = await start_proxy(f"state: {{path: null}}\nproviders:\n  openai: {{upstream: '{upstream.url}/v1'}}\n")
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
    async with client.post(f"{proxy.url}/openai/chat/completions", json=body,
                           headers={"X-Workspace-Id": "web-app", "X-Conversation-Id": "c-7"}) as resp:
        assert resp.status == 200
    await proxy.state.ledger.flush()

    require_curl()
    code, out, err = await run([*shlex.split(curl.replace("localhost:8787", f"127.0.0.1:{proxy.port}")), "-sS", "-f"])
    assert code == 0, err
    answer = json.loads(out)
    assert [(row["conversation"], row["requests"]) for row in answer["rows"]] == [("c-7", 1)], answer

    code, out, err = await run([sys.executable, "-m", "proxy", *shlex.split(command)[1:], "--url", proxy.url])
    assert code == 0, err
    assert "web-app" in out and "gpt-4o-mini" in out, out
