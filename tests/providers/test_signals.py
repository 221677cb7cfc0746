"""Reading rate-limit answers: stated waits, quota exhaustion, in-stream errors."""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Iterable
from types import MappingProxyType
from typing import Any

import pytest

from proxy.providers.signals import (
    MAX_WAIT,
    Backoff,
    StreamErrorScanner,
    classify_response,
    ends_event_stream,
    is_refusal,
    stated_wait,
    stream_scanner,
)

NOW = 1445412450.0
"""30 s before Wed, 21 Oct 2015 07:28:00 GMT."""


def body(document: Any) -> bytes:
    return json.dumps(document, indent=2).encode()


OPENAI_RATE_LIMIT = body(
    {
        "error": {
            "message": "Rate limit reached for gpt-4o in organization org-Xq3 on tokens per min (TPM): "
            "Limit 30000, Used 29877, Requested 1234. Please try again in 2.222s. "
            "Visit https://platform.openai.com/account/rate-limits to learn more.",
            "type": "tokens",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }
)
OPENAI_RATE_LIMIT_HEADERS = {
    "Content-Type": "application/json; charset=utf-8",
    "x-request-id": "req_7b1e4c0a9d2f4e8b",
    "x-ratelimit-limit-tokens": "30000",
    "x-ratelimit-remaining-tokens": "0",
    "x-ratelimit-reset-tokens": "2.222s",
    "retry-after-ms": "2222",
    "retry-after": "3",
}
OPENAI_INSUFFICIENT_QUOTA = body(
    {
        "error": {
            "message": "You exceeded your current quota, please check your plan and billing details. "
            "For more information on this error, read the docs: "
            "https://platform.openai.com/docs/guides/error-codes/api-errors.",
            "type": "insufficient_quota",
            "param": None,
            "code": "insufficient_quota",
        }
    }
)
AZURE_HEADERS = {
    "Content-Type": "application/json",
    "apim-request-id": "5c1f0e4b-8f3e-4a51-9d2a-0c7e2b9a1f11",
    "x-ms-region": "East US 2",
    "x-ms-retry-after-ms": "8500",
    "Retry-After": "9",
}
AZURE_BODY = body(
    {
        "error": {
            "code": "429",
            "message": "Requests to the ChatCompletions_Create Operation under Azure OpenAI API version "
            "2024-10-21 have exceeded token rate limit of your current pricing tier. "
            "Please retry after 9 seconds.",
        }
    }
)
ANTHROPIC_HEADERS = {
    "content-type": "application/json",
    "request-id": "req_011CQh3x9Rz4M8bK2vYt7aPq",
    "anthropic-ratelimit-requests-limit": "50",
    "anthropic-ratelimit-requests-remaining": "0",
    "anthropic-ratelimit-requests-reset": "2015-10-21T07:28:17Z",
    "anthropic-ratelimit-input-tokens-limit": "40000",
    "anthropic-ratelimit-input-tokens-remaining": "0",
    "anthropic-ratelimit-input-tokens-reset": "2015-10-21T07:28:17Z",
    "retry-after": "17",
    "x-should-retry": "true",
}
ANTHROPIC_RATE_LIMIT = body(
    {
        "type": "error",
        "error": {
            "type": "rate_limit_error",
            "message": "This request would exceed the rate limit for your organization of 40,000 "
            "input tokens per minute.",
        },
    }
)
ANTHROPIC_OVERLOADED = body({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})


def gemini_error(quota_id: str, quota_metric: str, retry_delay: str | None = "45.8s") -> dict[str, Any]:
    details: list[dict[str, Any]] = [
        {
            "@type": "type.googleapis.com/google.rpc.QuotaFailure",
            "violations": [
                {
                    "quotaMetric": quota_metric,
                    "quotaId": quota_id,
                    "quotaDimensions": {"location": "global", "model": "gemini-2.0-flash"},
                    "quotaValue": "15",
                }
            ],
        },
        {
            "@type": "type.googleapis.com/google.rpc.Help",
            "links": [
                {
                    "description": "Learn more about Gemini API quotas",
                    "url": "https://ai.google.dev/gemini-api/docs/rate-limits",
                }
            ],
        },
    ]
    if retry_delay is not None:
        details.append({"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": retry_delay})
    return {
        "error": {
            "code": 429,
            "message": "You exceeded your current quota, please check your plan and billing details.",
            "status": "RESOURCE_EXHAUSTED",
            "details": details,
        }
    }


GEMINI_METRIC = "generativelanguage.googleapis.com/generate_content_free_tier_requests"
GEMINI_PER_MINUTE = gemini_error("GenerateRequestsPerMinutePerProjectPerModel-FreeTier", GEMINI_METRIC)
GEMINI_PER_DAY = gemini_error("GenerateRequestsPerDayPerProjectPerModel-FreeTier", GEMINI_METRIC)
GEMINI_HEADERS = {"Content-Type": "application/json; charset=UTF-8", "Server": "scaffolding on HTTPServer2"}


@pytest.mark.parametrize(
    ("headers", "payload", "expected"),
    [
        pytest.param(OPENAI_RATE_LIMIT_HEADERS, OPENAI_RATE_LIMIT, 2.222, id="openai-retry-after-ms-wins"),
        pytest.param({"retry-after": "3"}, OPENAI_RATE_LIMIT, 3.0, id="openai-retry-after-only"),
        pytest.param(AZURE_HEADERS, AZURE_BODY, 8.5, id="azure-x-ms-retry-after-ms"),
        pytest.param(ANTHROPIC_HEADERS, ANTHROPIC_RATE_LIMIT, 17.0, id="anthropic-retry-after"),
        pytest.param(
            {"content-type": "application/json"}, ANTHROPIC_OVERLOADED, None, id="anthropic-529-no-wait"
        ),
        pytest.param(GEMINI_HEADERS, body(GEMINI_PER_MINUTE), 45.8, id="gemini-retry-delay-object"),
        pytest.param(GEMINI_HEADERS, body([GEMINI_PER_MINUTE]), 45.8, id="gemini-retry-delay-array"),
        pytest.param({"retry-after": "1.5"}, None, 1.5, id="decimal-seconds"),
        pytest.param({"retry-after": " 120 "}, None, 120.0, id="padded-seconds"),
        pytest.param({"retry-after": "0"}, None, 0.0, id="zero"),
        pytest.param({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, None, 30.0, id="http-date"),
        pytest.param({"retry-after": "Wednesday, 21-Oct-15 07:28:00 GMT"}, None, 30.0, id="rfc850-date"),
        pytest.param({"retry-after": "Wed Oct 21 07:28:00 2015"}, None, 30.0, id="asctime-date"),
        pytest.param({"retry-after": "Wed, 21 Oct 2015 07:27:00 GMT"}, None, 0.0, id="past-date-clamped"),
        pytest.param({"retry-after": "Fri, 21 Oct 2016 07:28:00 GMT"}, None, MAX_WAIT, id="far-date-capped"),
        pytest.param({"retry-after": "99999999"}, None, MAX_WAIT, id="absurd-seconds-capped"),
        pytest.param({"retry-after-ms": "9" * 400}, None, MAX_WAIT, id="overflowing-ms-capped"),
        pytest.param(
            {"retry-after": "12"},
            body(gemini_error("x", "y", retry_delay="200000s")),
            12.0,
            id="header-beats-body",
        ),
        pytest.param({}, body(gemini_error("x", "y", retry_delay="200000s")), MAX_WAIT, id="body-capped"),
        pytest.param(
            {"x-ms-retry-after-ms": "700", "retry-after-ms": "300", "retry-after": "5"},
            body(GEMINI_PER_MINUTE),
            0.3,
            id="precedence-all-four",
        ),
        pytest.param(
            {"x-ms-retry-after-ms": "700", "retry-after": "5"},
            body(GEMINI_PER_MINUTE),
            0.7,
            id="precedence-x-ms",
        ),
        pytest.param({"retry-after": "5"}, body(GEMINI_PER_MINUTE), 5.0, id="precedence-retry-after"),
        pytest.param({"Retry-After-Ms": "1500"}, None, 1.5, id="mixed-case-name"),
        pytest.param({"RETRY-AFTER": "4"}, None, 4.0, id="upper-case-name"),
        pytest.param(MappingProxyType({"Retry-After": "6"}), None, 6.0, id="read-only-mapping"),
        pytest.param(
            {"retry-after-ms": "soon", "x-ms-retry-after-ms": "-5", "retry-after": "later"},
            body(GEMINI_PER_MINUTE),
            45.8,
            id="invalid-headers-fall-through-to-body",
        ),
        pytest.param({"retry-after-ms": "nan", "retry-after": "2"}, None, 2.0, id="nan-ms-skipped"),
        pytest.param({"retry-after-ms": "inf", "retry-after": "2"}, None, 2.0, id="inf-ms-skipped"),
        pytest.param({"retry-after-ms": "1e3", "retry-after": "2"}, None, 2.0, id="exponent-ms-skipped"),
        pytest.param({"retry-after-ms": "", "retry-after": "2"}, None, 2.0, id="empty-ms-skipped"),
        pytest.param({"retry-after": "-1"}, None, None, id="negative-seconds-skipped"),
        pytest.param({"retry-after": "Wed, 99 Oct 2015 07:28:00 GMT"}, None, None, id="impossible-date"),
        pytest.param({"retry-after": "Wed, 21 Oct 99999 07:28:00 GMT"}, None, None, id="out-of-range-year"),
        pytest.param({}, body(gemini_error("x", "y", retry_delay="-3s")), None, id="negative-delay-skipped"),
        pytest.param({}, body(gemini_error("x", "y", retry_delay="45.8")), None, id="delay-without-unit"),
        pytest.param({}, body(gemini_error("x", "y", retry_delay=None)), None, id="no-retry-info"),
        pytest.param({}, b'{"error": {"details": [{"retryDelay": 45}]}}', None, id="delay-not-a-string"),
        pytest.param({}, b'{"error": {"details": {"retryDelay": "4s"}}}', None, id="details-not-a-list"),
        pytest.param({}, b"<html>Too Many Requests</html>", None, id="html-body"),
        pytest.param({}, b"\xff\xfe\x00garbage", None, id="undecodable-body"),
        pytest.param({}, b"[" * 100_000, None, id="deeply-nested-body"),
        pytest.param({}, b"", None, id="empty-body"),
        pytest.param({}, None, None, id="no-body"),
    ],
)
def test_stated_wait(headers: dict[str, str], payload: bytes | None, expected: float | None) -> None:
    wait = stated_wait(headers, payload, NOW)
    if expected is None:
        assert wait is None
    else:
        assert wait == pytest.approx(expected)


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        pytest.param(OPENAI_INSUFFICIENT_QUOTA, True, id="openai-insufficient-quota"),
        pytest.param(b'{"error": {"type": "insufficient_quota", "code": null}}', True, id="openai-type-only"),
        pytest.param(b'{"error": {"code": "insufficient_quota"}}', True, id="openai-code-only"),
        pytest.param(body(GEMINI_PER_DAY), True, id="gemini-per-day-object"),
        pytest.param(body([GEMINI_PER_DAY]), True, id="gemini-per-day-array"),
        pytest.param(
            body(gemini_error("", "generativelanguage.googleapis.com/generate_requests_per_model_per_day")),
            True,
            id="gemini-per-day-metric",
        ),
        pytest.param(body(GEMINI_PER_MINUTE), False, id="gemini-per-minute"),
        pytest.param(body([GEMINI_PER_MINUTE]), False, id="gemini-per-minute-array"),
        pytest.param(
            body(
                {
                    "error": {
                        "details": [
                            {
                                "@type": "type.googleapis.com/google.rpc.RetryInfo",
                                "violations": [{"quotaId": "RequestsPerDay"}],
                            }
                        ]
                    }
                }
            ),
            False,
            id="per-day-outside-quota-failure",
        ),
        pytest.param(OPENAI_RATE_LIMIT, False, id="openai-rate-limit"),
        pytest.param(ANTHROPIC_RATE_LIMIT, False, id="anthropic-rate-limit"),
        pytest.param(b'{"error": "insufficient_quota"}', False, id="error-not-an-object"),
        pytest.param(b'"insufficient_quota"', False, id="bare-string"),
        pytest.param(b"{not json", False, id="invalid-json"),
        pytest.param(b"", False, id="empty"),
        pytest.param(None, False, id="none"),
    ],
)
def test_is_refusal(payload: bytes | None, expected: bool) -> None:
    assert is_refusal(payload) is expected


