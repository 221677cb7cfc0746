"""What a request will cost each token window, estimated before it is sent, and learned from the answers.

Pure: the caller passes the body, the time and, afterwards, the usage the answer
reported (``TokenCounts``: ``input_tokens`` is all input, cache reads and writes
included; ``cached_input_tokens`` was read from a cache; ``cache_write_tokens``
was written to one). One ``Estimator`` per provider.

- *Input*: the body's bytes x the model group's tokens-per-byte ratio. The ratio
  is learned per model group (the tokenizer is the model's, whatever the key):
  the input tokens an answer reports over its body's bytes; the one in use is the
  p90 of the last 50 (0.30 before any answer), raised after a window hit.
- *Anthropic's prompt cache*, mirrored per key and model group: the request's
  content blocks in cache order (tools, system, then each message's blocks), one
  cumulative hash over their canonical form without ``cache_control`` (one pass,
  linear in the body's size). A prefix ending at a ``cache_control`` breakpoint
  is remembered for 5 minutes (an hour with ``"ttl": "1h"``) once its answer
  shows the cache was used (a read or a write): a request sent alongside the one
  writing it would not find it either. A request reads the longest remembered
  prefix it starts with, at a block boundary at most 20 blocks before one of its
  own breakpoints (as Anthropic looks back), if that prefix is at least 1024
  tokens (the smallest prefix Anthropic caches); the read renews it. An answer
  that read nothing from the cache drops what the request was believed to read.
- *Images* sent inline (base64: Anthropic's ``image`` source, OpenAI's ``data:``
  ``image_url``): a provider charges an image by its pixels, not by its base64
  length, so its payload is left out of the bytes and it counts as the group's
  p90 of image tokens (learned from the answers of requests with images, over
  what their text was estimated at; 1600 before any, Anthropic's figure for a
  full-size image).
- *Output*: the group's p90 of its last 50 answers' output tokens, never above
  the request's own maximum; before any answer, that maximum, else 1024.
- *OpenAI's tokens_per_minute*: the larger of the request's maximum output and
  its input estimate, as OpenAI charges it; a request that gives no maximum is
  charged its input estimate plus the output estimate above (OpenAI charges its
  output when it ends, and nothing is given back: leaning high holds it before
  that bill arrives rather than after).
- *WebSocket continuations* (``previous_response_id``): the previous response's
  reported input and output tokens plus the frame's bytes x the ratio.
"""

from __future__ import annotations

import hashlib
import json
import math
from bisect import bisect_left, insort
from collections import OrderedDict, deque
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from .request_body import RequestBody, as_parsed, max_output

__all__ = ["INPUT_WINDOW", "OUTPUT_WINDOW", "REQUESTS_WINDOW", "TOKENS_WINDOW", "Estimate", "Estimator", "RequestBody",
           "actual_for", "admitted_for"]

INPUT_WINDOW = "input_tokens_per_minute"
OUTPUT_WINDOW = "output_tokens_per_minute"
TOKENS_WINDOW = "tokens_per_minute"
REQUESTS_WINDOW = "requests_per_minute"
_WINDOWS = (INPUT_WINDOW, OUTPUT_WINDOW, TOKENS_WINDOW, REQUESTS_WINDOW)
_DIALECTS = ("anthropic", "openai")

PRIOR_RATIO = 0.30
PRIOR_OUTPUT = 1024
RECENT = 50
MAX_RATIO = 4.0
"""A reported ratio above this (a tiny body, a hidden system prompt) is taken as this."""
RATIO_MIN_BYTES = 2048
"""Bodies smaller than this teach no ratio: their JSON around the text (model, roles, settings) is much of
their bytes and counts no token, so a probe's "hi" (0.01 tokens a byte) would have the next long prompt
estimated at a twentieth of its tokens. Until a body this large is answered the prior stands (leaning high,
as a small request costs little)."""
RAISE_BY = 1.25
MAX_RAISE = 2.0
RAISE_KEPT = 0.9
"""After each answer, the part of a raise above 1 that remains."""
SHORT_TTL = 300.0
LONG_TTL = 3600.0
LOOKBACK = 20
MIN_CACHED_TOKENS = 1024
PRIOR_IMAGE_TOKENS = 1600
_MEDIA_MARK = b"base64"
_CACHE_MARK = b'"cache_control"'
_ERRORS_OF_INPUT = "input"


