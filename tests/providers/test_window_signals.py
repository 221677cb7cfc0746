"""The token windows read from answers, with the header shapes and 429 bodies OpenAI and Anthropic send."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from multidict import CIMultiDict

from proxy.providers.budgets import read_budget
from proxy.providers.window_signals import (
    window_hit,
    window_limits,
    window_remaining,
)

NOW = 1_800_000_000.0


def rfc3339(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat().replace("+00:00", "Z")


ANTHROPIC_HEADERS = {
    "anthropic-ratelimit-requests-limit": "4000",
    "anthropic-ratelimit-requests-remaining": "3999",
    "anthropic-ratelimit-requests-reset": rfc3339(NOW + 1),
    "anthropic-ratelimit-input-tokens-limit": "450000",
    "anthropic-ratelimit-input-tokens-remaining": "447000",
    "anthropic-ratelimit-input-tokens-reset": rfc3339(NOW + 2),
    "anthropic-ratelimit-output-tokens-limit": "90000",
    "anthropic-ratelimit-output-tokens-remaining": "90000",
    "anthropic-ratelimit-output-tokens-reset": rfc3339(NOW),
    "anthropic-ratelimit-tokens-limit": "540000",
    "anthropic-ratelimit-tokens-remaining": "447000",
    "anthropic-ratelimit-tokens-reset": rfc3339(NOW + 2),
}
OPENAI_HEADERS = {
    "x-ratelimit-limit-requests": "10000",
    "x-ratelimit-limit-tokens": "2000000",
    "x-ratelimit-remaining-requests": "9999",
    "x-ratelimit-remaining-tokens": "1998765",
    "x-ratelimit-reset-requests": "6ms",
    "x-ratelimit-reset-tokens": "37ms",
}


def anthropic_error(message: str) -> bytes:
    return json.dumps({"type": "error", "error": {"type": "rate_limit_error", "message": message},
                       "request_id": "req_011CSHoEeqs5C35K2UUqR7Fy"}).encode()


def openai_error(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "tokens", "param": None,
                                 "code": "rate_limit_exceeded"}}).encode()


ANTHROPIC_ITPM = anthropic_error(
    "This request would exceed the rate limit for your organization (0dccdde6-f924-4f1b-bb3b-92ef846e0a5b) of "
    "20,000 input tokens per minute. For details, refer to: https://docs.anthropic.com/en/api/rate-limits. You "
    "can see the response headers for current usage. Please reduce the prompt length or the maximum tokens "
    "requested, or try again later. You may also contact sales at https://www.anthropic.com/contact-sales to "
    "discuss your options for a rate limit increase.")
ANTHROPIC_ITPM_NEWER = anthropic_error(
    "This request would exceed your organization's rate limit of 30,000 input tokens per minute (org: "
    "9d50ef40-6cc8-4ca6-9d35-1dc9cf26235c, model: claude-sonnet-4-6). For details, refer to: "
    "https://docs.claude.com/en/api/rate-limits. You can see the response headers for current usage.")
ANTHROPIC_OTPM = anthropic_error(
    "This request would exceed your organization\u2019s rate limit of 80,000 output tokens per minute. For "
    "details, refer to: https://docs.anthropic.com/en/api/rate-limits; see the response headers for current "
    "usage. Please reduce the prompt length or the maximum tokens requested, or try again later.")
ANTHROPIC_RPM = anthropic_error(
    "This request would exceed the rate limit for your organization (c2bd0bd2-8f41-4d36-a7a4-1e0c4b7f3a11) of "
    "50 requests per minute. For details, refer to: https://docs.anthropic.com/en/api/rate-limits.")
ANTHROPIC_UNNAMED = anthropic_error("This request would exceed your account's rate limit. Please try again later.")
OPENAI_TPM = openai_error(
    "Rate limit reached for gpt-4o in organization org-uVqpjtJiKqvVJMVfvpaounIh on tokens per min (TPM): Limit "
    "30000, Used 29000, Requested 2000. Please try again in 2s. Visit https://platform.openai.com/account/"
    "rate-limits to learn more.")
OPENAI_RPM = openai_error(
    "Rate limit reached for gpt-4.1-mini in organization org-uVqpjtJiKqvVJMVfvpaounIh on requests per min (RPM): "
    "Limit 3, Used 3, Requested 1. Please try again in 20s. Visit https://platform.openai.com/account/rate-limits "
    "to learn more.")
OPENAI_TPM_OLDER = openai_error(
    "Rate limit reached for default-gpt-3.5-turbo in organization org-tWLJpza6PfFNRXgGrT00shKI on tokens per min. "
    "Limit: 60000 / min. Please try again in 1ms. Contact us through our help center at help.openai.com if you "
    "continue to have issues.")
OPENAI_TPD = openai_error(
    "Rate limit reached for gpt-4o-mini in organization org-uVqpjtJiKqvVJMVfvpaounIh on tokens per day (TPD): "
    "Limit 2000000, Used 1999000, Requested 3000. Please try again in 43.2s.")
OPENAI_QUOTA = json.dumps({"error": {
    "message": "You exceeded your current quota, please check your plan and billing details.",
    "type": "insufficient_quota", "param": None, "code": "insufficient_quota"}}).encode()


def test_limits_are_the_windows_announced_and_not_anthropic_s_combined_tokens() -> None:
    assert window_limits("anthropic", ANTHROPIC_HEADERS) == {
        "input_tokens_per_minute": 450000, "output_tokens_per_minute": 90000, "requests_per_minute": 4000}
    assert window_limits("openai", OPENAI_HEADERS) == {"tokens_per_minute": 2000000, "requests_per_minute": 10000}


def test_limits_read_any_header_case_and_skip_what_is_unreadable_or_zero() -> None:
    headers = CIMultiDict({"X-RateLimit-Limit-Tokens": "2000000", "X-RateLimit-Limit-Requests": "0"})
    assert window_limits("openai", headers) == {"tokens_per_minute": 2000000}
    assert window_limits("openai", {"X-RateLimit-Limit-Tokens": "30000"}) == {"tokens_per_minute": 30000}
    odd = {"x-ratelimit-limit-tokens": "1e6", "x-ratelimit-limit-requests": "\xb2",
           "anthropic-ratelimit-input-tokens-limit": "450000"}
    assert window_limits("openai", odd) == {}, "the other dialect's headers are not its windows"
    assert window_limits("anthropic", {}) == {}


def test_a_superscript_digit_is_not_a_count_anywhere() -> None:
    """'\\xb2' is a digit to str.isdigit() but not to int(): it used to raise out of the budget reader."""
    assert read_budget({"x-ratelimit-remaining-requests": "\xb2"}, NOW) is None


def test_remaining_with_the_reset_as_a_time() -> None:
    assert window_remaining("anthropic", ANTHROPIC_HEADERS, NOW) == {
        "input_tokens_per_minute": (447000.0, NOW + 2),
        "output_tokens_per_minute": (90000.0, NOW),
        "requests_per_minute": (3999.0, NOW + 1),
    }
    room = window_remaining("openai", OPENAI_HEADERS, NOW)
    assert room["tokens_per_minute"] == (1998765.0, pytest.approx(NOW + 0.037))
    assert room["requests_per_minute"] == (9999.0, pytest.approx(NOW + 0.006))


def test_remaining_without_a_readable_reset_keeps_the_count() -> None:
    room = window_remaining("openai", {"x-ratelimit-remaining-tokens": "500", "x-ratelimit-reset-tokens": "soon",
                                       "x-ratelimit-remaining-requests": "3",
                                       "x-ratelimit-reset-requests": "1000h"}, NOW)
    assert room == {"tokens_per_minute": (500.0, None), "requests_per_minute": (3.0, None)}
    assert window_remaining("anthropic", {"anthropic-ratelimit-input-tokens-reset": rfc3339(NOW)}, NOW) == {}


def test_a_window_s_remaining_zero_names_it_when_the_words_do_not() -> None:
    headers = {**ANTHROPIC_HEADERS, "anthropic-ratelimit-output-tokens-remaining": "0"}
    assert window_hit("anthropic", 429, headers, ANTHROPIC_UNNAMED) == "output_tokens_per_minute"
    assert window_hit("anthropic", 429, headers, ANTHROPIC_ITPM) == "input_tokens_per_minute", "the words first"
    spent = CIMultiDict({"X-RateLimit-Remaining-Requests": "0", "X-RateLimit-Remaining-Tokens": "1000"})
    assert window_hit("openai", 429, spent, OPENAI_QUOTA) == "requests_per_minute"
    assert window_hit("anthropic", 429, {"anthropic-ratelimit-tokens-remaining": "0"}, None) is None, \
        "the combined tokens header is not a window"


def test_only_a_429_is_a_window_hit() -> None:
    assert window_hit("anthropic", 529, {}, ANTHROPIC_ITPM) is None
    assert window_hit("openai", 200, {"x-ratelimit-remaining-tokens": "0"}, None) is None


def test_another_dialect_s_words_name_no_window() -> None:
    assert window_hit("anthropic", 429, {}, OPENAI_TPM) is None, "Anthropic has no tokens-per-minute window"
    assert window_hit("openai", 429, {}, ANTHROPIC_ITPM) is None
