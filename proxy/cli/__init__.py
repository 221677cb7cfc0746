"""The ``slotproxy`` command line: init, serve, check, status, usage, fake-upstream, demo, clients, schema.

Every call pays for what this module imports, ``--version`` and ``--help``
included, so it imports only the standard library's light modules at the top;
each command imports what it needs (the config model and pydantic, yaml,
aiohttp) when it runs. The ``fake-upstream`` and ``demo`` flags live with their
modules (which import aiohttp), so they are added only when the command line
names that command (``build_parser()`` with no argument adds every one).

Asking a running proxy is in ``fetch``, the status table in ``status``, the
agents' guides in ``clients``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .. import __version__
from ..server.bind import BindFailed
from .fetch import DEFAULT_URL, EXIT_USAGE, CliError, base_url

TYPE_CHECKING = False  # typing's own costs an import on every call; mypy reads this name the same
if TYPE_CHECKING:
    from pathlib import Path

    from ..config import Config
    from .clients import Setup

__all__ = ["build_parser", "main"]

DEFAULT_CONFIG = "slotproxy.yaml"
CONFIG_ENV = "SLOTPROXY_CONFIG"

DESCRIPTION = ("slotproxy: a proxy that holds concurrency slots for fleets of coding agents in front of LLM "
               "providers. Run slotproxy COMMAND --help for a command's options.")
CONFIG_HELP = f"config file (default: ${CONFIG_ENV}, else ./{DEFAULT_CONFIG})"


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
    raise NoConfig(
        f"no config file found: tried {_tried(from_env)}; "
        f"`slotproxy init` writes a commented one that serves as is to ./{DEFAULT_CONFIG}"
    )


class NoConfig(CliError):
    """No config file where ``serve`` looks (none named with --config)."""


def _tried(from_env: str | None) -> str:
    env_note = f"${CONFIG_ENV}={from_env} (missing)" if from_env else f"${CONFIG_ENV} (unset)"
    return f"--config (not given), {env_note}, ./{DEFAULT_CONFIG} (missing)"


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


def check_telemetry(config: Config) -> None:
    """A configured OTLP endpoint needs the ``otel`` extra: say which install gives it."""
    from ..telemetry import TelemetryNotInstalled, check_installed, telemetry_settings

    settings = telemetry_settings(config.telemetry, os.environ)
    if settings is None:
        return
    try:
        check_installed(settings)
    except TelemetryNotInstalled as exc:
        raise CliError(str(exc)) from None


def cmd_init(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .init import write_example

    written, lines = write_example(Path(args.path), force=args.force, default_name=DEFAULT_CONFIG)
    found_by_default = written.resolve() == Path(DEFAULT_CONFIG).resolve() and not os.environ.get(CONFIG_ENV)
    serve = "slotproxy serve" if found_by_default else f"slotproxy serve --config {written}"
    print("\n".join([*lines, f"next: slotproxy check --config {written}, then {serve}"]))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from ..server.bind import probe

    path = find_config(args.config)
    config = _load(path)
    host = args.host or config.server.host
    port = config.server.port if args.port is None else args.port
    if args.workers > 1 and config.backend.kind != "redis":
        raise CliError(f"--workers {args.workers} needs backend.kind: redis (with the memory backend each worker "
                       "would have limits of its own)")
    check_bind(config, host)
    check_backend_client(config)
    check_telemetry(config)
    if args.worker_of is not None:  # a worker of serve --workers: its parent probed the port and holds it
        return _serve_as_worker(args, config, str(path), host, port)
    probe(host, port)  # a taken port is the one line printed, before start-up logs anything

    from ..logs import setup_logging

    if args.workers > 1:
        from ..server.run import serve_workers
        from ..server.workers import reserve, reuse_port_missing

        if reuse_port_missing():
            raise CliError(f"--workers {args.workers} needs SO_REUSEPORT, which this system does not have (Linux "
                           "has it); run one process, or several with a load balancer in front")
        reservation = reserve(host, port)  # held while the parent runs: port 0 becomes one port for every worker
        setup_logging(args.log_format, args.log_level)
        return serve_workers(config, str(path), host, reservation, args.workers, log_format=args.log_format,
                             log_level=args.log_level)

    from ..server.run import serve

    setup_logging(args.log_format, args.log_level)
    return serve(config, str(path), host, port)


def _serve_as_worker(args: argparse.Namespace, config: Config, path: str, host: str, port: int) -> int:
    from ..logs import setup_logging
    from ..server.run import serve
    from ..server.workers import WorkerLink

    setup_logging(args.log_format, args.log_level, worker=args.worker_index)
    return serve(config, path, host, port, worker=WorkerLink(args.worker_of, args.worker_index, args.worker_fd))


def cmd_check(args: argparse.Namespace) -> int:
    import yaml

    path = find_config(args.config)
    config = _load(path)
    check_backend_client(config)
    check_telemetry(config)
    print(f"# {path}: valid")
    print(f"# {_prices_line(config)}")
    for warning in config.warnings(os.environ):
        print(f"warning: {warning}", file=sys.stderr)
    print(yaml.safe_dump(config.masked(), sort_keys=False, allow_unicode=True), end="")
    return 0


def _prices_line(config: Config) -> str:
    """Where the ledger's costs come from, and the spend caps in force."""
    from ..ledger.prices import genai_prices_version

    published = genai_prices_version()
    source = f"genai-prices {published}'s data" if published else "no published prices (genai-prices is missing)"
    own = len(config.prices)
    line = f"prices: {own} pattern{'' if own == 1 else 's'} from the config, then {source}"
    caps = config.workspaces.spend_per_day_usd
    if caps:
        line += "; spend caps per UTC day: " + ", ".join(f"{name} ${cap:,.2f}" for name, cap in caps.items())
    return line


