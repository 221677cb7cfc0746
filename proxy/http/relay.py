"""The streaming relay: route, read the body, take a slot, forward, stream back, release.

A slot is held from just before the upstream request is sent until the last byte
of the response has been written to the client, and released exactly once on
every path: normal end, client gone (queued or streaming), upstream failure,
backoff retry, idle timeout and the watchdog's slot timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from ..errors import (
    BadRequest,
    ProxyError,
    QueueFull,
    QueueTimeout,
    ShuttingDown,
    SlotLost,
    SpendLimitReached,
    UnknownProvider,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from ..limiter import Budget, Priority, SlotLease
from ..limiter.window import OTHER_GROUP
from ..providers.budgets import read_budget
from ..providers.estimate import Estimate
from ..providers.model_name import model_hint, request_model
from ..providers.signals import (
    Backoff,
    classify_response,
    ends_event_stream,
    readable_body,
    stream_scanner,
)
from ..providers.tokens import UsageReader
from . import upstream_errors
from .accounting import Account, BodyTail
from .answers import ALLOWED_ORIGIN, Answer, StreamedAnswer, WrittenAnswer
from .body import read_body
from .headers import (
    check_header_bytes,
    client_wait_limit,
    forward_request_headers,
    forward_response_headers,
    parse_priority,
)
from .idle import Watch
from .keys import QUEUE_MS_HEADER, STATE, error_response
from .runtime import ProxyState
from .websocket import relay_websocket, wants_websocket
from .windows import parsed_request

if TYPE_CHECKING:
    from ..config import ProviderSettings

__all__ = ["Exchange", "proxy_handler", "relay"]

log = logging.getLogger("slotproxy.relay")

_MAX_ERROR_BODY = 1 << 20
_ONE_WRITE_MAX = 64 * 1024
_NO_BODY_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE", "TRACE"})
_LEASE_LOST = "the slot this answer held was given up: its lease could not be renewed in redis before it expired"
_R = TypeVar("_R", Answer, StreamedAnswer)


class _NoSlot:
    """Stands in for a lease on requests whose method takes no slot."""

    queue_wait = 0.0
    reclaimed = False
    lease_lost = False
    on_reclaim = None
    seq = None
    key = None
    cost = None
    group = None

    def __init__(self) -> None:
        self.granted_at = time.time()

    def release(self) -> None:
        return None

    def headers_received(self) -> None:
        return None


class _ClientGone(Exception):
    """Writing to the client failed: it disconnected mid-response."""


class _Retry(Exception):
    """A backoff answer arrived before any byte reached the client; try again after the pause."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


def _route(request: web.Request, state: ProxyState, provider: str, decoded_rest: str) -> tuple[ProviderSettings, URL]:
    settings = state.provider(provider)
    if settings is None:
        raise UnknownProvider.named(provider, None if state.client_keys is not None else state.provider_names())
    if "." in decoded_rest and any(segment in (".", "..") for segment in decoded_rest.split("/")):
        raise BadRequest("dot segments ('.' or '..') are not allowed in the request path")
    raw_path, _, raw_query = request.raw_path.partition("?")
    raw_rest = raw_path.split("/", 2)[2] if raw_path.count("/") >= 2 else ""
    target = settings.upstream + "/" + raw_rest if raw_rest else settings.upstream
    if raw_query:
        # The query as the client encoded it: aiohttp's query_string is already decoded.
        target += "?" + raw_query
    return settings, URL(target, encoded=True)


async def proxy_handler(request: web.Request) -> web.StreamResponse:
    """The provider routes as the router dispatches them: the paths the guard did not relay itself."""
    return await relay(request, request.app[STATE], request.match_info["provider"], request.match_info.get("rest", ""))


