"""Client connections (part two, "Safe beside a browser"): slow and greedy clients, an upstream that
never answers, and parser errors, end to end over real sockets on 127.0.0.1.

- a client that trickles its headers is closed at ``server.header_timeout``, one that stalls its
  body gets 408 ``request_timeout`` at ``server.body_timeout``; neither reaches the upstream;
- a client that stops reading a stream is cut off at ``server.write_timeout`` and its slot goes to
  the next request at once, long before ``slot_timeout``;
- more idle connections than file descriptors (``ulimit -n 1024``, a real ``serve`` process) and
  ``server.max_connections``: the proxy keeps serving, evicts idle connections, refuses with 503
  ``too_many_connections`` only when all are busy, and logs each kind of refusal once a second;
- an upstream that answers ``100 Continue`` (once, or again and again) and nothing more is a
  504 at ``idle_timeout``;
- a request the HTTP parser refuses gets 400 ``bad_request`` that quotes none of its bytes and
  names no server software.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import aiohttp
import pytest
from aiohttp import web

from proxy.config import parse_config
from proxy.http.connections import ConnectionGuard, ConnectionSettings, connection_cap
from proxy.http.runtime import ProxyState
from proxy.server.app import start_server

from ..conftest import Proxy, chat, serve_app, wait_until
from ..ports import free_port
from ..system.test_security import REPO, stop, wait_healthy
from .test_bad_input import (
    RawResponse,
    Recorder,
    assert_error,
    read_response,
    recorder,
    request_bytes,
    send_raw,
)

CHUNK = b"data: " + b"x" * (64 * 1024 - 8) + b"\n\n"
CHAT = json.dumps(chat()).encode()
T = TypeVar("T")


def proxy_yaml(upstream_url: str, *, server: str = "", provider: str = "") -> str:
    extra = f", {provider}" if provider else ""
    return (f"state: {{path: null}}\nserver: {{{server}}}\n"
            f"providers:\n  openai: {{upstream: '{upstream_url}/v1'{extra}}}\n")


def in_flight_and_queued(proxy: Proxy) -> tuple[int, int]:
    status = proxy.status()
    return status["in_flight"], status["queued"]


@dataclass
class Streamer:
    """An upstream of our own: ``/v1/forever`` streams 64 KiB events until the reader goes away;
    ``/v1/chat/completions`` waits for ``release``, then streams a short answer."""

    release: asyncio.Event = field(default_factory=asyncio.Event)
    arrived: int = 0
    url: str = ""

    async def forever(self, request: web.Request) -> web.StreamResponse:
        self.arrived += 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            while True:
                await response.write(CHUNK)
        except ConnectionError:
            return response

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.arrived += 1
        await request.read()
        await self.release.wait()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": []}\n\ndata: [DONE]\n\n')
        await response.write_eof()
        return response


@pytest.fixture
async def streamer() -> AsyncIterator[Streamer]:
    upstream = Streamer()
    app = web.Application()
    app.router.add_post("/v1/forever", upstream.forever)
    app.router.add_post("/v1/chat/completions", upstream.chat)
    runner, port = await serve_app(app)
    upstream.url = f"http://127.0.0.1:{port}"
    yield upstream
    await runner.cleanup()


@pytest.fixture
async def rec() -> AsyncIterator[Recorder]:
    upstream = await recorder()
    yield upstream
    assert upstream.runner is not None
    await upstream.runner.cleanup()


async def trickle_until_closed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rest: bytes,
                               gap: float = 0.1) -> bytes:
    """Send ``rest`` one byte per ``gap`` until the proxy closes; what it sent before closing."""
    received = b""
    for byte in rest:
        try:
            data = await asyncio.wait_for(reader.read(4096), gap)
        except TimeoutError:
            writer.write(bytes([byte]))
            continue
        except ConnectionResetError:
            return received
        if not data:
            return received
        received += data
    raise AssertionError(f"the connection was still open after {len(rest) * gap:g}s of trickling")


async def closed_soon(reader: asyncio.StreamReader, timeout: float = 3.0) -> bool:
    """True when the proxy closes the connection (EOF or reset) within ``timeout``, reading whatever is left."""
    try:
        async with asyncio.timeout(timeout):
            while await reader.read(1 << 16):
                pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


async def close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await writer.wait_closed()
    except ConnectionError:
        pass


# --- slow clients: headers, body, reading ----------------------------------------------


async def test_headers_trickled_a_byte_at_a_time_are_cut_off_at_header_timeout(start_proxy, rec) -> None:
    proxy = await start_proxy(proxy_yaml(rec.url, server="header_timeout: 500ms"))
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    started = loop.time()
    writer.write(b"POST /openai/chat/completions HTTP/1.1\r\nHo")
    try:
        answer = await trickle_until_closed(reader, writer, b"st: 127.0.0.1\r\nX-Slow: " + b"a" * 60)
    finally:
        await close(writer)
    elapsed = loop.time() - started
    assert answer == b""
    assert 0.4 <= elapsed <= 2.0, elapsed
    assert rec.seen == []
    assert proxy.state.connections.open_count == 0


async def test_a_stalled_body_gets_408_at_body_timeout_and_the_connection_closes(start_proxy, rec) -> None:
    proxy = await start_proxy(proxy_yaml(rec.url, server="body_timeout: 500ms"))
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    started = loop.time()
    writer.write(b"POST /openai/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n" + CHAT[:10])
    try:
        response = await read_response(reader, timeout=5)
        elapsed = loop.time() - started
        assert await closed_soon(reader), "the connection stayed open after the 408"
    finally:
        await close(writer)
    assert response.status == 408, response
    assert "body_timeout" in assert_error(response.body, "request_timeout")
    assert response.headers.get("connection", "").lower() == "close"
    assert 0.4 <= elapsed <= 3.0, elapsed
    assert in_flight_and_queued(proxy) == (0, 0)
    assert rec.seen == []


async def connect_small_window(port: int) -> socket.socket:
    """A client socket with a tiny receive buffer (set before connect, so the window stays small)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return sock


