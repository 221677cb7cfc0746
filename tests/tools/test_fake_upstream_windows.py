"""The fake provider's per-minute windows (``--itpm``, ``--otpm``, ``--tpm``, ``--rpm``): buckets that refuse
and refill in real time over HTTP and WebSocket, Anthropic's prompt cache, and the providers' own headers and
429 bodies, read back by the proxy's readers."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from aiohttp import WSMsgType

from proxy.cli import main
from proxy.providers.budgets import read_budget
from proxy.providers.signals import classify_response, event_backoff, stated_wait
from proxy.tools.fake_upstream import FakeUpstream, add_arguments, start_fake_upstream
from proxy.tools.fake_upstream.dialects import nearest_thousand
from proxy.tools.fake_upstream.windows import PromptCache, request_blocks

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"
QUICK = {"chunks": 2, "delay_ms": 1}
ANTHROPIC_TAIL = (
    ". For details, refer to: https://docs.claude.com/en/api/rate-limits. You can see the response headers for "
    "current usage. Please reduce the prompt length or the maximum tokens requested, or try again later. You may "
    "also contact sales at https://www.anthropic.com/contact-sales to discuss your options for a rate limit "
    "increase."
)
OPENAI_LIMIT = re.compile(
    r"Rate limit reached for (?P<model>\S+) in organization org-fake on (?P<kind>tokens|requests) per min "
    r"\((?P<short>TPM|RPM)\): Limit (?P<limit>\d+), Used (?P<used>\d+), Requested (?P<requested>\d+)\. "
    r"Please try again in (?P<wait>[\d.]+)s\. Visit https://platform\.openai\.com/account/rate-limits to learn more\."
)


@dataclass
class Upstream:
    fake: FakeUpstream
    url: str
    session: aiohttp.ClientSession

    async def post(self, path: str, body: dict[str, Any], usage: dict[str, int] | None = None,
                   **headers: str) -> tuple[aiohttp.ClientResponse, Any]:
        wire = {name.replace("_", "-"): value for name, value in headers.items()}
        if usage is not None:
            wire["x-fake-usage"] = json.dumps(usage)
        async with self.session.post(self.url + path, json=body, headers=wire) as resp:
            data = await resp.json() if not body.get("stream") else await resp.text()
        return resp, data


@pytest.fixture
def fake(request: pytest.FixtureRequest) -> FakeUpstream:
    return FakeUpstream(**(QUICK | getattr(request, "param", {})))


def options(**kwargs: Any) -> pytest.MarkDecorator:
    return pytest.mark.parametrize("fake", [kwargs], indirect=True, ids=[""])


@pytest.fixture
async def up(fake: FakeUpstream) -> AsyncIterator[Upstream]:
    runner, port = await start_fake_upstream(fake)
    async with aiohttp.ClientSession() as session:
        yield Upstream(fake, f"http://127.0.0.1:{port}", session)
    await runner.cleanup()


def messages_body(text: str = "hi", model: str = "claude-m", **fields: Any) -> dict[str, Any]:
    return {"model": model, "max_tokens": 16, "messages": [{"role": "user", "content": text}], **fields}


def chat_body(text: str = "hi", model: str = "gpt-m", **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], **fields}


def wait_ms(resp: aiohttp.ClientResponse) -> int:
    millis = int(resp.headers["retry-after-ms"])
    assert resp.headers["retry-after"] == str(max(1, math.ceil(millis / 1000)))
    return millis


def epoch(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()


# --- Anthropic: input, output and request windows ------------------------------------------------


@options(itpm=60_000)
async def test_itpm_refuses_past_its_limit_in_anthropics_words(up: Upstream) -> None:
    first, _ = await up.post(MESSAGES, messages_body(), usage={"input": 59_000})
    assert first.status == 200
    assert first.headers["anthropic-ratelimit-input-tokens-limit"] == "60000"
    assert first.headers["anthropic-ratelimit-input-tokens-remaining"] == "1000"
    assert [first.headers[f"anthropic-ratelimit-tokens-{what}"] for what in ("limit", "remaining")] == \
        ["60000", "1000"]
    assert not {"anthropic-ratelimit-output-tokens-limit", "anthropic-ratelimit-requests-limit",
                "x-ratelimit-limit-tokens"} & {name.lower() for name in first.headers}
    refused, body = await up.post(MESSAGES, messages_body(), usage={"input": 5_000})
    assert refused.status == 429
    assert body == {"type": "error", "error": {"type": "rate_limit_error", "message": (
        "This request would exceed the rate limit for your organization (00000000-0000-4000-8000-00000000fa4e) "
        "of 60,000 input tokens per minute" + ANTHROPIC_TAIL)}}
    waited = wait_ms(refused)
    assert 3_500 < waited <= 4_000, "(5000 - ~1000 left) at 1000 tokens a second"
    assert refused.headers["anthropic-ratelimit-input-tokens-remaining"] == "1000"
    reset = epoch(refused.headers["anthropic-ratelimit-input-tokens-reset"])
    assert time.time() + 55 < reset <= time.time() + 59.1, "full again once the 59000 taken have refilled"
    now = time.time()
    assert stated_wait(refused.headers, json.dumps(body).encode(), now) == pytest.approx(waited / 1000)
    backoff = classify_response(429, refused.headers, json.dumps(body).encode(), {429}, now)
    assert backoff is not None and backoff.wait == pytest.approx(waited / 1000)
    budget = read_budget(refused.headers, now)
    assert budget is not None and budget.remaining_tokens == 1000
    stats = up.fake.stats()
    assert stats["windows"]["input_tokens_per_minute"]["rejected"] == 1
    assert (stats["window_rejected"], stats["rate_limited"], stats["keys"][""]["rejected"]) == (1, 1, 1)
    async with anthropic.AsyncAnthropic(base_url=up.url, api_key="x", max_retries=0) as client:
        with pytest.raises(anthropic.RateLimitError, match="60,000 input tokens per minute") as raised:
            await client.messages.create(**messages_body(), extra_headers={"x-fake-usage": '{"input": 60001}'})
    assert raised.value.response.headers["retry-after"] == "1", "key x's bucket is full: the request never fits"


@options(itpm=60_000)
async def test_a_bucket_refills_at_its_limit_per_minute(up: Upstream) -> None:
    drained, _ = await up.post(MESSAGES, messages_body(), usage={"input": 60_000})
    assert (drained.status, drained.headers["anthropic-ratelimit-input-tokens-remaining"]) == (200, "0")
    refused, _ = await up.post(MESSAGES, messages_body(), usage={"input": 300})
    assert refused.status == 429
    waited = wait_ms(refused)
    assert 200 < waited <= 300, "300 tokens at 1000 a second"
    early, _ = await up.post(MESSAGES, messages_body(), usage={"input": 300})
    assert early.status == 429
    await asyncio.sleep(waited / 1000 + 0.05)
    later, _ = await up.post(MESSAGES, messages_body(), usage={"input": 300})
    assert later.status == 200
    assert up.fake.stats()["windows"]["input_tokens_per_minute"]["rejected"] == 2


@options(itpm=60_000)
async def test_windows_are_per_key_and_per_model(up: Upstream) -> None:
    assert (await up.post(MESSAGES, messages_body(), usage={"input": 60_000}))[0].status == 200
    assert (await up.post(MESSAGES, messages_body(), usage={"input": 1_000}))[0].status == 429
    other_model, _ = await up.post(MESSAGES, messages_body(model="claude-other"), usage={"input": 1_000})
    other_key, _ = await up.post(MESSAGES, messages_body(), usage={"input": 1_000}, x_api_key="sk-b")
    assert (other_model.status, other_key.status) == (200, 200)
    levels = {(b["key"], b["model"]): b["level"]
              for b in up.fake.stats()["windows"]["input_tokens_per_minute"]["buckets"]}
    assert set(levels) == {("", "claude-m"), ("", "claude-other"), ("sk-b", "claude-m")}
    assert levels[("", "claude-m")] < 1_000 < levels[("sk-b", "claude-m")] < 60_000


@options(otpm=60_000)
async def test_otpm_charges_the_output_produced_after_the_answer(up: Upstream) -> None:
    first, _ = await up.post(MESSAGES, messages_body(stream=True), usage={"output": 59_000})
    assert first.headers["anthropic-ratelimit-output-tokens-remaining"] == "60000", "announced before the output"
    second, _ = await up.post(MESSAGES, messages_body(), usage={"output": 5_000})
    assert second.status == 200, "admitted while the bucket holds a token"
    assert second.headers["anthropic-ratelimit-output-tokens-remaining"] == "1000"
    refused, body = await up.post(MESSAGES, messages_body(), usage={"output": 10})
    assert refused.status == 429
    assert "of 60,000 output tokens per minute" in body["error"]["message"]
    assert refused.headers["anthropic-ratelimit-output-tokens-remaining"] == "0"
    assert 3_900 < wait_ms(refused) <= 4_100, "the bucket went ~4000 below zero and needs one token"
    assert up.fake.stats()["windows"]["output_tokens_per_minute"]["rejected"] == 1


@options(itpm=90_000, otpm=30_000, rpm=600)
async def test_anthropic_headers_name_each_window_and_the_tightest_tokens(up: Upstream) -> None:
    resp, _ = await up.post(MESSAGES, messages_body(), usage={"input": 1_234})
    headers = resp.headers
    assert [headers[f"anthropic-ratelimit-{w}-limit"] for w in ("input-tokens", "output-tokens", "requests")] == \
        ["90000", "30000", "600"]
    assert headers["anthropic-ratelimit-input-tokens-remaining"] == "89000", "88766 rounded to the thousand"
    assert headers["anthropic-ratelimit-requests-remaining"] == "599", "requests are not rounded"
    assert (headers["anthropic-ratelimit-tokens-limit"], headers["anthropic-ratelimit-tokens-remaining"]) == \
        ("30000", "30000"), "the tokens headers repeat the window with the least left"
    assert headers["anthropic-ratelimit-tokens-reset"] == headers["anthropic-ratelimit-output-tokens-reset"]
    assert time.time() - 1 < epoch(headers["anthropic-ratelimit-output-tokens-reset"]) < time.time() + 1, "full"
    assert epoch(headers["anthropic-ratelimit-input-tokens-reset"]) > time.time() + 0.5


@pytest.mark.parametrize("count,rounded", [
    (0, 0), (499, 0), (500, 1000), (1_499, 1000), (1_500, 2000), (88_766, 89_000), (450_000, 450_000),
])
def test_token_remaining_rounds_to_the_nearest_thousand(count: int, rounded: int) -> None:
    assert nearest_thousand(count) == rounded


@options(rpm=2)
async def test_rpm_holds_both_dialects_in_their_words(up: Upstream) -> None:
    answers = [await up.post(MESSAGES, messages_body()) for _ in range(3)]
    assert [r.status for r, _ in answers] == [200, 200, 429]
    assert [r.headers["anthropic-ratelimit-requests-remaining"] for r, _ in answers] == ["1", "0", "0"]
    assert "of 2 requests per minute" in answers[2][1]["error"]["message"]
    assert 29_000 < wait_ms(answers[2][0]) <= 30_000
    assert "anthropic-ratelimit-tokens-limit" not in answers[0][0].headers
    chats = [await up.post(CHAT, chat_body()) for _ in range(3)]
    assert [r.status for r, _ in chats] == [200, 200, 429]
    assert [r.headers["x-ratelimit-remaining-requests"] for r, _ in chats] == ["1", "0", "0"]
    error = chats[2][1]["error"]
    assert (error["type"], error["code"], error["param"]) == ("requests", "rate_limit_exceeded", None)
    match = OPENAI_LIMIT.fullmatch(error["message"])
    assert match is not None, error["message"]
    assert match.group("model", "short", "limit", "used", "requested") == ("gpt-m", "RPM", "2", "2", "1")
    assert float(match.group("wait")) == pytest.approx(wait_ms(chats[2][0]) / 1000, abs=0.002)
    assert up.fake.stats()["windows"]["requests_per_minute"]["rejected"] == 2


# --- OpenAI: the tokens window ---------------------------------------------------------------------


@options(tpm=60_000)
async def test_tpm_charges_the_larger_of_max_output_and_input_then_refuses(up: Upstream) -> None:
    async with openai.AsyncOpenAI(base_url=f"{up.url}/v1", api_key="x", max_retries=0) as client:
        raw = await client.chat.completions.with_raw_response.create(**chat_body(max_tokens=49_321))
        remaining = int(raw.headers["x-ratelimit-remaining-tokens"])
        assert 10_679 <= remaining < 10_750, "not rounded"
        assert raw.headers["x-ratelimit-limit-tokens"] == "60000"
        assert "x-ratelimit-limit-requests" not in raw.headers
        with pytest.raises(openai.RateLimitError) as raised:
            await client.chat.completions.create(**chat_body(max_completion_tokens=20_000))
    resp = raised.value.response
    error = raised.value.body
    assert isinstance(error, dict) and (error["type"], error["code"]) == ("tokens", "rate_limit_exceeded")
    match = OPENAI_LIMIT.fullmatch(error["message"])
    assert match is not None, error["message"]
    assert match.group("model", "short", "limit", "requested") == ("gpt-m", "TPM", "60000", "20000")
    assert 49_200 < int(match.group("used")) <= 49_321
    wait = float(match.group("wait"))
    assert 9.2 < wait < 9.4 and int(resp.headers["retry-after-ms"]) == pytest.approx(wait * 1000, abs=2)
    assert stated_wait({}, json.dumps({"error": error}).encode(), time.time()) == pytest.approx(wait)
    reset = resp.headers["x-ratelimit-reset-tokens"]
    assert re.fullmatch(r"49\.\d{1,3}s", reset), reset
    budget = read_budget(resp.headers, time.time())
    assert budget is not None and 10_679 <= (budget.remaining_tokens or 0) < 10_750


@options(tpm=60_000)
async def test_tpm_charges_what_the_answer_used_beyond_its_charge_and_gives_nothing_back(up: Upstream) -> None:
    under, _ = await up.post(CHAT, chat_body(max_tokens=1_000), usage={"input": 100, "output": 5_000})
    assert under.status == 200
    over, _ = await up.post(CHAT, chat_body(max_tokens=10_000, model="gpt-n"), usage={"input": 100, "output": 10})
    assert over.status == 200
    levels = {b["model"]: b["level"] for b in up.fake.stats()["windows"]["tokens_per_minute"]["buckets"]}
    assert 54_900 <= levels["gpt-m"] < 55_100, "1000 when sent, 4100 more once 5100 were used"
    assert 50_000 <= levels["gpt-n"] < 50_200, "10000 when sent, nothing given back"


@options(tpm=1_000)
async def test_a_request_above_the_whole_window_is_too_large(up: Upstream) -> None:
    resp, body = await up.post(RESPONSES, {"model": "gpt-m", "input": "hi", "max_output_tokens": 5_000})
    assert resp.status == 429
    assert body["error"]["message"] == (
        "Request too large for gpt-m in organization org-fake on tokens per min (TPM): Limit 1000, Requested 5000. "
        "The input or output tokens must be reduced in order to run successfully. "
        "Visit https://platform.openai.com/account/rate-limits to learn more.")
    assert wait_ms(resp) <= 1, "the bucket is full: a wait will not help"


# --- what is counted -----------------------------------------------------------------------------------


@options(tpm=1_000_000)
async def test_input_tokens_are_counted_from_the_text(up: Upstream) -> None:
    async with openai.AsyncOpenAI(base_url=f"{up.url}/v1", api_key="x", max_retries=0) as client:
        chat = await client.chat.completions.create(
            model="gpt-m", messages=[{"role": "system", "content": "s" * 40},
                                     {"role": "user", "content": [{"type": "text", "text": "é" * 10}]}])
        assert chat.usage is not None and chat.usage.prompt_tokens == 10 + 5, "ceil(UTF-8 bytes / 4) per block"
        responses = await client.responses.create(model="gpt-m", input="x" * 41, instructions="y" * 4)
        assert responses.usage is not None and responses.usage.input_tokens == 11 + 1
        completion = await client.completions.create(model="gpt-m", prompt="z" * 8)
        assert completion.usage is not None and completion.usage.prompt_tokens == 2


def test_blocks_come_in_cache_order_and_compare_without_cache_control() -> None:
    tool = {"name": "t", "input_schema": {"type": "object"}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "q" * 8,
                                                       "cache_control": {"type": "ephemeral"}}]}],
            "system": "s" * 4, "tools": [tool]}
    blocks = request_blocks(body)
    assert [b.identity.split(":")[0] for b in blocks] == ["tools", "system", "messages.user"]
    assert [b.tokens for b in blocks] == [math.ceil(len(json.dumps(tool, separators=(",", ":"))) / 4), 1, 2]
    assert [b.ttl for b in blocks] == [None, None, 300]
    plain = request_blocks({"messages": [{"role": "user", "content": "q" * 8}], "system": "s" * 4, "tools": [tool]})
    assert [b.identity for b in plain] == [b.identity for b in blocks]


# --- Anthropic prompt caching ---------------------------------------------------------------------------


def cached_system(**control: Any) -> list[dict[str, Any]]:
    return [{"type": "text", "text": "S" * 20_000, "cache_control": {"type": "ephemeral", **control}}]


@options(itpm=6_000)
async def test_cache_reads_are_free_against_itpm(up: Upstream) -> None:
    async with anthropic.AsyncAnthropic(base_url=up.url, api_key="x", max_retries=0) as client:
        first = await client.messages.create(**messages_body(system=cached_system()))
        assert (first.usage.input_tokens, first.usage.cache_creation_input_tokens,
                first.usage.cache_read_input_tokens) == (1, 5_000, 0)
        again = await client.messages.create(**messages_body(system=cached_system()))
        assert (again.usage.input_tokens, again.usage.cache_creation_input_tokens,
                again.usage.cache_read_input_tokens) == (1, 0, 5_000), "5001 would not fit in the ~1000 left"
        turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "o" * 400},
                {"role": "user", "content": [{"type": "text", "text": "n" * 40, "cache_control": {"type": "ephemeral"}}]}]
        plain_system = [{"type": "text", "text": "S" * 20_000}]
        next_turn = await client.messages.create(model="claude-m", max_tokens=16, system=plain_system,
                                                 messages=turn)
        assert (next_turn.usage.input_tokens, next_turn.usage.cache_creation_input_tokens,
                next_turn.usage.cache_read_input_tokens) == (0, 1 + 100 + 10, 5_000), \
            "the system prefix is read though its breakpoint moved; the rest up to the new one is written"
        other = await client.messages.create(**messages_body(model="claude-other", system=cached_system()))
        assert (other.usage.cache_creation_input_tokens, other.usage.cache_read_input_tokens) == (5_000, 0), \
            "another model has its own cache"
    assert up.fake.stats()["windows"]["input_tokens_per_minute"]["rejected"] == 0


def test_a_cached_prefix_lives_five_minutes_or_the_hour_asked_renewed_when_read() -> None:
    cache = PromptCache()
    scope = ("k", "m")
    short = request_blocks({"system": cached_system(), "messages": [{"role": "user", "content": "hi"}]})
    written = cache.count(scope, short, now=0)
    assert (written.input, written.cached, written.cache_write) == (5_001, 0, 5_000)
    cache.remember(written, now=0)
    assert cache.count(scope, short, now=299).cached == 5_000
    assert cache.count(scope, short, now=301).cached == 0, "expired after 5 minutes"
    assert cache.count(("k", "other"), short, now=1).cached == 0
    long = request_blocks({"system": cached_system(ttl="1h"), "messages": [{"role": "user", "content": "hi"}]})
    cache.remember(cache.count(scope, long, now=1000), now=1000)
    read = cache.count(scope, long, now=1000 + 3000)
    assert read.cached == 5_000
    cache.remember(read, now=4000)
    assert cache.count(scope, long, now=4000 + 3500).cached == 5_000, "renewed for an hour when read"
    assert cache.count(scope, long, now=4000 + 3601).cached == 0
    none = request_blocks({"system": "S" * 20_000, "messages": [{"role": "user", "content": "hi"}]})
    assert cache.count(scope, none, now=4001).cached == 0, "no breakpoint: nothing is read"


# --- the WebSocket mode ---------------------------------------------------------------------------------


async def ws_answer(ws: aiohttp.ClientWebSocketResponse, **fields: Any) -> list[dict[str, Any]]:
    await ws.send_str(json.dumps({"type": "response.create", "model": "gpt-m", "input": "hi", **fields}))
    events = []
    while not events or events[-1]["type"] not in {"response.completed", "response.failed", "error"}:
        message = await asyncio.wait_for(ws.receive(), 5)
        assert message.type is WSMsgType.TEXT, message
        events.append(json.loads(message.data))
    return events


@options(tpm=60_000)
async def test_websocket_frames_are_charged_and_refused_by_the_windows(up: Upstream) -> None:
    async with up.session.ws_connect(up.url + RESPONSES) as ws:
        first = await ws_answer(ws, max_output_tokens=59_000, x_fake={"usage": {"input": 100, "output": 50}})
        assert first[-1]["type"] == "response.completed"
        refused = (await ws_answer(ws, max_output_tokens=5_000))[-1]
        assert (refused["type"], refused["status"]) == ("error", 429)
        error = refused["error"]
        assert (error["type"], error["code"]) == ("tokens", "rate_limit_exceeded")
        match = OPENAI_LIMIT.fullmatch(error["message"])
        assert match is not None and match.group("short", "requested") == ("TPM", "5000")
        headers = refused["headers"]
        assert 3_900 < int(headers["retry-after-ms"]) <= 4_000
        assert 1_000 <= int(headers["x-ratelimit-remaining-tokens"]) < 1_100
        backoff = event_backoff(refused)
        assert backoff is not None and backoff.wait == pytest.approx(float(match.group("wait")))
        warmup = await ws_answer(ws, generate=False)
        assert warmup[-1]["type"] == "response.completed", "a warm-up costs no tokens"
    stats = up.fake.stats()
    assert (stats["windows"]["tokens_per_minute"]["rejected"], stats["rate_limited"]) == (1, 1)


@options(tpm=1_000_000)
async def test_a_continuation_is_charged_the_whole_conversation(up: Upstream) -> None:
    async with up.session.ws_connect(up.url + RESPONSES) as ws:
        first = (await ws_answer(ws, input="x" * 400))[-1]["response"]
        assert (first["usage"]["input_tokens"], first["usage"]["output_tokens"]) == (100, 2)
        then = (await ws_answer(ws, input="y" * 40, previous_response_id=first["id"]))[-1]["response"]
        assert then["usage"]["input_tokens"] == 100 + 2 + 10
    _, body = await up.post(RESPONSES, {"model": "gpt-m", "input": "z" * 4, "previous_response_id": then["id"]})
    assert body["usage"]["input_tokens"] == 112 + 2 + 1, "over HTTP too"


# --- options and the command line -------------------------------------------------------------------------


def test_window_flags() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = parser.parse_args([])
    assert (defaults.itpm, defaults.otpm, defaults.tpm, defaults.rpm) == (None, None, None, None)
    given = parser.parse_args(["--itpm", "450000", "--otpm", "90000", "--tpm", "2000000", "--rpm", "4000"])
    assert (given.itpm, given.otpm, given.tpm, given.rpm) == (450_000, 90_000, 2_000_000, 4_000)
    for flag in ("--itpm", "--otpm", "--tpm", "--rpm"):
        with pytest.raises(SystemExit):
            parser.parse_args([flag, "0"])


@pytest.mark.parametrize("kwargs,message", [
    ({"itpm": 0}, "itpm must be a positive integer or None"),
    ({"rpm": 10, "window_requests": 5}, "window_requests .* cannot be combined with the per-minute windows"),
])
def test_invalid_window_options(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FakeUpstream(**kwargs)


def test_the_command_refuses_a_fixed_window_beside_the_per_minute_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fake-upstream", "--port", "0", "--window-requests", "5", "--tpm", "1000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("slotproxy: fake-upstream: window_requests (a fixed request window) cannot be combined")


@options(itpm=6_000, rpm=10)
async def test_stats_reset_refills_the_windows_and_forgets_the_cache(up: Upstream) -> None:
    assert (await up.post(MESSAGES, messages_body(system=cached_system())))[0].status == 200
    assert (await up.post(MESSAGES, messages_body(), usage={"input": 5_000}))[0].status == 429
    async with up.session.get(up.url + "/stats") as resp:
        windows = (await resp.json())["windows"]
    assert {name: (w["limit"], w["rejected"]) for name, w in windows.items()} == \
        {"input_tokens_per_minute": (6_000, 1), "requests_per_minute": (10, 0)}
    async with up.session.post(up.url + "/stats/reset") as resp:
        after = (await resp.json())["windows"]
    assert after["input_tokens_per_minute"] == {"limit": 6_000, "rejected": 0, "buckets": []}
    _, body = await up.post(MESSAGES, messages_body(system=cached_system()))
    assert body["usage"]["cache_creation_input_tokens"] == 5_000, "written again"
