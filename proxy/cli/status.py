"""``slotproxy status``: the status document as a table, times as this machine's clock time and relative
to now; ``--watch`` redraws it until Ctrl-C.
"""

from __future__ import annotations

import os
import sys
import time

from .fetch import Unreachable, fetch_status

TYPE_CHECKING = False  # typing's own costs an import on every call; mypy reads this name the same
if TYPE_CHECKING:
    from typing import Any

__all__ = ["format_status", "humanise", "status_block", "watch"]

LISTED = 20
"""Waiters and holders the status table lists per provider (``--json`` has the document's 1000)."""


def humanise(ms: float) -> str:
    """A duration as the dashboard writes it: ``8.2 s``, ``12 s``, ``4 min 02 s``, ``3 h 05 min``."""
    seconds = max(0.0, ms) / 1000
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{int(seconds)} s"
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes} min {int(seconds % 60):02d} s"
    hours = minutes // 60
    if hours < 48:
        return f"{hours} h {minutes % 60:02d} min"
    return f"{hours // 24} d {hours % 24} h"


class _Clock:
    """Epoch-ms times as this machine's local clock time, and relative to now on the server's clock."""

    def __init__(self, now_ms: float, skew_ms: float = 0.0) -> None:
        self.now = now_ms
        self.skew = skew_ms

    def time_of(self, ms: float) -> str:
        local = time.localtime((ms - self.skew) / 1000)
        today = time.localtime((self.now - self.skew) / 1000)
        fmt = "%H:%M:%S" if local[:3] == today[:3] else "%Y-%m-%d %H:%M:%S"
        return time.strftime(fmt, local)

    def when(self, ms: float) -> str:
        """``14:03:27 (in 12 s)`` or ``13:58:02 (4 min 13 s ago)``."""
        delta = ms - self.now
        relative = f"in {humanise(delta)}" if delta >= 0 else f"{humanise(-delta)} ago"
        return f"{self.time_of(ms)} ({relative})"

    def until(self, ms: float) -> str:
        """An end still to come: ``14:03:27 (in 12 s)``, or ``(resuming)`` once it has passed."""
        relative = f"in {humanise(ms - self.now)}" if ms > self.now else "resuming"
        return f"{self.time_of(ms)} ({relative})"


def _printable(text: str) -> bool:
    encoding = getattr(sys.stdout, "encoding", None) or "ascii"
    try:
        text.encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return False
    return True


def _glyphs() -> tuple[str, str]:
    """The star and the ellipsis, where stdout can print them."""
    return ("★", "…") if _printable("★…") else ("*", "...")


def _bar_glyphs() -> tuple[str, str]:
    """A window bar's full and empty cells, where stdout can print them."""
    return ("█", "░") if _printable("█░") else ("#", ".")


def _cell(value: object) -> str:
    return "-" if value is None or value == "" else str(value)


def _limit(value: object) -> str:
    return "unlimited" if value is None else str(value)


def _table(rows: list[tuple[str, ...]], indent: str = "") -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [(indent + "  ".join(cell.ljust(width) for cell, width in zip(row, widths))).rstrip() for row in rows]


def _transport(value: object) -> str:
    return {"http": "HTTP", "websocket": "WebSocket"}.get(str(value), _cell(value))


def _pool_held_until(provider: dict[str, Any]) -> float | None:
    """Every available key held by its budget and none paused: the earliest reset (as the dashboard)."""
    pool = [k for k in provider.get("keys") or [] if k.get("available", True)]
    if not pool:
        return None
    holds = []
    for key in pool:
        until = (key.get("budget") or {}).get("held_until")
        if key.get("paused") or until is None:
            return None
        holds.append(until)
    return min(holds)


def _state(item: dict[str, Any], clock: _Clock, provider: bool = False) -> str:
    if item.get("paused") or item.get("paused_until") is not None:
        pool_held = _pool_held_until(item) if provider else None
        if item.get("paused_until") is not None:
            return f"paused until {clock.until(item['paused_until'])}"
        if pool_held is not None:
            return f"every key held by its budget until {clock.until(pool_held)}"
        return "paused"
    held = (item.get("budget") or {}).get("held_until")
    if held is not None:
        return f"held by its budget until {clock.until(held)}"
    return "-"


