"""/metrics in Prometheus text format, read back with prometheus-client's own parser."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ..conftest import chat, provider_yaml

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
