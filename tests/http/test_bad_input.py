"""The bad-input catalogue (issue 7, part 2): every hostile or malformed input, one table each.

Each row says what is sent and what must come back (status, and the OpenAI-shaped
error code wherever the proxy itself answers), then proves the proxy is still
healthy: a normal request succeeds and ``GET /_slotproxy/status`` shows
``in_flight 0`` / ``queued 0``.

Rows that overlap older tests are repeated here on purpose so the catalogue is
complete in one place; the older tests stay the reference for the behaviour:

- priority-header fallbacks: ``tests/http/test_relay.py::test_invalid_priority_header_falls_back_and_the_request_succeeds``
- unroutable paths and the open-proxy refusal: ``tests/http/test_relay.py::test_unroutable_paths_get_a_clear_error``,
  ``tests/http/test_relay.py::test_never_an_open_proxy``
- max_body: ``tests/http/test_relay.py::test_body_over_max_body_gets_413_and_takes_no_slot``
- admin bodies: ``tests/admin/test_api.py::test_bad_bodies_get_400_with_the_reason``
- YAML: ``tests/config/test_loader.py`` (duplicates, billion laughs, wrong types)

Most HTTP rows go over a raw socket, so the bytes on the wire are exactly the
row's, and the upstream is a catch-all recorder (``Recorder``) that notes every
request it receives, whatever the method or path — "the upstream sees nothing"
is then a real check, not one limited to the model routes the fake upstream counts.
"""

from __future__ import annotations

import asyncio
import json
import re
import textwrap
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from proxy.config import ConfigError, parse_config

from ..conftest import Proxy, chat, wait_until

MAX_BODY = 1024


# --- the rig: a recording upstream, a proxy in front of it, raw-socket helpers -------