async def relay(request: web.Request, state: ProxyState, provider: str, rest: str) -> web.StreamResponse:
    """One request to ``/{provider}/{rest}`` (``rest`` decoded; the raw path is what is forwarded).

    Answers from here on are counted under the provider; those refused before it is known are not, so
    a client cannot add label values."""
    if state.shutting_down:
        raise ShuttingDown("slotproxy is shutting down; retry shortly", retry_after=1.0)
    consumed: frozenset[str] = frozenset()
    if state.client_keys is not None:
        # Before routing, so that a client without a key learns nothing, not even which providers exist.
        known = state.provider(provider)
        injected = known is not None and state.upstreams.injects_auth(known)
        consumed = state.client_keys.check(request.headers, provider_key_injected=injected)
    settings, url = _route(request, state, provider, rest)
    if request.method == "GET" and "Upgrade" in request.headers and wants_websocket(request.headers):
        return await relay_websocket(request, state, provider, settings, url, consumed)
    state.request_started()
    account = Account(provider)
    if state.telemetry is not None:
        account.trace = state.telemetry.request(request.headers, provider, settings, request.method, rest)
    priority: Priority | None = None
    try:
        check_header_bytes(request.headers, skip=state.strip_headers)
        body = await read_body(request, state.config.server.max_body, state.config.server.body_timeout, invite=True)
        # Only a Responses API body may carry Codex's turn metadata (client_metadata): others are not searched.
        priority, invalid = parse_priority(request.headers, state.priority_headers, time.time(),
                                           body if rest.endswith("responses") else b"")
        account.priority = priority
        for key in invalid:
            state.metrics.invalid_headers.labels(key).inc()
        response = await Exchange(request, state, provider, settings, url, body, priority, consumed, rest,
                                  account).run()
    except ProxyError as exc:
        response = error_response(exc)
    except asyncio.CancelledError:
        if account.outcome == "ok":  # it left once its answer was whole (Exchange._stream): served
            state.metrics.count_request(provider, str(account.status))
            raise
        state.metrics.count_request(provider, "499")
        account.outcome = "client_gone"
        account.status = account.status or 499  # a stream whose headers it had keeps their status
        if priority is not None and getattr(request.protocol, "write_timed_out", False):
            log.warning("provider=%s client accepted no bytes for server.write_timeout; cut off, slot released "
                        "(workspace=%s conversation=%s)", provider, priority.workspace, priority.conversation or "-")
        raise
    finally:
        state.request_finished()
        if account.status == 0:
            account.status = response.status
        state.account(account)
    state.metrics.count_request(provider, str(response.status))
    return response


