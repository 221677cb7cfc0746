"""Token windows through the backends: the memory backend holds an acquire until its window has room; the
Redis backend refuses a cost in words (wave one holds windows in memory only)."""

from __future__ import annotations

import asyncio

import pytest

from proxy.backends import MemoryBackend
from proxy.backends.redis import RedisBackend
from proxy.errors import WindowsUnsupported
from proxy.limiter import FakeClock, LimiterSettings, Priority, WindowSettings

from .conftest import REDIS_URL, require_redis

pytestmark = pytest.mark.asyncio

T0 = 1_700_000_000.0
ITPM = "input_tokens_per_minute"


def memory(windows: WindowSettings | None) -> tuple[MemoryBackend, FakeClock]:
    clock = FakeClock(T0)
    backend = MemoryBackend(clock)
    backend.configure({"p": LimiterSettings(limit=4, windows=windows, queue_timeout=None, slot_timeout=None)},
                      frozenset())
    return backend, clock


def rows(backend: MemoryBackend) -> dict[tuple[str, str], dict[str, object]]:
    return {(row["group"], row["window"]): row for row in backend.provider_status("p").to_dict()["windows"]}


async def test_an_acquire_held_by_its_window_is_granted_when_the_window_refills() -> None:
    backend, clock = memory(WindowSettings(provider={ITPM: 600}))
    first = await backend.acquire("p", Priority(T0), cost={ITPM: 600}, group="opus")
    assert first.cost == {ITPM: 600}
    held = asyncio.create_task(backend.acquire("p", Priority(T0), cost={ITPM: 60}, group="opus"))
    await asyncio.sleep(0)
    other = await backend.acquire("p", Priority(T0), cost={ITPM: 60}, group="sonnet")
    assert other.group == "sonnet" and not held.done()
    assert rows(backend)[("opus", ITPM)]["held"] == 1
    clock.advance(6.1)
    lease = await asyncio.wait_for(held, 1)
    assert lease.group == "opus"
    backend.settle_windows("p", lease, {ITPM: 10}, {ITPM: "give_back"})
    assert rows(backend)[("opus", ITPM)]["available"] in (50, 51)  # 50 given back, 1 refilled since
    assert rows(backend)[("opus", ITPM)]["reserved"] == 660  # both opus requests are still held


async def test_a_client_leaving_while_held_takes_nothing() -> None:
    backend, clock = memory(WindowSettings(provider={ITPM: 600}))
    await backend.acquire("p", Priority(T0), cost={ITPM: 600}, group="opus")
    held = asyncio.create_task(backend.acquire("p", Priority(T0), cost={ITPM: 300}, group="opus"))
    await asyncio.sleep(0)
    held.cancel()
    with pytest.raises(asyncio.CancelledError):
        await held
    clock.advance(60)
    status = backend.provider_status("p")
    assert (status.queued, status.in_flight) == (0, 1)
    assert status.to_dict()["windows"][0]["available"] == 600


async def test_without_windows_a_cost_changes_nothing() -> None:
    backend, clock = memory(None)
    leases = [await backend.acquire("p", Priority(T0), cost={ITPM: 10**9}, group="opus") for _ in range(4)]
    assert all(lease.cost is None for lease in leases)
    assert "windows" not in backend.provider_status("p").to_dict()
    assert clock.timers_set == 0


async def test_the_redis_backend_refuses_a_cost_in_words(key_prefix: str) -> None:
    require_redis()
    backend = RedisBackend(REDIS_URL, key_prefix=key_prefix, lease_ttl=2.0)
    await backend.start()
    try:
        backend.configure({"p": LimiterSettings(limit=2)}, frozenset())
        await backend.flush()
        with pytest.raises(WindowsUnsupported, match="memory"):
            await backend.acquire("p", Priority(T0), cost={ITPM: 10}, group="opus")
        lease = await backend.acquire("p", Priority(T0))
        assert lease.cost is None
        lease.release()
    finally:
        await backend.close()
