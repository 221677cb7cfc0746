"""What the demo shows: the live view (redrawn in place on a terminal, a line every few seconds otherwise)
and the summary at the end.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

from .fleet import OLD_PROMPT_AGE, PROVIDER, DemoOptions, Outcome, Tally, make_fleet

__all__ = ["LiveView", "Snapshot", "describe", "queue_mix", "summary"]

TTY_REFRESH = 0.25
GLYPHS = {"full": "█", "empty": "░", "star": "★", "arrow": "→", "dash": "—", "unlimited": "∞"}
ASCII_GLYPHS = {"full": "#", "empty": ".", "star": "*", "arrow": "->", "dash": "-", "unlimited": "inf"}
LINE_EVERY = 3.0
BAR_WIDTH = 30


def _percentile(values: list[int], fraction: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return float(ordered[rank - 1])


@dataclass(frozen=True)
class Snapshot:
    """What the live view and the summary read, taken at one moment."""

    elapsed: float
    draining: bool
    done: bool
    providers: list[dict[str, Any]]
    upstream: dict[str, Any]
    completed: int
    agent_429s: int
    errors: int
    in_flight: int
    held_at_end: int = 0
    """Requests the proxy still held when the demo ended (abandoned: with a window, not drained)."""


class Style:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, text: str, code: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.enabled else text


class LiveView:
    """A few lines redrawn in place on a terminal; a progress line every few seconds otherwise."""

    def __init__(self, out: TextIO, options: DemoOptions, tty: bool) -> None:
        self.out = out
        self.options = options
        self.tty = tty
        self.style = Style(tty and not os.environ.get("NO_COLOR"))
        encoding = (getattr(out, "encoding", None) or "").lower().replace("-", "")
        self.glyphs = GLYPHS if encoding == "utf8" else ASCII_GLYPHS
        self._drawn = 0
        self._last_line = -math.inf

    def interval(self) -> float:
        return TTY_REFRESH if self.tty else 0.5

    def update(self, snap: Snapshot, *, final: bool = False) -> None:
        if self.tty:
            self._redraw(self.frame(snap))
        elif final or snap.elapsed - self._last_line >= LINE_EVERY:
            self._last_line = snap.elapsed
            print(self.line(snap), file=self.out, flush=True)

    def close(self) -> None:
        if self.tty:
            self.out.write("\x1b[?25h")
            self.out.flush()

    def _redraw(self, lines: list[str]) -> None:
        parts = ["\x1b[?25l"]
        if self._drawn:
            parts.append(f"\x1b[{self._drawn}F")
        parts.extend(f"\x1b[2K{line}\n" for line in lines)
        self.out.write("".join(parts))
        self.out.flush()
        self._drawn = len(lines)

    def _bar(self, snap: Snapshot) -> str:
        fraction = min(1.0, snap.elapsed / self.options.duration)
        filled = round(fraction * BAR_WIDTH)
        g = self.glyphs
        bar = self.style(g["full"] * filled, "32") + self.style(g["empty"] * (BAR_WIDTH - filled), "2")
        tail = " done" if snap.done else f" draining {snap.in_flight} in flight" if snap.draining else ""
        return f"[{bar}] {min(snap.elapsed, self.options.duration):5.1f}s / {self.options.duration:g}s{tail}"

    def frame(self, snap: Snapshot) -> list[str]:
        s = self.style
        g = self.glyphs
        title = describe(self.options, g["arrow"])
        lines = [s("slotproxy demo", "1") + f" {g['dash']} " + title, self._bar(snap), ""]
        if snap.providers:
            header = f"  {'PROVIDER':<10}{'LIMIT':>6}{'IN-FLIGHT':>11}{'QUEUED':>8}{'PAUSED':>8}{'429s':>6}   QUEUE NOW"
            lines.append(s(header, "1"))
            for p in snap.providers:
                limit = g["unlimited"] if p["limit"] is None else str(p["limit"])
                starred, old, new = p["queue_mix"]
                # Pad before styling: escape codes have no width on screen.
                paused = s(f"{'yes':>8}", "33") if p["paused"] else f"{'no':>8}"
                lines.append(
                    f"  {p['provider']:<10}{limit:>6}{p['in_flight']:>11}{p['queued']:>8}"
                    f"{paused}{p['backoffs']:>6}   {g['star']} {starred}  old {old}  new {new}"
                )
                if p.get("notice"):
                    lines.append("  " + s("! " + p["notice"], "33"))
                for w in p.get("windows") or []:
                    lines.append("  " + self._window_bar(w))
        else:
            lines.append(s("  no proxy: the fleet talks straight to the upstream", "33"))
        up = snap.upstream
        sent = up["rate_limited"]
        lines.append("")
        lines.append(
            f"  upstream  in-flight {up['active']}/{up['cap']}   max seen {up['max_concurrency']}   "
            f"429s sent {s(str(sent), '31') if sent else s('0', '32')}{_window_refusals(up)}"
        )
        seen = snap.agent_429s
        lines.append(
            f"  agents    {snap.completed} answers streamed   "
            f"429s seen {s(str(seen), '31') if seen else s('0', '32')}   errors {snap.errors}"
        )
        return lines

    def _window_bar(self, w: dict[str, Any]) -> str:
        g = self.glyphs
        limit = w.get("limit") or 0
        available = max(0.0, float(w.get("available") or 0))
        filled = round(min(1.0, available / limit) * BAR_WIDTH) if limit else 0
        bar = self.style(g["full"] * filled, "36") + self.style(g["empty"] * (BAR_WIDTH - filled), "2")
        return (f"{w.get('window', 'window')} [{bar}] {available:,.0f}/{limit:,} free   "
                f"holding {w.get('held', 0)}   hits {w.get('hits', 0)}")

    def line(self, snap: Snapshot) -> str:
        head = f"[{min(snap.elapsed, self.options.duration):5.1f}s/{self.options.duration:g}s]"
        if snap.done:
            head += " done"
        elif snap.draining:
            head += " draining"
        parts = [
            f"{p['provider']}: limit {p['limit']}, in-flight {p['in_flight']}, queued {p['queued']}, "
            f"paused {'yes' if p['paused'] else 'no'}, 429s {p['backoffs']}"
            + "".join(f", {w.get('window')} {max(0.0, float(w.get('available') or 0)):.0f}/{w.get('limit')} free "
                      f"holding {w.get('held', 0)}" for w in p.get("windows") or [])
            for p in snap.providers
        ]
        up = snap.upstream
        parts.append(f"upstream: in-flight {up['active']}/{up['cap']}, 429s sent {up['rate_limited']}"
                     f"{_window_refusals(up, ',')}")
        parts.append(f"agents: {snap.completed} done, 429s seen {snap.agent_429s}")
        return head + " " + " | ".join(parts)


def describe(options: DemoOptions, arrow: str = "->") -> str:
    window = "" if options.windows is None else f", {options.windows} tokens/min"
    held = "" if options.windows is None else ", holding the window"
    path = f"slotproxy ({PROVIDER} limit {options.cap}{held})" if options.use_proxy else "no proxy"
    return f"{options.agents} agents {arrow} {path} {arrow} fake upstream (cap {options.cap}{window})"


def _window_refusals(upstream: dict[str, Any], sep: str = "  ") -> str:
    """The upstream's 429s by token window (nothing without windows)."""
    windows = upstream.get("windows") or {}
    return "".join(f"{sep} {name} 429s {w['rejected']}" for name, w in windows.items())


