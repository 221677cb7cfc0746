"""``slotproxy serve --workers N``: N processes serving one port, supervised by the one the user started.

Each worker is a whole slotproxy (its own event loop, its own Redis replica with
its own replica id) that binds the port with ``SO_REUSEPORT``, so the kernel
spreads the connections between them. The parent serves nothing: it starts the
workers, starts a new one when one dies, and passes SIGTERM, SIGINT and SIGHUP on.

A worker is the same ``serve`` command again, run by a fresh interpreter
(``python -m proxy serve ... --worker-of PID --worker-index N --worker-fd FD``)
rather than a fork or ``multiprocessing``: a fork would copy the parent's
interpreter state into a process that is to run an event loop, threads and
sockets of its own, and ``multiprocessing``'s spawn re-imports the main module
(a console script here) and adds a resource tracker and pickling for what is
only a command line. ``ps`` shows what each worker is, and it starts exactly as
``slotproxy serve`` does.

Parent and worker share one end each of a socket pair (``--worker-fd``): the
worker writes ``ready`` once it listens, and reads end of file when the parent is
gone (SIGKILL included), which it takes as SIGTERM, so no worker outlives its
parent by more than its shutdown grace.

The parent holds the port for as long as it runs: a socket bound with
``SO_REUSEPORT``, never listening. The workers join it; a program that does not
set ``SO_REUSEPORT`` cannot take the port while a worker is being replaced, and
port 0 is resolved once, for every worker. It sets ``SO_REUSEADDR`` too, as every
listener does, or the connections a server on that port closed in the last minute
(in TIME-WAIT, listening nowhere) would make the port look taken.

The workers answer ``/metrics`` and ``/usage`` for the whole host: the parent makes
a private folder for their metrics files (``PROMETHEUS_MULTIPROC_DIR``, see
:mod:`proxy.http.metrics`) before it starts them, clears a dead worker's gauges
from it, and removes it when the fleet stops; and they write one ledger
(:mod:`proxy.ledger.writer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .bind import bind_every_address

__all__ = ["MARGIN", "Reservation", "Supervisor", "WorkerLink", "backoff", "describe_exit", "metrics_folder",
           "reserve", "reuse_port_missing", "worker_command", "worker_environment"]

log = logging.getLogger("slotproxy")

MARGIN = 5.0
"""Seconds past ``server.shutdown_grace`` that the parent waits for the workers after SIGTERM; then SIGKILL."""
STEADY = 10.0
"""A worker that served this long before it died is replaced at once; one that died sooner counts as a quick
death, and quick deaths in a row wait longer and longer before the next start."""
BACKOFF_FIRST = 0.5
BACKOFF_MAX = 30.0
READY = b"ready\n"


def backoff(quick_deaths: int) -> float:
    """Seconds before the next start after ``quick_deaths`` quick deaths in a row: none after the first, then
    0.5, 1, 2 … up to 30."""
    if quick_deaths <= 1:
        return 0.0
    return float(min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** (quick_deaths - 2)))


def describe_exit(returncode: int) -> str:
    """``signal 9`` or ``status 1``, as a process's return code says."""
    if returncode < 0:
        return f"signal {-returncode}"
    return f"status {returncode}"


# ----- the port, held by the parent ------------------------------------------------------------------------


@dataclass
class Reservation:
    """The parent's hold on the port: bound with ``SO_REUSEPORT`` and ``SO_REUSEADDR`` on every address the host
    resolves to."""

    port: int
    sockets: list[socket.socket]

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


def reuse_port_missing() -> bool:
    """True where the socket module has no ``SO_REUSEPORT`` (Windows)."""
    return not hasattr(socket, "SO_REUSEPORT")


def reserve(host: str, port: int) -> Reservation:
    """Bind, without listening, what the workers will listen on; port 0 picks one port for all of them.
    Raises :class:`~proxy.server.bind.BindFailed` (or the OSError it cannot explain)."""
    return Reservation(*bind_every_address(host, port, socket.SO_REUSEADDR, socket.SO_REUSEPORT))


def worker_command(config_path: str, host: str, port: int, log_format: str, log_level: str) -> \
        Callable[[int, int], list[str]]:
    """The command line of worker N, given the socket-pair end it inherits."""
    def command(index: int, fd: int) -> list[str]:
        return [sys.executable, "-m", "proxy", "serve", "--config", config_path, "--host", host, "--port",
                str(port), "--log-format", log_format, "--log-level", log_level, "--worker-of", str(os.getpid()),
                "--worker-index", str(index), "--worker-fd", str(fd)]
    return command


