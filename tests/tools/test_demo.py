"""`slotproxy demo`: the one-command tour runs end to end, both ways, and tells the truth."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.cli import build_parser
from proxy.tools.demo import DemoOptions
from proxy.tools.demo.view import LiveView, Snapshot

REPO = Path(__file__).resolve().parents[2]
FLEET = ["--agents", "10", "--cap", "3", "--duration", "3"]
WINDOWED = ["--agents", "8", "--cap", "3", "--duration", "3", "--windows", "3000"]


def _field(summary: str, label: str) -> str:
    match = re.search(rf"^\s*{re.escape(label)}:\s*(.+)$", summary, re.MULTILINE)
    assert match, f"no {label!r} line in the summary:\n{summary}"
    return match.group(1).strip()


@pytest.fixture(scope="module")
def runs() -> dict[str, subprocess.CompletedProcess[str]]:
    """Both modes, with and without a token window, at once, as subprocesses (stdout is a pipe: the non-TTY
    progress lines)."""
    demo = [sys.executable, "-m", "proxy", "demo"]
    argvs = {"proxy": [*demo, *FLEET], "direct": [*demo, *FLEET, "--no-proxy"],
             "windows": [*demo, *WINDOWED], "windows-direct": [*demo, *WINDOWED, "--no-proxy"]}
    procs = {name: subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, argv in argvs.items()}
    done = {}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=40)
            done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


def test_with_the_proxy_agents_see_no_429_and_upstream_reaches_exactly_its_cap(
    runs: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    run = runs["proxy"]
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "summary: with slotproxy" in out
    assert int(_field(out, "requests completed")) > 0
    assert _field(out, "429s the agents saw") == "0"
    assert _field(out, "429s the upstream sent") == "0"
    assert _field(out, "upstream max concurrency") == "3 (cap 3)"
    assert _field(out, "errors") == "0"
    over_sockets = re.match(r"(\d+) \(responses, by (\d+) Codex-style agents\)", _field(out, "over WebSockets"))
    assert over_sockets and int(over_sockets.group(1)) > 0 and int(over_sockets.group(2)) > 0, out
    for label in ("starred", "unstarred", "old prompts (unstarred)", "new prompts (unstarred)"):
        row = re.search(rf"^\s+{re.escape(label)}\s+(\d+)\s+(\d+|-)\s+(\d+|-)$", out, re.MULTILINE)
        assert row, f"no queue-wait row for {label!r}:\n{out}"
        assert int(row.group(1)) > 0, f"no completed requests in class {label!r}:\n{out}"
    assert "X-Slotproxy-Queue-Ms" in out


def test_without_the_proxy_the_same_fleet_gets_429s(runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    run = runs["direct"]
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "summary: without a proxy" in out
    seen = int(_field(out, "429s the agents saw"))
    assert seen > 0
    assert int(_field(out, "429s the upstream sent")) == seen
    assert int(_field(out, "over WebSockets").split()[0]) > 0  # Codex-style agents back off on the 429 frames
    assert _field(out, "upstream max concurrency") == "3 (cap 3)"  # the fake refuses past its cap
    assert int(_field(out, "requests completed")) > 0


def test_with_a_token_window_the_fleet_is_held_not_refused(
    runs: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    run = runs["windows"]
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "3000 tokens per minute (OpenAI TPM), held by the proxy" in out
    assert _field(out, "429s the upstream sent") == "0"
    assert _field(out, "window 429s upstream") == "0"
    assert _field(out, "429s the agents saw") == "0"
    assert _field(out, "errors") == "0"
    assert int(_field(out, "requests completed")) > 0
    # The window (a minute's worth: ~6 requests of ~500 tokens) is spent in the first second; the rest is held.
    held = re.match(r"(\d+) \(abandoned when the demo ended, not refused\)", _field(out, "still held at the end"))
    waited = re.match(r"(\d+) of (\d+)", _field(out, "requests that waited"))
    assert held and waited, out
    assert int(held.group(1)) + int(waited.group(1)) > 0, out
    assert "limit at the end: 3 (configured 3)" in out  # a window is not a reason to lower the slots


def test_with_a_token_window_and_no_proxy_the_fleet_is_refused(
    runs: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    run = runs["windows-direct"]
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "enforced by the upstream only" in out
    assert int(_field(out, "window 429s upstream")) > 0
    assert int(_field(out, "429s the agents saw")) > 0


def test_a_pipe_gets_progress_lines_not_terminal_redraws(runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    for run in runs.values():
        assert "\x1b[" not in run.stdout
        progress = [line for line in run.stdout.splitlines() if re.match(r"^\[\s*\d+\.\d+s/3s\]", line)]
        assert len(progress) >= 2, run.stdout
        assert "upstream: in-flight" in progress[-1]


def test_the_terminal_view_shows_each_provider_and_the_queue_mix() -> None:
    options = DemoOptions(duration=10, agents=4, cap=2)
    out = io.StringIO()
    view = LiveView(out, options, tty=True)
    provider = {
        "provider": "openai", "limit": 2, "configured_limit": 2, "in_flight": 2, "queued": 3, "paused": True,
        "notice": "Concurrency limit auto-reduced to 2 after a 429 — restore manually when ready.",
        "backoffs": 1, "queue_mix": (1, 0, 2),
    }
    upstream = {"cap": 2, "active": 2, "max_concurrency": 2, "rate_limited": 1}
    snap = Snapshot(elapsed=5.0, draining=False, done=False, providers=[provider], upstream=upstream,
                         completed=7, agent_429s=0, errors=0, in_flight=5)
    frame = "\n".join(view.frame(snap))
    plain = re.sub(r"\x1b\[[0-9;]*m", "", frame)
    assert re.search(r"openai\s+2\s+2\s+3\s+yes\s+1\s+\S 1  old 0  new 2", plain), plain
    assert "auto-reduced to 2" in plain
    assert "5.0s / 10s" in plain
    view.update(snap)
    view.update(snap)
    view.close()
    written = out.getvalue()
    assert f"\x1b[{len(view.frame(snap))}F" in written  # the second frame redraws over the first
    assert written.endswith("\x1b[?25h")  # the cursor comes back


def test_the_terminal_view_shows_each_window_with_what_it_holds() -> None:
    options = DemoOptions(duration=10, agents=4, cap=2, windows=30000)
    view = LiveView(io.StringIO(), options, tty=True)
    window = {"group": "fake-model", "window": "tokens_per_minute", "limit": 30000, "available": 7500.4,
              "held": 3, "hits": 0}
    provider = {"provider": "openai", "limit": 2, "configured_limit": 2, "in_flight": 2, "queued": 3,
                "paused": False, "notice": None, "backoffs": 0, "queue_mix": (0, 0, 3), "windows": [window]}
    upstream = {"cap": 2, "active": 2, "max_concurrency": 2, "rate_limited": 0,
                "windows": {"tokens_per_minute": {"limit": 30000, "rejected": 0, "buckets": []}}}
    snap = Snapshot(elapsed=5.0, draining=False, done=False, providers=[provider], upstream=upstream,
                    completed=7, agent_429s=0, errors=0, in_flight=5)
    plain = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(view.frame(snap)))
    assert "30000 tokens/min" in plain
    bar = re.search(r"tokens_per_minute \[(\S+)\] 7,500/30,000 free\s+holding 3\s+hits 0", plain)
    assert bar, plain
    assert bar.group(1).count(view.glyphs["full"]) == 8  # a quarter of the bar: a quarter of the window free
    assert "tokens_per_minute 429s 0" in plain
    line = LiveView(io.StringIO(), options, tty=False).line(snap)
    assert "tokens_per_minute 7500/30000 free holding 3" in line


@pytest.mark.parametrize("flag,value", [("--agents", "0"), ("--cap", "-1"), ("--duration", "0"), ("--duration", "x"),
                                        ("--windows", "0"), ("--windows", "lots")])
def test_bad_flags_are_refused_with_the_rule(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["demo", flag, value])
    assert exc.value.code == 2
    assert "must be" in capsys.readouterr().err


def test_options_validate_on_construction() -> None:
    with pytest.raises(ValueError, match="agents must be 1-500"):
        DemoOptions(agents=0)
    with pytest.raises(ValueError, match="windows must be 1-10000000 tokens per minute"):
        DemoOptions(windows=0)


def test_windows_without_a_value_takes_the_default() -> None:
    from proxy.tools.demo import DEFAULT_WINDOW

    assert build_parser().parse_args(["demo", "--windows"]).windows == DEFAULT_WINDOW
    assert build_parser().parse_args(["demo", "--windows", "5000"]).windows == 5000
    assert build_parser().parse_args(["demo"]).windows is None
