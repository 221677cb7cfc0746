"""The ledger on its own: rows written off the loop, kept across a restart, a failing file never fatal; the usage
report's queries and the fleet's hourly encoding."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from proxy.errors import AdminError
from proxy.http.heap import YOUNG_PASS_AFTER
from proxy.ledger import store
from proxy.ledger.fleet import FleetUsage, usage_key
from proxy.ledger.report import answer, parse_query, queue_median_sql, totals_sql
from proxy.ledger.store import _PACK_EVERY, COLUMNS, Ledger, LedgerRow
from proxy.ledger.writer import create, read_frame, write_frame

NOW_MS = 1_800_000_123_456


def row(**fields: object) -> LedgerRow:
    base: dict[str, object] = {
        "ended_at": NOW_MS, "provider": "openai", "key": None, "model": "gpt-5", "workspace": "web",
        "starred": False, "conversation": "c1", "transport": "http", "status": 200, "outcome": "ok",
        "queue_ms": 0, "ttfb_ms": 5, "duration_ms": 50, "input_tokens": 100, "cached_input_tokens": 10,
        "cache_write_tokens": 0, "output_tokens": 20, "reasoning_tokens": 3, "retries": 0,
    }
    base.update(fields)
    return LedgerRow(**base)  # type: ignore[arg-type]


def table(path: Path) -> list[dict[str, object]]:
    with sqlite3.connect(path) as connection:
        cursor = connection.execute(f"SELECT {', '.join(COLUMNS)} FROM requests ORDER BY ended_at")
        return [dict(zip(COLUMNS, values, strict=True)) for values in cursor]


async def test_rows_are_written_in_wal_mode_and_kept_across_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    ledger = Ledger(path, retention=86400)
    await ledger.start()
    ledger.record(row(ended_at=NOW_MS - 2))
    ledger.record(row(ended_at=NOW_MS - 1, status=503, outcome="rejected", input_tokens=None))
    await ledger.close()
    with sqlite3.connect(path) as connection:
        assert connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    again = Ledger(path, retention=86400)
    await again.start()
    again.record(row(ended_at=NOW_MS))
    await again.close()
    rows = table(path)
    assert [(r["status"], r["outcome"], r["input_tokens"]) for r in rows] == [(200, "ok", 100), (503, "rejected", None),
                                                                                (200, "ok", 100)]


async def test_a_path_that_is_a_folder_drops_rows_without_failing(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A path SQLite cannot open as a file (here a folder: this holds as root too)."""
    path = tmp_path / "not-a-file"
    path.mkdir()
    ledger = Ledger(path, retention=86400)
    with caplog.at_level(logging.ERROR, logger="slotproxy.ledger"):
        await ledger.start()
        started = time.monotonic()
        for _ in range(100):
            ledger.record(row())
        assert time.monotonic() - started < 0.05  # recording is an append, whatever the file does
        await ledger.flush()
        await ledger.close()
    assert ledger.dropped == 100
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines  # the open and the write both failed: one line, the next a minute later
    assert lines[0].startswith(f"the ledger at {path} could not be written (unable to open database file)")