def format_status(status: dict[str, Any], *, now_ms: float | None = None, skew_ms: float = 0.0,
                  url: str | None = None) -> str:
    """The status document as ``slotproxy status`` prints it: times as clock time and relative to now."""
    clock = _Clock(time.time() * 1000 + skew_ms if now_ms is None else now_ms, skew_ms)
    star, more = _glyphs()
    providers = [p for p in status.get("providers") or [] if isinstance(p, dict)]
    lines = []
    if url is not None:
        lines += [f"slotproxy at {url}, {clock.time_of(clock.now)}", ""]

    rows: list[tuple[str, ...]] = [("PROVIDER", "LIMIT", "CONFIGURED", "IN_FLIGHT", "QUEUED", "STATE", "COOLDOWN")]
    for p in providers:
        rows.append((str(p.get("provider")), _limit(p.get("limit")), _limit(p.get("configured_limit")),
                     _cell(p.get("in_flight")), _cell(p.get("queued")), _state(p, clock, provider=True),
                     f"{int(p.get('cooldown_ms') or 0)} ms"))
        for key in p.get("keys") or []:
            label = f"  key {key.get('name')}" + ("" if key.get("available", True) else " (not set)")
            rows.append((label, _limit(key.get("limit")), _limit(key.get("configured_limit")),
                         _cell(key.get("in_flight")), "-", _state(key, clock), "-"))
        for model in p.get("models") or []:
            rows.append((f"  model {model.get('pattern')}", _limit(model.get("limit")),
                         _limit(model.get("configured_limit")), _cell(model.get("in_flight")), "-", "-", "-"))
    lines += _table(rows) if providers else ["no providers configured"]

    for p in providers:
        name = p.get("provider")
        if p.get("notice"):
            lines.append(f"! {name}: {p['notice']}")
        for key in p.get("keys") or []:
            if key.get("notice"):
                lines.append(f"! {name} key {key.get('name')}: {key['notice']}")
        lines += _manual_limits(p, clock)
        if p.get("relayed_429"):
            lines.append(f"  {name}: {p['relayed_429']} upstream 429s relayed to clients")
        budgets = [(f"{name}", p.get("budget"))] + [(f"{name} key {k.get('name')}", k.get("budget"))
                                                     for k in p.get("keys") or []]
        for who, budget in budgets:
            if budget:
                lines.append(f"  {who} budget: {_budget(budget, clock)}")
    lines += _windows(providers)
    lines += _spend(status, clock)
    lines += _backend_and_config(status, clock)

    for p in providers:
        lines += _holders(p, clock, star, more)
        lines += _queue(p, clock, star, more)
    return "\n".join(lines)


def _manual_limits(provider: dict[str, Any], clock: _Clock) -> list[str]:
    """A line for each limit set by hand (admin API or dashboard) that differs from the configured one."""
    name = provider.get("provider")
    levels = [(f"{name}", provider)] + [(f"{name} key {k.get('name')}", k) for k in provider.get("keys") or []] \
        + [(f"{name} model {m.get('pattern')}", m) for m in provider.get("models") or []]
    lines = []
    for who, level in levels:
        if level.get("manual"):
            when = f" at {clock.when(level['manual_set_at'])}" if level.get("manual_set_at") else ""
            lines.append(f"  {who}: limit {_limit(level.get('limit'))} set by hand{when}; "
                         f"configured {_limit(level.get('configured_limit'))}")
    return lines


def _budget(budget: dict[str, Any], clock: _Clock) -> str:
    parts = []
    if budget.get("remaining_requests") is not None:
        parts.append(f"{budget['remaining_requests']:,} requests left")
    if budget.get("remaining_tokens") is not None:
        parts.append(f"{budget['remaining_tokens']:,} tokens left")
    if budget.get("reset_at") is not None:
        parts.append(f"resets {clock.when(budget['reset_at'])}")
    return ", ".join(parts) or "none reported yet"


