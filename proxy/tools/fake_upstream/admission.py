"""What the fake admits and counts: its options, the cap, per-key limits and windows, the 429s that
refuse a request, and the statistics ``GET /stats`` shows; shared by the HTTP routes (``server``) and
the WebSocket mode (``websocket``).

Only model requests (the four POST routes, and the ``response.create`` frames
of a WebSocket, in ``websocket``) are counted and capped; ``/v1/models``,
``/v1/usage`` and ``/stats`` never are, so polling them changes nothing.

A request's *key* is the auth value it carries: ``Authorization`` without a
leading ``Bearer ``, else ``x-api-key``, else ``""``. ``stats()["keys"]`` counts
every key seen. With ``key_limit``, each key may have that many requests in
flight, the global ``cap`` still applying too. With ``window_requests``, each
key has a fixed window: its first model request opens one of
``window_seconds``, in which at most ``window_requests`` requests are admitted
(whatever their answer); the next is refused until the window ends, with a
Retry-After (whole seconds, rounded up) and a retry-after-ms (exact) that say
when. With ``itpm``, ``otpm``, ``tpm`` or ``rpm``, the per-minute windows of
``windows`` hold each key and model instead (they cannot be combined with
``window_requests``), refusing in the provider's words (``dialects``).
Refusals are checked in that order (window, per-minute windows, ``cap``,
``key_limit``), each a 429 counted in ``rate_limited``; a window's also in
``window_rejected``, and a per-minute window's in its own ``rejected`` of
``stats()["windows"]`` (by window name: its ``limit``, ``rejected``, and each
key and model's bucket ``level``).
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from aiohttp import web

from .dialects import MODEL, Dialect, Reply, WindowState, retry_after_headers
from .knobs import Knobs
from .windows import (
    INPUT,
    OUTPUT,
    REQUESTS,
    TOKENS,
    Counted,
    Plan,
    Refusal,
    TokenWindows,
)

__all__ = ["ARRIVALS_KEPT", "MAX_WINDOW_SECONDS", "Admission", "TurnedAway", "key_of"]

ARRIVALS_KEPT = 10_000
MAX_WINDOW_SECONDS = 1e9


def key_of(headers: Mapping[str, str]) -> str:
    """The auth value a request carries: ``Authorization`` without ``Bearer ``, else ``x-api-key``, else ""."""
    auth = headers.get("Authorization", "").strip()
    if auth:
        return auth[len("bearer "):].strip() if auth[:len("bearer ")].lower() == "bearer " else auth
    return headers.get("x-api-key", "").strip()


@dataclass
class _KeyStats:
    """One key's statistics, as ``stats()["keys"][key]`` shows them."""

    requests: int = 0
    in_flight: int = 0
    max_concurrent: int = 0
    rejected: int = 0


@dataclass(frozen=True)
class TurnedAway:
    """Why a 429 turns a request away: its message, the wait it states, and the window that refused it."""

    message: str
    wait: float
    window: Refusal | None = None


@dataclass
class _Window:
    """One key's fixed request window: opened (on ``time.monotonic()``) by a request, and what it admitted."""

    opened: float
    admitted: int = 0


