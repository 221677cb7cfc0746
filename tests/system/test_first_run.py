"""A newcomer's first run, from the README alone, in a fresh virtualenv (issue 24).

The README's "Run it" command (``python3 -m venv … && pip install -e . && slotproxy serve --config
config.example.yaml``) in a new venv, with its dependencies taken from this environment (no download:
``--no-deps --no-index``, the way tests/system/test_wheel.py builds its venv); then ``slotproxy fake-upstream``
as the README's "Try it on the fake provider" starts it, a copy of ``config.example.yaml`` whose upstreams are changed
exactly as the README's fake-upstream snippet shows, and ``slotproxy serve`` on it. Then the agents'
client snippets (docs/agents.md), parsed by tests/system/test_client_guides.py's helpers: curl (run by bash as written, its URL
swapped for this proxy's), the OpenAI SDK and the Anthropic SDK (run by the fresh venv's Python). Every
answer is a 200 (the proxy's own request counter says so) and whole. Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ..ports import free_port
from .test_client_guides import DOC_URL, _curl_request, python_block, sh_block
from .test_wheel import building_in_the_checkout

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
FAKE_DEFAULT = "http://127.0.0.1:9100"
ANSWER = "tok0 tok1 tok2 tok3 tok4 "  # the fake's whole answer at its default 5 chunks


def readme_install_command() -> str:
    (line,) = [line for line in README.splitlines() if "slotproxy serve --config config.example.yaml" in line
               and "pip install -e ." in line]
    return line


def readme_fake_section() -> str:
    start = README.index("## Try it on the fake provider")
    return README[start:README.index("\n## ", start + 1)]


def readme_fake_command() -> list[str]:
    """The README's command that starts the fake provider, as argv."""
    (block,) = [b for b in re.findall(r"^```sh\n(.*?)^```", readme_fake_section(), re.DOTALL | re.MULTILINE)
                if "slotproxy fake-upstream" in b]
    return shlex.split(block.strip())


def readme_fake_upstreams() -> dict[str, str]:
    """The README's fake-upstream snippet: provider id → the upstream it tells a user to write."""
    (block,) = re.findall(r"^ *```yaml\n(.*?)^ *```", readme_fake_section(), re.DOTALL | re.MULTILINE)
    providers = yaml.safe_load(textwrap.dedent(block))["providers"]
    return {name: settings["upstream"] for name, settings in providers.items()}


def point_at_fake(example: str, upstreams: dict[str, str]) -> str:
    """``config.example.yaml`` as a user edits it: each named provider's ``upstream:`` line changed, the rest
    (comments included) as it is."""
    for provider, upstream in upstreams.items():
        pattern = re.compile(rf"(^  {re.escape(provider)}:\n(?:(?:    .*| *#.*)?\n)*?    upstream: )\S+", re.MULTILINE)
        example, count = pattern.subn(lambda m, url=upstream: m.group(1) + url, example, count=1)
        assert count == 1, f"config.example.yaml has no providers.{provider}.upstream line"
    return example


# --- the fresh install ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fresh_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python3 -m venv`` and ``pip install -e .``: a new venv holding this checkout as an editable install,
    its dependencies from this environment's site-packages (added as a plain path, so this environment's
    own editable install of the checkout is not what gets imported)."""
    root = tmp_path_factory.mktemp("first-run") / "venv"
    assert "python3 -m venv .venv" in readme_install_command()
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=60)
    python = root / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True, timeout=30).stdout.strip()
    Path(purelib, "test-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    with building_in_the_checkout():
        subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                        "--no-build-isolation", "--quiet", "-e", str(REPO)],
                       check=True, timeout=120, capture_output=True)
    assert (root / "bin" / "slotproxy").is_file()
    return root / "bin"


def _clean_env(bin_dir: Path) -> dict[str, str]:
    """A newcomer's shell with the venv activated: no provider keys, no slotproxy settings, no PYTHONPATH."""
    env = {k: v for k, v in os.environ.items()
           if k != "PYTHONPATH" and not k.startswith(("SLOTPROXY_", "OPENAI_", "ANTHROPIC_"))}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(bin_dir.parent)
    return env


def _wait_for_line(process: subprocess.Popen[str], pattern: str, timeout: float = 30) -> re.Match[str]:
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line)
        found = re.search(pattern, line)
        if found:
            return found
    raise AssertionError(f"no line matching {pattern!r}; output: {''.join(seen)[-3000:]}")


def _stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()