WINDOW_BAR = 8
"""Cells in a window's bar (``slotproxy status``)."""


def _windows(providers: list[dict[str, Any]]) -> list[str]:
    """A line per token window: whose it is, its fill as a bar, and what it holds; labels aligned."""
    rows = []
    for p in providers:
        owners = [(str(p.get("provider")), p.get("windows"))]
        owners += [(f"{p.get('provider')} key {k.get('name')}", k.get("windows")) for k in p.get("keys") or []]
        for who, windows in owners:
            for window in windows or []:
                if isinstance(window, dict):
                    rows.append((f"{who} {window.get('group')} {window.get('window')}", window))
    if not rows:
        return []
    full, empty = _bar_glyphs()
    width = max(len(label) for label, _ in rows)
    return [f"  {label.ljust(width)}  {_window_fill(window, full, empty)}" for label, window in rows]


def _window_fill(window: dict[str, Any], full: str, empty: str) -> str:
    """``████░░░░ 312,000/450,000 available, 2 held, 0 hits`` and, where known, the rest."""
    available, limit = window.get("available"), window.get("limit")
    if isinstance(limit, (int, float)) and limit > 0 and isinstance(available, (int, float)):
        cells = round(min(1.0, max(0.0, available / limit)) * WINDOW_BAR)
        parts = [f"{full * cells}{empty * (WINDOW_BAR - cells)} {_count(available)}/{_count(limit)} available"]
    else:
        parts = [f"{empty * WINDOW_BAR} {_count(available)} available, no limit now"]
    if window.get("reserved"):
        parts.append(f"{_count(window['reserved'])} reserved")
    held, held_total = int(window.get("held") or 0), int(window.get("held_total") or 0)
    parts.append(f"{held:,} held" + (f" ({held_total:,} so far)" if held_total > held else ""))
    parts.append(f"{int(window.get('hits') or 0):,} hits")
    if window.get("source") in ("headers", "both"):
        parts.append("limit from the answers' headers" if window["source"] == "headers"
                     else "limit from config and headers (the smaller)")
    if window.get("ratio") is not None:
        parts.append(f"{window['ratio']:.2f} tokens/byte")
    errors = [(q, window.get(f"estimate_error_{q}")) for q in ("p50", "p90")]
    if any(value is not None for _, value in errors):
        parts.append("estimates off by " + " ".join(f"{_percent(value)} ({q})" for q, value in errors
                                                    if value is not None))
    return ", ".join(parts)


def _spend(status: dict[str, Any], clock: _Clock) -> list[str]:
    """A line per workspace with a daily cap that has spent today: ``web-app spent $12.40 of $200.00 today``."""
    lines = []
    for entry in status.get("spend") or []:
        if not isinstance(entry, dict):
            continue
        spent, cap = float(entry.get("spent_usd") or 0), float(entry.get("cap_usd") or 0)
        line = f"  workspace {entry.get('workspace')} spent ${spent:,.2f} of ${cap:,.2f} today"
        if spent >= cap:
            line += ": new requests refused"
        if entry.get("resets_at"):
            line += f", resets {clock.when(entry['resets_at'])}"
        lines.append(line)
    return lines


def _count(value: object) -> str:
    return f"{int(value):,}" if isinstance(value, (int, float)) else "-"


def _percent(value: float) -> str:
    return f"{value * 100:+.0f}%"


