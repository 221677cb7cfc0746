"""How many small POSTs/s plain aiohttp can relay here: the ceiling under slotproxy's throughput target.

Issue 2 asks for at least 20% of nginx's requests/s at 16 connections. This puts a
bare aiohttp relay (one pooled ClientSession, read the body, forward, answer: no
limiter, no header rules, no metrics) beside slotproxy and nginx, interleaved in
one run, as one process and as two processes sharing the port (SO_REUSEPORT), so
the gap between slotproxy and the target can be read as "slotproxy's own cost" and
"what aiohttp itself costs on this machine".

slotproxy runs with its ledger on (``ledger.path`` a file in the run's temp
folder: one SQLite row per request, written by its writer process once a
second; its CPU is counted with slotproxy's) and, paired in the same rounds,
with ``ledger: {path: null}``, so the ledger's share of the CPU per request is
read apart. After the run the rows in
the ledger file are counted against the requests slotproxy was sent.

``--variants`` adds slotproxy as ``ablate.py``'s variants run it (``telemetry``: every request traced to
``otlp_sink.py``, a process of its own; ``windows``: token windows on), each with its ledger on as
"slotproxy" has it, in the same rounds; the report gives each one's CPU per request more than slotproxy's
(paired per round). ``full`` is slotproxy itself.

    python bench/ceiling.py [--rounds 3] [--duration 5] [--variants full,telemetry]
"""

from __future__ import annotations

import argparse
import signal
import sqlite3
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ablate import labelled, variant_config, variants
from common import (
    HOST,
    WRK_LUA,
    Processes,
    Spread,
    WrkFigures,
    bare_relay,
    command_line,
    cpu_seconds,
    free_port,
    log,
    machine_note,
    missing_tools,
    nginx_version,
    pass_miss_table,
    process_tree,
    raise_on_sigterm,
    run_loop,
    run_wrk,
    start_serve,
    static_nginx_conf,
    wait_http,
    wrk_version,
)
from otlp_sink import Sink, dropped_spans, exported_note
from overhead import BODY, PATH_PROXIED, proxy_conf, slotproxy_yaml, start_nginx

CONNS = 16
TARGET_RATIO = 0.20
TARGET_CPU_RATIO = 1.25
LEDGER_OFF = "slotproxy, ledger off"
PATHS = ("nginx", "slotproxy", LEDGER_OFF, "aiohttp ×1", "aiohttp ×2")
LEDGER_FILE = "ceiling-ledger.sqlite"


def run_relay(port: int, upstream: str) -> None:
    run_loop(bare_relay(port, upstream, "/bench/", streaming=False))


def start_relays(procs: Processes, name: str, count: int, upstream: str) -> tuple[str, list[int]]:
    port = free_port()
    pids = []
    for index in range(count):
        proc = procs.start(f"{name}-{index}", [sys.executable, __file__, "--relay", str(port), upstream])
        wait_http(f"http://{HOST}:{port}/bench/", proc, name, require_200=False)
        pids.append(proc.pid)
    return f"http://{HOST}:{port}{PATH_PROXIED}", pids


def start_slotproxy(procs: Processes, name: str, upstream: str, ledger: str) -> tuple[int, int]:
    """slotproxy with ``ledger: {path: <ledger>}`` (``null``: no ledger); its pid and port."""
    port = free_port()
    config = slotproxy_yaml(port, {"bench": upstream}) + f"ledger: {{path: {ledger}}}\n"
    return start_serve(procs, name, port, config).pid, port


def start_variant(procs: Processes, variant: str, upstream: str, ledger: str, otlp: str | None) -> tuple[int, int]:
    """slotproxy as ``ablate.py`` runs ``variant``, with its own ledger file as slotproxy has; its pid and port."""
    port = free_port()
    config = procs.workdir / f"{variant}.yaml"
    config.write_text(variant_config(variant, slotproxy_yaml(port, {"bench": upstream}) + f"ledger: {{path: {ledger}}}\n",
                                     otlp))
    proc = procs.start(variant, [sys.executable, str(Path(__file__).with_name("ablate.py")), "--serve", variant, "serve",
                                 "--config", str(config), "--port", str(port), "--log-level", "WARNING"])
    wait_http(f"http://{HOST}:{port}/healthz", proc, variant)
    return proc.pid, port