async def recv_head(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    received = b""
    async with asyncio.timeout(5):
        while b"\r\n\r\n" not in received:
            data = await loop.sock_recv(sock, 1)
            assert data, "the proxy closed before the response headers"
            received += data
    return received


async def drained_until_cut(sock: socket.socket, timeout: float = 5.0) -> bool:
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout):
            while await loop.sock_recv(sock, 1 << 16):
                pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


async def test_a_client_that_stops_reading_is_cut_off_and_its_slot_released(
    start_proxy, streamer, client, caplog
) -> None:
    proxy = await start_proxy(proxy_yaml(streamer.url, server="write_timeout: 500ms",
                                         provider="limit: 1, slot_timeout: 60s"))
    stalled = await connect_small_window(proxy.port)
    try:
        await asyncio.get_running_loop().sock_sendall(stalled, request_bytes("/openai/forever", body=CHAT))
        assert (await recv_head(stalled)).startswith(b"HTTP/1.1 200 ")
        assert in_flight_and_queued(proxy) == (1, 0)
        streamer.release.set()
        async with asyncio.timeout(5):
            async with client.post(f"{proxy.url}/openai/chat/completions", json=chat()) as resp:
                assert resp.status == 200
                assert (await resp.read()).endswith(b"data: [DONE]\n\n")
                queue_ms = int(resp.headers["X-Slotproxy-Queue-Ms"])
        assert await drained_until_cut(stalled), "the stalled client's connection is still open"
    finally:
        stalled.close()
    assert 200 <= queue_ms <= 4000, queue_ms
    await wait_until(lambda: in_flight_and_queued(proxy) == (0, 0), what="in_flight 0 and queued 0")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("write_timeout" in m and "slot released" in m for m in warnings), warnings
    assert any(m.startswith("cut off a client that accepted no bytes for server.write_timeout (0.5s)")
               for m in warnings), warnings


