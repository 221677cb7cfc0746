"""The per-request counters as ``/metrics`` shows them."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from proxy.http.metrics import HOST_FILES_ENV, Metrics
from proxy.ledger.store import LedgerRow
from proxy.limiter.status import KeyStatus, ModelStatus, ProviderStatus

REPO = Path(__file__).resolve().parents[2]


def _row(provider: str, key: str | None, tokens: tuple[int, int, int, int, int]) -> LedgerRow:
    return LedgerRow(0, provider, key, "gpt-5", "default", False, None, "http", 200, "ok", 0, 1, 2, *tokens)


def _tokens(metrics: Metrics) -> dict[tuple[str, str, str, str], float]:
    lines = [line for line in metrics.render().decode().splitlines() if line.startswith("slotproxy_tokens_total{")]
    found = {}
    for line in lines:
        labels, value = line.removeprefix("slotproxy_tokens_total{").split("} ")
        pairs = dict(pair.split("=") for pair in labels.split(","))
        found[tuple(pairs[name].strip('"') for name in ("provider", "key", "model", "type"))] = float(value)
    return found


def test_each_token_type_is_its_own_series_and_adds_up_per_provider_key_and_model() -> None:
    metrics = Metrics(list, None)
    metrics.count_tokens(_row("openai", None, (100, 40, 0, 7, 3)), "gpt-5*")
    metrics.count_tokens(_row("openai", None, (10, 0, 0, 2, 0)), "gpt-5*")
    metrics.count_tokens(_row("openai", "b", (1, 0, 0, 1, 0)), "other")
    metrics.count_tokens(_row("anthropic", None, (50, 20, 30, 5, 0)), "other")
    assert _tokens(metrics) == {
        ("openai", "", "gpt-5*", "input"): 110.0,
        ("openai", "", "gpt-5*", "cached_input"): 40.0,
        ("openai", "", "gpt-5*", "output"): 9.0,
        ("openai", "", "gpt-5*", "reasoning"): 3.0,
        ("openai", "b", "other", "input"): 1.0,
        ("openai", "b", "other", "output"): 1.0,
        ("anthropic", "", "other", "input"): 50.0,
        ("anthropic", "", "other", "cached_input"): 20.0,
        ("anthropic", "", "other", "cache_write"): 30.0,
        ("anthropic", "", "other", "output"): 5.0,
    }, "a type still at 0 (cache writes on openai, reasoning on anthropic) has no series"


# --- token windows -----------------------------------------------------------------------------------------

WINDOW_FAMILIES = ("slotproxy_window_available", "slotproxy_window_limit", "slotproxy_window_held_total",
                   "slotproxy_window_hits_total")


def _window(group: str, window: str, limit: int | None, available: int, held_total: int = 0,
            hits: int = 0) -> dict[str, Any]:
    return {"group": group, "window": window, "limit": limit, "source": "config", "available": available,
            "reserved": 0, "held": 0, "held_total": held_total, "hits": hits, "ratio": None,
            "estimate_error_p50": None, "estimate_error_p90": None}


def _provider(name: str, *, windows: tuple[dict[str, Any], ...] | None = None,
              keys: tuple[KeyStatus, ...] = (), patterns: tuple[str, ...] = ()) -> ProviderStatus:
    return ProviderStatus(provider=name, limit=8, configured_limit=8, in_flight=0, queued=0, paused=False,
                          paused_until=None, cooldown_ms=0, auto_reduced=False, auto_reduced_from=None, notice=None,
                          keys=keys, models=tuple(ModelStatus(pattern, None, None, 0) for pattern in patterns),
                          windows=windows)


def _key(name: str, windows: tuple[dict[str, Any], ...]) -> KeyStatus:
    return KeyStatus(name=name, available=True, limit=None, configured_limit=None, in_flight=0, paused_until=None,
                     auto_reduced_from=None, notice=None, windows=windows)


def window_snapshot() -> list[ProviderStatus]:
    """An Anthropic provider without a pool whose sonnet pattern and two models outside every pattern hold
    windows, and an OpenAI pool whose key team-a holds one."""
    return [
        _provider("anthropic", patterns=("claude-sonnet-*",), windows=(
            _window("claude-sonnet-*", "input_tokens_per_minute", 450_000, 312_000, held_total=14, hits=1),
            _window("claude-haiku-4-5", "input_tokens_per_minute", 400_000, 300_000, held_total=2, hits=1),
            _window("claude-opus-4-1", "input_tokens_per_minute", 200_000, 20_000, held_total=5),
            _window("other", "requests_per_minute", None, 50),
        )),
        _provider("openai", keys=(_key("team-a", (_window("gpt-5", "tokens_per_minute", 2_000_000, 1_500_000),)),
                                  _key("team-b", ()))),
    ]


def _series(text: str) -> dict[tuple[str, tuple[str, str, str, str]], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in WINDOW_FAMILIES:
                labels = tuple(sample.labels[name] for name in ("provider", "key", "group", "window"))
                found[(sample.name, labels)] = sample.value
    return found


def _expected_windows() -> dict[tuple[str, tuple[str, str, str, str]], float]:
    sonnet = ("anthropic", "", "claude-sonnet-*", "input_tokens_per_minute")
    other = ("anthropic", "", "other", "input_tokens_per_minute")
    requests = ("anthropic", "", "other", "requests_per_minute")
    team_a = ("openai", "team-a", "other", "tokens_per_minute")
    return {
        ("slotproxy_window_available", sonnet): 312_000, ("slotproxy_window_limit", sonnet): 450_000,
        ("slotproxy_window_held_total", sonnet): 14, ("slotproxy_window_hits_total", sonnet): 1,
        # Opus has the least room of the two models outside every pattern; their counts add up.
        ("slotproxy_window_available", other): 20_000, ("slotproxy_window_limit", other): 200_000,
        ("slotproxy_window_held_total", other): 7, ("slotproxy_window_hits_total", other): 1,
        ("slotproxy_window_available", requests): 50, ("slotproxy_window_limit", requests): math.nan,
        ("slotproxy_window_held_total", requests): 0, ("slotproxy_window_hits_total", requests): 0,
        ("slotproxy_window_available", team_a): 1_500_000, ("slotproxy_window_limit", team_a): 2_000_000,
        ("slotproxy_window_held_total", team_a): 0, ("slotproxy_window_hits_total", team_a): 0,
    }


def _same(found: dict[Any, float], expected: dict[Any, float]) -> bool:
    return found.keys() == expected.keys() and all(
        (math.isnan(value) and math.isnan(found[name])) or found[name] == value for name, value in expected.items())


def test_token_windows_are_series_by_provider_key_pattern_and_window() -> None:
    found = _series(Metrics(window_snapshot).render().decode())
    assert _same(found, _expected_windows()), found
    groups = {labels[2] for _, labels in found}
    assert groups == {"claude-sonnet-*", "other"}, "a model a client named is never a label value"


def test_no_window_series_without_windows() -> None:
    assert _series(Metrics(lambda: [_provider("openai")]).render().decode()) == {}


WORKER_SCRAPE = """
import sys
from proxy.http.metrics import Metrics
from tests.http.test_metrics import window_snapshot
sys.stdout.write(Metrics(window_snapshot, worker=0).render().decode())
"""


def test_a_worker_of_serve_workers_reads_the_windows_from_the_snapshot_at_the_scrape(tmp_path: Path) -> None:
    """Under ``serve --workers`` a scrape renders the host's files plus the snapshot's gauges: the windows are
    the snapshot's (the fleet's), not a count each worker keeps (its own process: the host's files change
    prometheus-client's values for the whole process)."""
    environ = {**os.environ, HOST_FILES_ENV: str(tmp_path), "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", WORKER_SCRAPE], cwd=REPO, env=environ, capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert list(tmp_path.glob("*.db")), "the scrape was the host's: this worker's counts went to its files"
    found = _series(result.stdout)
    assert _same(found, _expected_windows()), found


WORKER_COSTS = """
import sys
from proxy.http.metrics import Metrics
from proxy.ledger.store import LedgerRow
row = LedgerRow(0, "openai", None, "gpt-5", "default", False, None, "http", 200, "ok", 0, 1, 2, 10, 0, 0, 1, 0, 0, 0.25)
metrics = Metrics(lambda: [], worker=0)
metrics.count_tokens(row, "gpt-5*")
metrics.count_tokens(row._replace(cost_usd=0.5), "gpt-5*")
sys.stdout.write(metrics.render().decode())
"""


def test_costs_are_a_counter_per_provider_key_and_model_in_one_process_and_across_workers(tmp_path: Path) -> None:
    metrics = Metrics(list)
    metrics.count_tokens(_row("openai", "b", (10, 0, 0, 1, 0))._replace(cost_usd=0.125), "gpt-5*")
    metrics.count_tokens(_row("openai", "b", (10, 0, 0, 1, 0)), "gpt-5*")  # unpriced: no dollars
    assert 'slotproxy_cost_usd_total{key="b",model="gpt-5*",provider="openai"} 0.125' in metrics.render().decode()
    environ = {**os.environ, HOST_FILES_ENV: str(tmp_path), "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", WORKER_COSTS], cwd=REPO, env=environ, capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert 'slotproxy_cost_usd_total{key="",model="gpt-5*",provider="openai"} 0.75' in result.stdout
