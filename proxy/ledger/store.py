"""The ledger: one row per request that reached routing, in an embedded SQLite database.

The event loop only appends a row to a list (no I/O, no lock), and every
``_PACK_EVERY`` rows pickles what gathered into one chunk of bytes: thousands of
rows held as objects until the next write would set off the garbage collector's
young passes every few hundred requests. At most once a second the chunks go to
the writer, a process of its own
(:mod:`proxy.ledger.writer`), which writes it in one transaction (WAL mode, so
readers never wait for it), deletes rows older than ``retention`` once an hour
and answers the usage queries, so the database is only ever touched there. The
workers of ``serve --workers`` each have such a writer, all on the host's one file
(see :mod:`proxy.ledger.writer`), so a usage query on any of them reads every
worker's rows (another worker's last second of rows once it has written them).

A ledger that cannot be written (disk full, file locked, folder gone, the writer
process killed) never fails or delays a request: the rows of a failed write are
dropped and counted, and the failure is logged at most once a minute. What is
pending at shutdown is written before the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from ..aio import cancel_and_wait
from ..logs import ThrottledLog
from .writer import COLUMNS, HEADER, TOKEN_COLUMNS, payload_size, write_frame

__all__ = ["COLUMNS", "OUTCOMES", "TOKEN_COLUMNS", "Ledger", "LedgerRow", "LedgerWriteError"]

log = logging.getLogger("slotproxy.ledger")

OUTCOMES = ("ok", "client_gone", "upstream_error", "timeout", "rejected")
_FLUSH_EVERY = 1.0
_MAX_PENDING = 200_000
"""Rows kept waiting while the writer is behind; past this the newest are dropped (and counted)."""
_PACK_EVERY = 256
"""Rows kept as objects before they are pickled into a chunk: fewer than the collector's young threshold
(``http.heap.YOUNG_PASS_AFTER``), so rows waiting for their write start no collection."""
_FAILURE_LOG_EVERY = 60.0
_WRITER_EXIT_WAIT = 5.0
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


class LedgerWriteError(Exception):
    """The writer could not do what it was asked; the message says what happened, in words."""


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
    cost_usd: float | None = None
    """Its tokens priced (``proxy.ledger.prices``); None when the tokens or the model's price are unknown."""


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
        self._packed: list[bytes] = []
        """Earlier rows waiting for the next write, pickled ``_PACK_EVERY`` at a time (``_pack``)."""
        self._packed_rows = 0
        self._writer: asyncio.subprocess.Process | None = None
        self._talking = asyncio.Lock()
        self._started = False
        self._task: asyncio.Task[None] | None = None
        self._failures = ThrottledLog(log, logging.ERROR, f"the ledger at {path} could not be written (%s): %d "
                                      "row(s) dropped so far; requests are served as usual",
                                      interval=_FAILURE_LOG_EVERY)

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def record(self, row: LedgerRow) -> None:
        """Keep a row for the next write (on the event loop: an append, and a pickle every ``_PACK_EVERY`` rows)."""
        if self.path is None:
            return
        pending = self._pending
        pending.append(row)
        if len(pending) >= _PACK_EVERY:
            if self._packed_rows >= _MAX_PENDING:
                self._drop(len(pending), "the writer is behind")
                self._pending = []
                return
            self._pack()

    def _pack(self) -> None:
        """The rows gathered so far, pickled as one chunk (as plain tuples: pickled several times faster than
        the named ones)."""
        batch, self._pending = self._pending, []
        self._packed.append(pickle.dumps([tuple(row) for row in batch], protocol=pickle.HIGHEST_PROTOCOL))
        self._packed_rows += len(batch)

    async def start(self) -> None:
        """Start the writer and open the database there; an unwritable ledger is logged and its rows dropped,
        never fatal."""
        if self.path is None:
            return
        self._started = True
        try:
            await self._ask(("open",))
        except LedgerWriteError as exc:
            self._failures.event(str(exc), self.dropped)
        self._task = asyncio.get_running_loop().create_task(self._write_every_second())

    async def close(self) -> None:
        """Write what is pending (SIGTERM), then end the writer (it closes the database)."""
        if not self._started:
            return
        self._started = False
        await cancel_and_wait(self._task)
        self._task = None
        await self._flush()
        async with self._talking:
            await self._end_writer()

    async def flush(self) -> None:
        """Write the rows gathered so far (a test's or shutdown's; the loop does it every second)."""
        if self._started:
            await self._flush()

    async def query(self, sql: str, parameters: Sequence[Any]) -> list[tuple[Any, ...]]:
        """Run a read in the writer (after what is pending is written); nothing when it cannot be read."""
        try:
            return await self.read(sql, parameters)
        except LedgerWriteError as exc:
            log.warning("the ledger at %s could not be read (%s)", self.path, exc)
            return []

    async def read(self, sql: str, parameters: Sequence[Any]) -> list[tuple[Any, ...]]:
        """``query``, but a ledger that cannot be read (or is off) raises ``LedgerWriteError``."""
        if not self._started:
            raise LedgerWriteError("the ledger is not open" if self.path is not None else "the ledger is off")
        await self._flush()
        rows: list[tuple[Any, ...]] = await self._ask(("read", sql, list(parameters)))
        return rows

    async def _flush(self) -> None:
        if self._pending:
            self._pack()
        chunks, rows = self._packed, self._packed_rows
        if not chunks:
            return
        self._packed, self._packed_rows = [], 0
        try:
            await self._ask(("write", chunks, self._clock(), self.retention))
        except LedgerWriteError as exc:
            self._drop(rows, str(exc))

    async def _write_every_second(self) -> None:
        while True:
            await asyncio.sleep(_FLUSH_EVERY)
            await self._flush()

    async def _ask(self, request: tuple[Any, ...]) -> Any:
        """One request to the writer and its answer; a writer that is gone is started again for the next."""
        async with self._talking:
            writer = self._writer
            try:
                if writer is None:
                    writer = self._writer = await _start_writer(self.path)
                assert writer.stdin is not None and writer.stdout is not None
                writer.stdin.write(write_frame(request))
                await writer.stdin.drain()
                size = payload_size(await writer.stdout.readexactly(HEADER))
                kind, result = pickle.loads(await writer.stdout.readexactly(size))
            except (OSError, asyncio.IncompleteReadError):
                if writer is not None:
                    await self._end_writer()
                raise LedgerWriteError("the ledger's writer process ended unexpectedly") from None
            if kind != "ok":
                raise LedgerWriteError(result)
            return result

    async def _end_writer(self) -> None:
        """Close the writer's stdin (it ends there), wait for it, kill it if it does not end."""
        writer, self._writer = self._writer, None
        if writer is None:
            return
        if writer.stdin is not None:
            writer.stdin.close()
        try:
            await asyncio.wait_for(writer.wait(), _WRITER_EXIT_WAIT)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                writer.kill()
            await writer.wait()

    def _drop(self, count: int, why: str) -> None:
        self.dropped += count
        if self._on_dropped is not None:
            self._on_dropped(count)
        self._failures.event(why, self.dropped)


async def _start_writer(path: Path | None) -> asyncio.subprocess.Process:
    """``python -m proxy.ledger.writer PATH`` with this interpreter, finding this copy of the package."""
    search = [str(_PACKAGE_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy.ledger.writer", str(path), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.pathsep.join(search)})
