"""The ``fake-upstream`` command: its flags, and serving a fake on 127.0.0.1 until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
from collections.abc import Callable
from typing import Any

from .admission import MAX_WINDOW_SECONDS
from .knobs import Kind, in_range
from .server import FakeUpstream, start_fake_upstream

__all__ = ["DEFAULT_PORT", "add_arguments", "run"]

DEFAULT_PORT = 9100


def _bounded(kind: Kind, low: float, high: float, what: str) -> Callable[[str], Any]:
    """An argparse ``type`` that accepts ``kind`` values in [low, high] and names the rule it enforces."""

    def convert(raw: str) -> int | float:
        value = in_range(raw, kind, low, high)
        if value is None:
            raise argparse.ArgumentTypeError(f"must be {what}, got {raw!r}")
        return value

    return convert


_port = _bounded(int, 0, 65535, "a port number 0-65535")
_positive_int = _bounded(int, 1, math.inf, "a positive integer")
_non_negative = _bounded(float, 0, math.inf, "a number >= 0")
_window_length = _bounded(float, math.ulp(0.0), MAX_WINDOW_SECONDS, f"a number > 0 and <= {MAX_WINDOW_SECONDS:g}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``fake-upstream`` flags.

    Dests: port, cap, chunks, delay_ms, lag_ms, key_limit, window_requests, window_seconds, unified,
    websocket, ws_refuse_429, itpm, otpm, tpm, rpm.
    """
    add = parser.add_argument
    add("--port", type=_port, default=DEFAULT_PORT, help="port on 127.0.0.1 (default 9100)")
    add("--cap", type=_positive_int, default=None, help="hard concurrency cap (default: none)")
    add("--chunks", type=_positive_int, default=5, help="stream chunks per answer (default 5)")
    add("--delay-ms", type=_non_negative, default=20.0, help="ms between chunks (default 20)")
    add("--lag-ms", type=_non_negative, default=0.0, help="ms a finished request stays counted (default 0)")
    add("--key-limit", type=_positive_int, default=None, help="concurrency cap per API key (default: none)")
    add("--window-requests", type=_positive_int, default=None,
        help="requests admitted per API key per window, announced in rate-limit headers (default: no window)")
    add("--window-seconds", type=_window_length, default=60.0, help="length of a key's request window (default 60)")
    add("--itpm", type=_positive_int, default=None, metavar="N",
        help="Anthropic input tokens per minute, per API key and model; cache reads are free (default: none)")
    add("--otpm", type=_positive_int, default=None, metavar="N",
        help="Anthropic output tokens per minute, per API key and model (default: none)")
    add("--tpm", type=_positive_int, default=None, metavar="N",
        help="OpenAI tokens per minute, per API key and model (default: none)")
    add("--rpm", type=_positive_int, default=None, metavar="N",
        help="requests per minute, per API key and model, on every route (default: none)")
    add("--unified", action="store_true",
        help="Anthropic answers also carry the unified rate-limit headers (default: off)")
    add("--no-websocket", dest="websocket", action="store_false",
        help="refuse WebSocket upgrades of /v1/responses with 404, as a server without that mode "
             "(default: upgrades accepted)")
    add("--ws-refuse-429", action="store_true",
        help="refuse a WebSocket upgrade with 429 while the cap is full (default: off; the upgrade succeeds "
             "and a response.create over the cap gets an error event)")


async def _serve_until_signalled(fake: FakeUpstream, port: int) -> None:
    try:
        runner, bound = await start_fake_upstream(fake, port=port)
    except OSError as exc:  # a taken port is one line (slotproxy: cannot listen on ...), exit 2: no traceback
        from ...server.bind import failure

        bind_failed = failure(exc, "127.0.0.1", port, host_flag=None)
        if bind_failed is None:
            raise
        raise bind_failed from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    cap = "none" if fake.cap is None else fake.cap
    details = [f"cap={cap}", f"chunks={fake.chunks}", f"delay_ms={fake.delay_ms:g}", f"lag_ms={fake.lag_ms:g}"]
    if fake.key_limit is not None:
        details.append(f"key_limit={fake.key_limit}")
    if fake.window_requests is not None:
        details.append(f"window={fake.window_requests}/{fake.window_seconds:g}s")
    for name in ("itpm", "otpm", "tpm", "rpm"):
        if getattr(fake, name) is not None:
            details.append(f"{name}={getattr(fake, name)}")
    if fake.unified:
        details.append("unified")
    if not fake.websocket:
        details.append("no-websocket")
    if fake.ws_refuse_429:
        details.append("ws-refuse-429")
    print(f"fake-upstream listening on http://127.0.0.1:{bound} ({', '.join(details)})", flush=True)
    try:
        await stop.wait()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        await runner.cleanup()


def run(
    port: int = DEFAULT_PORT,
    cap: int | None = None,
    chunks: int = 5,
    delay_ms: float = 20.0,
    lag_ms: float = 0.0,
    *,
    key_limit: int | None = None,
    window_requests: int | None = None,
    window_seconds: float = 60.0,
    unified: bool = False,
    websocket: bool = True,
    ws_refuse_429: bool = False,
    itpm: int | None = None,
    otpm: int | None = None,
    tpm: int | None = None,
    rpm: int | None = None,
) -> None:
    """Serve a fake upstream on 127.0.0.1 until SIGINT or SIGTERM (the ``fake-upstream`` command).

    Raises ValueError, naming the rule, for options that cannot go together.
    """
    fake = FakeUpstream(
        cap=cap, chunks=chunks, delay_ms=delay_ms, lag_ms=lag_ms, key_limit=key_limit,
        window_requests=window_requests, window_seconds=window_seconds, unified=unified,
        websocket=websocket, ws_refuse_429=ws_refuse_429, itpm=itpm, otpm=otpm, tpm=tpm, rpm=rpm,
    )
    asyncio.run(_serve_until_signalled(fake, port))
