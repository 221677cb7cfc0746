"""Priority from the agents' own headers, and the client's deadline, exactly as the real CLIs send them;
then which headers are passed on, each way.

The header values below are copied from Codex CLI 0.171 and Claude Code 2.1.197 requests
(ids shortened); ``tests/http/test_provider_signals.py`` drives the same through the relay.
"""

from __future__ import annotations

import json
import logging

import pytest
from multidict import CIMultiDict

from proxy.http.headers import (
    InvalidHeaderLog,
    PriorityHeaders,
    client_wait_limit,
    forward_request_headers,
    forward_response_headers,
    parse_priority,
)
from proxy.limiter import FakeClock

from ..conftest import chat, provider_yaml

NOW = 1_796_118_500.0
CODEX_METADATA = json.dumps({
    "installation_id": "bbf32f67", "session_id": "01a23100-6ea7", "thread_id": "01a23100-6ea7",
    "turn_id": "01a23100-6ecb", "request_kind": "turn", "turn_trigger": "exec",
    "turn_started_at_unix_ms": 1796118441680, "analytics_enabled": False, "model": "gpt-5-codex",
})
CODEX = {"x-codex-turn-metadata": CODEX_METADATA, "session-id": "01a23100-6ea7", "thread-id": "01a23100-6ea7",
         "originator": "codex_exec"}
CLAUDE = {"X-Claude-Code-Session-Id": "7856009e-7318-4e00-a848-2cbcd6be6ef8", "X-Stainless-Timeout": "600",
          "X-Stainless-Retry-Count": "0", "x-app": "cli"}


def priority(headers: dict[str, str]) -> tuple[float, str | None, list[str]]:
    found, invalid = parse_priority(CIMultiDict(headers), PriorityHeaders(), NOW)
    return found.prompt_started_at, found.conversation, invalid


def test_codex_gets_its_turn_start_and_session_with_no_configuration() -> None:
    assert priority(CODEX) == (1796118441.68, "01a23100-6ea7", [])


def test_claude_code_gets_its_session() -> None:
    assert priority(CLAUDE) == (NOW, "7856009e-7318-4e00-a848-2cbcd6be6ef8", [])


def test_the_proxys_own_headers_win() -> None:
    mine = {**CODEX, "X-Prompt-Started-At": str(int((NOW - 5) * 1000)), "X-Conversation-Id": "agent-7"}
    assert priority(mine) == (NOW - 5, "agent-7", [])


@pytest.mark.parametrize("metadata", ["not json", "[]", json.dumps({"turn_started_at_unix_ms": "soon"}),
                                      json.dumps({"turn_started_at_unix_ms": True}),
                                      json.dumps({"turn_started_at_unix_ms": 10}),
                                      json.dumps({"turn_started_at_unix_ms": (NOW + 3600) * 1000}),
                                      "{" + " " * 5000 + "}"])
def test_unusable_turn_metadata_falls_back_to_arrival(metadata: str) -> None:
    assert priority({"x-codex-turn-metadata": metadata})[0] == NOW


def test_an_ancient_turn_start_counts_as_max_prompt_age() -> None:
    started, _, _ = priority({"x-codex-turn-metadata": json.dumps({"turn_started_at_unix_ms": 946684800000})})
    assert started == NOW - 86400


@pytest.mark.parametrize(("headers", "expected"), [
    ({"X-Stainless-Timeout": "600"}, 595.0),
    ({"X-Stainless-Read-Timeout": "120.5"}, 115.5),
    ({"X-Stainless-Timeout": "600", "X-Stainless-Read-Timeout": "60"}, 55.0),
    ({"X-Stainless-Timeout": "3"}, 0.0),
    ({"X-Stainless-Timeout": "NOT_GIVEN"}, None),
    ({"X-Stainless-Timeout": "-5"}, None),
    ({"X-Stainless-Timeout": "nan"}, None),
    ({"X-Stainless-Timeout": "inf"}, None),
    ({}, None),
])
def test_the_clients_deadline(headers: dict[str, str], expected: float | None) -> None:
    assert client_wait_limit(CIMultiDict(headers)) == expected


def test_forwarded_request_headers_drop_hop_by_hop_listed_and_stripped_names_and_replace_auth() -> None:
    incoming = CIMultiDict([
        ("Host", "127.0.0.1:8787"), ("Connection", "keep-alive, X-Trace-Hop"), ("x-trace-hop", "1"),
        ("Keep-Alive", "timeout=5"), ("Content-Length", "2"), ("Authorization", "Bearer client"),
        ("X-Api-Key", "client"), ("X-Workspace-Id", "w"), ("Accept", "a"), ("Accept", "b"),
    ])
    sent = forward_request_headers(incoming, strip=frozenset({"x-workspace-id"}), auth=("x-api-key", "provider"))
    assert list(sent.items()) == [("Accept", "a"), ("Accept", "b"), ("x-api-key", "provider")]
    # The same names with another Connection value: what it lists is dropped, not what the first one listed.
    incoming["Connection"] = "close"
    sent = forward_request_headers(incoming, strip=frozenset(), auth=None)
    assert "x-trace-hop" in sent and "X-Workspace-Id" in sent and sent["Authorization"] == "Bearer client"
    assert "Connection" not in sent and "Host" not in sent and "Keep-Alive" not in sent


