"""The fake provider: its wire shapes (checked with the official SDKs), its cap, its lag and its knobs."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gzip
import json
import re
import signal
import sys
import time
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import brotli
import openai
import pytest
from backports import zstd

from proxy.tools.fake_upstream import (
    FakeUpstream,
    add_arguments,
    admission,
    dialects,
    start_fake_upstream,
)

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"
CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
MESSAGES_BODY = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
RESPONSES_BODY = {"model": "m", "input": "hi"}
STREAMED = [(CHAT, CHAT_BODY), (MESSAGES, MESSAGES_BODY), (RESPONSES, RESPONSES_BODY)]
ENCODINGS = ["gzip", "deflate", "br", "zstd"]
TPM_MESSAGE = (
    "Rate limit reached for gpt-4o in organization org-x on tokens per min (TPM): "
    "Limit 30000, Used 30000, Requested 1200. Please try again in 6.379s."
)
RESPONSES_EVENTS = [
    "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
    *["response.output_text.delta"] * 3,
    "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed",
]
REPO = Path(__file__).resolve().parents[2]
OPENAI_DURATION = re.compile(r"(?:(\d+)h)?(?:(\d+)m)?(\d+(?:\.\d{1,3})?)s")
OPENAI_WINDOW = ["x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
                 "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"]
ANTHROPIC_WINDOW = [f"anthropic-ratelimit-{kind}-{what}" for kind in ("requests", "tokens")
                    for what in ("limit", "remaining", "reset")]
UNIFIED = ["anthropic-ratelimit-unified-status", "anthropic-ratelimit-unified-reset"]


@dataclass
class Upstream:
    fake: FakeUpstream
    url: str
    session: aiohttp.ClientSession

    def post(self, path: str, body: dict[str, Any], **headers: str) -> Any:
        wire = {name.replace("_", "-"): value for name, value in headers.items()}
        return self.session.post(self.url + path, json=body, headers=wire)

    async def sessions(self) -> int:
        async with self.session.get(self.url + "/v1/usage") as resp:
            return (await resp.json())["concurrent"]["sessions"]

    async def wait_sessions(self, expected: int, within: float = 1.0) -> float:
        """Poll /v1/usage until it reports ``expected``; returns the seconds it took."""
        start = time.monotonic()
        while await self.sessions() != expected:
            assert time.monotonic() - start < within, f"sessions never reached {expected}"
            await asyncio.sleep(0.005)
        return time.monotonic() - start


@pytest.fixture
def fake(request: pytest.FixtureRequest) -> FakeUpstream:
    return FakeUpstream(**(getattr(request, "param", None) or {"chunks": 3, "delay_ms": 5}))


def options(**kwargs: Any) -> pytest.MarkDecorator:
    """Run the test against a fake built with these options."""
    return pytest.mark.parametrize("fake", [kwargs], indirect=True, ids=[""])


@pytest.fixture
async def up(fake: FakeUpstream) -> AsyncIterator[Upstream]:
    runner, port = await start_fake_upstream(fake)
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        yield Upstream(fake, f"http://127.0.0.1:{port}", session)
    await runner.cleanup()


def openai_client(up: Upstream) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{up.url}/v1", api_key="x", max_retries=0)


def anthropic_client(up: Upstream) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=up.url, api_key="x", max_retries=0)


def decode_whole(encoding: str, data: bytes) -> bytes:
    """A complete body decoded; raises if the encoder never finished its stream."""
    if encoding == "gzip":
        return gzip.decompress(data)
    if encoding == "deflate":
        return zlib.decompress(data)
    if encoding == "br":
        return brotli.decompress(data)
    return zstd.decompress(data)


def piecewise_decoder(encoding: str) -> Callable[[bytes], bytes]:
    """Decodes a body piece by piece, as a client reading a compressed stream does."""
    if encoding in ("gzip", "deflate"):
        return zlib.decompressobj(wbits=31 if encoding == "gzip" else 15).decompress
    if encoding == "br":
        return brotli.Decompressor().process
    return zstd.ZstdDecompressor().decompress


@pytest.fixture
def fixed_replies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every answer gets the same id and timestamp, so two answers compare byte for byte."""
    real = FakeUpstream._reply
    monkeypatch.setattr(
        FakeUpstream, "_reply", staticmethod(lambda *args: dataclasses.replace(real(*args), id="fixed", created=0))
    )


async def sse_events(resp: aiohttp.ClientResponse) -> list[tuple[str | None, str]]:
    """(event name, data) pairs of an SSE body."""
    events, name = [], None
    async for raw in resp.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            events.append((name, line[len("data: "):]))
            name = None
    return events


# --- wire shapes, read by the official SDKs -------------------------------------------------


async def test_openai_chat_non_streaming(up: Upstream) -> None:
    async with openai_client(up) as client:
        completion = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert completion.object == "chat.completion"
    assert completion.choices[0].message.content == "tok0 tok1 tok2 "
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and completion.usage.completion_tokens == 3
    assert up.fake.completed == 1


async def test_openai_chat_streaming(up: Upstream) -> None:
    async with openai_client(up) as client:
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "tok0 tok1 tok2 "
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


async def test_openai_stream_ends_with_done(up: Upstream) -> None:
    async with up.post(CHAT, CHAT_BODY | {"stream": True}) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = await sse_events(resp)
    assert events[-1] == (None, "[DONE]")
    assert [json.loads(data)["object"] for _, data in events[:-1]] == ["chat.completion.chunk"] * 4


async def test_openai_completions(up: Upstream) -> None:
    async with openai_client(up) as client:
        full = await client.completions.create(model="m", prompt="hi")
        stream = await client.completions.create(model="m", prompt="hi", stream=True)
        pieces = [chunk.choices[0].text async for chunk in stream]
    assert full.choices[0].text == "tok0 tok1 tok2 "
    assert "".join(pieces) == "tok0 tok1 tok2 "


async def test_anthropic_non_streaming(up: Upstream) -> None:
    async with anthropic_client(up) as client:
        message = await client.messages.create(**MESSAGES_BODY)
    assert message.content[0].type == "text" and message.content[0].text == "tok0 tok1 tok2 "
    assert message.stop_reason == "end_turn"
    assert message.usage.output_tokens == 3


async def test_anthropic_streaming(up: Upstream) -> None:
    async with anthropic_client(up) as client, client.messages.stream(**MESSAGES_BODY) as stream:
        text = "".join([piece async for piece in stream.text_stream])
        final = await stream.get_final_message()
    assert text == "tok0 tok1 tok2 "
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == 3


async def test_anthropic_event_sequence(up: Upstream) -> None:
    async with up.post(MESSAGES, MESSAGES_BODY | {"stream": True}) as resp:
        events = await sse_events(resp)
    names = [name for name, _ in events]
    assert names == [
        "message_start", "content_block_start", *["content_block_delta"] * 3,
        "content_block_stop", "message_delta", "message_stop",
    ]
    assert all(json.loads(data)["type"] == name for name, data in events)


