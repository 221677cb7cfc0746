"""Telemetry off costs nothing: not one OpenTelemetry module is imported on the request path. On without the
``otel`` extra, ``serve`` exits 2 naming the install command. Which settings turn it on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from proxy.config import parse_config
from proxy.telemetry import INSTALL_LINE, telemetry_settings

REQUESTS_WITH_TELEMETRY_OFF = textwrap.dedent("""
    import asyncio, json, sys
    import aiohttp
    from proxy.config import parse_config
    from proxy.http.runtime import ProxyState
    from proxy.server.app import start_server
    from proxy.tools.fake_upstream import FakeUpstream, start_fake_upstream

    async def main():
        upstream, port = await start_fake_upstream(FakeUpstream(chunks=2, websocket=True))
        state = ProxyState(parse_config(
            "state: {path: null}\\nledger: {path: null}\\nproviders:\\n  openai:\\n"
            f"    upstream: http://127.0.0.1:{port}/v1\\n"))
        runner, proxy_port = await start_server(state, "127.0.0.1", 0)
        base = f"http://127.0.0.1:{proxy_port}/openai"
        async with aiohttp.ClientSession() as session:
            for stream in (True, False):
                async with session.post(f"{base}/chat/completions", headers={"traceparent": "00-" + "1" * 32 +
                                        "-" + "2" * 16 + "-01"},
                                        json={"model": "m", "stream": stream, "messages": []}) as resp:
                    assert resp.status == 200
                    await resp.read()
            async with session.ws_connect(f"{base}/responses") as ws:
                await ws.send_str(json.dumps({"type": "response.create", "model": "m", "input": []}))
                while json.loads((await ws.receive(timeout=10)).data)["type"] != "response.completed":
                    pass
        await runner.cleanup()
        await upstream.cleanup()
        print(json.dumps(sorted(name for name in sys.modules if name.startswith("opentelemetry"))))

    asyncio.run(main())
""")

HIDE_OPENTELEMETRY = textwrap.dedent("""
    import sys

    class Hidden:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == "opentelemetry" or name.startswith("opentelemetry."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Hidden)
    from proxy.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def environment(**extra: str) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith("OTEL_")}
    return {**env, **extra}


@pytest.mark.parametrize("extra", [{}, {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}],
                         ids=["no-endpoint", "sdk-disabled"])
def test_telemetry_off_imports_nothing_of_opentelemetry_on_the_request_path(extra: dict[str, str]) -> None:
    done = subprocess.run([sys.executable, "-c", REQUESTS_WITH_TELEMETRY_OFF], capture_output=True, text=True,
                          env=environment(**extra), timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


@pytest.mark.parametrize(("config", "extra"), [
    ("telemetry: {otlp_endpoint: 'http://127.0.0.1:4318'}\n", {}),
    ("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}),
], ids=["config", "variable"])
def test_an_endpoint_without_the_otel_extra_exits_2_naming_the_install(tmp_path: Path, config: str,
                                                                      extra: dict[str, str]) -> None:
    path = tmp_path / "slotproxy.yaml"
    path.write_text(f"state: {{path: null}}\nledger: {{path: null}}\n{config}providers:\n  openai:\n"
                    "    upstream: https://api.openai.com/v1\n")
    done = subprocess.run([sys.executable, "-c", HIDE_OPENTELEMETRY, "serve", "--config", str(path), "--port", "0"],
                          capture_output=True, text=True, env=environment(**extra), timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert INSTALL_LINE in done.stderr
    assert "http://127.0.0.1:4318" in done.stderr


def test_which_settings_turn_telemetry_on() -> None:
    written = parse_config("telemetry: {otlp_endpoint: 'http://collector:4318/', service_name: agents, "
                           "sample: 0.25}\n").telemetry
    default = parse_config("").telemetry
    assert telemetry_settings(default, {}) is None
    assert telemetry_settings(written, {"OTEL_SDK_DISABLED": "TRUE"}) is None
    on = telemetry_settings(written, {"OTEL_SERVICE_NAME": "ignored", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:1"})
    assert on is not None
    assert (on.signal_endpoint("traces"), on.service_name, on.sample, on.latest_experimental) == \
        ("http://collector:4318/v1/traces", "agents", 0.25, False)
    from_env = telemetry_settings(default, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:1", "OTEL_SERVICE_NAME": "svc",
                                            "OTEL_SEMCONV_STABILITY_OPT_IN": "gen_ai_latest_experimental"})
    assert from_env is not None
    assert (from_env.signal_endpoint("traces"), from_env.shown_endpoint, from_env.service_name,
            from_env.latest_experimental, from_env.metrics) == (None, "http://x:1", "svc", True, True)
    traces_only = telemetry_settings(written, {"OTEL_METRICS_EXPORTER": "none"})
    assert traces_only is not None and not traces_only.metrics
