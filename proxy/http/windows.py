"""The relay's part in a provider's token windows: what a request is estimated to cost before it is sent (and
again while it waits, when its model group's estimates moved), what each answer's headers say of the windows,
a 429 that names a window, and the reconciliation from the usage the answer reported.

One ``Windowing`` per provider that holds windows (``windows:`` written in its config), on ``ProxyState``; a
provider without windows has none, and its requests do no window work at all.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from typing import Any

from ..backends import Backend
from ..config.windows import DIALECT_WINDOWS
from ..limiter import SlotLease, policy
from ..limiter.window import FULL, OTHER_GROUP
from ..providers.budgets import header_count
from ..providers.estimate import (
    Estimate,
    Estimator,
    RequestBody,
    actual_for,
    admitted_for,
)
from ..providers.model_name import request_model
from ..providers.recost import Basis, Drift
from ..providers.tokens import UsageReader
from ..providers.window_signals import (
    HEADER_NAMES,
    REMAINING_HEADERS,
    Dialect,
    window_hit,
    window_limits,
    window_remaining,
)

__all__ = ["SETTLE_RULES", "Costing", "EndedResponses", "Windowing", "parsed_request"]

SETTLE_RULES: dict[str, dict[str, str]] = {
    "anthropic": {"input_tokens_per_minute": "give_back", "output_tokens_per_minute": "give_back"},
    "openai": {"tokens_per_minute": "charge_beyond"},
}
"""How each provider reconciles its windows with an answer's usage (``window.SETTLE_RULES``); a window not
named here (requests) keeps what it was charged."""

_KEPT = 1024
"""(key, group) pairs remembered at most (groups come from the models clients name)."""
_REPORT_AGAIN = 30.0
"""Unchanged limits are reported again after this long (the limiter may have forgotten an idle group's)."""


class Windowing:
    """One provider's windows as the relay sees them; the estimator outlives config reloads."""

    __slots__ = ("announced", "applies", "dialect", "drift", "estimator", "headroom", "keys", "learn",
                 "limit_headers", "patterns", "provider", "remaining_headers", "rules", "unannounced")

    def __init__(self, provider: str, dialect: Dialect, *, patterns: tuple[str, ...], keys: tuple[str, ...],
                 learn: bool, headroom: float, estimator: Estimator | None = None, drift: Drift | None = None) -> None:
        self.provider = provider
        self.dialect: Dialect = dialect
        self.patterns = patterns
        self.keys = keys
        """The pool's keys: before admission the key is not known, so a request is estimated for every
        window any of them holds for its group."""
        self.learn = learn
        self.headroom = headroom
        self.estimator = estimator or Estimator()
        self.drift = drift or Drift()
        """Where each model group's estimates last moved to (``providers.recost``); outlives reloads with the
        estimator."""
        self.rules = SETTLE_RULES[dialect]
        self.limit_headers = HEADER_NAMES[dialect][::3]
        """Each window's ``-limit`` header (the first of its three)."""
        self.unannounced = (None,) * len(self.limit_headers)
        self.remaining_headers = REMAINING_HEADERS[dialect]
        """(window, its ``-remaining`` header)."""
        self.announced: dict[tuple[str | None, str], tuple[tuple[str | None, ...], float]] = {}
        """The limit headers last announced for each (key, group), and when they were reported: an answer
        repeating them soon after reports nothing."""
        self.applies: dict[tuple[str | None, str], tuple[str, ...]] = {}
        """The windows in force for each (key, group) (None: any key of the pool), as last asked; forgotten
        when an answer announces new limits (a config reload builds a new ``Windowing``)."""

    def group(self, model: str | None) -> str:
        """The model group: the ``models`` pattern the model matches, else the model name (none: other)."""
        if model is None:
            return OTHER_GROUP
        pattern = policy.model_pattern(model, self.patterns) if self.patterns else None
        return pattern if pattern is not None else model

    def estimate(self, backend: Backend, group: str, body: bytes, request: Mapping[str, Any], *,
                 key: str | None = None, continuation: tuple[int, int] | None = None
                 ) -> tuple[Estimate, dict[str, float] | None]:
        """What the request will cost each window that applies to it (``key``: the one it is pinned to), and
        the cost to take (None: no window is known yet). Before any limit is known (all are learned from
        headers), it is estimated for the provider's own windows, so that its answer teaches the ratio, and
        charged to none: a window learned from its answer was not taken from, so it gives nothing back."""
        windows = self.applies.get((key, group))
        if windows is None:
            windows = self._applying(backend, key, group)
        estimate = self.estimator.estimate(dialect=self.dialect, key=key, group=group, body=body, request=request,
                                           windows=windows or DIALECT_WINDOWS[self.dialect],
                                           continuation=continuation, now=time.time())
        return estimate, estimate.cost if windows else None

    def costing(self, backend: Backend, group: str, body: bytes, request: Mapping[str, Any], *,
                key: str | None = None, continuation: tuple[int, int] | None = None) -> Costing:
        """The request's estimate now, kept with what it takes to estimate it again while it waits."""
        return Costing(self, backend, group, body, request, key, continuation)

    def _moved(self, backend: Backend, group: str) -> None:
        """The estimator learned: if the group's estimates moved (``providers.recost``, the rule), its waiters
        queued here are costed again (each ``Costing``, by the backend) and admission looks again. Not checked
        while no request of the provider is asking for its slot here (none could be costed again)."""
        drift = self.drift
        if drift.follows(group) and drift.moved(group, Basis(*self.estimator.basis(group))):
            backend.recost_windows(self.provider, group)

    def _applying(self, backend: Backend, key: str | None, group: str) -> tuple[str, ...]:
        provider = self.provider
        if key is not None or not self.keys:
            names = set(backend.window_limits(provider, key, group))
        else:
            names = set()
            for name in self.keys:
                names.update(backend.window_limits(provider, name, group))
        if len(self.applies) >= _KEPT:
            self.applies.clear()
        windows = self.applies[(key, group)] = tuple(sorted(names))
        return windows

    def answered(self, backend: Backend, key: str | None, group: str, headers: Mapping[str, str],
                 sent_at: float) -> None:
        """An answer's headers (any status): the limits it announces (with ``learn``), and the room left,
        which only ever lowers the room believed (Anthropic's rounding to the thousand allowed for by the core:
        ``limiter.window.ROUNDED_REMAINING``)."""
        get = headers.get  # the answer's headers are case-insensitive: only the few names are looked up
        if self.learn:
            raw = tuple(map(get, self.limit_headers))
            if raw != self.unannounced:
                last = self.announced.get((key, group))
                if last is None or last[0] != raw or time.time() - last[1] > _REPORT_AGAIN:
                    self._announced(backend, key, group, raw)
        room = None
        for window, name in self.remaining_headers:
            value = get(name)
            if value is not None and (left := header_count(value)) is not None:
                if room is None:
                    room = {window: left}
                else:
                    room[window] = left
        if room is not None:
            backend.report_window_remaining(self.provider, key, group, room, sent_at)

    def _announced(self, backend: Backend, key: str | None, group: str, raw: tuple[str | None, ...]) -> None:
        """Limits announced that differ from the last ones of (key, group), or the same again after a while."""
        now = time.time()
        limits = window_limits(self.dialect, {name: value for name, value in zip(self.limit_headers, raw)
                                              if value is not None})
        if len(self.announced) >= _KEPT:
            self.announced.clear()
        self.announced[(key, group)] = (raw, now)
        self.applies.clear()
        if limits:
            backend.report_window_limits(self.provider, key, group, limits)

    def hit(self, backend: Backend, key: str | None, group: str, status: int, headers: Mapping[str, str],
            body: bytes | str | None, wait: float | None, cost: Mapping[str, float] | None = None) -> str | None:
        """The window a 429 names, emptied until the stated wait (else its reset) and the group's ratio
        raised; None when it names no window (the usual backoff rules apply). At the wait the window has room
        for what the refused request was charged (``cost``: the provider said it may be sent again then); at
        the reset it is full again (both providers' reset is when the window is whole)."""
        window = window_hit(self.dialect, status, headers, body)
        if window is None:
            return None
        now = time.time()
        if wait is not None:
            until, then = now + wait, (cost or {}).get(window, 0.0)
        else:
            reset = window_remaining(self.dialect, headers, now).get(window, (0.0, None))[1]
            until, then = (reset, FULL) if reset is not None else (now, 0.0)
        backend.report_window_hit(self.provider, key, group, window, until, then)
        self.estimator.raise_ratio(key, group)
        self._moved(backend, group)
        return window

    def beyond(self, backend: Backend, lease: SlotLease, window: str) -> bool:
        """Whether the lease's cost exceeds ``window``'s whole capacity: a 429 from it can never be cured
        by waiting."""
        cost, group = lease.cost, lease.group
        if cost is None or group is None:
            return False
        limit = backend.window_limits(self.provider, lease.key, group).get(window)
        return limit is not None and cost.get(window, 0.0) > limit * (1.0 - self.headroom)

    def settle(self, backend: Backend, lease: SlotLease, group: str, estimate: Estimate,
               counts: tuple[int, ...] | None) -> None:
        """The answer ended: the estimator learns from its usage (``UsageReader.totals``, or its
        ``TokenCounts``) and the windows are reconciled; an answer without usage keeps its estimate."""
        if counts is None:
            return
        inputs, cached, written, output = counts[0], counts[1], counts[2], counts[3]
        self.estimator.learn(key=lease.key, group=group, estimate=estimate, input_tokens=inputs,
                             cached_read=cached, output_tokens=output, now=time.time(), cache_write=written)
        cost = lease.cost
        if cost is not None:
            # Settled only when it changes something: not a charge_beyond window within its charge (a request
            # the provider's word re-based that went beyond what the provider charged on admission but not
            # beyond the estimate is left so: one call less per OpenAI answer, and one script less with Redis).
            actual: dict[str, float] = {}
            changes = False
            for window, rule in self.rules.items():
                charged = cost.get(window)
                if charged is not None:
                    actual[window] = spent = actual_for(self.dialect, window, inputs, cached, written, output)
                    if rule != "charge_beyond" or spent > charged:
                        changes = True
            if changes:
                admitted = {window: admitted_for(window, inputs, cached, estimate.asked) for window in actual}
                backend.settle_windows(self.provider, lease, actual, self.rules, admitted)
        self._moved(backend, group)

    def status(self, row: dict[str, Any]) -> None:
        """Fill a status window row's ratio and estimate errors."""
        row.update(self.estimator.status(None, row["group"], row["window"]))


class Costing:
    """One request's window cost while it waits for its slot: estimated when it asks, and again when the
    backend calls it (its model group's estimates moved: ``Backend.recost_windows``). Settled afterwards
    against the estimate its grant took (``taken``): an earlier one when the grant was made before a re-costing
    reached it. Counted as asking (``Drift.asking``) from its estimate until ``taken`` or ``left``."""

    __slots__ = ("asking", "backend", "body", "continuation", "cost", "estimates", "group", "key", "request",
                 "windowing")

    def __init__(self, windowing: Windowing, backend: Backend, group: str, body: bytes, request: Mapping[str, Any],
                 key: str | None, continuation: tuple[int, int] | None) -> None:
        self.windowing, self.backend, self.group, self.body, self.request = windowing, backend, group, body, request
        self.key, self.continuation = key, continuation
        estimated = windowing.estimate(backend, group, body, request, key=key, continuation=continuation)
        self.estimates: list[tuple[Estimate, dict[str, float] | None]] = [estimated]
        self.cost: dict[str, float] | None = estimated[1]
        """What it takes from its windows now (None: no window is known yet)."""
        self.asking = True
        windowing.drift.asking += 1

    def left(self) -> None:
        """It no longer asks for a slot (granted, refused, gone): its group's answers need not be followed for
        it any more (``providers.recost``). Once; later calls do nothing."""
        if self.asking:
            self.asking = False
            self.windowing.drift.asking -= 1

    def _estimated(self) -> tuple[Estimate, dict[str, float] | None]:
        return self.windowing.estimate(self.backend, self.group, self.body, self.request, key=self.key,
                                       continuation=self.continuation)

    def __call__(self) -> dict[str, float] | None:
        """Its estimate again, from its own body (``limiter.Recost``); None when no window applies now."""
        estimated = self._estimated()
        if estimated[1] is None:
            return None
        self.estimates.append(estimated)
        if len(self.estimates) > _ESTIMATES_KEPT:  # only the latest few can still be granted
            del self.estimates[1]
        self.cost = cost = estimated[1]
        return cost

    def taken(self, lease: SlotLease) -> Estimate:
        """The estimate whose cost ``lease`` took: the latest with that cost (the latest without one taken).
        It asks no more (``left``)."""
        self.left()
        taken = lease.cost
        if taken is not None:
            for estimate, cost in reversed(self.estimates):
                if cost is taken or cost == taken:
                    return estimate
        return self.estimates[-1][0]


_ESTIMATES_KEPT = 8


def parsed_request(path: str, body: bytes) -> tuple[str | None, Mapping[str, Any]]:
    """The model a request names and its body, parsed on first look ({} when it is not a JSON object): the
    path's model (Gemini-style), else the body's top-level ``model``, or a WebSocket frame's ``response``'s.
    A body that opens with its ``model`` and names no other is not parsed for it."""
    request = RequestBody(body)
    in_path = request_model(path, b"") if "models/" in path else None
    if in_path is not None:
        return in_path, request
    leading = _LEADING_MODEL.match(body, 0, _SCAN)
    if leading is not None and body.find(b'"model"', leading.end()) < 0:
        return leading.group(1).decode(), request
    model = request.get("model")
    if not (isinstance(model, str) and model):
        nested = request.get("response")
        model = nested.get("model") if isinstance(nested, dict) else None
    return (model if isinstance(model, str) and model else None), request


_LEADING_MODEL = re.compile(rb'\s*\{\s*"model"\s*:\s*"([\x20\x21\x23-\x5b\x5d-\x7e]{1,256})"')
"""A body opening with its ``model``, a plain string (printable ASCII, no quote or backslash)."""
_SCAN = 1024


_RESPONSE_ID = re.compile(rb'"response"\s*:\s*\{\s*"id"\s*:\s*"([^"\\]{1,256})"')
_RESPONSES_KEPT = 64


class EndedResponses:
    """A socket's recent responses: the input and output tokens each reported, by its id, for a frame that
    continues one (``previous_response_id``): OpenAI charges the whole conversation again."""

    __slots__ = ("_ended",)

    def __init__(self) -> None:
        self._ended: dict[str, tuple[int, int]] = {}

    def remember(self, data: bytes, usage: UsageReader) -> None:
        found = _RESPONSE_ID.search(data, 0, 1024)
        totals = usage.totals()
        if found is None or totals is None:
            return
        ended = self._ended
        ended[found.group(1).decode()] = (totals[0], totals[3])
        if len(ended) > _RESPONSES_KEPT:
            del ended[next(iter(ended))]

    def continued(self, request: Mapping[str, Any]) -> tuple[int, int] | None:
        nested = request.get("response")
        previous = request.get("previous_response_id") or (
            nested.get("previous_response_id") if isinstance(nested, dict) else None)
        return self._ended.get(previous) if isinstance(previous, str) else None
