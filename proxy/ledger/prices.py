"""What a request cost in US dollars: its token counts times its model's prices.

A model's prices come from the config's ``prices`` (the first pattern the model
matches), else from the ``genai-prices`` package's bundled data for the provider
and model, as they stood on the request's date (UTC); else the cost is unknown
(None), never guessed. The package's data is read from the copy installed with
it: its network update is never started.

A request pays a dict lookup and a few multiplications: the rates are resolved
once per (provider, model) and day, the first time a request names the model
that day, and kept as floats. A tiered price (Anthropic's long
context, say) is kept as one set of rates per threshold of total input tokens:
past a threshold every token costs that tier's rate, as the provider bills it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from fnmatch import fnmatchcase
from typing import Any, NamedTuple

__all__ = ["DAY_MS", "PriceTable", "Rates", "genai_prices_version", "warm_up"]

log = logging.getLogger("slotproxy.ledger")

DAY_MS = 86_400_000
_MINUTE_MS = 60_000
_MILLION = 1_000_000.0
_MAX_CACHED = 4096
"""(provider, model) pairs kept; past this the table is emptied (a client naming endless models)."""


class Rates(NamedTuple):
    """US dollars per million tokens: ``input`` for uncached input, then cache reads, cache writes and output
    (reasoning is output). ``tiers``: (threshold, rates) from the highest threshold down, applying when the
    request's total input tokens exceed the threshold."""

    input: float
    cache_read: float
    cache_write: float
    output: float
    tiers: tuple[tuple[int, Rates], ...] = ()

    def cost(self, counts: Sequence[int]) -> float:
        """``counts``: the ledger's five token counts (input all input, cached reads and writes part of it)."""
        total_in, cached, written, output = counts[0], counts[1], counts[2], counts[3]
        rates = self
        for threshold, tier in self.tiers:
            if total_in > threshold:
                rates = tier
                break
        uncached = max(0, total_in - cached - written)
        return (uncached * rates.input + cached * rates.cache_read
                + written * rates.cache_write + output * rates.output) / _MILLION


class PriceTable:
    """The prices in force: the config's patterns, then the genai-prices data.

    ``providers`` maps each provider's name to the genai-prices providers to look its models up under (its
    upstream URL's provider first, then its dialect's)."""

    def __init__(self, prices: Mapping[str, Any] | None = None,
                 providers: Mapping[str, tuple[str | None, str]] | None = None) -> None:
        self._configured: tuple[tuple[str, Rates], ...] = ()
        self._providers: dict[str, tuple[str | None, str]] = {}
        self._cache: dict[tuple[str, str], tuple[Rates | None, int, int]] = {}
        """(provider, model) -> (rates, from, until): the rates in force from ``from`` until ``until`` (epoch ms)."""
        self.configure(prices or {}, providers or {})

    def configure(self, prices: Mapping[str, Any], providers: Mapping[str, tuple[str | None, str]]) -> None:
        """``prices``: pattern -> an object with ``input``, ``output``, ``cache_read``, ``cache_write`` (USD per
        million tokens; a cache price left None costs what input costs)."""
        self._configured = tuple((pattern, _configured_rates(price)) for pattern, price in prices.items())
        self._providers = dict(providers)
        self._cache = {}

    def cost(self, provider: str, model: str | None, counts: Sequence[int], now_ms: int) -> float | None:
        """The cost of one request's counts, or None when its model has no known price."""
        if model is None:
            return None
        entry = self._cache.get((provider, model))
        if entry is None or not entry[1] <= now_ms < entry[2]:
            entry = self._resolve(provider, model, now_ms)
        rates = entry[0]
        return None if rates is None else rates.cost(counts)

    def rates(self, provider: str, model: str, now_ms: int) -> Rates | None:
        """The rates a request naming ``model`` pays now (None: no known price)."""
        return self._resolve(provider, model, now_ms)[0]

    def _resolve(self, provider: str, model: str, now_ms: int) -> tuple[Rates | None, int, int]:
        since = now_ms // DAY_MS * DAY_MS
        until = since + DAY_MS
        rates = next((rates for pattern, rates in self._configured if fnmatchcase(model, pattern)), None)
        if rates is None:
            rates, by_the_minute = _published(self._providers.get(provider, (None, provider)), model, now_ms)
            if by_the_minute:
                since = now_ms // _MINUTE_MS * _MINUTE_MS
                until = since + _MINUTE_MS
        if len(self._cache) >= _MAX_CACHED:
            self._cache = {}
        entry = self._cache[(provider, model)] = (rates, since, until)
        return entry


def _configured_rates(price: Any) -> Rates:
    input_rate = float(price.input)
    cache_read = input_rate if price.cache_read is None else float(price.cache_read)
    cache_write = input_rate if price.cache_write is None else float(price.cache_write)
    return Rates(input_rate, cache_read, cache_write, float(price.output))


# --- the genai-prices data ----------------------------------------------------------------------------------

_loading = threading.Lock()


def warm_up() -> None:
    """Load the package's data in a thread, so the first request that needs it does not wait for the import."""
    threading.Thread(target=_snapshot, name="slotproxy-prices", daemon=True).start()


def _snapshot() -> Any:
    with _loading:
        from genai_prices import data_snapshot

        return data_snapshot.get_snapshot()


def genai_prices_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("genai-prices")
    except PackageNotFoundError:  # every price must then come from the config
        return None


def _published(ids: tuple[str | None, str], model: str, now_ms: int) -> tuple[Rates | None, bool]:
    """The genai-prices rates of ``model`` under the first of ``ids`` (an upstream URL, a provider id) that
    knows it, as of ``now_ms``; and whether they change with the time of day (an off-peak price), so hold
    for the minute only (else for the day)."""
    try:
        snapshot = _snapshot()
    except ImportError:
        return None, False
    from genai_prices.types import TieredPrices, TimeOfDateConstraint

    url, provider_id = ids
    found = None
    for by_id, by_url in ((None, url), (provider_id, None)):
        if by_id is None and by_url is None:
            continue
        try:
            found = snapshot.find_provider_model(model, None, by_id, by_url)
            break
        except LookupError:
            continue
    if found is None:
        return None, False
    info = found[1]
    price = info.get_prices(datetime.fromtimestamp(now_ms / 1000, tz=UTC))
    by_the_minute = isinstance(info.prices, list) and any(
        isinstance(conditional.constraint, TimeOfDateConstraint) for conditional in info.prices)
    names = ("input_mtok", "cache_read_mtok", "cache_write_mtok", "output_mtok")
    values = [getattr(price, name, None) for name in names]
    if values[0] is None or values[3] is None:
        return None, by_the_minute
    values = [values[0] if value is None else value for value in values]
    thresholds = sorted({tier.start for value in values if isinstance(value, TieredPrices) for tier in value.tiers},
                        reverse=True)

    def at(total_input: int | None) -> Rates:
        rates = [_rate(value, total_input) for value in values]
        return Rates(rates[0], rates[1], rates[2], rates[3])

    return at(None)._replace(tiers=tuple((threshold, at(threshold + 1)) for threshold in thresholds)), by_the_minute


def _rate(value: Any, total_input: int | None) -> float:
    """A price per million tokens; a tiered one as it applies to ``total_input`` tokens (None: the base)."""
    from genai_prices.types import TieredPrices

    if not isinstance(value, TieredPrices):
        return float(value)
    applicable = value.base
    if total_input is not None:
        for tier in reversed(value.tiers):
            if total_input > tier.start:
                applicable = tier.price
                break
    return float(applicable)