@pytest.mark.parametrize(
    ("status", "headers", "payload", "statuses", "expected"),
    [
        pytest.param(
            429, OPENAI_RATE_LIMIT_HEADERS, OPENAI_RATE_LIMIT, {429}, Backoff("429", 2.222, 429), id="openai-429"
        ),
        pytest.param(429, AZURE_HEADERS, AZURE_BODY, {429}, Backoff("429", 8.5, 429), id="azure-429"),
        pytest.param(
            429, ANTHROPIC_HEADERS, ANTHROPIC_RATE_LIMIT, {429, 529}, Backoff("429", 17.0, 429), id="anthropic-429"
        ),
        pytest.param(529, {}, ANTHROPIC_OVERLOADED, {429, 529}, Backoff("529", None, 529), id="anthropic-529"),
        pytest.param(
            429, GEMINI_HEADERS, body(GEMINI_PER_MINUTE), [429], Backoff("429", 45.8, 429), id="gemini-per-minute"
        ),
        pytest.param(429, {"retry-after": "20"}, OPENAI_INSUFFICIENT_QUOTA, {429}, None, id="openai-quota"),
        pytest.param(429, GEMINI_HEADERS, body([GEMINI_PER_DAY]), {429}, None, id="gemini-per-day"),
        pytest.param(529, {}, ANTHROPIC_OVERLOADED, {429}, None, id="529-not-configured"),
        pytest.param(200, {"retry-after": "5"}, b"{}", {429}, None, id="ok"),
        pytest.param(503, {"retry-after": "5"}, b"", {429}, None, id="503-not-configured"),
        pytest.param(503, {"retry-after": "5"}, b"", {429, 503}, Backoff("503", 5.0, 503), id="503-configured"),
    ],
)
def test_classify_response(
    status: int, headers: dict[str, str], payload: bytes, statuses: set[int], expected: Backoff | None
) -> None:
    found = classify_response(status, headers, payload, statuses, NOW)
    if expected is None or expected.wait is None:
        assert found == expected
    else:
        assert found is not None
        assert found.cause == expected.cause
        assert found.wait == pytest.approx(expected.wait)


