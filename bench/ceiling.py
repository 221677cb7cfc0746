"""How many small POSTs/s plain aiohttp can relay here: the ceiling under slotproxy's throughput target.

Issue 2 asks for at least 20% of nginx's requests/s at 16 connections. This puts a
bare aiohttp relay (one pooled ClientSession, read the body, forward, answer: no
limiter, no header rules, no metrics) beside slotproxy and nginx, interleaved in
one run, as one process and as two processes sharing the port (SO_REUSEPORT), so
the gap between slotproxy and the target can be read as "slotproxy's own cost" and
"what aiohttp itself costs on this machine".

    python bench/ceiling.py [--rounds 3] [--duration 5]
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

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
    raise_on_sigterm,
    run_loop,
    run_wrk,
    static_nginx_conf,
    wait_http,
    wrk_version,
)
from overhead import BODY, PATH_PROXIED, proxy_conf, start_nginx, start_slotproxy

CONNS = 16
TARGET_RATIO = 0.20
TARGET_CPU_RATIO = 1.15
PATHS = ("nginx", "slotproxy", "aiohttp ×1", "aiohttp ×2")


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


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, list[tuple[float, float]]]:
    lua = workdir / "post.lua"
    lua.write_text(WRK_LUA % BODY)
    procs = Processes(workdir)
    try:
        static_port, nginx_port = free_port(), free_port()
        start_nginx(procs, "nginx-static", static_nginx_conf(workdir / "nginx-static", static_port), "/")
        ngx, ngx_worker = start_nginx(procs, "nginx-proxy", proxy_conf(workdir / "nginx-proxy", nginx_port, static_port),
                                      "/bench/")
        slot, slot_port = start_slotproxy(procs, "slotproxy", {"bench": f"http://{HOST}:{static_port}"})
        upstream = f"http://{HOST}:{static_port}/"
        targets = {
            "nginx": (f"http://{HOST}:{nginx_port}{PATH_PROXIED}", [ngx.pid, ngx_worker]),
            "slotproxy": (f"http://{HOST}:{slot_port}{PATH_PROXIED}", [slot.pid]),
            "aiohttp ×1": start_relays(procs, "relay1", 1, upstream),
            "aiohttp ×2": start_relays(procs, "relay2", 2, upstream),
        }
        for url, _ in targets.values():
            run_wrk(url, CONNS, 1, lua)
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in PATHS}
        for number in range(1, args.rounds + 1):
            for name in PATHS:
                url, pids = targets[name]
                before = cpu_seconds(pids)
                figures = WrkFigures.of(run_wrk(url, CONNS, args.duration, lua))
                cpu_us = (cpu_seconds(pids) - before) / max(figures.requests, 1) * 1e6
                results[name].append((figures.rps, cpu_us))
                log(f"round {number} {name:<11} {figures.rps:8.0f} req/s  {cpu_us:5.0f} µs CPU/req  "
                    f"errors {figures.errors}")
        return results
    finally:
        procs.stop_all()


def report(results: dict[str, list[tuple[float, float]]], command: str) -> str:
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
    for name in PATHS:
        rps = Spread.of([r for r, _ in results[name]])
        ratio = Spread.of([r / n for (r, _), n in zip(results[name], nginx)])
        cpu = Spread.of([c for _, c in results[name]])
        cpu_ratio = Spread.of([c / base for (_, c), base in zip(results[name], relay_cpu)])
        meets = "—" if name == "nginx" else ("yes" if ratio.median >= TARGET_RATIO else "no")
        lines.append(f"| {name} | {rps.fmt(0)} | {ratio.fmt(3)} | {cpu.fmt(0)} | {cpu_ratio.fmt(3)} | {meets} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per wrk run (default 5)")
    parser.add_argument("--relay", nargs=2, metavar=("PORT", "UPSTREAM"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


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
        results = measure(args, Path(tmp))
    print(report(results, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
