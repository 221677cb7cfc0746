"""Small asyncio helpers shared by the long-lived background tasks."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, TypeVar

__all__ = ["cancel_and_wait", "result_if_any"]

_T = TypeVar("_T")


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel a background task and wait until it has finished unwinding."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def result_if_any(future: asyncio.Future[_T]) -> _T | None:
    """The value a future was resolved with, or None if it is pending, cancelled or failed.

    A waiter that leaves may have been granted in the same loop turn: this finds that grant."""
    if future.done() and not future.cancelled() and future.exception() is None:
        return future.result()
    return None
