"""The slotproxy error tree.

::

    SlotproxyError                 base of everything slotproxy raises on purpose
    ├── ConfigError                a config file (or a reload) is invalid; .problems lists each
    │                              one as "key.path: what is wrong (line N)"
    ├── StateError                 the runtime state file cannot be read or written
    ├── AdminError                 an admin API body or id is wrong (carries an HTTP status)
    └── ProxyError                 a request the proxy answers itself, in the OpenAI error shape
        ├── QueueFull              503 queue_full: more than max_queue waiters
        ├── QueueTimeout           503 queue_timeout: waited longer than queue_timeout
        ├── ShuttingDown           503 shutting_down: SIGTERM grace period
        ├── UnknownProvider        404 unknown_provider
        ├── BodyTooLarge           413 body_too_large
        ├── BadRequest             400 bad_request
        ├── Forbidden              401/403 forbidden: a missing or wrong key, a refused Host or Origin
        ├── RequestTimeout         408 request_timeout: the request body stalled past body_timeout
        ├── TooManyConnections     503 too_many_connections: at max_connections, every connection busy
        ├── UpstreamUnreachable    502 upstream_unreachable
        ├── UpstreamTimeout        504 upstream_timeout
        ├── SpendLimitReached      429 spend_limit_reached: the workspace's spend today reached its cap
        └── WebSocketUnsupported   426 websocket_unsupported: the client falls back to HTTP at once

Foreign errors (aiohttp, YAML, pydantic, Redis) are translated into these at one
boundary each, with ``raise ... from exc``. An upstream's failure (connect, DNS,
TLS, a cut stream, a timeout) is put in words by ``proxy.http.upstream_errors``: host
and port, what happened, no library class names, no secrets.
"""

from __future__ import annotations

__all__ = [
    "AdminError",
    "BadRequest",
    "BodyTooLarge",
    "ConfigError",
    "Forbidden",
    "ProxyError",
    "QueueFull",
    "QueueTimeout",
    "RequestTimeout",
    "ShuttingDown",
    "SlotproxyError",
    "SpendLimitReached",
    "StateError",
    "TooManyConnections",
    "UnknownLimit",
    "UnknownProvider",
    "UpstreamTimeout",
    "UpstreamUnreachable",
    "WebSocketUnsupported",
]


class SlotproxyError(Exception):
    """Base class of every error slotproxy raises on purpose."""


class ConfigError(SlotproxyError):
    """A config is invalid. ``problems`` holds one line per problem, each with its key path."""

    def __init__(self, problems: list[str] | str, *, source: str | None = None) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(where + "; ".join(self.problems))


class StateError(SlotproxyError):
    """The state file could not be read or written."""


class ProxyError(SlotproxyError):
    """An answer the proxy makes itself, rendered in the OpenAI error shape."""

    status: int = 500
    code: str = "slotproxy_error"

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": "slotproxy_error", "code": self.code}}


class QueueFull(ProxyError):
    status, code = 503, "queue_full"


class QueueTimeout(ProxyError):
    status, code = 503, "queue_timeout"


class ShuttingDown(ProxyError):
    status, code = 503, "shutting_down"


class UnknownProvider(ProxyError):
    status, code = 404, "unknown_provider"

    @classmethod
    def named(cls, provider: str, configured: list[str] | None = None) -> UnknownProvider:
        """The one wording for a provider id that is not configured (``configured`` lists the known ones)."""
        known = "" if configured is None else f"; configured: {', '.join(configured) or 'none'}"
        return cls(f"unknown provider '{provider}'{known}")


class UnknownLimit(ProxyError):
    """A key or model cap the provider does not have (admin API)."""

    status, code = 404, "unknown_limit"


class BodyTooLarge(ProxyError):
    status, code = 413, "body_too_large"


class BadRequest(ProxyError):
    status, code = 400, "bad_request"


class Forbidden(ProxyError):
    """401 when a credential is missing, 403 when it is wrong."""

    code = "forbidden"

    def __init__(self, message: str, *, status: int = 403) -> None:
        super().__init__(message)
        self.status = status


class RequestTimeout(ProxyError):
    """The client stopped sending its body; the connection is closed after this answer."""

    status, code = 408, "request_timeout"


class TooManyConnections(ProxyError):
    status, code = 503, "too_many_connections"


class UpstreamUnreachable(ProxyError):
    status, code = 502, "upstream_unreachable"


class UpstreamTimeout(ProxyError):
    status, code = 504, "upstream_timeout"


class SpendLimitReached(ProxyError):
    """A workspace's spend today (UTC) reached its cap: answered in the provider's own error shape, so its
    SDK surfaces the code (OpenAI's ``error.code``, Anthropic's ``error.type``)."""

    status, code = 429, "spend_limit_reached"

    def __init__(self, message: str, *, retry_after: float, dialect: str = "openai") -> None:
        super().__init__(message, retry_after=retry_after)
        self.dialect = dialect

    def body(self) -> dict[str, object]:
        if self.dialect == "anthropic":
            return {"type": "error", "error": {"type": self.code, "message": self.message}}
        return {"error": {"message": self.message, "type": "rate_limit_error", "code": self.code}}


class SlotLost(ProxyError):
    """The slot an answer held was given up because its lease could not be kept in the shared backend."""

    status, code = 503, "backend_unavailable"

    def __init__(self, message: str, *, retry_after: float | None = 1.0) -> None:
        super().__init__(message, retry_after=retry_after)


class WebSocketUnsupported(ProxyError):
    """A WebSocket upgrade the proxy cannot serve: 426 makes clients such as Codex use HTTP at once, where
    any other refusal makes them retry the upgrade for seconds first."""

    status, code = 426, "websocket_unsupported"


class AdminError(ProxyError):
    """A bad admin API request; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, *, status: int = 400, code: str = "bad_request",
                 retry_after: float | None = None) -> None:
        super().__init__(message, retry_after=retry_after)
        self.status = status
        self.code = code
