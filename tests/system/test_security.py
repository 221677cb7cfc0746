"""Security (issue 7, part 4): secrets never written, admin auth, the bind rule, no leaking
response headers, TLS verified by default, and optional client keys.

Related older tests, kept as they are: ``tests/server/test_server.py::test_json_logs_mask_secrets`` (one 429 path),
``tests/http/test_relay.py::test_priority_headers_stripped_and_provider_key_replaces_client_auth``,
``tests/admin/test_api.py::test_writes_need_the_token_when_it_is_set``,
``tests/cli/test_cli.py::test_serve_refuses_a_non_loopback_bind_without_an_admin_token``.
"""

from __future__ import annotations

import asyncio
import datetime
import io
import ipaddress
import logging
import os
import secrets
import signal
import ssl
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.logs import setup_logging

from ..conftest import chat, wait_until
from ..http.test_bad_input import (
    Recorder,
    assert_error,
    recorder,
    request_bytes,
    send_raw,
)
from ..ports import free_port

REPO = Path(__file__).resolve().parents[2]


# --- helpers: a proxy in a child process, exactly as `slotproxy serve` runs ----------


def spawn_proxy(config: Path, port: int, log: Path, env: dict[str, str], *extra: str) -> subprocess.Popen[bytes]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLOTPROXY_", "SPT_"))}
    with log.open("wb") as sink:  # a file, not a pipe: DEBUG output must never block the child
        return subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", "--config", str(config), "--port", str(port), *extra],
            stdout=sink, stderr=subprocess.STDOUT, env={**clean, **env}, cwd=REPO,
        )