def ledger_rows(path: Path) -> int:
    """The rows in slotproxy's ledger file (read after slotproxy stopped: SIGTERM writes what is pending)."""
    if not path.exists():
        return 0
    with sqlite3.connect(path) as connection:
        return int(connection.execute("SELECT count(*) FROM requests").fetchone()[0])


def paths(extra: Sequence[str]) -> list[str]:
    """The rows measured: ``PATHS``, with each extra variant's slotproxy after slotproxy's own."""
    rows = list(PATHS)
    rows[2:2] = [labelled(variant) for variant in extra]
    return rows


def measure(args: argparse.Namespace, workdir: Path) \
        -> tuple[dict[str, list[tuple[float, float]]], dict[str, int], list[str]]:
    lua = workdir / "post.lua"
    lua.write_text(WRK_LUA % BODY)
    procs = Processes(workdir)
    notes: list[str] = []
    try:
        static_port, nginx_port = free_port(), free_port()
        start_nginx(procs, "nginx-static", static_nginx_conf(workdir / "nginx-static", static_port,
                                                             rate_limit_headers="windows" in args.variants), "/")
        sink = Sink(procs) if "telemetry" in args.variants else None
        ngx, ngx_worker = start_nginx(procs, "nginx-proxy", proxy_conf(workdir / "nginx-proxy", nginx_port, static_port),
                                      "/bench/")
        slot, slot_port = start_slotproxy(procs, "slotproxy", f"http://{HOST}:{static_port}",
                                          str(workdir / LEDGER_FILE))
        off, off_port = start_slotproxy(procs, "slotproxy-ledger-off", f"http://{HOST}:{static_port}", "null")
        upstream = f"http://{HOST}:{static_port}/"
        targets = {
            "nginx": (f"http://{HOST}:{nginx_port}{PATH_PROXIED}", [ngx.pid, ngx_worker]),
            "slotproxy": (f"http://{HOST}:{slot_port}{PATH_PROXIED}", process_tree(slot)),
            LEDGER_OFF: (f"http://{HOST}:{off_port}{PATH_PROXIED}", process_tree(off)),
            "aiohttp ×1": start_relays(procs, "relay1", 1, upstream),
            "aiohttp ×2": start_relays(procs, "relay2", 2, upstream),
        }
        ports: dict[str, int] = {}
        for variant in args.extra:
            pid, ports[variant] = start_variant(procs, variant, f"http://{HOST}:{static_port}",
                                                str(workdir / f"{variant}-{LEDGER_FILE}"),
                                                sink.endpoint if sink else None)
            targets[labelled(variant)] = (f"http://{HOST}:{ports[variant]}{PATH_PROXIED}", process_tree(pid))
        rows = paths(args.extra)
        sent = dict.fromkeys(rows, 0)
        for name in rows:
            sent[name] += int(run_wrk(targets[name][0], CONNS, 1, lua)["requests"])
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in rows}
        for number in range(1, args.rounds + 1):
            for name in rows:
                url, pids = targets[name]
                before = cpu_seconds(pids)
                figures = WrkFigures.of(run_wrk(url, CONNS, args.duration, lua))
                cpu_us = (cpu_seconds(pids) - before) / max(figures.requests, 1) * 1e6
                sent[name] += figures.requests
                results[name].append((figures.rps, cpu_us))
                log(f"round {number} {name:<26} {figures.rps:8.0f} req/s  {cpu_us:5.0f} µs CPU/req  "
                    f"errors {figures.errors}")
        if sink is not None:
            notes.append(exported_note(sink.settled_stats(), sent[labelled("telemetry")],
                                       dropped_spans(ports["telemetry"])))
    finally:
        procs.stop_all()
    sent["ledger rows"] = ledger_rows(workdir / LEDGER_FILE)
    return results, sent, notes


