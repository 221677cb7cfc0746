"""Loopback ports for what a test starts on a port of its own: a ``serve --port`` subprocess, a Redis server, a
Cluster node (which also listens on its port + 10 000, the cluster bus).

A port is checked free when it is handed out, but the process that binds it starts later. In that gap:

- an outgoing connection could take it as its local port: the ports come from below the kernel's ephemeral
  range (32 768 up on Linux, 49 152 up on macOS), which connections never take;
- another pytest-xdist worker could be handed the same one: each worker has a share of the range of its own;
- this process could hand it out twice (a test that takes two before starting either): each worker walks
  its share in turn, so a port comes round again only after all the others.
"""

from __future__ import annotations

import itertools
import os
import random
import socket

__all__ = ["BUS_OFFSET", "free_port", "free_ports", "worker_share"]

PORTS = range(10_000, 20_000)
"""Where ports are handed out from; a Cluster node's bus port (+ ``BUS_OFFSET``) falls in 20 000-29 999, where
nothing is handed out."""
BUS_OFFSET = 10_000


def worker_share(span: range = PORTS) -> range:
    """This process's part of ``span``: all of it without xdist, else an equal slice per worker."""
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    size = len(span) // count
    return span[index * size:(index + 1) * size]


_share = worker_share()
_start = random.randrange(len(_share))  # two runs on one machine (two checkouts) seldom start at one place
_turn = itertools.cycle([*_share[_start:], *_share[:_start]])


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, bus: bool = False) -> int:
    """A loopback port nothing listens on (also what tests use as an unreachable upstream); with ``bus``, its
    cluster bus port (+ ``BUS_OFFSET``) is free too."""
    for _ in range(len(_share)):
        port = next(_turn)
        if _bindable(port) and (not bus or _bindable(port + BUS_OFFSET)):
            return port
    raise RuntimeError(f"no free loopback port in {_share.start}-{_share.stop - 1}")


def free_ports(count: int, *, bus: bool = False) -> list[int]:
    """``count`` different free ports."""
    return [free_port(bus=bus) for _ in range(count)]