def worker_environment() -> dict[str, str]:
    """The parent's environment, with the folder this package was loaded from first on PYTHONPATH: the workers
    run the parent's code, however the parent was started."""
    root = str(Path(__file__).resolve().parents[2])
    paths = [root, *[entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry and entry != root]]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


@contextlib.contextmanager
def metrics_folder() -> Iterator[str]:
    """A fresh folder only this user can read, for the workers' metrics files; removed with what is in it."""
    folder = tempfile.mkdtemp(prefix="slotproxy-metrics-")
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ----- the worker's side -----------------------------------------------------------------------------------


@dataclass
class WorkerLink:
    """A worker's end of its socket pair with the parent (``--worker-of``, ``--worker-index``, ``--worker-fd``)."""

    parent: int
    index: int
    fd: int
    _sock: socket.socket | None = field(default=None, init=False, repr=False)

    def ready(self, loop: asyncio.AbstractEventLoop, parent_gone: Callable[[], None]) -> None:
        """Tell the parent this worker listens; call ``parent_gone`` when the parent's end closes."""
        sock = self._sock = socket.socket(fileno=self.fd)
        sock.set_inheritable(False)
        try:
            sock.sendall(READY)
        except OSError:
            self._gone(loop, parent_gone)
            return
        sock.setblocking(False)
        loop.add_reader(sock.fileno(), self._readable, loop, parent_gone)

    def _readable(self, loop: asyncio.AbstractEventLoop, parent_gone: Callable[[], None]) -> None:
        assert self._sock is not None
        try:
            data = self._sock.recv(64)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(self._sock.fileno())
            self._gone(loop, parent_gone)

    def _gone(self, loop: asyncio.AbstractEventLoop, parent_gone: Callable[[], None]) -> None:
        log.warning("the parent process (pid %d) is gone; shutting down", self.parent)
        parent_gone()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


# ----- the parent's side -----------------------------------------------------------------------------------


@dataclass
class _Worker:
    index: int
    process: asyncio.subprocess.Process | None = None
    ready: bool = False
    ever_ready: bool = False
    hup_pending: bool = False
    quick_deaths: int = 0


