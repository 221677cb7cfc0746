"""The Redis backend's script batches against a real Redis: what each call gets back, and how a batch
recovers from a Redis that forgot its scripts or dropped the batches' connection."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from proxy.backends.redis.client import ScriptBatch, packing_in_c, reconnect_once

from .conftest import REDIS_URL, PrivateRedis, require_redis

pytestmark = pytest.mark.asyncio

SCRIPTS = {
    "ECHO": "return ARGV[1]",
    "REFUSE": "return redis.error_reply('refused by the script')",
    "SUM": "return tonumber(ARGV[1]) + tonumber(ARGV[2])",
}


def batch_client(url: str) -> aioredis.Redis:
    name = f"slotproxy-batch-test-{uuid.uuid4().hex[:8]}"
    pool = aioredis.BlockingConnectionPool.from_url(url, retry=reconnect_once(), client_name=name)
    pool.connection_class = packing_in_c(pool.connection_class)
    return aioredis.Redis(connection_pool=pool)


@pytest.fixture
async def redis_client() -> AsyncIterator[aioredis.Redis]:
    require_redis()
    client = batch_client(REDIS_URL)
    yield client
    await client.aclose(close_connection_pool=True)


@pytest.fixture
async def own_redis_client(private_redis: PrivateRedis) -> AsyncIterator[aioredis.Redis]:
    """On a Redis of the test's own: SCRIPT FLUSH empties a whole server's script cache, not one client's."""
    client = batch_client(private_redis.url)
    yield client
    await client.aclose(close_connection_pool=True)


async def test_each_call_of_a_batch_gets_its_own_answer_and_an_error_only_its_own(redis_client) -> None:
    batch = ScriptBatch(redis_client, SCRIPTS)
    calls = [batch.call("ECHO", keys=[], args=("a",)), batch.call("REFUSE", keys=[], args=()),
             batch.call("SUM", keys=[], args=(2, 40)), batch.call("ECHO", keys=[], args=("é",))]
    answers = await asyncio.gather(*calls, return_exceptions=True)
    await batch.close()
    assert answers[0] == b"a" and answers[2] == 42 and answers[3] == "é".encode()
    assert isinstance(answers[1], ResponseError) and "refused by the script" in str(answers[1])


async def test_scripts_a_flushed_redis_forgot_are_loaded_again(own_redis_client) -> None:
    batch = ScriptBatch(own_redis_client, SCRIPTS)
    assert await batch.call("SUM", keys=[], args=(1, 1)) == 2
    await own_redis_client.script_flush()
    answers = await asyncio.gather(batch.call("SUM", keys=[], args=(2, 2)), batch.call("ECHO", keys=[], args=("x",)))
    await batch.close()
    assert answers == [4, b"x"]


async def test_a_call_whose_script_the_redis_does_not_know_yet_keeps_its_turn(own_redis_client) -> None:
    """The first call of a script is not sent again after the calls made after it (a replica's first RELEASE
    ran after its next ENQUEUE, which then saw the slot still held)."""
    batch = ScriptBatch(own_redis_client, {"GET": "return redis.call('GET', KEYS[1])",
                                           "SET": "return redis.call('SET', KEYS[1], ARGV[1])"})
    assert await batch.call("GET", keys=["k"], args=()) is None  # GET is known to this Redis now; SET is not
    written = batch.call("SET", keys=["k"], args=("v",))
    read = batch.call("GET", keys=["k"], args=())
    assert await asyncio.gather(written, read) == [b"OK", b"v"]
    await batch.close()


async def test_a_killed_connection_is_opened_again_for_the_next_batch(redis_client) -> None:
    batch = ScriptBatch(redis_client, SCRIPTS)
    assert await batch.call("ECHO", keys=[], args=("before",)) == b"before"
    name = redis_client.connection_pool.connection_kwargs["client_name"]
    own = [client["id"] for client in await redis_client.client_list() if client.get("name") == name
           and client.get("cmd") != "client|list"]
    assert own, "the batches' connection is listed under the pool's client name"
    for client_id in own:
        await redis_client.client_kill_filter(_id=client_id)
    assert await batch.call("ECHO", keys=[], args=("after",)) == b"after"
    await batch.close()


async def test_a_closed_batch_ends_the_batch_in_flight_and_never_opens_its_connection_again(redis_client) -> None:
    """A write issued while the backend closes (a release from a cancelled task, say) must not reconnect:
    a connection opened after close outlives the event loop."""
    batch = ScriptBatch(redis_client, {**SCRIPTS, "SLOW": "local t = redis.call('TIME') "
                                       "repeat local n = redis.call('TIME') until (n[1] - t[1]) * 1000000 "
                                       "+ (n[2] - t[2]) > 200000 return 1"})
    assert await batch.call("ECHO", keys=[], args=("up",)) == b"up"
    in_flight = batch.call("SLOW", keys=[], args=())
    await asyncio.sleep(0.05)
    await batch.close()
    with pytest.raises(RedisError):
        await in_flight
    with pytest.raises(RedisError, match="closed"):
        await batch.call("ECHO", keys=[], args=("late",))
    await asyncio.sleep(0.3)  # the slow script has ended on the server
    name = redis_client.connection_pool.connection_kwargs["client_name"]
    batch_connections = [c for c in await redis_client.client_list() if c.get("name") == name]
    assert len(batch_connections) == 1, "only the test's own client is connected"
