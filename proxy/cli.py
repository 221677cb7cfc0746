"""The ``slotproxy`` command line: serve, check, status, fake-upstream, demo, clients, schema."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from . import __version__
from .config import Config, ConfigError, config_json_schema, load_config
from .guard import is_loopback_address
from .logs import setup_logging

__all__ = ["main"]

DEFAULT_CONFIG = "slotproxy.yaml"
CONFIG_ENV = "SLOTPROXY_CONFIG"
EXIT_USAGE = 2


class CliError(Exception):
    """A problem to report in one line before exiting with status 2."""


def find_config(explicit: str | None) -> Path:
    """--config, else $SLOTPROXY_CONFIG, else ./slotproxy.yaml."""
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
    try:
        return load_config(path)
    except ConfigError as exc:
        raise CliError(f"{path}: invalid config\n" + "\n".join(f"  {p}" for p in exc.problems)) from exc


def check_bind(config: Config, host: str) -> None:
    """Refuse a non-loopback bind without an admin token, unless explicitly allowed."""
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
    from .server import serve

    path = find_config(args.config)
    config = _load(path)
    host = args.host or config.server.host
    port = config.server.port if args.port is None else args.port
    check_bind(config, host)
    check_backend_client(config)
    setup_logging(args.log_format, args.log_level)
    return serve(config, str(path), host, port)


def cmd_check(args: argparse.Namespace) -> int:
    path = find_config(args.config)
    config = _load(path)
    check_backend_client(config)
    print(f"# {path}: valid")
    for warning in config.warnings(os.environ):
        print(f"warning: {warning}", file=sys.stderr)
    print(yaml.safe_dump(config.masked(), sort_keys=False, allow_unicode=True), end="")
    return 0


def _fetch_status(url: str) -> dict[str, Any]:
    target = url.rstrip("/") + "/_slotproxy/status"
    try:
        with urllib.request.urlopen(target, timeout=5) as response:
            data: dict[str, Any] = json.load(response)
            return data
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise CliError(f"cannot read status from {target}: {exc}") from exc


def _cell(value: object) -> str:
    return "-" if value is None else str(value)


def format_status(status: dict[str, Any]) -> str:
    columns = ("provider", "limit", "configured_limit", "in_flight", "queued", "paused_until", "cooldown_ms")
    headers = ("PROVIDER", "LIMIT", "CONFIGURED", "IN_FLIGHT", "QUEUED", "PAUSED_UNTIL", "COOLDOWN_MS")
    rows: list[tuple[str, ...]] = [headers]
    for provider in status.get("providers", []):
        rows.append(tuple(_cell(provider.get(c)) for c in columns))
        for key in provider.get("keys") or []:
            name = f"  key {key.get('name')}" + ("" if key.get("available", True) else " (not set)")
            rows.append((name, *(_cell(key.get(c)) for c in columns[1:4]), "-", _cell(key.get("paused_until")), "-"))
        for model in provider.get("models") or []:
            rows.append((f"  model {model.get('pattern')}", *(_cell(model.get(c)) for c in columns[1:4]),
                         "-", "-", "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    for provider in status.get("providers", []):
        if provider.get("notice"):
            lines.append(f"! {provider['provider']}: {provider['notice']}")
        for key in provider.get("keys") or []:
            if key.get("notice"):
                lines.append(f"! {provider['provider']} key {key.get('name')}: {key['notice']}")
    config = status.get("config") or {}
    if config.get("error"):
        lines.append(f"! config: {config['error']}")
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    status = _fetch_status(args.url)
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


def cmd_fake_upstream(args: argparse.Namespace) -> int:
    from . import fake_upstream

    fake_upstream.run(port=args.port, cap=args.cap, chunks=args.chunks, delay_ms=args.delay_ms, lag_ms=args.lag_ms,
                      key_limit=args.key_limit, window_requests=args.window_requests,
                      window_seconds=args.window_seconds, unified=args.unified, websocket=args.websocket,
                      ws_refuse_429=args.ws_refuse_429)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from . import demo

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
    print(json.dumps(config_json_schema(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import fake_upstream

    parser = argparse.ArgumentParser(prog="slotproxy", description=__doc__)
    parser.add_argument("--version", action="version", version=f"slotproxy {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the proxy")
    serve.add_argument("--config", help=f"config file (else ${CONFIG_ENV}, else ./{DEFAULT_CONFIG})")
    serve.add_argument("--host", help="listen address (overrides server.host)")
    serve.add_argument("--port", type=int, help="listen port (overrides server.port)")
    serve.add_argument("--log-format", choices=("text", "json"), default="text")
    serve.add_argument("--log-level", default="INFO")
    serve.set_defaults(func=cmd_serve)

    check = commands.add_parser("check", help="validate a config and print the effective config")
    check.add_argument("--config", help=f"config file (else ${CONFIG_ENV}, else ./{DEFAULT_CONFIG})")
    check.set_defaults(func=cmd_check)

    status = commands.add_parser("status", help="show the status of a running proxy")
    status.add_argument("--url", default="http://127.0.0.1:8787")
    status.add_argument("--json", action="store_true", help="print the raw JSON")
    status.set_defaults(func=cmd_status)

    fake = commands.add_parser("fake-upstream", help="run a mock capped LLM provider")
    fake_upstream.add_arguments(fake)
    fake.set_defaults(func=cmd_fake_upstream)

    from . import demo

    demo_parser = commands.add_parser("demo", help="watch a fleet of agents share a capped fake provider")
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(func=cmd_demo)

    agents = ("claude-code", "codex", "openai-sdk", "anthropic-sdk", "aider", "env")
    clients_parser = commands.add_parser("clients", help="print what each agent needs to use the proxy")
    clients_parser.add_argument("--config", help=f"config file (default: ${CONFIG_ENV}, else ./{DEFAULT_CONFIG})")
    clients_parser.add_argument("--url", help="the proxy's base URL as the agents reach it (default: built from "
                                "server.host and server.port, 0.0.0.0 and :: as 127.0.0.1)")
    clients_parser.add_argument("--agent", choices=agents,
                                help="print only this agent's guide (default: every agent's, each under a heading)")
    clients_parser.set_defaults(func=cmd_clients)

    schema = commands.add_parser("schema", help="print the config's JSON Schema")
    schema.set_defaults(func=cmd_schema)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except CliError as exc:
        print(f"slotproxy: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
