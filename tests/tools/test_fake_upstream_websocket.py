"""The fake provider's WebSocket mode of the Responses API, as Codex uses it: real sockets on 127.0.0.1."""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import json
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import WSMsgType

from proxy.tools.fake_upstream import FakeUpstream, add_arguments, start_fake_upstream

RESPONSES = "/v1/responses"
BETA = {"OpenAI-Beta": "responses_websockets=2026-02-06"}
TERMINAL = {"response.completed", "response.failed", "error"}
RESPONSES_EVENTS = [
    "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
    *["response.output_text.delta"] * 3,
    "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed",
]
TPM_MESSAGE = (
    "Rate limit reached for gpt-4o in organization org-x on tokens per min (TPM): "
    "Limit 30000, Used 30000, Requested 1200. Please try again in 6.379s."
)
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Upstream:
    fake: FakeUpstream
    url: str
    session: aiohttp.ClientSession

    def connect(self, **headers: str) -> Any:
        """Open a socket as Codex does (deflate offered, the beta header); ``x_fake_chunks`` → ``x-fake-chunks``."""
        wire = BETA | {name.replace("_", "-"): value for name, value in headers.items()}
        return self.session.ws_connect(self.url + RESPONSES, headers=wire, compress=15, autoclose=True)

    async def upgrade_by_hand(self, **headers: str) -> tuple[int, Any, Any]:
        """An upgrade request whose refusal is read whole: status, headers, JSON body."""
        wire = {
            "Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Key": base64.b64encode(os.urandom(16)).decode(), **BETA,
            **{name.replace("_", "-"): value for name, value in headers.items()},
        }
        async with self.session.get(self.url + RESPONSES, headers=wire) as resp:
            return resp.status, resp.headers, await resp.json()


@pytest.fixture
def fake(request: pytest.FixtureRequest) -> FakeUpstream:
    return FakeUpstream(**(getattr(request, "param", None) or {"chunks": 3, "delay_ms": 5}))


def options(**kwargs: Any) -> pytest.MarkDecorator:
    """Run the test against a fake built with these options."""
    return pytest.mark.parametrize("fake", [kwargs], indirect=True, ids=[""])


@pytest.fixture
async def up(fake: FakeUpstream) -> AsyncIterator[Upstream]:
    runner, port = await start_fake_upstream(fake)
    async with aiohttp.ClientSession() as session:
        yield Upstream(fake, f"http://127.0.0.1:{port}", session)
    await runner.cleanup()


async def create(ws: aiohttp.ClientWebSocketResponse, **fields: Any) -> None:
    await ws.send_str(json.dumps({"type": "response.create", "model": "m", "input": "hi", **fields}))


async def frame(ws: aiohttp.ClientWebSocketResponse) -> dict[str, Any]:
    message = await asyncio.wait_for(ws.receive(), 5)
    assert message.type is WSMsgType.TEXT, message
    event: dict[str, Any] = json.loads(message.data)
    return event


async def response(ws: aiohttp.ClientWebSocketResponse) -> list[dict[str, Any]]:
    """The frames of one response, up to its terminal event."""
    events = [await frame(ws)]
    while events[-1]["type"] not in TERMINAL:
        events.append(await frame(ws))
    return events


async def answer(ws: aiohttp.ClientWebSocketResponse, **fields: Any) -> list[dict[str, Any]]:
    await create(ws, **fields)
    return await response(ws)


def types(events: list[dict[str, Any]]) -> list[str]:
    return [event["type"] for event in events]


