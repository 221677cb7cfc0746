"""Running the proxy: start, reload on edits and SIGHUP, shut down gracefully on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import signal
import sqlite3
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from aiohttp import web

from ..aio import cancel_and_wait
from ..config import Config, ConfigError, beside_config, load_config
from ..config.diff import config_changes, describe_changes
from ..errors import ShuttingDown
from ..http.connections import install_accept_error_log, raise_open_files_limit
from ..http.heap import HeapKeeper, settle_heap
from ..http.metrics import HOST_FILES_ENV, worker_gone
from ..http.runtime import ProxyState
from ..limiter import LoopClock
from .app import start_server
from .workers import (
    Reservation,
    Supervisor,
    WorkerLink,
    metrics_folder,
    worker_command,
    worker_environment,
)

__all__ = ["ConfigWatcher", "dashboard_url", "serve", "serve_workers", "shutdown"]

log = logging.getLogger("slotproxy")


_GONE = b""
"""The digest of a config file that is not there (deleted, or moved away)."""


class ConfigWatcher:
    """Applies edits to the config file: content changes (also a symlink swap) and SIGHUP.

    A reload is parse → validate → swap. An invalid file is refused whole; the
    running config stays and the error is kept in status until a valid edit.
    A file that is gone is said once (and kept in status as ``missing_since``);
    the running config stays, and the file is read again as soon as it is back.
    """

    def __init__(self, state: ProxyState, path: str, interval: float = 1.0,
                 clock: Callable[[], float] = time.time) -> None:
        self._state = state
        self._path = Path(path)
        self._interval = interval
        self._clock = clock
        self._digest = self._read_digest()
        if self._digest is _GONE:
            self._gone()
        self._task: asyncio.Task[None] | None = None

    def _read_digest(self) -> bytes | None:
        """The content's digest, ``_GONE`` when there is no file, None when it cannot be read now."""
        try:
            return hashlib.sha256(self._path.read_bytes()).digest()
        except FileNotFoundError:
            return _GONE
        except OSError:
            return None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._poll())

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            self.check()

    def check(self) -> None:
        """One poll: reload when the content changed or the file is back; say once that it is gone."""
        digest = self._read_digest()
        if digest is None or digest == self._digest:
            return
        if digest is _GONE:
            self._digest = digest
            self._gone()
        else:
            self.reload("file is back" if self._state.config_missing_since is not None else "file changed")

    def _gone(self) -> None:
        if self._state.config_missing_since is None:
            self._state.config_missing_since = self._clock()
            log.warning("config file %s is missing (deleted or moved away); keeping the running config, and "
                        "reading the file again as soon as it is back", self._path)

    def reload(self, reason: str) -> bool:
        digest = self._read_digest()
        if digest is _GONE:
            self._digest = digest
            self._gone()
            return False
        self._digest = digest or self._digest
        self._state.config_missing_since = None
        try:
            config = load_config(self._path)
        except ConfigError as exc:
            self._state.config_error = f"{self._path}: " + "; ".join(exc.problems)
            log.error("config reload refused (%s); keeping the running config: %s", reason, self._state.config_error)
            return False
        refusal = self._state.telemetry_refusal(config)
        if refusal is not None:
            self._state.config_error = f"{self._path}: {refusal}"
            log.error("config reload refused (%s); keeping the running config: %s", reason, self._state.config_error)
            return False
        old = self._state.config
        self._warn_restart_only(config)
        self._state.apply(config)
        self._state.config_error = None
        log.info("config reloaded (%s): %s", reason, describe_changes(config_changes(old, config)))
        return True

    def _warn_restart_only(self, config: Config) -> None:
        old = self._state.config
        if (old.server.host, old.server.port) != (config.server.host, config.server.port):
            log.warning("server.host/server.port changed in the config; they apply at the next restart")
        if old.backend != config.backend:
            log.warning("backend settings changed in the config; they apply at the next restart")


async def shutdown(state: ProxyState, runner: web.AppRunner) -> None:
    """Answer queued requests 503, let streams finish for up to shutdown_grace, then stop."""
    grace = state.config.server.shutdown_grace
    state.shutting_down = True
    shed = state.backend.shed_queues(ShuttingDown("slotproxy is shutting down; retry shortly", retry_after=1.0))
    state.open_sockets.shutdown()
    log.info("shutting down: %d queued request(s) answered 503; waiting up to %.0fs for %d in flight",
             shed, grace, state.active_requests - shed)
    try:
        await asyncio.wait_for(state.idle.wait(), timeout=grace)
    except TimeoutError:
        log.warning("shutdown grace of %.0fs ran out with %d request(s) still in flight", grace, state.active_requests)
    await runner.cleanup()
    log.info("slotproxy stopped")