async def test_openai_responses_non_streaming(up: Upstream) -> None:
    async with openai_client(up) as client:
        response = await client.responses.create(**RESPONSES_BODY)
    assert (response.object, response.status, response.model) == ("response", "completed", "m")
    assert response.id.startswith("resp_")
    assert response.output_text == "tok0 tok1 tok2 "
    assert response.output[0].type == "message" and response.output[0].status == "completed"
    assert response.usage is not None
    assert (response.usage.output_tokens, response.usage.total_tokens) == (3, response.usage.input_tokens + 3)
    assert up.fake.completed == 1


async def test_openai_responses_streaming(up: Upstream) -> None:
    async with openai_client(up) as client:
        stream = await client.responses.create(**RESPONSES_BODY, stream=True)
        events = [event async for event in stream]
    assert [event.type for event in events] == RESPONSES_EVENTS
    assert [event.sequence_number for event in events] == list(range(len(RESPONSES_EVENTS)))
    assert "".join(event.delta for event in events if event.type == "response.output_text.delta") == "tok0 tok1 tok2 "
    completed = events[-1]
    assert completed.type == "response.completed" and completed.response.status == "completed"
    assert completed.response.output_text == "tok0 tok1 tok2 "
    assert completed.response.usage is not None and completed.response.usage.output_tokens == 3


async def test_openai_responses_stream_helper(up: Upstream) -> None:
    async with openai_client(up) as client, client.responses.stream(**RESPONSES_BODY) as stream:
        text = "".join([event.delta async for event in stream if event.type == "response.output_text.delta"])
        final = await stream.get_final_response()
    assert text == final.output_text == "tok0 tok1 tok2 "
    assert final.status == "completed"


async def test_responses_event_sequence(up: Upstream) -> None:
    async with up.post(RESPONSES, RESPONSES_BODY | {"stream": True}) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = await sse_events(resp)
    assert [name for name, _ in events] == RESPONSES_EVENTS
    datas = [json.loads(data) for _, data in events]
    assert all(data["type"] == name for (name, _), data in zip(events, datas, strict=True))
    assert [data["sequence_number"] for data in datas] == list(range(len(events)))
    item_ids = {data["item_id"] for data in datas if "item_id" in data}
    assert item_ids == {datas[2]["item"]["id"]}
    assert {data["response"]["id"] for data in datas if "response" in data} == {datas[0]["response"]["id"]}


async def test_models_parse_with_both_sdks(up: Upstream) -> None:
    async with openai_client(up) as oai, anthropic_client(up) as ant:
        assert [m.id async for m in oai.models.list()] == ["fake-model"]
        assert [m.id async for m in ant.models.list()] == ["fake-model"]
    assert up.fake.requests == 0


async def test_chunks_are_flushed_one_by_one(up: Upstream) -> None:
    times = []
    async with up.post(CHAT, CHAT_BODY | {"stream": True}, x_fake_chunks="4", x_fake_delay_ms="80") as resp:
        async for line in resp.content:
            if line.startswith(b"data: {"):
                times.append(time.monotonic())
    assert len(times) == 5
    assert times[3] - times[0] > 0.2


# --- the cap ---------------------------------------------------------------------------------


async def hold_slots(up: Upstream, count: int, **headers: str) -> list[asyncio.Task[Any]]:
    """Start ``count`` requests that stall inside their slot; returns once all are admitted."""

    async def one() -> None:
        async with up.post(CHAT, CHAT_BODY, x_fake_stall_ms="300", **headers) as resp:
            await resp.read()

    tasks = [asyncio.create_task(one()) for _ in range(count)]
    await up.wait_sessions(count)
    return tasks


@options(cap=2, retry_after=2.5, delay_ms=5)
async def test_over_the_cap_answers_429(up: Upstream) -> None:
    tasks = await hold_slots(up, 2)
    async with up.post(CHAT, CHAT_BODY) as resp:
        assert resp.status == 429
        assert resp.headers["retry-after"] == "3"
        assert resp.headers["retry-after-ms"] == "2500"
        assert await resp.json() == {
            "error": {"message": "Concurrency limit exceeded", "type": "rate_limit_error",
                      "code": "rate_limit_exceeded"},
        }
    async with up.post(MESSAGES, MESSAGES_BODY) as resp:
        assert resp.status == 429
        body = await resp.json()
        assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
    await asyncio.gather(*tasks)
    stats = up.fake.stats()
    assert (stats["max_concurrency"], stats["rate_limited"], stats["requests"], stats["completed"]) == (2, 2, 4, 2)


@options(cap=1, delay_ms=5)
async def test_over_the_cap_sdks_see_rate_limit_errors(up: Upstream) -> None:
    tasks = await hold_slots(up, 1)
    async with openai_client(up) as oai, anthropic_client(up) as ant:
        with pytest.raises(openai.RateLimitError):
            await oai.chat.completions.create(**CHAT_BODY)
        with pytest.raises(anthropic.RateLimitError):
            await ant.messages.create(**MESSAGES_BODY)
    await asyncio.gather(*tasks)


@options(cap=1, retry_after=2.5, delay_ms=5)
async def test_responses_over_the_cap_answers_429(up: Upstream) -> None:
    tasks = await hold_slots(up, 1)
    async with up.post(RESPONSES, RESPONSES_BODY | {"stream": True}) as resp:
        assert resp.status == 429
        assert (resp.headers["retry-after"], resp.headers["retry-after-ms"]) == ("3", "2500")
        assert await resp.json() == {
            "error": {"message": "Concurrency limit exceeded", "type": "rate_limit_error",
                      "code": "rate_limit_exceeded"},
        }
    async with openai_client(up) as client:
        with pytest.raises(openai.RateLimitError):
            await client.responses.create(**RESPONSES_BODY, stream=True)
    await asyncio.gather(*tasks)
    assert (up.fake.rate_limited, up.fake.max_concurrency, up.fake.requests) == (2, 1, 3)


@options(cap=1, delay_ms=5)
async def test_slot_frees_after_the_answer(up: Upstream) -> None:
    for _ in range(3):
        async with up.post(CHAT, CHAT_BODY | {"stream": True}) as resp:
            assert resp.status == 200
            await resp.read()
        await up.wait_sessions(0)
    assert up.fake.rate_limited == 0 and up.fake.max_concurrency == 1


@options(cap=1, lag_ms=150, delay_ms=5)
async def test_lag_keeps_the_slot_counted(up: Upstream) -> None:
    async with up.post(CHAT, CHAT_BODY) as resp:
        await resp.read()
    assert await up.sessions() == 1
    async with up.post(CHAT, CHAT_BODY) as resp:
        assert resp.status == 429
    took = await up.wait_sessions(0)
    assert 0.08 < took < 1.0
    async with up.post(CHAT, CHAT_BODY) as resp:
        assert resp.status == 200


@options(cap=1, chunks=100, delay_ms=20)
@pytest.mark.parametrize("path,body", STREAMED)
async def test_client_disconnect_mid_stream_frees_the_slot(up: Upstream, path: str, body: dict[str, Any]) -> None:
    resp = await up.post(path, body | {"stream": True})
    await resp.content.readline()
    assert await up.sessions() == 1
    resp.close()
    assert await up.wait_sessions(0, within=0.5) < 0.5
    assert up.fake.completed == 0


