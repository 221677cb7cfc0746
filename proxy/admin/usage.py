"""``GET /_slotproxy/usage``: what was spent, from the fleet's aggregates (Redis) or this replica's ledger."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiohttp import web

from ..http.answers import json_answer
from ..http.keys import STATE
from ..http.runtime import ProxyState
from ..ledger.report import (
    UsageQuery,
    answer,
    parse_query,
    queue_median_sql,
    totals_sql,
)

__all__ = ["usage", "usage_document"]


async def usage(request: web.Request) -> web.Response:
    """A read, like status: no admin token. A bad parameter is a 400 naming it (``AdminError``)."""
    return json_answer(await usage_document(request.app[STATE], request.query))


async def usage_document(state: ProxyState, params: Mapping[str, str]) -> dict[str, Any]:
    query = parse_query(params)
    fleet = await state.backend.fleet_usage(query)
    if fleet is not None:
        return fleet
    return await replica_usage(state, query)


async def replica_usage(state: ProxyState, query: UsageQuery) -> dict[str, Any]:
    """This replica's own ledger (empty, and saying so, when ``ledger.path`` is null)."""
    ledger = state.ledger
    totals = await ledger.query(*totals_sql(query))
    medians = await ledger.query(*queue_median_sql(query))
    document = answer(query, totals, medians, "replica")
    if not ledger.enabled:
        document["ledger"] = "off (ledger.path is null): nothing is recorded"
    return document
