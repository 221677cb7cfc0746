"""``slotproxy status`` (issue 24, finding 4): clock times, the queue and the holders, ``--watch``, and one
line with exit 1 when no proxy answers.

Before, it printed ``PAUSED_UNTIL 1796284299940`` (raw epoch ms), no waiters and no holders, and a proxy
that was not running was ``cannot read status from ...: <urlopen error [Errno 111] Connection refused>``,
exit 2. The status documents here are built by the tests, in the shape ``GET /_slotproxy/status`` answers
(the ``holders`` list included: per provider, oldest first).
"""

from __future__ import annotations

import io
import json
import os
import pty
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from proxy.cli.status import format_status

from ..ports import free_port

REPO = Path(__file__).resolve().parents[2]
NOW = 1_796_284_287_440  # 2026-12-03 07:51:27.440 UTC; the PAUSED_UNTIL 1796284299940 is 12.5 s later
NOTICE = "Concurrency limit auto-reduced to 3 after a 429 — restore manually when ready."


def document(now: int = NOW) -> dict[str, Any]:
    return {
        "providers": [{
            "provider": "openai", "limit": 3, "configured_limit": 8, "in_flight": 3, "queued": 25,
            "paused": True, "paused_until": now + 12_500, "cooldown_ms": 0, "auto_reduced": True,
            "auto_reduced_from": 8, "notice": NOTICE, "websockets": 1,
            "queue": [
                {"workspace": "release-team", "starred": True, "prompt_started_at": now - 242_000,
                 "waited_ms": 1_200, "conversation": "conv-7", "transport": "websocket"},
                {"workspace": "web-app", "starred": False, "prompt_started_at": now - 5_000, "waited_ms": 4_000,
                 "conversation": None, "transport": "http"},
            ],
            "holders": [
                {"workspace": "data-pipeline", "starred": False, "conversation": "conv-1", "model": "gpt-5",
                 "key": "team-a", "transport": "http", "granted_at": now - 75_000, "held_ms": 75_000},
                {"workspace": "release-team", "starred": True, "conversation": None, "model": None, "key": None,
                 "transport": "websocket", "granted_at": now - 800, "held_ms": 800},
            ],
            "keys": [
                {"name": "team-a", "available": True, "limit": 2, "configured_limit": 4, "in_flight": 2,
                 "paused": False, "paused_until": None, "auto_reduced": True, "auto_reduced_from": 4, "notice": None,
                 "budget": {"remaining_requests": 0, "remaining_tokens": 12000, "reset_at": now + 95_000,
                            "held_until": now + 95_000}},
                {"name": "team-b", "available": False, "limit": 4, "configured_limit": 4, "in_flight": 0,
                 "paused": False, "paused_until": None, "auto_reduced": False, "auto_reduced_from": None,
                 "notice": None},
            ],
            "models": [{"pattern": "gpt-5*", "limit": 2, "configured_limit": 2, "in_flight": 1}],
        }, {
            "provider": "anthropic", "limit": None, "configured_limit": None, "in_flight": 0, "queued": 0,
            "paused": False, "paused_until": None, "cooldown_ms": 250, "notice": None, "queue": [], "holders": [],
            "keys": [], "models": [],
        }],
        "backend": {"kind": "memory", "healthy": True, "degraded": None},
        "config": {"path": "/etc/slotproxy.yaml", "loaded_at": now - 253_000, "error": None},
    }


@pytest.fixture
def utc() -> Iterator[None]:
    before = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    yield
    if before is None:
        del os.environ["TZ"]
    else:
        os.environ["TZ"] = before
    time.tzset()


