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


def _field(summary: str, label: str) -> str:
    match = re.search(rf"^\s*{re.escape(label)}:\s*(.+)$", summary, re.MULTILINE)
    assert match, f"no {label!r} line in the summary:\n{summary}"
    return match.group(1).strip()


@pytest.fixture(scope="module")
def runs() -> dict[str, subprocess.CompletedProcess[str]]:
    """Both modes at once, as subprocesses (stdout is a pipe: the non-TTY progress lines)."""
    argv = [sys.executable, "-m", "proxy", "demo", *FLEET]
    procs = {
        "proxy": subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
        "direct": subprocess.Popen([*argv, "--no-proxy"], cwd=REPO, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True),
    }
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


@pytest.mark.parametrize("flag,value", [("--agents", "0"), ("--cap", "-1"), ("--duration", "0"), ("--duration", "x")])
def test_bad_flags_are_refused_with_the_rule(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["demo", flag, value])
    assert exc.value.code == 2
    assert "must be" in capsys.readouterr().err


def test_options_validate_on_construction() -> None:
    with pytest.raises(ValueError, match="agents must be 1-500"):
        DemoOptions(agents=0)
