"""/metrics in Prometheus text format, read back with prometheus-client's own parser."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.limiter import Priority

from ..conftest import chat, provider_yaml, wait_until

pytestmark = pytest.mark.asyncio

SPEC_METRICS = {
    "slotproxy_in_flight": "gauge",
    "slotproxy_queued": "gauge",
    "slotproxy_limit": "gauge",
    "slotproxy_paused": "gauge",
    "slotproxy_requests": "counter",
    "slotproxy_queue_wait_seconds": "histogram",
    "slotproxy_upstream_backoff": "counter",
    "slotproxy_auto_reductions": "counter",
    "slotproxy_watchdog_reclaims": "counter",
    "slotproxy_invalid_priority_headers": "counter",
}


async def test_metrics_parse_and_carry_every_spec_metric(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream(retry_after=0.05)
    proxy = await start_proxy(provider_yaml(upstream, limit=3, retry_on_429=0))
    url = f"{proxy.url}/openai/chat/completions"
    async with client.post(url, json=chat(), headers={"X-Workspace-Starred": "perhaps"}) as resp:
        await resp.read()
    async with client.post(url, json=chat(), headers={"x-fake-status": "429"}) as resp:
        assert resp.status == 429
    async with client.get(f"{proxy.url}/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    for name, kind in SPEC_METRICS.items():
        assert name in families, name
        assert families[name].type == kind, name
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in families.values() for s in family.samples}
    assert samples[("slotproxy_requests_total", (("provider", "openai"), ("status", "200")))] == 1
    assert samples[("slotproxy_requests_total", (("provider", "openai"), ("status", "429")))] == 1
    assert samples[("slotproxy_upstream_backoff_total", (("provider", "openai"), ("status", "429")))] == 1
    assert samples[("slotproxy_auto_reductions_total", (("provider", "openai"),))] == 1
    assert samples[("slotproxy_limit", (("provider", "openai"),))] == 2
    assert samples[("slotproxy_paused", (("provider", "openai"),))] in (0, 1)
    assert samples[("slotproxy_invalid_priority_headers_total", (("header", "starred"),))] == 1
    assert samples[("slotproxy_queue_wait_seconds_count", (("provider", "openai"),))] == 2


async def test_key_and_model_series_carry_labels_from_the_config_only(start_upstream, start_proxy, client,
                                                                     monkeypatch) -> None:
    monkeypatch.setenv("SP_METRICS_KEY_A", "key-a")
    monkeypatch.delenv("SP_METRICS_KEY_B", raising=False)
    upstream = await start_upstream(retry_after=0.05)
    proxy = await start_proxy(
        f"state: {{path: null}}\nproviders:\n  openai:\n    upstream: {upstream.url}/v1\n    retry_on_429: 0\n"
        "    keys: [{name: a, api_key_env: SP_METRICS_KEY_A, limit: 3}, {name: b, api_key_env: SP_METRICS_KEY_B}]\n"
        "    models: {'big-*': {limit: 2}}\n")
    url = f"{proxy.url}/openai/chat/completions"
    for model in ("big-1", "whatever-the-client-says"):
        async with client.post(url, json={**chat(), "model": model}, headers={"x-fake-status": "429"}) as resp:
            assert resp.status == 429
    async with client.get(f"{proxy.url}/metrics") as resp:
        text = await resp.text()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("slotproxy_key_limit", (("key", "a"), ("provider", "openai")))] == 1, "two bursts, two steps"
    assert samples[("slotproxy_key_paused", (("key", "a"), ("provider", "openai")))] in (0, 1)
    assert samples[("slotproxy_key_paused", (("key", "b"), ("provider", "openai")))] == 0
    assert samples[("slotproxy_key_budget_held", (("key", "a"), ("provider", "openai")))] == 0
    assert samples[("slotproxy_model_limit", (("model", "big-*"), ("provider", "openai")))] == 2
    assert samples[("slotproxy_model_in_flight", (("model", "big-*"), ("provider", "openai")))] == 0
    models = {dict(labels).get("model") for name, labels in samples if name.startswith("slotproxy_model_")}
    assert models == {"big-*"}, "a model the client named is never a label value"


async def test_garbage_collection_pauses_are_counted_by_generation(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream()
    proxy = await start_proxy(provider_yaml(upstream))

    async def pauses() -> dict[tuple[str, str, str | None], float]:
        async with client.get(f"{proxy.url}/metrics") as resp:
            text = await resp.text()
        return {(s.name, s.labels["generation"], s.labels.get("le")): s.value for family in text_string_to_metric_families(text)
                if family.name == "slotproxy_gc_pause_seconds" for s in family.samples}

    before = await pauses()
    assert {generation for _, generation, _ in before} == {"0", "1", "2"}
    gc.collect()
    after = await pauses()
    count, total = ("slotproxy_gc_pause_seconds_count", "2", None), ("slotproxy_gc_pause_seconds_sum", "2", None)
    assert after[count] == before[count] + 1
    assert after[total] > before[total]
    assert after[("slotproxy_gc_pause_seconds_bucket", "2", "+Inf")] == after[count]


async def test_answers_are_counted_under_their_provider_once_it_is_known(start_upstream, start_proxy, client) -> None:
    upstream = await start_upstream(chunks=1, delay_ms=1)
    proxy = await start_proxy("server: {max_body: 1KiB}\n" + provider_yaml(upstream, limit=1))
    url = f"{proxy.url}/openai/chat/completions"
    async with client.post(url, data=b"x" * 4096) as resp:
        assert resp.status == 413
    async with client.post(f"{proxy.url}/no-such-provider/chat/completions", json=chat()) as resp:
        assert resp.status == 404
    holder = asyncio.create_task(client.post(url, json=chat(), headers={"x-fake-stall-ms": "500"}))
    await wait_until(lambda: proxy.status()["in_flight"] == 1)
    queued = asyncio.create_task(client.post(url, json=chat()))
    await wait_until(lambda: proxy.status()["queued"] == 1)
    queued.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued
    await wait_until(lambda: proxy.status()["queued"] == 0)
    async with await holder as held:
        await held.read()
    await wait_until(lambda: proxy.state.metrics.request_counts.get(("openai", "200")) == 1)
    async with client.get(f"{proxy.url}/metrics") as resp:
        text = await resp.text()
    counted = {tuple(sorted(s.labels.items())): s.value for family in text_string_to_metric_families(text)
               if family.name == "slotproxy_requests" for s in family.samples if s.name == "slotproxy_requests_total"}
    assert counted == {
        (("provider", "openai"), ("status", "413")): 1,
        (("provider", "openai"), ("status", "499")): 1,
        (("provider", "openai"), ("status", "200")): 1,
    }, "the client that left while queued is a 499; the unknown provider adds no label value"


WINDOWS_YAML = """
state: {{path: null}}
providers:
  anthropic:
    upstream: {upstream}/v1
    auth: x-api-key
    limit: 8
    queue_timeout: 30
    windows: {{input_tokens_per_minute: 6000}}
    models: {{"claude-sonnet-*": {{limit: 4}}}}