def sse(*events: tuple[str | None, Any]) -> bytes:
    """A stream of SSE events; a str payload is sent verbatim, anything else as JSON."""
    out = []
    for name, data in events:
        text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
        out.append((f"event: {name}\n" if name else "") + f"data: {text}\n\n")
    return "".join(out).encode()


def anthropic_stream(*tail: tuple[str | None, Any]) -> bytes:
    return sse(
        (
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": "msg_01XFDUDYJgAACzvnptvVoYEL",
                    "type": "message",
                    "role": "assistant",
                    "content": [],
                    "model": "claude-sonnet-4-20250514",
                    "stop_reason": None,
                    "usage": {"input_tokens": 25, "output_tokens": 1},
                },
            },
        ),
        (
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        ),
        ("ping", {"type": "ping"}),
        (
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hello"}},
        ),
        *tail,
    )


def anthropic_error(kind: str, message: str) -> tuple[str, Any]:
    return ("error", {"type": "error", "error": {"type": kind, "message": message}})


def anthropic_text(text: str) -> tuple[str, Any]:
    delta = {"type": "text_delta", "text": text}
    return ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta})


def openai_chunk(content: str) -> tuple[None, Any]:
    return (
        None,
        {
            "id": "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT",
            "object": "chat.completion.chunk",
            "created": 1741569952,
            "model": "gpt-4o-2024-08-06",
            "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
        },
    )