def test_relayed_response_headers_keep_repeats_and_cors_only_when_asked() -> None:
    incoming = CIMultiDict([
        ("Content-Type", "application/json"), ("Set-Cookie", "a=1"), ("Set-Cookie", "b=2"),
        ("Transfer-Encoding", "chunked"), ("Content-Length", "10"), ("Access-Control-Allow-Origin", "*"),
    ])
    assert list(forward_response_headers(incoming).items()) == [
        ("Content-Type", "application/json"), ("Set-Cookie", "a=1"), ("Set-Cookie", "b=2")]
    assert forward_response_headers(incoming, keep_cors=True)["Access-Control-Allow-Origin"] == "*"


# ----- an invalid priority header is said, once a minute per header, never with its value --------------------


def refusal_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "slotproxy.headers"]


def test_an_invalid_priority_header_is_said_once_a_minute_per_header_with_why_and_never_its_value(caplog) -> None:
    caplog.set_level(logging.INFO, logger="slotproxy.headers")
    clock = FakeClock(NOW)
    names = PriorityHeaders(refusals=InvalidHeaderLog(clock=clock.time))
    starred_bad = {"X-Workspace-Starred": "maybe-SECRET-1"}
    for _ in range(5):  # 40 s of the same bad value: one line, each still counted by its caller
        assert parse_priority(starred_bad, names, NOW)[1] == ["starred"]
        clock.advance(10)
    parse_priority({"X-Workspace-Id": "SECRET-2" + "w" * 300, "X-Prompt-Started-At": "2024-13-45T00:00:00Z"},
                   names, NOW)
    assert refusal_lines(caplog) == [
        ("priority header X-Workspace-Starred (headers.starred) refused: not one of 1, true, yes, on, 0, false, "
        "no, off; its default is used"),
        "priority header X-Workspace-Id (headers.workspace) refused: longer than 256 characters; its default is used",
        ("priority header X-Prompt-Started-At (headers.prompt_started_at) refused: an RFC 3339 time that is no real "
        "date or time of day; its default is used"),
    ]
    clock.advance(20)  # a minute after the first line
    parse_priority({"X-Workspace-Starred": "SECRET-3", "X-Prompt-Started-At": "SECRET-4"}, names, NOW)
    assert refusal_lines(caplog)[3:] == [
        ("priority header X-Workspace-Starred (headers.starred) refused: not one of 1, true, yes, on, 0, false, "
        "no, off; its default is used (5 since the last report)"),
    ], "the prompt start's own minute has not passed"
    assert not any("SECRET" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize(("header", "value", "why"), [
    ("X-Workspace-Id", "   ", "empty, or not printable ASCII"),
    ("X-Conversation-Id", "conversation\u00e9", "empty, or not printable ASCII"),
    ("X-Prompt-Started-At", "yesterday", "neither epoch milliseconds nor an RFC 3339 time"),
    ("X-Prompt-Started-At", "0946684799000", "before 2000-01-01 or more than 5 minutes ahead of this proxy's clock"),
])
def test_each_refusal_says_which_rule_the_value_broke(caplog, header, value, why) -> None:
    caplog.set_level(logging.INFO, logger="slotproxy.headers")
    parse_priority({header: value}, PriorityHeaders(refusals=InvalidHeaderLog()), NOW)
    (line,) = refusal_lines(caplog)
    assert line.startswith(f"priority header {header} (") and f"refused: {why};" in line


async def test_invalid_priority_headers_through_the_proxy_are_counted_each_and_said_once(
        start_upstream, start_proxy, client, caplog) -> None:
    caplog.set_level(logging.INFO, logger="slotproxy.headers")
    up = await start_upstream()
    proxy = await start_proxy(provider_yaml(up))
    for _ in range(3):
        async with client.post(f"{proxy.url}/openai/chat/completions", json=chat(stream=False),
                               headers={"X-Workspace-Starred": "SECRET-maybe"}) as resp:
            assert resp.status == 200, "an invalid priority header never fails the request"
    assert refusal_lines(caplog) == [
        ("priority header X-Workspace-Starred (headers.starred) refused: not one of 1, true, yes, on, 0, false, "
        "no, off; its default is used")]
    metrics = proxy.state.metrics.render().decode()
    assert 'slotproxy_invalid_priority_headers_total{header="starred"} 3.0' in metrics
    assert "SECRET" not in caplog.text
