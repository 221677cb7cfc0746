"""What each feature costs per small proxied POST: slotproxy with one part switched off at a time.

Each variant is ``slotproxy serve`` started with one part replaced by the least
that keeps a request flowing (a stand-in, in this process only), measured
interleaved with the full proxy and the bare aiohttp relay of ``ceiling.py``
(16 connections, wrk). The difference to "full" is that part's CPU per request;
what is left once every part is off is aiohttp's own. This is a measuring tool:
a variant with a part off is not a proxy anyone should run.

    python bench/ablate.py [--rounds 3] [--duration 4] [--variants full,ledger,...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common import (
    HOST,
    WRK_LUA,
    Processes,
    WrkFigures,
    bare_relay_answer,
    cpu_seconds,
    free_port,
    log,
    process_tree,
    run_wrk,
    static_nginx_conf,
    wait_http,
)
from multidict import CIMultiDict
from otlp_sink import Sink, dropped_spans, exported_note, telemetry_yaml
from overhead import BODY, PATH_PROXIED, slotproxy_yaml, start_nginx

CONNS = 16
VARIANTS = {
    "full": "everything on",
    "slot": "no slot taken (the limiter, the watchdog, the grant metrics)",
    "priority": "priority headers not read (workspace, star, prompt age, conversation)",
    "headers": "headers not filtered either way (only Content-Type forwarded, as the bare relay does)",
    "guard": "the guard's checks off (Host, Origin, method and path checks)",
    "all": "all four of the above off",
    "ledger": "nothing recorded when a request ends (no ledger row, no fleet aggregates, no token counters)",
    "bookkeeping": "none of what each request cost is read or recorded (no usage read from the answer, no model "
                   "name from the body, no ledger row, no aggregates, no token counters)",
    "server": "the relay itself replaced by the bare relay's handler (what is left is slotproxy's server: "
              "connection limits, the guard, the answers)",
    "windows": "token windows ON (tokens and requests per minute far above what is sent, nothing is held: "
               "the estimate, the windows' bookkeeping, the answer's x-ratelimit headers read, the settling)",
    "telemetry": "telemetry ON (sample 1.0: every request's three spans and its GenAI metrics, exported over "
                 "OTLP/HTTP by the SDK's batch processor and periodic reader to bench/otlp_sink.py, a process of its "
                 "own that discards them)",
}
"""Each part a variant switches off, except ``ADDED``, which add one: with ``windows`` in a run, the upstream
announces ``common.RATE_LIMIT_HEADERS`` to every path, so the pair differs by the windows alone; with
``telemetry``, the OTLP sink is started (its CPU is not counted)."""
ADDED = ("windows", "telemetry")
WINDOWS = "{tokens_per_minute: 1000000000, requests_per_minute: 1000000000}"


def _switch_off(parts: set[str]) -> None:
    from proxy.http import relay
    from proxy.limiter import Priority
    from proxy.server import app

    if "slot" in parts:
        init = relay.Exchange.__init__

        def without_slot(self: relay.Exchange, *args: object, **kwargs: object) -> None:
            init(self, *args, **kwargs)  # type: ignore[arg-type]
            self.needs_slot = False

        relay.Exchange.__init__ = without_slot  # type: ignore[method-assign]
    if parts & {"ledger", "bookkeeping"}:
        from proxy.http.runtime import ProxyState

        ProxyState.account = lambda self, account: None  # type: ignore[method-assign]
    if "bookkeeping" in parts:
        from proxy.providers.tokens import UsageReader

        UsageReader.read = lambda self, text: None  # type: ignore[method-assign]
        relay.model_hint = lambda path, body: None  # type: ignore[assignment]
    if "priority" in parts:
        relay.parse_priority = lambda headers, names, now, body=b"": (  # type: ignore[assignment]
            Priority(prompt_started_at=now, workspace="default", starred=False, conversation=None), [])
    if "headers" in parts:
        relay.forward_request_headers = lambda incoming, strip, auth: [  # type: ignore[assignment]
            ("Content-Type", incoming.get("Content-Type", ""))]
        relay.forward_response_headers = lambda incoming, keep_cors=False: CIMultiDict(  # type: ignore[assignment]
            {"Content-Type": incoming.get("Content-Type", "")})
        relay.check_header_bytes = lambda headers, skip: None  # type: ignore[assignment]
    if "server" in parts:
        app.relay = _bare_relay_handler  # type: ignore[assignment]
    if "guard" in parts:  # the guard still dispatches provider paths, as it must for a request to flow
        app._refusal = lambda request, state: None  # type: ignore[assignment]


async def _bare_relay_handler(request: Any, state: Any, provider: str, rest: str) -> Any:
    """``common.bare_relay``'s handler, on the provider's pooled session."""
    settings = state.provider(provider)
    return await bare_relay_answer(request, state.upstreams.session_for(settings), f"{settings.upstream}/{rest}",
                                   streaming=False)


def variant_config(variant: str, config: str, otlp_endpoint: str | None = None) -> str:
    """The bench's config (one provider, ``bench``) as ``variant`` runs it: with ``windows``, the provider
    holds token windows; with ``telemetry``, every request is traced to ``otlp_endpoint`` (the sink's)."""
    if variant == "telemetry":
        if otlp_endpoint is None:
            raise ValueError("the telemetry variant needs the OTLP sink's endpoint (otlp_sink.Sink)")
        return config + telemetry_yaml(otlp_endpoint)
    if variant != "windows":
        return config
    if config.count("  bench: {") != 1:
        raise ValueError("the windows variant needs the config's one provider written as `  bench: {...}`")
    return config.replace("  bench: {", f"  bench: {{windows: {WINDOWS}, ", 1)


def labelled(variant: str) -> str:
    """How reports name slotproxy as ``variant`` runs it."""
    if variant == "full":
        return "slotproxy"
    return f"slotproxy, {variant} on" if variant in ADDED else f"slotproxy, {variant} off"


def variants(text: str) -> list[str]:
    """``--variants``: comma-separated names of ``VARIANTS`` (an argparse type: a wrong name is refused)."""
    names = text.split(",")
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    return names


def serve(variant: str, argv: list[str]) -> int:
    parts = {"slot", "priority", "headers", "guard"} if variant == "all" else {variant} - {"full", *ADDED}
    _switch_off(parts)
    from proxy.cli import main
    return main(argv)


def measure(args: argparse.Namespace, workdir: Path) -> tuple[dict[str, list[float]], list[str]]:
    """CPU µs per request of each target, per round; and notes on the run (what reached the OTLP sink)."""
    lua = workdir / "post.lua"
    lua.write_text(WRK_LUA % BODY)
    procs = Processes(workdir)
    try:
        static_port = free_port()
        start_nginx(procs, "nginx-static", static_nginx_conf(workdir / "nginx-static", static_port,
                                                             rate_limit_headers="windows" in args.variants), "/")
        sink = Sink(procs) if "telemetry" in args.variants else None
        targets: dict[str, tuple[str, list[int]]] = {}
        ports: dict[str, int] = {}
        for variant in args.variants:
            port = ports[variant] = free_port()
            config = workdir / f"{variant}.yaml"
            config.write_text(variant_config(variant, slotproxy_yaml(port, {"bench": f"http://{HOST}:{static_port}"}),
                                             sink.endpoint if sink else None))
            proc = procs.start(variant, [sys.executable, __file__, "--serve", variant, "serve", "--config", str(config),
                                         "--port", str(port), "--log-level", "WARNING"])
            wait_http(f"http://{HOST}:{port}/healthz", proc, variant, require_200=False)
            targets[variant] = (f"http://{HOST}:{port}{PATH_PROXIED}", process_tree(proc.pid))
        relay_port = free_port()
        ceiling = Path(__file__).with_name("ceiling.py")
        proc = procs.start("relay", [sys.executable, str(ceiling), "--relay", str(relay_port), f"http://{HOST}:{static_port}/"])
        wait_http(f"http://{HOST}:{relay_port}/bench/", proc, "relay", require_200=False)
        targets["bare relay"] = (f"http://{HOST}:{relay_port}{PATH_PROXIED}", [proc.pid])
        sent = dict.fromkeys(targets, 0)
        for name, (url, _) in targets.items():
            sent[name] += int(run_wrk(url, CONNS, 1, lua)["requests"])
        results: dict[str, list[float]] = {name: [] for name in targets}
        for number in range(1, args.rounds + 1):
            for name, (url, pids) in targets.items():
                before = cpu_seconds(pids)
                figures = WrkFigures.of(run_wrk(url, CONNS, args.duration, lua))
                sent[name] += figures.requests
                results[name].append((cpu_seconds(pids) - before) / max(figures.requests, 1) * 1e6)
                log(f"round {number} {name:<10} {results[name][-1]:6.1f} µs CPU/req")
        notes = []
        if sink is not None:
            notes.append(exported_note(sink.settled_stats(), sent["telemetry"], dropped_spans(ports["telemetry"])))
        return results, notes
    finally:
        procs.stop_all()


def report(results: dict[str, list[float]], command: str, notes: Sequence[str] = ()) -> str:
    full = results["full"]
    relay = results["bare relay"]
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [(f"`{command}` ({when}), {CONNS} connections, wrk 1 thread; "
              "CPU µs per request, median of rounds; differences paired per round."), "",
             "| variant | CPU µs/req | less than full | / bare relay |", "|---|---|---|---|"]
    for name, values in results.items():
        saved = statistics.median([f - v for f, v in zip(full, values)])
        ratio = statistics.median([v / r for v, r in zip(values, relay)])
        label = f"{name}: {VARIANTS[name]}" if name in VARIANTS else name
        lines.append(f"| {label} | {statistics.median(values):.1f} | {saved:.1f} | {ratio:.3f} |")
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--serve"]:
        # this checkout's slotproxy, as ``python -m proxy`` from its root runs it (not the one pip installed)
        sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
        return serve(argv[1], argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--variants", type=variants, default=list(VARIANTS),
                        help=f"which to measure, of {','.join(VARIANTS)} (default: all; full is always measured)")
    args = parser.parse_args(argv)
    args.variants = ["full", *(name for name in args.variants if name != "full")]
    with tempfile.TemporaryDirectory(prefix="slotproxy-ablate-") as tmp:
        results, notes = measure(args, Path(tmp))
    print(report(results, " ".join(["python", "bench/ablate.py", *argv]), notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