"""


async def test_token_windows_are_scraped_from_the_status_snapshot(start_upstream, start_proxy, client) -> None:
    """A sonnet request takes 5,000 of 6,000 input tokens; the next, asking 2,000, waits on the window; a haiku
    request's 429 naming its window is a hit. The series carry the pattern, or ``other``, never the model."""
    upstream = await start_upstream()
    proxy = await start_proxy(WINDOWS_YAML.format(upstream=upstream.url))
    backend = proxy.state.backend
    sent = await backend.acquire("anthropic", Priority(time.time()), model="claude-sonnet-4-5",
                                 cost={"input_tokens_per_minute": 5000}, group="claude-sonnet-*")
    held = asyncio.create_task(backend.acquire("anthropic", Priority(time.time()), model="claude-sonnet-4-5",
                                               cost={"input_tokens_per_minute": 2000}, group="claude-sonnet-*"))
    await wait_until(lambda: proxy.status("anthropic")["queued"] == 1, what="a request held by the window")
    haiku = await backend.acquire("anthropic", Priority(time.time()), model="claude-haiku-4-5",
                                  cost={"input_tokens_per_minute": 100}, group="claude-haiku-4-5")
    backend.report_window_hit("anthropic", None, "claude-haiku-4-5", "input_tokens_per_minute", time.time() + 30)
    haiku.release()
    async with client.get(f"{proxy.url}/metrics") as resp:
        text = await resp.text()
    held.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await held
    sent.release()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert (families["slotproxy_window_available"].type, families["slotproxy_window_held"].type) == ("gauge", "counter")
    samples = {(s.name, s.labels["group"]): s.value for family in families.values() for s in family.samples
               if s.name.startswith("slotproxy_window_")
               and (s.labels["provider"], s.labels["key"], s.labels["window"]) == ("anthropic", "", "input_tokens_per_minute")}
    assert 1000 <= samples[("slotproxy_window_available", "claude-sonnet-*")] < 1100, "refilled 100 a second"
    assert samples[("slotproxy_window_limit", "claude-sonnet-*")] == 6000
    assert samples[("slotproxy_window_held_total", "claude-sonnet-*")] == 1
    assert samples[("slotproxy_window_hits_total", "claude-sonnet-*")] == 0
    assert samples[("slotproxy_window_available", "other")] == 0, "the hit emptied haiku's window"
    assert samples[("slotproxy_window_hits_total", "other")] == 1
    assert {group for _, group in samples} == {"claude-sonnet-*", "other"}
