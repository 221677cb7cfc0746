"""The ``slotproxy`` command line: serve, check, status, fake-upstream, demo, clients, schema.

Every call pays for what this module imports, ``--version`` and ``--help``
included, so it imports only the standard library's light modules at the top;
each command imports what it needs (the config model and pydantic, yaml,
aiohttp) when it runs. The ``fake-upstream`` and ``demo`` flags live with their
modules (which import aiohttp), so they are added only when the command line
names that command (``build_parser()`` with no argument adds every one).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from .. import __version__
from ..server.bind import BindFailed

TYPE_CHECKING = False  # typing's own costs an import on every call; mypy reads this name the same
if TYPE_CHECKING:
    from pathlib import Path
    from typing import Any

    from ..config import Config

__all__ = ["build_parser", "format_status", "main"]

DEFAULT_CONFIG = "slotproxy.yaml"
CONFIG_ENV = "SLOTPROXY_CONFIG"
DEFAULT_URL = "http://127.0.0.1:8787"
STATUS_PATH = "/_slotproxy/status"
USAGE_PATH = "/_slotproxy/usage"
STATUS_TIMEOUT = 5.0
LISTED = 20
"""Waiters and holders the status table lists per provider (``--json`` has the document's 1000)."""
EXIT_USAGE = 2

DESCRIPTION = ("slotproxy: a proxy that holds concurrency slots for fleets of coding agents in front of LLM "
               "providers. Run slotproxy COMMAND --help for a command's options.")
CONFIG_HELP = f"config file (default: ${CONFIG_ENV}, else ./{DEFAULT_CONFIG})"


class CliError(Exception):
    """A problem to report in one line before exiting with ``exit_code``."""

    exit_code = EXIT_USAGE


class Unreachable(CliError):
    """No slotproxy answered where the command looked: exit 1, as for any failed query."""

    exit_code = 1


def find_config(explicit: str | None) -> Path:
    """--config, else $SLOTPROXY_CONFIG, else ./slotproxy.yaml."""
    from pathlib import Path

    if explicit:
        path = Path(explicit)
        if path.is_file():
            return path
        raise CliError(f"config file not found: {explicit} (given with --config)")
    from_env = os.environ.get(CONFIG_ENV)
    if from_env and Path(from_env).is_file():
        return Path(from_env)
    if Path(DEFAULT_CONFIG).is_file():
        return Path(DEFAULT_CONFIG)
    env_note = f"${CONFIG_ENV}={from_env} (missing)" if from_env else f"${CONFIG_ENV} (unset)"
    raise CliError(
        f"no config file found: tried --config (not given), {env_note}, ./{DEFAULT_CONFIG} (missing); "
        "start from config.example.yaml"
    )


def _load(path: Path) -> Config:
    """The config at ``path``; one with no provider is refused (``check``, ``serve`` and ``clients``)."""
    from ..config import ConfigError, load_config, missing_folders

    try:
        config = load_config(path, require_providers=True)
        problems = missing_folders(config, path)
    except ConfigError as exc:
        problems = exc.problems
    if problems:
        raise CliError(f"{path}: invalid config\n" + "\n".join(f"  {p}" for p in problems))
    return config


def check_bind(config: Config, host: str) -> None:
    """Refuse a non-loopback bind without an admin token, unless explicitly allowed."""
    from ..http.guard import is_loopback_address

    if is_loopback_address(host) or config.admin.allow_unauthenticated:
        return
    if os.environ.get(config.admin.token_env):
        return
    raise CliError(
        f"refusing to listen on {host} with no admin token: set {config.admin.token_env} "
        "(SLOTPROXY_ADMIN_TOKEN by default), or set admin.allow_unauthenticated: true"
    )


def check_backend_client(config: Config) -> None:
    """``backend.kind: redis`` needs the redis client in this environment: say which install gives it."""
    import importlib

    if config.backend.kind != "redis":
        return
    try:
        importlib.import_module("redis.asyncio")
        return
    except ImportError:
        pass
    raise CliError("backend.kind is redis but the redis client is not installed in this Python: "
                   "pip install 'redis[hiredis]>=5' (or reinstall slotproxy with its dependencies)")


def cmd_serve(args: argparse.Namespace) -> int:
    from ..server.bind import probe

    path = find_config(args.config)
    config = _load(path)
    host = args.host or config.server.host
    port = config.server.port if args.port is None else args.port
    check_bind(config, host)
    check_backend_client(config)
    probe(host, port)  # a taken port is the one line printed, before start-up logs anything

    from ..logs import setup_logging
    from ..server.run import serve

    setup_logging(args.log_format, args.log_level)
    return serve(config, str(path), host, port)


def cmd_check(args: argparse.Namespace) -> int:
    import yaml

    path = find_config(args.config)
    config = _load(path)
    check_backend_client(config)
    print(f"# {path}: valid")
    for warning in config.warnings(os.environ):
        print(f"warning: {warning}", file=sys.stderr)
    print(yaml.safe_dump(config.masked(), sort_keys=False, allow_unicode=True), end="")
    return 0


# --- status ------------------------------------------------------------------------------------


def _base_url(url: str) -> str:
    """``--url`` without a trailing slash; ``host:port`` alone means ``http://host:port``."""
    from urllib.parse import urlsplit

    text = url.strip()
    if "://" not in text:
        text = f"http://{text}"
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise CliError(f"--url must be the proxy's base URL, such as {DEFAULT_URL} (got {url!r})")
    return text.rstrip("/")


def fetch_status(url: str, timeout: float = STATUS_TIMEOUT) -> tuple[dict[str, Any], float]:
    """The status document at ``url`` and the server's clock minus this one's (ms; 0 unless they
    clearly differ). ``Unreachable`` says in one line why there is none."""
    data, date = fetch_json(url, STATUS_PATH, timeout=timeout)
    if not isinstance(data.get("providers"), list):
        raise Unreachable(f"{url} answers, but not as slotproxy ({STATUS_PATH} is no status document); "
                          "check --url")
    return data, _clock_skew(date)


def fetch_json(url: str, path: str, query: dict[str, str] | None = None, *,
               timeout: float = STATUS_TIMEOUT) -> tuple[dict[str, Any], str | None]:
    """A JSON object from the running proxy and its Date header. A 400 (a bad option) is a ``CliError``
    with the proxy's reason; no answer is ``Unreachable``."""
    import http.client
    import json
    import urllib.error
    import urllib.parse
    import urllib.request

    target = url + path + ("?" + urllib.parse.urlencode(query) if query else "")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via $http_proxy
    try:
        with opener.open(target, timeout=timeout) as response:
            body = response.read()
            date = response.headers.get("Date")
    except urllib.error.HTTPError as exc:
        if exc.code == 400:
            raise CliError(_http_refusal(url, exc, path)) from None
        raise Unreachable(_http_refusal(url, exc, path)) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        raise Unreachable(f"no slotproxy answers at {url} ({_reason_in_words(reason, timeout)}); start it with "
                          "`slotproxy serve`, or pass --url") from None
    except http.client.HTTPException:
        raise Unreachable(f"{url} answers, but not in HTTP; check --url") from None
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise Unreachable(f"{url} answers, but not as slotproxy ({path} is no JSON object); check --url")
    return data, date


def _reason_in_words(reason: object, timeout: float) -> str:
    import socket
    import ssl

    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, TimeoutError):
        return f"no answer within {timeout:g} s"
    if isinstance(reason, socket.gaierror):
        return "host not found"
    if isinstance(reason, ssl.SSLCertVerificationError):
        return f"TLS certificate not valid: {reason.verify_message}"
    if isinstance(reason, ConnectionResetError):
        return "connection reset"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror[:1].lower() + reason.strerror[1:]
    return str(reason)


