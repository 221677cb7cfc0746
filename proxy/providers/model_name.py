"""Which model a request asks for: the body's top-level ``model``, or the ``{model}`` of a Gemini-style path.

Read only when the provider has model caps. Agents' bodies can be large (a long
conversation is hundreds of KB), and SDKs write ``model`` first, so a scan of the
body's opening finds it without parsing the body; only a body where it is not
first is parsed, once.
"""

from __future__ import annotations

import json
import re

__all__ = ["frame_model", "model_hint", "request_model"]

_LEADING_MODEL = re.compile(rb'\s*\{\s*"model"\s*:\s*"((?:[^"\\]|\\.){1,256})"')
_PLAIN_LEADING_MODEL = re.compile(rb'\s*\{\s*"model"\s*:\s*"([^"\\]{1,256})"')
_FRAME_MODEL = re.compile(rb'"model"\s*:\s*"((?:[^"\\]|\\.){1,256})"')
_PATH_MODEL = re.compile(r"(?:^|/)models/([^/:]{1,256}):")
_SCAN = 1024
_HINT_WINDOW = 4096
_PARSE_AT_MOST = 8 << 20


def request_model(path: str, body: bytes) -> str | None:
    """The model named by ``path`` (the part after the provider's prefix, decoded) or by the JSON ``body``."""
    in_path = _PATH_MODEL.search(path)
    if in_path is not None:
        return in_path.group(1)
    if not body:
        return None
    leading = _LEADING_MODEL.match(body, 0, _SCAN)
    if leading is not None:
        return _string(leading.group(1))
    data = _parsed(body)
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) and model else None


def model_hint(path: str, body: bytes) -> str | None:
    """The model a request names, for showing it and recording it (not for a model cap): the path's, else
    a top-level-looking ``"model"`` in the body's first or last 4 KiB (SDKs write it first, some last),
    never a parse of the body. A body that names it only in its middle shows none."""
    if "models/" in path and (in_path := _PATH_MODEL.search(path)) is not None:
        return in_path.group(1)
    if not body:
        return None
    plain = _PLAIN_LEADING_MODEL.match(body, 0, _SCAN)  # the common case, without escapes: one quick match
    if plain is not None:
        return plain.group(1).decode("utf-8", "replace")
    found = _LEADING_MODEL.match(body, 0, _SCAN) or _FRAME_MODEL.search(body, 0, _HINT_WINDOW) \
        or _FRAME_MODEL.search(body, max(0, len(body) - _HINT_WINDOW))
    return _string(found.group(1)) if found is not None else None


def frame_model(frame: bytes) -> str | None:
    """The model a WebSocket ``response.create`` frame names: its ``model`` (or its ``response``'s), found in
    the frame's opening (after its ``type``), else by one parse."""
    found = _FRAME_MODEL.search(frame, 0, _SCAN)
    if found is not None:
        return _string(found.group(1))
    data = _parsed(frame)
    if not isinstance(data, dict):
        return None
    nested = data.get("response")
    model = data.get("model") or (nested.get("model") if isinstance(nested, dict) else None)
    return model if isinstance(model, str) and model else None


def _string(raw: bytes) -> str | None:
    """A JSON string's content as matched (escapes decoded)."""
    if b"\\" not in raw:
        return raw.decode("utf-8", "replace")
    try:
        value = json.loads(b'"' + raw + b'"')
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _parsed(body: bytes) -> object:
    if len(body) > _PARSE_AT_MOST or body.lstrip()[:1] != b"{":
        return None
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