def cmd_status(args: argparse.Namespace) -> int:
    from .status import status_block, watch

    url = base_url(args.url)
    if args.watch is None:
        print(status_block(url, args.json))
        return 0
    return watch(url, args.json, args.watch)


def cmd_usage(args: argparse.Namespace) -> int:
    import json

    from ..ledger.report import format_usage
    from .fetch import USAGE_PATH, fetch_json

    url = base_url(args.url)
    query = {name: value for name in ("since", "until", "by", "provider", "workspace", "model")
             if (value := getattr(args, name)) is not None}
    document, _ = fetch_json(url, USAGE_PATH, query)
    print(json.dumps(document, indent=2) if args.json else format_usage(document))
    return 0


def cmd_fake_upstream(args: argparse.Namespace) -> int:
    from ..tools import fake_upstream

    try:
        fake_upstream.run(port=args.port, cap=args.cap, chunks=args.chunks, delay_ms=args.delay_ms,
                          lag_ms=args.lag_ms, key_limit=args.key_limit, window_requests=args.window_requests,
                          window_seconds=args.window_seconds, unified=args.unified, websocket=args.websocket,
                          ws_refuse_429=args.ws_refuse_429, itpm=args.itpm, otpm=args.otpm, tpm=args.tpm,
                          rpm=args.rpm)
    except ValueError as exc:
        raise CliError(f"fake-upstream: {exc}") from None
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from ..tools import demo

    return demo.main(args)


def cmd_clients(args: argparse.Namespace) -> int:
    from . import clients

    try:
        url = clients.normalize_url(args.url) if args.url else None
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    try:
        config = _load(find_config(args.config))
    except NoConfig:
        if url is None:
            raise CliError(f"no config file found and no --url to ask a running proxy: tried "
                           f"{_tried(os.environ.get(CONFIG_ENV))}; run it where the config is, or pass --url "
                           f"with the proxy's base URL (such as {DEFAULT_URL})") from None
        print(clients.render(_setup_from_proxy(url), url, args.agent), end="")
        return 0
    print(clients.render(config, url or clients.default_url(config), args.agent, os.environ), end="")
    return 0