class Exchange:
    """One client request, relayed with up to ``retry_on_429`` retries before the client sees anything."""

    group: str = OTHER_GROUP
    """With windows: the request's model group."""
    parsed: Mapping[str, Any] = MappingProxyType({})
    """With windows: the request body, parsed once."""
    estimate: Estimate | None = None
    """With windows: what the current attempt was estimated to cost."""

    def __init__(
        self,
        request: web.Request,
        state: ProxyState,
        provider: str,
        settings: ProviderSettings,
        url: URL,
        body: bytes,
        priority: Priority,
        consumed: frozenset[str] = frozenset(),
        rest: str = "",
        account: Account | None = None,
    ) -> None:
        self.request = request
        self.state = state
        self.provider = provider
        self.settings = settings
        self.url = url
        self.body = body
        self.priority = priority
        self.needs_slot = request.method in settings.slot_methods
        client_wait = client_wait_limit(request.headers) if self.needs_slot else None
        self.windowing = windowing = state.windowing(provider) if self.needs_slot else None
        if windowing is None:
            self.model = None if not self.needs_slot else \
                request_model(rest, body) if settings.models else model_hint(rest, body)
        else:
            self.model, self.parsed = parsed_request(rest, body)
            self.group = windowing.group(self.model)
        self.client_deadline = None if client_wait is None else time.monotonic() + client_wait
        self.response: web.StreamResponse | None = None
        self.queue_ms = 0
        self.consumed = consumed
        self.headers_seen = False
        """Whether the current attempt's upstream answered with its headers (else it failed before answering)."""
        self.chunks: int | None = None
        """The chunks of upstream's body relayed so far in this attempt; None until its body streams."""
        self.account = account or Account(provider)
        self.account.model = self.model

    async def run(self) -> web.StreamResponse:
        retries_left = self.settings.retry_on_429
        seq: int | None = None
        waited = 0.0
        while True:
            asked_at = time.monotonic()
            lease: SlotLease | _NoSlot
            fresh = seq is None and self.needs_slot  # a new request, not a retry: its workspace's cap applies
            if fresh and self.state.spend.caps and (refusal := self._over_spend()) is not None:
                return error_response(refusal, queue_ms=self.queue_ms)
            try:
                if self.needs_slot:
                    client_wait = None if self.client_deadline is None else max(
                        0.0, self.client_deadline - time.monotonic())
                    windowing = self.windowing
                    if windowing is None:
                        lease = await self.state.backend.acquire(self.provider, self.priority, seq=seq,
                                                                 client_wait=client_wait, model=self.model)
                    else:  # costed again while it waits if its group's estimates move (``providers.recost``)
                        costing = windowing.costing(self.state.backend, self.group, self.body, self.parsed)
                        try:
                            lease = await self.state.backend.acquire(
                                self.provider, self.priority, seq=seq, client_wait=client_wait, model=self.model,
                                cost=costing.cost, group=self.group, recost=costing)
                        except BaseException:
                            costing.left()
                            raise
                        self.estimate = costing.taken(lease)
                    self.state.observe_grant(self.provider, lease)
                    if self.account.trace is not None:
                        self.account.trace.waited(lease.queue_wait, self.priority, lease)
                else:
                    lease = _NoSlot()
            except (QueueFull, QueueTimeout, ShuttingDown, SpendLimitReached) as exc:
                self.queue_ms = self.account.queue_ms = int((waited + time.monotonic() - asked_at) * 1000)
                if self.account.trace is not None:
                    self.account.trace.waited(time.monotonic() - asked_at, self.priority, refused=exc.status)
                return error_response(exc, queue_ms=self.queue_ms)
            waited += lease.queue_wait
            self.queue_ms = self.account.queue_ms = int(waited * 1000)
            if fresh and self.state.spend.caps and (refusal := self._over_spend()) is not None:  # reached while it waited
                lease.release()
                return error_response(refusal, queue_ms=self.queue_ms)
            self.account.key = lease.key
            seq = lease.seq
            try:
                return await self._attempt(lease, retry_allowed=retries_left > 0)
            except _Retry as retry:
                retries_left -= 1
                self.account.retries += 1
                if self.account.trace is not None:
                    self.account.trace.retried(retry.status, self.model)
            finally:
                if self.windowing is not None:
                    self._settle(lease)
                lease.release()

    def _over_spend(self) -> ProxyError | None:
        """The refusal of a new request whose workspace's spend today reached its cap (asked only while some
        cap is configured: a proxy without caps makes no call for it)."""
        return self.state.spend_refusal(self.priority.workspace, self.settings)

    def _settle(self, lease: SlotLease | _NoSlot) -> None:
        """Reconcile the windows this attempt took from with the usage its answer reported."""
        usage, estimate, windowing = self.account.usage, self.estimate, self.windowing
        if usage is not None and estimate is not None and windowing is not None and not isinstance(lease, _NoSlot):
            windowing.settle(self.state.backend, lease, self.group, estimate, usage.totals())

    async def _attempt(self, lease: SlotLease | _NoSlot, *, retry_allowed: bool) -> web.StreamResponse:
        # idle_timeout: the wait for upstream's final headers (aiohttp would restart a read timeout on every
        # 1xx answer), then each gap between chunks. The watchdog's reclaim fires it at once.
        watch = self.state.idle_watch.watch(self.settings.idle_timeout)
        lease.on_reclaim = watch.fire
        if lease.reclaimed:
            watch.fire()
        self.headers_seen, self.chunks = False, None
        try:
            session = self.state.upstreams.session_for(self.settings)
            # Built after the grant: a queued request holds nothing it does not need yet.
            strip = self.state.strip_headers | self.consumed if self.consumed else self.state.strip_headers
            headers = forward_request_headers(self.request.headers, strip=strip,
                                              auth=self.state.upstreams.auth(self.settings, lease.key))
            if self.account.trace is not None:
                headers["traceparent"] = self.account.trace.sending(self.model, lease.key)
            data = None if (not self.body and self.request.method in _NO_BODY_METHODS) else self.body
            async with session.request(
                self.request.method,
                self.url,
                headers=headers,
                data=data,
                allow_redirects=False,
                timeout=self.state.upstreams.client_timeout(self.settings),
            ) as upstream:
                self.headers_seen = True
                watch.progress()
                lease.headers_received()
                budget = self._note_budget(upstream, lease) if self.settings.budgets and self.needs_slot else None
                if self.windowing is not None:
                    self.windowing.answered(self.state.backend, lease.key, self.group, upstream.headers,
                                            lease.granted_at)
                if upstream.status in self.settings.backoff_statuses:
                    window_spent = budget is not None and budget.held_until is not None
                    return await self._relay_backoff(upstream, lease, watch, retry_allowed, window_spent)
                if self._small_whole(upstream):  # most non-streamed answers: no streaming layer to pass through
                    return await self._send_whole(upstream, await upstream.read())
                return await self._stream(upstream, lease, watch)
        except asyncio.CancelledError:
            if not watch.absorbed():
                raise
            self.account.outcome = "timeout"
            return self._timed_out(lease, watch.delay)
        except TimeoutError:  # aiohttp's connect_timeout (sock_read is off: idle_timeout is the watch's)
            self.account.outcome = "upstream_error"
            return self._fail(UpstreamTimeout, upstream_errors.connect_timed_out(
                self.url.host, self.url.port, self.settings.connect_timeout))
        except _ClientGone:
            log.debug("provider=%s client left mid-response", self.provider)
            self.account.outcome = "client_gone"
            self.account.status = self.account.status or 499
            return self.response or error_response(BadRequest("client disconnected"))
        except aiohttp.ClientError as exc:
            self.account.outcome = "upstream_error"
            host, port = self.url.host, self.url.port
            what = upstream_errors.broke_off(exc, host, port, self.chunks) if self.headers_seen \
                else upstream_errors.before_answer(exc, host, port)
            return self._fail(UpstreamUnreachable, what)
        finally:
            watch.close()
            lease.on_reclaim = None

    def _timed_out(self, lease: SlotLease | _NoSlot, idle_timeout: float) -> web.StreamResponse:
        host, port = self.url.host, self.url.port
        if lease.lease_lost:
            return self._fail(SlotLost, _LEASE_LOST)
        if lease.reclaimed:
            what = upstream_errors.slot_timed_out(host, port, self.settings.slot_timeout)
        else:
            what = upstream_errors.idle(host, port, idle_timeout, self.chunks, self.headers_seen)
        return self._fail(UpstreamTimeout, what)

    def _fail(self, kind: type[UpstreamUnreachable | UpstreamTimeout | SlotLost], what: str) -> web.StreamResponse:
        """Answer with an error that says ``what`` happened upstream (in words, with its host and port), or,
        once bytes reached the client, cut the connection; the log line says the same and which it was."""
        error = kind(upstream_errors.for_provider(self.provider, what))
        if self.response is None:
            log.warning("provider=%s %s; answered %d %s", self.provider, what, error.status, error.code)
            return error_response(error, queue_ms=self.queue_ms)
        log.warning("provider=%s %s; the client's connection was cut (its answer had begun)", self.provider, what)
        transport = self.request.transport
        if transport is not None:
            transport.close()
        return self.response

    async def _relay_backoff(
        self, upstream: aiohttp.ClientResponse, lease: SlotLease | _NoSlot, watch: Watch, retry_allowed: bool,
        window_spent: bool = False,
    ) -> web.StreamResponse:
        """A backoff status. One whose own rate-limit headers say the key's request window is spent is a
        budget matter, not too many at once: the key is held until the reset and its limit is left alone."""
        body, complete = await _read_capped(upstream.content, _MAX_ERROR_BODY, watch)
        readable = readable_body(body, upstream.headers.get("Content-Encoding"))
        backoff = classify_response(
            upstream.status, upstream.headers, readable, self.settings.backoff_statuses, time.time()
        )
        if self.windowing is not None and backoff is not None and upstream.status == 429:
            retry = self._window_hit(upstream, lease, readable, backoff, retry_allowed)
            if retry:
                raise _Retry(upstream.status)
            if retry is not None:
                backoff = None
        if backoff is not None:
            self._report(backoff, lease, reduce=not window_spent)
            if retry_allowed:
                log.debug("provider=%s retrying after a %s (the client has seen nothing yet)", self.provider, backoff.cause)
                raise _Retry(upstream.status)
        if upstream.status == 429:
            self.state.backend.backoffs.relayed(self.provider)
        if not complete:
            return await self._stream(upstream, lease, watch, prefix=body)
        return await self._send_whole(upstream, body)

    def _window_hit(self, upstream: aiohttp.ClientResponse, lease: SlotLease | _NoSlot, body: bytes,
                    backoff: Backoff, retry_allowed: bool) -> bool | None:
        """A 429 that names a window: the window is emptied until the stated wait, with no backoff (the
        slots were not the problem). True when it is to be retried: it then waits in the queue for the
        window's room, unless its cost exceeds the window's whole capacity (it can never fit); False when it
        is relayed; None when it names no window."""
        windowing = self.windowing
        if windowing is None or isinstance(lease, _NoSlot):
            return None
        window = windowing.hit(self.state.backend, lease.key, self.group, upstream.status, upstream.headers,
                               body, backoff.wait, lease.cost)
        if window is None:
            return None
        if retry_allowed and not windowing.beyond(self.state.backend, lease, window):
            log.debug("provider=%s retrying after a 429 of its %s window (the client has seen nothing yet)",
                      self.provider, window)
            return True
        return False

    def _report(self, backoff: Backoff, lease: SlotLease | _NoSlot, *, reduce: bool = True) -> None:
        self.state.metrics.backoffs.labels(self.provider, backoff.cause).inc()
        self.state.backend.report_backoff(
            self.provider, backoff.cause, backoff.wait, lease.granted_at,
            reduce=reduce and backoff.status in self.settings.reduce_statuses, key=lease.key)

    def _note_budget(self, upstream: aiohttp.ClientResponse, lease: SlotLease | _NoSlot) -> Budget | None:
        budget = read_budget(upstream.headers, time.time())
        if budget is not None:
            self.state.backend.report_budget(self.provider, budget, lease.key)
        return budget

    async def _stream(
        self, upstream: aiohttp.ClientResponse, lease: SlotLease | _NoSlot, watch: Watch, prefix: bytes = b""
    ) -> web.StreamResponse:
        """Relay the body as it arrives (a small whole answer never comes here: see ``_small_whole``)."""
        length = upstream.content_length
        event_stream = _is_event_stream(upstream)
        response = self._answer(StreamedAnswer(status=upstream.status, reason=upstream.reason,
                                                   headers=self._response_headers(upstream)), upstream)
        if length is not None:
            response.content_length = length
        await _to_client(response.prepare(self.request))
        self.account.first_byte()
        self.account.status = upstream.status  # what the client got, even if it leaves before the end
        if prefix:
            await _to_client(response.write(prefix))
        usage = self.account.usage = UsageReader()
        encoding = upstream.headers.get("Content-Encoding")
        scanner = stream_scanner(encoding, usage) if event_stream else None
        tail = BodyTail(encoding) if not event_stream and upstream.status < 300 else None
        # Cancellation point: the client may leave at any await below; the handler
        # is cancelled and the caller's finally releases the slot.
        chunks = 0
        before = last = b""
        try:
            async for chunk in upstream.content.iter_any():
                chunks += 1
                watch.progress()
                if scanner is not None:
                    backoff = scanner.feed(chunk)
                    if backoff is not None:
                        self._report(backoff, lease)
                elif tail is not None:
                    tail.feed(chunk)
                try:  # _to_client's job, written out: no extra coroutine per chunk
                    await response.write(chunk)
                except ConnectionError as exc:
                    raise _ClientGone from exc
                before, last = last, chunk
        except asyncio.CancelledError:
            # The client left while upstream's body had not ended. If it had the stream's final event (the
            # OpenAI SDK hangs up at [DONE], before the body's end), it was served: relay() counts its status.
            if event_stream and not encoding and ends_event_stream(before + last):
                self.account.outcome = "ok"
            raise
        finally:
            self.chunks = chunks  # for the words if upstream broke off or went quiet
        await _to_client(response.write_eof())
        if tail is not None:
            tail.read_into(usage)
        self.account.outcome = "ok"
        return response

    def _small_whole(self, upstream: aiohttp.ClientResponse) -> bool:
        """A small fixed-length answer is read whole (within idle_timeout of its headers) and sent in one write."""
        length = upstream.content_length
        return length is not None and length <= _ONE_WRITE_MAX and self.request.method != "HEAD" \
            and not _is_event_stream(upstream)

    async def _send_whole(self, upstream: aiohttp.ClientResponse, body: bytes) -> web.StreamResponse:
        """A small fixed-length answer: headers and body leave in one write, still before the slot is released."""
        headers = self._response_headers(upstream)
        account = self.account
        account.first_byte()
        try:  # _to_client's job, written out for both kinds of answer
            if WrittenAnswer.fits(self.request.method, upstream.status):
                headers[QUEUE_MS_HEADER] = str(self.queue_ms)
                written = self.response = WrittenAnswer(status=upstream.status, reason=upstream.reason)
                await written.send(self.request, headers, body)
                response: web.StreamResponse = written
            else:
                response = self._answer(Answer(status=upstream.status, reason=upstream.reason, body=body,
                                               headers=headers), upstream)
                await response.prepare(self.request)
                await response.write_eof()
        except ConnectionError as exc:
            raise _ClientGone from exc
        account.outcome = "ok"
        if upstream.status < 300 and body:
            account.usage = usage = UsageReader()
            encoding = upstream.headers.get("Content-Encoding")
            usage.read(readable_body(body, encoding) if encoding else body)
        return response

    def _response_headers(self, upstream: aiohttp.ClientResponse) -> CIMultiDict[str]:
        return forward_response_headers(upstream.headers, keep_cors=self.request.get(ALLOWED_ORIGIN) is not None)

    def _answer(self, response: _R, upstream: aiohttp.ClientResponse) -> _R:
        """The relayed answer to the client, marked as this exchange's: queue header, untyped body noted."""
        response.untyped = "Content-Type" not in upstream.headers
        response.headers[QUEUE_MS_HEADER] = str(self.queue_ms)
        self.response = response
        return response


async def _read_capped(content: aiohttp.StreamReader, cap: int, watch: Watch) -> tuple[bytes, bool]:
    """Up to ``cap`` bytes of a body, and whether that was all of it."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in content.iter_any():
        watch.progress()
        chunks.append(chunk)
        size += len(chunk)
        if size >= cap:
            return b"".join(chunks), content.at_eof()
    return b"".join(chunks), True


async def _to_client(write: Awaitable[object]) -> None:
    """A write toward the client; its failure means the client left, not that upstream failed."""
    try:
        await write
    except ConnectionError as exc:
        raise _ClientGone from exc


def _is_event_stream(upstream: aiohttp.ClientResponse) -> bool:
    """Read from the header as sent: aiohttp's ``content_type`` parses it and copies its parameters."""
    if upstream.status != 200:
        return False
    raw = upstream.headers.get("Content-Type")
    return raw is not None and raw.partition(";")[0].strip().lower() == "text/event-stream"