@options(cap=1, delay_ms=5)
async def test_client_disconnect_while_stalled_frees_the_slot(up: Upstream) -> None:
    task = asyncio.create_task(up.post(CHAT, CHAT_BODY, x_fake_stall_ms="5000").__aenter__())
    await up.wait_sessions(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await up.wait_sessions(0, within=0.5)


# --- knobs -----------------------------------------------------------------------------------


async def test_tags_and_headers_are_recorded(up: Upstream) -> None:
    for request in (up.post(CHAT, CHAT_BODY, x_fake_tag="a"), up.post(CHAT, CHAT_BODY | {"user": "u"}),
                    up.post(MESSAGES, MESSAGES_BODY, X_Custom="Yes")):
        async with request as resp:
            await resp.read()
    assert [a["tag"] for a in up.fake.arrivals] == ["a", "u", ""]
    assert all(abs(a["at"] - time.time() * 1000) < 5000 for a in up.fake.arrivals)
    assert up.fake.last_headers["x-custom"] == "Yes"


async def test_arrivals_keep_the_most_recent(up: Upstream, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission, "ARRIVALS_KEPT", 2)
    for tag in "abc":
        async with up.post(CHAT, CHAT_BODY, x_fake_tag=tag) as resp:
            await resp.read()
    assert [a["tag"] for a in up.fake.arrivals] == ["b", "c"]


async def test_stats_route_and_reset(up: Upstream) -> None:
    async with up.post(CHAT, CHAT_BODY, x_fake_tag="t") as resp:
        await resp.read()
    async with up.session.get(up.url + "/stats") as resp:
        stats = await resp.json()
    assert stats["requests"] == 1 and stats["completed"] == 1 and stats["max_concurrency"] == 1
    assert stats["arrivals"][0]["tag"] == "t" and stats["cap"] is None
    async with up.session.post(up.url + "/stats/reset") as resp:
        after = await resp.json()
    assert (after["requests"], after["completed"], after["max_concurrency"], after["arrivals"]) == (0, 0, 0, [])
    assert after["last_headers"] == {}


async def test_injected_status(up: Upstream) -> None:
    async with up.post(CHAT, CHAT_BODY | {"stream": True}, x_fake_status="503") as resp:
        assert resp.status == 503
        assert (await resp.json())["error"]["type"] == "server_error"
    async with up.post(CHAT, CHAT_BODY, x_fake_status="429", x_fake_error_code="insufficient_quota") as resp:
        assert resp.status == 429 and resp.headers["retry-after"] == "1"
        assert resp.headers["retry-after-ms"] == "1000"
        assert (await resp.json())["error"]["code"] == "insufficient_quota"
    async with up.post(CHAT, CHAT_BODY, x_fake_status="429", x_fake_no_retry_after="1") as resp:
        assert resp.status == 429
        assert "retry-after" not in resp.headers and "retry-after-ms" not in resp.headers
    async with up.post(MESSAGES, MESSAGES_BODY, x_fake_status="529") as resp:
        assert resp.status == 529
        assert await resp.json() == {
            "type": "error", "error": {"type": "overloaded_error", "message": "Injected status 529"},
        }
    assert (up.fake.requests, up.fake.rate_limited, up.fake.max_concurrency) == (4, 2, 1)


async def test_stall_delays_the_headers_inside_the_slot(up: Upstream) -> None:
    start = time.monotonic()
    async with up.post(CHAT, CHAT_BODY, x_fake_stall_ms="150") as resp:
        assert time.monotonic() - start >= 0.14
        assert resp.status == 200
        await resp.read()


async def test_stall_counts_as_active(up: Upstream) -> None:
    tasks = await hold_slots(up, 1)
    assert up.fake.active == 1
    await asyncio.gather(*tasks)


@pytest.mark.parametrize("path,body", STREAMED)
async def test_reset_after_cuts_the_stream(up: Upstream, path: str, body: dict[str, Any]) -> None:
    deltas = 0
    async with up.post(path, body | {"stream": True}, x_fake_reset_after="2", x_fake_chunks="5") as resp:
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientError):
            async for line in resp.content:
                deltas += b'"tok' in line
    assert deltas == 2
    await up.wait_sessions(0)
    assert up.fake.completed == 0


async def test_reset_after_without_stream_drops_the_connection(up: Upstream) -> None:
    with pytest.raises(aiohttp.ClientError):
        async with up.post(CHAT, CHAT_BODY, x_fake_reset_after="0") as resp:
            await resp.read()
    await up.wait_sessions(0)


async def test_gzip_answer(up: Upstream) -> None:
    async with up.post(CHAT, CHAT_BODY, x_fake_gzip="1") as resp:
        raw = await resp.read()
        assert resp.headers["Content-Encoding"] == "gzip"
        assert int(resp.headers["Content-Length"]) == len(raw)
    assert json.loads(gzip.decompress(raw))["object"] == "chat.completion"
    async with openai_client(up) as client:
        completion = await client.chat.completions.create(**CHAT_BODY, extra_headers={"x-fake-gzip": "1"})
    assert completion.choices[0].message.content == "tok0 tok1 tok2 "


async def test_stream_error_openai(up: Upstream) -> None:
    async with up.post(CHAT, CHAT_BODY | {"stream": True}, x_fake_stream_error="rate_limit_exceeded") as resp:
        events = await sse_events(resp)
    assert len(events) == 2
    assert json.loads(events[1][1])["error"]["code"] == "rate_limit_exceeded"
    async with openai_client(up) as client:
        stream = await client.chat.completions.create(
            **CHAT_BODY, stream=True, extra_headers={"x-fake-stream-error": "rate_limit_exceeded"}
        )
        with pytest.raises(openai.APIError):
            async for _ in stream:
                pass


async def test_stream_error_anthropic(up: Upstream) -> None:
    async with up.post(MESSAGES, MESSAGES_BODY | {"stream": True}, x_fake_stream_error="overloaded_error") as resp:
        events = await sse_events(resp)
    assert [name for name, _ in events] == ["message_start", "content_block_start", "content_block_delta", "error"]
    assert json.loads(events[-1][1]) == {
        "type": "error", "error": {"type": "overloaded_error", "message": "In-stream error: overloaded_error"},
    }
    async with anthropic_client(up) as client:
        with pytest.raises(anthropic.APIError):
            async with client.messages.stream(
                **MESSAGES_BODY, extra_headers={"x-fake-stream-error": "overloaded_error"}
            ) as stream:
                async for _ in stream:
                    pass


async def test_injected_status_responses(up: Upstream) -> None:
    async with up.post(RESPONSES, RESPONSES_BODY | {"stream": True}, x_fake_status="503") as resp:
        assert resp.status == 503
        assert await resp.json() == {
            "error": {"message": "Injected status 503", "type": "server_error", "code": "server_error"},
        }
    async with openai_client(up) as client:
        with pytest.raises(openai.RateLimitError) as raised:
            await client.responses.create(**RESPONSES_BODY, extra_headers={"x-fake-status": "429"})
    assert raised.value.response.headers["retry-after"] == "1"
    assert raised.value.code == "rate_limit_exceeded"