@dataclass(eq=False)
class Admission:
    """What the fake admits and counts, whichever way a model request comes: its options and statistics.

    ``cap`` is the hard concurrency limit (None: no limit); ``chunks`` and
    ``delay_ms`` shape each answer (a stream sends ``chunks`` chunks
    ``delay_ms`` apart; a non-streaming answer takes ``delay_ms``); ``lag_ms``
    keeps a finished request counted that much longer (the provider's
    accounting lag, also visible in ``/v1/usage``); ``retry_after`` is the
    wait, in seconds, its cap 429s state. ``key_limit`` caps the requests in
    flight per key; ``window_requests`` (None: no window) are admitted per key
    per fixed window of ``window_seconds``, announced in every answer's
    headers; ``unified`` adds Anthropic's unified status to them (see
    ``dialects``). ``websocket`` False refuses the Responses API's WebSocket
    upgrades with 404; ``ws_refuse_429`` refuses an upgrade with 429 while the
    cap is full. ``itpm``, ``otpm``, ``tpm`` and ``rpm`` (None: not held) are
    the per-minute windows of ``windows``, held per key and model. Options may
    be changed while running, but for the per-minute windows.
    """

    cap: int | None = None
    chunks: int = 5
    delay_ms: float = 20
    lag_ms: float = 0
    retry_after: float = 1.0
    key_limit: int | None = None
    window_requests: int | None = None
    window_seconds: float = 60.0
    unified: bool = False
    websocket: bool = True
    ws_refuse_429: bool = False
    itpm: int | None = None
    otpm: int | None = None
    tpm: int | None = None
    rpm: int | None = None
    max_concurrency: int = field(default=0, init=False)
    active: int = field(default=0, init=False)
    rate_limited: int = field(default=0, init=False)
    window_rejected: int = field(default=0, init=False)
    requests: int = field(default=0, init=False)
    completed: int = field(default=0, init=False)
    arrivals: list[dict[str, Any]] = field(default_factory=list, init=False)
    last_headers: dict[str, str] = field(default_factory=dict, init=False)
    keys: dict[str, _KeyStats] = field(default_factory=dict, init=False)
    websockets: int = field(default=0, init=False)
    websockets_opened: int = field(default=0, init=False)
    _windows: dict[str, _Window] = field(default_factory=dict, init=False, repr=False)
    token_windows: TokenWindows | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("cap", "key_limit", "window_requests", "itpm", "otpm", "tpm", "rpm"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer or None, got {getattr(self, name)!r}")
        if self.chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {self.chunks!r}")
        for name in ("delay_ms", "lag_ms", "retry_after"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0 < self.window_seconds <= MAX_WINDOW_SECONDS:
            raise ValueError(f"window_seconds must be > 0 and <= {MAX_WINDOW_SECONDS:g}, got {self.window_seconds!r}")
        limits = {name: limit for name, limit in ((INPUT, self.itpm), (OUTPUT, self.otpm), (TOKENS, self.tpm),
                                                  (REQUESTS, self.rpm)) if limit is not None}
        if limits and self.window_requests is not None:
            raise ValueError("window_requests (a fixed request window) cannot be combined with the per-minute "
                             "windows itpm, otpm, tpm and rpm, whose headers it would contradict; use rpm instead")
        if limits:
            self.token_windows = TokenWindows(limits)

    def reset(self) -> None:
        """Zero the statistics and close every key's window.

        ``active`` and the keys with requests in flight stay (with their
        ``in_flight``), since those requests will still end; so do the open
        WebSockets, which ``websockets_opened`` restarts from.
        """
        self.max_concurrency = self.active
        self.websockets_opened = self.websockets
        self.rate_limited = self.window_rejected = self.requests = self.completed = 0
        self.arrivals.clear()
        self.last_headers = {}
        self.keys = {
            key: _KeyStats(in_flight=account.in_flight, max_concurrent=account.in_flight)
            for key, account in self.keys.items() if account.in_flight
        }
        self._windows.clear()
        if self.token_windows is not None:
            self.token_windows.reset()

    def stats(self) -> dict[str, Any]:
        """The statistics (and the limits), as ``GET /stats`` answers them."""
        return {
            "cap": self.cap,
            "key_limit": self.key_limit,
            "window_requests": self.window_requests,
            "window_seconds": self.window_seconds,
            "max_concurrency": self.max_concurrency,
            "active": self.active,
            "rate_limited": self.rate_limited,
            "window_rejected": self.window_rejected,
            "requests": self.requests,
            "completed": self.completed,
            "arrivals": list(self.arrivals),
            "last_headers": dict(self.last_headers),
            "keys": {key: asdict(account) for key, account in self.keys.items()},
            "websockets": self.websockets,
            "websockets_opened": self.websockets_opened,
            "windows": {} if self.token_windows is None else self.token_windows.stats(time.monotonic()),
        }

    def _window(self, key: str) -> _Window | None:
        """``key``'s open window (a new one once the last has ended); None without ``window_requests``."""
        if self.window_requests is None:
            return None
        now = time.monotonic()
        window = self._windows.get(key)
        if window is None or now - window.opened >= self.window_seconds:
            window = self._windows[key] = _Window(now)
        return window

    def _refusal(self, key: str, window: _Window | None, plan: Plan | None = None) -> TurnedAway | None:
        """Why a 429 turns this request away, or None to admit it.

        A refusal by a window is counted in ``window_rejected`` here (and a per-minute window's, in its own
        count of ``stats()["windows"]``).
        """
        if window is not None and self.window_requests is not None and window.admitted >= self.window_requests:
            self.window_rejected += 1
            wait = math.ceil((window.opened + self.window_seconds - time.monotonic()) * 1000) / 1000
            return TurnedAway(f"Request limit reached: {self.window_requests} per {self.window_seconds:g}s",
                              max(0.001, wait))
        refused = None if plan is None or self.token_windows is None else \
            self.token_windows.refusal(plan, time.monotonic())
        if refused is not None:
            self.window_rejected += 1
            return TurnedAway(f"Rate limit reached on {refused.window}", refused.wait, refused)
        if self.cap is not None and self.active >= self.cap:
            return TurnedAway("Concurrency limit exceeded", self.retry_after)
        if self.key_limit is not None and self.keys[key].in_flight >= self.key_limit:
            return TurnedAway("Concurrency limit exceeded for this key", self.retry_after)
        return None

    def _headers(self, dialect: Dialect, window: _Window | None, knobs: Knobs, plan: Plan | None = None) \
            -> dict[str, str]:
        """An answer's extra headers: its windows announced (when there are any), then
        ``x-fake-ratelimit-headers``."""
        headers: dict[str, str] = {}
        if window is not None and self.window_requests is not None:
            left = max(0.0, window.opened + self.window_seconds - time.monotonic())
            state = WindowState(limit=self.window_requests, admitted=window.admitted, left=left)
            headers = dialect.window_headers(state, unified=self.unified)
        if plan is not None and self.token_windows is not None:
            headers |= dialect.token_window_headers(self.token_windows.readings(plan, time.monotonic()))
        return headers | knobs.ratelimit_headers

    def _count(self, dialect: Dialect, body: dict[str, Any], key: str) -> Counted | None:
        """The request's input as the windows count it (None without them)."""
        if self.token_windows is None:
            return None
        return self.token_windows.count(body, key, _model(body), caching=dialect.caches_prompts,
                                        now=time.monotonic())

    def _plan(self, dialect: Dialect, body: dict[str, Any], key: str, reply: Reply, counted: Counted | None,
              *, warmup: bool = False) -> Plan | None:
        """What the windows need of this request to admit it; a warm-up needs one request and no tokens."""
        if self.token_windows is None or counted is None:
            return None
        usage = reply.usage
        fed, cached = (0, 0) if warmup else (usage.input, usage.cached)
        return self.token_windows.plan(dialect.windows, key, reply.model, counted, fed, cached,
                                       {} if warmup else body)

    def _settle(self, dialect: Dialect, plan: Plan | None, reply: Reply) -> None:
        """Charge the windows what an answer produced."""
        if plan is None or self.token_windows is None:
            return
        usage = reply.usage
        self.token_windows.settle(plan, usage.input, usage.output, time.monotonic(),
                                  response_id=reply.id if dialect.continuable else None)

    def _record(self, headers: Mapping[str, str], body: dict[str, Any], key: str, tag: str | None) -> None:
        """Count one model request; ``tag`` None falls back to the body's ``user``."""
        self.requests += 1
        self.keys.setdefault(key, _KeyStats()).requests += 1
        self.last_headers = {name.lower(): value for name, value in headers.items()}
        if tag is None:
            tag = body.get("user") if isinstance(body.get("user"), str) else ""
        self.arrivals.append({"tag": tag, "at": int(time.time() * 1000)})
        if len(self.arrivals) > ARRIVALS_KEPT:
            del self.arrivals[: len(self.arrivals) - ARRIVALS_KEPT]

    def _admit(self, key: str, window: _Window | None, plan: Plan | None = None) -> None:
        if plan is not None and self.token_windows is not None:
            self.token_windows.admit(plan, time.monotonic())
        self.active += 1
        self.max_concurrency = max(self.max_concurrency, self.active)
        account = self.keys[key]
        account.in_flight += 1
        account.max_concurrent = max(account.max_concurrent, account.in_flight)
        if window is not None:
            window.admitted += 1

    def _schedule_release(self, key: str) -> None:
        if self.lag_ms > 0:
            asyncio.get_running_loop().call_later(self.lag_ms / 1000, self._release, key)
        else:
            self._release(key)

    def _release(self, key: str) -> None:
        self.active -= 1
        self.keys[key].in_flight -= 1

    def _count_rate_limited(self, key: str) -> None:
        self.rate_limited += 1
        self.keys.setdefault(key, _KeyStats()).rejected += 1

    @staticmethod
    def _reply(dialect: Dialect, body: dict[str, Any], size: int, knobs: Knobs, counted: Counted | None = None) \
            -> Reply:
        """The answer to give; its input is the body's size // 4, or with windows the input they counted."""
        options = body.get("stream_options")
        if counted is None:
            counted = Counted(max(1, size // 4))
        return Reply(
            id=dialect.id_prefix + uuid.uuid4().hex[:24],
            model=_model(body),
            created=int(time.time()),
            chunks=knobs.chunks,
            prompt_tokens=counted.input,
            cached_tokens=counted.cached,
            cache_write_tokens=counted.cache_write,
            stream=body.get("stream") is True,
            include_usage=isinstance(options, dict) and bool(options.get("include_usage")),
            usage_override=knobs.usage,
            usage_deltas=knobs.usage_deltas,
        )

    def _error(
        self, dialect: Dialect, status: int, message: str, *, key: str, retry_after: float | None,
        headers: Mapping[str, str], code: str | None = None, body: dict[str, Any] | None = None,
    ) -> web.Response:
        """An error answer (``body``, else the dialect's for ``message``); a 429 is counted (for its key too) and
        states ``retry_after`` seconds unless None."""
        waits: dict[str, str] = {}
        if status == 429:
            self._count_rate_limited(key)
            if retry_after is not None:
                waits = retry_after_headers(retry_after)
        if body is None:
            body = dialect.error_body(status, message, code)
        response = web.json_response(body, status=status, headers=waits)
        response.headers.update(headers)
        return response


def _model(body: Mapping[str, Any]) -> str:
    return str(body.get("model") or MODEL)