def _backend_and_config(status: dict[str, Any], clock: _Clock) -> list[str]:
    lines = []
    backend = status.get("backend") or {}
    if backend and (backend.get("kind") != "memory" or backend.get("healthy") is False):
        parts = [f"backend {backend.get('kind')}", "healthy" if backend.get("healthy") else "unhealthy"]
        for field in ("mode", "primary"):
            if backend.get(field):
                parts.append(f"{field} {backend[field]}")
        if backend.get("failovers"):
            last = backend.get("last_failover_at")
            parts.append(f"{backend['failovers']} failovers" + (f" (last {clock.when(last)})" if last else ""))
        lines.append(", ".join(parts))
        if backend.get("error"):
            lines.append(f"! backend: {backend['error']}")
    config = status.get("config") or {}
    if config.get("path") or config.get("loaded_at"):
        loaded = f", loaded {clock.when(config['loaded_at'])}" if config.get("loaded_at") else ""
        lines.append(f"config {config.get('path') or '(built in)'}{loaded}")
    if config.get("error"):
        lines.append(f"! config: {config['error']}")
    if config.get("missing_since"):
        lines.append(f"! config: the file has been missing since {clock.when(config['missing_since'])}; "
                     "the running config is kept")
    return lines


def _holders(provider: dict[str, Any], clock: _Clock, star: str, more: str) -> list[str]:
    holders = [h for h in provider.get("holders") or [] if isinstance(h, dict)]
    if not holders:
        return []
    lines = ["", f"{provider.get('provider')}: {len(holders)} holding slots, longest held first"]
    rows: list[tuple[str, ...]] = [("WORKSPACE", star, "CONVERSATION", "MODEL", "KEY", "VIA", "HELD FOR")]
    for h in holders[:LISTED]:
        rows.append((h.get("workspace") or "default", star if h.get("starred") else "", _cell(h.get("conversation")),
                     _cell(h.get("model")), _cell(h.get("key")), _transport(h.get("transport")),
                     humanise(h.get("held_ms") or 0)))
    lines += _table(rows, "  ")
    if len(holders) > LISTED:
        lines.append(f"  {more}and {len(holders) - LISTED} more holding slots (--json lists them)")
    return lines


def _queue(provider: dict[str, Any], clock: _Clock, star: str, more: str) -> list[str]:
    queue = [w for w in provider.get("queue") or [] if isinstance(w, dict)]
    queued = max(int(provider.get("queued") or 0), len(queue))
    if not queued:
        return []
    lines = ["", f"{provider.get('provider')}: {queued} waiting, next to be admitted first"]
    rows: list[tuple[str, ...]] = [("#", "WORKSPACE", star, "PROMPT AGE", "WAITING", "VIA", "CONVERSATION")]
    for index, w in enumerate(queue[:LISTED], 1):
        started = w.get("prompt_started_at")
        rows.append((str(index), w.get("workspace") or "default", star if w.get("starred") else "",
                     "-" if started is None else humanise(clock.now - started), humanise(w.get("waited_ms") or 0),
                     _transport(w.get("transport")), _cell(w.get("conversation"))))
    lines += _table(rows, "  ")
    shown = min(len(queue), LISTED)
    if queued > shown:
        lines.append(f"  {more}and {queued - shown} more waiting")
    return lines


def status_block(url: str, as_json: bool) -> str:
    import json

    status, skew = fetch_status(url)
    return json.dumps(status, indent=2) if as_json else format_status(status, skew_ms=skew, url=url)


def watch(url: str, as_json: bool, interval: float) -> int:
    """Redraw the status every ``interval`` seconds until Ctrl-C: in place on a terminal, else a block
    per refresh separated by a blank line. A proxy that goes away later is said in the block, and
    retried; one that is not there at the start is an error (exit 1)."""
    out = sys.stdout
    tty = out.isatty()
    drawn = False
    try:
        while True:
            started = time.monotonic()
            try:
                block = status_block(url, as_json)
            except Unreachable as exc:
                if not drawn:
                    raise
                block = f"slotproxy: {exc} (trying again every {interval:g} s)"
            if tty:
                text = "\x1b[?25l\x1b[H" + ("" if drawn else "\x1b[2J")
                text += "".join(f"{line}\x1b[K\n" for line in block.splitlines()) + "\x1b[J"
            else:
                text = ("\n" if drawn else "") + block + "\n"
            out.write(text)
            out.flush()
            drawn = True
            time.sleep(max(0.0, interval - (time.monotonic() - started)))
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # | head: the reader has enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
        return 0
    finally:
        if tty and drawn:
            out.write("\x1b[?25h")
            out.flush()