async def test_stream_error_responses_failed(up: Upstream) -> None:
    body = RESPONSES_BODY | {"stream": True}
    async with up.post(RESPONSES, body, x_fake_stream_error="rate_limit_exceeded") as resp:
        events = await sse_events(resp)
    assert [name for name, _ in events] == [*RESPONSES_EVENTS[:5], "response.failed"]
    failed = json.loads(events[-1][1])
    assert (failed["type"], failed["sequence_number"]) == ("response.failed", 5)
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "rate_limit_exceeded", "message": TPM_MESSAGE}
    assert up.fake.completed == 1


async def test_stream_error_responses_error_event(up: Upstream) -> None:
    async with up.post(RESPONSES, RESPONSES_BODY | {"stream": True}, x_fake_stream_error="rate_limit_exceeded",
                       x_fake_stream_error_form="event") as resp:
        events = await sse_events(resp)
    assert [name for name, _ in events] == [*RESPONSES_EVENTS[:5], "error"]
    assert json.loads(events[-1][1]) == {
        "type": "error", "sequence_number": 5, "code": "rate_limit_exceeded", "message": TPM_MESSAGE, "param": None,
    }


async def test_stream_error_responses_other_code_through_the_sdk(up: Upstream) -> None:
    async with openai_client(up) as client:
        stream = await client.responses.create(
            **RESPONSES_BODY, stream=True, extra_headers={"x-fake-stream-error": "server_error"}
        )
        events = [event async for event in stream]
    failed = events[-1]
    assert failed.type == "response.failed" and failed.response.error is not None
    assert failed.response.error.code == "server_error"
    assert failed.response.error.message == "In-stream error: server_error"


@pytest.mark.usefixtures("fixed_replies")
@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("path,body", STREAMED)
async def test_encoded_stream_decodes_to_the_plain_stream(
    up: Upstream, path: str, body: dict[str, Any], encoding: str
) -> None:
    async with up.post(path, body | {"stream": True}) as resp:
        assert "Content-Encoding" not in resp.headers
        plain = await resp.read()
    async with up.post(path, body | {"stream": True}, x_fake_encoding=encoding) as resp:
        assert resp.headers["Content-Encoding"] == encoding
        assert "Content-Length" not in resp.headers
        encoded = await resp.read()
    assert encoded != plain
    assert decode_whole(encoding, encoded) == plain


@pytest.mark.usefixtures("fixed_replies")
@pytest.mark.parametrize("encoding", ENCODINGS)
async def test_encoded_stream_error_decodes_to_the_plain_stream(up: Upstream, encoding: str) -> None:
    knobs = {"x_fake_stream_error": "rate_limit_exceeded"}
    async with up.post(RESPONSES, RESPONSES_BODY | {"stream": True}, **knobs) as resp:
        plain = await resp.read()
    async with up.post(RESPONSES, RESPONSES_BODY | {"stream": True}, **knobs, x_fake_encoding=encoding) as resp:
        encoded = await resp.read()
    assert decode_whole(encoding, encoded) == plain
    assert plain.endswith(b"\n\n") and b"event: response.failed" in plain


@pytest.mark.parametrize("encoding", ENCODINGS)
async def test_encoded_stream_is_flushed_event_by_event(up: Upstream, encoding: str) -> None:
    decode, seen, first_delta_at = piecewise_decoder(encoding), b"", None
    async with up.post(RESPONSES, RESPONSES_BODY | {"stream": True}, x_fake_encoding=encoding,
                       x_fake_chunks="2", x_fake_delay_ms="100") as resp:
        async for piece in resp.content.iter_any():
            seen += decode(piece)
            if first_delta_at is None and b"response.output_text.delta" in seen:
                first_delta_at = time.monotonic()
    assert first_delta_at is not None
    assert time.monotonic() - first_delta_at > 0.05
    assert seen.endswith(b"\n\n") and b"event: response.completed" in seen


@pytest.mark.parametrize("encoding", ENCODINGS)
async def test_sdks_read_encoded_streams(up: Upstream, encoding: str) -> None:
    headers = {"x-fake-encoding": encoding}
    async with openai_client(up) as oai, anthropic_client(up) as ant:
        async with oai.responses.stream(**RESPONSES_BODY, extra_headers=headers) as stream:
            assert (await stream.get_final_response()).output_text == "tok0 tok1 tok2 "
        async with ant.messages.stream(**MESSAGES_BODY, extra_headers=headers) as stream:
            assert (await stream.get_final_message()).content[0].text == "tok0 tok1 tok2 "  # type: ignore[union-attr]


async def test_encoding_leaves_non_streaming_answers_alone(up: Upstream) -> None:
    async with up.post(RESPONSES, RESPONSES_BODY, x_fake_encoding="br") as resp:
        assert "Content-Encoding" not in resp.headers
        assert (await resp.json())["output"][0]["content"][0]["text"] == "tok0 tok1 tok2 "


async def test_per_request_chunks_and_delay(up: Upstream) -> None:
    start = time.monotonic()
    async with up.post(CHAT, CHAT_BODY | {"stream": True}, x_fake_chunks="2", x_fake_delay_ms="100") as resp:
        events = await sse_events(resp)
    assert time.monotonic() - start >= 0.19
    assert len(events) == 4
    start = time.monotonic()
    async with up.post(CHAT, CHAT_BODY, x_fake_delay_ms="120") as resp:
        assert (await resp.json())["choices"][0]["message"]["content"] == "tok0 tok1 tok2 "
    assert time.monotonic() - start >= 0.11


@pytest.mark.parametrize("header,value", [("x_fake_chunks", "0"), ("x_fake_delay_ms", "soon"),
                                          ("x_fake_status", "abc"), ("x_fake_encoding", "lzma"),
                                          ("x_fake_stream_error_form", "sometimes"),
                                          ("x_fake_ratelimit_headers", "{not json"),
                                          ("x_fake_ratelimit_headers", '["x-a", "1"]'),
                                          ("x_fake_ratelimit_headers", '{"x-a": 1}'),
                                          ("x_fake_ratelimit_headers", '{"x a": "1"}'),
                                          ("x_fake_ratelimit_headers", '{"x-a": "1\\r\\nx-b: 2"}'),
                                          ("x_fake_usage", "{not json"),
                                          ("x_fake_usage", "[1, 2]"),
                                          ("x_fake_usage", '{"prompt_tokens": 1}'),
                                          ("x_fake_usage", '{"input": -1}'),
                                          ("x_fake_usage", '{"input": 1.5}'),
                                          ("x_fake_usage", '{"output": true}'),
                                          ("x_fake_usage", '{"input": "9"}'),
                                          ("x_fake_usage", '{"input": 10, "cached": 8, "cache_write": 3}'),
                                          ("x_fake_usage", '{"cached": 100000}'),
                                          ("x_fake_usage", '{"output": 2, "reasoning": 3}'),
                                          ("x_fake_usage_deltas", "0")])
