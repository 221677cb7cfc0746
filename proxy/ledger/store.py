"""The ledger: one row per request that reached routing, in an embedded SQLite database.

The event loop only appends a row to a list (no I/O, no lock). One writer
thread takes what has gathered at most once a second and writes it in one
transaction (WAL mode, so readers never wait for it); the same thread deletes
rows older than ``retention`` once an hour and answers the usage queries, so
the database is only ever touched from that thread.

A ledger that cannot be written (disk full, file locked, folder gone) never
fails or delays a request: the rows of a failed write are dropped and counted,
and the failure is logged at most once a minute. What is pending at shutdown is
written before the process exits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from ..aio import cancel_and_wait
from ..logs import ThrottledLog

__all__ = ["COLUMNS", "OUTCOMES", "TOKEN_COLUMNS", "Ledger", "LedgerRow"]

log = logging.getLogger("slotproxy.ledger")

TOKEN_COLUMNS = ("input_tokens", "cached_input_tokens", "cache_write_tokens", "output_tokens", "reasoning_tokens")
COLUMNS = ("ended_at", "provider", "key", "model", "workspace", "starred", "conversation", "transport", "status",
           "outcome", "queue_ms", "ttfb_ms", "duration_ms", *TOKEN_COLUMNS, "retries")
OUTCOMES = ("ok", "client_gone", "upstream_error", "timeout", "rejected")
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS requests (
    ended_at INTEGER NOT NULL, provider TEXT NOT NULL, key TEXT, model TEXT, workspace TEXT NOT NULL,
    starred INTEGER NOT NULL, conversation TEXT, transport TEXT NOT NULL, status INTEGER NOT NULL,
    outcome TEXT NOT NULL, queue_ms INTEGER NOT NULL, ttfb_ms INTEGER, duration_ms INTEGER NOT NULL,
    {", ".join(f"{name} INTEGER" for name in TOKEN_COLUMNS)}, retries INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS requests_ended_at ON requests (ended_at);
"""
_INSERT = f"INSERT INTO requests ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"
_ROWS_PER_INSERT = 50
"""Rows one INSERT statement carries: the writer gives the GIL back and takes it again around each statement, so
a second's batch is a few dozen statements, not a thousand (the event loop waits for the GIL each time)."""
_INSERT_MANY = _INSERT + f", ({', '.join('?' * len(COLUMNS))})" * (_ROWS_PER_INSERT - 1)
_FLUSH_EVERY = 1.0
_PRUNE_EVERY = 3600.0
_MAX_PENDING = 200_000
"""Rows kept waiting while the writer is behind; past this the newest are dropped (and counted)."""
_FAILURE_LOG_EVERY = 60.0


class LedgerRow(NamedTuple):
    """One request as it ended (see the SPEC's ledger: no bodies, no headers, no secrets)."""

    ended_at: int
    provider: str
    key: str | None
    model: str | None
    workspace: str
    starred: bool
    conversation: str | None
    transport: str
    status: int
    outcome: str
    queue_ms: int
    ttfb_ms: int | None
    duration_ms: int
    input_tokens: int | None = None
    cached_input_tokens: int | None = None
    cache_write_tokens: int | None = None
    output_tokens: int | None = None
    reasoning_tokens: int | None = None
    retries: int = 0


