"""Asking a running proxy over HTTP (the standard library only): its status and usage documents, the
reasons it could not be asked in words, and the errors a command reports in one line.
"""

from __future__ import annotations

import time

TYPE_CHECKING = False  # typing's own costs an import on every call; mypy reads this name the same
if TYPE_CHECKING:
    from typing import Any

__all__ = ["DEFAULT_URL", "EXIT_USAGE", "USAGE_PATH", "CliError", "Unreachable", "base_url", "fetch_json",
           "fetch_status"]

DEFAULT_URL = "http://127.0.0.1:8787"
STATUS_PATH = "/_slotproxy/status"
USAGE_PATH = "/_slotproxy/usage"
STATUS_TIMEOUT = 5.0
EXIT_USAGE = 2


class CliError(Exception):
    """A problem to report in one line before exiting with ``exit_code``."""

    exit_code = EXIT_USAGE


class Unreachable(CliError):
    """No slotproxy answered where the command looked: exit 1, as for any failed query."""

    exit_code = 1


def base_url(url: str) -> str:
    """``--url`` without a trailing slash; ``host:port`` alone means ``http://host:port``."""
    from urllib.parse import urlsplit

    text = url.strip()
    if "://" not in text:
        text = f"http://{text}"
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise CliError(f"--url must be the proxy's base URL, such as {DEFAULT_URL} (got {url!r})")
    return text.rstrip("/")


def fetch_status(url: str, timeout: float = STATUS_TIMEOUT) -> tuple[dict[str, Any], float]:
    """The status document at ``url`` and the server's clock minus this one's (ms; 0 unless they
    clearly differ). ``Unreachable`` says in one line why there is none."""
    data, date = fetch_json(url, STATUS_PATH, timeout=timeout)
    if not isinstance(data.get("providers"), list):
        raise Unreachable(f"{url} answers, but not as slotproxy ({STATUS_PATH} is no status document); "
                          "check --url")
    return data, _clock_skew(date)


def fetch_json(url: str, path: str, query: dict[str, str] | None = None, *,
               timeout: float = STATUS_TIMEOUT) -> tuple[dict[str, Any], str | None]:
    """A JSON object from the running proxy and its Date header. A 400 (a bad option) is a ``CliError``
    with the proxy's reason; no answer is ``Unreachable``."""
    import http.client
    import json
    import urllib.error
    import urllib.parse
    import urllib.request

    target = url + path + ("?" + urllib.parse.urlencode(query) if query else "")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via $http_proxy
    try:
        with opener.open(target, timeout=timeout) as response:
            body = response.read()
            date = response.headers.get("Date")
    except urllib.error.HTTPError as exc:
        if exc.code == 400:
            raise CliError(_http_refusal(url, exc, path)) from None
        raise Unreachable(_http_refusal(url, exc, path)) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        raise Unreachable(f"no slotproxy answers at {url} ({_reason_in_words(reason, timeout)}); start it with "
                          "`slotproxy serve`, or pass --url") from None
    except http.client.HTTPException:
        raise Unreachable(f"{url} answers, but not in HTTP; check --url") from None
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise Unreachable(f"{url} answers, but not as slotproxy ({path} is no JSON object); check --url")
    return data, date


def _reason_in_words(reason: object, timeout: float) -> str:
    import socket
    import ssl

    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, TimeoutError):
        return f"no answer within {timeout:g} s"
    if isinstance(reason, socket.gaierror):
        return "host not found"
    if isinstance(reason, ssl.SSLCertVerificationError):
        return f"TLS certificate not valid: {reason.verify_message}"
    if isinstance(reason, ConnectionResetError):
        return "connection reset"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror[:1].lower() + reason.strerror[1:]
    return str(reason)


def _http_refusal(url: str, exc: Any, path: str = STATUS_PATH) -> str:
    import json

    try:
        message = json.loads(exc.read())["error"]["message"]
    except Exception:  # noqa: BLE001 - any body that is not our error shape: the status code says enough
        message = None
    if exc.code == 404 and not message:
        return f"{url} answers, but not as slotproxy (HTTP 404 for {path}); check --url"
    return f"{url} refused the request for {path}: HTTP {exc.code}" + (f": {message}" if message else "")


def _clock_skew(date: str | None) -> float:
    """Server clock minus ours, in ms, from the one-second ``Date`` header: 0 unless off by over 1.5 s."""
    if not date:
        return 0.0
    from email.utils import parsedate_to_datetime

    try:
        server = parsedate_to_datetime(date).timestamp() * 1000 + 500
    except (TypeError, ValueError):
        return 0.0
    offset = server - time.time() * 1000
    return offset if abs(offset) > 1500 else 0.0