async def test_bad_knob_is_a_400(up: Upstream, header: str, value: str) -> None:
    async with up.post(CHAT, CHAT_BODY, **{header: value}) as resp:
        assert resp.status == 400
        assert header.replace("_", "-") in (await resp.json())["error"]["message"]
    assert up.fake.active == 0


# --- the usage knob: x-fake-usage, x-fake-usage-deltas -----------------------------------------

COMPLETIONS = "/v1/completions"
COMPLETIONS_BODY = {"model": "m", "prompt": "hi"}
INCLUDE_USAGE = {"stream": True, "stream_options": {"include_usage": True}}
USAGE = {"input": 900, "cached": 512, "cache_write": 64, "output": 40, "reasoning": 16}
USAGE_KNOB = {"x_fake_usage": json.dumps(USAGE)}
OPENAI_USAGE = {
    "prompt_tokens": 900, "completion_tokens": 40, "total_tokens": 940,
    "prompt_tokens_details": {"cached_tokens": 512}, "completion_tokens_details": {"reasoning_tokens": 16},
}
RESPONSES_USAGE = {
    "input_tokens": 900, "input_tokens_details": {"cached_tokens": 512},
    "output_tokens": 40, "output_tokens_details": {"reasoning_tokens": 16}, "total_tokens": 940,
}
ANTHROPIC_USAGE = {
    "input_tokens": 900 - 512 - 64, "cache_creation_input_tokens": 64, "cache_read_input_tokens": 512,
    "output_tokens": 40,
}
NATIVE_USAGE = [(CHAT, CHAT_BODY, OPENAI_USAGE), (COMPLETIONS, COMPLETIONS_BODY, OPENAI_USAGE),
                (RESPONSES, RESPONSES_BODY, RESPONSES_USAGE), (MESSAGES, MESSAGES_BODY, ANTHROPIC_USAGE)]


def sse_parsed(text: bytes) -> list[tuple[str | None, Any]]:
    """(event name, parsed data) pairs of a whole SSE body; ``[DONE]`` stays a string."""
    events: list[tuple[str | None, Any]] = []
    for block in text.decode().split("\n\n"):
        lines = block.splitlines()
        name = next((line[len("event: "):] for line in lines if line.startswith("event: ")), None)
        for line in lines:
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append((name, data if data == "[DONE]" else json.loads(data)))
    return events


async def stream_of(up: Upstream, path: str, body: dict[str, Any], **headers: str) -> list[tuple[str | None, Any]]:
    async with up.post(path, body, **headers) as resp:
        assert resp.status == 200
        return sse_parsed(await resp.read())


def body_tokens(body: dict[str, Any]) -> int:
    """The input the fake reports by default: the body's size (as aiohttp sends it) // 4, at least 1."""
    return max(1, len(json.dumps(body).encode()) // 4)


@pytest.mark.parametrize("path,body,native", NATIVE_USAGE)
async def test_usage_knob_sets_each_json_answers_native_usage(
    up: Upstream, path: str, body: dict[str, Any], native: dict[str, int]
) -> None:
    async with up.post(path, body, **USAGE_KNOB) as resp:
        assert resp.status == 200
        assert (await resp.json())["usage"] == native


@pytest.mark.parametrize("path,body,native", NATIVE_USAGE)
async def test_usage_knob_in_a_gzipped_json_answer(
    up: Upstream, path: str, body: dict[str, Any], native: dict[str, int]
) -> None:
    async with up.post(path, body, x_fake_gzip="1", **USAGE_KNOB) as resp:
        assert resp.headers["Content-Encoding"] == "gzip"
        raw = await resp.read()
    assert json.loads(gzip.decompress(raw))["usage"] == native


async def test_usage_knob_reaches_the_sdks(up: Upstream) -> None:
    headers = {"x-fake-usage": json.dumps(USAGE)}
    async with openai_client(up) as oai, anthropic_client(up) as ant:
        completion = await oai.chat.completions.create(**CHAT_BODY, extra_headers=headers)
        response = await oai.responses.create(**RESPONSES_BODY, extra_headers=headers)
        async with ant.messages.stream(**MESSAGES_BODY, extra_headers=headers | {"x-fake-usage-deltas": "3"}) as stream:
            message = await stream.get_final_message()
    assert completion.usage is not None and completion.usage.prompt_tokens_details is not None
    assert completion.usage.completion_tokens_details is not None
    assert (completion.usage.prompt_tokens, completion.usage.prompt_tokens_details.cached_tokens,
            completion.usage.completion_tokens, completion.usage.completion_tokens_details.reasoning_tokens) == \
        (900, 512, 40, 16)
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.input_tokens_details.cached_tokens,
            response.usage.output_tokens, response.usage.output_tokens_details.reasoning_tokens) == (900, 512, 40, 16)
    assert (message.usage.input_tokens, message.usage.cache_creation_input_tokens,
            message.usage.cache_read_input_tokens, message.usage.output_tokens) == (324, 64, 512, 40)
    assert message.stop_reason == "end_turn"


@pytest.mark.parametrize("path,body", [(CHAT, CHAT_BODY), (COMPLETIONS, COMPLETIONS_BODY)])
async def test_usage_knob_in_an_openai_stream_with_include_usage(
    up: Upstream, path: str, body: dict[str, Any]
) -> None:
    events = await stream_of(up, path, body | INCLUDE_USAGE, **USAGE_KNOB)
    *chunks, final, done = [data for _, data in events]
    assert done == "[DONE]"
    assert len(chunks) == 4 and all(chunk["usage"] is None for chunk in chunks)
    assert final["choices"] == [] and final["usage"] == OPENAI_USAGE
    assert final["id"] == chunks[0]["id"]


@pytest.mark.parametrize("path,body", [(CHAT, CHAT_BODY), (COMPLETIONS, COMPLETIONS_BODY)])
async def test_an_openai_stream_without_include_usage_states_no_usage(
    up: Upstream, path: str, body: dict[str, Any]
) -> None:
    async with up.post(path, body | {"stream": True, "stream_options": {"include_usage": False}},
                       **USAGE_KNOB) as resp:
        raw = await resp.read()
    events = [data for _, data in sse_parsed(raw)]
    assert events[-1] == "[DONE]" and len(events) == 5
    assert all("usage" not in chunk and chunk["choices"] for chunk in events[:-1])
    assert b"tokens" not in raw


async def test_usage_knob_in_a_responses_stream(up: Upstream) -> None:
    events = await stream_of(up, RESPONSES, RESPONSES_BODY | {"stream": True}, **USAGE_KNOB)
    assert [name for name, _ in events] == RESPONSES_EVENTS
    usages = {data["type"]: data["response"]["usage"] for _, data in events if "response" in data}
    assert usages == {"response.created": None, "response.in_progress": None,
                      "response.completed": RESPONSES_USAGE}