def test_the_table_shows_clock_times_the_holders_and_the_queue(utc) -> None:
    assert format_status(document(), now_ms=NOW, url="http://127.0.0.1:8787").splitlines() == [
        "slotproxy at http://127.0.0.1:8787, 07:51:27",
        "",
        ("PROVIDER                LIMIT      CONFIGURED  IN_FLIGHT  QUEUED  "
         "STATE                                              COOLDOWN"),
        ("openai                  3          8           3          25      "
         "paused until 07:51:39 (in 12 s)                    0 ms"),
        ("  key team-a            2          4           2          -       "
         "held by its budget until 07:53:02 (in 1 min 35 s)  -"),
        ("  key team-b (not set)  4          4           0          -       "
         "-                                                  -"),
        ("  model gpt-5*          2          2           1          -       "
         "-                                                  -"),
        ("anthropic               unlimited  unlimited   0          0       "
         "-                                                  250 ms"),
        f"! openai: {NOTICE}",
        "  openai key team-a budget: 0 requests left, 12,000 tokens left, resets 07:53:02 (in 1 min 35 s)",
        "config /etc/slotproxy.yaml, loaded 07:47:14 (4 min 13 s ago)",
        "",
        "openai: 2 holding slots, longest held first",
        "  WORKSPACE      ★  CONVERSATION  MODEL  KEY     VIA        HELD FOR",
        "  data-pipeline     conv-1        gpt-5  team-a  HTTP       1 min 15 s",
        "  release-team   ★  -             -      -       WebSocket  0.8 s",
        "",
        "openai: 25 waiting, next to be admitted first",
        "  #  WORKSPACE     ★  PROMPT AGE  WAITING  VIA        CONVERSATION",
        "  1  release-team  ★  4 min 02 s  1.2 s    WebSocket  conv-7",
        "  2  web-app          5.0 s       4.0 s    HTTP       -",
        "  …and 23 more waiting",
    ]


def test_no_raw_epoch_milliseconds_anywhere(utc) -> None:
    text = format_status(document(), now_ms=NOW)
    for value in (NOW + 12_500, NOW + 95_000, NOW - 253_000, NOW - 75_000, NOW - 242_000):
        assert str(value) not in text


def test_a_pause_that_has_run_out_says_resuming_and_a_date_shows_when_not_today(utc) -> None:
    doc = document()
    doc["providers"][0]["paused_until"] = NOW - 300
    doc["config"]["loaded_at"] = NOW - 3 * 86_400_000
    text = format_status(doc, now_ms=NOW)
    assert "paused until 07:51:27 (resuming)" in text
    assert "config /etc/slotproxy.yaml, loaded 2026-11-30 07:51:27 (3 d 0 h ago)" in text


def test_a_pool_whose_every_key_is_held_by_its_budget(utc) -> None:
    doc = document()
    provider = doc["providers"][0]
    provider["paused_until"] = None
    provider["keys"] = [{**provider["keys"][0], "name": name, "budget": {"held_until": NOW + hold}}
                        for name, hold in (("a", 30_000), ("b", 20_000))]
    assert "every key held by its budget until 07:51:47 (in 20 s)" in format_status(doc, now_ms=NOW)


def test_the_server_clock_is_what_relative_times_count_from(utc) -> None:
    """A proxy whose clock runs 10 minutes ahead: its times are shown on this machine's clock."""
    skew = 600_000
    text = format_status(document(NOW + skew), now_ms=NOW + skew, skew_ms=skew)
    assert "paused until 07:51:39 (in 12 s)" in text


# --- the command -----------------------------------------------------------------------------------


class _StatusServer(ThreadingHTTPServer):
    daemon_threads = True
    body: bytes = b""


class _Handler(BaseHTTPRequestHandler):
    server: _StatusServer

    def do_GET(self) -> None:
        if self.path != "/_slotproxy/status":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.server.body)))
        self.end_headers()
        self.wfile.write(self.server.body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def status_url() -> Iterator[str]:
    """A stand-in proxy that answers ``GET /_slotproxy/status`` with ``document()`` (times from now)."""
    server = _StatusServer(("127.0.0.1", 0), _Handler)
    server.body = json.dumps(document(int(time.time() * 1000))).encode()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def cli(*args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, check=False, **kwargs)


@contextmanager
def ctrl_c_reaches_children() -> Iterator[None]:
    """A test run from a shell's background job ignores SIGINT, and its children would inherit that."""
    before = signal.getsignal(signal.SIGINT)
    if before is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def test_status_prints_the_table_from_a_running_proxy(status_url: str) -> None:
    result = cli("status", "--url", status_url)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"slotproxy at {status_url}, ")
    assert any(line.startswith("openai ") and "paused until " in line and "(in 1" in line for line in lines), lines
    assert "openai: 25 waiting, next to be admitted first" in lines
    assert "openai: 2 holding slots, longest held first" in lines