def queue_mix(queue: list[dict[str, Any]], now_ms: int) -> tuple[int, int, int]:
    """How many waiters are starred, unstarred with an old prompt, unstarred with a new one."""
    starred = sum(1 for w in queue if w["starred"])
    old = sum(1 for w in queue if not w["starred"] and now_ms - w["prompt_started_at"] >= OLD_PROMPT_AGE * 1000)
    return starred, old, len(queue) - starred - old


def _wait_rows(outcomes: list[Outcome], metric: Callable[[Outcome], int]) -> Iterator[tuple[str, list[int]]]:
    unstarred = [o for o in outcomes if not o.starred]
    yield "starred", [metric(o) for o in outcomes if o.starred]
    yield "unstarred", [metric(o) for o in unstarred]
    yield "old prompts (unstarred)", [metric(o) for o in unstarred if o.old]
    yield "new prompts (unstarred)", [metric(o) for o in unstarred if not o.old]


def _window_summary(options: DemoOptions, snap: Snapshot, tally: Tally) -> list[str]:
    """With a window: its 429s upstream, who waited and for how long, and what was left held at the end."""
    if options.windows is None:
        return []
    rejected = sum(w["rejected"] for w in (snap.upstream.get("windows") or {}).values())
    lines = [f"  token window:              {options.windows} tokens per minute (OpenAI TPM), "
             + ("held by the proxy" if options.use_proxy else "enforced by the upstream only"),
             f"  window 429s upstream:      {rejected}"]
    if options.use_proxy:
        waits = [o.queue_ms for o in tally.outcomes if o.queue_ms > 0]
        longest = f", longest {max(waits) / 1000:.1f}s" if waits else ""
        lines += [f"  requests that waited:      {len(waits)} of {len(tally.outcomes)}{longest}",
                  f"  still held at the end:     {snap.held_at_end} (abandoned when the demo ended, not refused)"]
    else:
        lost = [o.backoff_ms for o in tally.outcomes if o.backoff_ms > 0]
        longest = f", longest {max(lost) / 1000:.1f}s" if lost else ""
        lines.append(f"  requests that backed off:  {len(lost)} of {len(tally.outcomes)}{longest}")
    return lines