@dataclass(frozen=True)
class _CacheNote:
    """The mirrored cache's part in one estimate: the prefixes it believes the request reads (the longest
    and the remembered ones before it), and the breakpoints the request writes."""

    read: tuple[bytes, ...]
    breakpoints: tuple[tuple[bytes, float], ...]


@dataclass(slots=True)
class Estimate:
    """What one request is expected to cost: ``cost`` per window asked for; ``input`` all its input tokens
    (cache reads included), ``cache_read`` the part the mirrored cache says will be read."""

    cost: dict[str, float]
    input_bytes: int
    cache_read: float
    input: float
    output: float
    dialect: str = "openai"
    carried: float = 0.0
    """Tokens a WebSocket continuation carries from the previous response (part of ``input``)."""
    images: int = 0
    """Inline images, counted apart: ``input_bytes`` is the body's bytes less their payloads."""
    cache: _CacheNote | None = field(default=None, repr=False, compare=False)
    asked: int | None = None
    """The request's own output maximum (None: it named none)."""


def actual_for(dialect: str, window: str, input_tokens: int, cached_read: int, cache_write: int,
               output_tokens: int) -> float:
    """What the provider counted in ``window`` for an answer's usage. ``input_tokens`` is all input, cache
    reads and writes included (``TokenCounts.input_tokens``), so Anthropic's input window, which counts
    writes and not reads, is ``input_tokens - cached_read``; ``cache_write`` is already part of it."""
    del dialect, cache_write  # the windows count the same whatever the dialect; writes are inside input_tokens
    if window == INPUT_WINDOW:
        return float(max(0, input_tokens - cached_read))
    if window == OUTPUT_WINDOW:
        return float(output_tokens)
    if window == TOKENS_WINDOW:
        return float(input_tokens + output_tokens)
    if window == REQUESTS_WINDOW:
        return 1.0
    raise ValueError(_unknown_window(window))


def admitted_for(window: str, input_tokens: int, cached_read: int, asked: int | None) -> float:
    """What the provider charged ``window`` when it admitted the request, from the usage its answer reported:
    Anthropic's input window the input less the cache reads (it counts the prompt it is sent), its output
    window nothing yet (the output is charged as it is produced), OpenAI's tokens window the larger of the
    maximum output asked and the input; a request window, one."""
    if window == INPUT_WINDOW:
        return float(max(0, input_tokens - cached_read))
    if window == OUTPUT_WINDOW:
        return 0.0
    if window == TOKENS_WINDOW:
        return float(max(asked or 0, input_tokens))
    if window == REQUESTS_WINDOW:
        return 1.0
    raise ValueError(_unknown_window(window))