def _setup_from_proxy(url: str) -> Setup:
    """The guides' providers from the proxy at ``url`` (its status), with a note on stderr of what that leaves out."""
    from .clients import setup_from_status
    from .fetch import Unreachable, fetch_status

    try:
        document, _ = fetch_status(url)
    except Unreachable as exc:
        reason = str(exc).removesuffix(", or pass --url")
        raise Unreachable(f"no config file found ({_tried(os.environ.get(CONFIG_ENV))}), and the proxy could not "
                          f"be asked for its providers instead: {reason}") from None
    setup = setup_from_status(document)
    if not setup.providers:
        raise Unreachable(f"no config file found, and the proxy at {url} lists no provider")
    print(f"slotproxy: no config file here: the guides are for the providers of the proxy at {url} (its status "
          "shows neither its header names nor whether it needs client keys: the defaults are shown)",
          file=sys.stderr)
    return setup


def cmd_schema(args: argparse.Namespace) -> int:
    import json

    from ..config import config_json_schema

    print(json.dumps(config_json_schema(), indent=2))
    return 0


MAX_WORKERS = 256


def _worker_count(raw: str) -> int:
    try:
        count = int(raw)
    except ValueError:
        count = 0
    if not 1 <= count <= MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to {MAX_WORKERS}, got {raw!r}")
    return count


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

    init = commands.add_parser(
        "init", help="write a commented example config that serves as is",
        description="Write the example config, every key commented, that serves without edits (providers whose "
                    "key variable is unset forward the client's own key), and beside it the JSON Schema its first "
                    "line points editors at. An existing config is left as it is unless --force.")
    init.add_argument("path", nargs="?", default=DEFAULT_CONFIG, metavar="PATH",
                      help=f"where to write it; a folder gets {DEFAULT_CONFIG} in it (default: ./{DEFAULT_CONFIG}, "
                           "what serve reads when given no --config)")
    init.add_argument("--force", action="store_true",
                      help="replace an existing file (default: leave it and exit 2)")
    init.set_defaults(func=cmd_init)

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
    serve.add_argument("--workers", type=_worker_count, default=1, metavar="N",
                       help="run N processes that share the port (SO_REUSEPORT), each a replica of the Redis "
                            "backend, supervised by this one: a worker that dies is started again, SIGTERM and "
                            "SIGHUP reach every worker; needs backend.kind: redis (default: 1, one process)")
    # Internal: how serve --workers starts each worker (its parent's pid, its number, its end of their socket pair).
    serve.add_argument("--worker-of", type=int, help=argparse.SUPPRESS)
    serve.add_argument("--worker-index", type=int, default=1, help=argparse.SUPPRESS)
    serve.add_argument("--worker-fd", type=int, default=-1, help=argparse.SUPPRESS)
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
        description="Show the tokens, requests, errors and queue waits of a running proxy's requests, grouped, "
                    "with a line of totals (GET /_slotproxy/usage). With the Redis backend the whole fleet's, "
                    "unless grouped by conversation, status or outcome (each replica's own ledger).")
    usage.add_argument("--url", default=DEFAULT_URL, help=f"the running proxy's base URL (default: {DEFAULT_URL})")
    usage.add_argument("--since", metavar="WHEN",
                       help="from when: a duration ago such as 5h or 30m, or epoch milliseconds (default: 24 hours "
                            "before --until)")
    usage.add_argument("--until", metavar="WHEN",
                       help="up to when, in the same forms as --since (default: now)")
    usage.add_argument("--by", default="workspace", metavar="FIELDS",
                       help="comma-separated fields to group by: provider, key, model, workspace, conversation, "
                            "hour, status, outcome (default: workspace)")
    for name in ("provider", "workspace", "model"):
        usage.add_argument(f"--{name}", metavar=name.upper(),
                           help=f"only the requests of this {name} (default: every {name})")
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
                    "the proxy: environment variables, config lines or SDK snippets. Where no config file is "
                    "found, the running proxy at the URL given is asked for its providers instead.")
    clients_parser.add_argument("--config", help=CONFIG_HELP)
    clients_parser.add_argument("--url", help="the proxy's base URL as the agents reach it; with no config file "
                                "found, the proxy asked for its providers (default: built from server.host and "
                                "server.port, 0.0.0.0 and :: as 127.0.0.1)")
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