def openai_error(code: str | None, kind: str) -> tuple[None, Any]:
    return (
        None,
        {
            "error": {
                "message": "Rate limit reached for gpt-4o in organization org-Xq3 on requests per min (RPM).",
                "type": kind,
                "param": None,
                "code": code,
            }
        },
    )


ANTHROPIC_OVERLOADED_STREAM = anthropic_stream(anthropic_error("overloaded_error", "Overloaded"))
OPENAI_ERROR_STREAM = sse(
    openai_chunk("Hel"), openai_chunk("lo"), openai_error("rate_limit_exceeded", "requests")
)

STREAMS = [
    pytest.param(ANTHROPIC_OVERLOADED_STREAM, Backoff("overloaded_error", None, 529), id="anthropic-overloaded"),
    pytest.param(
        anthropic_stream(
            anthropic_error("rate_limit_error", "Number of request tokens has exceeded your limit.")
        ),
        Backoff("rate_limit_error", None),
        id="anthropic-rate-limit",
    ),
    pytest.param(OPENAI_ERROR_STREAM, Backoff("rate_limit_exceeded", None), id="openai-code"),
    pytest.param(
        sse(openai_chunk("Hi"), openai_error(None, "rate_limit_exceeded")),
        Backoff("rate_limit_exceeded", None),
        id="openai-type",
    ),
    pytest.param(
        sse(
            ("response.created", {"type": "response.created", "sequence_number": 0}),
            (
                "error",
                {"type": "error", "code": "rate_limit_exceeded", "message": "Slow down.", "param": None},
            ),
        ),
        Backoff("rate_limit_exceeded", None),
        id="openai-responses-error-event",
    ),
    pytest.param(
        sse(
            openai_chunk("Hi"),
            (None, {"error": {"code": "rate_limit_exceeded", "details": [{"retryDelay": "7s"}]}}),
        ),
        Backoff("rate_limit_exceeded", 7.0),
        id="retry-delay-hint",
    ),
    pytest.param(
        anthropic_stream(
            anthropic_error("overloaded_error", "Overloaded"),
            anthropic_error("rate_limit_error", "again"),
        ),
        Backoff("overloaded_error", None, 529),
        id="two-errors-first-wins",
    ),
    pytest.param(
        anthropic_stream(anthropic_error("invalid_request_error", "max_tokens: must be at most 8192")),
        None,
        id="anthropic-invalid-request",
    ),
    pytest.param(
        anthropic_stream(anthropic_error("api_error", "Internal server error")), None, id="anthropic-api-error"
    ),
    pytest.param(
        sse(openai_chunk("Hi"), openai_error("server_error", "server_error")), None, id="openai-server-error"
    ),
    pytest.param(
        anthropic_stream(
            anthropic_text("the error was"), anthropic_text(" a rate_limit_error and overloaded_error")
        ),
        None,
        id="text-mentions-error",
    ),
    pytest.param(
        sse(openai_chunk('{"error": {"code": "rate_limit_exceeded"}}'), (None, "[DONE]")),
        None,
        id="text-quotes-error-json",
    ),
    pytest.param(
        anthropic_stream(("error", {"type": "error", "error": {"type": ["overloaded_error"]}})),
        None,
        id="error-type-not-a-string",
    ),
    pytest.param(sse((None, "{error: rate_limit_exceeded")), None, id="broken-json"),
    pytest.param(
        b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error"}}',
        None,
        id="unfinished-line",
    ),
]