def test_status_json_is_the_document(status_url: str) -> None:
    result = cli("status", "--url", status_url, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["providers"][0]["holders"][0]["workspace"] == "data-pipeline"


def test_status_with_no_proxy_running_is_one_line_and_exit_1() -> None:
    port = free_port()
    for extra in ([], ["--json"], ["--watch"]):
        result = cli("status", "--url", f"http://127.0.0.1:{port}", *extra)
        assert result.returncode == 1, (extra, result.stderr)
        assert result.stderr.splitlines() == [
            (f"slotproxy: no slotproxy answers at http://127.0.0.1:{port} (connection refused); start it with "
             "`slotproxy serve`, or pass --url")], extra
        assert result.stdout == ""


def test_status_url_may_be_host_and_port_only() -> None:
    port = free_port()
    result = cli("status", "--url", f"localhost:{port}")
    assert result.returncode == 1
    assert f"no slotproxy answers at http://localhost:{port} (connection refused)" in result.stderr


def test_status_help_documents_url_and_its_default() -> None:
    result = cli("status", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "--url URL the running proxy's base URL (default: http://127.0.0.1:8787)" in text
    assert "--watch [SECONDS]" in text


def _read_until(fd: int, predicate: Any, timeout: float = 20) -> bytes:
    data = b""
    deadline = time.monotonic() + timeout
    while not predicate(data):
        left = deadline - time.monotonic()
        assert left > 0, f"timed out; got {data!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the pty's other side is closed
                break
            if not chunk:
                break
            data += chunk
    return data


def test_watch_on_a_pipe_prints_a_block_per_refresh_and_ctrl_c_exits_0(status_url: str) -> None:
    with ctrl_c_reaches_children(), subprocess.Popen(
            [sys.executable, "-m", "proxy", "status", "--url", status_url, "--watch", "0.2"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:
        assert process.stdout is not None and process.stderr is not None
        heading = f"slotproxy at {status_url}, ".encode()
        data = _read_until(process.stdout.fileno(), lambda seen: seen.count(heading) >= 3)
        process.send_signal(signal.SIGINT)
        rest, err = process.communicate(timeout=20)
    text = (data + rest).decode()
    assert process.returncode == 0, err
    assert err == b""
    assert "\x1b[" not in text
    blocks = text.split(f"\n\nslotproxy at {status_url}, ")
    assert len(blocks) >= 3
    assert all("openai: 25 waiting, next to be admitted first" in block for block in blocks)


def test_watch_on_a_terminal_redraws_in_place_and_ctrl_c_exits_0(status_url: str) -> None:
    leader, follower = pty.openpty()
    try:
        with ctrl_c_reaches_children(), subprocess.Popen(
                [sys.executable, "-m", "proxy", "status", "--url", status_url, "--watch", "0.2"],
                cwd=REPO, stdout=follower, stderr=subprocess.PIPE) as process:
            os.close(follower)
            follower = -1
            data = _read_until(leader, lambda seen: seen.count(b"\x1b[H") >= 3)
            process.send_signal(signal.SIGINT)
            _, err = process.communicate(timeout=20)
            data += _read_until(leader, lambda seen: seen.endswith(b"\x1b[?25h"), timeout=5)
    finally:
        os.close(leader)
        if follower != -1:
            os.close(follower)
    assert process.returncode == 0, err
    assert err == b""
    assert data.count(b"\x1b[2J") == 1  # the screen is cleared once; each refresh goes home and overwrites
    assert data.endswith(b"\x1b[?25h")  # the cursor is shown again
    assert b"openai: 25 waiting, next to be admitted first" in data


def test_a_limit_set_by_hand_relayed_429s_and_a_missing_config_file_are_said(utc) -> None:
    doc = document()
    anthropic = doc["providers"][1]
    anthropic.update(limit=6, configured_limit=4, manual=True, manual_set_at=NOW - 60_000, relayed_429=21)
    doc["providers"][0]["keys"][1].update(limit=1, manual=True, manual_set_at=None)
    doc["config"]["missing_since"] = NOW - 30_000
    text = format_status(doc, now_ms=NOW)
    assert "  anthropic: limit 6 set by hand at 07:50:27" in text
    assert "; configured 4" in text
    assert "  openai key team-b: limit 1 set by hand; configured 4" in text
    assert "  anthropic: 21 upstream 429s relayed to clients" in text
    assert "! config: the file has been missing since 07:50:57" in text
    assert "set by hand" not in format_status(document(), now_ms=NOW)


# --- token windows -----------------------------------------------------------------------------------


def window(group: str, name: str, limit: int | None, available: int, **fields: Any) -> dict[str, Any]:
    """A ``windows`` entry as ``GET /_slotproxy/status`` answers it (the estimator's fields unknown yet)."""
    return {"group": group, "window": name, "limit": limit, "source": "config", "available": available,
            "reserved": 0, "held": 0, "held_total": 0, "hits": 0, "ratio": None, "estimate_error_p50": None,
            "estimate_error_p90": None, **fields}


def windowed() -> dict[str, Any]:
    doc = document()
    openai, anthropic = doc["providers"]
    openai["keys"][0]["windows"] = [window("gpt-5*", "tokens_per_minute", 2_000_000, 2_000_000)]
    anthropic["windows"] = [
        window("claude-sonnet-4-5", "input_tokens_per_minute", 450_000, 312_000, reserved=24_000, held=2,
               held_total=14, ratio=0.312, estimate_error_p50=0.03, estimate_error_p90=0.18),
        window("claude-sonnet-4-5", "output_tokens_per_minute", 90_000, 0, hits=3, source="both"),
    ]
    return doc


def test_each_token_window_is_a_line_with_its_fill(utc) -> None:
    lines = format_status(windowed(), now_ms=NOW).splitlines()
    windows = [line for line in lines if "_per_minute" in line]
    assert windows == [
        ("  openai key team-a gpt-5* tokens_per_minute            ████████ 2,000,000/2,000,000 available, "
         "0 held, 0 hits"),
        ("  anthropic claude-sonnet-4-5 input_tokens_per_minute   ██████░░ 312,000/450,000 available, "
         "24,000 reserved, 2 held (14 so far), 0 hits, 0.31 tokens/byte, estimates off by +3% (p50) +18% (p90)"),
        ("  anthropic claude-sonnet-4-5 output_tokens_per_minute  ░░░░░░░░ 0/90,000 available, 0 held, "
         "3 hits, limit from config and headers (the smaller)"),
    ]
    budget = next(i for i, line in enumerate(lines) if " budget: " in line)
    config = next(i for i, line in enumerate(lines) if line.startswith("config "))
    assert lines[budget + 1:config] == windows


def test_without_windows_no_window_line(utc) -> None:
    assert "per_minute" not in format_status(document(), now_ms=NOW)


def test_window_bars_fall_back_to_ascii(utc, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BytesIO(), encoding="ascii"))
    text = format_status(windowed(), now_ms=NOW)
    assert "  anthropic claude-sonnet-4-5 output_tokens_per_minute  ........ 0/90,000 available" in text
    assert "######.. 312,000/450,000 available" in text
    for line in text.splitlines():
        if "_per_minute" in line:
            line.encode("ascii")


def test_a_window_whose_limit_went_away_says_so(utc) -> None:
    doc = document()
    doc["providers"][1]["windows"] = [window("other", "requests_per_minute", None, 40)]
    assert "  anthropic other requests_per_minute  ░░░░░░░░ 40 available, no limit now, 0 held, 0 hits" in \
        format_status(doc, now_ms=NOW).splitlines()