def _http_refusal(url: str, exc: Any, path: str = STATUS_PATH) -> str:
    import json

    try:
        message = json.loads(exc.read())["error"]["message"]
    except Exception:  # noqa: BLE001 - any body that is not our error shape: the status code says enough
        message = None
    if exc.code == 404 and not message:
        return f"{url} answers, but not as slotproxy (HTTP 404 for {path}); check --url"
    return f"{url} refused the request for {path}: HTTP {exc.code}" + (f": {message}" if message else "")


def _clock_skew(date: str | None) -> float:
    """Server clock minus ours, in ms, from the one-second ``Date`` header: 0 unless off by over 1.5 s."""
    if not date:
        return 0.0
    from email.utils import parsedate_to_datetime

    try:
        server = parsedate_to_datetime(date).timestamp() * 1000 + 500
    except (TypeError, ValueError):
        return 0.0
    offset = server - time.time() * 1000
    return offset if abs(offset) > 1500 else 0.0


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


def _glyphs() -> tuple[str, str]:
    """The star and the ellipsis, where stdout can print them."""
    encoding = getattr(sys.stdout, "encoding", None) or "ascii"
    try:
        "★…".encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return "*", "..."
    return "★", "…"


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
        budgets = [(f"{name}", p.get("budget"))] + [(f"{name} key {k.get('name')}", k.get("budget"))
                                                     for k in p.get("keys") or []]
        for who, budget in budgets:
            if budget:
                lines.append(f"  {who} budget: {_budget(budget, clock)}")
    lines += _backend_and_config(status, clock)

    for p in providers:
        lines += _holders(p, clock, star, more)
        lines += _queue(p, clock, star, more)
    return "\n".join(lines)


