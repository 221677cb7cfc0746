"""Prices, the ledger's ``cost_usd`` column on an older file, the fleet's cost aggregates, the day's spend, and the
config's ``prices`` and ``spend_per_day_usd`` rules. Pure and fast: no proxy."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime
from pathlib import Path

import pytest
from genai_prices import Usage, calc_price

from proxy.config.loader import parse_config
from proxy.errors import ConfigError
from proxy.ledger.fleet import FleetUsage
from proxy.ledger.prices import DAY_MS, PriceTable
from proxy.ledger.report import UsageQuery
from proxy.ledger.spend import DailySpend
from proxy.ledger.store import LedgerRow
from proxy.ledger.writer import COLUMNS, Writer

PROVIDERS = {"openai": ("http://127.0.0.1:9/v1", "openai"), "anthropic": ("http://127.0.0.1:9", "anthropic")}


def ms(year: int, month: int, day: int) -> int:
    return int(datetime(year, month, day, 12, tzinfo=UTC).timestamp() * 1000)


def published(model: str, provider: str, when: int, **usage: int) -> float:
    return float(calc_price(Usage(**usage), model, provider_id=provider,
                            genai_request_timestamp=datetime.fromtimestamp(when / 1000, tz=UTC)).total_price)


def test_a_tiered_price_applies_past_its_threshold_and_the_request_s_date_picks_the_price() -> None:
    """claude-opus-4-6 was priced in two tiers (200k input tokens) until 2026-03-13, flat after."""
    table = PriceTable(providers=PROVIDERS)
    big = (300_000, 20_000, 10_000, 2_000, 0)
    for when in (ms(2026, 3, 1), ms(2026, 4, 1)):
        cost = table.cost("anthropic", "claude-opus-4-6", big, when)
        assert cost == pytest.approx(published("claude-opus-4-6", "anthropic", when, input_tokens=300_000,
                                               cache_read_tokens=20_000, cache_write_tokens=10_000,
                                               output_tokens=2_000), rel=1e-9)
    tiered, flat = (table.cost("anthropic", "claude-opus-4-6", big, when) for when in (ms(2026, 3, 1), ms(2026, 4, 1)))
    assert tiered is not None and flat is not None and tiered > flat
    small = (1_000, 0, 0, 100, 0)
    assert table.cost("anthropic", "claude-opus-4-6", small, ms(2026, 3, 1)) == pytest.approx(
        published("claude-opus-4-6", "anthropic", ms(2026, 3, 1), input_tokens=1_000, output_tokens=100))


def test_configured_patterns_come_first_and_a_cache_price_left_out_costs_the_input_price() -> None:
    config = parse_config("prices:\n  'gpt-4o*': {input: 1.0, output: 2.0}\n  '*': {input: 9, output: 9}\n")
    table = PriceTable(config.prices, PROVIDERS)
    assert table.cost("openai", "gpt-4o", (1000, 400, 0, 10, 5), ms(2026, 6, 1)) == pytest.approx(
        (600 * 1.0 + 400 * 1.0 + 10 * 2.0) / 1e6)
    assert table.cost("openai", "anything", (1, 0, 0, 1, 0), ms(2026, 6, 1)) == pytest.approx(18 / 1e6)
    assert table.cost("openai", None, (1, 0, 0, 1, 0), ms(2026, 6, 1)) is None
    assert PriceTable(providers=PROVIDERS).cost("openai", "no-such-model-9", (1, 0, 0, 1, 0), ms(2026, 6, 1)) is None


def test_an_older_ledger_gains_the_cost_column_in_place(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    old_columns = COLUMNS[:-1]
    with sqlite3.connect(path) as connection:
        connection.execute(f"CREATE TABLE requests ({', '.join(old_columns)})")
        connection.execute(f"INSERT INTO requests VALUES ({', '.join('?' * len(old_columns))})",
                           (1, "openai", None, "m", "w", 0, None, "http", 200, "ok", 0, 1, 2, 1, 0, 0, 1, 0, 0))
    writer = Writer(str(path))
    try:
        writer.write([(2, "openai", None, "m", "w", 0, None, "http", 200, "ok", 0, 1, 2, 1, 0, 0, 1, 0, 0, 0.25)],
                     now=0.0, retention=1e9)
        assert writer.read("SELECT ended_at, cost_usd FROM requests ORDER BY ended_at", []) == [(1, None), (2, 0.25)]
    finally:
        writer.close()
    Writer(str(path)).close()  # opened again: nothing left to add
    assert list(path.parent.glob("*.sqlite")) == [path], "a migration, not a new file"


def test_the_fleet_keeps_costs_in_nano_dollars_and_a_day_of_spend_per_workspace() -> None:
    sums = FleetUsage("p", 86400.0)
    now = ms(2026, 6, 1)
    base = LedgerRow(now, "openai", None, "gpt-4o", "web", False, None, "http", 200, "ok", 0, 1, 2, 10, 0, 0, 1, 0)
    sums.add(base._replace(cost_usd=0.1))
    sums.add(base._replace(cost_usd=0.2))
    sums.add(base._replace(cost_usd=None, model="unknown"))
    writes = dict(sums.take())
    day = now // DAY_MS * DAY_MS
    spend = writes.pop(f"{{p:openai}}:spend:{day}")
    assert spend[1:] == ["web", 300_000_000]
    ((_, args),) = writes.items()
    fields = dict(zip(args[1::2], args[2::2], strict=True))
    answer = FleetUsage.answer(UsageQuery(since=now - 1, until=now + 1, by=("model",)),
                               [("openai", day, {name: str(value) for name, value in fields.items()})])
    by_model = {row["model"]: row for row in answer["rows"]}
    assert by_model["gpt-4o"]["cost_usd"] == pytest.approx(0.3) and by_model["gpt-4o"]["unpriced"] == 0
    assert by_model["unknown"]["unpriced"] == 1 and by_model["unknown"]["cost_usd"] == 0
    assert FleetUsage.day_spend([{"web": "300000000"}, {"web": "100000000", "docs": "5"}]) == {
        "web": pytest.approx(0.4), "docs": pytest.approx(5e-9)}


def test_the_day_s_spend_starts_again_at_midnight_utc_and_a_read_replaces_what_was_counted() -> None:
    now = [ms(2026, 6, 1) / 1000]
    spend = DailySpend({"*": 1.0, "web": 2.0}, clock=lambda: now[0])
    spend.add("web", 1.5, int(now[0] * 1000))
    assert spend.refusal("web", "openai", "openai") is None
    taken = spend.read_started()
    spend.add("web", 0.25, int(now[0] * 1000))  # during the read: not in it
    spend.read_done({"web": 1.5, "docs": 1.0}, spend.day)
    assert spend.spent("web") == pytest.approx(1.75)
    refusal = spend.refusal("docs", "anthropic", "anthropic")
    assert refusal is not None and refusal.body()["error"]["type"] == "spend_limit_reached"  # type: ignore[index]
    assert taken == {"web": 1.5}
    now[0] += 86400
    assert spend.spent("web") == 0 and spend.refusal("docs", "openai", "openai") is None


@pytest.mark.parametrize(("yaml_text", "words"), [
    ("prices:\n  'gpt-*': {input: -1, output: 1}\n", "prices.gpt-*.input: must be an amount of US dollars"),
    ("prices:\n  'gpt-*': {input: 1}\n", "prices.gpt-*.output"),
    ("prices:\n  '': {input: 1, output: 1}\n", "prices"),
    ("prices:\n  'gpt-*': {input: 1, output: 1, cache: 1}\n", "cache"),
    ("workspaces:\n  spend_per_day_usd: {web: -5}\n", "workspaces.spend_per_day_usd.web: must be an amount"),
    ("workspaces:\n  spend_per_day_usd: {'*': true}\n", "must be an amount of US dollars"),
])
def test_check_refuses_negative_prices_and_caps_and_bad_patterns(yaml_text: str, words: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config("providers:\n  openai: {upstream: 'https://api.openai.com'}\n" + yaml_text)
    assert words in str(raised.value)
