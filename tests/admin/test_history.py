"""The one-hour history: the pure series on fake time, the sampler's loop, and ``GET /_slotproxy/history``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from proxy.admin import history
from proxy.admin.history import HELD, PAUSED, REDUCED, SAMPLES, History, HistorySampler
from proxy.admin.routes import HISTORY
from proxy.limiter import KeyStatus, ProviderStatus

from ..conftest import chat, wait_until

T0 = 1_800_000_000.0


class FakeTime:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def key(name: str = "team-a", *, limit: int | None = 2, paused_until: int | None = None,
        auto_reduced_from: int | None = None, held_until: int | None = None, available: bool = True) -> KeyStatus:
    budget = {"remaining_requests": 0 if held_until else 5, "remaining_tokens": None, "reset_at": held_until,
              "held_until": held_until}
    return KeyStatus(name=name, available=available, limit=limit, configured_limit=2, in_flight=1,
                     paused_until=paused_until, auto_reduced_from=auto_reduced_from, notice=None, budget=budget)


def provider(name: str = "openai", *, limit: int | None = 4, paused_until: int | None = None,
             reductions: int = 0, keys: tuple[KeyStatus, ...] = (), budget: dict[str, Any] | None = None,
             auto_reduced_from: int | None = None) -> ProviderStatus:
    return ProviderStatus(
        provider=name, limit=limit, configured_limit=4, in_flight=3, queued=2, paused=paused_until is not None,
        paused_until=paused_until, cooldown_ms=0, auto_reduced=auto_reduced_from is not None,
        auto_reduced_from=auto_reduced_from, notice=None, counters={"auto_reductions": reductions},
        keys=keys, budget=budget,
    )


def samples(hist: History, name: str = "openai") -> list[list[Any]]:
    (entry,) = [p for p in hist.to_dict()["providers"] if p["provider"] == name]
    return [list(s) for s in entry["samples"]]


def key_samples(hist: History, name: str, provider_name: str = "openai") -> list[list[Any]]:
    (entry,) = [p for p in hist.to_dict()["providers"] if p["provider"] == provider_name]
    (series,) = [k for k in entry["keys"] if k["name"] == name]
    return [list(s) for s in series["samples"]]


def flags_of(rows: list[list[Any]]) -> list[int]:
    return [row[-1] for row in rows]


def test_a_series_keeps_the_last_hour_and_documents_its_window() -> None:
    clock = FakeTime()
    hist = History(clock=clock)
    for _ in range(SAMPLES + 20):
        hist.record([provider(keys=(key(),))])
        clock.now += 5
    rows = samples(hist)
    assert len(rows) == SAMPLES == 720
    assert rows[0] == [round((T0 + 20 * 5) * 1000), 3, 2, 4, 0]
    assert rows[-1][0] - rows[0][0] == (SAMPLES - 1) * 5000 == 3_595_000
    assert len(key_samples(hist, "team-a")) == SAMPLES
    assert key_samples(hist, "team-a")[-1][1:] == [1, 2, 0]
    document = hist.to_dict()
    assert (document["interval_ms"], document["window_ms"]) == (5000, 3_600_000)


def test_hours_of_samples_stay_bounded_to_the_last_hour_of_each_series() -> None:
    """Three hours of a storm every ten minutes on two providers and a pool: each series holds one hour, no
    more, and the newest hour is the one kept (the dashboard's 5-minute span is its last 60 samples)."""
    clock = FakeTime()
    hist = History(clock=clock)
    later = round(T0 * 1000) + 10**9
    for i in range(3 * SAMPLES):
        storm = i % 120 < 6  # 30 seconds in every 10 minutes
        keys = (key(paused_until=later if storm else None), key("team-b"), key("team-c"))
        hist.record([provider(keys=keys, paused_until=later if storm else None), provider("anthropic")])
        clock.now += 5
    document = hist.to_dict()
    series = [entry["samples"] for entry in document["providers"]]
    series += [k["samples"] for entry in document["providers"] for k in entry["keys"]]
    assert len(series) == 5 and {len(s) for s in series} == {SAMPLES}
    first = round((T0 + 2 * SAMPLES * 5) * 1000)
    assert all(s[0][0] == first and s[-1][0] == first + (SAMPLES - 1) * 5000 for s in series)
    # Six storms in the hour kept, each six samples long.
    assert sum(1 for row in samples(hist) if row[4] & PAUSED) == 6 * 6
    last_five_minutes = samples(hist)[-60:]
    assert sum(1 for row in last_five_minutes if row[4] & PAUSED) == 0
    assert [row[4] & PAUSED for row in samples(hist)[-120:-114]] == [PAUSED] * 6


def test_a_pause_a_reduction_and_a_budget_hold_are_flagged() -> None:
    clock = FakeTime()
    hist = History(clock=clock)
    later = round(T0 * 1000) + 30_000
    steps = [
        provider(keys=(key(), key("team-b"))),
        # team-a answered 429: it pauses and drops to 1; the provider counts the reduction.
        provider(reductions=1, keys=(key(limit=1, paused_until=later, auto_reduced_from=2), key("team-b"))),
        # still paused, no new reduction; team-b's window is spent.
        provider(reductions=1, keys=(key(limit=1, paused_until=later, auto_reduced_from=2),
                                     key("team-b", held_until=later))),
        # team-a's pause is over, its limit still reduced; the provider pauses and drops to 3.
        provider(reductions=1, keys=(key(limit=1, auto_reduced_from=2), key("team-b"))),
        provider(limit=3, paused_until=later, auto_reduced_from=4, keys=(key(limit=2), key("team-b"))),
    ]
    for status in steps:
        hist.record([status])
        clock.now += 5
    assert flags_of(key_samples(hist, "team-a")) == [0, PAUSED | REDUCED, PAUSED, 0, 0]
    assert flags_of(key_samples(hist, "team-b")) == [0, 0, HELD, 0, 0]
    assert flags_of(samples(hist)) == [0, REDUCED, 0, 0, PAUSED | REDUCED]
    assert [row[3] for row in samples(hist)] == [4, 4, 4, 4, 3]
    assert [row[2] for row in key_samples(hist, "team-a")] == [2, 1, 1, 1, 2]


def test_a_limit_lowered_while_already_reduced_is_a_new_reduction() -> None:
    hist = History(clock=FakeTime())
    for limit in (3, 2, 2, 1):
        hist.record([provider(keys=(key(limit=limit, auto_reduced_from=4 if limit < 3 else None),))])
    assert flags_of(key_samples(hist, "team-a")) == [0, REDUCED, 0, REDUCED]


def test_a_pool_held_by_its_budgets_is_held_not_paused() -> None:
    hist = History(clock=FakeTime())
    soon, later = round(T0 * 1000) + 1000, round(T0 * 1000) + 9000
    held = (key(held_until=soon), key("team-b", held_until=later), key("team-c", available=False))
    hist.record([provider(paused_until=soon, keys=held)])
    mixed = (key(paused_until=soon), key("team-b", held_until=later))
    hist.record([provider(paused_until=soon, keys=mixed)])
    # The provider's own pause, longer than its keys' block.
    hist.record([provider(paused_until=later + 1, keys=(key(held_until=soon),))])
    hist.record([provider(budget={"remaining_requests": 0, "remaining_tokens": 10, "reset_at": later,
                                  "held_until": later})])
    assert flags_of(samples(hist)) == [HELD, PAUSED | HELD, PAUSED, HELD]


def test_a_provider_or_key_that_leaves_the_config_loses_its_series() -> None:
    clock = FakeTime()
    hist = History(clock=clock)
    for _ in range(3):
        hist.record([provider(keys=(key(), key("team-b"))), provider("anthropic")])
        clock.now += 5
    hist.record([provider(keys=(key("team-b"),))])
    document = hist.to_dict()
    assert [p["provider"] for p in document["providers"]] == ["openai"]
    assert [k["name"] for k in document["providers"][0]["keys"]] == ["team-b"]
    assert len(key_samples(hist, "team-b")) == 4
    hist.record([provider(keys=(key(), key("team-b"))), provider("anthropic")])
    assert len(key_samples(hist, "team-a")) == 1 and len(samples(hist, "anthropic")) == 1


class FakeBackend:
    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []
        self.fail = False

    async def refresh(self, *, queue_detail: bool = True) -> None:
        self.calls.append(("refresh", queue_detail))
        if self.fail:
            raise ConnectionError("backend gone")

    def statistics(self, *, queue_detail: bool = True) -> list[ProviderStatus]:
        self.calls.append(("statistics", queue_detail))
        return [provider()]


async def test_the_sampler_refreshes_first_survives_a_failure_and_stops_with_the_app() -> None:
    backend = FakeBackend()
    hist = History(0.01)
    sampler = HistorySampler(backend, hist)  # type: ignore[arg-type]
    running = sampler.running(None)
    await running.__anext__()
    await wait_until(lambda: len(backend.calls) >= 4, what="two samples")
    assert backend.calls[:4] == [("refresh", False), ("statistics", False)] * 2
    backend.fail = True
    await wait_until(lambda: backend.calls.count(("refresh", False)) >= 4, what="failed samples")
    backend.fail = False
    taken = len(samples(hist))
    await wait_until(lambda: len(samples(hist)) > taken, what="sampling to go on after a failure")
    with pytest.raises(StopAsyncIteration):
        await running.__anext__()
    stopped = len(backend.calls)
    await asyncio.sleep(0.05)
    assert len(backend.calls) == stopped


POOL_YAML = """
state: {{path: null}}
providers:
  openai:
    upstream: {upstream}/v1
    retry_on_429: 0
    keys:
      - {{name: team-a, api_key_env: SP_KEY_A, limit: 2}}
      - {{name: team-b, api_key_env: SP_KEY_B, limit: 2}}
    budgets: true
"""


@pytest.mark.asyncio
async def test_the_history_route_answers_the_documented_shape(start_upstream, start_proxy, client,
                                                              monkeypatch) -> None:
    monkeypatch.setattr(history, "SAMPLE_INTERVAL", 0.02)
    monkeypatch.setenv("SP_KEY_A", "key-a")
    monkeypatch.setenv("SP_KEY_B", "key-b")
    monkeypatch.setenv("SLOTPROXY_ADMIN_TOKEN", "a-token-history-reads-do-not-need")
    upstream = await start_upstream(retry_after=5)
    proxy = await start_proxy(POOL_YAML.format(upstream=upstream.url))
    kept = proxy.runner.app[HISTORY]
    await wait_until(lambda: bool(kept.to_dict()["providers"]), what="the first sample")
    async with client.post(f"{proxy.url}/openai/chat/completions", json=chat(stream=False),
                           headers={"x-fake-status": "429"}) as resp:
        assert resp.status == 429
    (reduced,) = [k["name"] for k in proxy.status()["keys"] if k["auto_reduced"]]
    url = f"{proxy.url}/_slotproxy/history"

    async def document() -> dict[str, Any]:
        async with client.get(url) as resp:
            assert resp.status == 200 and resp.content_type == "application/json"
            return await resp.json()  # type: ignore[no-any-return]


    def flags() -> list[int]:
        return [s[3] for k in kept.to_dict()["providers"][0]["keys"] if k["name"] == reduced for s in k["samples"]]

    await wait_until(lambda: PAUSED | REDUCED in flags() and flags()[-1] == PAUSED, what="the 429 in the history")
    body = await document()
    assert set(body) == {"interval_ms", "window_ms", "providers"}
    assert (body["interval_ms"], body["window_ms"]) == (20, 20 * SAMPLES)
    (entry,) = body["providers"]
    assert set(entry) == {"provider", "samples", "keys"} and entry["provider"] == "openai"
    assert all(len(s) == 5 and s[3] is None for s in entry["samples"])
    assert REDUCED in {s[4] & REDUCED for s in entry["samples"]}
    assert [k["name"] for k in entry["keys"]] == ["team-a", "team-b"]
    for series in entry["keys"]:
        assert all(len(s) == 4 and isinstance(s[0], int) and s[2] in (1, 2) for s in series["samples"])
    times = [s[0] for s in entry["samples"]]
    assert times == sorted(times)


@pytest.mark.asyncio
@pytest.mark.parametrize("headers", [{"Origin": "https://evil.example"}, {"Sec-Fetch-Site": "cross-site"}])
async def test_the_history_route_is_refused_to_other_sites_like_status(start_upstream, start_proxy, client,
                                                                       headers) -> None:
    upstream = await start_upstream()
    proxy = await start_proxy(f"state: {{path: null}}\nproviders:\n  openai:\n    upstream: {upstream.url}/v1\n")
    for path in ("status", "history"):
        async with client.get(f"{proxy.url}/_slotproxy/{path}", headers=headers) as resp:
            assert resp.status == 403, path
            assert "Access-Control-Allow-Origin" not in resp.headers