def reports(chunks: Iterable[bytes]) -> list[Backoff]:
    scanner = StreamErrorScanner()
    return [found for chunk in chunks if (found := scanner.feed(chunk)) is not None]


def expected_reports(expected: Backoff | None) -> list[Backoff]:
    return [] if expected is None else [expected]


@pytest.mark.parametrize("crlf", [False, True], ids=["lf", "crlf"])
@pytest.mark.parametrize(("stream", "expected"), STREAMS)
def test_scanner_whole_stream(stream: bytes, expected: Backoff | None, crlf: bool) -> None:
    if crlf:
        stream = stream.replace(b"\n", b"\r\n")
    assert reports([stream]) == expected_reports(expected)


@pytest.mark.parametrize("crlf", [False, True], ids=["lf", "crlf"])
@pytest.mark.parametrize(("stream", "expected"), STREAMS)
def test_scanner_one_byte_at_a_time(stream: bytes, expected: Backoff | None, crlf: bool) -> None:
    if crlf:
        stream = stream.replace(b"\n", b"\r\n")
    assert reports(stream[i : i + 1] for i in range(len(stream))) == expected_reports(expected)


@pytest.mark.parametrize("crlf", [False, True], ids=["lf", "crlf"])
@pytest.mark.parametrize(("stream", "expected"), STREAMS)
def test_scanner_split_in_two_anywhere(stream: bytes, expected: Backoff | None, crlf: bool) -> None:
    if crlf:
        stream = stream.replace(b"\n", b"\r\n")
    for cut in range(len(stream) + 1):
        assert reports([stream[:cut], stream[cut:]]) == expected_reports(expected), f"split at byte {cut}"


