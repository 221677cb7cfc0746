"""Priority from the agents' own headers, and the client's deadline, exactly as the real CLIs send them;
then which headers are passed on, each way.

The header values below are copied from Codex CLI 0.171 and Claude Code 2.1.197 requests
(ids shortened); ``tests/http/test_provider_signals.py`` drives the same through the relay.
"""

from __future__ import annotations

import json

import pytest
from multidict import CIMultiDict

from proxy.http.headers import (
    PriorityHeaders,
    client_wait_limit,
    forward_request_headers,
    forward_response_headers,
    parse_priority,
)

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
