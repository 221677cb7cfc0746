"""Upstream failures in words: the one boundary where aiohttp's and the OS's errors become sentences.

Every sentence names the upstream by host and port only (never a path, a query or
credentials, which may carry keys) and says what happened the way a person would:
``could not connect to api.openai.com:443 (connection refused)``, never a library's
class name. :func:`for_provider` puts the provider in front, the one form the relay
and the WebSocket relay use in error bodies, and the log lines print after
``provider=<id>``::

    provider 'openai': could not connect to api.openai.com:443 (connection refused)
    provider 'openai': could not resolve api.openai.com (name not known)
    provider 'openai': TLS certificate for api.openai.com:443 not valid (self-signed certificate)
    provider 'openai': upstream api.openai.com:443 closed the connection before answering
    provider 'openai': upstream api.openai.com:443 closed the stream after 19 chunks (connection reset)
    provider 'openai': upstream api.openai.com:443 sent no response headers within idle_timeout (60s)

Pure: no I/O; exceptions are read for their kind and attributes only.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import ssl

import aiohttp

__all__ = [
    "before_answer",
    "broke_off",
    "connect_timed_out",
    "for_provider",
    "idle",
    "place",
    "slot_timed_out",
]

# getaddrinfo's failures (socket.EAI_*), in words. Some constants are missing on some platforms.
_RESOLVER_WORDS = {
    getattr(socket, name): words
    for name, words in (
        ("EAI_NONAME", "name not known"),
        ("EAI_AGAIN", "temporary failure in name resolution"),
        ("EAI_FAIL", "name server failure"),
        ("EAI_NODATA", "the name has no address"),
        ("EAI_ADDRFAMILY", "the name has no address of that family"),
        ("EAI_SERVICE", "unknown service"),
    )
    if hasattr(socket, name)
}
# Connect-time errno values whose strerror is not the clearest wording.
_ERRNO_WORDS = {
    errno.ECONNREFUSED: "connection refused",
    errno.ECONNRESET: "connection reset",
    errno.ETIMEDOUT: "timed out",
    errno.ENETUNREACH: "network unreachable",
    errno.EHOSTUNREACH: "host unreachable",
    errno.EADDRNOTAVAIL: "address not available",
    errno.EACCES: "permission denied",
    errno.EPERM: "not permitted",
}
_ERRNO_IN_TEXT = re.compile(r"\[Errno (\d+)\]")
# OpenSSL reasons a newcomer meets, in words (others: the reason code, lower case, underscores as spaces).
_TLS_HINTS = {
    "WRONG_VERSION_NUMBER": "wrong version number: it may speak plain HTTP, try http://",
    "TLSV1_ALERT_PROTOCOL_VERSION": "no TLS version in common",
    "SSLV3_ALERT_HANDSHAKE_FAILURE": "handshake refused by the server",
}


def place(host: str | None, port: int | None) -> str:
    """``host:port`` as a person types it (``[::1]:443`` for an IPv6 address)."""
    name = host or "?"
    if ":" in name and not name.startswith("["):
        name = f"[{name}]"
    return name if port is None else f"{name}:{port}"


def for_provider(provider: str, what: str) -> str:
    """The one form of an upstream failure in an error body: ``provider 'openai': <what happened>``."""
    return f"provider '{provider}': {what}"


def before_answer(exc: BaseException, host: str | None, port: int | None) -> str:
    """Why no answer came: the connection failed (DNS, refused, TLS), or upstream broke off before its headers."""
    where = place(host, port)
    if isinstance(exc, aiohttp.ClientConnectorDNSError) or isinstance(_os_error(exc), socket.gaierror):
        return f"could not resolve {host or '?'} ({_resolver_words(_os_error(exc))})"
    if isinstance(exc, aiohttp.ClientConnectorCertificateError) or isinstance(
            _os_error(exc), ssl.SSLCertVerificationError):
        return f"TLS certificate for {where} not valid ({_certificate_words(exc)})"
    if isinstance(exc, aiohttp.ClientSSLError) or isinstance(_os_error(exc), ssl.SSLError):
        return f"TLS handshake with {where} failed ({_tls_words(_os_error(exc))})"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"could not connect to {where} ({_os_words(_os_error(exc))})"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return f"upstream {where} closed the connection before answering"
    if isinstance(exc, ConnectionResetError) or getattr(exc, "errno", None) == errno.ECONNRESET:
        return f"upstream {where} reset the connection before answering"
    if isinstance(exc, aiohttp.ClientResponseError):
        return f"upstream {where} sent an answer that is not valid HTTP ({_first_words(exc.message)})"
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"the connection to upstream {where} failed ({_os_words(exc)})"
    return f"the connection to upstream {where} failed before an answer"


def broke_off(exc: BaseException, host: str | None, port: int | None, chunks: int | None) -> str:
    """Upstream's answer had begun (its headers came) and stopped short; ``chunks`` relayed so far, None when
    the body was being read whole."""
    where = place(host, port)
    reset = "ConnectionResetError" in str(exc) or isinstance(exc, ConnectionResetError) \
        or getattr(exc, "errno", None) == errno.ECONNRESET
    how = " (connection reset)" if reset else ""
    if chunks is None:
        return f"upstream {where} closed the connection before its answer was complete{how}"
    return f"upstream {where} closed the stream after {_chunks(chunks)}{how}"


def connect_timed_out(host: str | None, port: int | None, seconds: float) -> str:
    return f"could not connect to {place(host, port)} within connect_timeout ({_duration(seconds)})"


def idle(host: str | None, port: int | None, seconds: float, chunks: int | None, headers_seen: bool) -> str:
    """``idle_timeout`` fired: before the response headers, or in the body after ``chunks`` (None: read whole)."""
    where, limit = place(host, port), f"idle_timeout ({_duration(seconds)})"
    if not headers_seen:
        return f"upstream {where} sent no response headers within {limit}"
    if chunks is None:
        return f"upstream {where} sent nothing for {limit} before its answer was complete"
    after = "its response headers" if chunks == 0 else _chunks(chunks)
    return f"upstream {where} sent nothing for {limit} after {after}"


def slot_timed_out(host: str | None, port: int | None, seconds: float) -> str:
    return f"upstream {place(host, port)} did not finish its answer within slot_timeout ({_duration(seconds)})"


# --- the parts ---------------------------------------------------------------------------


def _chunks(count: int) -> str:
    return f"{count} chunk" if count == 1 else f"{count} chunks"


def _duration(seconds: float) -> str:
    from ..config.types import format_duration  # loaded already wherever a relay runs

    return format_duration(seconds)


def _os_error(exc: BaseException) -> BaseException | None:
    """The OS-level error under aiohttp's wrapper (its ``os_error``, else the cause), or ``exc`` itself."""
    inner = getattr(exc, "os_error", None) or exc.__cause__
    return inner if isinstance(inner, OSError) else (exc if isinstance(exc, OSError) else None)


