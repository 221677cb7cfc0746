"""The README's two commands are the ones CI runs and the ones the tests exercise."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


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


def _block_after(marker: str, fence: str) -> str:
    start = README.index(marker)
    opening = README.index(fence, start)
    body_start = README.index("\n", opening) + 1
    end = README.index("```", body_start)
    return README[body_start:end]


def test_the_redis_backend_snippet_is_a_valid_config() -> None:
    from proxy.config import parse_config

    block = _block_after("## Several replicas: the Redis backend", "```yaml")
    config = parse_config(block + "providers:\n  openai: {upstream: 'https://api.openai.com/v1', limit: 8}\n")
    assert (config.backend.kind, config.backend.lease_ttl, config.backend.on_backend_error) == ("redis", 30.0, "fail_closed")


async def test_the_admin_api_curl_lines_do_what_they_say(start_upstream, start_proxy) -> None:
    import asyncio
    import shlex
    import shutil

    block = _block_after("**Admin API**", "```sh")
    lines = [line.split("#")[0].strip() for line in block.splitlines() if line.strip().startswith("curl")]
    assert len(lines) == 5
    upstream = await start_upstream()
    proxy = await start_proxy(
        f"state: {{path: null}}\nproviders:\n  openai: {{upstream: '{upstream.url}/v1', limit: 3}}\n"
        f"  anthropic:\n    upstream: '{upstream.url}'\n    keys: [{{name: team-a, api_key_env: SP_README_KEY}}]\n"
        "    models: {'claude-opus-*': {limit: 1}}\n")
    for line in lines:
        argv = shlex.split(line.replace("localhost:8787", f"127.0.0.1:{proxy.port}"))
        if shutil.which("curl") is None:
            raise AssertionError("curl is needed to run the README's admin examples (apt-get install curl)")
        process = await asyncio.create_subprocess_exec(*argv, "-sS", "-f", stdout=asyncio.subprocess.PIPE,
                                                       stderr=asyncio.subprocess.PIPE)
        out, err = await process.communicate()
        assert process.returncode == 0, (line, out, err)
    status = proxy.status()
    assert (status["limit"], status["cooldown_ms"]) == (6, 1500)
    anthropic = proxy.status("anthropic")
    assert (anthropic["keys"][0]["limit"], anthropic["models"][0]["limit"]) == (4, 2)
    assert "release-team" in proxy.state.backend.starred()


def test_the_readme_serve_command_runs_exactly_as_written() -> None:
    """The first Quick start command, verbatim, in the repository (venv, install, serve on 8787)."""
    import json
    import os
    import signal
    import socket
    import subprocess
    import time
    import urllib.request

    line = next(line for line in README.splitlines() if "slotproxy serve --config config.example.yaml" in line)
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", 8787)) == 0:
            raise AssertionError("port 8787 is taken; the README command serves there (stop what holds it)")
    state = REPO / "slotproxy-state.json"
    existed = state.exists()
    process = subprocess.Popen(["bash", "-c", line], cwd=REPO, start_new_session=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                with urllib.request.urlopen("http://127.0.0.1:8787/_slotproxy/status", timeout=2) as response:
                    status = json.load(response)
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"the README command did not serve: {process.communicate()[0][-2000:]}")
                time.sleep(0.5)
        assert [p["provider"] for p in status["providers"]] == ["openai", "anthropic"]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
        process.communicate(timeout=60)
        if not existed and state.exists():
            state.unlink()
    assert process.returncode == 0
