"""Event-loop lag while the ledger writes: how late a 1 ms timer fires with N rows a second being recorded.

The ledger's event-loop side is an append to a list; once a second what has
gathered is pickled to the writer, a process of its own, which writes it in
one transaction. What is left on the loop's side is building the rows and
pickling each second's batch to the writer's pipe. This measures the lag that
causes, in one process per run and nothing else on its loop:

- a producer task records ``--rates`` rows a second (realistic ``LedgerRow``
  values: a few providers, keys, models and workspaces, 200 conversations,
  mostly 200s with some 429s, 499s and 502s, token counts, some unknown),
  every 5 ms the rows that are due, built on the loop as the relay builds them;
- a probe task sleeps 1 ms (``asyncio.sleep(0.001)``) again and again and
  records how late each sleep ended (actual − 1 ms, ``time.perf_counter``);
- ``off``: the same with ``Ledger(None)`` (``ledger: {path: null}``): the
  baseline, producer included; ``on``: ``Ledger(<temp file>)`` as shipped.

Each run is its own process (a fresh heap, a fresh database file), the runs
interleaved by round. Per rate and variant it prints the lateness p50/p99/max
(over all probe samples of the run; median over rounds and their range), the
rows recorded, written (counted in the file after ``close``) and dropped, each
batch's write time p50/p99 (``Ledger.flush``, wall, as the loop waits for it:
pickling, the writer's transaction and the answer) and the writer process's CPU
per batch, how many of the samples over 2 ms overlapped a batch write or a
garbage-collection stop, and the collector's stops over 1 ms. Target: p99 ≤ 2 ms
at 2 000 rows/s. ``--busy 0.5`` also keeps the loop half busy with Python work
in 0.1 ms slices, as a proxy relaying requests is.

    python bench/ledger.py [--rounds 3] [--duration 10] [--rates 2000,10000] [--variants off,on]
                           [--busy 0.5] [--loop asyncio]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import (
    Spread,
    children_of,
    command_line,
    cpu_seconds,
    log,
    machine_note,
    pass_miss_table,
    pct,
    run_loop,
)

from proxy.ledger.store import Ledger, LedgerRow

VARIANTS = {
    "off": "`ledger: {path: null}` (the baseline: the producer and the probe alone)",
    "on": "the ledger as shipped",
}
TARGET_P99_MS = 2.0
TARGET_RATE = 2000
PROBE_SLEEP = 0.001
PRODUCE_EVERY = 0.005
LATE_MS = 2.0
RETENTION = 30 * 86400.0


# --- one run (in its own process) ----------------------------------------------------


def row_templates(count: int, seed: int = 7) -> list[tuple[Any, ...]]:
    """Rows as a busy proxy ends them, less ``ended_at``: the fields after it, in LedgerRow's order."""
    rng = random.Random(seed)
    providers = {"openai": ["gpt-4.1", "gpt-4.1-mini", "o4-mini"], "anthropic": ["claude-sonnet-4", "claude-haiku-4"],
                 "azure": ["gpt-4o"]}
    workspaces = ["default", "backend", "frontend", "data", "research", "ops", "mobile", "infra"]
    conversations = [f"{rng.getrandbits(128):032x}" for _ in range(200)]
    templates = []
    for _ in range(count):
        provider = rng.choice(list(providers))
        key = rng.choice(["key-a", "key-b", "key-c"]) if provider == "openai" else None
        status, outcome = rng.choices([(200, "ok"), (429, "ok"), (499, "client_gone"), (502, "upstream_error")],
                                      weights=[90, 5, 3, 2])[0]
        known = outcome == "ok" and status == 200 and rng.random() < 0.95
        input_tokens = rng.randint(500, 120_000)
        output_tokens = rng.randint(20, 4000)
        templates.append((
            provider, key, rng.choice(providers[provider]), rng.choice(workspaces), rng.random() < 0.1,
            rng.choice(conversations) if rng.random() < 0.8 else None, "http" if rng.random() < 0.9 else "websocket",
            status, outcome, rng.choice([0, 0, 0, 1, 3, 40, 1200]), rng.randint(150, 3000) if known else None,
            rng.randint(300, 90_000),
            input_tokens if known else None, rng.randint(0, input_tokens) if known else None,
            0 if known else None, output_tokens if known else None, rng.randint(0, output_tokens) if known else None,
            rng.choice([0, 0, 0, 0, 0, 0, 0, 0, 1, 2]),
        ))
    return templates