async def wait_until(check: Callable[[], bool], what: str, within: float = 2.0) -> float:
    """Poll ``check`` until true; returns the seconds it took."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < within, f"{what} never happened"
        await asyncio.sleep(0.005)
    return time.monotonic() - start


# --- responses on a socket --------------------------------------------------------------------


async def test_a_response_is_the_sse_events_one_frame_each(up: Upstream) -> None:
    async with up.connect(Authorization="Bearer sk-1") as ws:
        events = await answer(ws)
        assert (up.fake.websockets, up.fake.websockets_opened) == (1, 1)
    assert types(events) == RESPONSES_EVENTS
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "tok0 tok1 tok2 "
    done = events[-1]["response"]
    assert (done["status"], done["model"], done["output"][0]["content"][0]["text"]) == \
        ("completed", "m", "tok0 tok1 tok2 ")
    usage = done["usage"]
    assert usage["output_tokens"] == 3 and usage["total_tokens"] == usage["input_tokens"] + 3 > 3
    stats = up.fake.stats()
    assert (stats["requests"], stats["completed"], stats["active"], stats["max_concurrency"]) == (1, 1, 0, 1)
    assert stats["keys"]["sk-1"]["requests"] == 1
    assert stats["last_headers"]["openai-beta"] == "responses_websockets=2026-02-06"
    await wait_until(lambda: up.fake.websockets == 0, "the socket's closing")


async def test_frames_carry_the_events_of_the_sse_stream(up: Upstream, monkeypatch: pytest.MonkeyPatch) -> None:
    real = FakeUpstream._reply
    monkeypatch.setattr(FakeUpstream, "_reply", staticmethod(
        lambda *args: dataclasses.replace(real(*args), id="resp_fixed", created=0, prompt_tokens=1)))
    async with up.session.post(up.url + RESPONSES, json={"model": "m", "input": "hi", "stream": True}) as resp:
        sse = [json.loads(line[len(b"data: "):]) async for line in resp.content if line.startswith(b"data: ")]
    async with up.connect() as ws:
        assert await answer(ws) == sse


async def test_the_handshake_negotiates_deflate_and_echoes_the_subprotocol(up: Upstream) -> None:
    async with up.session.ws_connect(up.url + RESPONSES, protocols=("first", "second"), compress=15) as ws:
        assert (ws.protocol, ws.compress) == ("first", 15)
        assert types(await answer(ws)) == RESPONSES_EVENTS


async def test_a_warmup_is_counted_and_answered_at_once_with_an_empty_completion(up: Upstream) -> None:
    async with up.connect(x_fake_stall_ms="2000", x_fake_delay_ms="2000") as ws:
        start = time.monotonic()
        events = await answer(ws, generate=False)
        assert time.monotonic() - start < 1
    assert types(events) == ["response.created", "response.completed"]
    assert [event["sequence_number"] for event in events] == [0, 1]
    done = events[1]["response"]
    assert (done["status"], done["output"], done["id"]) == ("completed", [], events[0]["response"]["id"])
    assert done["usage"]["input_tokens"] == done["usage"]["output_tokens"] == done["usage"]["total_tokens"] == 0
    assert (up.fake.requests, up.fake.completed, up.fake.active) == (1, 1, 0)


async def test_one_socket_carries_many_responses_one_after_another(up: Upstream) -> None:
    async with up.connect(x_fake_tag="session") as ws:
        warmup = await answer(ws, generate=False)
        await create(ws, x_fake={"tag": "first"})
        await create(ws, user="ignored")
        first, second = await response(ws), await response(ws)
    assert types(first) == types(second) == RESPONSES_EVENTS
    ids = {events[0]["response"]["id"] for events in (warmup, first, second)}
    assert len(ids) == 3
    assert [arrival["tag"] for arrival in up.fake.arrivals] == ["session", "first", "session"]
    assert (up.fake.requests, up.fake.completed, up.fake.max_concurrency) == (3, 3, 1)


async def test_without_a_tag_the_frame_user_is_recorded(up: Upstream) -> None:
    async with up.connect() as ws:
        await answer(ws, user="alice")
    assert up.fake.arrivals[0]["tag"] == "alice"


@options(lag_ms=150, chunks=1, delay_ms=0)
async def test_lag_keeps_a_finished_response_counted(up: Upstream) -> None:
    async with up.connect() as ws:
        await answer(ws)
        assert up.fake.active == 1
        assert await wait_until(lambda: up.fake.active == 0, "the release") > 0.08


# --- the cap, the key limit and the window ---------------------------------------------------


@pytest.mark.parametrize("fake", [{"cap": 1, "chunks": 3, "delay_ms": 100},
                                  {"key_limit": 1, "chunks": 3, "delay_ms": 100}],
                         indirect=True, ids=["cap", "key_limit"])
async def test_over_the_limit_a_response_gets_a_429_frame_and_the_socket_stays_open(up: Upstream) -> None:
    async with up.connect(Authorization="Bearer k") as first, up.connect(Authorization="Bearer k") as second:
        await create(first)
        await wait_until(lambda: up.fake.active == 1, "the first admission")
        refused = await answer(second)
        assert refused == [{
            "type": "error", "status": 429,
            "error": {"message": refused[0]["error"]["message"], "type": "rate_limit_error",
                      "code": "rate_limit_exceeded"},
            "headers": {"retry-after": "1", "retry-after-ms": "1000"},
        }]
        assert refused[0]["error"]["message"].endswith(". Please try again in 1s.")
        assert types(await response(first)) == RESPONSES_EVENTS
        await wait_until(lambda: up.fake.active == 0, "the release")
        assert types(await answer(second)) == RESPONSES_EVENTS
    assert (up.fake.rate_limited, up.fake.requests, up.fake.completed, up.fake.max_concurrency) == (1, 3, 2, 1)
    assert up.fake.keys["k"].rejected == 1


@options(window_requests=1, chunks=1, delay_ms=0)
async def test_a_spent_window_refuses_the_next_response_with_its_wait(up: Upstream) -> None:
    async with up.connect() as ws:
        assert types(await answer(ws))[-1] == "response.completed"
        [refused] = await answer(ws)
    assert refused["status"] == 429
    assert re.fullmatch(r"Request limit reached: 1 per 60s\. Please try again in (59\.\d{1,3}s|1m0s)\.",
                        refused["error"]["message"])
    assert 59_000 < int(refused["headers"]["retry-after-ms"]) <= 60_000
    assert (up.fake.window_rejected, up.fake.rate_limited) == (1, 1)


# --- refused upgrades --------------------------------------------------------------------------


@options(cap=1, ws_refuse_429=True, retry_after=2.5, chunks=3, delay_ms=5)
async def test_ws_refuse_429_refuses_an_upgrade_while_the_cap_is_full(up: Upstream) -> None:
    async with up.connect() as holder:
        await create(holder, x_fake={"stall-ms": 300})
        await wait_until(lambda: up.fake.active == 1, "the admission")
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await up.connect()
        assert refused.value.status == 429
        assert refused.value.headers is not None
        assert (refused.value.headers["Retry-After"], refused.value.headers["retry-after-ms"]) == ("3", "2500")
        status, _, body = await up.upgrade_by_hand()
        assert (status, body["error"]["code"], body["error"]["type"]) == (429, "rate_limit_exceeded",
                                                                           "rate_limit_error")
        assert types(await response(holder)) == RESPONSES_EVENTS
    await wait_until(lambda: up.fake.active == 0, "the release")
    async with up.connect() as ws:
        assert types(await answer(ws)) == RESPONSES_EVENTS
    assert (up.fake.rate_limited, up.fake.websockets_opened, up.fake.requests) == (2, 2, 2)


@options(cap=1)
async def test_without_ws_refuse_429_a_full_cap_still_opens_the_socket(up: Upstream) -> None:
    async with up.connect() as holder, up.connect() as other:
        await create(holder, x_fake={"stall-ms": 200})
        await wait_until(lambda: up.fake.active == 1, "the admission")
        assert (await answer(other))[0]["status"] == 429


@options(websocket=False)
async def test_no_websocket_refuses_upgrades_with_404(up: Upstream) -> None:
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await up.connect()
    assert refused.value.status == 404
    status, _, body = await up.upgrade_by_hand()
    assert status == 404 and body["error"]["type"] == "not_found_error" and "WebSocket" in body["error"]["message"]
    assert (up.fake.websockets_opened, up.fake.requests) == (0, 0)


async def test_a_plain_get_is_still_405(up: Upstream) -> None:
    async with up.session.get(up.url + RESPONSES) as resp:
        assert resp.status == 405
        assert resp.headers["Allow"] == "POST"
    async with up.session.post(up.url + RESPONSES, json={"model": "m", "input": "hi"}) as resp:
        assert resp.status == 200


@pytest.mark.parametrize("status", [405, 429, 500, 200])
async def test_x_fake_ws_refuse_refuses_that_upgrade(up: Upstream, status: int) -> None:
    got, headers, body = await up.upgrade_by_hand(x_fake_ws_refuse=str(status))
    assert got == status
    assert body["error"]["message"] == f"Injected refusal {status} of the WebSocket upgrade"
    assert ("Retry-After" in headers) is (status == 429)
    assert up.fake.rate_limited == (status == 429)
    assert up.fake.last_headers["x-fake-ws-refuse"] == str(status)
    async with up.connect() as ws:
        assert types(await answer(ws)) == RESPONSES_EVENTS


@pytest.mark.parametrize("value", ["abc", "101", "600"])
async def test_a_bad_x_fake_ws_refuse_is_a_400(up: Upstream, value: str) -> None:
    status, _, body = await up.upgrade_by_hand(x_fake_ws_refuse=value)
    assert status == 400
    assert body["error"]["message"] == f"x-fake-ws-refuse must be a status 200-599, got {value!r}"


# --- in-stream errors and injected statuses ----------------------------------------------------


async def test_stream_error_sends_response_failed_and_the_socket_stays_open(up: Upstream) -> None:
    async with up.connect() as ws:
        events = await answer(ws, x_fake={"stream-error": "rate_limit_exceeded"})
        assert types(await answer(ws)) == RESPONSES_EVENTS
    assert types(events) == [*RESPONSES_EVENTS[:5], "response.failed"]
    failed = events[-1]
    assert failed["sequence_number"] == 5
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "rate_limit_exceeded", "message": TPM_MESSAGE}
    assert (up.fake.active, up.fake.requests, up.fake.completed) == (0, 2, 2)


@pytest.mark.parametrize("kind,status,message", [
    ("rate_limit_exceeded", 429, TPM_MESSAGE),
    ("server_is_overloaded", 503, "In-stream error: server_is_overloaded"),
    ("server_error", 500, "In-stream error: server_error"),
])
async def test_stream_error_event_form_is_an_error_frame_with_a_status(
    up: Upstream, kind: str, status: int, message: str
) -> None:
    async with up.connect(x_fake_stream_error=kind, x_fake_stream_error_form="event") as ws:
        events = await answer(ws)
        assert types(await answer(ws, x_fake={"stream-error": None})) == RESPONSES_EVENTS
    assert types(events) == [*RESPONSES_EVENTS[:5], "error"]
    assert events[-1] == {"type": "error", "status": status, "error": {"type": kind, "code": kind, "message": message}}
    assert up.fake.active == 0


async def test_injected_status_is_an_error_frame_after_admission(up: Upstream) -> None:
    async with up.connect() as ws:
        [limited] = await answer(ws, x_fake={"status": 429})
        [bare] = await answer(ws, x_fake={"status": 429, "no-retry-after": True})
        [broken] = await answer(ws, x_fake={"status": 500, "error-code": "boom"})
    assert limited == {"type": "error", "status": 429,
                       "error": {"message": "Injected status 429", "type": "rate_limit_error",
                                 "code": "rate_limit_exceeded"},
                       "headers": {"retry-after": "1", "retry-after-ms": "1000"}}
    assert "headers" not in bare
    assert broken == {"type": "error", "status": 500,
                      "error": {"message": "Injected status 500", "type": "server_error", "code": "boom"}}
    assert (up.fake.rate_limited, up.fake.max_concurrency, up.fake.active) == (2, 1, 0)


# --- knobs -----------------------------------------------------------------------------------


async def test_handshake_knobs_apply_to_every_response_and_frame_knobs_override_them(up: Upstream) -> None:
    async with up.connect(x_fake_chunks="2", x_fake_ratelimit_headers="not json", x_fake_reset_after="0") as ws:
        first = await answer(ws)
        second = await answer(ws, x_fake={"chunks": 4})
        third = await answer(ws)
        fourth = await answer(ws, x_fake={"chunks": None})
    deltas = [types(events).count("response.output_text.delta") for events in (first, second, third, fourth)]
    assert deltas == [2, 4, 2, 3]


async def test_delay_and_stall_pace_a_socket_response(up: Upstream) -> None:
    async with up.connect() as ws:
        start = time.monotonic()
        await create(ws, x_fake={"stall-ms": 150, "delay-ms": "50"})
        await frame(ws)
        stalled = time.monotonic() - start
        await response(ws)
        total = time.monotonic() - start
    assert stalled >= 0.14 and total >= stalled + 0.14


async def test_close_after_closes_the_socket_with_1011_and_releases(up: Upstream) -> None:
    async with up.connect() as ws:
        await create(ws, x_fake={"close-after": 2})
        events = [await frame(ws) for _ in range(6)]
        closing = await asyncio.wait_for(ws.receive(), 5)
        assert closing.type is WSMsgType.CLOSE and closing.data == 1011
    assert types(events) == RESPONSES_EVENTS[:6]
    assert ws.close_code == 1011
    await wait_until(lambda: up.fake.websockets == 0, "the socket's closing")
    assert (up.fake.active, up.fake.completed, up.fake.requests) == (0, 0, 1)


async def test_close_after_past_the_last_delta_cuts_before_the_closing_events(up: Upstream) -> None:
    async with up.connect(x_fake_close_after="9") as ws:
        await create(ws)
        events = [await frame(ws) for _ in range(7)]
        assert (await asyncio.wait_for(ws.receive(), 5)).type is WSMsgType.CLOSE
    assert types(events) == RESPONSES_EVENTS[:7] and ws.close_code == 1011


async def test_drop_after_resets_the_connection_without_a_close_frame(up: Upstream) -> None:
    async with up.connect() as ws:
        await create(ws, x_fake={"drop-after": 1})
        events = [await frame(ws) for _ in range(5)]
        ending = await asyncio.wait_for(ws.receive(), 5)
    assert types(events) == RESPONSES_EVENTS[:5]
    assert ending.type in (WSMsgType.CLOSED, WSMsgType.ERROR)
    assert ws.close_code != 1011
    await wait_until(lambda: up.fake.websockets == 0, "the socket's end")
    assert (up.fake.active, up.fake.completed) == (0, 0)


@options(chunks=50, delay_ms=20)
@pytest.mark.parametrize("leave", ["close", "vanish"])
async def test_a_client_leaving_mid_response_frees_the_slot_at_once(up: Upstream, leave: str) -> None:
    async with up.connect() as ws:
        await create(ws)
        while (await frame(ws))["type"] != "response.output_text.delta":
            pass
        assert up.fake.active == 1
        if leave == "close":
            await ws.close()
        else:
            ws._conn.transport.abort()  # type: ignore[union-attr]
        assert await wait_until(lambda: up.fake.active == 0, "the release", within=0.5) < 0.5
    await wait_until(lambda: up.fake.websockets == 0, "the socket's end")
    assert (up.fake.completed, up.fake.keys[""].in_flight) == (0, 0)


@pytest.mark.parametrize("knobs,message", [
    ({"chunks": 0}, "x-fake-chunks must be an integer >= 1, got '0'"),
    ({"chunks": "many"}, "x-fake-chunks must be an integer >= 1, got 'many'"),
    ({"delay-ms": -1}, "x-fake-delay-ms must be a number of ms >= 0, got '-1'"),
    ({"stream-error-form": "loud"}, "x-fake-stream-error-form must be one of event, failed, got 'loud'"),
    ({"close-after": -1}, "x-fake-close-after must be an integer >= 0, got '-1'"),
    ({"close-after": 1, "drop-after": 1}, "close-after and drop-after cannot both be set"),
    ({"chunks": [3]}, "x_fake.chunks must be a string, a number or a boolean, got [3]"),
    ({"chunk": 3}, "x_fake has no knob 'chunk'; the knobs are "),
    ([1], "x_fake must be a JSON object, got [1]"),
    ({"usage": [1]}, "x_fake.usage must be a JSON object, got [1]"),
    ({"usage": '{"input": 5}'}, 'x_fake.usage must be a JSON object, got "{\\"input\\": 5}"'),
    ({"usage": {"input": -1}}, "x-fake-usage: input must be an integer >= 0, got -1"),
    ({"usage": {"inputs": 1}}, "x-fake-usage has no figure 'inputs'; the figures are input, cached, "),
    ({"usage": {"output": 1, "reasoning": 2}}, "x-fake-usage: reasoning (2) must not exceed output (1; "),
    ({"usage-deltas": 2}, "x_fake has no knob 'usage-deltas'"),
])
async def test_bad_knobs_get_a_400_frame_and_the_socket_stays_open(
    up: Upstream, knobs: Any, message: str
) -> None:
    async with up.connect() as ws:
        [error] = await answer(ws, x_fake=knobs)
        assert types(await answer(ws)) == RESPONSES_EVENTS
    assert (error["type"], error["status"], error["error"]["type"]) == ("error", 400, "invalid_request_error")
    assert error["error"]["message"].startswith(message)
    assert (up.fake.requests, up.fake.completed, up.fake.max_concurrency) == (2, 1, 1)


USAGE = {"input": 900, "cached": 512, "cache_write": 64, "output": 40, "reasoning": 16}
RESPONSES_USAGE = {
    "input_tokens": 900, "input_tokens_details": {"cached_tokens": 512},
    "output_tokens": 40, "output_tokens_details": {"reasoning_tokens": 16}, "total_tokens": 940,
}


def usages(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``usage`` of each event carrying a ``response``, by the event's type."""
    return {event["type"]: event["response"]["usage"] for event in events if "response" in event}