def _budget(budget: dict[str, Any], clock: _Clock) -> str:
    parts = []
    if budget.get("remaining_requests") is not None:
        parts.append(f"{budget['remaining_requests']:,} requests left")
    if budget.get("remaining_tokens") is not None:
        parts.append(f"{budget['remaining_tokens']:,} tokens left")
    if budget.get("reset_at") is not None:
        parts.append(f"resets {clock.when(budget['reset_at'])}")
    return ", ".join(parts) or "none reported yet"


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


def _status_block(url: str, as_json: bool) -> str:
    import json

    status, skew = fetch_status(url)
    return json.dumps(status, indent=2) if as_json else format_status(status, skew_ms=skew, url=url)


def cmd_status(args: argparse.Namespace) -> int:
    url = _base_url(args.url)
    if args.watch is None:
        print(_status_block(url, args.json))
        return 0
    return _watch(url, args.json, args.watch)


def _watch(url: str, as_json: bool, interval: float) -> int:
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
                block = _status_block(url, as_json)
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


# --- the others --------------------------------------------------------------------------------


def cmd_usage(args: argparse.Namespace) -> int:
    import json

    from ..ledger.report import format_usage

    url = _base_url(args.url)
    document, _ = fetch_json(url, USAGE_PATH, {"since": args.since, "by": args.by})
    print(json.dumps(document, indent=2) if args.json else format_usage(document))
    return 0


def cmd_fake_upstream(args: argparse.Namespace) -> int:
    from ..tools import fake_upstream

    fake_upstream.run(port=args.port, cap=args.cap, chunks=args.chunks, delay_ms=args.delay_ms, lag_ms=args.lag_ms,
                      key_limit=args.key_limit, window_requests=args.window_requests,
                      window_seconds=args.window_seconds, unified=args.unified, websocket=args.websocket,
                      ws_refuse_429=args.ws_refuse_429)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from ..tools import demo

    return demo.main(args)


def cmd_clients(args: argparse.Namespace) -> int:
    from . import clients

    config = _load(find_config(args.config))
    try:
        url = clients.normalize_url(args.url) if args.url else clients.default_url(config)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    print(clients.render(config, url, args.agent), end="")
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    import json

    from ..config import config_json_schema

    print(json.dumps(config_json_schema(), indent=2))
    return 0