def timed_writes(ledger: Ledger, writes: list[tuple[float, float, int]]) -> None:
    """Wrap the ledger's batch write: (start, end, rows) of each, on ``perf_counter``'s clock."""
    flush = ledger._flush

    async def timed() -> None:
        rows, start = len(ledger._pending), time.perf_counter()
        try:
            await flush()
        finally:
            if rows:
                writes.append((start, time.perf_counter(), rows))

    ledger._flush = timed  # type: ignore[method-assign]


def writer_cpu_seconds() -> float:
    """CPU of this process's children: the ledger's writer."""
    return cpu_seconds(children_of(os.getpid()))


async def one_run(variant: str, rate: int, duration: float, path: Path, busy: float) -> dict[str, Any]:
    ledger = Ledger(None if variant == "off" else path, RETENTION)
    writes: list[tuple[float, float, int]] = []
    timed_writes(ledger, writes)
    await ledger.start()
    templates = row_templates(5000)
    stop = asyncio.Event()
    recorded = 0

    async def produce() -> None:
        nonlocal recorded
        started = time.perf_counter()
        index = 0
        while not stop.is_set():
            await asyncio.sleep(PRODUCE_EVERY)
            due = int((time.perf_counter() - started) * rate)
            now_ms = int(time.time() * 1000)
            while recorded < due:
                ledger.record(LedgerRow(now_ms, *templates[index]))
                index = (index + 1) % len(templates)
                recorded += 1

    async def burn() -> None:
        """Keep the loop busy ``busy`` of the time, as a proxy relaying requests is: Python work in slices of
        0.1 ms (a request's callbacks), ``busy`` × 10 ms of them in every 10 ms."""
        while not stop.is_set():
            window_end = time.perf_counter() + 0.010
            spent = 0.0
            while spent < busy * 0.010 and not stop.is_set():
                start = time.perf_counter()
                while time.perf_counter() - start < 0.0001:
                    pass
                spent += time.perf_counter() - start
                await asyncio.sleep(0)
            await asyncio.sleep(max(window_end - time.perf_counter(), 0))

    samples: list[tuple[float, float]] = []

    async def probe() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            await asyncio.sleep(PROBE_SLEEP)
            end = time.perf_counter()
            samples.append((end, end - start - PROBE_SLEEP))

    collections: list[tuple[int, float, float]] = []  # (generation, start, end) of each garbage collection
    collecting: dict[str, float] = {}

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collecting["start"] = time.perf_counter()
        elif "start" in collecting:
            collections.append((info["generation"], collecting.pop("start"), time.perf_counter()))

    gc.callbacks.append(on_gc)
    producer = asyncio.create_task(produce())
    burner = asyncio.create_task(burn()) if busy > 0 else None
    await asyncio.sleep(1.5)  # the first batch written, the timers settled
    samples.clear()
    writes.clear()
    collections.clear()
    recorded_before = recorded
    writer_cpu = writer_cpu_seconds()
    probing = asyncio.create_task(probe())
    await asyncio.sleep(duration)
    stop.set()
    await asyncio.gather(producer, probing, *([burner] if burner else []))
    measured_writes = list(writes)
    writer_cpu = writer_cpu_seconds() - writer_cpu
    measured_collections = list(collections)
    gc.callbacks.remove(on_gc)
    await ledger.close()
    written = 0
    if variant != "off":
        with sqlite3.connect(path) as check:
            written = int(check.execute("SELECT count(*) FROM requests").fetchone()[0])
    late = [(end, lateness) for end, lateness in samples if lateness * 1000 > LATE_MS]
    during = sum(1 for end, lateness in late
                 if any(w_start <= end and w_end >= end - lateness - PROBE_SLEEP
                        for w_start, w_end, _ in measured_writes))
    during_gc = sum(1 for end, lateness in late
                    if any(g_start <= end and g_end >= end - lateness - PROBE_SLEEP and g_end - g_start > 0.001
                           for _, g_start, g_end in measured_collections))
    lateness_ms = [lateness * 1000 for _, lateness in samples]
    pauses_ms = [(end - start) * 1000 for _, start, end in measured_collections]
    return {
        "samples": len(samples),
        "p50_ms": pct(lateness_ms, 50), "p99_ms": pct(lateness_ms, 99), "max_ms": max(lateness_ms),
        "late": len(late), "late_during_writes": during, "late_during_gc": during_gc,
        "gc_over_1ms": sum(1 for pause in pauses_ms if pause > 1), "gc_max_ms": max(pauses_ms, default=0.0),
        "recorded": recorded, "recorded_measured": recorded - recorded_before,
        "written": written, "dropped": ledger.dropped,
        "batches": len(measured_writes),
        "batch_rows": statistics.median([rows for *_, rows in measured_writes]) if measured_writes else float("nan"),
        "write_p50_ms": pct([(e - s) * 1000 for s, e, _ in measured_writes], 50),
        "write_p99_ms": pct([(e - s) * 1000 for s, e, _ in measured_writes], 99),
        "write_cpu_ms": writer_cpu * 1000 / len(measured_writes) if measured_writes else float("nan"),
    }


