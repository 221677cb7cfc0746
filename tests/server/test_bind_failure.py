"""A listener that cannot be bound (issue 24, finding 1): one line on stderr, exit 2, no traceback.

Each case really binds: a port held by a process the test starts, a TEST-NET address (192.0.2.1) no
interface has, and a port below the first unprivileged one. Before, each was a 31-line traceback ending
in ``OSError: [Errno 98]`` (or 99, or 13).
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest

from proxy.config import parse_config
from proxy.http.runtime import ProxyState
from proxy.server.app import start_server
from proxy.server.bind import BindFailed, describe, unprivileged_port_start
from proxy.server.workers import reserve

from ..backends.conftest import REDIS_URL, delete_prefix, require_redis
from ..ports import free_port

REPO = Path(__file__).resolve().parents[2]
NOT_HERE = "192.0.2.1"  # TEST-NET-1 (RFC 5737): no machine has it
PYTHON = os.path.basename(sys.executable)
T = TypeVar("T")

HOLDER = textwrap.dedent("""\
    import socket, sys, time
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    print(sock.getsockname()[1], flush=True)
    sys.stdin.read()
    """)


@pytest.fixture
def held_port(tmp_path: Path) -> Iterator[tuple[int, int]]:
    """A port another process listens on: (port, that process's pid). Its command line is ``python holder.py``."""
    (tmp_path / "holder.py").write_text(HOLDER)
    with subprocess.Popen([sys.executable, "holder.py"], cwd=tmp_path, stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert holder.stdout is not None
            yield int(holder.stdout.readline()), holder.pid
        finally:
            holder.kill()


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "slotproxy.yaml"
    path.write_text("state: {path: null}\nproviders:\n  openai: {upstream: 'http://127.0.0.1:9/v1'}\n")
    return path


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, check=False, env={**os.environ, **(env or {})})


def assert_one_line(result: subprocess.CompletedProcess[str], line: str) -> None:
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stderr.splitlines() == [line]
    assert result.returncode == 2


# --- the port is in use --------------------------------------------------------------------------


def test_serve_on_a_port_in_use_names_the_process_that_holds_it(held_port, config: Path) -> None:
    port, pid = held_port
    result = run("serve", "--config", str(config), "--port", str(port))
    assert_one_line(result, f'slotproxy: cannot listen on 127.0.0.1:{port}: the port is in use (by pid {pid} '
                            f'"{PYTHON} holder.py"); stop it or choose another port with --port')


def test_fake_upstream_on_a_port_in_use_names_the_process_that_holds_it(held_port) -> None:
    port, pid = held_port
    result = run("fake-upstream", "--port", str(port))
    assert_one_line(result, f'slotproxy: cannot listen on 127.0.0.1:{port}: the port is in use (by pid {pid} '
                            f'"{PYTHON} holder.py"); stop it or choose another port with --port')
    assert result.stdout == ""


def test_a_holder_the_os_does_not_show_is_left_out_not_guessed() -> None:
    taken = OSError(errno.EADDRINUSE, "Address already in use")
    assert describe(taken, "127.0.0.1", 8787, find=lambda host, port: None) == (
        "cannot listen on 127.0.0.1:8787: the port is in use by another program; stop it or choose another "
        "port with --port")
    assert describe(taken, "::1", 8787, find=lambda host, port: (42, "nginx: master process")) == (
        'cannot listen on [::1]:8787: the port is in use (by pid 42 "nginx: master process"); stop it or '
        "choose another port with --port")


async def test_a_port_taken_after_the_cli_looked_is_still_one_line(held_port, tmp_path: Path) -> None:
    """``serve`` probes the port before it logs anything; one taken between that probe and the real
    bind is translated where the server starts."""
    from proxy.server.run import _serve

    port, pid = held_port
    config = parse_config("state: {path: null}\nproviders: {openai: {upstream: 'http://127.0.0.1:9/v1'}}\n")
    with pytest.raises(BindFailed) as failed:
        await _serve(config, str(tmp_path / "slotproxy.yaml"), "127.0.0.1", port)
    assert str(failed.value) == (f'cannot listen on 127.0.0.1:{port}: the port is in use (by pid {pid} '
                                 f'"{PYTHON} holder.py"); stop it or choose another port with --port')
    assert failed.value.__cause__ is None and failed.value.__suppress_context__


# --- the address is not available ---------------------------------------------------------------


def test_serve_on_an_address_this_machine_does_not_have(config: Path) -> None:
    port = free_port()
    result = run("serve", "--config", str(config), "--host", NOT_HERE, "--port", str(port),
                 env={"SLOTPROXY_ADMIN_TOKEN": "a-token-so-the-non-loopback-bind-is-allowed"})
    assert_one_line(result, f"slotproxy: cannot listen on {NOT_HERE}:{port}: the address is not available (no "
                            f"network interface of this machine has {NOT_HERE}); choose one it has with --host "
                            "(127.0.0.1: this machine only; 0.0.0.0: every interface)")


def test_serve_on_a_host_name_that_does_not_resolve(config: Path) -> None:
    port = free_port()
    result = run("serve", "--config", str(config), "--host", "no-such-host.invalid", "--port", str(port),
                 env={"SLOTPROXY_ADMIN_TOKEN": "a-token-so-the-non-loopback-bind-is-allowed"})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith(f"slotproxy: cannot listen on no-such-host.invalid:{port}: the host name does not "
                           "resolve to an address (")
    assert line.endswith("); give an IP address with --host, such as 127.0.0.1")


def test_demo_on_an_address_this_machine_does_not_have() -> None:
    """The demo listens on 127.0.0.1, free ports: the address is what can fail (here made one no interface has)."""
    script = ("import sys, proxy.tools.demo as demo; demo.HOST = sys.argv[1]; from proxy.cli import main; "
              "sys.exit(main(['demo', '--duration', '0.1', '--agents', '1']))")
    result = subprocess.run([sys.executable, "-c", script, NOT_HERE], cwd=REPO, capture_output=True, text=True,
                            timeout=60, check=False)
    assert_one_line(result, f"slotproxy: cannot listen on {NOT_HERE}:0 (any free port): the address is not "
                            f"available (no network interface of this machine has {NOT_HERE}); bring up an "
                            "interface with that address (ip addr lists them)")


def test_the_demo_advice_for_its_own_loopback_address() -> None:
    missing = OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")
    assert describe(missing, "127.0.0.1", 0, port_flag=None, host_flag=None) == (
        "cannot listen on 127.0.0.1:0 (any free port): the address is not available (no network interface of "
        "this machine has 127.0.0.1); bring up the loopback interface (ip link set lo up)")
    exhausted = OSError(errno.EADDRINUSE, "Address already in use")
    assert describe(exhausted, "127.0.0.1", 0, port_flag=None, host_flag=None) == (
        "cannot listen on 127.0.0.1:0 (any free port): no free port is left on this address; close some "
        "connections and try again")


# --- permission denied -----------------------------------------------------------------------------


DROP_AND_EXEC = textwrap.dedent("""\
    import ctypes, os, sys
    PR_CAPBSET_DROP, CAP_NET_BIND_SERVICE = 24, 10
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_CAPBSET_DROP, CAP_NET_BIND_SERVICE, 0, 0, 0) != 0:
        sys.exit(f"cannot drop CAP_NET_BIND_SERVICE: {os.strerror(ctypes.get_errno())}")
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
    """)
"""Drop CAP_NET_BIND_SERVICE from the bounding set, then exec the rest of the command line: even root comes
out of that exec without it (as ``setpriv --bounding-set -net_bind_service`` does)."""


def run_unprivileged(*args: str) -> subprocess.CompletedProcess[str]:
    command = [*args] if os.geteuid() != 0 else ["-c", DROP_AND_EXEC, *args]
    return subprocess.run([sys.executable, *command], cwd=REPO, capture_output=True, text=True, timeout=60,
                          check=False)


@pytest.fixture
def privileged_port() -> int:
    """A port below the first unprivileged one, that this test's commands cannot bind.

    Run as root (as CI's container does), the commands drop CAP_NET_BIND_SERVICE first; skipped only where
    that cannot be done, or where every port is unprivileged (net.ipv4.ip_unprivileged_port_start = 0).
    """
    first_free = unprivileged_port_start()
    if first_free <= 1:
        pytest.skip("every port is unprivileged here (net.ipv4.ip_unprivileged_port_start is 0)")
    port = first_free - 1
    probe = ("import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
             f"try:\n    s.bind(('127.0.0.1', {port}))\nexcept PermissionError:\n    print('denied')")
    done = run_unprivileged("-c", probe)
    if done.stdout.strip() != "denied":
        pytest.skip(f"port {port} can be bound here without CAP_NET_BIND_SERVICE, or it cannot be dropped: "
                    f"{done.stderr.strip()}")
    return port


def test_serve_on_a_privileged_port(privileged_port: int, config: Path) -> None:
    first_free = privileged_port + 1
    result = run_unprivileged("-m", "proxy", "serve", "--config", str(config), "--port", str(privileged_port))
    assert_one_line(result, f"slotproxy: cannot listen on 127.0.0.1:{privileged_port}: permission denied (ports "
                            f"below {first_free} need root or the CAP_NET_BIND_SERVICE capability); choose a port "
                            f"from {first_free} up with --port, or run it with CAP_NET_BIND_SERVICE")


def test_fake_upstream_on_a_privileged_port(privileged_port: int) -> None:
    first_free = privileged_port + 1
    result = run_unprivileged("-m", "proxy", "fake-upstream", "--port", str(privileged_port))
    assert_one_line(result, f"slotproxy: cannot listen on 127.0.0.1:{privileged_port}: permission denied (ports "
                            f"below {first_free} need root or the CAP_NET_BIND_SERVICE capability); choose a port "
                            f"from {first_free} up with --port, or run it with CAP_NET_BIND_SERVICE")


def test_permission_denied_above_the_privileged_ports_blames_the_policy() -> None:
    denied = OSError(errno.EACCES, "Permission denied")
    assert describe(denied, "127.0.0.1", 65000) == (
        "cannot listen on 127.0.0.1:65000: permission denied by the operating system (a security policy such as "
        "SELinux or AppArmor); choose another port with --port")


def test_other_errors_are_not_dressed_up_as_bind_failures() -> None:
    assert describe(OSError(errno.EMFILE, "Too many open files"), "127.0.0.1", 8787) is None


def test_the_probe_lets_go_of_what_it_bound() -> None:
    from proxy.server.bind import probe

    port = free_port()
    probe("127.0.0.1", port)
    with socket.socket() as again:  # no SO_REUSEADDR: nothing of the probe's may linger
        again.bind(("127.0.0.1", port))


# --- a port a server let go of a moment ago --------------------------------------------------------

PLAIN = "state: {path: null}\nledger: {path: null}\nproviders: {openai: {upstream: 'http://127.0.0.1:9/v1'}}\n"


def run_in(loop: str, main: Coroutine[Any, Any, T]) -> T:
    """``main`` in a fresh event loop: ``asyncio``'s own, or ``uvloop`` (what ``serve`` runs on)."""
    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        return cast(T, uvloop.run(main))
    return asyncio.run(main)


def time_wait_sockets(port: int) -> int:
    """How many TCP sockets on local ``port`` are in TIME-WAIT (state 06 in ``/proc/net/tcp``)."""
    lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return sum(1 for line in lines if int(line.split()[1].split(":")[1], 16) == port and line.split()[3] == "06")


async def served_and_stopped() -> int:
    """A plain ``serve`` on a port of its own that served three clients, closing each connection first (the
    clients asked for ``Connection: close``), then stopped: its port, listening nowhere, in TIME-WAIT."""
    runner, port = await start_server(ProxyState(parse_config(PLAIN)), "127.0.0.1", 0)
    try:
        for _ in range(3):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
            assert (await asyncio.wait_for(reader.read(), 5)).startswith(b"HTTP/1.1 200 ")
            writer.close()
            await writer.wait_closed()
    finally:
        await runner.cleanup()
    return port


async def two_workers_on(port: int) -> list[int]:
    """What ``serve --workers 2`` binds, in this loop: the parent's reservation, then two listeners beside it."""
    reservation = reserve("127.0.0.1", port)
    runners = []
    try:
        for _ in range(2):
            runners.append(await start_server(ProxyState(parse_config(PLAIN)), "127.0.0.1", port, reuse_port=True))
    finally:
        for runner, _ in runners:
            await runner.cleanup()
        reservation.close()
    return [bound for _, bound in runners]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_workers_bind_a_port_whose_last_server_closed_connections_a_moment_ago(loop: str) -> None:
    """Its connections wait in TIME-WAIT for a minute, listening nowhere; a reservation without
    ``SO_REUSEADDR`` took them for another program."""
    port = run_in(loop, served_and_stopped())
    assert time_wait_sockets(port) >= 1
    assert run_in(loop, two_workers_on(port)) == [port, port]


def spawn_fleet(config: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as err:
        return subprocess.Popen([sys.executable, "-m", "proxy", "serve", "--config", str(config), "--port", str(port),
                                 "--workers", "2"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)


async def test_serve_with_workers_starts_on_a_port_whose_last_server_closed_connections_a_moment_ago(
        tmp_path: Path) -> None:
    require_redis()
    port = await served_and_stopped()
    assert time_wait_sockets(port) >= 1
    prefix = f"slotproxy-test-{uuid.uuid4().hex[:10]}"
    config = tmp_path / "slotproxy.yaml"
    config.write_text(PLAIN.replace("ledger: {path: null}\n", f"backend: {{kind: redis, url: '{REDIS_URL}', "
                                    f"key_prefix: {prefix}}}\nserver: {{shutdown_grace: 1s}}\n"))
    log = tmp_path / "stderr.log"
    fleet = spawn_fleet(config, port, log)
    try:
        deadline = time.monotonic() + 20
        while "dashboard: " not in log.read_text() and fleet.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert "with 2 workers" in log.read_text(), log.read_text()
        fleet.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(fleet.wait, 20) == 0, log.read_text()
    finally:
        if fleet.poll() is None:
            fleet.kill()
            fleet.wait()
        delete_prefix(REDIS_URL, prefix)


def test_a_reservation_still_names_the_program_that_listens_on_the_port(held_port) -> None:
    port, pid = held_port
    with pytest.raises(BindFailed) as failed:
        reserve("127.0.0.1", port)
    assert str(failed.value) == (f'cannot listen on 127.0.0.1:{port}: the port is in use (by pid {pid} '
                                 f'"{PYTHON} holder.py"); stop it or choose another port with --port')