def report(results: dict[str, list[tuple[float, float]]], sent: dict[str, int], command: str,
           notes: Sequence[str] = ()) -> str:
    nginx = [rps for rps, _ in results["nginx"]]
    lines = [
        f"`{command}` — {CONNS} connections, wrk 1 thread.",
        machine_note(nginx_version(), wrk_version(), with_model=True),
        "Cells: median over rounds (min–max); the ratios are paired per round with nginx (`worker_processes 1`)",
        f"and with the bare relay's CPU per request (target for slotproxy: at most {TARGET_CPU_RATIO}×).",
        "",
        "| path | req/s | ratio to nginx | CPU µs/req (its processes) | CPU / aiohttp ×1 | meets 0.20? |",
        "|---|---|---|---|---|---|",
    ]
    relay_cpu = [c for _, c in results["aiohttp ×1"]]
    for name, row in results.items():
        rps = Spread.of([r for r, _ in row])
        ratio = Spread.of([r / n for (r, _), n in zip(row, nginx)])
        cpu = Spread.of([c for _, c in row])
        cpu_ratio = Spread.of([c / base for (_, c), base in zip(row, relay_cpu)])
        meets = "—" if name == "nginx" else ("yes" if ratio.median >= TARGET_RATIO else "no")
        lines.append(f"| {name} | {rps.fmt(0)} | {ratio.fmt(3)} | {cpu.fmt(0)} | {cpu_ratio.fmt(3)} | {meets} |")
    on, off = [c for _, c in results["slotproxy"]], [c for _, c in results[LEDGER_OFF]]
    share = Spread.of([a - b for a, b in zip(on, off)])
    share_pct = Spread.of([(a - b) / a * 100 for a, b in zip(on, off)])
    to_relay = {name: Spread.of([c / base for c, base in zip(cpu, relay_cpu)])
                for name, cpu in (("slotproxy (ledger on)", on), ("slotproxy, ledger off", off))}
    lines += [
        "",
        (f"The ledger's share of slotproxy's CPU per request (slotproxy − ledger off, paired per round): "
         f"{share.fmt(1)} µs, {share_pct.fmt(1)} % of slotproxy's. The ledger file held {sent['ledger rows']} rows "
         f"for the {sent['slotproxy']} requests slotproxy was sent (warm-up included)."),
        "",
        *pass_miss_table((f"CPU per request, {name} / aiohttp ×1", ratio.fmt(3), f"≤ {TARGET_CPU_RATIO}",
                          ratio.median <= TARGET_CPU_RATIO) for name, ratio in to_relay.items()),
    ]
    for name in (name for name in results if name not in PATHS):
        more = Spread.of([c - base for (_, c), base in zip(results[name], on)])
        lines += ["", f"{name}: {more.fmt(1)} µs CPU a request more than slotproxy (paired per round)."]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per wrk run (default 5)")
    parser.add_argument("--variants", type=variants, default=["full"],
                        help="slotproxy also as these variants of bench/ablate.py run it, comma-separated "
                             "(default full: slotproxy alone)")
    parser.add_argument("--relay", nargs=2, metavar=("PORT", "UPSTREAM"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.extra = [name for name in dict.fromkeys(args.variants) if name != "full"]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.relay:
        run_relay(int(args.relay[0]), args.relay[1])
        return 0
    if missing_tools("ceiling.py", ("nginx", "wrk"), "nginx wrk"):
        return 2
    signal.signal(signal.SIGTERM, raise_on_sigterm)
    command = command_line("ceiling.py", argv)
    with tempfile.TemporaryDirectory(prefix="slotproxy-ceiling-") as tmp:
        results, sent, notes = measure(args, Path(tmp))
    print(report(results, sent, command, notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
