"""A listening socket that cannot be bound, said in one line: what, why in words, and what to do.

``serve``, ``fake-upstream`` and ``demo`` report a bind failure through
:class:`BindFailed` (the CLI prints it after ``slotproxy:`` and exits 2) instead
of a traceback ending in ``OSError: [Errno 98]``::

    cannot listen on 127.0.0.1:8787: the port is in use (by pid 1234 "python3 -m proxy serve"); stop it or
    choose another port with --port

Which process holds a port is read where the OS says: the socket's inode from
``/proc/net/tcp`` and ``/proc/net/tcp6``, then the ``/proc/<pid>/fd`` that points
at it (only the processes this user may look into); anything unreadable is
left out of the message, never guessed.

Standard library only, imported lazily where it costs: this module is on the
path of every CLI call.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

TYPE_CHECKING = False  # typing's own costs an import on every CLI call; mypy reads this name the same
if TYPE_CHECKING:
    import socket
    from ipaddress import IPv4Address, IPv6Address

    _Address = IPv4Address | IPv6Address

__all__ = ["BindFailed", "describe", "failure", "find_holder", "probe"]

_LISTEN = "0A"
_BOUND = "07"  # TCP_CLOSE: bound, neither listening nor connected
_CMDLINE_SHOWN = 60

Holder = tuple[int, str]
"""A process holding a port: its pid and its command line (shortened)."""


class BindFailed(Exception):
    """A listener could not be bound; ``str()`` is the one line to print."""


def failure(exc: OSError, host: str, port: int, *, port_flag: str | None = "--port",
            host_flag: str | None = "--host") -> BindFailed | None:
    """``exc`` as a :class:`BindFailed` when it is a bind failure this module can explain, else None."""
    text = describe(exc, host, port, port_flag=port_flag, host_flag=host_flag)
    return None if text is None else BindFailed(text)


def probe(host: str, port: int, *, port_flag: str | None = "--port", host_flag: str | None = "--host") -> None:
    """Bind what a server on ``host``:``port`` would bind, and let go at once.

    Run before start-up logs anything, so a taken port is the only line the user
    sees. It binds as asyncio's ``create_server`` does (every address the host
    resolves to, ``SO_REUSEADDR``, IPv6 sockets v6-only) and never listens, so
    nothing lingers for the real bind. Raises :class:`BindFailed`.
    """
    import socket

    _, opened = bind_every_address(host, port, socket.SO_REUSEADDR, port_flag=port_flag, host_flag=host_flag)
    for sock in opened:
        sock.close()


def bind_every_address(host: str, port: int, *options: int, port_flag: str | None = "--port",
                       host_flag: str | None = "--host") -> tuple[int, list[socket.socket]]:
    """Bind, without listening, a socket per address ``host`` resolves to, each with the ``SOL_SOCKET``
    ``options`` set (IPv6 ones v6-only), all on one port (port 0: the first one's pick). Returns that port
    and the sockets; on a failure closes them and raises :class:`BindFailed` (or the OSError it cannot
    explain)."""
    import socket

    try:
        infos = socket.getaddrinfo(host or None, port, family=socket.AF_UNSPEC, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise BindFailed(_unresolved(exc, host, port, host_flag)) from None
    opened: list[socket.socket] = []
    chosen = port
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            opened.append(sock)
            for option in options:
                sock.setsockopt(socket.SOL_SOCKET, option, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((address[0], chosen, *address[2:]))
            chosen = sock.getsockname()[1]
    except OSError as exc:
        for sock in opened:
            sock.close()
        bound = failure(exc, host, port, port_flag=port_flag, host_flag=host_flag)
        if bound is None:
            raise
        raise bound from None
    return chosen, opened


def describe(exc: OSError, host: str, port: int, *, port_flag: str | None = "--port",
             host_flag: str | None = "--host",
             find: Callable[[str, int], Holder | None] | None = None) -> str | None:
    """The one line for a bind failure (without the ``slotproxy:`` prefix), or None for another error.

    ``find`` looks up the process holding the port (default :func:`find_holder`).
    """
    where = _where(host, port)
    if exc.errno == errno.EADDRINUSE:
        if port == 0:
            return (f"cannot listen on {where}: no free port is left on this address; close some connections "
                    "and try again")
        holder = (find or find_holder)(host, port)
        who = (f'the port is in use (by pid {holder[0]} "{holder[1]}")' if holder
               else "the port is in use by another program")
        advice = f"stop it or choose another port with {port_flag}" if port_flag else "stop it and try again"
        return f"cannot listen on {where}: {who}; {advice}"
    if exc.errno == errno.EADDRNOTAVAIL:
        why = f"the address is not available (no network interface of this machine has {_bare(host)})"
        if host_flag:
            advice = (f"choose one it has with {host_flag} (127.0.0.1: this machine only; 0.0.0.0: every "
                      "interface)")
        elif _is_loopback(host):
            advice = "bring up the loopback interface (ip link set lo up)"
        else:
            advice = "bring up an interface with that address (ip addr lists them)"
        return f"cannot listen on {where}: {why}; {advice}"
    if exc.errno in (errno.EACCES, errno.EPERM):
        first_free = unprivileged_port_start()
        if 0 < port < first_free:
            why = f"permission denied (ports below {first_free} need root or the CAP_NET_BIND_SERVICE capability)"
            choose = f"choose a port from {first_free} up with {port_flag}, or " if port_flag else ""
            return f"cannot listen on {where}: {why}; {choose}run it with CAP_NET_BIND_SERVICE"
        why = "permission denied by the operating system (a security policy such as SELinux or AppArmor)"
        advice = f"choose another port with {port_flag}" if port_flag else "check the system's security policy"
        return f"cannot listen on {where}: {why}; {advice}"
    return None


def unprivileged_port_start() -> int:
    """The lowest port an unprivileged process may bind (Linux's sysctl; 1024 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_unprivileged_port_start", encoding="ascii") as handle:
            return int(handle.read().strip())
    except (OSError, ValueError):
        return 1024


def find_holder(host: str, port: int) -> Holder | None:
    """The process that listens on (or has bound) ``port``, where ``/proc`` says so; else None."""
    inodes = _socket_inodes(host, port)
    if not inodes:
        return None
    try:
        pids = sorted((entry for entry in os.listdir("/proc") if entry.isdigit()), key=int)
    except OSError:
        return None
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:  # another user's process, or gone
            continue
        for fd in fds:
            try:
                if os.readlink(f"{fd_dir}/{fd}") in wanted:
                    return int(pid), _command_line(pid)
            except OSError:
                continue
    return None


def _socket_inodes(host: str, port: int) -> list[str]:
    """Inodes of TCP sockets bound to ``port`` whose address can clash with ``host``, listeners first."""
    wanted = _address_of(host)
    found: dict[str, list[str]] = {_LISTEN: [], _BOUND: []}
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            with open(table, encoding="ascii") as handle:
                lines = handle.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] not in found:
                continue
            address, _, hex_port = fields[1].partition(":")
            if int(hex_port, 16) != port or fields[9] == "0":
                continue
            local = _proc_address(address, width)
            if wanted is None or local is None or local.is_unspecified or local == wanted:
                found[fields[3]].append(fields[9])
    return found[_LISTEN] + found[_BOUND]


def _proc_address(text: str, width: int) -> _Address | None:
    """An address as ``/proc/net/tcp*`` writes it: 32-bit words in host byte order, as hex."""
    import ipaddress
    import sys

    try:
        raw = bytes.fromhex(text)
    except ValueError:
        return None
    if len(raw) != width:
        return None
    if sys.byteorder == "little":
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(raw)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _address_of(host: str) -> _Address | None:
    """``host`` as an IP address; None for a wildcard or a host name (then any address may clash)."""
    import ipaddress

    try:
        address = ipaddress.ip_address(_bare(host).split("%")[0])
    except ValueError:
        return None
    return None if address.is_unspecified else address


def _command_line(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            argv = [part.decode("utf-8", "replace") for part in handle.read().split(b"\0") if part]
    except OSError:
        argv = []
    if not argv:
        return "?"
    text = " ".join(" ".join([os.path.basename(argv[0]), *argv[1:]]).split())  # one line, however it was typed
    return text if len(text) <= _CMDLINE_SHOWN else text[:_CMDLINE_SHOWN - 1] + "…"


def _unresolved(exc: OSError, host: str, port: int, host_flag: str | None) -> str:
    reason = exc.strerror or str(exc)
    advice = f"give an IP address with {host_flag}, such as 127.0.0.1" if host_flag else "use an IP address"
    return (f"cannot listen on {_where(host, port)}: the host name does not resolve to an address "
            f"({reason}); {advice}")


def _bare(host: str) -> str:
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _where(host: str, port: int) -> str:
    shown = _bare(host) or "0.0.0.0"
    if ":" in shown:
        shown = f"[{shown}]"
    return f"{shown}:{port} (any free port)" if port == 0 else f"{shown}:{port}"


def _is_loopback(host: str) -> bool:
    address = _address_of(host)
    return host == "localhost" or (address is not None and address.is_loopback)
