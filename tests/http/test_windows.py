"""Token windows held in the request path, end to end: a real proxy in front of the fake provider enforcing
the same per-minute windows (SPEC part four, "Token windows")."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import anthropic
import openai

from ..conftest import Proxy, Upstream

ITPM = 30_000
TEXT = "x" * 2_000
"""500 input tokens as the fake counts them (a quarter of the text's bytes)."""
EACH = 500
HEADROOM = 0.02
"""The proxy sends a request the instant its bucket holds the cost, and the fake charges it when it arrives:
a first request that took longer to arrive (a new connection) than a later one leaves the fake a few tokens
short of the proxy's view, as a provider's clock may. A little headroom absorbs that skew."""


def anthropic_yaml(upstream: Upstream, windows: str, backend: str = "", **settings: Any) -> str:
    extra = "".join(f"    {name}: {value}\n" for name, value in settings.items())
    return (f"state: {{path: null}}\n{backend}providers:\n  anthropic:\n    upstream: {upstream.url}\n"
            f"    auth: x-api-key\n    limit: 100\n    windows: {windows}\n{extra}")


def messages(text: str = TEXT, model: str = "claude-m", **fields: Any) -> dict[str, Any]:
    return {"model": model, "max_tokens": 16, "messages": [{"role": "user", "content": text}], **fields}


async def post(client: aiohttp.ClientSession, proxy: Proxy, body: dict[str, Any],
               path: str = "/anthropic/v1/messages", **headers: str) -> tuple[int, Any]:
    async with client.post(proxy.url + path, json=body, headers=headers) as resp:
        return resp.status, await resp.json()


async def fleet(client: aiohttp.ClientSession, proxy: Proxy, count: int, body: dict[str, Any],
                path: str = "/anthropic/v1/messages") -> list[int]:
    answers = await asyncio.gather(*(post(client, proxy, body, path) for _ in range(count)))
    return [status for status, _ in answers]


def window_row(proxy: Proxy, window: str, provider: str = "anthropic", group: str = "claude-m") -> dict[str, Any]:
    rows = [row for row in proxy.status(provider)["windows"] if row["group"] == group and row["window"] == window]
    assert len(rows) == 1, proxy.status(provider).get("windows")
    return rows[0]


def upstream_429s(upstream: Upstream) -> int:
    return int(upstream.fake.stats()["rate_limited"])


async def test_a_fleet_is_held_by_its_input_window_and_never_refused(start_upstream, start_proxy, client,
                                                                    backend_yaml) -> None:
    up = await start_upstream(itpm=ITPM, chunks=1, delay_ms=5)
    proxy = await start_proxy(anthropic_yaml(up, f"{{input_tokens_per_minute: {ITPM}, headroom: {HEADROOM}}}",
                                             backend_yaml, retry_on_429=0))
    count = ITPM // EACH + 1  # more than the window holds: the last ones wait for its refill (~2 s)
    started = time.monotonic()
    statuses = await fleet(client, proxy, count, messages())
    assert statuses == [200] * count
    assert upstream_429s(up) == 0
    assert time.monotonic() - started > 0.5, "the last requests waited for the window's refill"
    await proxy.state.backend.refresh()  # Redis: status reads the fleet's snapshot
    row = window_row(proxy, "input_tokens_per_minute")
    assert (row["limit"], row["source"], row["hits"]) == (ITPM, "both", 0), "config, and the fake's headers"
    assert row["held_total"] >= 1 and row["reserved"] == 0
    assert row["ratio"] is not None and row["ratio"] < 0.3, "the ratio is learned from the answers"
    assert -0.3 < row["estimate_error_p50"] <= 0.05, "the prior leans high, then the estimates are exact"


async def test_windows_learned_from_the_headers_hold_every_request_after_the_first(start_upstream, start_proxy,
                                                                                client) -> None:
    up = await start_upstream(itpm=ITPM, chunks=1, delay_ms=5)
    proxy = await start_proxy(anthropic_yaml(up, f"{{headroom: {HEADROOM}}}", retry_on_429=0))
    assert (await post(client, proxy, messages()))[0] == 200
    assert window_row(proxy, "input_tokens_per_minute")["source"] == "headers"
    # That first request was sent before any window was known, so it was charged to none: let the fake's
    # bucket refill it (500 tokens at 500 a second) rather than count on the headers' rounding to the thousand.
    await asyncio.sleep(1.1)
    count = ITPM // EACH + 2
    assert await fleet(client, proxy, count, messages()) == [200] * count
    assert upstream_429s(up) == 0
    row = window_row(proxy, "input_tokens_per_minute")
    assert (row["limit"], row["source"], row["hits"]) == (ITPM, "headers", 0)


def fake_usage(input_tokens: int) -> dict[str, str]:
    return {"x-fake-usage": json.dumps({"input": input_tokens})}


async def drain(client: aiohttp.ClientSession, upstream: Upstream, input_tokens: int) -> None:
    """Another client of the same key spends the fake's input window behind the proxy's back."""
    async with client.post(f"{upstream.url}/v1/messages", json=messages("hi"),
                           headers=fake_usage(input_tokens)) as resp:
        assert resp.status == 200


async def test_a_window_429_empties_the_window_without_a_backoff(start_upstream, start_proxy, client) -> None:
    up = await start_upstream(itpm=60_000, chunks=1, delay_ms=1)
    windows = "{input_tokens_per_minute: 1000000, learn: false}"
    proxy = await start_proxy(anthropic_yaml(up, windows, retry_on_429=0))
    await drain(client, up, 59_000)
    status, body = await post(client, proxy, messages("hi"), **fake_usage(1_500))
    assert status == 429 and "60,000 input tokens per minute" in body["error"]["message"]
    assert upstream_429s(up) == 1
    document = proxy.status("anthropic")
    row = window_row(proxy, "input_tokens_per_minute")
    assert (row["hits"], row["available"]) == (1, 0), "counted, and emptied until the stated wait"
    assert (document["limit"], document["auto_reduced"], document["notice"], document["paused"]) == \
        (100, False, None, False), "the slots were not the problem"
    assert document["relayed_429"] == 1
    assert proxy.state.backend.backoffs.relayed_total("anthropic") == 1
    assert proxy.state.windowing("anthropic").estimator.status(None, "claude-m")["ratio"] > 0.3, "raised"


async def test_a_window_429_is_retried_once_the_window_has_room(start_upstream, start_proxy, client) -> None:
    up = await start_upstream(itpm=60_000, chunks=1, delay_ms=1)
    windows = "{input_tokens_per_minute: 1000000, learn: false}"
    proxy = await start_proxy(anthropic_yaml(up, windows, retry_on_429=2))
    await drain(client, up, 59_000)
    started = time.monotonic()
    status, _ = await post(client, proxy, messages("hi"), **fake_usage(1_500))
    assert status == 200
    assert time.monotonic() - started >= 0.4, "held until the wait the 429 stated (~0.5 s)"
    assert upstream_429s(up) == 1, "retried once, when the window had room"
    assert window_row(proxy, "input_tokens_per_minute")["hits"] == 1
    assert proxy.status("anthropic")["auto_reduced"] is False


async def test_after_a_window_429_the_request_goes_at_the_stated_wait_not_a_refill_after_it(
        start_upstream, start_proxy, client) -> None:
    """The fake's 429 says when the refused request fits (Retry-After, 2 s here): the proxy holds it until
    then and sends it with the room the provider said it will have, not after refilling from empty (its
    estimate's worth at 1 000 tokens a second: another 4.5 s)."""
    up = await start_upstream(itpm=60_000, chunks=1, delay_ms=1)
    proxy = await start_proxy(anthropic_yaml(up, "{input_tokens_per_minute: 60000, learn: false}", retry_on_429=2))
    await drain(client, up, 59_000)
    started = time.monotonic()
    status, _ = await post(client, proxy, messages("z" * 12_000))  # 3 000 tokens as the fake counts them
    waited = time.monotonic() - started
    assert status == 200
    assert upstream_429s(up) == 1
    assert 1.9 <= waited < 4.5, waited


async def test_a_window_429_after_an_under_estimate_waits_the_stated_time_not_twice_the_debt(
        start_upstream, start_proxy, client) -> None:
    """Two requests the proxy thinks small: the fake takes the first (80 000 tokens) and refuses the second
    (45 000) for 2.5 s. The first request's usage, settling after that 429, is already in what the fake said:
    the second goes after about 2.5 s, not after the first's 80 000 refill too (40 s)."""
    up = await start_upstream(itpm=120_000, chunks=1, delay_ms=300)
    proxy = await start_proxy(anthropic_yaml(up, "{input_tokens_per_minute: 120000, learn: false}", retry_on_429=2))
    started = time.monotonic()
    first = asyncio.create_task(post(client, proxy, messages("a"), **fake_usage(80_000)))
    await asyncio.sleep(0.05)
    status, _ = await post(client, proxy, messages("b"), **fake_usage(45_000))
    waited = time.monotonic() - started
    assert status == 200 and (await first)[0] == 200
    assert upstream_429s(up) == 1
    assert 2.0 <= waited < 8.0, waited


async def test_a_request_larger_than_its_window_is_sent_once_and_its_429_relayed(start_upstream, start_proxy,
                                                                                 client) -> None:
    up = await start_upstream(itpm=3_000, chunks=1, delay_ms=1)
    proxy = await start_proxy(anthropic_yaml(up, "{input_tokens_per_minute: 3000}", retry_on_429=3))
    status, body = await post(client, proxy, messages("y" * 16_000))  # 4000 tokens: never fits in 3000
    assert status == 429 and "3,000 input tokens per minute" in body["error"]["message"]
    stats = up.fake.stats()
    assert (stats["requests"], stats["rate_limited"]) == (1, 1), "relayed at once: no retry can fit it"
    assert window_row(proxy, "input_tokens_per_minute")["hits"] == 1


def cached(turn: int) -> dict[str, Any]:
    system = [{"type": "text", "text": "s" * 16_000, "cache_control": {"type": "ephemeral"}}]
    return messages(f"question {turn}", system=system)


async def test_prompt_cache_reads_are_not_held_by_the_input_window(start_upstream, start_proxy, client) -> None:
    """Each request's prompt is 4000 tokens, 3990 of them read from the cache the first one wrote: twelve of
    them fit a 12000 input window at once; the whole prompts would need a minute and more of refill."""
    up = await start_upstream(itpm=12_000, chunks=1, delay_ms=1)
    proxy = await start_proxy(anthropic_yaml(up, "{input_tokens_per_minute: 12000}", retry_on_429=0))
    assert (await post(client, proxy, cached(0)))[0] == 200
    started = time.monotonic()
    answers = await asyncio.gather(*(post(client, proxy, cached(turn)) for turn in range(1, 13)))
    assert [status for status, _ in answers] == [200] * 12
    assert all(answer["usage"]["cache_read_input_tokens"] == 4_000 for _, answer in answers)
    assert time.monotonic() - started < 5
    assert upstream_429s(up) == 0


async def test_the_sdks_work_through_windows(start_upstream, start_proxy) -> None:
    up = await start_upstream(itpm=100_000, otpm=20_000, tpm=100_000, rpm=1_000, chunks=2, delay_ms=1)
    proxy = await start_proxy(
        f"state: {{path: null}}\nproviders:\n"
        f"  anthropic:\n    upstream: {up.url}\n    auth: x-api-key\n    windows: {{}}\n"
        f"  openai:\n    upstream: {up.url}/v1\n    windows: {{tokens_per_minute: 100000}}\n")
    async with anthropic.AsyncAnthropic(base_url=f"{proxy.url}/anthropic", api_key="k", max_retries=0) as claude:
        for _ in range(2):
            message = await claude.messages.create(**messages("hello"))
            assert message.usage.input_tokens > 0
        async with claude.messages.stream(**messages("hello")) as stream:
            final = await stream.get_final_message()
        assert final.usage.output_tokens > 0
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/openai", api_key="k", max_retries=0) as gpt:
        completion = await gpt.chat.completions.create(
            model="gpt-m", messages=[{"role": "user", "content": "hello"}], max_tokens=32)
        assert completion.usage is not None and completion.usage.total_tokens > 0
        chunks = [chunk async for chunk in await gpt.chat.completions.create(
            model="gpt-m", messages=[{"role": "user", "content": "hello"}], stream=True,
            stream_options={"include_usage": True})]
        assert chunks[-1].usage is not None
        response = await gpt.responses.create(model="gpt-m", input="hello", max_output_tokens=64)
        assert response.usage is not None
    assert upstream_429s(up) == 0
    learned = {row["window"]: row for row in proxy.status("anthropic")["windows"]}
    assert {name: row["limit"] for name, row in learned.items()} == {
        "input_tokens_per_minute": 100_000, "output_tokens_per_minute": 20_000, "requests_per_minute": 1_000}
    assert all(row["reserved"] == 0 and row["source"] == "headers" for row in learned.values())
    tpm = window_row(proxy, "tokens_per_minute", provider="openai", group="gpt-m")
    assert (tpm["limit"], tpm["source"], tpm["reserved"]) == (100_000, "both", 0)
    assert tpm["estimate_error_p50"] is not None, "reconciled from the answers' usage"


# --- a group costed again once its estimates move (providers.recost) -----------------------------------------

OTPM = 100_000
"""Refills 1,667 output tokens a second: a request estimated at its max_tokens of 64,000 leaves room for one."""


async def test_a_fleet_queued_on_its_prior_output_estimate_goes_once_the_first_answer_teaches_a_small_p90(
        start_upstream, start_proxy, client, backend_yaml) -> None:
    """A cold start: eight requests asking max_tokens 64,000 before their group has any answer, so each is
    estimated at 64,000 against a 100,000 output window. The first goes and the others queue. Its answer (two
    output tokens) teaches the group a p90 of two: the waiters are costed again at once and go together,
    rather than one at a time as each answer gives its over-estimate back (eight answers of half a second)."""
    up = await start_upstream(otpm=OTPM, chunks=2, delay_ms=500)
    proxy = await start_proxy(anthropic_yaml(up, f"{{output_tokens_per_minute: {OTPM}}}", backend_yaml,
                                             retry_on_429=0))
    count = 8
    started = time.monotonic()
    statuses = await fleet(client, proxy, count, messages(max_tokens=64_000))
    elapsed = time.monotonic() - started
    assert statuses == [200] * count and upstream_429s(up) == 0
    assert up.fake.stats()["max_concurrency"] >= count - 2, "after the first answer, the rest went together"
    assert elapsed < 3.0, f"two answers' time, not eight: {elapsed:.2f} s"
    await proxy.state.backend.refresh()
    row = window_row(proxy, "output_tokens_per_minute")
    assert (row["reserved"], row["held"], row["hits"]) == (0, 0, 0)
    assert row["available"] > OTPM - 64_000, "the first request's over-estimate was given back"


class _Backend:
    """What ``Windowing`` asks of a backend, recorded: one output window of 100,000 on every group."""

    def __init__(self) -> None:
        self.recosted: list[tuple[str, str]] = []

    def window_limits(self, provider: str, key: str | None, group: str | None) -> dict[str, int]:
        return {"output_tokens_per_minute": OTPM}

    def recost_windows(self, provider: str, group: str) -> None:
        self.recosted.append((provider, group))

    def settle_windows(self, *args: Any) -> None:
        return None

    def report_window_hit(self, *args: Any) -> None:
        return None


class _Lease:
    key = None
    group = "claude-m"

    def __init__(self, cost: dict[str, float] | None) -> None:
        self.cost = cost


def _windowing() -> Any:
    from proxy.http.windows import Windowing

    return Windowing("anthropic", "anthropic", patterns=(), keys=(), learn=True, headroom=0.0)


def test_waiters_are_costed_again_when_their_group_s_estimates_move_and_not_otherwise() -> None:
    from proxy.http.windows import parsed_request
    from proxy.providers.tokens import TokenCounts

    windowing, backend = _windowing(), _Backend()
    body = json.dumps(messages(max_tokens=64_000)).encode()
    _, request = parsed_request("v1/messages", body)
    costing = windowing.costing(backend, "claude-m", body, request)
    assert costing.cost == {"output_tokens_per_minute": 64_000}, "no answer yet: the request's own maximum"

    def answered(output: int) -> None:
        lease = _Lease({"output_tokens_per_minute": 64_000.0})
        windowing.settle(backend, lease, "claude-m", costing.estimates[0][0], TokenCounts(500, 0, 0, output))
    answered(480)
    assert backend.recosted == [("anthropic", "claude-m")], "the first answer moved the group's estimates"
    assert costing() == {"output_tokens_per_minute": 480}
    answered(500)
    assert len(backend.recosted) == 1, "a p90 of 500 is within a fifth of the 480 it last moved to"
    answered(5_000)
    assert len(backend.recosted) == 2
    windowing.hit(backend, None, "claude-m", 429, {}, b'{"type": "error", "error": {"type": "rate_limit_error", '
                  b'"message": "This request would exceed your rate limit of 100,000 output tokens per minute."}}',
                  1.0)
    assert len(backend.recosted) == 3, "a window hit raises the ratio by a quarter: moved"
    assert windowing.costing(backend, "other", body, request).cost == {"output_tokens_per_minute": 64_000}


def test_a_lease_is_settled_against_the_estimate_its_grant_took() -> None:
    from proxy.http.windows import parsed_request

    windowing, backend = _windowing(), _Backend()
    body = json.dumps(messages(max_tokens=64_000)).encode()
    _, request = parsed_request("v1/messages", body)
    costing = windowing.costing(backend, "claude-m", body, request)
    first = costing.estimates[0][0]
    from proxy.providers.tokens import TokenCounts

    windowing.settle(backend, _Lease(None), "claude-m", first, TokenCounts(500, 0, 0, 480))
    fresh = costing()
    assert fresh == {"output_tokens_per_minute": 480}
    assert costing.taken(_Lease({"output_tokens_per_minute": 64_000})) is first, "granted before the re-costing"
    assert costing.taken(_Lease(dict(fresh))) is costing.estimates[-1][0]
    assert costing.taken(_Lease(None)) is costing.estimates[-1][0]


def test_no_move_is_checked_while_no_request_asks_and_waiters_asking_after_are_costed_again() -> None:
    """An answer that comes while none of the provider's requests is asking for its slot here is not checked
    for a move (nothing could be costed again); the first answer that comes while one asks is checked, from the
    priors, so that request is costed again once, and later small drifts cost nothing again."""
    from proxy.http.windows import parsed_request
    from proxy.providers.tokens import TokenCounts

    windowing, backend = _windowing(), _Backend()
    asked: list[str] = []
    basis = windowing.estimator.basis
    windowing.estimator.basis = lambda group: asked.append(group) or basis(group)  # type: ignore[method-assign]
    body = json.dumps(messages(max_tokens=64_000)).encode()
    _, request = parsed_request("v1/messages", body)
    first = windowing.costing(backend, "claude-m", body, request)
    assert windowing.drift.asking == 1
    first.taken(_Lease({"output_tokens_per_minute": 64_000.0}))
    first.taken(_Lease({"output_tokens_per_minute": 64_000.0}))
    assert windowing.drift.asking == 0, "granted: it asks no more (once, however often it is read)"

    def answered(output: int) -> None:
        windowing.settle(backend, _Lease({"output_tokens_per_minute": 64_000.0}), "claude-m",
                         first.estimates[0][0], TokenCounts(500, 0, 0, output))
    for output in (480, 5_000, 480):
        answered(output)
    assert (asked, backend.recosted) == ([], []), "nobody asking: the estimates' moves are not followed"
    waiting = windowing.costing(backend, "claude-m", body, request)
    assert waiting.cost == {"output_tokens_per_minute": 5_000}
    answered(5_000)
    assert asked == ["claude-m"] and backend.recosted == [("anthropic", "claude-m")], \
        "a request asks: checked, from the priors (the moves before it were not followed)"
    answered(5_000)
    assert len(asked) == 2 and len(backend.recosted) == 1, "measured from there on as before"
    waiting.left()
    waiting.left()
    assert windowing.drift.asking == 0
    answered(480)
    assert len(asked) == 2 and len(backend.recosted) == 1


async def test_no_request_counts_as_asking_once_it_was_granted_refused_or_left(start_upstream, start_proxy,
                                                                               client) -> None:
    """A request granted at once, one whose client leaves while it is queued, and one that times out in the
    queue each stop asking (``Drift.asking``): the first holds the output window for two seconds."""
    up = await start_upstream(otpm=OTPM, chunks=2, delay_ms=1_000)
    proxy = await start_proxy(anthropic_yaml(up, f"{{output_tokens_per_minute: {OTPM}}}", retry_on_429=0,
                                             queue_timeout="0.4s"))
    drift = proxy.state.windowing("anthropic").drift
    granted = asyncio.create_task(post(client, proxy, messages(max_tokens=64_000)))
    await asyncio.sleep(0.1)
    try:
        async with client.post(proxy.url + "/anthropic/v1/messages", json=messages(max_tokens=64_000),
                               timeout=aiohttp.ClientTimeout(total=0.1)) as resp:
            await resp.read()
    except TimeoutError:
        pass
    status, body = await post(client, proxy, messages(max_tokens=64_000))
    assert (status, body["error"]["code"]) == (503, "queue_timeout")
    assert (await granted)[0] == 200
    await asyncio.sleep(0.1)
    assert drift.asking == 0
