"""The ledger's writer: a process of its own (``python -m proxy.ledger.writer PATH``) that holds the only
connection to the database.

A writer thread in the proxy's process would share the GIL with the event loop, and SQLite gives the GIL back
and takes it again around every statement: the loop paid for each hand-over (measured: about 10 µs of the
loop's time a row, three times what the writes themselves cost). In a process of its own the writer costs the
loop only the pickling of each second's batch.

The proxy talks to it over the child's stdin and stdout, one request at a time, each way a 4-byte big-endian
length and a pickle: ``("write", chunks, now, retention)`` (``chunks``: the rows as pickled lists of tuples), ``("read", sql, parameters)`` or ``("open",)``; the
answer is ``("ok", result)`` or ``("error", what happened in words)``. It ends when its stdin closes: the proxy
closing the ledger, or the proxy gone however it went, so it never outlives it. Ctrl-C and SIGTERM, which
reach a terminal's whole process group, are the proxy's to act on; it writes what is pending, then closes
the pipe. Only the standard library is imported here, so the process starts in milliseconds.

Under ``serve --workers N`` each worker has a writer of its own, and all of them write the host's one file:
SQLite in WAL mode is made for several processes of one host writing one database (each transaction takes
the file's write lock for the few milliseconds it lasts; the others wait for it, ``_BUSY_WAIT`` at most), and
a worker that dies takes only its own second of rows with it. The parent creates the database before the
workers start (:func:`create`), so no two writers race to switch a new file to WAL.
"""

from __future__ import annotations

import itertools
import pickle
import signal
import sqlite3
import sys
from collections.abc import Sequence
from typing import Any, BinaryIO

__all__ = ["ADDED_COLUMNS", "COLUMNS", "HEADER", "INSERT", "SCHEMA", "TOKEN_COLUMNS", "Writer", "create", "main", "payload_size",
           "read_frame", "words", "write_frame"]

TOKEN_COLUMNS = ("input_tokens", "cached_input_tokens", "cache_write_tokens", "output_tokens", "reasoning_tokens")
COLUMNS = ("ended_at", "provider", "key", "model", "workspace", "starred", "conversation", "transport", "status",
           "outcome", "queue_ms", "ttfb_ms", "duration_ms", *TOKEN_COLUMNS, "retries", "cost_usd")
SCHEMA = f"""
CREATE TABLE IF NOT EXISTS requests (
    ended_at INTEGER NOT NULL, provider TEXT NOT NULL, key TEXT, model TEXT, workspace TEXT NOT NULL,
    starred INTEGER NOT NULL, conversation TEXT, transport TEXT NOT NULL, status INTEGER NOT NULL,
    outcome TEXT NOT NULL, queue_ms INTEGER NOT NULL, ttfb_ms INTEGER, duration_ms INTEGER NOT NULL,
    {", ".join(f"{name} INTEGER" for name in TOKEN_COLUMNS)}, retries INTEGER NOT NULL, cost_usd REAL);
CREATE INDEX IF NOT EXISTS requests_ended_at ON requests (ended_at);
"""
ADDED_COLUMNS = (("cost_usd", "REAL"),)
"""Columns a newer version added, with their type: a ledger written by an older one gains them when opened
(its rows have them null)."""
INSERT = f"INSERT INTO requests ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"
_ROWS_PER_INSERT = 50
"""Rows one INSERT statement carries: a second's batch is a few dozen statements, not thousands."""
_INSERT_MANY = INSERT + f", ({', '.join('?' * len(COLUMNS))})" * (_ROWS_PER_INSERT - 1)
_PRUNE_EVERY = 3600.0
_BUSY_WAIT = 2.0
"""Seconds a statement waits while another process's transaction holds the file (other workers' writers)."""
HEADER = 4
"""Each message's length, in bytes before it (big-endian)."""