def _resolver_words(error: BaseException | None) -> str:
    code = getattr(error, "errno", None)
    if code in _RESOLVER_WORDS:
        return _RESOLVER_WORDS[code]
    text = getattr(error, "strerror", None)
    return text.lower() if isinstance(text, str) and text else "name not known"


def _os_words(error: BaseException | None) -> str:
    """An errno in words: ``connection refused``. asyncio reports several addresses' failures in one text."""
    code = getattr(error, "errno", None)
    if isinstance(code, int):
        return _errno_words(code)
    found = list(dict.fromkeys(int(n) for n in _ERRNO_IN_TEXT.findall(str(error or ""))))
    if found:
        return ", ".join(_errno_words(n) for n in found)
    return "connection failed"


def _errno_words(code: int) -> str:
    return _ERRNO_WORDS.get(code) or os.strerror(code).lower()


def _certificate_words(exc: BaseException) -> str:
    error = getattr(exc, "certificate_error", None) or _os_error(exc)
    message = getattr(error, "verify_message", None)
    if isinstance(message, str) and message:
        return message.rstrip(".")
    return _tls_words(error)


def _tls_words(error: BaseException | None) -> str:
    reason = getattr(error, "reason", None)
    if isinstance(reason, str) and reason:
        return _TLS_HINTS.get(reason, reason.lower().replace("_", " "))
    return "handshake failed"


def _first_words(message: object) -> str:
    """The first line of a parser's complaint, without its trailing colon: ``bad status line``."""
    line = str(message or "").strip().splitlines()[0] if str(message or "").strip() else "unreadable"
    line = line.rstrip(":. ")
    line = line[:1].lower() + line[1:]
    return line[:80]
