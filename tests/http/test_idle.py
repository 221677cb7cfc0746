"""proxy.http.idle: the one-timer idle deadlines the relay puts on every upstream exchange (real loop, short timings)."""

from __future__ import annotations

import asyncio

import pytest

from proxy.http.idle import IdleWatch


async def _held(watches: IdleWatch, delay: float, touches: int, gap: float) -> str:
    watch = watches.watch(delay)
    try:
        for _ in range(touches):
            await asyncio.sleep(gap)
            watch.progress()
        return "finished"
    except asyncio.CancelledError:
        if not watch.absorbed():
            raise
        return "idle"
    finally:
        watch.close()


async def test_progress_keeps_an_exchange_alive_and_silence_ends_it() -> None:
    watches = IdleWatch()
    busy = asyncio.create_task(_held(watches, 0.2, touches=6, gap=0.08))  # 0.48 s in all, never 0.2 s quiet
    quiet = asyncio.create_task(_held(watches, 0.2, touches=1, gap=0.6))
    assert await busy == "finished"
    assert await quiet == "idle"
    assert len(watches) == 0


async def test_a_client_leaving_as_well_still_cancels() -> None:
    watches = IdleWatch()
    task = asyncio.create_task(_held(watches, 0.05, touches=1, gap=1.0))
    await asyncio.sleep(0.02)
    task.cancel()  # the client left...
    await asyncio.sleep(0.05)  # ...and the watch fires too
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_closed_exchanges_are_dropped_not_kept() -> None:
    watches = IdleWatch()
    for _ in range(1000):
        watches.watch(300.0).close()
    assert len(watches) == 0
    assert len(watches._deadlines) <= 64 + 1


async def test_fire_is_the_watchdogs_abort() -> None:
    watches = IdleWatch()

    async def exchange() -> str:
        watch = watches.watch(300.0)
        asyncio.get_running_loop().call_later(0.05, watch.fire)
        try:
            await asyncio.sleep(5)
            return "finished"
        except asyncio.CancelledError:
            return "aborted" if watch.absorbed() else "cancelled"
        finally:
            watch.close()

    assert await asyncio.wait_for(exchange(), 2) == "aborted"