def _watch_interval(raw: str) -> float:
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not 0.1 <= seconds <= 3600:
        raise argparse.ArgumentTypeError(f"must be a number of seconds from 0.1 to 3600, got {raw!r}")
    return seconds


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line. With ``argv``, the flags of ``fake-upstream`` and ``demo`` (defined in
    their modules, which import aiohttp) are added only when ``argv`` names that command."""
    command = None if argv is None else next((arg for arg in argv if not arg.startswith("-")), "")

    parser = argparse.ArgumentParser(prog="slotproxy", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"slotproxy {__version__}",
                        help="print the version and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve", help="run the proxy",
        description="Run the proxy in the foreground. Edits to the config file apply while it runs (at once on "
                    "SIGHUP); SIGTERM lets streams finish, then stops it.")
    serve.add_argument("--config", help=CONFIG_HELP)
    serve.add_argument("--host", help="address to listen on (default: server.host in the config, 127.0.0.1 "
                                      "when it is not set)")
    serve.add_argument("--port", type=int, help="port to listen on (default: server.port in the config, 8787 "
                                                "when it is not set)")
    serve.add_argument("--log-format", choices=("text", "json"), default="text",
                       help="log lines as text, or as one JSON object each (default: text)")
    serve.add_argument("--log-level", default="INFO", metavar="LEVEL", type=str.upper,
                       choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                       help="the least severe level logged: DEBUG, INFO, WARNING or ERROR (default: INFO)")
    serve.set_defaults(func=cmd_serve)

    check = commands.add_parser(
        "check", help="validate a config and print the effective config",
        description="Validate a config file and print the effective config, secrets masked (exit 0). An invalid "
                    "one prints every problem with its key path and line (exit 2).")
    check.add_argument("--config", help=CONFIG_HELP)
    check.set_defaults(func=cmd_check)

    status = commands.add_parser(
        "status", help="show the status of a running proxy",
        description="Show a running proxy's providers (limits, in flight, pauses), the requests holding slots "
                    "and the queue, as the dashboard does. Times are this machine's clock time.")
    status.add_argument("--url", default=DEFAULT_URL,
                        help=f"the running proxy's base URL (default: {DEFAULT_URL})")
    status.add_argument("--json", action="store_true",
                        help="print the status document as JSON, times in epoch milliseconds (default: a table)")
    status.add_argument("--watch", nargs="?", const=1.0, type=_watch_interval, metavar="SECONDS",
                        help="redraw every SECONDS until Ctrl-C (default: print once; 1 second when given "
                             "without a number)")
    status.set_defaults(func=cmd_status)

    usage = commands.add_parser(
        "usage", help="show what the requests cost, from a running proxy's ledger",
        description="Show the tokens, requests, errors and queue waits of a running proxy's requests, grouped "
                    "(GET /_slotproxy/usage). With the Redis backend the whole fleet's, unless grouped by "
                    "conversation (each replica's own ledger).")
    usage.add_argument("--url", default=DEFAULT_URL, help=f"the running proxy's base URL (default: {DEFAULT_URL})")
    usage.add_argument("--since", default="24h", metavar="WHEN",
                       help="from when: a duration ago such as 5h or 30m, or epoch milliseconds (default: 24h)")
    usage.add_argument("--by", default="workspace", metavar="FIELDS",
                       help="comma-separated fields to group by: provider, key, model, workspace, conversation, "
                            "hour (default: workspace)")
    usage.add_argument("--json", action="store_true", help="print the answer as JSON (default: a table)")
    usage.set_defaults(func=cmd_usage)

    fake = commands.add_parser(
        "fake-upstream", help="run a mock capped LLM provider",
        description="A mock OpenAI- and Anthropic-compatible provider on 127.0.0.1 with a hard concurrency cap "
                    "(over it, 429 with Retry-After), for trying slotproxy out; GET /stats shows what it saw.")
    if command in (None, "fake-upstream"):
        from ..tools import fake_upstream

        fake_upstream.add_arguments(fake)
    fake.set_defaults(func=cmd_fake_upstream)

    demo_parser = commands.add_parser(
        "demo", help="watch a fleet of agents share a capped fake provider",
        description="Start a capped fake provider, the proxy and a fleet of simulated agents on 127.0.0.1, show "
                    "live progress, and end with a summary.")
    if command in (None, "demo"):
        from ..tools import demo

        demo.add_arguments(demo_parser)
    demo_parser.set_defaults(func=cmd_demo)

    agents = ("claude-code", "codex", "openai-sdk", "anthropic-sdk", "aider", "env")
    clients_parser = commands.add_parser(
        "clients", help="print what each agent needs to use the proxy",
        description="Print, for the config's providers, what each agent needs to send its requests through "
                    "the proxy: environment variables, config lines or SDK snippets.")
    clients_parser.add_argument("--config", help=CONFIG_HELP)
    clients_parser.add_argument("--url", help="the proxy's base URL as the agents reach it (default: built from "
                                "server.host and server.port, 0.0.0.0 and :: as 127.0.0.1)")
    clients_parser.add_argument("--agent", choices=agents,
                                help="print only this agent's guide (default: every agent's, each under a heading)")
    clients_parser.set_defaults(func=cmd_clients)

    schema = commands.add_parser(
        "schema", help="print the config's JSON Schema",
        description="Print the JSON Schema of the config file, for editors that complete and check YAML.")
    schema.set_defaults(func=cmd_schema)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(args_list).parse_args(args_list)
    try:
        code: int = args.func(args)
    except CliError as exc:
        print(f"slotproxy: {exc}", file=sys.stderr)
        return exc.exit_code
    except BindFailed as exc:
        print(f"slotproxy: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
