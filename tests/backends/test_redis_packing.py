"""The Redis backend's connections pack commands with hiredis: the same bytes redis-py's own packer writes.

Every script call of the behaviour suite goes through these connections against a
real Redis; here the bytes themselves are compared with redis-py's pure-Python
packer, for the kinds of arguments the scripts are sent, and the connection class
is checked for each URL scheme.
"""

from __future__ import annotations

import pytest
from redis.asyncio.connection import (
    Connection,
    SSLConnection,
    UnixDomainSocketConnection,
)
from redis.exceptions import DataError

from proxy.backends.redis import RedisBackend
from proxy.backends.redis.client import packing_in_c

SCRIPT_ARGS = [
    ("EVALSHA", "3f" * 20, 3, "slotproxy:p:queue", "slotproxy:p:leases", "slotproxy:p:state"),
    ("EVALSHA", "ab" * 20, 1, "k", "replica-7", "workspace-é", "1", 1_800_000_000_123, "", 30000, -1, 0),
    ("SCRIPT LOAD", "return redis.call('TIME')"),
    ("EVALSHA", "cd" * 20, 0, b"raw bytes \x00\xff", "x" * 70_000),
]


@pytest.mark.parametrize("args", SCRIPT_ARGS, ids=["keys", "enqueue-like", "split-name", "bytes-and-large"])
def test_a_command_packs_to_the_bytes_redis_py_writes(args: tuple[object, ...]) -> None:
    packed = packing_in_c(Connection)().pack_command(*args)
    assert b"".join(packed) == b"".join(Connection().pack_command(*args))


def test_a_pipeline_packs_to_the_bytes_redis_py_writes() -> None:
    packed = packing_in_c(Connection)().pack_commands(SCRIPT_ARGS)
    assert b"".join(packed) == b"".join(Connection().pack_commands(SCRIPT_ARGS))


def test_an_argument_redis_cannot_take_is_refused_as_before() -> None:
    with pytest.raises(DataError):
        Connection().pack_command("EVALSHA", None)
    with pytest.raises(DataError):
        packing_in_c(Connection)().pack_command("EVALSHA", None)


@pytest.mark.parametrize(("url", "base"), [
    ("redis://127.0.0.1:6379/0", Connection),
    ("rediss://127.0.0.1:6380/0", SSLConnection),
    ("unix:///run/redis.sock", UnixDomainSocketConnection),
])
def test_every_url_scheme_gets_its_own_connection_class_packing_in_c(url: str, base: type) -> None:
    backend = RedisBackend(url)
    chosen = backend._redis.connection_pool.connection_class
    assert issubclass(chosen, base) and chosen is packing_in_c(base) and chosen is not base