def test_scanner_reports_once_then_stays_quiet() -> None:
    scanner = StreamErrorScanner()
    assert scanner.feed(ANTHROPIC_OVERLOADED_STREAM) == Backoff("overloaded_error", None, 529)
    assert scanner.feed(ANTHROPIC_OVERLOADED_STREAM) is None
    assert scanner.feed(OPENAI_ERROR_STREAM) is None


def test_scanner_ignores_empty_chunks() -> None:
    scanner = StreamErrorScanner()
    assert scanner.feed(b"") is None
    assert scanner.feed(OPENAI_ERROR_STREAM) == Backoff("rate_limit_exceeded", None)


def test_scanner_drops_overlong_line_and_recovers() -> None:
    padding = "x" * (100 * 1024)
    overlong = sse((None, {"error": {"code": "rate_limit_exceeded", "pad": padding}}))
    stream = overlong + ANTHROPIC_OVERLOADED_STREAM
    pieces = [stream[i : i + 4096] for i in range(0, len(stream), 4096)]
    assert reports(pieces) == [Backoff("overloaded_error", None, 529)]


def test_scanner_memory_is_bounded_on_endless_line() -> None:
    scanner = StreamErrorScanner()
    piece = b"data: " + b"y" * 65536
    tracemalloc.start()
    try:
        for _ in range(160):
            assert scanner.feed(piece) is None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024 * 1024


# ----- part two: every signal real agent clients see ---------------------------------------

OPENAI_TPM_MESSAGE = ("Rate limit reached for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, "
                      "Used 30000, Requested 1200. Please try again in 6.379s. Visit https://platform.openai.com/"
                      "account/rate-limits to learn more.")

