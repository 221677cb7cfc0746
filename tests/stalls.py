"""A test that stalls is stopped and shows where its tasks were waiting, instead of holding the suite.

An asyncio test stuck on an await that never ends (a future nobody resolves) leaves its worker idle in the
event loop's select for ever, and the traceback of a thread shows nothing of the coroutines. Past
``STALL_LIMIT`` seconds this stops the loop the test runs on (``run_until_complete`` then fails the test)
after writing the stack of each of its tasks to stderr, which pytest shows with the failure.
"""

from __future__ import annotations

import asyncio
import io
import os
import sys
import threading
import time
from collections.abc import Iterator

import pytest

STALL_LIMIT = float(os.environ.get("SLOTPROXY_TEST_STALL_LIMIT", "240"))
"""Seconds one test may run; the slowest take about a minute."""

_loops: list[asyncio.AbstractEventLoop] = []
_running: dict[str, object] = {}
_run_forever = asyncio.BaseEventLoop.run_forever


def _noting_the_loop(self: asyncio.BaseEventLoop) -> None:
    _loops[:] = [self]
    _run_forever(self)


def _awaiting(task: asyncio.Task[object]) -> Iterator[str]:
    """Where a suspended task waits, outermost first: its coroutine and every coroutine it awaits in turn
    (``Task.print_stack`` shows only the outermost)."""
    awaited: object = task.get_coro()
    while awaited is not None:
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "ag_frame", None) or \
            getattr(awaited, "gi_frame", None)
        if frame is not None:
            yield f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "ag_await", None) or \
            getattr(awaited, "gi_yieldfrom", None)


def _dump_and_stop(loop: asyncio.AbstractEventLoop, test: object) -> None:
    out = io.StringIO()
    out.write(f"{test} ran past {STALL_LIMIT:g} s; its tasks:\n")
    for task in asyncio.all_tasks(loop):
        out.write(f"--- {task!r}\n")
        out.writelines(f"{line}\n" for line in _awaiting(task))
    sys.stderr.write(out.getvalue())
    loop.stop()


def _watch() -> None:
    while True:
        time.sleep(1.0)
        started, test = _running.get("started"), _running.get("test")
        if isinstance(started, float) and time.monotonic() - started > STALL_LIMIT and _loops:
            _running.clear()
            loop = _loops[0]
            if loop.is_running():
                loop.call_soon_threadsafe(_dump_and_stop, loop, test)


asyncio.BaseEventLoop.run_forever = _noting_the_loop  # type: ignore[method-assign]
threading.Thread(target=_watch, name="stall-watch", daemon=True).start()


def _timed(phase: str, item: pytest.Item) -> Iterator[None]:
    _running.update(started=time.monotonic(), test=f"{item.nodeid} ({phase})")
    try:
        yield
    finally:
        _running.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    yield from _timed("setup", item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    yield from _timed("call", item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    yield from _timed("teardown", item)