@pytest.fixture(scope="module")
def running(fresh_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, dict[str, str]]]:
    """The fake and the proxy, both started by the fresh venv's ``slotproxy``: (proxy URL, fake URL, env)."""
    work = tmp_path_factory.mktemp("first-run-work")
    env = _clean_env(fresh_bin)
    slotproxy = str(fresh_bin / "slotproxy")
    where = subprocess.run([str(fresh_bin / "python"), "-c", "import proxy; print(proxy.__file__)"], cwd=work,
                           env=env, check=True, capture_output=True, text=True, timeout=30).stdout.strip()
    assert where == str(REPO / "proxy" / "__init__.py"), f"proxy imported from {where}, not the editable install"

    command = readme_fake_command()
    assert command[:2] == ["slotproxy", "fake-upstream"]
    fake = subprocess.Popen([slotproxy, *command[1:], "--port", str(free_port())], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proxy: subprocess.Popen[str] | None = None
    try:
        fake_url = _wait_for_line(fake, r"fake-upstream listening on (http://127\.0\.0\.1:\d+)").group(1)
        upstreams = {name: url.replace(FAKE_DEFAULT, fake_url) for name, url in readme_fake_upstreams().items()}
        config = work / "config.example.yaml"
        config.write_text(point_at_fake((REPO / "config.example.yaml").read_text(), upstreams))
        port = free_port()
        proxy = subprocess.Popen([slotproxy, "serve", "--config", "config.example.yaml", "--port", str(port)],
                                 cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        _wait_for_line(proxy, r"slotproxy listening on .*dashboard: ")
        yield f"http://127.0.0.1:{port}", fake_url, env
    finally:
        if proxy is not None:
            _stop(proxy)
        _stop(fake)


def _requests_by_status(proxy_url: str) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(f"{proxy_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    found = re.findall(r'^slotproxy_requests_total\{provider="(\w+)",status="(\d+)"\} (\S+)$', text, re.MULTILINE)
    return {(provider, status): float(value) for provider, status, value in found}


def _run_python(bin_dir: Path, code: str, env: dict[str, str]) -> str:
    done = subprocess.run([str(bin_dir / "python"), "-c", code], env=env, cwd=bin_dir.parent, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


# --- the tests ----------------------------------------------------------------------------------------


def test_the_readme_tells_each_provider_its_own_fake_upstream() -> None:
    """OpenAI-style upstreams end in /v1; Anthropic's does not (its clients send /v1/messages themselves)."""
    assert readme_fake_upstreams() == {"openai": f"{FAKE_DEFAULT}/v1", "anthropic": FAKE_DEFAULT}
    edited = yaml.safe_load(point_at_fake((REPO / "config.example.yaml").read_text(), readme_fake_upstreams()))
    assert {name: p["upstream"] for name, p in edited["providers"].items()} == readme_fake_upstreams()


def test_the_readme_walk_through_answers_every_snippet_in_full(
    running: tuple[str, str, dict[str, str]], fresh_bin: Path
) -> None:
    proxy_url, fake_url, env = running
    before = _requests_by_status(proxy_url)

    curl = sh_block("curl ").replace(DOC_URL, proxy_url)
    if shutil.which("curl") is not None:
        done = subprocess.run(["bash", "-c", curl], env=env, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        out = done.stdout
    else:  # the same request, read from the snippet the way bash and curl read it
        url, headers, body = _curl_request(curl, env)
        request = urllib.request.Request(url, data=body.encode(), headers=headers, method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            out = response.read().decode()
    assert out.rstrip().endswith("data: [DONE]"), out
    assert "".join(re.findall(r'"content":"([^"]*)"', out)) == ANSWER, out

    for module in ("openai", "anthropic"):
        code = python_block(module).replace(DOC_URL, proxy_url)
        assert _run_python(fresh_bin, code, env) == ANSWER, module

    after = _requests_by_status(proxy_url)
    grown = {key: after[key] - before.get(key, 0.0) for key in after if after[key] != before.get(key, 0.0)}
    assert grown == {("openai", "200"): 2.0, ("anthropic", "200"): 1.0}, grown
    with urllib.request.urlopen(f"{fake_url}/stats", timeout=10) as response:  # the README: GET /stats
        stats = json.load(response)
    assert (stats["requests"], stats["completed"], stats["rate_limited"]) == (3, 3, 0)


# --- the fake accepts both forms, and says what it serves ----------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/chat/completions", "/v1/messages", "/messages",
                                  "/v1/responses", "/responses", "/v1/completions", "/completions"])
async def test_the_fake_serves_each_route_with_and_without_v1(start_upstream, client, path: str) -> None:
    upstream = await start_upstream()
    body = {"model": "fake-model", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
            "prompt": "hi", "input": "hi"}
    async with client.post(upstream.url + path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        assert "tok0" in await resp.text()
    for models in ("/v1/models", "/models"):
        async with client.get(upstream.url + models) as resp:
            assert (resp.status, (await resp.json())["data"][0]["id"]) == (200, "fake-model")


async def test_the_fake_answers_an_unknown_path_with_a_json_404_naming_its_routes(start_upstream, client) -> None:
    upstream = await start_upstream()
    async with client.post(f"{upstream.url}/v2/chat", json={}) as resp:
        assert (resp.status, resp.content_type) == (404, "application/json")
        assert await resp.json() == {"error": {
            "message": "slotproxy fake-upstream has no route POST /v2/chat; it serves /v1/chat/completions, "
                       "/v1/completions, /v1/responses, /v1/messages, /v1/models (with or without /v1)",
            "type": "not_found_error", "code": "unknown_url"}}
    async with client.get(f"{upstream.url}/v1/chat/completions") as resp:
        assert resp.status == 405  # a served path with another method is still a 405


async def test_an_anthropic_upstream_written_with_v1_gets_a_hint_through_the_proxy(start_upstream, start_proxy,
                                                                                  client) -> None:
    """The old README's mistake (``/v1`` on Anthropic's upstream makes ``/v1/v1/messages``) is now explained."""
    upstream = await start_upstream()
    proxy = await start_proxy(f"state: {{path: null}}\nproviders:\n"
                              f"  anthropic: {{upstream: '{upstream.url}/v1', auth: x-api-key}}\n")
    async with client.post(f"{proxy.url}/anthropic/v1/messages", json={"model": "m", "max_tokens": 8}) as resp:
        assert resp.status == 404
        message = (await resp.json())["error"]["message"]
    assert message == (
        "slotproxy fake-upstream has no route POST /v1/v1/messages; it serves /v1/chat/completions, "
        "/v1/completions, /v1/responses, /v1/messages, /v1/models (with or without /v1). The path has /v1 twice: "
        f"point an Anthropic-style provider's upstream at http://127.0.0.1:{upstream.port} (its clients add /v1), "
        f"an OpenAI-style one at http://127.0.0.1:{upstream.port}/v1")