def summary(options: DemoOptions, snap: Snapshot, tally: Tally, wall: float) -> str:
    up = snap.upstream
    mode = "with slotproxy" if options.use_proxy else "without a proxy (--no-proxy)"
    socket_responses = sum(1 for o in tally.outcomes if o.websocket)
    socket_agents = sum(1 for a in make_fleet(options.agents) if a.websocket)
    lines = [
        "",
        f"slotproxy demo summary: {mode}, {options.agents} agents, {options.duration:g}s (wall {wall:.1f}s)",
        f"  requests completed:        {snap.completed}",
        f"  over WebSockets:           {socket_responses} (responses, by {socket_agents} Codex-style agents)",
        f"  429s the agents saw:       {snap.agent_429s}",
        f"  429s the upstream sent:    {up['rate_limited']}",
        f"  upstream max concurrency:  {up['max_concurrency']} (cap {up['cap']})",
        f"  errors:                    {snap.errors}",
    ]
    lines += [f"    {sample}" for sample in tally.error_samples]
    lines += _window_summary(options, snap, tally)
    for p in snap.providers:
        lines.append(
            f"  {p['provider']} limit at the end: {p['limit']} (configured {p['configured_limit']}), "
            f"upstream backoffs seen by the proxy: {p['backoffs']}"
        )
    if options.use_proxy:
        title = "queue wait (X-Slotproxy-Queue-Ms)"

        def metric(o: Outcome) -> int:
            return o.queue_ms
    else:
        title = "time lost backing off after 429s"

        def metric(o: Outcome) -> int:
            return o.backoff_ms
    lines.append(f"  {title:<36}{'n':>6}{'mean ms':>10}{'p95 ms':>10}")
    for label, values in _wait_rows(tally.outcomes, metric):
        if values:
            mean = sum(values) / len(values)
            lines.append(f"    {label:<34}{len(values):>6}{mean:>10.0f}{_percentile(values, 0.95):>10.0f}")
        else:
            lines.append(f"    {label:<34}{0:>6}{'-':>10}{'-':>10}")
    flag = "" if options.windows is None else f" --windows {options.windows}"
    if options.use_proxy:
        lines.append(f"  Same fleet straight at the upstream, for comparison: slotproxy demo{flag} --no-proxy")
    else:
        lines.append(f"  The same fleet through slotproxy: slotproxy demo{flag}")
    return "\n".join(lines)
