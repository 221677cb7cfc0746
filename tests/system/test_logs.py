"""What the log says: a reload names what changed and repeats no warning; a 429 storm is summarised.

A storm is logged as its first backoff at once, then at most one line a second per
provider while it lasts, and one last line when it has calmed down, while the
metrics still count every event, on the memory and the Redis backend alike.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from proxy.config import load_config
from proxy.http.runtime import ProxyState
from proxy.limiter import FakeClock
from proxy.logs import BackoffLog
from proxy.server.run import ConfigWatcher

from ..conftest import Proxy, chat, wait_until

T0 = 1_700_000_000.0


def clock_time(epoch: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(epoch))


def lines(caplog: pytest.LogCaptureFixture, logger: str = "slotproxy.backoff") -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == logger]


# ----- the summary, on fake time ----------------------------------------------------------------------------


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(T0)


def test_a_storm_is_its_first_event_at_once_then_a_line_a_second_then_a_last_one(clock, caplog) -> None:
    caplog.set_level(logging.INFO, logger="slotproxy.backoff")
    log = BackoffLog(clock)
    limit = 8
    for n in range(15):  # one 429 every 0.35 s for 4.9 s; each pauses 6 s and lowers the limit down to 3
        after = max(3, limit - 1)
        log.event("openai", "429", limit_before=limit, limit_after=after, paused_until=clock.time() + 6)
        limit = after
        if n == 0:
            assert lines(caplog) == [f"openai: upstream 429; limit 8 → 7; paused until {clock_time(T0 + 6)} (in 6 s)"]
        if n < 14:
            clock.advance(0.35)
    clock.advance(10)
    assert lines(caplog) == [
        f"openai: upstream 429; limit 8 → 7; paused until {clock_time(T0 + 6)} (in 6 s)",
        f"openai: 3 upstream 429s in the last 1 s; limit 8 → 5; paused until {clock_time(T0 + 6.7)} (in 6 s)",
        f"openai: 6 upstream 429s in the last 2 s; limit 8 → 3; paused until {clock_time(T0 + 7.75)} (in 6 s)",
        f"openai: 9 upstream 429s in the last 3 s; limit 8 → 3; paused until {clock_time(T0 + 8.8)} (in 6 s)",
        f"openai: 12 upstream 429s in the last 4 s; limit 8 → 3; paused until {clock_time(T0 + 9.85)} (in 6 s)",
        f"openai: 15 upstream 429s in the last 5 s; limit 8 → 3; paused until {clock_time(T0 + 10.9)} (in 6 s)",
        # no 429 for one second after the last pause ended
        "openai: calm again after 15 upstream 429s in 5 s; limit 8 → 3",
    ]
    assert len(lines(caplog)) <= math.ceil(4.9) + 2


def test_a_burst_under_a_long_pause_is_counted_a_second_later_and_summed_up_when_the_pause_is_over(
        clock, caplog) -> None:
    caplog.set_level(logging.INFO, logger="slotproxy.backoff")
    log = BackoffLog(clock)
    for n in range(15):  # one burst of in-flight requests: one reduction, one 30 s pause
        log.event("openai", "429", limit_before=8 if n == 0 else 7, limit_after=7, paused_until=T0 + 30)
        clock.advance(0.01)
    clock.advance(35)
    assert lines(caplog) == [
        f"openai: upstream 429; limit 8 → 7; paused until {clock_time(T0 + 30)} (in 30 s)",
        f"openai: 15 upstream 429s in the last 1 s; limit 8 → 7; paused until {clock_time(T0 + 30)} (in 29 s)",
        "openai: calm again after 15 upstream 429s in 0.1 s; limit 8 → 7",
    ]


def test_one_backoff_is_one_line_and_each_provider_and_key_has_its_own(clock, caplog) -> None:
    caplog.set_level(logging.INFO, logger="slotproxy.backoff")
    log = BackoffLog(clock)
    log.event("anthropic", "529", limit_before=4, limit_after=4, paused_until=T0 + 5)
    log.event("openai", "429", key="team-a", limit_before=2, limit_after=1, paused_until=T0 + 0.3)
    clock.advance(0.5)
    log.event("openai", "rate_limit_error", key="team-b", limit_before=2, limit_after=1, paused_until=T0 + 1.5)
    clock.advance(10)
    assert lines(caplog) == [
        f"anthropic: upstream 529; paused until {clock_time(T0 + 5)} (in 5 s)",
        f"openai: upstream 429; key team-a: limit 2 → 1, paused until {clock_time(T0 + 0.3)} (in 0.3 s)",
        ("openai: 1 upstream 429 and 1 upstream rate_limit_error in the last 1 s; key team-a: limit 2 → 1; "
         f"key team-b: limit 2 → 1, paused until {clock_time(T0 + 1.5)} (in 0.5 s)"),
        ("openai: calm again after 1 upstream 429 and 1 upstream rate_limit_error in 0.5 s; "
         "key team-a: limit 2 → 1; key team-b: limit 2 → 1"),
    ]


def test_the_storm_lines_say_how_many_429s_reached_clients(clock, caplog) -> None:
    caplog.set_level(logging.INFO, logger="slotproxy.backoff")
    log = BackoffLog(clock)
    for n in range(21):  # a 429 every 0.1 s; every fourth one ran out of retries and reached its client
        log.event("openai", "429", limit_before=4, limit_after=4, paused_until=clock.time() + 0.5)
        if n % 4 == 3:
            log.relayed("openai")
        clock.advance(0.1)
    clock.advance(10)
    said = lines(caplog)
    assert said[0] == f"openai: upstream 429; paused until {clock_time(T0 + 0.5)} (in 0.5 s)"
    assert said[-1] == "openai: calm again after 21 upstream 429s in 2 s, 5 relayed to clients"
    assert re.fullmatch(r"openai: 11 upstream 429s in the last 1 s, 2 relayed to clients; paused until .*", said[1])
    assert log.relayed_total("openai") == 5
    log.relayed("openai")  # no storm going on: counted, not logged
    assert (log.relayed_total("openai"), log.relayed_total("other"), len(lines(caplog))) == (6, 0, len(said))


# ----- reloads ------------------------------------------------------------------------------------------------


UNSET_A = ("providers.openai.api_key_env names $SP_LOGS_UNSET_A, which is unset or empty: requests to this "
           "provider carry the client's own credentials until it is set")
UNSET_B = ("providers.anthropic.api_key_env names $SP_LOGS_UNSET_B, which is unset or empty: requests to this "
           "provider carry the client's own credentials until it is set")


def write(path: Path, openai_limit: int, *, anthropic: bool = False, comment: str = "") -> None:
    text = textwrap.dedent(f"""\
        {comment}
        state: {{path: null}}
        providers:
          openai: {{upstream: 'https://api.openai.com/v1', limit: {openai_limit}, api_key_env: SP_LOGS_UNSET_A}}
        """)
    if anthropic:
        text += ("  anthropic: {upstream: 'https://api.anthropic.com', auth: x-api-key, limit: 2,\n"
                 "              api_key_env: SP_LOGS_UNSET_B}\n")
    path.write_text(text)


@pytest.fixture
def watched(tmp_path: Path, monkeypatch) -> Iterator[tuple[Path, ProxyState, ConfigWatcher]]:
    monkeypatch.delenv("SP_LOGS_UNSET_A", raising=False)
    monkeypatch.delenv("SP_LOGS_UNSET_B", raising=False)
    path = tmp_path / "slotproxy.yaml"
    write(path, 8)
    state = ProxyState(load_config(path), config_path=str(path))
    yield path, state, ConfigWatcher(state, str(path))


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "slotproxy"]


async def test_a_reload_that_changes_a_limit_says_what_changed(watched, caplog) -> None:
    path, state, watcher = watched
    caplog.set_level(logging.INFO, logger="slotproxy")
    write(path, 3, anthropic=True)
    assert watcher.reload("file changed")
    assert "config reloaded (file changed): openai.limit 8 → 3, providers added: anthropic" in messages(caplog)
    assert state.backend.provider_status("openai").limit == 3


async def test_a_reload_with_no_effective_change_says_so(watched, caplog) -> None:
    path, _, watcher = watched
    caplog.set_level(logging.INFO, logger="slotproxy")
    write(path, 8, comment="# only a comment changed")
    assert watcher.reload("SIGHUP")
    assert messages(caplog) == ["config reloaded (SIGHUP): no effective change"]


async def test_a_reload_repeats_no_unchanged_warning_but_logs_a_new_one(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.delenv("SP_LOGS_UNSET_A", raising=False)
    monkeypatch.delenv("SP_LOGS_UNSET_B", raising=False)
    path = tmp_path / "slotproxy.yaml"
    write(path, 8)
    caplog.set_level(logging.INFO, logger="slotproxy")
    state = ProxyState(load_config(path), config_path=str(path))
    watcher = ConfigWatcher(state, str(path))
    assert messages(caplog) == [UNSET_A], "at start-up every warning is logged once"

    caplog.clear()
    write(path, 6)
    watcher.reload("file changed")
    assert messages(caplog) == ["config reloaded (file changed): openai.limit 8 → 6"]

    caplog.clear()
    write(path, 6, anthropic=True)
    watcher.reload("file changed")
    assert messages(caplog) == [UNSET_B, "config reloaded (file changed): providers added: anthropic"]

    caplog.clear()
    write(path, 6)
    watcher.reload("file changed")
    write(path, 6, anthropic=True)
    watcher.reload("file changed")
    assert messages(caplog) == [
        "config reloaded (file changed): providers removed: anthropic",
        UNSET_B,
        "config reloaded (file changed): providers added: anthropic",
    ], "a warning that went away and came back is logged again"


# ----- a storm through a real proxy -----------------------------------------------------------------------------


PAUSE = r"paused until \d\d:\d\d:\d\d \(in 0\.[12] s\)"


def storm_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Every line about the provider: the summaries, and any line of the old kind (one per pause, reduction
    and retry) that would name it."""
    return [record.getMessage() for record in caplog.records
            if record.name.startswith("slotproxy") and re.search(r"\bopenai\b", record.getMessage())]


