"""Optional client keys (``access.keys_env``): who may use the proxy at all.

A client presents its key as ``X-Slotproxy-Key: <key>``, or, where its SDK can
only send one credential, as the ``Authorization: Bearer`` or ``x-api-key``
value (as with LiteLLM's virtual keys). A key presented in Authorization or
x-api-key is consumed: it is never forwarded upstream. Keys are compared in
constant time, against every configured key.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from ..errors import Forbidden

__all__ = ["CLIENT_KEY_HEADER", "ClientKeys"]

CLIENT_KEY_HEADER = "X-Slotproxy-Key"


def _bearer(value: str | None) -> str | None:
    if not value:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


class ClientKeys:
    def __init__(self, keys: frozenset[bytes], env_name: str) -> None:
        self._keys = tuple(keys)
        self._env_name = env_name

    @classmethod
    def from_env(cls, env_name: str | None, environ: Mapping[str, str]) -> ClientKeys | None:
        if not env_name:
            return None
        raw = environ.get(env_name, "")
        keys = frozenset(k.strip().encode() for k in raw.split(",") if k.strip())
        return cls(keys, env_name)

    def _matches(self, candidate: str) -> bool:
        given = candidate.encode("utf-8", "surrogateescape")
        found = False
        for key in self._keys:
            found |= hmac.compare_digest(given, key)
        return found

    def check(self, headers: Mapping[str, str], *, provider_key_injected: bool) -> frozenset[str]:
        """Raise Forbidden (401 none given, 403 wrong); else the lower-case header names to strip.

        ``X-Slotproxy-Key``, when sent, is the only key considered. Otherwise the
        Authorization/x-api-key value counts as the client key only where the proxy
        injects the provider's key; elsewhere those carry the client's provider key.
        """
        dedicated = headers.get(CLIENT_KEY_HEADER)
        if dedicated:
            offered = [(CLIENT_KEY_HEADER.lower(), dedicated)]
        elif provider_key_injected:
            offered = [(name, value) for name, value in (
                ("authorization", _bearer(headers.get("Authorization"))),
                ("x-api-key", headers.get("x-api-key")),
            ) if value]
        else:
            offered = []
        if not offered:
            raise Forbidden(f"a client key is required: send it as '{CLIENT_KEY_HEADER}: <key>'", status=401)
        for name, value in offered:
            if self._matches(value):
                return frozenset({CLIENT_KEY_HEADER.lower(), name})
        raise Forbidden("the client key is not valid", status=403)