async def test_retention_deletes_old_rows_on_the_hourly_prune(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    ledger = Ledger(path, retention=3600, clock=lambda: NOW_MS / 1000)
    await ledger.start()
    ledger.record(row(ended_at=NOW_MS - 2 * 3600 * 1000))
    ledger.record(row(ended_at=NOW_MS - 10))
    await ledger.close()
    assert [r["ended_at"] for r in table(path)] == [NOW_MS - 10]


def test_the_query_is_validated_naming_the_parameter() -> None:
    for params, words in [({"since": "yesterday"}, "since must be epoch milliseconds"),
                          ({"until": "-5"}, "until must be epoch milliseconds"),
                          ({"by": "workspace,colour"}, "by: 'colour' is not a field to group by"),
                          ({"by": "model,model"}, "by: a field is named twice"),
                          ({"provider": ""}, "provider must be a non-empty value"),
                          ({"group": "x"}, "unknown parameter 'group'"),
                          ({"since": "1h", "until": "2h"}, "is after until")]:
        with pytest.raises(AdminError, match=words) as raised:
            parse_query(params, NOW_MS)
        assert raised.value.status == 400
    query = parse_query({"since": "5h", "by": "provider, model", "workspace": "web"}, NOW_MS)
    assert (query.since, query.until, query.by, dict(query.filters)) == (
        NOW_MS - 5 * 3600 * 1000, NOW_MS, ("provider", "model"), {"workspace": "web"})
    assert parse_query({}, NOW_MS).since == NOW_MS - 24 * 3600 * 1000
    assert parse_query({"by": "conversation"}, NOW_MS).per_replica


def test_the_report_groups_sums_and_sorts_by_tokens() -> None:
    connection = sqlite3.connect(":memory:")
    from proxy.ledger.writer import INSERT, SCHEMA

    connection.executescript(SCHEMA)
    rows = [row(workspace="web", queue_ms=10), row(workspace="web", queue_ms=30, output_tokens=80),
            row(workspace="web", queue_ms=20), row(workspace="docs", input_tokens=5000),
            row(workspace="docs", status=429), row(workspace="docs", status=200, input_tokens=None,
                                                  cached_input_tokens=None, output_tokens=None)]
    connection.executemany(INSERT, [tuple(vars_of(r)) for r in rows])
    query = parse_query({"since": str(NOW_MS - 1), "until": str(NOW_MS + 1)}, NOW_MS)
    doc = answer(query, connection.execute(*totals_sql(query)), connection.execute(*queue_median_sql(query)),
                 "replica")
    assert doc["by"] == ["workspace"] and doc["scope"] == "replica"
    docs, web = doc["rows"]
    assert (docs["workspace"], docs["requests"], docs["errors"], docs["unknown_usage"]) == ("docs", 3, 1, 1)
    assert docs["input_tokens"] == 5100 and docs["output_tokens"] == 40
    assert (web["workspace"], web["requests"], web["output_tokens"], web["queue_ms_p50"], web["queue_ms_max"]) == \
        ("web", 3, 120, 20, 30)


def vars_of(entry: LedgerRow) -> list[object]:
    return [getattr(entry, name) for name in COLUMNS]


def test_the_fleet_encoding_reads_back_as_the_ledger_would() -> None:
    fleet = FleetUsage("sp", retention=86400)
    hour = NOW_MS // 3_600_000 * 3_600_000
    for queue_ms in (5, 50, 500):
        fleet.add(row(queue_ms=queue_ms))
    fleet.add(row(workspace="docs", status=503, outcome="rejected", input_tokens=None, queue_ms=9000))
    (key, args), = fleet.take()
    assert key == usage_key("sp", "openai", hour) == f"{{sp:openai}}:usage:{hour}"
    assert args[0] == hour + 3_600_000 + 86_400_000
    stored: dict[str, int] = {}
    for name, amount in zip(args[1::2], args[2::2], strict=True):
        stored[name] = max(stored.get(name, 0), amount) if name.startswith("max:") else stored.get(name, 0) + amount
    query = parse_query({"since": str(NOW_MS - 1), "until": str(NOW_MS + 1), "by": "workspace"}, NOW_MS)
    assert fleet.keys(query, ["openai"]) == [(key, "openai", hour)]
    doc = FleetUsage.answer(query, [("openai", hour, {k: str(v) for k, v in stored.items()})])
    web, docs = doc["rows"]
    assert doc["scope"] == "fleet"
    assert (web["requests"], web["input_tokens"], web["output_tokens"], web["queue_ms_p50"], web["queue_ms_max"]) == \
        (3, 300, 60, 100, 500)
    assert (docs["requests"], docs["errors"], docs["input_tokens"], docs["unknown_usage"]) == (1, 1, 0, 0)
    assert fleet.take() == []


async def test_a_batch_of_any_size_is_written_whole_in_order(tmp_path: Path) -> None:
    """Fifty rows to a statement, the rest one by one: every row, every field, in order."""
    path = tmp_path / "ledger.sqlite"
    ledger = Ledger(path, retention=86400)
    await ledger.start()
    written = [row(ended_at=NOW_MS + n, queue_ms=n, conversation=f"c{n}") for n in range(123)]
    for entry in written:
        ledger.record(entry)
    await ledger.close()
    assert [tuple(r.values()) for r in table(path)] == [tuple(entry) for entry in written]


async def test_rows_waiting_for_their_write_are_packed_and_start_no_young_collections(tmp_path: Path) -> None:
    """A busy second's rows wait as pickled chunks, not as objects: rows made as the relay makes them, four
    times the collector's young threshold of them, start at most one young collection (kept as objects, they
    started one every ``YOUNG_PASS_AFTER`` rows); every row is written whole and in order across the chunks'
    edges."""
    path = tmp_path / "ledger.sqlite"
    ledger = Ledger(path, retention=86400)
    await ledger.start()
    count = 4 * YOUNG_PASS_AFTER + 7
    values = [tuple(row(ended_at=NOW_MS + n, queue_ms=n, conversation=f"c{n}")) for n in range(count)]
    collections: list[int] = []

    def note(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    thresholds = gc.get_threshold()
    gc.collect()
    gc.set_threshold(YOUNG_PASS_AFTER, *thresholds[1:])
    gc.callbacks.append(note)
    try:
        for fields in values:
            ledger.record(tuple.__new__(LedgerRow, fields))  # as ``Account.row`` makes it
    finally:
        gc.callbacks.remove(note)
        gc.set_threshold(*thresholds)
    assert len(collections) <= 1
    assert len(ledger._pending) == count % _PACK_EVERY
    await ledger.close()
    assert [tuple(r.values()) for r in table(path)] == values


async def test_rows_past_what_may_wait_are_dropped_and_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """While the writer is behind, rows past ``_MAX_PENDING`` are dropped (the newest), counted and said in one
    line; those kept are written."""
    monkeypatch.setattr(store, "_MAX_PENDING", 2 * _PACK_EVERY)
    path = tmp_path / "ledger.sqlite"
    ledger = Ledger(path, retention=86400)
    await ledger.start()
    with caplog.at_level(logging.ERROR, logger="slotproxy.ledger"):
        for n in range(3 * _PACK_EVERY):
            ledger.record(row(ended_at=NOW_MS + n))
    assert ledger.dropped == _PACK_EVERY
    assert [r.getMessage() for r in caplog.records] == [
        (f"the ledger at {path} could not be written (the writer is behind): {_PACK_EVERY} row(s) dropped so far; "
         "requests are served as usual")]
    await ledger.close()
    assert [r["ended_at"] for r in table(path)] == [NOW_MS + n for n in range(2 * _PACK_EVERY)]


def writer_pid(ledger: Ledger) -> int:
    assert ledger._writer is not None
    return ledger._writer.pid


async def test_a_writer_process_that_dies_costs_its_batch_and_the_next_one_is_written(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The writer is a process of its own: killed (the OOM killer, a stray kill), the batch sent to it is
    dropped and counted, one line says so in words, and a new writer takes the next batch."""
    path = tmp_path / "ledger.sqlite"
    ledger = Ledger(path, retention=86400)
    await ledger.start()
    ledger.record(row(ended_at=NOW_MS - 3))
    await ledger.flush()
    os.kill(writer_pid(ledger), signal.SIGKILL)
    ledger.record(row(ended_at=NOW_MS - 2))
    with caplog.at_level(logging.ERROR, logger="slotproxy.ledger"):
        await ledger.flush()
    assert ledger.dropped == 1
    assert [r.getMessage() for r in caplog.records] == [
        (f"the ledger at {path} could not be written (the ledger's writer process ended unexpectedly): 1 row(s) "
         "dropped so far; requests are served as usual")]
    ledger.record(row(ended_at=NOW_MS - 1))
    await ledger.close()
    assert [r["ended_at"] for r in table(path)] == [NOW_MS - 3, NOW_MS - 1]


async def test_ctrl_c_and_sigterm_to_the_process_group_leave_the_writer_to_the_proxy(tmp_path: Path) -> None:
    """SIGINT and SIGTERM reach every process of a terminal's group: the writer leaves them to the proxy,
    which writes what is pending at shutdown and then ends it."""
    path = tmp_path / "ledger.sqlite"
    ledger = Ledger(path, retention=86400)
    await ledger.start()
    writer = ledger._writer
    assert writer is not None
    os.kill(writer.pid, signal.SIGINT)
    os.kill(writer.pid, signal.SIGTERM)
    ledger.record(row())
    await ledger.close()
    assert ledger.dropped == 0 and len(table(path)) == 1
    assert writer.returncode == 0


def test_the_writer_never_outlives_the_proxy(tmp_path: Path) -> None:
    """However the proxy ends (SIGKILL included), the writer's stdin closes with it, and the writer ends."""
    writer = subprocess.Popen([sys.executable, "-m", "proxy.ledger.writer", str(tmp_path / "ledger.sqlite")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert writer.stdin is not None and writer.stdout is not None
    writer.stdin.write(write_frame(("open",)))
    writer.stdin.flush()
    assert read_frame(writer.stdout) == ("ok", None)
    writer.stdin.close()
    assert writer.wait(timeout=5) == 0
    writer.stdout.close()


async def test_the_writers_of_several_workers_share_one_file_and_each_reads_every_row(tmp_path: Path) -> None:
    """``serve --workers``: each worker's writer appends to the host's one file. A writer that finds the file
    held by another's transaction waits for it rather than dropping its batch, and a usage query in any of
    them reads the rows all of them wrote."""
    path = tmp_path / "ledger.sqlite"
    create(str(path))
    ledgers = [Ledger(path, retention=86400) for _ in range(3)]
    for ledger in ledgers:
        await ledger.start()
    for n, ledger in enumerate(ledgers):
        for k in range(40):
            ledger.record(row(ended_at=NOW_MS + k, conversation=f"w{n}-{k}"))
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another writer's transaction, held long
    flushes = asyncio.gather(*(ledger.flush() for ledger in ledgers))
    await asyncio.sleep(0.8)
    holder.execute("COMMIT")
    holder.close()
    await flushes
    assert [ledger.dropped for ledger in ledgers] == [0, 0, 0]
    query = parse_query({"by": "conversation", "since": str(NOW_MS), "until": str(NOW_MS + 100)}, now_ms=NOW_MS)
    for ledger in ledgers:
        rows = await ledger.query(*totals_sql(query))
        assert len(rows) == 120
    for ledger in ledgers:
        await ledger.close()
