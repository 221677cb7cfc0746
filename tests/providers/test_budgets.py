"""Budgets from the providers' rate-limit headers, with the exact header shapes OpenAI and Anthropic send."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from proxy.providers.budgets import MAX_HOLD, read_budget

NOW = 1_800_000_000.0


def rfc3339(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat().replace("+00:00", "Z")


def test_no_rate_limit_headers_no_budget() -> None:
    assert read_budget({"content-type": "application/json"}, NOW) is None


@pytest.mark.parametrize(("reset", "seconds"), [("1s", 1.0), ("6m0s", 360.0), ("20ms", 0.02), ("1h2m3.5s", 3723.5),
                                                ("0.5s", 0.5)])
def test_openai_requests_spent_hold_until_the_reset(reset: str, seconds: float) -> None:
    budget = read_budget({"x-ratelimit-remaining-requests": "0", "x-ratelimit-remaining-tokens": "39000",
                          "x-ratelimit-reset-requests": reset, "x-ratelimit-reset-tokens": "7m12s"}, NOW)
    assert budget is not None
    assert (budget.remaining_requests, budget.remaining_tokens) == (0, 39000)
    assert budget.held_until == pytest.approx(NOW + seconds)
    assert budget.reset_at == budget.held_until, "the reset shown is the one that holds the key"


def test_requests_left_means_no_hold_and_the_earliest_reset() -> None:
    budget = read_budget({"x-ratelimit-remaining-requests": "59", "x-ratelimit-reset-requests": "1s",
                          "x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "20ms"}, NOW)
    assert budget is not None and budget.held_until is None, "spent tokens alone do not hold (requests still go)"
    assert budget.reset_at == pytest.approx(NOW + 0.02)


def test_anthropic_requests_and_the_smallest_token_window() -> None:
    headers = {
        "anthropic-ratelimit-requests-remaining": "0",
        "anthropic-ratelimit-requests-reset": rfc3339(NOW + 2.5),
        "anthropic-ratelimit-tokens-remaining": "80000",
        "anthropic-ratelimit-tokens-reset": rfc3339(NOW + 30),
        "anthropic-ratelimit-input-tokens-remaining": "5000",
        "anthropic-ratelimit-input-tokens-reset": rfc3339(NOW + 10),
        "anthropic-ratelimit-output-tokens-remaining": "9000",
        "anthropic-ratelimit-output-tokens-reset": rfc3339(NOW + 12),
    }
    budget = read_budget(headers, NOW)
    assert budget is not None
    assert (budget.remaining_requests, budget.remaining_tokens) == (0, 5000)
    assert budget.held_until == pytest.approx(NOW + 2.5)


@pytest.mark.parametrize("reset", [str(int(NOW) + 3600), rfc3339(NOW + 3600)])
def test_anthropic_unified_rejected_holds_until_the_unified_reset(reset: str) -> None:
    budget = read_budget({"anthropic-ratelimit-unified-status": "rejected",
                          "anthropic-ratelimit-unified-reset": reset}, NOW)
    assert budget is not None and budget.held_until == pytest.approx(NOW + 3600)
    allowed = read_budget({"anthropic-ratelimit-unified-status": "allowed_warning",
                           "anthropic-ratelimit-unified-reset": reset}, NOW)
    assert allowed is not None and allowed.held_until is None and allowed.reset_at == pytest.approx(NOW + 3600)


@pytest.mark.parametrize("headers", [
    {"x-ratelimit-remaining-requests": "zero", "x-ratelimit-reset-requests": "1s"},
    {"x-ratelimit-remaining-requests": "-1", "x-ratelimit-reset-requests": "1s"},
    {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "soon"},
    {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1s2"},
    {"anthropic-ratelimit-requests-remaining": "0", "anthropic-ratelimit-requests-reset": "2026-13-40T00:00:00Z"},
    {"anthropic-ratelimit-requests-remaining": "0", "anthropic-ratelimit-requests-reset": "2026-12-01T00:00:00"},
    {"anthropic-ratelimit-unified-status": "rejected", "anthropic-ratelimit-unified-reset": str(int(NOW + 2 * MAX_HOLD))},
])
def test_unreadable_or_unbelievable_values_never_hold(headers: dict[str, str]) -> None:
    budget = read_budget(headers, NOW)
    assert budget is None or budget.held_until is None