async def wait_healthy(client: aiohttp.ClientSession, port: int, process: subprocess.Popen[bytes],
                       timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, f"the proxy exited with {process.returncode}"
        try:
            async with client.get(f"http://127.0.0.1:{port}/healthz") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        assert time.monotonic() < deadline, "the proxy did not become healthy"
        await asyncio.sleep(0.05)


async def stop(process: subprocess.Popen[bytes]) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return await asyncio.to_thread(process.wait, 15)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


# --- 1. API keys and Authorization values are never written anywhere -----------------


def _secret(prefix: str) -> str:
    # Not "sk-" shaped on purpose: the log masker's key-shape rule must not be what saves us.
    return f"{prefix}{secrets.token_hex(12)}"


class Secrets:
    def __init__(self) -> None:
        self.provider = _secret("AIzaProv")
        self.anthropic = _secret("antProv")
        self.admin = _secret("admTok")
        self.client_bearer = _secret("cliBearer")
        self.client_xkey = _secret("cliXkey")
        self.client_azure = _secret("cliAzure")
        self.proxy_auth = _secret("cliProxyAuth")
        self.client_key = _secret("cliKey")
        self.wrong_client_key = _secret("cliWrongKey")

    def all(self) -> dict[str, str]:
        return {k: v for k, v in vars(self).items()}


def leaks(text: str, found: dict[str, str]) -> list[str]:
    """Names of the secrets present in ``text``, whole or as a 12-character slice of their random part."""
    out = []
    for name, value in found.items():
        tail = value[-24:]
        pieces = [value, tail[:12], tail[6:18], tail[12:]]
        if any(piece in text for piece in pieces):
            out.append(name)
    return out


@pytest.mark.parametrize("log_format", ["text", "json"])
async def test_secrets_never_reach_logs_status_metrics_or_error_bodies(
    start_upstream, client, tmp_path: Path, log_format: str
) -> None:
    s = Secrets()
    upstream = await start_upstream(chunks=3, delay_ms=5, retry_after=0.05)
    closed_port = free_port()
    config = tmp_path / "slotproxy.yaml"
    config.write_text(textwrap.dedent(f"""\
        server: {{max_body: 4KiB, shutdown_grace: 1s}}
        admin: {{token_env: SPT_ADMIN_TOKEN}}
        access: {{keys_env: SPT_CLIENT_KEYS}}
        state: {{path: null}}
        logging: {{slow_grant: 0s}}
        defaults: {{default_pause: 50ms, retry_on_429: 1}}
        providers:
          keyed: {{upstream: '{upstream.url}/v1', limit: 2, api_key_env: SPT_PROVIDER_KEY}}
          xkey: {{upstream: '{upstream.url}/v1', limit: 2, auth: x-api-key, api_key_env: SPT_ANTHROPIC_KEY}}
          passthru: {{upstream: '{upstream.url}/v1', limit: 2}}
          refused: {{upstream: 'http://127.0.0.1:{closed_port}/v1', limit: 1, api_key_env: SPT_PROVIDER_KEY}}
          slow: {{upstream: '{upstream.url}/v1', limit: 1, idle_timeout: 200ms, api_key_env: SPT_PROVIDER_KEY}}
          tls: {{upstream: 'https://127.0.0.1:{upstream.port}/v1', limit: 1, api_key_env: SPT_PROVIDER_KEY}}
        """))
    port = free_port()
    log = tmp_path / "proxy.log"
    env = {"SPT_PROVIDER_KEY": s.provider, "SPT_ANTHROPIC_KEY": s.anthropic, "SPT_ADMIN_TOKEN": s.admin,
           "SPT_CLIENT_KEYS": f"other-key-0000000000,{s.client_key}"}
    process = spawn_proxy(config, port, log, env, "--log-level", "DEBUG", "--log-format", log_format)
    base = f"http://127.0.0.1:{port}"
    client_auth = {
        "X-Slotproxy-Key": s.client_key,
        "Authorization": f"Bearer {s.client_bearer}",
        "x-api-key": s.client_xkey,
        "api-key": s.client_azure,
        "Proxy-Authorization": f"Basic {s.proxy_auth}",
        "X-Workspace-Id": "x" * 300,
        "X-Prompt-Started-At": "not-a-time",
        "X-Conversation-Id": "conv-1",
    }
    seen: list[str] = []  # every status line, header and body the proxy sent back
    echoed: list[str] = []  # answers to malformed requests: aiohttp quotes the client's own bad line back

    async def call(method: str, path: str, *, headers: dict[str, str] | None = None, cancel: bool = False,
                   **kwargs: Any) -> int:
        try:
            async with client.request(method, base + path, headers={**client_auth, **(headers or {})},
                                      **kwargs) as resp:
                seen.append(f"{resp.status} {resp.reason} {dict(resp.headers)}")
                if cancel:
                    seen.append(repr(await resp.content.readany()))
                    return resp.status
                seen.append((await resp.read()).decode("utf-8", "replace"))
                return resp.status
        except aiohttp.ClientPayloadError:
            return -1

    try:
        await wait_healthy(client, port, process)
        statuses: dict[str, int] = {}
        for provider in ("keyed", "xkey", "passthru"):
            path = f"/{provider}/chat/completions"
            statuses[f"{provider} stream"] = await call("POST", path, json=chat())
            statuses[f"{provider} plain"] = await call("POST", path, json=chat(stream=False))
            statuses[f"{provider} 500"] = await call("POST", path, json=chat(), headers={"x-fake-status": "500"})
            statuses[f"{provider} 401"] = await call("POST", path, json=chat(), headers={"x-fake-status": "401"})
            statuses[f"{provider} 429"] = await call("POST", path, json=chat(), headers={"x-fake-status": "429"})
            statuses[f"{provider} reset"] = await call("POST", path, json=chat(),
                                                       headers={"x-fake-reset-after": "1"})
            statuses[f"{provider} cancel"] = await call("POST", path, json=chat(), cancel=True,
                                                        headers={"x-fake-delay-ms": "100"})
            statuses[f"{provider} models"] = await call("GET", f"/{provider}/models?key={s.client_bearer}")
        statuses["refused"] = await call("POST", "/refused/chat/completions", json=chat())
        statuses["timeout"] = await call("POST", "/slow/chat/completions", json=chat(),
                                         headers={"x-fake-stall-ms": "600"})
        statuses["tls"] = await call("POST", "/tls/chat/completions", json=chat())
        statuses["unknown"] = await call("POST", "/nope/chat/completions", json=chat())
        statuses["no client key"] = await call("POST", "/keyed/chat/completions", json=chat(),
                                               headers={"X-Slotproxy-Key": "", "Authorization": "", "x-api-key": ""})
        statuses["wrong client key"] = await call("POST", "/keyed/chat/completions", json=chat(),
                                                  headers={"X-Slotproxy-Key": s.wrong_client_key})
        statuses["dots"] = await call("POST", "/keyed/a/..%2f..%2fx", json=chat())
        statuses["too large"] = await call("POST", "/keyed/chat/completions", data=b"x" * 8192)
        limit_url = "/_slotproxy/providers/keyed/limit"
        statuses["admin none"] = await call("PUT", limit_url, json={"limit": 3}, headers={"Authorization": ""})
        statuses["admin wrong"] = await call("PUT", limit_url, json={"limit": 3})
        statuses["admin bad body"] = await call("PUT", limit_url, data=b"{" + s.client_bearer.encode(),
                                                headers={"Authorization": f"Bearer {s.admin}"})
        statuses["admin ok"] = await call("PUT", limit_url, json={"limit": 3},
                                          headers={"Authorization": f"Bearer {s.admin}"})
        statuses["star ok"] = await call("PUT", "/_slotproxy/workspaces/team/star",
                                         headers={"Authorization": f"Bearer {s.admin}"})
        # Malformed requests the HTTP parser refuses: it logs them with the offending line.
        for line in (f"Authorization: Bearer {s.client_bearer}\x01", f"x-api-key: {s.client_xkey}\x01",
                     f"Authorization: Bearer {s.client_bearer}" + "A" * 9000):
            response = await send_raw(port, request_bytes("/keyed/chat/completions", headers=[line.encode()]))
            echoed.append(f"{response.status} {response.headers} {response.body.decode('utf-8', 'replace')}")
            statuses[f"raw {line[:15]}"] = response.status
        for path in ("/_slotproxy/status", "/metrics", "/_slotproxy/", "/healthz", "/readyz"):
            statuses[path] = await call("GET", path)

        expected = {
            "keyed stream": 200, "keyed 500": 500, "keyed 429": 429, "refused": 502, "timeout": 504,
            "tls": 502, "unknown": 404, "no client key": 401, "wrong client key": 403, "dots": 400, "too large": 413, "admin none": 401, "admin wrong": 403,
            "admin bad body": 400, "admin ok": 200, "star ok": 200, "/metrics": 200, "/_slotproxy/status": 200,
        }
        assert {k: statuses[k] for k in expected} == expected, statuses
        assert {v for k, v in statuses.items() if k.startswith("raw")} == {400}
    finally:
        code = await stop(process)
    written = log.read_text("utf-8", "replace")
    assert code == 0, written[-2000:]
    # The log is not empty: the error paths above were really taken and logged.
    for evidence in (f"could not connect to 127.0.0.1:{closed_port} (connection refused)",
                     f"TLS handshake with 127.0.0.1:{upstream.port} failed",
                     "sent no response headers within idle_timeout (200ms)", "after a 429", "rejected a bad request",
                     "granted a slot", "limit set to 3 via the admin API"):
        assert evidence in written, f"expected {evidence!r} in the log"
    found = s.all()
    assert leaks(written, found) == [], "secrets in the log"
    # Status, metrics, dashboard, every relayed answer and every proxy-made error: no secret at all.
    assert leaks("\n".join(seen), found) == [], "secrets in an answer"
    # A malformed request's 400 may quote that client's own line back to it, nothing else.
    assert leaks("\n".join(echoed), {k: v for k, v in found.items() if k in ("provider", "anthropic", "admin")}) == []


def _proxy_log_handler(log_format: str) -> tuple[logging.Handler, io.StringIO]:
    """A handler that formats exactly as ``slotproxy serve`` does (``proxy.logs.setup_logging``)."""
    root, access = logging.getLogger(), logging.getLogger("aiohttp.access")
    saved_handlers, saved_level, saved_access = root.handlers[:], root.level, access.level
    try:
        setup_logging(log_format, "DEBUG")
        formatter = root.handlers[0].formatter
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
        access.setLevel(saved_access)
    sink = io.StringIO()
    handler = logging.StreamHandler(sink)
    handler.setFormatter(formatter)
    return handler, sink


KEY = "AIzaSyD3adb33fc0ffee" + secrets.token_hex(6)
ECHO_ROWS = [
    ("bearer-control-char", b"Authorization: Bearer " + KEY.encode() + b"\x01"),
    ("x-api-key-control-char", b"x-api-key: " + KEY.encode() + b"\x01"),
    ("azure-api-key-control-char", b"api-key: " + KEY.encode() + b"\x01"),
    ("goog-api-key-control-char", b"x-goog-api-key: " + KEY.encode() + b"\x01"),
    ("bearer-oversized", b"Authorization: Bearer " + KEY.encode() + b"A" * 9000),
    ("x-api-key-oversized", b"x-api-key: " + KEY.encode() + b"A" * 9000),
    ("raw-authorization-oversized", b"Authorization: " + KEY.encode() + b"A" * 9000),
    ("basic-control-char", b"Authorization: Basic " + KEY.encode() + b"\x01"),
    ("bearer-with-colon-control-char", b"Authorization: Bearer org:" + KEY.encode() + b"\x01"),
    ("query-key-control-char", None),
    ("x-slotproxy-key-control-char", b"X-Slotproxy-Key: " + KEY.encode() + b"\x01"),
]


@pytest.mark.parametrize("log_format", ["text", "json"])
@pytest.mark.parametrize(
    ("line", ),
    [pytest.param(line, id=name) for name, line in ECHO_ROWS],
)
async def test_malformed_requests_carrying_a_key_do_not_put_it_in_the_log(start_proxy, line, log_format) -> None:
    handler, sink = _proxy_log_handler(log_format)
    root = logging.getLogger()
    root.addHandler(handler)
    old_level = root.level
    root.setLevel(logging.DEBUG)
    try:
        proxy = await start_proxy("state: {path: null}\nproviders:\n  openai: {upstream: 'http://127.0.0.1:9/v1'}\n")
        if line is None:
            data = f"GET /openai/models?key={KEY}\x01 HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        else:
            data = request_bytes("/openai/chat/completions", headers=[line])
        response = await send_raw(proxy.port, data)
        assert response.status == 400
        await asyncio.sleep(0.05)
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    written = sink.getvalue()
    assert "Error handling request" in written or "bad request" in written.lower()
    assert leaks(written, {"key": KEY}) == [], written[-600:]


# --- 2. admin writes need the token when it is set ------------------------------------

TOKEN = "adm-" + "7f3c9a21b4e8d6f0" * 2


def _flip(ch: str) -> str:
    return "b" if ch != "b" else "c"


# (Authorization header bytes, or None for none; expected status)
TOKEN_ROWS = [
    (None, 401),
    (b"", 401),
    (b"Bearer", 401),
    (b"Bearer ", 401),
    (b"Basic " + TOKEN.encode(), 401),
    (TOKEN.encode(), 401),
    (b"Token " + TOKEN.encode(), 401),
    (b"Bearer x", 403),
    (b"Bearer " + TOKEN[:-1].encode(), 403),  # a prefix
    (b"Bearer " + TOKEN[:1].encode(), 403),  # a one-char prefix
    (b"Bearer " + TOKEN.encode() + b"0", 403),  # the token plus one char
    (b"Bearer " + (TOKEN[:-1] + _flip(TOKEN[-1])).encode(), 403),  # same length, last char differs
    (b"Bearer " + (_flip(TOKEN[0]) + TOKEN[1:]).encode(), 403),  # same length, first char differs
    (b"Bearer " + TOKEN.upper().encode(), 403),
    (b"Bearer " + TOKEN.encode() * 200, 403),  # 7 KB
    (b"Bearer " + TOKEN.encode() + b" " + TOKEN.encode(), 403),
    (b"Bearer " + "t\u00f6ken".encode(), 403),
    pytest.param(b"Bearer \xff" + TOKEN.encode(), 403, id="non-utf8-token"),
    (b"Bearer " + TOKEN.encode(), 200),
    (b"bearer " + TOKEN.encode(), 200),
    (b"BEARER  " + TOKEN.encode() + b" ", 200),
]


@pytest.fixture
async def admin_rig(start_proxy, monkeypatch) -> AsyncIterator[tuple[Any, Recorder]]:
    monkeypatch.setenv("SPT_ADMIN_TOKEN", TOKEN)
    upstream = await recorder()
    proxy = await start_proxy(textwrap.dedent(f"""\
        state: {{path: null}}
        admin: {{token_env: SPT_ADMIN_TOKEN}}
        providers:
          openai: {{upstream: '{upstream.url}/v1', limit: 2}}
        """))
    yield proxy, upstream
    assert upstream.runner is not None
    await upstream.runner.cleanup()


@pytest.mark.parametrize(("auth", "status"), TOKEN_ROWS)
async def test_admin_writes_need_the_token(admin_rig, auth, status) -> None:
    proxy, _ = admin_rig
    body = b'{"limit": 5}'
    headers = [] if auth is None else [b"Authorization: " + auth]
    response = await send_raw(proxy.port, request_bytes("/_slotproxy/providers/openai/limit", method="PUT",
                                                        headers=headers, body=body))
    assert response.status == status, response
    if status == 200:
        assert response.json()["limit"] == 5
        return
    assert_error(response.body, "forbidden")
    assert TOKEN.encode() not in response.body and TOKEN[:8].encode() not in response.body
    assert proxy.status()["limit"] == 2


async def test_wrong_tokens_all_get_the_same_answer_whatever_their_length_or_prefix(admin_rig) -> None:
    """A wrong token's answer must not say how close it was (length, shared prefix)."""
    proxy, _ = admin_rig
    bodies = set()
    for given in ("x", TOKEN[:1], TOKEN[:-1], TOKEN + "0", TOKEN[:-1] + _flip(TOKEN[-1]), "y" * len(TOKEN),
                  TOKEN * 50):
        response = await send_raw(proxy.port, request_bytes(
            "/_slotproxy/providers/openai/limit", method="PUT",
            headers=[f"Authorization: Bearer {given}".encode()], body=b'{"limit": 5}'))
        assert response.status == 403
        bodies.add(response.body)
    assert len(bodies) == 1, bodies


@pytest.mark.parametrize(("method", "path", "body"), [
    ("PUT", "/_slotproxy/providers/openai/limit", b'{"limit": 5}'),
    ("PUT", "/_slotproxy/providers/openai/cooldown", b'{"cooldown_ms": 5}'),
    ("PUT", "/_slotproxy/workspaces/team/star", b""),
    ("DELETE", "/_slotproxy/workspaces/team/star", b""),
    ("PUT", "/_slotproxy/providers/nope/limit", b'{"limit": 5}'),  # auth before the existence check
])
async def test_every_admin_write_is_guarded(admin_rig, method, path, body) -> None:
    proxy, _ = admin_rig
    for headers, status in (([], 401), ([b"Authorization: Bearer nope"], 403)):
        response = await send_raw(proxy.port, request_bytes(path, method=method, headers=headers, body=body))
        assert response.status == status, response
        assert_error(response.body, "forbidden")
    status_now = proxy.status()
    assert (status_now["limit"], status_now["cooldown_ms"]) == (2, 0)
    assert proxy.state.backend.starred() == frozenset()


@pytest.mark.parametrize("path", ["/_slotproxy/status", "/metrics", "/healthz", "/readyz", "/_slotproxy/"])
async def test_reads_need_no_token(admin_rig, path) -> None:
    proxy, _ = admin_rig
    response = await send_raw(proxy.port, request_bytes(path, method="GET", body=b""))
    assert response.status == 200


async def test_no_token_set_means_writes_are_open(admin_rig, monkeypatch) -> None:
    proxy, _ = admin_rig
    monkeypatch.setenv("SPT_ADMIN_TOKEN", "")
    response = await send_raw(proxy.port, request_bytes("/_slotproxy/providers/openai/limit", method="PUT",
                                                        body=b'{"limit": 4}'))
    assert response.status == 200 and proxy.status()["limit"] == 4


# --- 3. the non-loopback bind rule ----------------------------------------------------

BIND_ROWS = [
    # (id, --host or None (server.host from YAML), YAML extra, env, expect start?)
    ("no-token", "0.0.0.0", "", {}, False),
    ("empty-token", "0.0.0.0", "", {"SLOTPROXY_ADMIN_TOKEN": ""}, False),
    ("host-from-yaml", None, "server: {host: 0.0.0.0}\n", {}, False),
    ("with-token", "0.0.0.0", "", {"SLOTPROXY_ADMIN_TOKEN": "a-long-admin-token"}, True),
    ("allow-unauthenticated", "0.0.0.0", "admin: {allow_unauthenticated: true}\n", {}, True),
    ("loopback-needs-nothing", "127.0.0.1", "", {}, True),
]


@pytest.mark.parametrize(("host", "extra", "env", "starts"), [pytest.param(*r[1:], id=r[0]) for r in BIND_ROWS])
async def test_non_loopback_bind_needs_a_token_or_an_explicit_opt_out(
    client, tmp_path: Path, host, extra, env, starts
) -> None:
    config = tmp_path / "slotproxy.yaml"
    config.write_text("state: {path: null}\nproviders:\n  openai: {upstream: 'http://127.0.0.1:9/v1'}\n" + extra)
    port = free_port()
    log = tmp_path / "serve.log"
    process = spawn_proxy(config, port, log, env, *(["--host", host] if host else []))
    try:
        if not starts:
            code = await asyncio.to_thread(process.wait, 15)
            out = log.read_text()
            assert code == 2, out
            assert "SLOTPROXY_ADMIN_TOKEN" in out and "admin.allow_unauthenticated" in out
            assert len(out.strip().splitlines()) == 1, out
            return
        await wait_healthy(client, port, process)
    finally:
        code = await stop(process)
    assert code == 0, log.read_text()


# --- 4. response headers: nothing that leaks internals is added -----------------------


class FixedUpstream:
    """Answers every request with fixed bytes, so its header names are known exactly."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.server: asyncio.Server | None = None
        self.port = 0

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            if length:
                await reader.readexactly(length)
            writer.write(self.answer)
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


ANSWERS = {
    "json-with-length": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
                        b"X-Request-Id: req-1\r\nConnection: close\r\n\r\n{}",
    "sse-chunked": b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                   b"Connection: close\r\n\r\n7\r\ndata: 1\r\n0\r\n\r\n",
    "error-401": b"HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
                 b"Connection: close\r\n\r\n{}",
    "no-content-type": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello",
}
# What HTTP framing needs (and Date, which RFC 9110 6.6.1 has a proxy add when the origin sent none).
FRAMING = {"content-length", "transfer-encoding", "connection", "keep-alive", "date"}
ALLOWED_ADDITIONS = FRAMING | {"x-slotproxy-queue-ms"}


async def _names(port: int, path: str) -> tuple[int, list[str], dict[str, str]]:
    response = await send_raw(port, request_bytes(path))
    return response.status, sorted(response.headers), response.headers


@pytest.mark.parametrize("case", [
    pytest.param(name, id=name) for name in ANSWERS
])
async def test_proxy_adds_only_the_queue_header_and_framing(start_proxy, case) -> None:
    upstream = FixedUpstream(ANSWERS[case])
    await upstream.start()
    try:
        proxy = await start_proxy(f"state: {{path: null}}\nproviders:\n  openai: {{upstream: 'http://127.0.0.1:{upstream.port}/v1', retry_on_429: 0}}\n")
        direct_status, direct, _ = await _names(upstream.port, "/v1/chat/completions")
        via_status, via, via_headers = await _names(proxy.port, "/openai/chat/completions")
    finally:
        await upstream.stop()
    assert via_status == direct_status
    added = set(via) - set(direct)
    assert "x-slotproxy-queue-ms" in added
    assert "date" in via_headers
    assert added - ALLOWED_ADDITIONS == set(), {n: via_headers[n] for n in added - ALLOWED_ADDITIONS}


async def test_upstream_server_header_is_relayed_unchanged(start_proxy) -> None:
    upstream = FixedUpstream(b"HTTP/1.1 200 OK\r\nServer: upstream-edge/1.0\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
    await upstream.start()
    try:
        proxy = await start_proxy(f"state: {{path: null}}\nproviders:\n  openai: {{upstream: 'http://127.0.0.1:{upstream.port}/v1'}}\n")
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(request_bytes("/openai/chat/completions"))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        writer.close()
        await writer.wait_closed()
    finally:
        await upstream.stop()
    server_lines = [line for line in head.split(b"\r\n") if line.lower().startswith(b"server:")]
    assert server_lines == [b"Server: upstream-edge/1.0"]


@pytest.mark.parametrize(("path", "method", "status"), [
    ("/nope/x", "GET", 404), ("/_slotproxy/status", "GET", 200), ("/healthz", "GET", 200), ("/metrics", "GET", 200),
    ("/_slotproxy/nope", "GET", 404), ("/_slotproxy", "GET", 301),
    # refused before any route is looked at
    ("/openai/models", "TRACE", 405), ("/openai/a\\b", "GET", 400), ("/openai/models", "OPTIONS", 204),
])
async def test_proxy_made_answers_do_not_name_the_server_software(start_proxy, path, method, status) -> None:
    proxy = await start_proxy("state: {path: null}\nproviders:\n  openai: {upstream: 'http://127.0.0.1:9/v1'}\n")
    response = await send_raw(proxy.port, request_bytes(path, method=method, body=b""))
    assert response.status == status
    assert "server" not in response.headers, response.headers["server"]


# --- 5. upstream TLS is verified by default -------------------------------------------


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=1))
        # The name matches: the only thing wrong is that nobody trusts the issuer.
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                       critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.fixture
async def tls_upstream(tmp_path: Path) -> AsyncIterator[Recorder]:
    cert, key = _self_signed(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    rec = Recorder()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", rec.handle)
    rec.runner = web.AppRunner(app, access_log=None)
    await rec.runner.setup()
    site = web.TCPSite(rec.runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    rec.port = rec.runner.addresses[0][1]
    yield rec
    await rec.runner.cleanup()


def _tls_yaml(rec: Recorder, extra: str = "") -> str:
    return f"state: {{path: null}}\nproviders:\n  secure: {{upstream: 'https://127.0.0.1:{rec.port}/v1', limit: 1{extra}}}\n"


async def test_self_signed_upstream_is_refused_by_default(start_proxy, client, tls_upstream) -> None:
    proxy = await start_proxy(_tls_yaml(tls_upstream))
    async with client.post(f"{proxy.url}/secure/chat/completions", json=chat(stream=False)) as resp:
        assert resp.status == 502
        assert_error(await resp.read(), "upstream_unreachable")
    assert tls_upstream.seen == []
    await wait_until(lambda: proxy.status("secure")["in_flight"] == 0)


async def test_tls_verify_false_reaches_a_self_signed_upstream(start_proxy, client, tls_upstream) -> None:
    proxy = await start_proxy(_tls_yaml(tls_upstream, ", tls_verify: false"))
    async with client.post(f"{proxy.url}/secure/chat/completions", json=chat(stream=False)) as resp:
        assert resp.status == 200
        assert (await resp.json())["ok"] is True
    assert [s.raw_path for s in tls_upstream.seen] == ["/v1/chat/completions"]


async def test_verified_and_unverified_providers_do_not_share_a_connection_pool(start_proxy, client, tls_upstream) -> None:
    """tls_verify: false on one provider must not switch verification off for another to the same host."""
    yaml = (f"state: {{path: null}}\nproviders:\n"
            f"  lax: {{upstream: 'https://127.0.0.1:{tls_upstream.port}/v1', tls_verify: false}}\n"
            f"  strict: {{upstream: 'https://127.0.0.1:{tls_upstream.port}/v1'}}\n")
    proxy = await start_proxy(yaml)
    async with client.post(f"{proxy.url}/lax/chat/completions", json=chat(stream=False)) as resp:
        assert resp.status == 200
    async with client.post(f"{proxy.url}/strict/chat/completions", json=chat(stream=False)) as resp:
        assert resp.status == 502
        assert_error(await resp.read(), "upstream_unreachable")
    assert len(tls_upstream.seen) == 1


async def test_tls_verify_false_warns(start_proxy, client, tls_upstream, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    proxy = await start_proxy(_tls_yaml(tls_upstream, ", tls_verify: false"))
    async with client.post(f"{proxy.url}/secure/chat/completions", json=chat(stream=False)) as resp:
        assert resp.status == 200
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("tls" in r.getMessage().lower() and "secure" in r.getMessage() for r in warnings), \
        [r.getMessage() for r in caplog.records]


# --- 6. optional client keys (access.keys_env) ----------------------------------------
#
# Implemented in proxy/http/access.py while these tests were written (see also tests/http/test_access.py):
# `X-Slotproxy-Key: <key>` always works and is stripped before forwarding; `Authorization:
# Bearer <key>` and `x-api-key: <key>` also work and are consumed (for a provider without
# api_key_env the client's Authorization is its provider key, so the client key must ride in
# X-Slotproxy-Key there). X-Slotproxy-Key rather than Proxy-Authorization: browsers forbid
# scripts from setting Proxy-* headers and some HTTP clients reserve Proxy-Authorization for a
# configured forward proxy. Missing → 401 forbidden, wrong → 403 forbidden, both before any
# slot is taken or byte sent upstream. "Constant time" is checked by behaviour: keys that
# share a prefix or a length with a real one get the same answer as any other wrong key.

CLIENT_KEYS = ("ck-alpha-0123456789", "ck-beta-9876543210")


@pytest.fixture
async def keyed_rig(start_proxy, monkeypatch) -> AsyncIterator[tuple[Any, Recorder]]:
    monkeypatch.setenv("SPT_CLIENT_KEYS", f" {CLIENT_KEYS[0]} , {CLIENT_KEYS[1]} ")
    monkeypatch.setenv("SPT_PROVIDER_KEY", "provider-secret-key-123")
    upstream = await recorder()
    proxy = await start_proxy(textwrap.dedent(f"""\
        state: {{path: null}}
        access: {{keys_env: SPT_CLIENT_KEYS}}
        providers:
          keyed: {{upstream: '{upstream.url}/v1', limit: 1, api_key_env: SPT_PROVIDER_KEY}}
          passthru: {{upstream: '{upstream.url}/v1', limit: 1}}
        """))
    yield proxy, upstream
    assert upstream.runner is not None
    await upstream.runner.cleanup()


REFUSED_ROWS = [
    ("keyed", {}, 401),
    ("passthru", {}, 401),
    # The proxy cannot tell a provider key from a wrong client key here: refused either way.
    ("passthru", {"Authorization": "Bearer users-own-provider-key"}, (401, 403)),
    ("keyed", {"X-Slotproxy-Key": ""}, 401),
    ("keyed", {"X-Slotproxy-Key": "wrong"}, 403),
    ("keyed", {"X-Slotproxy-Key": CLIENT_KEYS[0][:-1]}, 403),
    ("keyed", {"X-Slotproxy-Key": CLIENT_KEYS[0] + "0"}, 403),
    ("keyed", {"X-Slotproxy-Key": ",".join(CLIENT_KEYS)}, 403),
    ("keyed", {"X-Slotproxy-Key": CLIENT_KEYS[0].upper()}, 403),
    ("keyed", {"Authorization": "Bearer wrong-key"}, 403),
    ("keyed", {"x-api-key": "wrong-key"}, 403),
    # Without a provider key of its own, x-api-key is the client's provider key: no client key offered.
    ("passthru", {"x-api-key": "ck-gamma-1111111111"}, 401),
]


@pytest.mark.parametrize(("provider", "headers", "status"), REFUSED_ROWS)
async def test_client_keys_refuse_a_missing_or_wrong_key(keyed_rig, client, provider, headers, status) -> None:
    proxy, upstream = keyed_rig
    async with client.post(f"{proxy.url}/{provider}/chat/completions", json=chat(stream=False),
                           headers=headers) as resp:
        assert resp.status in (status if isinstance(status, tuple) else (status,))
        message = assert_error(await resp.read(), "forbidden")
    for value in (*CLIENT_KEYS, *(v for v in headers.values() if len(v) > 8)):
        assert value.split(" ")[-1] not in message
    assert upstream.seen == []
    assert proxy.state.backend.provider_status(provider).counters["granted"] == 0


async def test_client_keys_accept_a_valid_key_in_each_place(keyed_rig, client) -> None:
    proxy, upstream = keyed_rig
    url = f"{proxy.url}/keyed/chat/completions"
    async with client.post(url, json=chat(stream=False)) as resp:
        assert resp.status == 401  # the feature is on: without a key, no entry
    accepted = [
        ("keyed", {"X-Slotproxy-Key": CLIENT_KEYS[0]}),
        ("keyed", {"Authorization": f"Bearer {CLIENT_KEYS[1]}"}),
        ("keyed", {"x-api-key": CLIENT_KEYS[0]}),
        ("passthru", {"X-Slotproxy-Key": CLIENT_KEYS[1], "Authorization": "Bearer users-own-provider-key"}),
    ]
    for provider, headers in accepted:
        async with client.post(f"{proxy.url}/{provider}/chat/completions", json=chat(stream=False),
                               headers=headers) as resp:
            assert resp.status == 200, (provider, headers)
        seen = upstream.seen[-1].headers
        assert "x-slotproxy-key" not in seen
        assert not any(key in " ".join(seen.values()) for key in CLIENT_KEYS), seen
        if provider == "keyed":
            assert seen["authorization"] == "Bearer provider-secret-key-123"
        else:
            assert seen["authorization"] == "Bearer users-own-provider-key"


async def test_wrong_client_keys_all_get_the_same_answer(keyed_rig) -> None:
    proxy, upstream = keyed_rig
    bodies = set()
    for given in ("x", CLIENT_KEYS[0][:1], CLIENT_KEYS[0][:-1], CLIENT_KEYS[0] + "0", "y" * len(CLIENT_KEYS[0]),
                  CLIENT_KEYS[1][:-1] + "1", CLIENT_KEYS[0] * 100):
        response = await send_raw(proxy.port, request_bytes("/keyed/chat/completions",
                                                            headers=[f"X-Slotproxy-Key: {given}".encode()]))
        assert response.status == 403
        bodies.add(response.body)
    assert len(bodies) == 1, bodies
    assert upstream.seen == []


@pytest.mark.parametrize("line", [b"X-Slotproxy-Key: \xff" + CLIENT_KEYS[0].encode(),
                                  b"Authorization: Bearer \xff" + CLIENT_KEYS[0].encode()])
async def test_non_utf8_client_key_gets_403_not_500(keyed_rig, line) -> None:
    proxy, upstream = keyed_rig
    response = await send_raw(proxy.port, request_bytes("/keyed/chat/completions", headers=[line]))
    assert response.status == 403, response
    assert_error(response.body, "forbidden")
    assert upstream.seen == []


async def test_client_keys_env_empty_fails_closed(keyed_rig, client, monkeypatch) -> None:
    """keys_env names a variable that is empty: nobody gets in (not everybody)."""
    proxy, upstream = keyed_rig
    monkeypatch.setenv("SPT_CLIENT_KEYS", " , ")
    proxy.state.apply(proxy.state.config)
    for headers in ({}, {"X-Slotproxy-Key": CLIENT_KEYS[0]}, {"X-Slotproxy-Key": ""}):
        async with client.post(f"{proxy.url}/keyed/chat/completions", json=chat(stream=False),
                               headers=headers) as resp:
            assert resp.status in (401, 403), headers
            assert_error(await resp.read(), "forbidden")
    assert upstream.seen == []