async def test_usage_knob_in_an_anthropic_stream_with_three_deltas(up: Upstream) -> None:
    events = await stream_of(up, MESSAGES, MESSAGES_BODY | {"stream": True}, x_fake_usage_deltas="3", **USAGE_KNOB)
    assert [name for name, _ in events] == [
        "message_start", "content_block_start", *["content_block_delta"] * 3,
        "content_block_stop", *["message_delta"] * 3, "message_stop",
    ]
    assert events[0][1]["message"]["usage"] == ANTHROPIC_USAGE | {"output_tokens": 1}
    deltas = [data for name, data in events if name == "message_delta"]
    assert [delta["usage"] for delta in deltas] == [{"output_tokens": 13}, {"output_tokens": 27}, {"output_tokens": 40}]
    assert [delta["delta"] for delta in deltas] == [{"stop_reason": None, "stop_sequence": None}] * 2 + [
        {"stop_reason": "end_turn", "stop_sequence": None}]


async def test_usage_deltas_grow_to_the_output_and_default_to_one(up: Upstream) -> None:
    body = MESSAGES_BODY | {"stream": True}
    for deltas, expected in [("1", [7]), ("2", [4, 7]), ("4", [2, 4, 5, 7]), ("9", [1, 2, 2, 3, 4, 5, 5, 6, 7])]:
        events = await stream_of(up, MESSAGES, body, x_fake_usage='{"output": 7}', x_fake_usage_deltas=deltas)
        assert [data["usage"]["output_tokens"] for name, data in events if name == "message_delta"] == expected
    events = await stream_of(up, MESSAGES, body, x_fake_usage='{"output": 0}')
    assert [data["usage"] for name, data in events if name == "message_delta"] == [{"output_tokens": 0}]


@pytest.mark.parametrize("path,body,native", NATIVE_USAGE)
async def test_usage_knob_in_a_gzip_encoded_stream(
    up: Upstream, path: str, body: dict[str, Any], native: dict[str, int]
) -> None:
    async with up.post(path, body | INCLUDE_USAGE, x_fake_encoding="gzip", x_fake_usage_deltas="2",
                       **USAGE_KNOB) as resp:
        assert resp.headers["Content-Encoding"] == "gzip"
        events = [data for _, data in sse_parsed(gzip.decompress(await resp.read()))]
    if path == MESSAGES:
        assert events[0]["message"]["usage"] == native | {"output_tokens": 1}
        deltas = [e["usage"] for e in events if e["type"] == "message_delta"]
        assert deltas == [{"output_tokens": 20}, {"output_tokens": 40}]
    elif path == RESPONSES:
        assert events[-1]["type"] == "response.completed" and events[-1]["response"]["usage"] == native
    else:
        assert events[-2]["usage"] == native and all(e["usage"] is None for e in events[:-2])


async def test_without_the_knob_usage_is_the_body_size_and_the_chunks(up: Upstream) -> None:
    async with up.post(CHAT, CHAT_BODY) as resp:
        chat = (await resp.json())["usage"]
    tokens = body_tokens(CHAT_BODY)
    assert chat == {"prompt_tokens": tokens, "completion_tokens": 3, "total_tokens": tokens + 3,
                    "prompt_tokens_details": {"cached_tokens": 0}, "completion_tokens_details": {"reasoning_tokens": 0}}
    async with up.post(MESSAGES, MESSAGES_BODY) as resp:
        messages = (await resp.json())["usage"]
    assert messages == {"input_tokens": body_tokens(MESSAGES_BODY), "cache_creation_input_tokens": 0,
                        "cache_read_input_tokens": 0, "output_tokens": 3}
    events = await stream_of(up, RESPONSES, RESPONSES_BODY | {"stream": True})
    tokens = body_tokens(RESPONSES_BODY | {"stream": True})
    assert events[-1][1]["response"]["usage"] == {
        "input_tokens": tokens, "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": tokens + 3,
    }


async def test_usage_knob_figures_left_out_keep_their_defaults(up: Upstream) -> None:
    async with up.post(CHAT, CHAT_BODY, x_fake_usage='{"cached": 2, "reasoning": 1}', x_fake_chunks="4") as resp:
        chat = (await resp.json())["usage"]
    tokens = body_tokens(CHAT_BODY)
    assert chat == {"prompt_tokens": tokens, "completion_tokens": 4, "total_tokens": tokens + 4,
                    "prompt_tokens_details": {"cached_tokens": 2}, "completion_tokens_details": {"reasoning_tokens": 1}}
    async with up.post(MESSAGES, MESSAGES_BODY, x_fake_usage='{"cache_write": 3, "output": 0}') as resp:
        messages = (await resp.json())
    assert messages["usage"] == {"input_tokens": body_tokens(MESSAGES_BODY) - 3, "cache_creation_input_tokens": 3,
                                 "cache_read_input_tokens": 0, "output_tokens": 0}
    assert messages["content"][0]["text"] == "tok0 tok1 tok2 "
    async with up.post(RESPONSES, RESPONSES_BODY, x_fake_usage="{}") as resp:
        assert (await resp.json())["usage"]["input_tokens"] == body_tokens(RESPONSES_BODY)


async def test_a_bad_usage_knob_gets_the_routes_error_shape(up: Upstream) -> None:
    async with up.post(MESSAGES, MESSAGES_BODY, x_fake_usage='{"input": 5, "cached": 6}') as resp:
        assert resp.status == 400
        assert await resp.json() == {"type": "error", "error": {
            "type": "invalid_request_error",
            "message": "x-fake-usage: cached + cache_write (6 + 0) must not exceed input "
                       "(5; by default the body's size // 4)",
        }}
    async with up.post(RESPONSES, RESPONSES_BODY, x_fake_usage='{"tokens": 5}') as resp:
        assert resp.status == 400
        assert (await resp.json())["error"] == {
            "type": "invalid_request_error", "code": "invalid_request_error",
            "message": "x-fake-usage has no figure 'tokens'; the figures are input, cached, cache_write, output, "
                       "reasoning",
        }
    assert (up.fake.requests, up.fake.completed, up.fake.max_concurrency) == (2, 0, 0)


# --- keys, per-key caps, the request window, rate-limit headers -------------------------------


def openai_seconds(duration: str) -> float:
    """An ``x-ratelimit-reset-*`` duration (``1.5s``, ``6m0s``, ``1h2m3s``) in seconds."""
    match = OPENAI_DURATION.fullmatch(duration)
    assert match is not None, duration
    hours, minutes, seconds = match.groups()
    return int(hours or 0) * 3600 + int(minutes or 0) * 60 + float(seconds)


def rfc3339_epoch(stamp: str) -> float:
    assert stamp.endswith("Z"), stamp
    when = datetime.fromisoformat(stamp)
    assert when.tzinfo == UTC
    return when.timestamp()


async def answer(up: Upstream, path: str, body: dict[str, Any], **headers: str) -> aiohttp.ClientResponse:
    """Post and read the whole answer (streamed or not); the response keeps its status and headers."""
    async with up.post(path, body, **headers) as resp:
        await resp.read()
    return resp