async def test_usage_knob_on_the_handshake_and_in_a_frame(up: Upstream) -> None:
    # usage-deltas (Anthropic's) is no socket knob: the handshake's, even a bad one, is ignored.
    async with up.connect(x_fake_usage=json.dumps(USAGE), x_fake_usage_deltas="0") as ws:
        first = await answer(ws)
        second = await answer(ws, x_fake={"usage": {"input": 7, "output": 2}, "chunks": 2})
        third = await answer(ws, x_fake={"usage": None, "chunks": 1})
    assert usages(first) == {"response.created": None, "response.in_progress": None,
                             "response.completed": RESPONSES_USAGE}
    assert usages(second)["response.completed"] == {
        "input_tokens": 7, "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 2, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 9,
    }
    done = usages(third)["response.completed"]
    assert (done["input_tokens_details"], done["output_tokens"], done["output_tokens_details"]) == \
        ({"cached_tokens": 0}, 1, {"reasoning_tokens": 0})
    assert done["input_tokens"] > 0 and done["total_tokens"] == done["input_tokens"] + 1


async def test_a_warmup_reports_zero_usage_whatever_the_knob_says(up: Upstream) -> None:
    async with up.connect(x_fake_usage='{"cached": 100000}') as ws:
        warmup = await answer(ws, generate=False)
        [error] = await answer(ws)
        fitting = await answer(ws, x_fake={"usage": {"input": 100000, "cached": 100000}})
    assert usages(warmup) == {"response.created": None, "response.completed": {
        "input_tokens": 0, "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0,
    }}
    assert (error["status"], error["error"]["type"]) == (400, "invalid_request_error")
    assert error["error"]["message"].startswith("x-fake-usage: cached + cache_write (100000 + 0) must not exceed")
    assert usages(fitting)["response.completed"]["input_tokens_details"] == {"cached_tokens": 100000}
    assert (up.fake.requests, up.fake.completed) == (3, 2)


