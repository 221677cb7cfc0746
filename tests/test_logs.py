"""One line per event worth knowing: a repeated event is logged at most once an interval, with its count."""

from __future__ import annotations

import logging

import pytest

from proxy.logs import ThrottledLog, mask_secrets


def test_a_repeated_event_is_one_line_an_interval_and_a_single_one_carries_no_count(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    throttled = ThrottledLog(logging.getLogger("slotproxy.test"), logging.WARNING, "could not write (%s)",
                             interval=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="slotproxy.test"):
        assert throttled.event("disk full")
        for _ in range(4):
            now[0] += 1
            assert not throttled.event("disk full")
        now[0] += 60
        assert throttled.event("disk full")
    assert [r.getMessage() for r in caplog.records] == [
        "could not write (disk full)",
        "could not write (disk full) (5 since the last report)",
    ]


@pytest.mark.parametrize(("line", "masked"), [
    ("openai.windows null → {tokens_per_minute: 1000000, learn: false}",
     "openai.windows null → {tokens_per_minute: 1000000, learn: false}"),
    ("input_tokens_per_minute: 40000000 output_tokens=12345678", "input_tokens_per_minute: 40000000 output_tokens=12345678"),
    ("token=abcdefgh1234", "token=***"),
    ('"Authorization": "Bearer abcdefgh1234"', '"Authorization": "Bearer ***"'),
    ("x-api-key: abcdefgh1234", "x-api-key: ***"),
    ("api_key=sk-abcdefgh1234", "api_key=***"),
    ("key sk-ant-abcdefgh1234 pasted", "key *** pasted"),
])
def test_secrets_are_masked_and_the_windows_names_are_not(line: str, masked: str) -> None:
    assert mask_secrets(line) == masked