class Ledger:
    """The rows of this process, written to ``path`` (None: the ledger is off and ``record`` does nothing)."""

    def __init__(self, path: Path | None, retention: float, *, on_dropped: Callable[[int], None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.retention = retention
        self.dropped = 0
        self._on_dropped = on_dropped
        self._clock = clock
        self._pending: list[LedgerRow] = []
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._connection: sqlite3.Connection | None = None
        self._task: asyncio.Task[None] | None = None
        self._pruned_at = 0.0
        self._failures = ThrottledLog(log, logging.ERROR, f"the ledger at {path} could not be written (%s): %d "
                                      "row(s) dropped so far; requests are served as usual",
                                      interval=_FAILURE_LOG_EVERY)

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def record(self, row: LedgerRow) -> None:
        """Keep a row for the next write (on the event loop: an append, nothing else)."""
        if self.path is None:
            return
        if len(self._pending) >= _MAX_PENDING:
            self._drop(1, "the writer is behind")
            return
        self._pending.append(row)

    async def start(self) -> None:
        """Open the database (in the writer thread) and start writing; an unwritable ledger is logged and its
        rows dropped, never fatal."""
        if self.path is None:
            return
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="slotproxy-ledger")
        try:
            await self._in_writer(self._open)
        except (sqlite3.Error, OSError) as exc:
            self._failures.event(_words(exc), self.dropped)
        self._task = asyncio.get_running_loop().create_task(self._write_every_second())

    async def close(self) -> None:
        """Write what is pending (SIGTERM), then close the database."""
        if self._executor is None:
            return
        await cancel_and_wait(self._task)
        self._task = None
        await self.flush()
        await self._in_writer(self._close)
        self._executor.shutdown(wait=True)
        self._executor = None

    async def flush(self) -> None:
        """Write the rows gathered so far (a test's or shutdown's; the loop does it every second)."""
        batch, self._pending = self._pending, []
        if not batch or self._executor is None:
            return
        try:
            await self._in_writer(self._write, batch)
        except (sqlite3.Error, OSError) as exc:
            self._drop(len(batch), _words(exc))

    async def query(self, sql: str, parameters: Sequence[Any]) -> list[tuple[Any, ...]]:
        """Run a read in the writer thread (after what is pending is written)."""
        if self.path is None or self._executor is None:
            return []
        await self.flush()
        return await self._in_writer(self._read, sql, parameters)

    async def _write_every_second(self) -> None:
        while True:
            await asyncio.sleep(_FLUSH_EVERY)
            await self.flush()

    async def _in_writer(self, job: Callable[..., Any], *args: Any) -> Any:
        assert self._executor is not None
        return await asyncio.get_running_loop().run_in_executor(self._executor, job, *args)

    def _drop(self, count: int, why: str) -> None:
        self.dropped += count
        if self._on_dropped is not None:
            self._on_dropped(count)
        self._failures.event(why, self.dropped)

    # ----- in the writer thread ----------------------------------------------------------------

    def _open(self) -> None:
        assert self.path is not None
        connection = sqlite3.connect(self.path, timeout=0.5, isolation_level=None, check_same_thread=True)
        try:
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=NORMAL")
            connection.executescript(_SCHEMA)
        except sqlite3.Error:
            connection.close()
            raise
        self._connection = connection

    def _connected(self) -> sqlite3.Connection:
        if self._connection is None:
            self._open()
        assert self._connection is not None
        return self._connection

    def _write(self, batch: list[LedgerRow]) -> None:
        connection = self._connected()
        with connection:
            connection.execute("BEGIN")
            whole = len(batch) - len(batch) % _ROWS_PER_INSERT
            for start in range(0, whole, _ROWS_PER_INSERT):
                connection.execute(_INSERT_MANY, tuple(itertools.chain.from_iterable(
                    batch[start:start + _ROWS_PER_INSERT])))
            if whole < len(batch):
                connection.executemany(_INSERT, batch[whole:])
        now = self._clock()
        if now - self._pruned_at >= _PRUNE_EVERY:
            self._pruned_at = now
            with connection:
                connection.execute("DELETE FROM requests WHERE ended_at < ?", (int((now - self.retention) * 1000),))

    def _read(self, sql: str, parameters: Sequence[Any]) -> list[tuple[Any, ...]]:
        return list(self._connected().execute(sql, tuple(parameters)))

    def _close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


def _words(exc: BaseException) -> str:
    """An SQLite or OS error in words (its message), never a class name alone."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or "unknown error"