async def test_the_key_is_the_bearer_token_else_x_api_key(up: Upstream) -> None:
    for headers in ({"Authorization": "Bearer sk-a"}, {"Authorization": "bearer sk-a", "x_api_key": "ignored"},
                    {"x_api_key": "sk-b"}, {}, {"Authorization": "Basic dXNlcg=="}):
        resp = await answer(up, CHAT, CHAT_BODY, **headers)
        assert resp.status == 200
        assert not [name for name in resp.headers if name.lower().startswith("x-ratelimit-")]
    await up.wait_sessions(0)
    one = {"requests": 1, "in_flight": 0, "max_concurrent": 1, "rejected": 0}
    assert up.fake.stats()["keys"] == {
        "sk-a": one | {"requests": 2}, "sk-b": one, "": one, "Basic dXNlcg==": one,
    }


@options(key_limit=2, chunks=3, delay_ms=5)
async def test_key_limit_caps_each_key_and_429s_the_extras(up: Upstream) -> None:
    auth = [{"Authorization": "Bearer sk-a"}, {"x_api_key": "sk-b"}] * 3
    slow = {"x_fake_chunks": "4", "x_fake_delay_ms": "100"}
    answers = await asyncio.gather(*(answer(up, CHAT, CHAT_BODY | {"stream": True}, **slow, **headers)
                                     for headers in auth))
    assert sorted(resp.status for resp in answers) == [200] * 4 + [429] * 2
    for resp in answers:
        if resp.status == 429:
            assert (resp.headers["retry-after"], resp.headers["retry-after-ms"]) == ("1", "1000")
    await up.wait_sessions(0)
    stats = up.fake.stats()
    each = {"requests": 3, "in_flight": 0, "max_concurrent": 2, "rejected": 1}
    assert stats["keys"] == {"sk-a": each, "sk-b": each}
    assert (stats["max_concurrency"], stats["rate_limited"], stats["completed"]) == (4, 2, 4)
    assert stats["window_rejected"] == 0


@options(cap=1, key_limit=2, delay_ms=5)
async def test_key_limit_leaves_the_global_cap_in_force(up: Upstream) -> None:
    tasks = await hold_slots(up, 1)
    async with up.post(CHAT, CHAT_BODY, x_api_key="sk-b") as resp:
        assert resp.status == 429
        assert (await resp.json())["error"]["message"] == "Concurrency limit exceeded"
    await asyncio.gather(*tasks)
    assert up.fake.keys["sk-b"].rejected == 1 and up.fake.keys[""].rejected == 0


@options(key_limit=1, delay_ms=5)
async def test_key_limit_429_has_the_cap_error_shape(up: Upstream) -> None:
    tasks = await hold_slots(up, 1, Authorization="Bearer x")
    async with up.post(MESSAGES, MESSAGES_BODY, x_api_key="x") as resp:
        assert resp.status == 429 and resp.headers["retry-after"] == "1"
        body = await resp.json()
        assert body == {"type": "error", "error": {"type": "rate_limit_error",
                                                   "message": "Concurrency limit exceeded for this key"}}
    async with openai_client(up) as oai, anthropic_client(up) as ant:  # both send their api_key as a Bearer token
        with pytest.raises(openai.RateLimitError):
            await oai.chat.completions.create(**CHAT_BODY)
        with pytest.raises(anthropic.RateLimitError):
            await ant.messages.create(**MESSAGES_BODY)
    assert (await answer(up, CHAT, CHAT_BODY, x_api_key="other")).status == 200
    await asyncio.gather(*tasks)
    assert (up.fake.keys["x"].rejected, up.fake.keys["other"].rejected, up.fake.rate_limited) == (3, 0, 3)


@options(window_requests=2, window_seconds=1, chunks=2, delay_ms=1)
async def test_window_admits_its_requests_then_429s_until_it_resets(up: Upstream) -> None:
    first = await answer(up, CHAT, CHAT_BODY)
    second = await answer(up, CHAT, CHAT_BODY | {"stream": True})
    third = await answer(up, CHAT, CHAT_BODY)
    assert [r.status for r in (first, second, third)] == [200, 200, 429]
    assert [r.headers["x-ratelimit-remaining-requests"] for r in (first, second, third)] == ["1", "0", "0"]
    assert [r.headers["x-ratelimit-remaining-tokens"] for r in (first, second, third)] == \
        ["999900", "999800", "999800"]
    for resp in (first, second, third):
        assert (resp.headers["x-ratelimit-limit-requests"], resp.headers["x-ratelimit-limit-tokens"]) == \
            ("2", "1000000")
        reset = openai_seconds(resp.headers["x-ratelimit-reset-requests"])
        assert 0 < reset <= 1
        assert resp.headers["x-ratelimit-reset-tokens"] == resp.headers["x-ratelimit-reset-requests"]
        assert not {*ANTHROPIC_WINDOW, *UNIFIED} & {name.lower() for name in resp.headers}
    wait_ms = int(third.headers["retry-after-ms"])
    assert third.headers["retry-after"] == "1" and 0 < wait_ms <= 1000
    assert abs(wait_ms / 1000 - openai_seconds(third.headers["x-ratelimit-reset-requests"])) < 0.05
    other = await answer(up, RESPONSES, RESPONSES_BODY, Authorization="Bearer other")
    assert (other.status, other.headers["x-ratelimit-remaining-requests"]) == (200, "1")
    stats = up.fake.stats()
    assert (stats["rate_limited"], stats["window_rejected"], stats["keys"][""]["rejected"]) == (1, 1, 1)
    await asyncio.sleep(wait_ms / 1000 + 0.02)
    again = await answer(up, CHAT, CHAT_BODY)
    assert (again.status, again.headers["x-ratelimit-remaining-requests"]) == (200, "1")
    assert openai_seconds(again.headers["x-ratelimit-reset-requests"]) > 0.9


@options(window_requests=2, window_seconds=1, chunks=2, delay_ms=1)
async def test_window_headers_on_anthropic_are_rfc3339_instants(up: Upstream) -> None:
    answers = [await answer(up, MESSAGES, MESSAGES_BODY | {"stream": stream}) for stream in (False, True, False)]
    assert [r.status for r in answers] == [200, 200, 429]
    assert [r.headers["anthropic-ratelimit-requests-remaining"] for r in answers] == ["1", "0", "0"]
    assert [r.headers["anthropic-ratelimit-tokens-remaining"] for r in answers] == ["999900", "999800", "999800"]
    now = time.time()
    for resp in answers:
        assert (resp.headers["anthropic-ratelimit-requests-limit"],
                resp.headers["anthropic-ratelimit-tokens-limit"]) == ("2", "1000000")
        reset = rfc3339_epoch(resp.headers["anthropic-ratelimit-requests-reset"])
        assert now - 0.1 < reset <= now + 1
        assert resp.headers["anthropic-ratelimit-tokens-reset"] == resp.headers["anthropic-ratelimit-requests-reset"]
        assert not {*OPENAI_WINDOW, *UNIFIED} & {name.lower() for name in resp.headers}
    assert answers[2].headers["retry-after"] == "1"
    assert up.fake.window_rejected == 1