class Supervisor:
    """Keeps ``count`` workers running until SIGTERM or SIGINT, then stops them; returns the exit status.

    A worker that exits before it is ready while the fleet first starts (a port it cannot bind, say: it has
    printed why) ends the whole command with its exit status, 2 for the CLI's one-line refusals. Once the
    fleet is up, a worker that dies is started again: at once after a steady run, after a growing pause
    (:func:`backoff`) when it keeps dying within ``STEADY`` seconds. SIGHUP reaches every worker (one still
    starting gets it once it is ready); SIGTERM and SIGINT send SIGTERM to every worker, which lets its
    streams finish for its ``shutdown_grace``; what still runs ``grace() + margin`` seconds later is killed.
    """

    def __init__(self, count: int, command: Callable[[int, int], Sequence[str]], *, grace: Callable[[], float],
                 on_ready: Callable[[list[int]], None] | None = None,
                 on_exit: Callable[[int], None] | None = None, env: Mapping[str, str] | None = None,
                 margin: float = MARGIN) -> None:
        """``on_exit(index)``: worker ``index`` has exited (before any replacement starts)."""
        self._workers = [_Worker(index) for index in range(1, count + 1)]
        self._command = command
        self._grace = grace
        self._on_ready = on_ready
        self._on_exit = on_exit
        self._env = dict(env) if env is not None else worker_environment()
        self._margin = margin
        self._up = False
        self._stopping = False
        self._stop: asyncio.Event | None = None
        self._exit_code = 0

    @property
    def pids(self) -> list[int]:
        return [worker.process.pid for worker in self._workers if worker.process is not None]

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._begin_stop)
        loop.add_signal_handler(signal.SIGHUP, self._reload)
        keepers = [loop.create_task(self._keep(worker)) for worker in self._workers]
        try:
            await self._stop.wait()
            self._begin_stop()
            grace = self._grace() + self._margin
            _, running = await asyncio.wait(keepers, timeout=grace)
            if running:
                for worker in self._workers:
                    process = worker.process
                    if process is not None and process.returncode is None:
                        log.warning("worker %d (pid %d) still running %.0fs after SIGTERM; killing it",
                                    worker.index, process.pid, grace)
                        process.kill()
                await asyncio.wait(running)
        finally:
            for task in keepers:
                task.cancel()
            await asyncio.gather(*keepers, return_exceptions=True)
            for sig in handled:
                loop.remove_signal_handler(sig)
        return self._exit_code

    def _begin_stop(self) -> None:
        """SIGTERM to every worker (idempotent: a second SIGTERM or Ctrl-C changes nothing)."""
        if self._stopping:
            return
        self._stopping = True
        if self._up:
            log.info("stopping %d worker(s): each lets its streams finish for its shutdown_grace",
                     len(self.pids))
        for worker in self._workers:
            self._signal(worker, signal.SIGTERM)
        assert self._stop is not None
        self._stop.set()

    def _reload(self) -> None:
        for worker in self._workers:
            if worker.ready:
                self._signal(worker, signal.SIGHUP)
            elif worker.process is not None:
                worker.hup_pending = True  # its handler is not installed yet: SIGHUP now would end it

    @staticmethod
    def _signal(worker: _Worker, sig: int) -> None:
        process = worker.process
        if process is not None and process.returncode is None:
            try:
                process.send_signal(sig)
            except ProcessLookupError:
                pass

    async def _keep(self, worker: _Worker) -> None:
        """Run worker N, and again whenever it dies, until the fleet stops."""
        assert self._stop is not None
        loop = asyncio.get_running_loop()
        delay = 0.0
        while not self._stopping:
            if delay:
                try:
                    await asyncio.wait_for(self._stop.wait(), timeout=delay)
                    return
                except TimeoutError:
                    pass
            started = loop.time()
            try:
                pid, returncode, was_ready = await self._run_once(worker)
            except OSError as exc:  # no process at all (out of memory, out of process slots)
                if not self._up:
                    log.error("could not start worker %d: %s; stopping", worker.index, exc)
                    self._exit_code = 1
                    self._begin_stop()
                    return
                worker.quick_deaths += 1
                delay = backoff(worker.quick_deaths)
                log.error("could not start worker %d: %s; trying again in %gs", worker.index, exc, delay)
                continue
            if self._on_exit is not None:
                self._on_exit(worker.index)
            if self._stopping:
                return
            if not worker.ever_ready and not self._up:
                self._fail_start(worker, pid, returncode)
                return
            quick = not was_ready or loop.time() - started < STEADY
            worker.quick_deaths = worker.quick_deaths + 1 if quick else 0
            delay = backoff(worker.quick_deaths)
            after = f" in {delay:g}s" if delay else ""
            log.warning("worker %d (pid %d) exited with %s; starting a new one%s", worker.index, pid,
                        describe_exit(returncode), after)

    async def _run_once(self, worker: _Worker) -> tuple[int, int, bool]:
        """Start worker N, wait until it is ready and until it exits: its pid, return code, whether it was ready."""
        loop = asyncio.get_running_loop()
        parent_end, child_end = socket.socketpair()
        try:
            try:
                process = await asyncio.create_subprocess_exec(
                    *self._command(worker.index, child_end.fileno()), pass_fds=(child_end.fileno(),),
                    stdin=subprocess.DEVNULL, env=self._env)
            finally:
                child_end.close()
            worker.process, worker.ready, worker.hup_pending = process, False, False
            if self._stopping:
                self._signal(worker, signal.SIGTERM)
            parent_end.setblocking(False)
            exited = loop.create_task(process.wait())
            told = loop.create_task(loop.sock_recv(parent_end, len(READY)))
            try:
                await asyncio.wait((exited, told), return_when=asyncio.FIRST_COMPLETED)
                if not exited.done() and told.done() and told.exception() is None and told.result():
                    self._became_ready(worker, process.pid)
                returncode = await exited
            finally:
                told.cancel()
                exited.cancel()
            return process.pid, returncode, worker.ready
        finally:
            worker.process, worker.ready = None, False
            parent_end.close()  # only now: the worker reads its closing as "the parent is gone"

    def _became_ready(self, worker: _Worker, pid: int) -> None:
        worker.ready = True
        if worker.hup_pending:
            worker.hup_pending = False
            self._signal(worker, signal.SIGHUP)
        if self._stopping:
            return
        if worker.ever_ready:
            log.info("worker %d (pid %d) is serving", worker.index, pid)
        worker.ever_ready = True
        if not self._up and all(other.ready for other in self._workers):
            self._up = True
            if self._on_ready is not None:
                self._on_ready(self.pids)

    def _fail_start(self, worker: _Worker, pid: int, returncode: int) -> None:
        """A worker that could not start while the fleet first starts ends the command (no restart loop)."""
        self._exit_code = returncode if returncode > 0 else 1
        if returncode != 2:  # 2: the CLI's one-line refusal, which the worker has printed
            log.error("worker %d (pid %d) exited with %s before it was ready; stopping", worker.index, pid,
                      describe_exit(returncode))
        self._begin_stop()
