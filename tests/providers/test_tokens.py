"""Token counts read from every answer shape, normalised; streams read by the relay's own scanner."""

from __future__ import annotations

import gzip
import json
import zlib

import pytest

from proxy.providers.signals import stream_scanner
from proxy.providers.tokens import TokenCounts, UsageReader

CHAT_USAGE = {"prompt_tokens": 120, "completion_tokens": 30, "total_tokens": 150,
              "prompt_tokens_details": {"cached_tokens": 100, "audio_tokens": 0},
              "completion_tokens_details": {"reasoning_tokens": 12}}
RESPONSES_USAGE = {"input_tokens": 900, "input_tokens_details": {"cached_tokens": 512}, "output_tokens": 64,
                   "output_tokens_details": {"reasoning_tokens": 40}, "total_tokens": 964}


def read(*texts: bytes) -> TokenCounts | None:
    reader = UsageReader()
    for text in texts:
        reader.read(text)
    return reader.counts()


def sse(data: object, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return (head + "data: " + json.dumps(data) + "\n\n").encode()


def test_openai_chat_json() -> None:
    body = json.dumps({"id": "c", "choices": [{"message": {"content": "the usage: {x}"}}], "usage": CHAT_USAGE})
    assert read(body.encode()) == TokenCounts(input_tokens=120, cached_input_tokens=100, output_tokens=30,
                                              reasoning_tokens=12)


def test_responses_json_and_its_terminal_event() -> None:
    expected = TokenCounts(input_tokens=900, cached_input_tokens=512, output_tokens=64, reasoning_tokens=40)
    assert read(json.dumps({"id": "r", "output": [], "usage": RESPONSES_USAGE}).encode()) == expected
    frame = json.dumps({"type": "response.completed", "response": {"id": "r", "usage": RESPONSES_USAGE}})
    assert read(frame.encode()) == expected


def test_anthropic_message_start_updated_by_the_last_delta_not_added() -> None:
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 10, "cache_creation_input_tokens": 200,
                                                            "cache_read_input_tokens": 3000, "output_tokens": 1}}}
    deltas = [{"type": "message_delta", "usage": {"output_tokens": n}} for n in (5, 17, 42)]
    counts = read(json.dumps(start).encode(), *(json.dumps(d).encode() for d in deltas))
    assert counts == TokenCounts(input_tokens=3210, cached_input_tokens=3000, cache_write_tokens=200,
                                 output_tokens=42)


def test_a_null_usage_and_a_quoted_usage_in_text_are_not_usage() -> None:
    assert read(b'{"choices": [], "usage": null}') is None
    text = json.dumps({"delta": {"content": 'he said "usage": {"prompt_tokens": 99}'}}).encode()
    assert read(text) is None
    assert read(b'{"usage": {"prompt_tokens": "many", "completion_tokens": -3}}') == TokenCounts()
    assert read(b"") is None


def test_an_openai_stream_without_include_usage_has_unknown_counts() -> None:
    reader = UsageReader()
    scanner = stream_scanner(None, reader)
    assert scanner is not None
    for n in range(3):
        scanner.feed(sse({"choices": [{"delta": {"content": f"t{n}"}}], "usage": None}))
    scanner.feed(b"data: [DONE]\n\n")
    assert reader.counts() is None


def _chat_stream() -> bytes:
    chunks = [sse({"choices": [{"delta": {"content": f"token {n}"}}], "usage": None}) for n in range(5)]
    chunks.append(sse({"choices": [], "usage": CHAT_USAGE}))
    return b"".join(chunks) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("cut", [1, 7, 64, 10_000])
def test_a_stream_cut_anywhere_yields_its_final_usage(cut: int) -> None:
    stream = _chat_stream()
    reader = UsageReader()
    scanner = stream_scanner(None, reader)
    assert scanner is not None
    for start in range(0, len(stream), cut):
        scanner.feed(stream[start:start + cut])
    assert reader.counts() == TokenCounts(input_tokens=120, cached_input_tokens=100, output_tokens=30,
                                          reasoning_tokens=12)


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_compressed_stream_is_read_from_its_decoded_copy(encoding: str) -> None:
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 7, "cache_creation_input_tokens": 0,
                                                            "cache_read_input_tokens": 0, "output_tokens": 1}}}
    plain = sse(start, "message_start") + sse({"type": "message_delta", "usage": {"output_tokens": 9}},
                                              "message_delta")
    compressed = gzip.compress(plain) if encoding == "gzip" else zlib.compress(plain)
    reader = UsageReader()
    scanner = stream_scanner(encoding, reader)
    assert scanner is not None
    for start_at in range(0, len(compressed), 5):
        scanner.feed(compressed[start_at:start_at + 5])
    assert reader.counts() == TokenCounts(input_tokens=7, output_tokens=9)


def test_a_rate_limit_error_is_still_reported_while_usage_is_read() -> None:
    reader = UsageReader()
    scanner = stream_scanner(None, reader)
    assert scanner is not None
    backoff = scanner.feed(sse({"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}))
    assert backoff is not None and backoff.cause == "rate_limit_error"
    scanner.feed(sse({"type": "message_delta", "usage": {"input_tokens": 3, "output_tokens": 2}}))
    assert reader.counts() == TokenCounts(input_tokens=3, output_tokens=2)


def test_a_usage_object_longer_than_the_first_window_is_read_whole() -> None:
    padding = {f"extra_{n}": "x" * 40 for n in range(80)}  # some 4 KiB of fields a provider may add
    body = json.dumps({"id": "r", "usage": {**padding, "prompt_tokens": 7, "completion_tokens": 3}}).encode()
    assert read(body) == TokenCounts(input_tokens=7, output_tokens=3)


@pytest.mark.parametrize("usage", [
    CHAT_USAGE,
    RESPONSES_USAGE,
    {"input_tokens": 10, "cache_creation_input_tokens": 200, "cache_read_input_tokens": 3000, "output_tokens": 1},
    {"input_tokens": 10, "cache_read_input_tokens": None, "cache_creation_input_tokens": 5},
    {"prompt_tokens": "many", "completion_tokens": -3, "prompt_tokens_details": {"cached_tokens": True},
     "completion_tokens_details": {"reasoning_tokens": 1.5}},
    {"input_tokens": 1 << 53, "output_tokens": (1 << 53) - 1, "input_tokens_details": [], "output_tokens_details": None},
    {"output_tokens": 4},
    {"total_tokens": 9},
])
def test_a_rows_plain_totals_are_the_named_counts(usage: dict[str, object]) -> None:
    reader = UsageReader()
    reader.read(json.dumps({"id": "x", "usage": usage}, separators=(",", ":")).encode())
    totals, counts = reader.totals(), reader.counts()
    assert totals == (None if counts is None else tuple(counts))
    assert totals is None or type(totals) is tuple  # a ledger row is made without a named tuple in between


def test_the_totals_are_worked_out_once_until_another_usage_object_comes() -> None:
    """The windows' settling and the ledger's row both ask for an answer's totals: the second asks nothing again."""
    usage = UsageReader()
    assert usage.totals() is None
    usage.read(b'{"usage":{"prompt_tokens":12,"completion_tokens":1}}')
    first = usage.totals()
    assert first == (12, 0, 0, 1, 0) and usage.totals() is first
    usage.read(b'data: {"usage":{"completion_tokens":5}}')
    assert usage.totals() == (12, 0, 0, 5, 0)
    usage.add({"prompt_tokens": 20})
    assert usage.totals() == (20, 0, 0, 5, 0) == usage.counts()