async def test_a_bad_handshake_knob_gets_a_400_frame_per_response(up: Upstream) -> None:
    async with up.connect(x_fake_chunks="0") as ws:
        [error] = await answer(ws)
        assert types(await answer(ws, x_fake={"chunks": 3})) == RESPONSES_EVENTS
    assert error["status"] == 400


# --- other frames, statistics, the command line ------------------------------------------------


async def test_other_frames_are_refused_or_ignored(up: Upstream) -> None:
    async with up.connect() as ws:
        await ws.send_str("not json")
        await ws.send_str("[1, 2]")
        await ws.send_bytes(b'{"type": "response.create"}')
        await ws.send_str(json.dumps({"type": "response.cancel", "response_id": "resp_x"}))
        for _ in range(2):
            error = await frame(ws)
            assert (error["type"], error["status"]) == ("error", 400)
            assert error["error"]["message"] == \
                "A text frame must hold a JSON object, such as a response.create event"
        assert types(await answer(ws)) == RESPONSES_EVENTS
    assert up.fake.requests == 1


async def test_a_create_nested_under_response_is_read_too(up: Upstream) -> None:
    async with up.connect() as ws:
        await ws.send_str(json.dumps({"type": "response.create", "response": {"model": "nested", "user": "u"}}))
        events = await response(ws)
    assert events[-1]["response"]["model"] == "nested"
    assert up.fake.arrivals[0]["tag"] == "u"


