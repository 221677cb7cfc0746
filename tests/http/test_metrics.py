"""The per-request counters as ``/metrics`` shows them."""

from __future__ import annotations

from proxy.http.metrics import Metrics
from proxy.ledger.store import LedgerRow


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
