"""``slotproxy usage`` and ``GET /_slotproxy/usage``: totals, cache writes, every filter of the API on the command
line, and grouping by what the client got (status) and how the request ended (outcome)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from typing import Any

import aiohttp

from proxy.ledger.report import UsageQuery, format_usage, parse_query

from ..conftest import Proxy, Upstream
from ..ports import free_port

FIGURES = {"input": 1200, "cached": 1000, "cache_write": 50, "output": 90, "reasoning": 30}
ANTHROPIC = {"x-api-key": "k", "anthropic-version": "2023-06-01", "x-fake-usage": json.dumps(FIGURES)}


def config(upstream: Upstream, tmp_path: Any) -> str:
    return (f"state: {{path: null}}\nledger: {{path: '{tmp_path / 'l.sqlite'}'}}\nproviders:\n"
            f"  openai: {{upstream: '{upstream.url}/v1'}}\n"
            f"  anthropic: {{upstream: '{upstream.url}', auth: x-api-key}}\n"
            f"  down: {{upstream: 'http://127.0.0.1:{free_port()}/v1'}}\n")


async def send(client: aiohttp.ClientSession, proxy: Proxy) -> None:
    """Two Anthropic answers with cache writes (web, docs), an OpenAI one (web) and an unreachable upstream."""
    for workspace, model in (("web", "claude-a"), ("docs", "claude-b")):
        body = {"model": model, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
        async with client.post(f"{proxy.url}/anthropic/v1/messages", json=body,
                               headers={**ANTHROPIC, "X-Workspace-Id": workspace}) as resp:
            assert resp.status == 200
            await resp.read()
    async with client.post(f"{proxy.url}/openai/responses", json={"model": "gpt-5", "input": "hi"},
                           headers={"X-Workspace-Id": "web"}) as resp:
        assert resp.status == 200
        await resp.read()
    async with client.post(f"{proxy.url}/down/responses", json={"model": "gpt-5", "input": "hi"}) as resp:
        assert resp.status == 502
    await proxy.state.ledger.flush()


async def usage_cli(proxy: Proxy, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "proxy", "usage", "--url", proxy.url, *args]
    return await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=30, check=False)


async def usage_json(proxy: Proxy, *args: str) -> dict[str, Any]:
    result = await usage_cli(proxy, *args, "--json")
    assert result.returncode == 0, result.stderr
    document: dict[str, Any] = json.loads(result.stdout)
    return document


async def test_usage_groups_by_status_and_outcome(start_upstream, start_proxy, client, tmp_path) -> None:
    proxy = await start_proxy(config(await start_upstream(chunks=2, delay_ms=1), tmp_path))
    await send(client, proxy)
    async with client.get(f"{proxy.url}/_slotproxy/usage", params={"by": "status,outcome"}) as resp:
        assert resp.status == 200
        document = await resp.json()
    assert document["by"] == ["status", "outcome"]
    assert sorted((row["status"], row["outcome"], row["requests"], row["errors"]) for row in document["rows"]) == [
        (200, "ok", 3, 0), (502, "upstream_error", 1, 1)]
    by_outcome = await usage_json(proxy, "--by", "outcome")
    assert sorted((row["outcome"], row["requests"]) for row in by_outcome["rows"]) == [("ok", 3),
                                                                                        ("upstream_error", 1)]
    table = await usage_cli(proxy, "--by", "provider,status")
    assert table.returncode == 0, table.stderr
    assert any(line.split()[:3] == ["down", "502", "1"] for line in table.stdout.splitlines()), table.stdout


def test_status_and_outcome_are_answered_from_each_replica_s_ledger() -> None:
    """The fleet's hourly aggregates on Redis have neither: a query naming one is not answered from them."""
    assert parse_query({"by": "status"}, now_ms=10**12).per_replica
    assert parse_query({"by": "workspace,outcome"}, now_ms=10**12).per_replica
    assert not parse_query({"by": "workspace,model"}, now_ms=10**12).per_replica
    assert not UsageQuery(since=0, until=1, by=("provider", "hour")).per_replica