# --- the driver ----------------------------------------------------------------------


def run_one(variant: str, rate: int, args: argparse.Namespace, workdir: Path, number: int) -> dict[str, Any]:
    path = workdir / f"ledger-{variant}-{rate}-{number}.sqlite"
    argv = [sys.executable, __file__, "--one", variant, str(rate), str(args.duration), str(path),
            str(args.busy), args.loop]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=args.duration + 120, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("BENCHJSON "):
            return dict(json.loads(line[len("BENCHJSON "):]))
    raise RuntimeError(f"run {variant} at {rate} rows/s printed no result (exit {done.returncode}): "
                       f"{done.stderr[-2000:]}")


def measure(args: argparse.Namespace, workdir: Path) -> dict[tuple[int, str], list[dict[str, Any]]]:
    results: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for number in range(1, args.rounds + 1):
        for rate in args.rates:
            for variant in args.variants:
                figures = run_one(variant, rate, args, workdir, number)
                results.setdefault((rate, variant), []).append(figures)
                log(f"round {number} {rate:>6} rows/s {variant:<7} lateness p50 {figures['p50_ms']:.3f} "
                    f"p99 {figures['p99_ms']:.3f} max {figures['max_ms']:.1f} ms; written {figures['written']} "
                    f"dropped {figures['dropped']}; batch {figures['write_p50_ms']:.1f}/{figures['write_p99_ms']:.1f} ms "
                    f"(CPU {figures['write_cpu_ms']:.1f}); >{LATE_MS:g} ms {figures['late']} "
                    f"({figures['late_during_writes']} during a write, {figures['late_during_gc']} during a GC stop); "
                    f"GC stops > 1 ms {figures['gc_over_1ms']}, max {figures['gc_max_ms']:.1f} ms")
    return results


def spread(runs: list[dict[str, Any]], key: str, digits: int) -> str:
    values = [run[key] for run in runs]
    if any(math.isnan(value) for value in values):  # no batch written (the ledger off)
        return "—"
    return Spread.of(values).fmt(digits)