def _raise_open_files_limit() -> None:
    before, after = raise_open_files_limit()
    if after > before:
        log.info("open files limit raised from %d to %d (the hard limit)", before, after)
    else:
        log.info("open files limit: %d (the hard limit)", after)


async def _serve(config: Config, path: str, host: str, port: int, worker: WorkerLink | None = None) -> int:
    _raise_open_files_limit()
    install_accept_error_log(asyncio.get_running_loop())
    state = ProxyState(config, config_path=path, worker=None if worker is None else worker.index)
    try:
        runner, bound = await start_server(state, host, port, reuse_port=worker is not None)
    except OSError as exc:  # the port was free when the CLI probed it, and was taken since: still one line
        from .bind import failure

        bind_failed = failure(exc, host, port)
        if bind_failed is None:
            raise
        raise bind_failed from None
    watcher = ConfigWatcher(state, path)
    watcher.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: watcher.reload("SIGHUP"))
    settle_heap()
    heap = HeapKeeper(lambda: state.active_requests, LoopClock(loop))
    heap.start()
    publisher = loop.create_task(state.metrics.publish_every()) if state.metrics.host_wide else None
    if worker is None:
        log.info("slotproxy listening on http://%s:%d (providers: %s; config %s); dashboard: %s",
                 host, bound, ", ".join(config.provider_names()) or "none", path, dashboard_url(host, bound))
    else:  # the parent says where the fleet listens, once
        worker.ready(loop, stop.set)
    await stop.wait()
    heap.stop()
    await watcher.stop()
    await shutdown(state, runner)
    await cancel_and_wait(publisher)
    state.metrics.publish()
    if worker is not None:
        worker.close()
    return 0


def dashboard_url(host: str, port: int) -> str:
    """Where a browser on this machine finds the dashboard (a wildcard bind is reached on loopback)."""
    shown = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    if ":" in shown and not shown.startswith("["):
        shown = f"[{shown}]"
    return f"http://{shown}:{port}/_slotproxy/"


def serve(config: Config, path: str, host: str, port: int, *, worker: WorkerLink | None = None) -> int:
    """Run until SIGTERM or SIGINT; returns the exit status. ``worker``: as worker N of ``serve --workers``."""
    # Outside any except block: an error while serving must not carry "No module named 'uvloop'" as its context.
    return _event_loop_runner()(_serve(config, path, host, port, worker))


def serve_workers(config: Config, path: str, host: str, reservation: Reservation, count: int, *,
                  log_format: str, log_level: str) -> int:
    """``serve --workers N``: start N workers on the port ``reservation`` holds and supervise them until
    SIGTERM or SIGINT; returns the exit status."""
    port = reservation.port
    grace = config.server.shutdown_grace

    def current_grace() -> float:
        """The workers' shutdown_grace as the config file says now (they reload it on edits and SIGHUP)."""
        nonlocal grace
        try:
            grace = load_config(Path(path)).server.shutdown_grace
        except (ConfigError, OSError):
            pass  # an invalid edit: the workers keep the config they run, and so their grace
        return grace

    def started(pids: list[int]) -> None:
        log.info("slotproxy listening on http://%s:%d with %d workers (pids %s; providers: %s; config %s); "
                 "dashboard: %s", host, port, count, ", ".join(map(str, pids)),
                 ", ".join(config.provider_names()) or "none", path, dashboard_url(host, port))

    _create_ledger(config, path)
    with metrics_folder() as folder:
        supervisor = Supervisor(count, worker_command(path, host, port, log_format, log_level), grace=current_grace,
                                on_ready=started, on_exit=lambda index: worker_gone(folder, index),
                                env={**worker_environment(), HOST_FILES_ENV: folder})
        try:
            code = asyncio.run(supervisor.run())
        finally:
            reservation.close()
    if code == 0:
        log.info("slotproxy stopped")
    return code


def _create_ledger(config: Config, path: str) -> None:
    """The workers' one ledger, made before they start (what fails here fails again in each worker, which
    says so and serves on)."""
    ledger = beside_config(config.ledger.path, path)
    if ledger is None:
        return
    from ..ledger.writer import create

    with contextlib.suppress(sqlite3.Error, OSError):
        create(str(ledger))


def _event_loop_runner() -> Callable[[Coroutine[Any, Any, int]], int]:
    """uvloop's runner where it is installed (every platform its marker in pyproject covers), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run