class _Recent:
    """The last ``RECENT`` values, kept in order as well as in arrival order (one insertion per answer, not
    a sort): the ratio and output histories, whose p90 each estimate reads."""

    __slots__ = ("ordered", "p90", "values")

    def __init__(self) -> None:
        self.values: deque[float] = deque()
        self.ordered: list[float] = []
        self.p90: float | None = None
        """The nearest-rank p90 of the values (None: none yet), kept as each comes: every estimate reads it."""

    def add(self, value: float) -> None:
        values, ordered = self.values, self.ordered
        values.append(value)
        if len(values) > RECENT:
            del ordered[bisect_left(ordered, values.popleft())]
        insort(ordered, value)
        self.p90 = ordered[(9 * len(ordered) + 9) // 10 - 1]  # ceil(0.9 n) - 1, in integers

    @property
    def p50(self) -> float | None:
        return _percentile(self.ordered, 0.5) if self.ordered else None


class _Errors:
    """The last ``RECENT`` estimate errors, only read by status: kept in arrival order, sorted when read."""

    __slots__ = ("values",)

    def __init__(self) -> None:
        self.values: deque[float] = deque(maxlen=RECENT)
        """Appended to by ``Estimator.learn``."""

    @property
    def p50(self) -> float | None:
        return _percentile(sorted(self.values), 0.5) if self.values else None

    @property
    def p90(self) -> float | None:
        return _percentile(sorted(self.values), 0.9) if self.values else None


class _Group:
    __slots__ = ("errors", "images", "outputs", "raised", "ratios")

    def __init__(self) -> None:
        self.ratios = _Recent()
        self.outputs = _Recent()
        self.images = _Recent()
        self.errors: dict[str, _Errors] = {}
        self.raised = 1.0

    def ratio(self) -> float:
        learned = self.ratios.p90
        return (PRIOR_RATIO if learned is None else learned) * self.raised

    def image_tokens(self) -> float:
        learned = self.images.p90
        return (PRIOR_IMAGE_TOKENS if learned is None else learned) * self.raised


class Estimator:
    """Estimates for one provider. Ratios and output histories are kept per model group, the mirrored
    prompt cache per key and model group; both are bounded (least recently used dropped first)."""

    actual_for = staticmethod(actual_for)

    def __init__(self, *, groups_kept: int = 1024, prefixes_kept: int = 50_000) -> None:
        self._groups: OrderedDict[str, _Group] = OrderedDict()
        self._last: tuple[str, _Group] | None = None
        """The group last used and its stats: already the most recently used (a request's estimate and the
        learning from its answer find it without a lookup)."""
        self._prefixes: OrderedDict[bytes, tuple[float, float]] = OrderedDict()
        """A prefix's digest (its key, group and model are hashed in) -> (expires at, lifetime)."""
        self._groups_kept = groups_kept
        self._prefixes_kept = prefixes_kept
        self._checked: dict[tuple[str, object], bool] = {}
        """(dialect, windows) already found valid: whether a token window is among them."""

    def estimate(self, *, dialect: str, key: str | None, group: str, body: bytes,
                 request: Mapping[str, Any] | None, windows: Collection[str],
                 continuation: tuple[int, int] | None = None, now: float) -> Estimate:
        """The cost of a request about to be sent. ``request`` is the parsed ``body`` when the caller has
        it (the body is parsed here otherwise, once, and only when a token window needs it)."""
        checked = (dialect, windows)
        tokens = self._checked.get(checked)
        if tokens is None:
            _check(dialect, windows)
            tokens = any(window != REQUESTS_WINDOW for window in windows)
            if type(windows) is tuple and len(self._checked) < _CHECKED_KEPT:
                self._checked[checked] = tokens
        last = self._last
        stats = last[1] if last is not None and last[0] == group else self._group(group)
        learned = stats.ratios.p90  # ``_Group.ratio``, written out: read on every request
        ratio = (PRIOR_RATIO if learned is None else learned) * stats.raised
        carried = float(sum(continuation)) if continuation is not None else 0.0
        if not tokens:
            return Estimate({w: 1.0 for w in windows}, len(body), 0.0, len(body) * ratio + carried, 0.0,
                            dialect, carried)
        if request is None:
            request = RequestBody(body)
        images = 0
        counted = len(body)
        if _MEDIA_MARK in body:
            media = _Media()
            _find_media(as_parsed(request), media)
            images, counted = media.images, counted - media.payload
        image_tokens = stats.image_tokens() if images or dialect == "anthropic" else 0.0
        total_input = counted * ratio + images * image_tokens + carried
        asked = request.max_output() if type(request) is RequestBody else max_output(request)
        history = stats.outputs.p90
        if history is None:
            output = float(asked if asked is not None else PRIOR_OUTPUT)
        else:
            output = history  # min(history, float(asked)), without the call
            if asked is not None and float(asked) < history:
                output = float(asked)
        read, note = 0.0, None
        if dialect == "anthropic" and INPUT_WINDOW in windows and continuation is None and _CACHE_MARK in body:
            read, note = self._mirror(key, group, as_parsed(request), counted, ratio, image_tokens, images > 0,
                                      now)
        cost = {}
        for window in windows:
            if window == INPUT_WINDOW:
                cost[window] = max(0.0, total_input - read)
            elif window == OUTPUT_WINDOW:
                cost[window] = output
            elif window == TOKENS_WINDOW:
                if asked is None:
                    cost[window] = total_input + output
                else:  # max(float(asked), total_input), without the call
                    most = float(asked)
                    cost[window] = total_input if total_input > most else most  # noqa: FURB136
            else:
                cost[window] = 1.0
        return Estimate(cost, counted, read, total_input, output, dialect, carried, images, note, asked)

    def learn(self, *, key: str | None, group: str, estimate: Estimate, input_tokens: int, cached_read: int,
              output_tokens: int, now: float, cache_write: int | None = None) -> None:
        """An answer's usage: the ratio (not from a continuation, whose body is only the new frame), the
        output history, each window's estimate error, and the mirrored cache. ``cache_write`` None means
        unknown; an answer that read and wrote nothing leaves the request's breakpoints unremembered."""
        del key  # the ratio is the group's; the cache digests carry the key
        last = self._last
        stats = last[1] if last is not None and last[0] == group else self._group(group)
        if estimate.images:
            text = estimate.input_bytes * (stats.ratios.p90 or PRIOR_RATIO) + estimate.carried
            stats.images.add(max(0.0, input_tokens - text) / estimate.images)
        elif estimate.input_bytes >= RATIO_MIN_BYTES and not estimate.carried and input_tokens > 0:
            ratio = input_tokens / estimate.input_bytes
            stats.ratios.add(ratio if ratio < MAX_RATIO else MAX_RATIO)  # noqa: FURB136 - min, without the call
        stats.outputs.add(float(output_tokens))
        if stats.raised != 1.0:
            stats.raised = 1.0 + (stats.raised - 1.0) * RAISE_KEPT
        errors = stats.errors
        if estimate.input > 0:
            (errors.get(_ERRORS_OF_INPUT) or _errors(stats, _ERRORS_OF_INPUT)).values.append(
                input_tokens / estimate.input - 1.0)
        for window, charged in estimate.cost.items():
            if window != REQUESTS_WINDOW and charged > 0:
                actual = actual_for(estimate.dialect, window, input_tokens, cached_read, cache_write or 0,
                                    output_tokens)
                (errors.get(window) or _errors(stats, window)).values.append(actual / charged - 1.0)
        if estimate.cache is not None:
            self._learn_cache(estimate.cache, cached_read, cache_write, now)

    def raise_ratio(self, key: str | None, group: str) -> None:
        """After a window hit: the group's ratio x1.25, at most x2 the learned one; it eases back with
        each answer."""
        del key
        stats = self._group(group)
        stats.raised = min(MAX_RAISE, stats.raised * RAISE_BY)

    def basis(self, group: str) -> tuple[bool, float, float | None, float | None]:
        """What the group's estimates rest on now (``recost.Basis``): answered yet, ratio, output and image p90."""
        stats = self._groups.get(group) or _Group()
        return bool(stats.outputs.values), stats.ratio(), stats.outputs.p90, stats.images.p90

    def status(self, key: str | None, group: str, window: str | None = None) -> dict[str, float | None]:
        """The ratio in use and the recent errors ``actual/estimate - 1``: of ``window``'s estimates, or
        of the whole input estimate when no window is named (None before any answer)."""
        del key
        stats = self._groups.get(group)
        if stats is None:
            return {"ratio": PRIOR_RATIO, "estimate_error_p50": None, "estimate_error_p90": None}
        errors = stats.errors.get(window or _ERRORS_OF_INPUT)
        return {"ratio": stats.ratio(),
                "estimate_error_p50": errors.p50 if errors is not None else None,
                "estimate_error_p90": errors.p90 if errors is not None else None}

    def _group(self, group: str) -> _Group:
        stats = self._groups.get(group)
        if stats is None:
            stats = self._groups[group] = _Group()
            if len(self._groups) > self._groups_kept:
                self._groups.popitem(last=False)
        else:
            self._groups.move_to_end(group)
        self._last = (group, stats) if group in self._groups else None
        return stats

    def _mirror(self, key: str | None, group: str, request: Mapping[str, Any], counted: int, ratio: float,
                image_tokens: float, with_media: bool, now: float) -> tuple[float, _CacheNote | None]:
        """The tokens the request will read from the mirrored cache, and what it writes."""
        seed = json.dumps([key, group, request.get("model")]).encode()
        try:
            digests, sizes, images, breakpoints = _walk(request, seed, with_media)
        except RecursionError:  # nested deeper than this stack allows: counted as uncached
            return 0.0, None
        if not breakpoints:
            return 0.0, None
        scale = min(1.0, counted / sizes[-1]) if sizes[-1] else 1.0
        read, longest = 0.0, -1
        for at in _candidates([at for at, _ in breakpoints]):
            entry = self._prefixes.get(digests[at])
            if entry is None:
                continue
            if entry[0] <= now:
                del self._prefixes[digests[at]]
                continue
            tokens = sizes[at] * scale * ratio + images[at] * image_tokens
            if tokens >= MIN_CACHED_TOKENS:
                read, longest = tokens, at
                self._remember(digests[at], entry[1], now)
            break
        believed = tuple(digests[at] for at, _ in breakpoints if at < longest)
        note = _CacheNote(believed + (digests[longest],) if longest >= 0 else (),
                          tuple((digests[at], ttl) for at, ttl in breakpoints))
        return read, note

    def _learn_cache(self, note: _CacheNote, cached_read: int, cache_write: int | None, now: float) -> None:
        if note.read and cached_read == 0:
            for digest in note.read:  # the provider had none of it: dropped early, or never written
                self._prefixes.pop(digest, None)
        if cache_write is not None and cache_write == 0 and cached_read == 0:
            return
        for digest, ttl in note.breakpoints:
            self._remember(digest, ttl, now)

    def _remember(self, digest: bytes, ttl: float, now: float) -> None:
        known = self._prefixes.get(digest)
        if known is not None and known[0] > now:
            ttl = max(ttl, known[1])
        self._prefixes[digest] = (now + ttl, ttl)
        self._prefixes.move_to_end(digest)
        while len(self._prefixes) > self._prefixes_kept:
            self._prefixes.popitem(last=False)


def _walk(request: Mapping[str, Any], seed: bytes, with_media: bool) -> tuple[
        list[bytes], list[int], list[int], list[tuple[int, float]]]:
    """One cumulative hash over the request's content blocks in cache order: for each block, the digest,
    the canonical bytes (image payloads left out) and the images of the prefix ending with it; and the
    breakpoints (block index, lifetime)."""
    hasher = hashlib.sha1(seed, usedforsecurity=False)  # a fingerprint of the client's own prompt, no secret
    digests: list[bytes] = []
    sizes: list[int] = []
    images: list[int] = []
    breakpoints: list[tuple[int, float]] = []
    size = 0
    media = _Media()
    for mark, block in _blocks(request):
        if block is None:
            hasher.update(mark)
            continue
        parts = [mark]
        _canonical(block, parts)
        canonical = b"".join(parts)
        hasher.update(canonical)
        size += len(canonical)
        if with_media:
            payload = media.payload
            _find_media(block, media)
            size -= media.payload - payload
        digests.append(hasher.copy().digest())
        sizes.append(size)
        images.append(media.images)
        breakpoint = block.get("cache_control") if type(block) is dict else None
        if isinstance(breakpoint, dict):
            breakpoints.append((len(digests) - 1, LONG_TTL if breakpoint.get("ttl") == "1h" else SHORT_TTL))
    return digests, sizes, images, breakpoints


def _canonical(value: object, parts: list[bytes]) -> None:
    """A parsed JSON value as bytes that are equal exactly when the values are, ``cache_control`` left out
    at every depth: objects' keys sorted, strings as their UTF-8 with their length before them (no escaping
    pass: a long text costs a copy, not an encoding)."""
    kind = type(value)
    if kind is str:
        encoded = cast(str, value).encode("utf-8", "surrogatepass")
        parts.append(b"s%d:" % len(encoded))
        parts.append(encoded)
    elif kind is dict:
        mapping = cast(dict[str, Any], value)
        parts.append(b"{")
        for name in sorted(mapping):
            if name != "cache_control":
                _canonical(name, parts)
                _canonical(mapping[name], parts)
        parts.append(b"}")
    elif kind is list:
        parts.append(b"[")
        for item in cast(list[Any], value):
            _canonical(item, parts)
        parts.append(b"]")
    else:
        parts.append(b"v%s;" % repr(value).encode())


def _blocks(request: Mapping[str, Any]) -> Iterator[tuple[bytes, Any]]:
    """(mark, block) in cache order; a block of None is a separator (a section's or a message's start).
    Every mark starts with a byte no canonical value starts with, so no two sequences hash alike."""
    yield b"Ttools", None
    tools = request.get("tools")
    if isinstance(tools, list):
        for tool in tools:
            yield b"B", tool
    yield b"Tsystem", None
    yield from _content(request.get("system"))
    messages = request.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, dict):
                role = [b"M"]
                _canonical(message.get("role"), role)
                yield b"".join(role), None
                yield from _content(message.get("content"))