PART_TWO_RESPONSES = [
    pytest.param(429, {}, body({"error": {"message": OPENAI_TPM_MESSAGE, "type": "tokens",
                                          "code": "rate_limit_exceeded"}}),
                 Backoff("429", 6.379, 429), id="openai-wait-in-words"),
    pytest.param(429, {}, body({"error": {"message": "Rate limit exceeded: try again in 20ms", "type": "requests"}}),
                 Backoff("429", 0.02, 429), id="wait-in-ms-words"),
    pytest.param(429, {"retry-after": "3"}, body({"error": {"message": "Please try again in 6.379s."}}),
                 Backoff("429", 3.0, 429), id="header-wins-over-words"),
    pytest.param(529, {}, body({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
                 Backoff("529", None, 529), id="anthropic-overloaded"),
    pytest.param(400, {}, body({"type": "error", "error": {"type": "billing_error",
                                                           "message": "Your credit balance is too low"}}),
                 None, id="anthropic-billing"),
    pytest.param(429, {"retry-after": "60"}, body({"type": "error", "error": {
        "type": "rate_limit_error", "message": "You have reached your specified API usage limits.",
        "details": {"error_code": "enforced_spend_limit_reached"}}}), None, id="anthropic-spend-limit"),
    pytest.param(429, {}, body({"error": {"type": "spend_limit_exceeded", "message": "Monthly spend limit"}}),
                 None, id="spend-limit-type"),
]


@pytest.mark.parametrize(("status", "headers", "payload", "expected"), PART_TWO_RESPONSES)
def test_part_two_responses(status: int, headers: dict[str, str], payload: bytes, expected: Backoff | None) -> None:
    assert classify_response(status, headers, payload, {400, 429, 529}, 0.0) == expected


def event_bytes(event: str, document: Any) -> bytes:
    return f"event: {event}\ndata: {json.dumps(document)}\n\n".encode()


PART_TWO_STREAMS = [
    pytest.param(event_bytes("response.failed", {"type": "response.failed", "sequence_number": 9, "response": {
        "id": "resp_1", "status": "failed", "error": {"code": "rate_limit_exceeded", "message": OPENAI_TPM_MESSAGE}}}),
        Backoff("rate_limit_exceeded", 6.379, 429), id="responses-failed-rate-limit"),
    pytest.param(event_bytes("response.failed", {"type": "response.failed", "response": {
        "status": "failed", "error": {"type": "overloaded_error", "message": "Overloaded"}}}),
        Backoff("overloaded_error", None, 529), id="responses-failed-overloaded-type"),
    pytest.param(event_bytes("response.failed", {"type": "response.failed", "response": {
        "status": "failed", "error": {"code": "server_error", "message": "The server had an error"}}}),
        None, id="responses-failed-other"),
    pytest.param(event_bytes("error", {"type": "error", "code": "rate_limit_exceeded", "message": "try again in 1.5s",
                               "sequence_number": 4}),
        Backoff("rate_limit_exceeded", 1.5, 429), id="responses-error-event"),
    pytest.param(event_bytes("error", {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
        Backoff("overloaded_error", None, 529), id="anthropic-overloaded-event"),
    pytest.param(event_bytes("error", {"type": "error", "error": {"type": "rate_limit_error", "message": "Spend limit",
                                                          "details": {"error_code": "enforced_spend_limit_reached"}}}),
        None, id="anthropic-spend-limit-event"),
    pytest.param(event_bytes("error", {"type": "error", "error": {"type": "billing_error", "message": "No credit"}}),
        None, id="anthropic-billing-event"),
]


@pytest.mark.parametrize(("stream", "expected"), PART_TWO_STREAMS)
def test_part_two_stream_errors(stream: bytes, expected: Backoff | None) -> None:
    assert StreamErrorScanner().feed(stream) == expected


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "zstd"])
def test_a_compressed_stream_is_scanned_decoded_in_bounded_pieces(encoding: str) -> None:
    import zlib

    import brotli
    from backports import zstd

    stream = b"".join(event_bytes("content_block_delta", {"type": "content_block_delta", "text": "x" * 200})
                      for _ in range(2000)) + event_bytes("error", {"type": "error", "error": {"type": "rate_limit_error"}})
    packed = {"gzip": lambda b: zlib.compress(b, wbits=31), "deflate": zlib.compress, "br": brotli.compress,
              "zstd": zstd.compress}[encoding](stream)
    scanner = stream_scanner(encoding)
    assert scanner is not None
    found = [scanner.feed(packed[i:i + 1000]) for i in range(0, len(packed), 1000)]
    assert [f for f in found if f is not None] == [Backoff("rate_limit_error", None, 429)]


def test_an_unknown_encoding_is_not_scanned() -> None:
    assert stream_scanner("compress") is None
    assert isinstance(stream_scanner(None), StreamErrorScanner)
    assert isinstance(stream_scanner("identity"), StreamErrorScanner)


@pytest.mark.parametrize(("tail", "ends"), [
    (b'data: {"choices": []}\n\ndata: [DONE]\n\n', True),
    (b"data:[DONE]\r\n\r\n", True),
    (b'event: message_stop\ndata: {"type": "message_stop"}\n\n', True),
    (b"event: response.completed\r\ndata: {}\r\n\r\n", True),
    (b"event: response.failed\ndata: {}\n\n", True),
    (b"data: [DONE]\n", False),  # unfinished: no blank line yet
    (b"data: [DONE]\n\nevent: ping\ndata: {}\n\n", False),  # something came after it
    (b'event: content_block_delta\ndata: {"text": "[DONE]"}\n\n', False),
    (b'data: {"type": "response.completed"}\n\n', False),  # a data field, not the event's name
    (b"", False),
])
def test_the_final_event_of_each_api_ends_an_event_stream(tail: bytes, ends: bool) -> None:
    assert ends_event_stream(tail) is ends