@dataclass
class Seen:
    method: str
    raw_path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Recorder:
    """A catch-all upstream that records every request; ``x-hold-ms`` delays its answer."""

    seen: list[Seen] = field(default_factory=list)
    port: int = 0
    runner: web.AppRunner | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append(Seen(request.method, request.raw_path,
                              {k.lower(): v for k, v in request.headers.items()}, body))
        hold = request.headers.get("x-hold-ms")
        if hold:
            await asyncio.sleep(float(hold) / 1000)
        return web.json_response({"object": "chat.completion", "ok": True, "received": len(body)})

    async def start(self) -> None:
        app = web.Application(client_max_size=1 << 24)
        app.router.add_route("*", "/{tail:[\\s\\S]*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Listener:
    """A bare TCP listener on another local port: an open proxy would connect to it."""

    connections: int = 0
    server: asyncio.Server | None = None

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        writer.close()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


@dataclass
class Rig:
    proxy: Proxy
    upstream: Recorder

    @property
    def url(self) -> str:
        return self.proxy.url

    def granted(self) -> int:
        return self.proxy.state.backend.provider_status("openai").counters["granted"]


async def recorder() -> Recorder:
    rec = Recorder()
    await rec.start()
    return rec


def rig_yaml(upstream: Recorder, *, limit: int = 1, extra: str = "") -> str:
    return textwrap.dedent(f"""\
        state: {{path: null}}
        server: {{max_body: {MAX_BODY}}}
        providers:
          openai: {{upstream: '{upstream.url}/v1', limit: {limit}}}
        """) + extra


@pytest.fixture
async def rig(start_proxy) -> AsyncIterator[Rig]:
    upstream = await recorder()
    proxy = await start_proxy(rig_yaml(upstream))
    yield Rig(proxy, upstream)
    assert upstream.runner is not None
    await upstream.runner.cleanup()


@pytest.fixture
async def listener() -> AsyncIterator[Listener]:
    lst = Listener()
    await lst.start()
    yield lst
    await lst.stop()


@dataclass
class RawResponse:
    status: int
    version: str
    headers: dict[str, str]
    body: bytes
    interim: list[int] = field(default_factory=list)

    def json(self) -> Any:
        return json.loads(self.body)


async def read_response(reader: asyncio.StreamReader, timeout: float = 5.0) -> RawResponse:
    """Read one HTTP response: head, then Content-Length bytes, chunks, or until EOF."""
    interim: list[int] = []

    async def read() -> RawResponse:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            assert exc.partial, "the proxy closed the connection without answering"
            raise
        lines = head.decode("latin-1").rstrip("\r\n").split("\r\n")
        version, status = lines[0].split(" ")[:2]
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if 100 <= int(status) < 200:  # an interim answer: the real one follows
            interim.append(int(status))
            return await read()
        if "content-length" in headers:
            body = await reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            body = b""
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                chunk = await reader.readexactly(size + 2)
                if size == 0:
                    break
                body += chunk[:-2]
        else:
            body = await reader.read()
        return RawResponse(int(status), version, headers, body, interim)

    return await asyncio.wait_for(read(), timeout)


async def send_raw(port: int, data: bytes | Sequence[bytes], *, gap: float = 0.0, timeout: float = 5.0) -> RawResponse:
    """Write ``data`` (or its pieces, ``gap`` seconds apart) and read one response."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        pieces = [data] if isinstance(data, bytes) else list(data)
        for i, piece in enumerate(pieces):
            if i and gap:
                await asyncio.sleep(gap)
            if reader.at_eof():
                break
            writer.write(piece)
            try:
                await writer.drain()
            except ConnectionError:
                break
        return await read_response(reader, timeout)
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except ConnectionError:
            pass


def request_bytes(path: str = "/openai/chat/completions", *, method: str = "POST",
                  headers: Sequence[bytes] = (), body: bytes = b'{"model": "fake"}') -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n".encode()
    head += b"".join(h + b"\r\n" for h in headers)
    if body or method == "POST":
        head += f"Content-Length: {len(body)}\r\n".encode()
    return head + b"\r\n" + body


def assert_error(body: bytes | dict[str, Any], code: str) -> str:
    """The OpenAI error shape: ``{"error": {"message", "type": "slotproxy_error", "code"}}``."""
    doc = json.loads(body) if isinstance(body, bytes) else body
    assert set(doc) == {"error"}, doc
    error = doc["error"]
    assert {"message", "type", "code"} <= set(error), error
    assert error["type"] == "slotproxy_error", error
    assert error["code"] == code, error
    assert isinstance(error["message"], str) and error["message"], error
    return error["message"]


async def assert_healthy(rig: Rig, client: aiohttp.ClientSession) -> None:
    """A normal request still succeeds, and status shows nothing held or queued."""
    before = len(rig.upstream.seen)
    async with client.post(f"{rig.url}/openai/chat/completions", json=chat(stream=False)) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["X-Slotproxy-Queue-Ms"].isdigit()
        assert (await resp.json())["ok"] is True
    assert [(s.method, s.raw_path) for s in rig.upstream.seen[before:]] == [("POST", "/v1/chat/completions")]
    await wait_until(lambda: (rig.proxy.status()["in_flight"], rig.proxy.status()["queued"]) == (0, 0),
                     what="in_flight 0 and queued 0")
    async with client.get(f"{rig.url}/_slotproxy/status") as resp:
        (entry,) = (await resp.json())["providers"]
    assert (entry["in_flight"], entry["queued"]) == (0, 0)


def invalid_count(rig: Rig, key: str) -> float:
    text = rig.proxy.state.metrics.render().decode()
    match = re.search(rf'^slotproxy_invalid_priority_headers_total{{header="{key}"}} (\S+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


# --- 1. priority headers: malformed, oversized, non-ASCII --------------------------

HEADER_NAMES = {
    "workspace": "X-Workspace-Id",
    "starred": "X-Workspace-Starred",
    "prompt_started_at": "X-Prompt-Started-At",
    "conversation": "X-Conversation-Id",
}
PRIORITY_NAMES = {name.lower() for name in HEADER_NAMES.values()}

# (header key, raw value bytes, valid?) — an invalid value never fails the request:
# 200, the default is used, and slotproxy_invalid_priority_headers_total{header} counts it.
FALLBACK_ROWS = [
    ("workspace", b"x" * 257, False),
    ("workspace", b"x" * 5000, False),
    ("workspace", b"ws\tinner-tab", False),
    ("workspace", "ws-\u00e9t\u00e9".encode(), False),
    ("workspace", b"ws-\xff\xfe", False),
    ("workspace", "\u0430dmin".encode(), False),  # Cyrillic a: a look-alike of "admin"
    ("workspace", b"release-team", True),
    ("starred", b"maybe", False),
    ("starred", b"2", False),
    ("starred", b"y" * 5000, False),
    ("starred", "yes\u200b".encode(), False),
    ("starred", b"TRUE", True),
    ("prompt_started_at", b"-1700000000000", False),
    ("prompt_started_at", b"0", False),
    ("prompt_started_at", b"1700000000", False),  # seconds, not ms: 1970
    ("prompt_started_at", b"9" * 30, False),
    ("prompt_started_at", b"99999999999999", False),  # far future
    ("prompt_started_at", b"1" * 5000, False),
    ("prompt_started_at", b"1e12", False),
    ("prompt_started_at", b"NaN", False),
    ("prompt_started_at", b"Infinity", False),
    ("prompt_started_at", b"0x18BCFE56800", False),
    ("prompt_started_at", b"1_700_000_000_000", False),
    ("prompt_started_at", b"1700000000000.5", True),  # fractional ms are allowed
    ("prompt_started_at", b"2026-13-01T00:00:00Z", False),
    ("prompt_started_at", b"2026-02-30T00:00:00Z", False),
    ("prompt_started_at", b"2026-01-01T25:00:00Z", False),
    ("prompt_started_at", b"2026-01-01T00:00:00", False),  # no offset
    ("prompt_started_at", b"2026-01-01", False),
    ("prompt_started_at", b"2026-01-01T00:00:00+99:00", False),
    ("prompt_started_at", b"2026-01-01T00:00:00ZZ", False),
    ("prompt_started_at", b"9999-12-31T23:59:59Z", False),
    ("prompt_started_at", b"0001-01-01T00:00:00+14:00", False),
    ("prompt_started_at", b"yesterday", False),
    ("prompt_started_at", b"2026-01-01T00:00:00Z" + b" " * 60 + b"x", False),
    ("prompt_started_at", "\uff12\uff10\uff12\uff16-01-01T00:00:00Z".encode(), False),  # full-width digits
    ("prompt_started_at", b"2024-06-01T12:00:00.5+02:00", True),
    pytest.param(
        "prompt_started_at", "\u0661\u0667\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660".encode(),
        False, id="prompt_started_at-arabic-indic-digits",
    ),
    pytest.param(
        "prompt_started_at", b"2026-W01-1T00:00:00Z", False, id="prompt_started_at-iso-week-date",
    ),
    pytest.param(
        "prompt_started_at", b"20260101T000000Z", False, id="prompt_started_at-iso-basic-format",
    ),
    pytest.param(
        "prompt_started_at", b"2026-01-01T00:00:00+00:00:30", False, id="prompt_started_at-offset-with-seconds",
    ),
    ("conversation", b"c" * 257, False),
    ("conversation", "conv-\u2603".encode(), False),
    ("conversation", b"conv%0d%0aX-Injected:%201", True),  # percent signs are printable: kept verbatim
]


@pytest.mark.parametrize(("key", "value", "valid"), FALLBACK_ROWS)
async def test_priority_header_values_fall_back_and_never_fail_the_request(rig, client, key, value, valid) -> None:
    name = HEADER_NAMES[key].encode()
    before = invalid_count(rig, key)
    response = await send_raw(rig.proxy.port, request_bytes(headers=[name + b": " + value]))
    assert response.status == 200, response.body
    assert response.json()["ok"] is True
    assert invalid_count(rig, key) == (before if valid else before + 1)
    seen = rig.upstream.seen[-1].headers
    assert not PRIORITY_NAMES & set(seen), seen
    await assert_healthy(rig, client)


# Values HTTP itself refuses: aiohttp's parser answers 400 before any handler runs
# (a plain-text body, not the OpenAI shape: the proxy never sees these requests).
PARSER_REJECTED_ROWS = [
    (key, value, why)
    for key in HEADER_NAMES
    for value, why in [
        (b"a\x01b", "control char"),
        (b"a\x00b", "NUL"),
        (b"a\x7fb", "DEL"),
        (b"\x1b[31mred", "ANSI escape"),
        (b"a\x0bb", "vertical tab"),
        (b"1" * 10240, "10 KB value (over aiohttp's 8190-byte field limit)"),
    ]
]


@pytest.mark.parametrize(("key", "value", "why"), PARSER_REJECTED_ROWS,
                         ids=[f"{k}-{w.split(' ')[0]}" for k, _, w in PARSER_REJECTED_ROWS])
async def test_priority_header_values_http_refuses_get_400(rig, client, key, value, why) -> None:
    granted = rig.granted()
    response = await send_raw(rig.proxy.port, request_bytes(headers=[HEADER_NAMES[key].encode() + b": " + value]))
    assert response.status == 400, (why, response)
    assert rig.upstream.seen == [] and rig.granted() == granted
    await assert_healthy(rig, client)


# --- 2. absolute-form targets and CONNECT: never an open proxy -----------------------

OPEN_PROXY_ROWS = [
    # (request line template, status, code); {other} is a local listener's port, {proxy} the proxy's
    ("GET http://127.0.0.1:{other}/v1/models HTTP/1.1", 400, "bad_request"),
    ("POST http://127.0.0.1:{other}/openai/chat/completions HTTP/1.1", 400, "bad_request"),
    ("GET http://127.0.0.1:{proxy}/openai/models HTTP/1.1", 400, "bad_request"),
    ("POST http://127.0.0.1:{proxy}/openai/chat/completions HTTP/1.1", 400, "bad_request"),
    ("GET https://127.0.0.1:{other}/ HTTP/1.1", 400, "bad_request"),
    ("GET http://user:pw@127.0.0.1:{other}/x HTTP/1.1", 400, "bad_request"),
    ("OPTIONS * HTTP/1.1", 400, "bad_request"),
    ("CONNECT 127.0.0.1:{other} HTTP/1.1", 405, "bad_request"),
    ("CONNECT 127.0.0.1:{proxy} HTTP/1.1", 405, "bad_request"),
    ("CONNECT /openai/chat/completions HTTP/1.1", 405, "bad_request"),
    ("GET 127.0.0.1:{other} HTTP/1.1", 400, None),  # authority-form with GET: aiohttp's parser refuses it
]


@pytest.mark.parametrize(("line", "status", "code"), OPEN_PROXY_ROWS)
async def test_never_an_open_proxy(rig, client, listener, line, status, code) -> None:
    other = listener.server.sockets[0].getsockname()[1]
    request_line = line.format(other=other, proxy=rig.proxy.port)
    data = f"{request_line}\r\nHost: 127.0.0.1:{other}\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}".encode()
    response = await send_raw(rig.proxy.port, data)
    assert response.status == status, response
    if code:
        assert_error(response.body, code)
    await asyncio.sleep(0.05)
    assert listener.connections == 0
    assert rig.upstream.seen == []
    await assert_healthy(rig, client)


async def test_host_header_pointing_elsewhere_still_goes_to_the_configured_upstream(rig, client, listener) -> None:
    other = listener.server.sockets[0].getsockname()[1]
    data = (f"POST /openai/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{other}\r\n"
            f"X-Forwarded-Host: 127.0.0.1:{other}\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}").encode()
    response = await send_raw(rig.proxy.port, data)
    assert response.status == 200
    assert listener.connections == 0
    (seen,) = rig.upstream.seen
    assert seen.headers["host"] == f"127.0.0.1:{rig.upstream.port}"
    await assert_healthy(rig, client)


# --- 3. paths: traversal in the provider segment, unknown and reserved providers -----

# (raw path, status, code, what the upstream must see: None = nothing, else the exact raw path)
PATH_ROWS = [
    ("/..%2f..", 404, "unknown_provider", None),
    ("/..%2f..%2fetc%2fpasswd", 404, "unknown_provider", None),
    ("/%2e%2e/", 404, "unknown_provider", None),
    ("/%2e%2e/openai/chat/completions", 404, "unknown_provider", None),
    ("/%2E%2E%2Fopenai/chat/completions", 404, "unknown_provider", None),
    ("/openai%2fchat/completions", 404, "unknown_provider", None),
    ("/openai%2F..%2F..%2Fsecret", 404, "unknown_provider", None),
    ("/openai/..%2f..%2fsecret", 400, "bad_request", None),
    ("/openai/%2e%2e/%2e%2e/secret", 400, "bad_request", None),
    ("/openai/%2e%2e%2fsecret", 400, "bad_request", None),
    ("/openai/chat/../../secret", 400, "bad_request", None),
    ("/openai/./chat/completions", 400, "bad_request", None),
    ("/openai/chat/%2e/completions", 400, "bad_request", None),
    # Encoded once more, an upstream (or a proxy behind it) that decodes twice sees dot segments: refused.
    ("/openai/%252e%252e/secret", 400, "bad_request", None),
    ("/openai/%252e%252e%252fsecret", 400, "bad_request", None),
    ("/openai/chat%2fcompletions", 200, None, "/v1/chat%2fcompletions"),
    ("/openai//etc/passwd", 200, None, "/v1//etc/passwd"),
    ("/openai", 200, None, "/v1"),
    pytest.param(
        "/openai/chat%0d%0aX-Injected:%201", 200, None, "/v1/chat%0d%0aX-Injected:%201",
        id="encoded-crlf-in-rest",
    ),
    ("/nope/chat/completions", 404, "unknown_provider", None),
    ("/OPENAI/chat/completions", 404, "unknown_provider", None),
    ("/openai.evil/chat/completions", 404, "unknown_provider", None),
    ("/%6fpenai/chat/completions", 404, "unknown_provider", None),  # the first segment is matched as written
    ("/_slotproxy/x", 404, "unknown_provider", None),
    ("/_slotproxy/providers/openai/limit/x", 404, "unknown_provider", None),
    ("/_anything/x", 404, "unknown_provider", None),
    ("/metrics/x", 404, "unknown_provider", None),
    ("/healthz/x", 404, "unknown_provider", None),
    ("/readyz/x", 404, "unknown_provider", None),
]


@pytest.mark.parametrize(("path", "status", "code", "upstream_path"), PATH_ROWS)
async def test_paths(rig, client, path, status, code, upstream_path) -> None:
    response = await send_raw(rig.proxy.port, request_bytes(path))
    assert response.status == status, response
    if code:
        assert_error(response.body, code)
    if upstream_path is None:
        assert rig.upstream.seen == []
    else:
        (seen,) = rig.upstream.seen
        assert seen.raw_path == upstream_path
        assert "x-injected" not in seen.headers
    await assert_healthy(rig, client)


QUERY_ROWS = [
    "limit=5&after=abc",
    "api-version=2024-02-01",
    "q=a%26b%3Dc",
    "x=%0d%0aX-Injected:%201",
    "x=1%20HTTP/1.1%0d%0aHost:%20evil%0d%0a%0d%0aGET%20/admin",
    "q=a+b",
    "q=a%2Bb",
    "q=%23fragment&next=1",
    "q=caf%C3%A9",
]


@pytest.mark.parametrize(
    "query",
    [pytest.param(q, id=q) for q in QUERY_ROWS],
)
async def test_query_string_reaches_upstream_byte_for_byte(rig, client, query) -> None:
    """SPEC: the query string is kept. Encoded bytes must stay encoded, so nothing can break the request line."""
    response = await send_raw(rig.proxy.port, request_bytes(f"/openai/chat/completions?{query}"))
    assert response.status == 200, response
    (seen,) = rig.upstream.seen
    assert "x-injected" not in seen.headers and "host" in seen.headers
    assert seen.raw_path == f"/v1/chat/completions?{query}"
    await assert_healthy(rig, client)


# --- 4. bodies over server.max_body: 413, no slot, nothing upstream -------------------

CHUNK = b"x" * 256
BODY_ROWS = [
    # (id, pieces to send; 413 expected unless the row says 200)
    ("content-length-over", [b"Content-Length: 1025\r\n\r\n" + b"x" * 1025], 413),
    ("content-length-huge-body-never-sent", [b"Content-Length: 10000000000\r\n\r\n"], 413),
    ("content-length-over-body-never-sent", [b"Content-Length: 5000\r\n\r\n"], 413),
    pytest.param(
        [b"Content-Length: 5000\r\nExpect: 100-continue\r\n\r\n"], 413, id="expect-100-continue-over",
    ),
    ("chunked-over", [b"Transfer-Encoding: chunked\r\n\r\n" + (b"100\r\n" + CHUNK + b"\r\n") * 5 + b"0\r\n\r\n"], 413),
    ("chunked-over-one-byte-chunks", [b"Transfer-Encoding: chunked\r\n\r\n" + b"1\r\nx\r\n" * 1100 + b"0\r\n\r\n"], 413),
    ("chunked-over-never-finished", [b"Transfer-Encoding: chunked\r\n\r\n" + (b"100\r\n" + CHUNK + b"\r\n") * 5], 413),
    ("content-length-exactly-max", [b"Content-Length: 1024\r\n\r\n" + b"x" * 1024], 200),
    ("chunked-exactly-max", [b"Transfer-Encoding: chunked\r\n\r\n" + (b"100\r\n" + CHUNK + b"\r\n") * 4 + b"0\r\n\r\n"], 200),
]


@pytest.mark.parametrize(("pieces", "status"),
                         [r if hasattr(r, "marks") else pytest.param(r[1], r[2], id=r[0]) for r in BODY_ROWS])
async def test_bodies_over_max_body(rig, client, pieces, status) -> None:
    granted = rig.granted()
    head = b"POST /openai/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    started = time.monotonic()
    response = await send_raw(rig.proxy.port, [head + pieces[0], *pieces[1:]], timeout=3)
    assert time.monotonic() - started < 2, "the 413 must not wait for a body that never comes"
    assert response.status == status, response
    if status == 413:
        message = assert_error(response.body, "body_too_large")
        assert response.interim == [], "no 100 Continue for a body that will be refused"
        assert str(MAX_BODY) in message
        assert rig.upstream.seen == []
        assert rig.granted() == granted
    else:
        (seen,) = rig.upstream.seen
        assert len(seen.body) == MAX_BODY
        assert rig.granted() == granted + 1
    await assert_healthy(rig, client)


# --- 5. a slow client never holds a slot while its body trickles in -------------------


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_slow_body_holds_no_slot_while_others_use_it(rig, client, framing) -> None:
    """limit 1; one byte every 50 ms for ~1 s; meanwhile other requests take the slot and finish."""
    size, gap = 20, 0.05
    if framing == "content-length":
        head = f"Content-Length: {size}\r\n\r\n".encode()
        pieces = [b"y"] * size
    else:
        head = b"Transfer-Encoding: chunked\r\n\r\n"
        pieces = [b"1\r\ny\r\n"] * size + [b"0\r\n\r\n"]
    granted = rig.granted()
    body_sent = asyncio.Event()

    async def slow_client() -> RawResponse:
        reader, writer = await asyncio.open_connection("127.0.0.1", rig.proxy.port)
        writer.write(b"POST /openai/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nx-slow: 1\r\n"
                     b"Connection: close\r\n" + head)
        for piece in pieces:
            await asyncio.sleep(gap)
            writer.write(piece)
            await writer.drain()
        body_sent.set()
        try:
            return await read_response(reader)
        finally:
            writer.close()
            await writer.wait_closed()

    slow = asyncio.create_task(slow_client())
    started = time.monotonic()
    waits: list[int] = []
    while not body_sent.is_set():
        # Each of these holds the only slot for 100 ms; none could start if the slow
        # client had been granted the slot before its body was complete.
        async with client.post(f"{rig.url}/openai/chat/completions", json=chat(stream=False),
                               headers={"x-hold-ms": "100"}) as resp:
            assert resp.status == 200
            waits.append(int(resp.headers["X-Slotproxy-Queue-Ms"]))
            await resp.read()
        if not body_sent.is_set():
            assert rig.granted() - granted == len(waits), "the slow client got a slot before its body was in"
    response = await slow
    assert time.monotonic() - started >= size * gap * 0.9
    assert response.status == 200
    assert len(waits) >= 4, waits
    assert max(waits[:-1]) < 50, waits  # none queued behind the slow client
    assert [s.body for s in rig.upstream.seen if "x-slow" in s.headers] == [b"y" * size]
    assert rig.granted() == granted + len(waits) + 1
    await assert_healthy(rig, client)


async def test_a_client_that_stops_mid_body_and_leaves_holds_nothing(rig, client) -> None:
    _reader, writer = await asyncio.open_connection("127.0.0.1", rig.proxy.port)
    writer.write(b"POST /openai/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"z" * 10)
    await writer.drain()
    await asyncio.sleep(0.1)
    assert rig.proxy.status()["in_flight"] == 0 and rig.proxy.status()["queued"] == 0
    await assert_healthy(rig, client)
    writer.close()
    await writer.wait_closed()
    await asyncio.sleep(0.05)
    assert all(s.body != b"z" * 10 for s in rig.upstream.seen)
    await assert_healthy(rig, client)


# --- 6. header injection via CR/LF, and request smuggling ----------------------------

RAW_HEADER_ROWS = [
    (b"X-Custom: a\rX-Injected: 1", "bare CR in a value"),
    (b"X-Workspace-Id: a\rX-Injected: 1", "bare CR in a priority value"),
    (b"X-Custom: a\nX-Injected: 1", "bare LF ends a line"),
    (b"X-Conversation-Id: c\nX-Injected: 1", "bare LF in a priority value"),
    (b"X-Custom: a\r\n X-Injected: 1", "obs-fold continuation"),
    (b"X-Workspace-Id: a\r\n\tX-Injected: 1", "obs-fold in a priority value"),
    (b"X-Custom: a\x00X-Injected: 1", "NUL"),
    (b"X-Custom : a", "space before the colon"),
    (b"X-Cus\rtom: a", "CR in a name"),
    (b"Content-Length: 2\r\nTransfer-Encoding: chunked", "CL and TE together (smuggling)"),
    (b"Content-Length: 2\r\nContent-Length: 3", "two different Content-Lengths"),
    (b"Transfer-Encoding: chunked, identity", "TE not ending in chunked"),
]


@pytest.mark.parametrize(("line", "why"), RAW_HEADER_ROWS, ids=[w for _, w in RAW_HEADER_ROWS])
async def test_crlf_injection_and_smuggling_are_refused_with_400(rig, client, line, why) -> None:
    data = (b"POST /openai/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" + line
            + b"\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
    if b"Content-Length" in line or b"Transfer-Encoding" in line:
        data = b"POST /openai/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" + line + b"\r\nConnection: close\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
    response = await send_raw(rig.proxy.port, data)
    assert response.status in (400, 501), (why, response)
    assert rig.upstream.seen == []
    await assert_healthy(rig, client)


# Values that are legal HTTP but would become a header break if anything decoded them
# on the way up: the upstream must never see an ``x-injected`` header.
INJECTION_VALUE_ROWS = [
    (b"X-Workspace-Id", b"ws%0d%0aX-Injected:%201"),
    (b"X-Conversation-Id", b"c%0D%0AX-Injected: 1"),
    (b"X-Prompt-Started-At", b"1700000000000%0d%0aX-Injected: 1"),
    (b"X-Workspace-Starred", b"1\\r\\nX-Injected: 1"),
    (b"X-Workspace-Id", "ws\u2028X-Injected: 1".encode()),  # Unicode line separator
    (b"X-Conversation-Id", "c\u0085X-Injected: 1".encode()),  # NEL
    (b"X-Custom", b"a%0d%0aX-Injected:%201"),
    (b"X-Custom", "a\u2028X-Injected: 1".encode()),
    (b"X-Custom", "a\u0085X-Injected: 1".encode()),
]


@pytest.mark.parametrize(("name", "value"), INJECTION_VALUE_ROWS)
async def test_header_values_never_inject_a_header_upstream(rig, client, name, value) -> None:
    response = await send_raw(rig.proxy.port, request_bytes(headers=[name + b": " + value]))
    assert response.status == 200, response
    (seen,) = rig.upstream.seen
    assert "x-injected" not in seen.headers, seen.headers
    assert not PRIORITY_NAMES & set(seen.headers)
    if name == b"X-Custom":
        assert seen.headers["x-custom"].encode() == value  # relayed verbatim, still one header
    await assert_healthy(rig, client)


async def test_injection_attempts_in_priority_headers_never_reach_the_fake_upstream(start_upstream, start_proxy) -> None:
    """The same rows against the real fake provider, checked through its own ``last_headers``."""
    upstream = await start_upstream(chunks=1, delay_ms=1)
    proxy = await start_proxy(f"state: {{path: null}}\nproviders:\n  openai: {{upstream: '{upstream.url}/v1', limit: 1}}\n")
    lines = [name + b": " + value for name, value in INJECTION_VALUE_ROWS if name != b"X-Custom"]
    response = await send_raw(proxy.port, request_bytes(headers=lines, body=json.dumps(chat(stream=False)).encode()))
    assert response.status == 200
    last = upstream.fake.stats()["last_headers"]
    assert "x-injected" not in last and not PRIORITY_NAMES & set(last), last
    await wait_until(lambda: (proxy.status()["in_flight"], proxy.status()["queued"]) == (0, 0))


async def test_non_utf8_header_bytes_are_not_silently_altered(rig, client) -> None:
    response = await send_raw(rig.proxy.port, request_bytes(headers=[b"X-Custom: caf\xe9"]))
    if response.status == 200:
        (seen,) = rig.upstream.seen
        assert seen.headers["x-custom"].encode("utf-8", "surrogateescape") == b"caf\xe9"
    else:
        assert response.status == 400
        assert_error(response.body, "bad_request")
        assert rig.upstream.seen == []
    await assert_healthy(rig, client)


# --- 7. admin API: wrong types, negative or huge limits, unknown ids -----------------

ADMIN_ROWS = [
    # (method, encoded path under /_slotproxy/, body, status, code, words in the message)
    ("PUT", "providers/openai/limit", b"not json", 400, "bad_request", "not valid JSON"),
    ("PUT", "providers/openai/limit", b"", 400, "bad_request", "JSON object"),
    ("PUT", "providers/openai/limit", b"null", 400, "bad_request", "JSON object"),
    ("PUT", "providers/openai/limit", b"5", 400, "bad_request", "JSON object"),
    ("PUT", "providers/openai/limit", b'"5"', 400, "bad_request", "JSON object"),
    ("PUT", "providers/openai/limit", b"[5]", 400, "bad_request", "JSON object"),
    ("PUT", "providers/openai/limit", b"{}", 400, "bad_request", '{"limit"'),
    ("PUT", "providers/openai/limit", b'{"limit": 2, "extra": 1}', 400, "bad_request", '{"limit"'),
    ("PUT", "providers/openai/limit", b'{"limit": "6"}', 400, "bad_request", "positive integer or null"),
    ("PUT", "providers/openai/limit", b'{"limit": [6]}', 400, "bad_request", "positive integer or null"),
    ("PUT", "providers/openai/limit", b'{"limit": {"n": 6}}', 400, "bad_request", "positive integer or null"),
    ("PUT", "providers/openai/limit", b'{"limit": true}', 400, "bad_request", "positive integer or null"),
    ("PUT", "providers/openai/limit", b'{"limit": 1.5}', 400, "bad_request", "positive integer or null"),
    ("PUT", "providers/openai/limit", b'{"limit": 2.0}', 400, "bad_request", "positive integer or null"),
    ("PUT", "providers/openai/limit", b'{"limit": 0}', 400, "bad_request", "positive integer or null"),
    ("PUT", "providers/openai/limit", b'{"limit": -1}', 400, "bad_request", "positive integer or null"),
    ("PUT", "providers/openai/limit", b'{"limit": -99999999999999999999}', 400, "bad_request", "positive integer"),
    ("PUT", "providers/openai/limit", b'{"limit": 100001}', 400, "bad_request", "at most"),
    ("PUT", "providers/openai/limit", b'{"limit": 10000000000000000000000}', 400, "bad_request", "at most"),
    ("PUT", "providers/openai/limit", b'{"limit": 1e400}', 400, "bad_request", "positive integer or null"),
    ("PUT", "providers/openai/limit", b'{"limit": NaN}', 400, "bad_request", "positive integer or null"),
    ("PUT", "providers/openai/limit", b'{"limit": -Infinity}', 400, "bad_request", "positive integer or null"),
    ("PUT", "providers/openai/limit", b'{"limit": ' + b"9" * 4000 + b"}", 400, "bad_request", "at most"),
    ("PUT", "providers/openai/limit", b'{"limit": 2, "pad": "' + b"x" * 5000 + b'"}', 400, "bad_request", "body over"),
    ("PUT", "providers/openai/limit", b'{"limit": "\xff\xfe"}', 400, "bad_request", "not valid JSON"),
    ("PUT", "providers/openai/limit", b"[" * 3000 + b"]" * 3000, 400, "bad_request", ""),
    ("PUT", "providers/openai/cooldown", b'{"cooldown_ms": -5}', 400, "bad_request", "between 0 and"),
    ("PUT", "providers/openai/cooldown", b'{"cooldown_ms": "1s"}', 400, "bad_request", "cooldown_ms"),
    ("PUT", "providers/openai/cooldown", b'{"cooldown_ms": null}', 400, "bad_request", "cooldown_ms"),
    ("PUT", "providers/openai/cooldown", b'{"cooldown_ms": true}', 400, "bad_request", "cooldown_ms"),
    ("PUT", "providers/openai/cooldown", b'{"cooldown_ms": 1e308}', 400, "bad_request", "between 0 and"),
    ("PUT", "providers/openai/cooldown", b'{"cooldown_ms": NaN}', 400, "bad_request", "between 0 and"),
    ("PUT", "providers/openai/cooldown", b'{"cooldown_ms": Infinity}', 400, "bad_request", "between 0 and"),
    ("PUT", "providers/openai/cooldown", b'{"cooldown_ms": 3600001}', 400, "bad_request", "between 0 and"),
    ("PUT", "providers/nope/limit", b'{"limit": 2}', 404, "unknown_provider", "nope"),
    ("PUT", "providers/nope/cooldown", b'{"cooldown_ms": 5}', 404, "unknown_provider", "nope"),
    ("PUT", "providers/OPENAI/limit", b'{"limit": 2}', 404, "unknown_provider", ""),
    ("PUT", "providers/%01/limit", b'{"limit": 2}', 404, "unknown_provider", ""),
    ("PUT", "providers/..%2f..%2fopenai/limit", b'{"limit": 2}', 400, "bad_request", "dot segments"),
    ("PUT", "providers/_slotproxy/limit", b'{"limit": 2}', 404, "unknown_provider", ""),
    ("PUT", "workspaces/" + "w" * 257 + "/star", b"", 400, "bad_request", "not a valid workspace id"),
    ("PUT", "workspaces/" + "w" * 5000 + "/star", b"", 400, "bad_request", "not a valid workspace id"),
    ("PUT", "workspaces/a%01b/star", b"", 400, "bad_request", "not a valid workspace id"),
    ("PUT", "workspaces/a%7Fb/star", b"", 400, "bad_request", "not a valid workspace id"),
    ("PUT", "workspaces/a%0D%0AX-Injected:%201/star", b"", 400, "bad_request", "not a valid workspace id"),
    ("PUT", "workspaces/%20lead/star", b"", 400, "bad_request", "not a valid workspace id"),
    ("PUT", "workspaces/%C3%A9t%C3%A9/star", b"", 400, "bad_request", "not a valid workspace id"),
    ("PUT", "workspaces/a%09b/star", b"", 400, "bad_request", "not a valid workspace id"),
    ("DELETE", "workspaces/never-starred/star", b"", 404, "unknown_provider", "not starred"),
    ("DELETE", "workspaces/a%01b/star", b"", 400, "bad_request", "not a valid workspace id"),
]


@pytest.mark.parametrize(("method", "path", "body", "status", "code", "words"), ADMIN_ROWS,
                         ids=[f"{m}-{p[:40]}-{b[:24]!r}" for m, p, b, *_ in ADMIN_ROWS])
async def test_admin_api_bad_input(rig, client, method, path, body, status, code, words) -> None:
    url = URL(f"{rig.url}/_slotproxy/{path}", encoded=True)
    async with client.request(method, url, data=body, headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == status, await resp.text()
        message = assert_error(await resp.read(), code)
    assert words in message
    status_now = rig.proxy.status()
    assert (status_now["limit"], status_now["configured_limit"], status_now["cooldown_ms"]) == (1, 1, 0)
    assert rig.proxy.state.backend.starred() == frozenset()
    await assert_healthy(rig, client)


# --- 8. YAML: duplicate keys, alias bombs, wrong types -------------------------------


def _bomb(levels: int = 9, fan: int = 9) -> str:
    lines = ['l0: &l0 [' + ", ".join(['"lol"'] * fan) + "]"]
    for i in range(1, levels + 1):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * fan) + "]")
    return "\n".join(lines) + "\n"


def _mapping_bomb() -> str:
    lines = ["m0: &m0 {" + ", ".join(f"k{j}: v" for j in range(10)) + "}"]
    for i in range(1, 9):
        lines.append(f"m{i}: &m{i} {{" + ", ".join(f"k{j}: *m{i - 1}" for j in range(10)) + "}")
    return "\n".join(lines) + "\n"


def _merge_bomb() -> str:
    lines = ["a0: &a0 {" + ", ".join(f"k{j}: [1, 2, 3, 4, 5, 6, 7, 8, 9]" for j in range(10)) + "}"]
    for i in range(1, 9):
        lines.append(f"a{i}: &a{i}\n  <<: *a{i - 1}\n  x: [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    return "\n".join(lines) + "\n"


def _wide_bomb() -> str:
    return "x: &x [" + ", ".join(["1"] * 1000) + "]\ny: [" + ", ".join(["*x"] * 1000) + "]\n"


BOMB = "YAML aliases expand to more than 100000 nodes (an alias bomb?)"
YAML_ROWS = [
    # (id, text, a problem that must be reported; '^' prefix = startswith)
    ("dup-top-level", "server: {port: 1}\nserver: {port: 2}\n", "duplicate key 'server' (line 2)"),
    ("dup-flow", "server: {port: 1, port: 2}\n", "server: duplicate key 'port' (line 1)"),
    ("dup-provider", "providers:\n  openai: {upstream: 'http://x'}\n  openai: {upstream: 'http://y'}\n",
     "providers: duplicate key 'openai' (line 3)"),
    ("dup-nested", "providers:\n  openai:\n    upstream: http://x\n    limit: 2\n    limit: 3\n",
     "providers.openai: duplicate key 'limit' (line 5)"),
    ("dup-quoted", "server: {port: 1}\n'server': {port: 2}\n", "duplicate key 'server' (line 2)"),
    ("billion-laughs", _bomb(), BOMB),
    ("billion-laughs-deeper", _bomb(levels=12, fan=10), BOMB),
    ("mapping-bomb", _mapping_bomb(), BOMB),
    ("merge-key-bomb", _merge_bomb(), BOMB),
    ("wide-fan-out", _wide_bomb(), BOMB),
    ("recursive-alias", "a: &a [*a]\n", "^invalid YAML: alias *a refers to a node that contains it"),
    # Refused only when Python's recursion limit stops the composer; until then PyYAML's pure-Python
    # scanner is quadratic in flow depth: ~0.7 s on a quiet machine whatever the depth, 2.5 s under
    # load. Correct but slow, so this row only guards against a hang (5 s); see the report.
    ("deeply-nested", "a: " + "[" * 20000 + "]" * 20000 + "\n", "YAML nests deeper than 64 levels"),
    ("python-tag", "x: !!python/object/apply:os.system ['true']\n", "^invalid YAML: could not determine a constructor"),
    ("top-level-list", "- a\n- b\n", "^the top level must be a mapping"),
    ("providers-list", "providers: [openai]\n", "providers: must be a mapping (line 1)"),
    ("provider-scalar", "providers: {openai: 'http://x'}\n", "providers.openai: must be a mapping (line 1)"),
    ("server-list", "server: [a]\n", "server: must be a mapping (line 1)"),
    ("port-string", "server: {port: abc}\n", "^server.port: must be a port number"),
    ("port-huge", "server: {port: 70000}\n", "^server.port: must be a port number"),
    ("max-body-negative", "server: {max_body: -1}\n", "server.max_body: must not be negative (line 1)"),
    ("max-body-word", "server: {max_body: lots}\n", "^server.max_body: must be a size"),
    ("limit-string", "providers:\n  openai: {upstream: 'http://x', limit: '8'}\n",
     "providers.openai.limit: must be a positive integer or null (line 2)"),
    ("limit-bool", "providers:\n  openai: {upstream: 'http://x', limit: true}\n",
     "providers.openai.limit: must be a positive integer or null (line 2)"),
    ("limit-float", "providers:\n  openai: {upstream: 'http://x', limit: 2.5}\n",
     "providers.openai.limit: must be a positive integer or null (line 2)"),
    ("limit-negative", "providers:\n  openai: {upstream: 'http://x', limit: -3}\n",
     "providers.openai.limit: must be a positive integer or null (line 2)"),
    pytest.param(
        "providers:\n  openai: {upstream: 'http://x', limit: 10000000000000000000000}\n",
        "^providers.openai.limit:", id="limit-huge",
    ),
    ("upstream-int", "providers:\n  openai: {upstream: 5}\n", "providers.openai.upstream: must be a string (line 2)"),
    ("upstream-scheme", "providers:\n  openai: {upstream: 'file:///etc/passwd'}\n",
     "^providers.openai.upstream: must be an http:// or https:// URL"),
    ("upstream-credentials", "providers:\n  openai: {upstream: 'http://u:p@x/v1'}\n",
     "^providers.openai.upstream: must not contain credentials"),
    ("slot-methods-string", "defaults: {slot_methods: POST}\n", "defaults.slot_methods: must be a list (line 1)"),
    ("duration-word", "defaults: {slot_timeout: 5 minutes}\n", "^defaults.slot_timeout: must be a duration"),
    ("duration-nan", "defaults: {release_cooldown: .nan}\n", "^defaults.release_cooldown: must be a duration"),
    ("duration-inf", "defaults: {slot_timeout: .inf}\n", "^defaults.slot_timeout: must be a duration"),
    ("duration-negative", "defaults: {release_cooldown: -1s}\n", "defaults.release_cooldown: must not be negative (line 1)"),
    ("starred-string", "workspaces: {starred: release-team}\n", "workspaces.starred: must be a list (line 1)"),
    ("starred-nested", "workspaces: {starred: [[a]]}\n", "workspaces.starred[0]: must be a string (line 1)"),
    ("header-int", "headers: {workspace: 5}\n", "headers.workspace: must be a string (line 1)"),
    ("header-crlf", 'headers: {workspace: "X-A\\r\\nX-B"}\n', "^headers.workspace: must be an HTTP header name"),
    ("allow-unauth-string", "admin: {allow_unauthenticated: 'yes please'}\n",
     "admin.allow_unauthenticated: must be true or false (line 1)"),
    ("token-env-is-a-value", "admin: {token_env: 'sk-live-abcdef0123456789'}\n",
     "^admin.token_env: must be the NAME of an environment variable"),
    ("keys-env-is-a-value", "access: {keys_env: 'key1,key2'}\n",
     "^access.keys_env: must be the NAME of an environment variable"),
    ("backend-kind", "backend: {kind: etcd}\n", "backend.kind: must be 'memory' or 'redis' (line 1)"),
    ("reserved-provider", "providers:\n  metrics: {upstream: 'http://x'}\n", "^providers.metrics: reserved"),
    ("traversal-provider-id", "providers:\n  '..': {upstream: 'http://x'}\n", "^providers...: a provider id must"),
    ("slash-provider-id", "providers:\n  'a/b': {upstream: 'http://x'}\n", "^providers.a/b: a provider id must"),
]


def _yaml_param(row: Any) -> Any:
    return row if hasattr(row, "marks") else pytest.param(row[1], row[2], id=row[0])


@pytest.mark.parametrize(("text", "problem"), [_yaml_param(r) for r in YAML_ROWS])
def test_yaml_bad_input_raises_config_error_with_the_key_path(text: str, problem: str) -> None:
    started = time.perf_counter()
    with pytest.raises(ConfigError) as exc:
        parse_config(text)
    elapsed = time.perf_counter() - started
    assert elapsed < 1.0, f"took {elapsed:.2f}s"
    problems = exc.value.problems
    if problem.startswith("^"):
        assert any(p.startswith(problem[1:]) for p in problems), problems
    else:
        assert problem in problems, problems