async def test_the_table_has_cache_writes_and_a_totals_line(start_upstream, start_proxy, client, tmp_path) -> None:
    proxy = await start_proxy(config(await start_upstream(chunks=2, delay_ms=1), tmp_path))
    await send(client, proxy)
    result = await usage_cli(proxy, "--by", "workspace")
    assert result.returncode == 0, result.stderr
    head, *lines = result.stdout.splitlines()
    assert "CACHE WRITE" in head
    columns = head.replace("CACHE WRITE", "CACHE_WRITE").replace("QUEUE P50", "QUEUE_P50") \
        .replace("QUEUE MAX", "QUEUE_MAX").split()
    cells = {line.split()[0]: line.split() for line in lines if line and line.split()[0] in ("web", "docs", "TOTAL")}
    write = columns.index("CACHE_WRITE")
    assert (cells["web"][write], cells["docs"][write], cells["TOTAL"][write]) == ("50", "50", "100")
    requests, errors = columns.index("REQUESTS"), columns.index("ERRORS")
    document = await usage_json(proxy, "--by", "workspace")
    assert cells["TOTAL"][requests] == str(sum(row["requests"] for row in document["rows"])) == "4"
    assert cells["TOTAL"][errors] == "1"
    assert cells["TOTAL"][columns.index("INPUT")] == str(sum(row["input_tokens"] for row in document["rows"]))


def test_the_totals_line_adds_every_count_and_keeps_the_longest_wait() -> None:
    rows = [{"workspace": "a", "requests": 2, "errors": 1, "input_tokens": 10, "cached_input_tokens": 4,
             "cache_write_tokens": 3, "output_tokens": 5, "reasoning_tokens": 1, "unknown_usage": 0,
             "queue_ms_p50": 7, "queue_ms_max": 40, "cost_usd": 1.25, "unpriced": 0},
            {"workspace": "b", "requests": 1, "errors": 0, "input_tokens": 20, "cached_input_tokens": 0,
             "cache_write_tokens": 6, "output_tokens": 2, "reasoning_tokens": 0, "unknown_usage": 1,
             "queue_ms_p50": 3, "queue_ms_max": 90, "cost_usd": 0.004, "unpriced": 1}]
    table = format_usage({"by": ["workspace"], "rows": rows, "since": 0, "until": 1, "scope": "replica"})
    head, first, second, total = table.splitlines()[:4]
    assert head.split()[-6:] == ["UNKNOWN", "UNPRICED", "COST", "QUEUE", "P50", "QUEUE", "MAX"][-6:]
    assert "$1.25" in first.split() and "$0.004000" in second.split()
    assert total.split() == ["TOTAL", "3", "1", "30", "4", "9", "7", "1", "1", "1", "$1.25", "90", "ms"]
    empty = format_usage({"by": ["workspace"], "rows": [], "since": 0, "until": 1, "scope": "replica"})
    assert "TOTAL" not in empty and "(no requests in this span)" in empty


async def test_every_filter_of_the_api_is_a_flag(start_upstream, start_proxy, client, tmp_path) -> None:
    proxy = await start_proxy(config(await start_upstream(chunks=2, delay_ms=1), tmp_path))
    await send(client, proxy)

    def requests(document: dict[str, Any]) -> int:
        return sum(row["requests"] for row in document["rows"])

    assert requests(await usage_json(proxy)) == 4
    assert requests(await usage_json(proxy, "--provider", "anthropic")) == 2
    assert requests(await usage_json(proxy, "--workspace", "web")) == 2
    only = await usage_json(proxy, "--model", "claude-b", "--by", "model")
    assert [(row["model"], row["requests"]) for row in only["rows"]] == [("claude-b", 1)]
    assert requests(await usage_json(proxy, "--provider", "anthropic", "--workspace", "web")) == 1
    earlier = await usage_json(proxy, "--until", "1h")
    assert earlier["rows"] == [] and earlier["until"] - earlier["since"] == 24 * 3600 * 1000
    now = int(time.time() * 1000)
    assert requests(await usage_json(proxy, "--since", str(now - 60_000), "--until", str(now + 60_000))) == 4
    bad = await usage_cli(proxy, "--until", "next week")
    assert bad.returncode == 2 and "until must be epoch milliseconds" in bad.stderr