# --- greedy clients: the open-files limit and max_connections ------------------------------


IDLE = 1200
FILES = 1024


@pytest.fixture
def enough_files() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = IDLE + 256
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"the hard open-files limit ({hard}) is below {needed}")
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed if hard == resource.RLIM_INFINITY else hard, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def spawn_limited(config: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    """``slotproxy serve`` under ``ulimit -n FILES`` (soft and hard), its output in ``log``."""
    command = [sys.executable, "-m", "proxy", "serve", "--config", str(config), "--port", str(port)]
    with log.open("wb") as sink:
        return subprocess.Popen(["bash", "-c", f'ulimit -n {FILES} && exec "$@"', "bash", *command],
                                stdout=sink, stderr=subprocess.STDOUT, cwd=REPO)


async def open_idle(port: int, count: int) -> list[socket.socket]:
    loop = asyncio.get_running_loop()
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket()
            socks.append(sock)
            sock.setblocking(False)
            await asyncio.wait_for(loop.sock_connect(sock, ("127.0.0.1", port)), 5)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


async def test_more_idle_connections_than_file_descriptors_leave_the_proxy_serving(
    enough_files, client, tmp_path: Path
) -> None:
    config = tmp_path / "slotproxy.yaml"
    config.write_text(proxy_yaml(f"http://127.0.0.1:{free_port()}"))
    port = free_port()
    log = tmp_path / "proxy.log"
    process = spawn_limited(config, port, log)
    socks: list[socket.socket] = []
    cap = connection_cap(4096, FILES)
    try:
        await wait_healthy(client, port, process)
        socks = await open_idle(port, IDLE)
        await wait_healthy(client, port, process, timeout=5)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while (closed := sum(map(closed_by_peer, socks))) < IDLE - cap and loop.time() < deadline:
            await asyncio.sleep(0.05)
        assert closed >= IDLE - cap, f"only {closed} of {IDLE} idle connections were closed (cap {cap})"
    finally:
        for sock in socks:
            sock.close()
        code = await stop(process)
    written = log.read_text("utf-8", "replace")
    assert code == 0, written[-3000:]
    assert "Traceback" not in written, written[-3000:]
    assert len(written.splitlines()) < 60, written
    assert f"open files limit: {FILES}" in written, written
    assert f"leaves room for {cap} client connections" in written, written
    assert "closed an idle client connection to make room" in written, written


def run_in(loop: str, main: Coroutine[Any, Any, T]) -> T:
    """``main`` run to its end in a fresh event loop of the kind named: ``asyncio``'s own, or ``uvloop``
    (the one ``slotproxy serve`` runs on where it is installed)."""
    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        return cast(T, uvloop.run(main))
    return asyncio.run(main)


async def refused_past_the_cap(tmp_path: Path) -> tuple[list[tuple[int, bytes]], RawResponse, bool, int]:
    """16 busy streams through a proxy capped at 16 connections, and one connection more: what the 16 got,
    what the 17th got, whether it was closed within 3 s, and the upstream's request count."""
    streamer = Streamer()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", streamer.chat)
    upstream, upstream_port = await serve_app(app)
    config = parse_config(proxy_yaml(f"http://127.0.0.1:{upstream_port}", server="max_connections: 16")
                          + f"ledger: {{path: '{tmp_path / 'ledger.sqlite'}'}}\n")
    runner, port = await start_server(ProxyState(config), "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}/openai/chat/completions"
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

            async def busy() -> tuple[int, bytes]:
                async with session.post(url, json=chat()) as resp:
                    return resp.status, await resp.read()

            tasks = [asyncio.create_task(busy()) for _ in range(16)]
            try:
                await wait_until(lambda: streamer.arrived == 16, what="16 requests at the upstream")
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                try:
                    refused = await read_response(reader, timeout=3)
                    closed = await closed_soon(reader)
                finally:
                    await close(writer)
                streamer.release.set()
                results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
            finally:
                streamer.release.set()
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await runner.cleanup()
        await upstream.cleanup()
    return results, refused, closed, streamer.arrived


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_at_max_connections_all_busy_a_new_connection_gets_503_and_the_busy_ones_finish(
    loop: str, tmp_path: Path, caplog
) -> None:
    """On every event loop: uvloop's transports are no ``asyncio.Transport``, and a refusal that assumed
    one left the client waiting forever while the log said it was refused."""
    caplog.set_level(logging.INFO, logger="slotproxy.connections")
    results, refused, closed, arrived = run_in(loop, refused_past_the_cap(tmp_path))
    assert refused.status == 503, refused
    assert_error(refused.body, "too_many_connections")
    assert refused.headers["retry-after"] == "1"
    assert "server" not in refused.headers
    assert closed, "the refused connection stayed open"
    assert [status for status, _ in results] == [200] * 16
    assert all(body.endswith(b"data: [DONE]\n\n") for _, body in results)
    assert arrived == 16
    refusals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused a client connection")]
    assert refusals == ["refused a client connection: 16 open, every one busy (server.max_connections is 16)"]


def test_the_refusal_says_the_cap_was_lowered_only_when_the_open_files_limit_lowered_it() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft > 300, soft  # pytest's own soft limit: the test lowers it for a moment, never raises it
    resource.setrlimit(resource.RLIMIT_NOFILE, (300, hard))
    try:
        lowered = ConnectionGuard(ConnectionSettings(max_connections=4096))
        kept = ConnectionGuard(ConnectionSettings(max_connections=100))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert lowered.cap == connection_cap(4096, 300) == 118
    assert lowered.cap_reason() == "server.max_connections is 4096, lowered to 118 by the open files limit"
    assert kept.cap == 100
    assert kept.cap_reason() == "server.max_connections is 100"


async def test_at_max_connections_all_idle_the_oldest_idle_one_makes_room(start_proxy, rec, client, caplog) -> None:
    caplog.set_level(logging.INFO, logger="slotproxy.connections")
    proxy = await start_proxy(proxy_yaml(rec.url, server="max_connections: 16"))
    idle = [await asyncio.open_connection("127.0.0.1", proxy.port) for _ in range(16)]
    try:
        await wait_until(lambda: proxy.state.connections.open_count == 16, what="16 open connections")
        async with client.post(f"{proxy.url}/openai/chat/completions", json=chat(stream=False)) as resp:
            assert resp.status == 200
            assert (await resp.json())["ok"] is True
        oldest, *others = (reader for reader, _ in idle)
        assert await closed_soon(oldest), "the oldest idle connection was not closed"
        assert not any(reader.at_eof() for reader in others)
        assert proxy.state.connections.open_count == 16
    finally:
        for _, writer in idle:
            await close(writer)
    assert [s.raw_path for s in rec.seen] == ["/v1/chat/completions"]
    assert any(r.getMessage().startswith("closed an idle client connection to make room")
               for r in caplog.records), caplog.text


# --- an upstream that never answers ----------------------------------------------------------


@dataclass
class ContinueForever:
    """Reads a request, answers ``100 Continue`` (once, or every ``every`` seconds), never a final answer."""

    every: float | None
    server: asyncio.Server | None = None
    port: int = 0
    requests: int = 0
    writers: list[asyncio.StreamWriter] = field(default_factory=list)
    handlers: set[asyncio.Task[object]] = field(default_factory=set)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        self.writers.append(writer)
        try:
            await reader.readuntil(b"\r\n\r\n")
            self.requests += 1
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            while True:
                try:
                    if not await asyncio.wait_for(reader.read(1 << 16), self.every):
                        return
                except TimeoutError:
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.close()
        await self.server.wait_closed()
        if self.handlers:
            await asyncio.wait(self.handlers, timeout=2)


@pytest.mark.parametrize("every", [None, 0.2], ids=["once-then-silent", "every-200ms"])
async def test_an_upstream_answering_only_100_continue_is_a_504_at_idle_timeout(start_proxy, client, every) -> None:
    upstream = ContinueForever(every)
    await upstream.start()
    try:
        proxy = await start_proxy(proxy_yaml(f"http://127.0.0.1:{upstream.port}",
                                             provider="limit: 1, idle_timeout: 500ms, retry_on_429: 0"))
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with asyncio.timeout(5), client.post(f"{proxy.url}/openai/chat/completions", json=chat()) as resp:
            elapsed = loop.time() - started
            status, body = resp.status, await resp.read()
    finally:
        await upstream.stop()
    assert status == 504, body
    assert "idle_timeout" in assert_error(body, "upstream_timeout")
    assert 0.4 <= elapsed <= 3.0, elapsed
    assert upstream.requests == 1
    assert in_flight_and_queued(proxy) == (0, 0)


# --- parser errors -----------------------------------------------------------------------------


SECRET = "SECRET123"
MALFORMED = {
    "header-without-colon": f"GET /x HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {SECRET}\r\n"
                            "Bad Header\r\n\r\n",
    "junk-after-version": f"GET /x?{SECRET} HTTP/1.1 junkjunk\r\nHost: 127.0.0.1\r\n\r\n",
    "junk-method": f"G\x01T /{SECRET} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    "control-byte-in-value": f"GET /x HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Api-Key: {SECRET}\x01zz\r\n\r\n",
    "bad-version": f"GET /{SECRET} HTTP/9.Z\r\nHost: 127.0.0.1\r\n\r\n",
}
ECHO_MARKERS = (SECRET, "Bad Header", "junkjunk", "Bearer", "Authorization", "X-Api-Key", "/x", "HTTP/9")


@pytest.mark.parametrize("raw", list(MALFORMED.values()), ids=list(MALFORMED))
async def test_a_request_the_parser_refuses_gets_400_bad_request_echoing_nothing(
    start_proxy, rec, caplog, raw
) -> None:
    caplog.set_level(logging.DEBUG)
    proxy = await start_proxy(proxy_yaml(rec.url))
    response = await send_raw(proxy.port, raw.encode("latin-1"))
    assert response.status == 400, response
    assert_error(response.body, "bad_request")
    assert response.headers["content-type"].startswith("application/json")
    answer = response.body.decode("latin-1") + "".join(f"{k}: {v}\n" for k, v in response.headers.items())
    assert [marker for marker in ECHO_MARKERS if marker in answer] == [], answer
    assert "server" not in response.headers, response.headers
    assert not any(word in answer.lower() for word in ("aiohttp", "python")), answer
    assert SECRET not in caplog.text
    assert rec.seen == []


async def test_a_fleet_connecting_at_once_is_queued_by_the_listener_not_dropped(start_upstream, start_proxy) -> None:
    """300 connections arrive while the proxy's loop is busy: the kernel completes every handshake into the
    listen queue (sized to server.max_connections), where aiohttp's default backlog of 128 drops the rest."""
    import select
    import time

    upstream = await start_upstream()
    proxy = await start_proxy(f"state: {{path: null}}\nserver: {{max_connections: 1000}}\nproviders:\n"
                              f"  openai: {{upstream: '{upstream.url}/v1'}}\n")
    sockets = [socket.socket() for _ in range(300)]
    try:
        for sock in sockets:
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", proxy.port))
        pending, deadline = set(sockets), time.monotonic() + 1.0  # the loop accepts nothing meanwhile
        while pending and time.monotonic() < deadline:
            _, writable, _ = select.select([], list(pending), [], 0.05)
            pending -= {sock for sock in writable if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0}
        assert not pending, f"{len(pending)} of 300 handshakes not completed: the listen queue overflowed"
    finally:
        for sock in sockets:
            sock.close()
