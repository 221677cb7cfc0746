"""Admin API writes: limits, cooldowns and stars, behind an optional bearer token."""

from __future__ import annotations

import hmac
import json
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import web

from ..errors import AdminError, BodyTooLarge, UnknownLimit, UnknownProvider
from ..http.answers import json_answer
from ..http.body import read_body
from ..http.headers import valid_label
from ..http.keys import STATE
from ..http.state import LimitLevelId, TooManyStars
from ..limiter import validate_limit
from .status import provider_document
from .throttle import AuthFailures

if TYPE_CHECKING:
    from ..backends import Backend

__all__ = ["AUTH_FAILURES", "add_routes"]

log = logging.getLogger("slotproxy.admin")

T = TypeVar("T")

MAX_COOLDOWN_MS = 3_600_000
_MAX_BODY = 4096
_MAX_DEPTH = 32

AUTH_FAILURES: web.AppKey[AuthFailures] = web.AppKey("slotproxy_auth_failures", AuthFailures)
"""The failed admin authentications of the app's clients, per address."""


def authorize(request: web.Request) -> None:
    """Writes need ``Authorization: Bearer <token>`` when the admin token env var is set.

    Failures are logged at most once a second per client address; an address that
    fails too often is answered 429 for the rest of its minute.
    """
    state = request.app[STATE]
    token = os.environ.get(state.config.admin.token_env, "")
    if not token:
        return
    address = request.remote or "unknown"
    wait = request.app[AUTH_FAILURES].blocked_for(address)
    if wait is not None:
        raise AdminError(f"too many failed admin authentications from {address}; retry in {math.ceil(wait)}s",
                         status=429, code="rate_limited", retry_after=wait)
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    if not header or scheme.lower() != "bearer" or not given:
        _failed(request, address, "no token")
        raise AdminError(f"admin writes need 'Authorization: Bearer <token>' (the token is in ${state.config.admin.token_env})",
                         status=401, code="forbidden")
    if not hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"),
                               token.encode("utf-8", "surrogateescape")):
        _failed(request, address, "wrong token")
        raise AdminError("the admin token is wrong", status=403, code="forbidden")


def _failed(request: web.Request, address: str, why: str) -> None:
    count = request.app[AUTH_FAILURES].failed(address)
    if count is not None:
        log.warning("admin authentication failed from %s (%s): %d failure(s) since the last report",
                    address, why, count)


