"""The local threat model (SPEC part two, "Safe beside a browser"), request by request, as an attacker sends it.

Each refusal goes over a raw socket with exactly the headers a web page (or a
DNS-rebinding page, or a path-confusion probe) would send. Each asserts the
status and the error code, that the recording upstream saw nothing, and that
the provider key the proxy would inject never left it. The browser itself is
in ``tests/system/test_browser_attacks.py``; slow clients in ``tests/http/test_connections.py``.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from proxy.admin.throttle import AuthFailures
from proxy.http.guard import BrowserGuard, check_path, host_name
from proxy.http.headers import PriorityHeaders, parse_priority
from proxy.http.state import MAX_RUNTIME_STARS
from proxy.limiter import FakeClock

from ..conftest import Proxy, chat, wait_until
from ..http.test_bad_input import Recorder, assert_error, recorder, send_raw

REPO = Path(__file__).resolve().parents[2]
KEY_ENV = "SPT_THREAT_PROVIDER_KEY"
TOKEN_ENV = "SPT_THREAT_ADMIN_TOKEN"


@dataclass
class Target:
    proxy: Proxy
    upstream: Recorder
    key: str
    token: str

    @property
    def port(self) -> int:
        return self.proxy.port

    def assert_nothing_left(self) -> None:
        """Nothing reached the upstream, so the injected key did not either."""
        assert self.upstream.seen == [], [(s.method, s.raw_path) for s in self.upstream.seen]
        assert self.proxy.status()["in_flight"] == 0


def target_yaml(upstream: Recorder, extra: str = "") -> str:
    return textwrap.dedent(f"""\
        state: {{path: null}}
        admin: {{token_env: {TOKEN_ENV}}}
        providers:
          openai: {{upstream: '{upstream.url}/v1', limit: 2, api_key_env: {KEY_ENV}}}
        """) + extra


@pytest.fixture
async def target(start_proxy, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Target]:
    key, token = "sk-threat-" + secrets.token_hex(8), secrets.token_hex(8)
    monkeypatch.setenv(KEY_ENV, key)
    monkeypatch.setenv(TOKEN_ENV, token)
    upstream = await recorder()
    proxy = await start_proxy(target_yaml(upstream))
    yield Target(proxy, upstream, key, token)
    assert upstream.runner is not None
    await upstream.runner.cleanup()


def raw(method: str, path: str, *headers: str, body: bytes = b"", host: str | None = "127.0.0.1:8787") -> bytes:
    lines = [f"{method} {path} HTTP/1.1"]
    if host is not None:
        lines.append(f"Host: {host}")
    lines += ["Connection: close", *headers]
    if body or method in ("POST", "PUT"):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


CHAT = json.dumps(chat(stream=False)).encode()
EVERY_ROUTE = [
    ("POST", "/openai/chat/completions", CHAT),
    ("GET", "/openai/models", b""),
    ("GET", "/_slotproxy/status", b""),
    ("GET", "/_slotproxy/", b""),
    ("PUT", "/_slotproxy/providers/openai/limit", b'{"limit": 1}'),
    ("GET", "/metrics", b""),
    ("GET", "/healthz", b""),
    ("GET", "/readyz", b""),
]


# --- Host: the DNS-rebinding defence ---------------------------------------------------


@pytest.mark.parametrize(("method", "path", "body"), EVERY_ROUTE)
@pytest.mark.parametrize("host", ["evil.example:8787", "evil.example", "127.0.0.1.evil.example",
                                  "localhost.evil.example:8787", "127.1:8787", "0.0.0.0:8787"])
async def test_a_foreign_host_is_refused_on_every_route(target: Target, method: str, path: str, body: bytes,
                                                        host: str) -> None:
    answer = await send_raw(target.port, raw(method, path, "Origin: http://evil.example", body=body, host=host))
    assert answer.status == 403
    assert "server.allowed_hosts" in assert_error(answer.body, "forbidden")
    assert target.key not in answer.body.decode()
    target.assert_nothing_left()
    assert target.proxy.status()["limit"] == 2


@pytest.mark.parametrize("host", ["127.0.0.1:1234", "127.9.8.7", "localhost:8787", "LOCALHOST", "[::1]:8787"])
async def test_loopback_hosts_are_served(target: Target, host: str) -> None:
    answer = await send_raw(target.port, raw("POST", "/openai/chat/completions", body=CHAT, host=host))
    assert answer.status == 200, answer.body
    (seen,) = target.upstream.seen
    assert seen.headers["authorization"] == f"Bearer {target.key}"


async def test_allowed_hosts_admits_a_service_name_and_star_admits_any(start_proxy, monkeypatch) -> None:
    upstream = await recorder()
    try:
        named = await start_proxy(target_yaml(upstream, "server: {allowed_hosts: [slotproxy.agents.svc]}\n"))
        assert (await send_raw(named.port, raw("GET", "/healthz", host="slotproxy.agents.svc:8787"))).status == 200
        assert (await send_raw(named.port, raw("GET", "/healthz", host="SLOTPROXY.agents.svc"))).status == 200
        assert (await send_raw(named.port, raw("GET", "/healthz", host="other.svc"))).status == 403
        anything = await start_proxy(target_yaml(upstream, "server: {allowed_hosts: ['*']}\n"))
        assert (await send_raw(anything.port, raw("GET", "/healthz", host="other.svc"))).status == 200
    finally:
        assert upstream.runner is not None
        await upstream.runner.cleanup()


def test_host_rule_by_listen_address() -> None:
    loopback = BrowserGuard.for_listener("127.0.0.1")
    assert loopback.host_allowed("127.0.0.1:8787") and loopback.host_allowed("[::1]")
    assert not loopback.host_allowed("evil.example") and not loopback.host_allowed("192.168.1.10:8787")
    everywhere = BrowserGuard.for_listener("0.0.0.0")
    assert everywhere.host_allowed("evil.example") and everywhere.host_allowed("10.0.0.7:8787")
    listed = BrowserGuard.for_listener("0.0.0.0", ("slotproxy.svc",))
    assert listed.host_allowed("slotproxy.svc:8787") and listed.host_allowed("localhost:8787")
    assert not listed.host_allowed("evil.example")
    assert host_name("[::1]:8787") == "::1" and host_name("Proxy.Local:80") == "proxy.local"


# --- Origin and Sec-Fetch-Site --------------------------------------------------------


@pytest.mark.parametrize(("method", "path", "body"), EVERY_ROUTE)
@pytest.mark.parametrize("headers", [
    ("Origin: http://evil.example",),
    ("Origin: null",),
    ("Origin: http://127.0.0.1:9999",),  # another local port is another origin
    ("Sec-Fetch-Site: cross-site", "Sec-Fetch-Mode: no-cors"),
    ("Sec-Fetch-Site: same-site", "Sec-Fetch-Mode: cors"),
])
async def test_a_web_page_is_refused_on_every_route(target: Target, method: str, path: str, body: bytes,
                                                    headers: tuple[str, ...]) -> None:
    answer = await send_raw(target.port, raw(method, path, *headers, "Content-Type: text/plain", body=body))
    assert answer.status == 403
    assert "server.allowed_origins" in assert_error(answer.body, "forbidden")
    target.assert_nothing_left()
    assert target.proxy.status()["limit"] == 2


async def test_the_proxys_own_origin_and_a_navigation_to_the_dashboard_are_served(target: Target) -> None:
    own = await send_raw(target.port, raw("PUT", "/_slotproxy/providers/openai/limit", f"Origin: http://127.0.0.1:{target.port}",
                                          f"Authorization: Bearer {target.token}", body=b'{"limit": 1}',
                                          host=f"127.0.0.1:{target.port}"))
    assert own.status == 200, own.body
    link = await send_raw(target.port, raw("GET", "/_slotproxy/", "Sec-Fetch-Site: cross-site",
                                           "Sec-Fetch-Mode: navigate"))
    assert link.status == 200 and b"<html" in link.body.lower()
    framed = await send_raw(target.port, raw("GET", "/_slotproxy/", "Sec-Fetch-Site: cross-site",
                                             "Sec-Fetch-Mode: navigate", "Sec-Fetch-Dest: iframe"))
    assert framed.status == 403
    assert "frame-ancestors 'none'" in link.headers["content-security-policy"]
    assert link.headers["x-frame-options"] == "DENY"
    status_by_link = await send_raw(target.port, raw("GET", "/_slotproxy/status", "Sec-Fetch-Site: cross-site",
                                                     "Sec-Fetch-Mode: navigate"))
    assert status_by_link.status == 403


async def test_an_allowed_origin_gets_cors_headers_and_upstream_ones(start_proxy, monkeypatch) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-allowed-origin")
    upstream = await recorder()
    try:
        proxy = await start_proxy(target_yaml(upstream, "server: {allowed_origins: ['http://localhost:3000']}\n"))
        answer = await send_raw(proxy.port, raw("POST", "/openai/chat/completions", "Origin: http://localhost:3000",
                                                "Content-Type: application/json", body=CHAT))
        assert answer.status == 200
        assert answer.headers["access-control-allow-origin"] == "http://localhost:3000"
        preflight = await send_raw(proxy.port, raw("OPTIONS", "/openai/chat/completions",
                                                   "Origin: http://localhost:3000",
                                                   "Access-Control-Request-Method: POST",
                                                   "Access-Control-Request-Headers: content-type, x-workspace-id"))
        assert preflight.status == 204
        assert preflight.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert preflight.headers["access-control-allow-headers"] == "content-type, x-workspace-id"
        assert len(upstream.seen) == 1  # the preflight was answered here
    finally:
        assert upstream.runner is not None
        await upstream.runner.cleanup()


# --- OPTIONS, TRACE, and upstream CORS headers ----------------------------------------


@pytest.mark.parametrize("path", ["/openai/chat/completions", "/_slotproxy/providers/openai/limit", "/metrics"])
async def test_options_is_answered_here_and_never_forwarded(target: Target, path: str) -> None:
    plain = await send_raw(target.port, raw("OPTIONS", path))
    assert plain.status == 204 and "POST" in plain.headers["allow"]
    assert "access-control-allow-origin" not in plain.headers
    preflight = await send_raw(target.port, raw("OPTIONS", path, "Origin: http://evil.example",
                                                "Access-Control-Request-Method: POST"))
    assert preflight.status == 403
    assert "access-control-allow-origin" not in preflight.headers
    target.assert_nothing_left()


@pytest.mark.parametrize("method", ["TRACE", "CONNECT"])
async def test_trace_and_connect_get_405(target: Target, method: str) -> None:
    path = "127.0.0.1:443" if method == "CONNECT" else "/openai/chat/completions"
    answer = await send_raw(target.port, raw(method, path))
    assert answer.status == 405
    assert_error(answer.body, "bad_request")
    target.assert_nothing_left()


async def test_upstream_cors_headers_never_reach_a_client_without_an_allowed_origin(start_proxy, client) -> None:
    from aiohttp import web

    from ..conftest import serve_app

    async def permissive(request: web.Request) -> web.Response:
        return web.json_response({"ok": True}, headers={"Access-Control-Allow-Origin": "*",
                                                        "Access-Control-Allow-Credentials": "true",
                                                        "X-Request-Id": "kept"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", permissive)
    runner, port = await serve_app(app)
    try:
        proxy = await start_proxy(f"state: {{path: null}}\nproviders:\n  openai: {{upstream: 'http://127.0.0.1:{port}'}}\n")
        async with client.post(f"{proxy.url}/openai/chat/completions", json=chat(stream=False)) as resp:
            assert resp.status == 200
            assert not [h for h in resp.headers if h.lower().startswith("access-control-")]
            assert resp.headers["X-Request-Id"] == "kept"
    finally:
        await runner.cleanup()


# --- paths -----------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "status", "code"), [
    ("/%5fslotproxy/providers/openai/limit", 404, "unknown_provider"),
    ("/%5Fslotproxy/status", 404, "unknown_provider"),
    ("/%6detrics", 404, "unknown_provider"),
    ("/%6fpenai/chat/completions", 404, "unknown_provider"),
    ("/openai/%2e%2e/admin", 400, "bad_request"),
    ("/openai/%2E/chat", 400, "bad_request"),
    ("/openai/%252e%252e/admin", 400, "bad_request"),
    ("/openai/%25252e%25252e/admin", 400, "bad_request"),
    ("/openai/..;/admin", 400, "bad_request"),
    ("/openai/v1/..;jsessionid=1/x", 400, "bad_request"),
    ("/openai/..%2fadmin", 400, "bad_request"),
    ("/openai/a\\..\\admin", 400, "bad_request"),
    ("/openai/a%5c..%5cadmin", 400, "bad_request"),
    ("/openai/a%255cadmin", 400, "bad_request"),
])
async def test_confusing_paths_are_refused(target: Target, path: str, status: int, code: str) -> None:
    method = "PUT" if "limit" in path else "POST"
    body = b'{"limit": 1}' if method == "PUT" else CHAT
    answer = await send_raw(target.port, raw(method, path, f"Authorization: Bearer {target.token}", body=body))
    assert answer.status == status, answer.body
    assert_error(answer.body, code)
    target.assert_nothing_left()
    assert target.proxy.status()["limit"] == 2


@pytest.mark.parametrize("path", ["/openai/chat/completions?x=%2e%2e", "/openai/files/a%20b",
                                  "/openai/models/gemini-pro:generateContent"])
def test_ordinary_paths_pass(path: str) -> None:
    check_path(path)


# --- admin authentication failures -----------------------------------------------------


async def test_failed_admin_auth_is_logged_sparingly_and_then_blocked(target: Target, caplog) -> None:
    caplog.set_level("WARNING", logger="slotproxy.admin")
    put = ("PUT", "/_slotproxy/providers/openai/limit")
    for attempt in range(20):
        answer = await send_raw(target.port, raw(*put, f"Authorization: Bearer wrong-{attempt}", body=b'{"limit": 1}'))
        assert answer.status == 403
    blocked = await send_raw(target.port, raw(*put, f"Authorization: Bearer {target.token}", body=b'{"limit": 1}'))
    assert blocked.status == 429
    assert_error(blocked.body, "rate_limited")
    assert 1 <= int(blocked.headers["retry-after"]) <= 60
    lines = [r.getMessage() for r in caplog.records if "admin authentication failed" in r.getMessage()]
    assert 1 <= len(lines) <= 3, lines
    assert "127.0.0.1" in lines[0]
    assert not any(f"wrong-{n}" in line for n in range(20) for line in lines)
    assert target.proxy.status()["limit"] == 2
    reads = await send_raw(target.port, raw("GET", "/_slotproxy/status"))
    assert reads.status == 200


def test_auth_failures_window_on_fake_time() -> None:
    clock = FakeClock()
    failures = AuthFailures(clock.time, limit=3, window=60.0, log_interval=1.0)
    assert failures.failed("a") == 1
    assert failures.failed("a") is None
    clock.advance(1.0)
    assert failures.failed("a") == 2  # the one held back, and this one
    assert failures.blocked_for("a") == pytest.approx(59.0)
    assert failures.blocked_for("b") is None
    clock.advance(59.0)
    assert failures.blocked_for("a") is None
    assert failures.failed("a") == 1


# --- admin bodies and stars -------------------------------------------------------------


@pytest.mark.parametrize("body", [b"[" * 2000, b'{"limit": ' + b"[" * 40 + b"]" * 40 + b"}",
                                  b'{"a":' * 33 + b"1" + b"}" * 33])
async def test_deeply_nested_admin_bodies_get_400(target: Target, body: bytes) -> None:
    answer = await send_raw(target.port, raw("PUT", "/_slotproxy/providers/openai/limit",
                                             f"Authorization: Bearer {target.token}", body=body))
    assert answer.status == 400
    assert "32 levels" in assert_error(answer.body, "bad_request")


async def test_nesting_inside_strings_does_not_count(target: Target) -> None:
    body = json.dumps({"limit": 1, "note": "[" * 100}).encode()
    answer = await send_raw(target.port, raw("PUT", "/_slotproxy/providers/openai/limit",
                                             f"Authorization: Bearer {target.token}", body=body))
    assert answer.status == 400
    assert "32 levels" not in assert_error(answer.body, "bad_request")


async def test_unstar_forgets_and_runtime_stars_are_capped(start_proxy, tmp_path: Path,
                                                          client: aiohttp.ClientSession) -> None:
    state_path = tmp_path / "state.json"
    proxy = await start_proxy(f"state: {{path: {state_path}}}\nworkspaces: {{starred: [yaml-star]}}\n"
                              "providers:\n  openai: {upstream: 'http://127.0.0.1:9/v1'}\n")
    star = f"{proxy.url}/_slotproxy/workspaces/{{}}/star"
    for n in range(300):
        async with client.put(star.format(f"w{n}")) as resp:
            assert resp.status == 200
        async with client.delete(star.format(f"w{n}")) as resp:
            assert resp.status == 200
    async with client.delete(star.format("yaml-star")) as resp:
        assert resp.status == 200
    await wait_until(lambda: state_path.exists() and json.loads(state_path.read_text())["star_overrides"]
                     == {"yaml-star": False}, what="only the YAML star's override left")
    overrides = {f"w{n}": True for n in range(MAX_RUNTIME_STARS)}
    proxy.state.stars.load(overrides, ())
    async with client.put(star.format("one-too-many")) as resp:
        assert resp.status == 400
        assert str(MAX_RUNTIME_STARS) in assert_error(await resp.json(), "bad_request")
    async with client.put(star.format("w5")) as resp:  # already starred: not a new one
        assert resp.status == 200


# --- priority: no header buys a place ahead of every honest prompt ---------------------


@pytest.mark.parametrize("value", ["946684800000", "2000-01-01T00:00:00Z"])
def test_an_ancient_prompt_start_counts_as_max_prompt_age(value: str) -> None:
    now = 1_800_000_000.0
    names = PriorityHeaders(max_prompt_age=3600.0)
    priority, invalid = parse_priority({"X-Prompt-Started-At": value}, names, now)
    assert invalid == []
    assert priority.prompt_started_at == now - 3600.0
    recent, _ = parse_priority({"X-Prompt-Started-At": str(int((now - 60) * 1000))}, names, now)
    assert recent.prompt_started_at == pytest.approx(now - 60)


async def test_ancient_prompt_start_queues_behind_an_honest_old_one(start_proxy, start_upstream, client) -> None:
    upstream = await start_upstream(delay_ms=100)
    proxy = await start_proxy(f"state: {{path: null}}\nheaders: {{max_prompt_age: 1h}}\n"
                              f"providers:\n  openai: {{upstream: '{upstream.url}/v1', limit: 1}}\n")
    url = f"{proxy.url}/openai/chat/completions"
    now_ms = int(time.time() * 1000)
    order: list[str] = []

    async def send(name: str, started_ms: int) -> None:
        async with client.post(url, json=chat(), headers={"X-Prompt-Started-At": str(started_ms)}) as resp:
            assert resp.status == 200
            await resp.read()
            order.append(name)

    holder = asyncio.create_task(send("holder", now_ms))
    await wait_until(lambda: proxy.status()["in_flight"] == 1, what="the holder in flight")
    honest = asyncio.create_task(send("honest", now_ms - 2 * 3600 * 1000))
    await wait_until(lambda: proxy.status()["queued"] == 1, what="the honest prompt queued")
    cheat = asyncio.create_task(send("cheat", 946684800000))  # 2000-01-01
    await wait_until(lambda: proxy.status()["queued"] == 2, what="both queued")
    await asyncio.gather(holder, honest, cheat)
    # Both count as exactly an hour old, so the year-2000 claim buys nothing over the honest prompt that came first.
    assert order == ["holder", "honest", "cheat"]


# --- check: unset provider key variables --------------------------------------------------


def test_check_warns_about_unset_key_variables_and_masks_a_pasted_key(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    pasted = "AIzaSyD" + "x7Q2" * 8
    config.write_text(f"providers:\n  openai: {{upstream: 'http://127.0.0.1:9/v1', api_key_env: SPT_UNSET_KEY}}\n"
                      f"  gemini: {{upstream: 'http://127.0.0.1:9/v1', api_key_env: {pasted}}}\n"
                      "  set: {upstream: 'http://127.0.0.1:9/v1', api_key_env: SPT_SET_KEY}\n")
    env = {"PATH": "/usr/bin:/bin", "SPT_SET_KEY": "present"}
    done = subprocess.run([sys.executable, "-m", "proxy", "check", "--config", str(config)], check=False,
                          capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert any("providers.openai.api_key_env names $SPT_UNSET_KEY, which is unset or empty" in w for w in warnings)
    assert any("providers.gemini.api_key_env" in w and "looks like a key value" in w for w in warnings)
    assert not any("providers.set." in w for w in warnings)
    assert pasted not in done.stdout + done.stderr