def _content(content: object) -> Iterator[tuple[bytes, Any]]:
    if isinstance(content, str):
        yield b"B", {"type": "text", "text": content}
    elif isinstance(content, list):
        for block in content:
            yield b"B", block


class _Media:
    __slots__ = ("images", "payload")

    def __init__(self) -> None:
        self.images = 0
        self.payload = 0


def _find_media(value: object, media: _Media) -> None:
    """Inline images anywhere in ``value`` (a tool result's content holds them too): Anthropic's base64
    ``source``, OpenAI's ``data:`` URLs (chat's ``image_url.url``, the Responses API's ``image_url``)."""
    if type(value) is list:
        for item in cast(list[Any], value):
            _find_media(item, media)
        return
    if type(value) is not dict:
        return
    block = cast(dict[str, Any], value)
    kind = block.get("type")
    payload = None
    if kind == "image":
        source = block.get("source")
        if type(source) is dict and source.get("type") == "base64":
            payload = source.get("data")
    elif kind == "image_url" or kind == "input_image":
        url = block.get("image_url")
        payload = url.get("url") if type(url) is dict else url
        if not (type(payload) is str and payload.startswith("data:")):
            payload = None
    if type(payload) is str:
        media.images += 1
        media.payload += len(payload)
        return
    for item in block.values():
        if type(item) is list or type(item) is dict:
            _find_media(item, media)


def _candidates(breakpoints: list[int]) -> list[int]:
    """The block boundaries Anthropic checks for a cached prefix, longest first: each breakpoint and the
    ``LOOKBACK`` blocks before it."""
    seen: set[int] = set()
    for at in breakpoints:
        seen.update(range(max(0, at - LOOKBACK), at + 1))
    return sorted(seen, reverse=True)


def _check(dialect: str, windows: Collection[str]) -> None:
    if dialect not in _DIALECTS:
        raise ValueError(f"unknown provider dialect {dialect!r}: it is 'anthropic' or 'openai'")
    for window in windows:
        if window not in _WINDOWS:
            raise ValueError(_unknown_window(window))


_CHECKED_KEPT = 64

def _errors(stats: _Group, name: str) -> _Errors:
    recent = stats.errors.get(name)
    if recent is None:
        recent = stats.errors[name] = _Errors()
    return recent


def _percentile(ordered: list[float], fraction: float) -> float:
    """Nearest rank: with fewer than ten values the p90 is the largest (it leans high)."""
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def _unknown_window(window: str) -> str:
    return f"unknown token window {window!r}: the windows are {', '.join(_WINDOWS)}"