async def _json_object(request: web.Request) -> dict[str, Any]:
    try:
        raw = await read_body(request, _MAX_BODY, request.app[STATE].config.server.body_timeout)
    except BodyTooLarge:
        raise AdminError(f"body over {_MAX_BODY} bytes") from None
    if _nesting_depth(raw, _MAX_DEPTH) > _MAX_DEPTH:
        raise AdminError(f"body nests deeper than {_MAX_DEPTH} levels")
    try:
        body = json.loads(raw or b"null")
    except ValueError as exc:
        raise AdminError(f"body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise AdminError("body must be a JSON object")
    return body


def _nesting_depth(raw: bytes, limit: int) -> int:
    """How deep JSON arrays and objects nest (strings skipped), counted up to ``limit + 1``."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    break
        elif byte in (0x5D, 0x7D):  # ] }
            depth -= 1
    return deepest


def _provider(request: web.Request) -> str:
    name = request.match_info["id"]
    if not request.app[STATE].backend.has_provider(name):
        raise UnknownProvider.named(name)
    return name


def _limit_from(body: dict[str, Any]) -> int | None:
    if set(body) != {"limit"}:
        raise AdminError('body must be {"limit": <positive integer or null>}')
    try:
        return validate_limit(body["limit"])
    except ValueError as exc:
        raise AdminError(str(exc)) from exc


def _cooldown_from(body: dict[str, Any]) -> float:
    value = body.get("cooldown_ms")
    if set(body) != {"cooldown_ms"} or isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AdminError('body must be {"cooldown_ms": <milliseconds, a number >= 0>}')
    if not math.isfinite(value) or not 0 <= value <= MAX_COOLDOWN_MS:
        raise AdminError(f"cooldown_ms must be between 0 and {MAX_COOLDOWN_MS}, got {value}")
    return value / 1000.0


async def _provider_answer(request: web.Request, provider: str) -> web.Response:
    """That provider's status object, read after the write has landed (in Redis too)."""
    state = request.app[STATE]
    await state.backend.flush()
    await state.backend.refresh()
    return json_answer(provider_document(state, state.backend.provider_status(provider)))


async def _provider_write(
    request: web.Request, parse: Callable[[dict[str, Any]], T], apply: Callable[[str, T], str]
) -> web.Response:
    """Authorize, find the provider, validate the body, apply, log, answer its status.

    An ``AdminError`` on the way is rendered by the app's middleware, like every ``ProxyError``."""
    authorize(request)
    provider = _provider(request)
    value = parse(await _json_object(request))
    what = apply(provider, value)
    log.info("provider=%s %s via the admin API", provider, what)
    return await _provider_answer(request, provider)


def _level(request: web.Request, provider: str, kind: str) -> LimitLevelId:
    if kind == "key":
        return provider, "key", request.match_info["key"]
    if kind == "model":
        return provider, "model", request.match_info["pattern"]
    return provider, "provider", ""


def _level_words(level: LimitLevelId) -> str:
    _, kind, name = level
    return "limit" if kind == "provider" else f"{kind}={name} limit"


def _set_level_limit(backend: Backend, level: LimitLevelId, limit: int | None) -> None:
    """Raises UnknownLimit for a key or model cap the provider does not have."""
    provider, kind, name = level
    if kind == "key":
        backend.set_key_limit(provider, name, limit)
    elif kind == "model":
        backend.set_model_limit(provider, name, limit)
    else:
        backend.set_limit(provider, limit)


def _configured_limit(backend: Backend, level: LimitLevelId) -> int | None:
    provider, kind, name = level
    status = backend.provider_status(provider)
    if kind == "provider":
        return status.configured_limit
    levels = {key.name: key.configured_limit for key in status.keys} if kind == "key" else \
        {model.pattern: model.configured_limit for model in status.models}
    if name not in levels:
        what = "key" if kind == "key" else "model cap"
        raise UnknownLimit(f"provider '{provider}' has no {what} '{name}' (configured: {', '.join(levels) or 'none'})")
    return levels[name]


def _put_limit(kind: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    """A PUT of a provider's, a pool key's or a model cap's limit: a manual limit, marked with when it was set
    (status shows it until it is restored); 404 for a key or model cap the provider does not have."""

    async def put(request: web.Request) -> web.Response:
        state = request.app[STATE]

        def apply(provider: str, limit: int | None) -> str:
            level = _level(request, provider, kind)
            configured = _configured_limit(state.backend, level)
            _set_level_limit(state.backend, level, limit)
            state.manual_limits.set(level, limit, configured, int(time.time() * 1000))
            return f"{_level_words(level)} set to {'unlimited' if limit is None else limit}"

        return await _provider_write(request, _limit_from, apply)

    return put


def _restore_limit(kind: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    """A DELETE of a limit: back to the configured value, with no manual or auto-reduced mark left."""

    async def delete(request: web.Request) -> web.Response:
        authorize(request)
        state = request.app[STATE]
        level = _level(request, _provider(request), kind)
        configured = _configured_limit(state.backend, level)
        _set_level_limit(state.backend, level, configured)
        state.manual_limits.clear(level)
        log.info("provider=%s %s restored to the configured %s via the admin API", level[0], _level_words(level),
                 "unlimited" if configured is None else configured)
        return await _provider_answer(request, level[0])

    return delete


put_limit = _put_limit("provider")
put_key_limit = _put_limit("key")
put_model_limit = _put_limit("model")
restore_limit = _restore_limit("provider")
restore_key_limit = _restore_limit("key")
restore_model_limit = _restore_limit("model")


async def put_cooldown(request: web.Request) -> web.Response:
    backend = request.app[STATE].backend

    def apply(provider: str, seconds: float) -> str:
        backend.set_cooldown(provider, seconds)
        return f"release cooldown set to {seconds * 1000:g}ms"

    return await _provider_write(request, _cooldown_from, apply)


async def star(request: web.Request) -> web.Response:
    authorize(request)
    workspace = request.match_info["id"]
    if not valid_label(workspace):
        raise AdminError(f"'{workspace[:64]}' is not a valid workspace id")
    state = request.app[STATE]
    starred = request.method == "PUT"
    if not starred and workspace not in state.backend.starred():
        raise AdminError(f"workspace '{workspace}' is not starred", status=404, code="unknown_provider")
    try:
        stars = state.set_star(workspace, starred)
    except TooManyStars as exc:
        raise AdminError(str(exc)) from None
    await state.backend.flush()
    return json_answer({"workspace": workspace, "starred": starred, "starred_workspaces": sorted(stars)})


def add_routes(app: web.Application) -> None:
    app[AUTH_FAILURES] = AuthFailures(time.monotonic)
    app.router.add_put("/_slotproxy/providers/{id}/limit", put_limit)
    app.router.add_delete("/_slotproxy/providers/{id}/limit", restore_limit)
    app.router.add_put("/_slotproxy/providers/{id}/keys/{key}/limit", put_key_limit)
    app.router.add_delete("/_slotproxy/providers/{id}/keys/{key}/limit", restore_key_limit)
    app.router.add_put("/_slotproxy/providers/{id}/models/{pattern:.+}/limit", put_model_limit)
    app.router.add_delete("/_slotproxy/providers/{id}/models/{pattern:.+}/limit", restore_model_limit)
    app.router.add_put("/_slotproxy/providers/{id}/cooldown", put_cooldown)
    app.router.add_put("/_slotproxy/workspaces/{id}/star", star)
    app.router.add_delete("/_slotproxy/workspaces/{id}/star", star)