def report(results: dict[tuple[int, str], list[dict[str, Any]]], args: argparse.Namespace, command: str) -> str:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    samples = statistics.median(run["samples"] for runs in results.values() for run in runs)
    lines = [
        (f"`{command}` ({when}): {args.duration:g} s measured per run (~{samples:.0f} probe samples), "
         "one process per run, "
         f"{args.loop} loop; a 1 ms `asyncio.sleep` probe, the rows recorded every {PRODUCE_EVERY * 1000:g} ms"
         + (f", the loop kept {args.busy:.0%} busy in 0.1 ms slices" if args.busy else ", nothing else on the loop")
         + ". "
         "Cells: median over rounds (min–max)."),
        machine_note(f"SQLite {sqlite3.sqlite_version}", with_model=True),
        "",
        ("| rows/s | variant | lateness p50 ms | p99 ms | max ms | samples > 2 ms, share (during a write / a GC stop) "
         "| GC stops > 1 ms (longest ms) | rows written / recorded | dropped | batch rows | batch write p50 ms "
         "| p99 ms | writer process CPU / batch ms |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (rate, variant), runs in results.items():
        late = "; ".join(f"{run['late']} = {run['late'] / max(run['samples'], 1):.2%} "
                         f"({run['late_during_writes']}/{run['late_during_gc']})" for run in runs)
        stops = "; ".join(f"{run['gc_over_1ms']} ({run['gc_max_ms']:.1f})" for run in runs)
        written = sum(run["written"] for run in runs)
        recorded = sum(run["recorded"] for run in runs)
        rows = "—" if variant == "off" else f"{written} / {recorded}"
        lines.append(
            f"| {rate} | {variant} | {spread(runs, 'p50_ms', 3)} | {spread(runs, 'p99_ms', 3)} | "
            f"{spread(runs, 'max_ms', 1)} | {late} | {stops} | {rows} | {sum(run['dropped'] for run in runs)} | "
            f"{spread(runs, 'batch_rows', 0)} | {spread(runs, 'write_p50_ms', 1)} | {spread(runs, 'write_p99_ms', 1)} | "
            f"{spread(runs, 'write_cpu_ms', 1)} |")
    lines += ["", "Variants: " + "; ".join(f"`{name}`: {VARIANTS[name]}" for name in args.variants) + "."]
    checks = []
    for rate in args.rates:
        if (rate, "on") in results:
            p99 = Spread.of([run["p99_ms"] for run in results[(rate, "on")]])
            goal = f"≤ {TARGET_P99_MS:g} ms" if rate == TARGET_RATE else f"≤ {TARGET_P99_MS:g} ms (headroom, no target)"
            checks.append((f"loop lateness p99, ledger on, {rate} rows/s", f"{p99.fmt(3)} ms", goal,
                           p99.median <= TARGET_P99_MS))
    if checks:
        lines += ["", *pass_miss_table(checks)]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds measured per run (default 10)")
    parser.add_argument("--rates", default=[2000, 10000], type=lambda text: [int(r) for r in text.split(",")],
                        help="rows recorded a second, comma-separated (default 2000,10000)")
    parser.add_argument("--variants", default=["off", "on"], type=lambda text: text.split(","),
                        help=f"comma-separated, of {', '.join(VARIANTS)} (default off,on)")
    parser.add_argument("--busy", type=float, default=0.0,
                        help="share of the loop's time spent in Python work beside the probe, in 0.1 ms slices "
                             "(default 0: an idle loop; 0.5: a proxy half busy)")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                        help="the event loop (default uvloop, as `slotproxy serve` runs)")
    args = parser.parse_args(argv)
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"--variants: unknown {', '.join(sorted(unknown))} (known: {', '.join(VARIANTS)})")
    if args.rounds < 1 or args.duration <= 0 or min(args.rates) < 1 or not 0 <= args.busy < 1:
        parser.error("--rounds and --rates >= 1, --duration > 0, 0 <= --busy < 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--one"]:
        variant, rate, duration, path, busy, loop = argv[1:7]
        coro = one_run(variant, int(rate), float(duration), Path(path), float(busy))
        figures = run_loop(coro) if loop == "uvloop" else asyncio.run(coro)
        print("BENCHJSON " + json.dumps(figures), flush=True)
        return 0
    args = parse_args(argv)
    command = command_line("ledger.py", argv)
    with tempfile.TemporaryDirectory(prefix="slotproxy-ledger-") as tmp:
        results = measure(args, Path(tmp))
    print(report(results, args, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
