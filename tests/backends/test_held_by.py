"""What held a queued request, as its lease names it for the queue span, one suite on every backend: the memory
limiter's words and the Redis scripts' (their ``what_holds`` and the windows a grant names, put in words by
``limiter.holding``) held to the same literals, for the provider's limit and pause, the keys of a pool, a model
cap, a pinned key and a token window."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from proxy.limiter import (
    KeySettings,
    LimiterSettings,
    ModelCap,
    Priority,
    SlotLease,
    WindowSettings,
)

from .test_behaviour import queued

pytestmark = pytest.mark.asyncio

ITPM = "input_tokens_per_minute"
FAST = 60_000
"""A window of 60,000 a minute refills 1,000 a second."""
POOL = (KeySettings("a", 1), KeySettings("b", 1))


def prio() -> Priority:
    return Priority(prompt_started_at=time.time())


async def setup(backend: Any, **settings: Any) -> None:
    backend.configure({"p": LimiterSettings(**{"queue_timeout": None, "slot_timeout": None, **settings})},
                      frozenset())
    await backend.flush()


async def take(backend: Any, **request: Any) -> SlotLease:
    return await asyncio.wait_for(backend.acquire("p", prio(), **request), 5)


async def queue_then_grant(backend: Any, holding: SlotLease | None, **request: Any) -> str | None:
    """A request queued behind ``holding`` (None: held by time, a pause or a window), granted once it lets go."""
    waiting = asyncio.create_task(backend.acquire("p", prio(), **request))
    await queued(backend, 1)
    assert not waiting.done()
    if holding is not None:
        holding.release()
    lease = await asyncio.wait_for(waiting, 5)
    lease.release()
    return getattr(lease, "holder", None)


async def test_a_request_that_went_straight_through_names_no_holder(backend) -> None:
    await setup(backend, limit=1)
    lease = await take(backend)
    assert getattr(lease, "holder", None) is None


async def test_the_provider_limit(backend) -> None:
    await setup(backend, limit=1)
    assert await queue_then_grant(backend, await take(backend)) == "provider limit"


async def test_the_provider_paused(backend) -> None:
    await setup(backend, limit=4)
    backend.report_backoff("p", "429", 0.3, time.time(), reduce=False)
    await backend.flush()
    assert await queue_then_grant(backend, None) == "provider paused"


async def test_every_key_of_the_pool(backend) -> None:
    await setup(backend, limit=4, keys=POOL)
    first, _ = await take(backend), await take(backend)
    assert await queue_then_grant(backend, first) == "keys"


async def test_a_model_cap(backend) -> None:
    await setup(backend, limit=4, models=(ModelCap("opus-*", 1),))
    assert await queue_then_grant(backend, await take(backend, model="opus-4"), model="opus-4") == "model opus-*"


async def test_the_key_a_request_is_pinned_to(backend) -> None:
    await setup(backend, limit=4, keys=POOL)
    on_a = await take(backend, key="a")
    assert on_a.key == "a"
    assert await queue_then_grant(backend, on_a, key="a") == "key a"


async def test_a_token_window(backend) -> None:
    await setup(backend, limit=4, windows=WindowSettings(provider={ITPM: FAST}))
    (await take(backend, cost={ITPM: FAST}, group="opus")).release()
    assert await queue_then_grant(backend, None, cost={ITPM: 300}, group="opus") == f"window {ITPM}"


async def test_the_token_windows_of_a_pool_name_their_keys(backend) -> None:
    await setup(backend, limit=4, keys=POOL, windows=WindowSettings(provider={ITPM: FAST}))
    for key in ("a", "b"):
        (await take(backend, key=key, cost={ITPM: FAST}, group="opus")).release()
    assert await queue_then_grant(backend, None, cost={ITPM: 300}, group="opus") == \
        f"window {ITPM} (key a), {ITPM} (key b)"


async def test_a_window_that_held_it_last_is_named_over_the_limit_that_held_it_first(backend) -> None:
    await setup(backend, limit=1, windows=WindowSettings(provider={ITPM: FAST}))
    first = await take(backend, cost={ITPM: FAST}, group="opus")
    assert await queue_then_grant(backend, first, cost={ITPM: 300}, group="opus") == f"window {ITPM}"