class Writer:
    """The database of one ledger file, opened on first use (again after a failure)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._connection: sqlite3.Connection | None = None
        self._pruned_at = 0.0

    def handle(self, request: tuple[Any, ...]) -> Any:
        kind, *args = request
        if kind == "write":
            chunks, now, retention = args
            return self.write([row for chunk in chunks for row in pickle.loads(chunk)], now, retention)
        if kind == "read":
            return self.read(*args)
        if kind == "open":
            self._connected()
            return None
        raise ValueError(f"unknown request {kind!r}")

    def write(self, batch: Sequence[tuple[Any, ...]], now: float, retention: float) -> None:
        """One transaction for the batch; once an hour, the rows older than ``retention`` go."""
        connection = self._connected()
        with connection:
            connection.execute("BEGIN")
            whole = len(batch) - len(batch) % _ROWS_PER_INSERT
            for start in range(0, whole, _ROWS_PER_INSERT):
                connection.execute(_INSERT_MANY, tuple(itertools.chain.from_iterable(
                    batch[start:start + _ROWS_PER_INSERT])))
            if whole < len(batch):
                connection.executemany(INSERT, batch[whole:])
        if now - self._pruned_at >= _PRUNE_EVERY:
            self._pruned_at = now
            with connection:
                connection.execute("DELETE FROM requests WHERE ended_at < ?", (int((now - retention) * 1000),))

    def read(self, sql: str, parameters: Sequence[Any]) -> list[tuple[Any, ...]]:
        return list(self._connected().execute(sql, tuple(parameters)))

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def _connected(self) -> sqlite3.Connection:
        """Open (or create) the database in WAL mode, so readers never wait for the writer."""
        if self._connection is None:
            connection = sqlite3.connect(self.path, timeout=_BUSY_WAIT, isolation_level=None)
            try:
                connection.execute("PRAGMA journal_mode=WAL")
                connection.execute("PRAGMA synchronous=NORMAL")
                connection.executescript(SCHEMA)
                _add_missing_columns(connection)
            except sqlite3.Error:
                connection.close()
                raise
            self._connection = connection
        return self._connection


def _add_missing_columns(connection: sqlite3.Connection) -> None:
    """The migration of an older ledger: ALTER TABLE for each column it lacks (another worker's writer may
    add it first: that is not a failure)."""
    present = {row[1] for row in connection.execute("PRAGMA table_info(requests)")}
    for name, kind in ADDED_COLUMNS:
        if name in present:
            continue
        try:
            connection.execute(f"ALTER TABLE requests ADD COLUMN {name} {kind}")
        except sqlite3.OperationalError as exc:
            if "duplicate column" not in str(exc):
                raise


def create(path: str) -> None:
    """Create the database (WAL mode, the table) if it is not there yet; raises ``sqlite3.Error`` or
    ``OSError``."""
    writer = Writer(path)
    try:
        writer.handle(("open",))
    finally:
        writer.close()


def write_frame(message: Any) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return len(payload).to_bytes(HEADER, "big") + payload


def payload_size(header: bytes) -> int:
    return int.from_bytes(header, "big")


def read_frame(stream: BinaryIO) -> Any | None:
    """The next message, or None at the end of the stream."""
    header = stream.read(HEADER)
    if len(header) < HEADER:
        return None
    return pickle.loads(stream.read(payload_size(header)))


def words(exc: BaseException) -> str:
    """An SQLite or OS error in words (its message), never a class name alone."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or "unknown error"


def main(argv: Sequence[str] | None = None) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    (path,) = sys.argv[1:] if argv is None else argv
    writer = Writer(path)
    requests, answers = sys.stdin.buffer, sys.stdout.buffer
    try:
        while (request := read_frame(requests)) is not None:
            try:
                answer: tuple[str, Any] = ("ok", writer.handle(request))
            except (sqlite3.Error, OSError, ValueError) as exc:
                writer.close()  # opened again for the next request: the folder may be back
                answer = ("error", words(exc))
            answers.write(write_frame(answer))
            answers.flush()
    except BrokenPipeError:  # the proxy is gone
        pass
    finally:
        writer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