async def test_stats_count_open_sockets_and_reset_keeps_them(up: Upstream) -> None:
    async with up.connect() as first:
        async with up.connect():
            await wait_until(lambda: up.fake.websockets == 2, "two open sockets")
            up.fake.reset()
            assert (up.fake.websockets, up.fake.websockets_opened) == (2, 2)
        await wait_until(lambda: up.fake.websockets == 1, "one socket closed")
        assert types(await answer(first)) == RESPONSES_EVENTS
        async with up.session.get(up.url + "/stats") as resp:
            stats = await resp.json()
    assert (stats["websockets"], stats["websockets_opened"], stats["requests"]) == (1, 2, 1)


def test_add_arguments_websocket_flags() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = parser.parse_args([])
    assert (defaults.websocket, defaults.ws_refuse_429) == (True, False)
    given = parser.parse_args(["--no-websocket", "--ws-refuse-429"])
    assert (given.websocket, given.ws_refuse_429) == (False, True)
    helps = {action.dest: action.help or "" for action in parser._actions if action.dest != "help"}
    assert all("default" in text for text in helps.values()), helps


async def test_run_serves_the_websocket_flags() -> None:
    code = "from proxy.tools.fake_upstream import run; run(0, 1, websocket=False, ws_refuse_429=True)"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 10)).decode()  # type: ignore[union-attr]
        assert line.rstrip().endswith("lag_ms=0, no-websocket, ws-refuse-429)")
        async with aiohttp.ClientSession() as session:
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await session.ws_connect(line.split()[3] + RESPONSES)
        assert refused.value.status == 404
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 10)
        assert proc.returncode == 0, err.decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