@options(window_requests=2, window_seconds=1, unified=True)
async def test_unified_status_goes_from_allowed_to_rejected(up: Upstream) -> None:
    answers = [await answer(up, MESSAGES, MESSAGES_BODY, x_api_key="x") for _ in range(3)]
    assert [r.status for r in answers] == [200, 200, 429]
    assert [r.headers["anthropic-ratelimit-unified-status"] for r in answers] == ["allowed", "rejected", "rejected"]
    for resp in answers:
        reset = int(resp.headers["anthropic-ratelimit-unified-reset"])
        assert reset - 1 < rfc3339_epoch(resp.headers["anthropic-ratelimit-requests-reset"]) < reset + 0.001
        assert time.time() < reset <= time.time() + 2
    async with anthropic_client(up) as client:
        with pytest.raises(anthropic.RateLimitError) as raised:
            await client.messages.create(**MESSAGES_BODY)
    assert raised.value.response.headers["anthropic-ratelimit-unified-status"] == "rejected"
    chat = await answer(up, CHAT, CHAT_BODY)
    assert not set(UNIFIED) & {name.lower() for name in chat.headers}


@options(window_requests=1, window_seconds=60)
async def test_reset_clears_the_keys_and_closes_the_windows(up: Upstream) -> None:
    assert (await answer(up, CHAT, CHAT_BODY)).status == 200
    assert (await answer(up, CHAT, CHAT_BODY)).status == 429
    async with up.session.get(up.url + "/stats") as resp:
        stats = await resp.json()
    assert stats["keys"] == {"": {"requests": 2, "in_flight": 0, "max_concurrent": 1, "rejected": 1}}
    assert (stats["window_requests"], stats["window_seconds"], stats["window_rejected"]) == (1, 60, 1)
    async with up.session.post(up.url + "/stats/reset") as resp:
        after = await resp.json()
    assert (after["keys"], after["window_rejected"]) == ({}, 0)
    assert (await answer(up, CHAT, CHAT_BODY)).status == 200


@options(window_requests=10, chunks=2, delay_ms=1)
async def test_ratelimit_headers_knob_adds_headers_verbatim(up: Upstream) -> None:
    asked = {"X-Custom-Limit": "7", "x-ratelimit-remaining-requests": "0", "retry-after": "9"}
    knob = {"x_fake_ratelimit_headers": json.dumps(asked)}
    for path, body in STREAMED:
        for stream in (False, True):
            resp = await answer(up, path, body | {"stream": stream}, **knob)
            assert resp.status == 200 and resp.headers["X-Custom-Limit"] == "7"
            assert resp.headers.getall("retry-after") == ["9"]
    resp = await answer(up, CHAT, CHAT_BODY, x_fake_status="429", **knob)
    assert resp.status == 429
    assert resp.headers.getall("retry-after") == ["9"] and resp.headers["retry-after-ms"] == "1000"
    assert resp.headers.getall("x-ratelimit-remaining-requests") == ["0"]
    assert resp.headers["x-ratelimit-limit-requests"] == "10"
    resp = await answer(up, CHAT, CHAT_BODY, x_fake_ratelimit_headers="{}")
    assert resp.status == 200 and resp.headers["x-ratelimit-remaining-requests"] == "2"


@pytest.mark.parametrize("seconds,duration", [
    (0, "0s"), (0.0201, "0.021s"), (0.5, "0.5s"), (1.5, "1.5s"), (59.9996, "1m0s"), (360, "6m0s"),
    (61.25, "1m1.25s"), (3723, "1h2m3s"), (3600, "1h0m0s"),
])
def test_openai_duration_format(seconds: float, duration: str) -> None:
    assert dialects.openai_duration(seconds) == duration
    assert openai_seconds(duration) == pytest.approx(seconds, abs=0.001)


# --- construction and the command line -------------------------------------------------------


@pytest.mark.parametrize("kwargs,message", [
    ({"cap": 0}, "cap must be a positive integer or None"),
    ({"chunks": 0}, "chunks must be >= 1"),
    ({"lag_ms": -1}, "lag_ms must be >= 0"),
    ({"key_limit": 0}, "key_limit must be a positive integer or None"),
    ({"window_requests": 0}, "window_requests must be a positive integer or None"),
    ({"window_seconds": 0}, "window_seconds must be > 0"),
    ({"window_seconds": float("nan")}, "window_seconds must be > 0"),
])
def test_invalid_options(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FakeUpstream(**kwargs)


def test_add_arguments_defaults_and_values() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = parser.parse_args([])
    assert (defaults.port, defaults.cap, defaults.chunks, defaults.delay_ms, defaults.lag_ms) == (9100, None, 5, 20, 0)
    given = parser.parse_args(["--port", "0", "--cap", "3", "--chunks", "7", "--delay-ms", "2.5", "--lag-ms", "40"])
    assert (given.port, given.cap, given.chunks, given.delay_ms, given.lag_ms) == (0, 3, 7, 2.5, 40)


def test_add_arguments_limits_and_window() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = parser.parse_args([])
    assert (defaults.key_limit, defaults.window_requests, defaults.window_seconds, defaults.unified) == \
        (None, None, 60, False)
    given = parser.parse_args(["--key-limit", "2", "--window-requests", "10", "--window-seconds", "1.5", "--unified"])
    assert (given.key_limit, given.window_requests, given.window_seconds, given.unified) == (2, 10, 1.5, True)
    for flag in ("--key-limit", "--window-requests", "--window-seconds"):
        with pytest.raises(SystemExit):
            parser.parse_args([flag, "0"])


def test_add_arguments_rejects_a_zero_cap(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--cap", "0"])
    assert "must be a positive integer, got '0'" in capsys.readouterr().err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
async def test_run_prints_its_address_and_stops_on_a_signal(sig: signal.Signals) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "from proxy.tools.fake_upstream import run; run(0, 2, 3, 5, 0)",
        cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 10)).decode()  # type: ignore[union-attr]
        assert line.startswith("fake-upstream listening on http://127.0.0.1:")
        assert "(cap=2, chunks=3, delay_ms=5, lag_ms=0)" in line
        url = line.split()[3]
        async with aiohttp.ClientSession() as session, session.get(url + "/stats") as resp:
            assert (await resp.json())["cap"] == 2
        proc.send_signal(sig)
        _, err = await asyncio.wait_for(proc.communicate(), 10)
        assert proc.returncode == 0, err.decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_run_serves_the_limits_it_is_given() -> None:
    code = ("from proxy.tools.fake_upstream import run; "
            "run(0, key_limit=2, window_requests=3, window_seconds=1.5, unified=True)")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 10)).decode()  # type: ignore[union-attr]
        assert "(cap=none, chunks=5, delay_ms=20, lag_ms=0, key_limit=2, window=3/1.5s, unified)" in line
        async with aiohttp.ClientSession() as session:
            async with session.post(line.split()[3] + MESSAGES, json=MESSAGES_BODY) as resp:
                assert resp.headers["anthropic-ratelimit-requests-remaining"] == "2"
                assert resp.headers["anthropic-ratelimit-unified-status"] == "allowed"
            async with session.get(line.split()[3] + "/stats") as resp:
                stats = await resp.json()
        assert (stats["key_limit"], stats["window_requests"], stats["window_seconds"]) == (2, 3, 1.5)
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 10)
        assert proc.returncode == 0, err.decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