async def test_a_storm_of_429s_is_summarised_and_every_one_is_counted(
        start_upstream, start_proxy, client: aiohttp.ClientSession, backend_yaml, caplog) -> None:
    caplog.set_level(logging.INFO)
    upstream = await start_upstream(retry_after=0.2)
    proxy: Proxy = await start_proxy(
        f"state: {{path: null}}\n{backend_yaml}providers:\n"
        f"  openai: {{upstream: '{upstream.url}/v1', limit: 8, retry_on_429: 0}}\n")
    url = f"{proxy.url}/openai/chat/completions"
    answered: list[float] = []

    async def one() -> int:
        async with client.post(url, json=chat(), headers={"x-fake-status": "429"}) as resp:
            await resp.read()
            answered.append(time.monotonic())
            return resp.status

    assert await one() == 429
    await wait_until(lambda: bool(storm_lines(caplog)), timeout=0.3, what="the first 429 logged at once")
    assert re.fullmatch(rf"openai: upstream 429; limit 8 → 7; {PAUSE}", storm_lines(caplog)[0]), storm_lines(caplog)

    rest = []
    for _ in range(14):  # one every 0.2 s, each after the pause the one before caused
        await asyncio.sleep(0.2)
        rest.append(asyncio.create_task(one()))
    assert await asyncio.gather(*rest) == [429] * 14
    duration = answered[-1] - answered[0]
    await wait_until(lambda: "calm again" in storm_lines(caplog)[-1], timeout=5, what="the storm's last line")

    await proxy.state.backend.flush()
    await proxy.state.backend.refresh()
    limit = proxy.status()["limit"]
    said = storm_lines(caplog)
    assert len(said) <= math.ceil(duration) + 2, (duration, said)
    assert re.fullmatch(rf"openai: calm again after 15 upstream 429s in \d s, 15 relayed to clients; limit 8 → {limit}",
                        said[-1]), said
    counts = []
    for line in said[1:-1]:
        match = re.fullmatch(rf"openai: (\d+) upstream 429s in the last (\d) s, \d+ relayed to clients; "
                             rf"limit 8 → \d(; {PAUSE})?", line)
        assert match, said
        counts.append(int(match.group(1)))
    assert counts == sorted(counts) and all(1 < count <= 15 for count in counts), said

    metrics = proxy.state.metrics.render().decode()
    assert 'slotproxy_upstream_backoff_total{provider="openai",status="429"} 15.0' in metrics
    assert f'slotproxy_auto_reductions_total{{provider="openai"}} {8 - limit}.0' in metrics
    assert proxy.status()["relayed_429"] == 15
    assert upstream.fake.stats()["rate_limited"] == 15
