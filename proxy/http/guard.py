"""Who may call the proxy at all: the Host, Origin and path rules of the local threat model.

slotproxy injects provider keys, and usually runs on a developer's machine next
to a browser. Any page that browser opens can send requests to 127.0.0.1, and a
DNS-rebinding page can even make them same-origin for itself. So a request is
served only when its Host names this proxy (a loopback literal, ``localhost`` or
a configured name) and it does not come from a web page the config does not
allow. Agent SDKs and CLIs send no ``Origin`` and no ``Sec-Fetch-*`` headers, so
these rules never stand in their way.

Everything here is pure: it reads header values and the configured lists and
answers; the HTTP middleware applies the answers.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import unquote

from ..errors import BadRequest, UnknownProvider

__all__ = [
    "BrowserGuard",
    "check_path",
    "host_name",
    "is_loopback_address",
]

DASHBOARD_PATHS = frozenset({"/_slotproxy/", "/_slotproxy"})
_CROSS = frozenset({"cross-site", "same-site"})
_PORT = re.compile(r":[0-9]{1,5}$")
_SEPARATORS = re.compile(r"[/\\]")
_MAX_DECODE_ROUNDS = 3
_HOSTS_REMEMBERED = 64


def is_loopback_address(host: str) -> bool:
    """A listen address (or Host name) that only this machine can reach: 127.0.0.0/8, ``::1`` or
    ``localhost``, as literals, never a name DNS could rebind."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(host_header: str) -> str:
    """The name part of a Host value, lower-case: ``[::1]:8787`` → ``::1``, ``Proxy:80`` → ``proxy``."""
    value = host_header.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        return value[1:end] if end > 0 else value
    return _PORT.sub("", value)


@dataclass(frozen=True, slots=True)
class BrowserGuard:
    """The Host allowlist and the Origin / Sec-Fetch-Site rule, for one listen address."""

    loopback_listener: bool
    allowed_hosts: frozenset[str] = frozenset()
    allowed_origins: frozenset[str] = frozenset()
    _decided: dict[str, bool] = field(default_factory=dict, compare=False, repr=False)
    """Host values already judged: clients send the same one on every request (a few entries at most)."""

    @classmethod
    def for_listener(cls, listen_host: str, allowed_hosts: tuple[str, ...] = (),
                     allowed_origins: tuple[str, ...] = ()) -> BrowserGuard:
        return cls(is_loopback_address(listen_host), frozenset(h.lower() for h in allowed_hosts),
                   frozenset(o.lower() for o in allowed_origins))

    def host_allowed(self, host_header: str | None) -> bool:
        """On a loopback listener, only loopback literals and ``allowed_hosts``; elsewhere any Host,
        unless ``allowed_hosts`` is set. A request with no Host at all is no browser's."""
        if host_header is None or "*" in self.allowed_hosts:
            return True
        decided = self._decided.get(host_header)
        if decided is None:
            decided = self._judge(host_header)
            if len(self._decided) < _HOSTS_REMEMBERED:
                self._decided[host_header] = decided
        return decided

    def _judge(self, host_header: str) -> bool:
        value = host_header.strip().lower()
        name = host_name(value)
        if name in self.allowed_hosts or value in self.allowed_hosts:
            return True
        if not self.loopback_listener and not self.allowed_hosts:
            return True
        return is_loopback_address(name)

    def origin_allowed(self, origin: str, host_header: str | None) -> bool:
        """The proxy's own origin (so the dashboard works) or one listed in ``allowed_origins``."""
        origin = origin.strip().lower()
        own = host_header is not None and origin == "http://" + host_header.strip().lower()
        return own or origin in self.allowed_origins

    def refusal(self, method: str, path: str, headers: Mapping[str, str]) -> str | None:
        """Why a request that a web page may have sent is refused, or None when it may be served."""
        origin = headers.get("Origin")
        if origin is not None:
            if self.origin_allowed(origin, headers.get("Host")):
                return None
            return (f"requests from the web page origin '{origin[:100]}' are refused: add it to "
                    "server.allowed_origins to allow it")
        site = headers.get("Sec-Fetch-Site", "").strip().lower()
        if site not in _CROSS:
            return None
        if path in DASHBOARD_PATHS and _top_level_navigation(method, headers):
            return None
        return ("requests sent by another web site are refused: list that site's origin in "
                "server.allowed_origins to allow it")


def _top_level_navigation(method: str, headers: Mapping[str, str]) -> bool:
    """A link followed in a browser tab; not a frame, which navigates too but sits inside the other page."""
    if method != "GET" or headers.get("Sec-Fetch-Mode", "").strip().lower() != "navigate":
        return False
    return headers.get("Sec-Fetch-Dest", "document").strip().lower() == "document"


def check_path(raw_path: str) -> None:
    """Raise ``BadRequest`` (or ``UnknownProvider``) for a raw request path that is refused.

    The first segment must be written as is (``/%5fslotproxy`` is not the admin
    API, and no path ACL in front of the proxy would see it as such). Dot segments
    hidden by percent-encoding (once or twice), Tomcat-style ``..;`` segments and
    backslashes are refused outright: upstreams and proxies behind them disagree
    on what they mean.
    """
    path = raw_path.partition("?")[0]
    if "\\" in path:
        raise BadRequest("backslashes are not allowed in the request path")
    if "%" not in path and ";" not in path:
        return
    first = path[1:].partition("/")[0]
    if "%" in first:
        raise UnknownProvider("the first path segment must be written without percent-encoding "
                              "(it names a provider or one of the proxy's own routes)")
    for segment in path.split("/"):
        for form in _decoded_forms(segment):
            if "\\" in form:
                raise BadRequest("backslashes are not allowed in the request path, encoded or not")
            if any(part in (".", "..") or part.startswith(("..;", ".;")) for part in _SEPARATORS.split(form)):
                raise BadRequest("encoded dot segments and '..;' segments are not allowed in the request path")


def _decoded_forms(segment: str) -> list[str]:
    """The segment as written and as decoded once, twice and three times (until nothing changes)."""
    forms = [segment]
    for _ in range(_MAX_DECODE_ROUNDS):
        decoded = unquote(forms[-1])
        if decoded == forms[-1]:
            break
        forms.append(decoded)
    return forms
