"""Instructions per small proxied POST, counted by callgrind: slotproxy against the bare aiohttp relay.

CPU seconds per request (``ceiling.py``) move with whatever else the machine
runs: on a shared 2-core machine two runs of the same code can differ by 10%,
more than most changes to the relay are worth. Valgrind's callgrind counts the
instructions a process executes instead, which do not depend on the machine's
load: the same code, inputs and seed give the same count within a fraction of
a percent. It counts user-space instructions only (the kernel's share of a
request, the same for both, is left out), so the ratio here is higher than
``ceiling.py``'s CPU ratio for the same code; use it to compare code, and
``ceiling.py`` for the target.

Each server runs under ``valgrind --tool=callgrind`` (about 50× slower) with
``PYTHONHASHSEED=0``, in front of nginx answering a fixed small JSON (not under
valgrind). ``--connections`` client connections (default 1) each send the
same POST as ``ceiling.py``'s wrk script, one request at a time. With one, the
count repeats to a fraction of a percent; it includes the timers a lone request
sets and a busy server shares. With 16, as in ``ceiling.py``, the server is
saturated (the client is far faster than a server under valgrind) and handles
the requests in much the same batches each round, within a few percent. The
first round starts with ``--warmup`` requests; each round opens its
connections, sends a request on each, zeroes the counters, sends
``--requests`` requests and dumps the count.

    python bench/instructions.py [--rounds 3] [--requests 800] [--warmup 400] [--connections 1]
                                 [--variants full,slot,...] [--backends memory,redis] [--tree DIR]
                                 [--keep DIR]

``--variants`` counts the variants of ``ablate.py`` (each with one part of
slotproxy switched off) instead of, or beside, the full proxy (``full``).
``--backends memory,redis`` counts each of them on both backends, with the
provider config of ``redis_backend.py`` (``limit: 10000``: a slot is taken and
given back in Redis on every request; the Redis server's own work is not
counted, as ``redis_backend.py`` does not bill it to slotproxy either).
``--tree DIR`` adds slotproxy as found in another checkout (``git worktree add
/tmp/base <rev>``), measured the same way: the difference between two trees of
the code, free of the machine's noise (``--tree-windows``: with the ``windows`` variant's config). With
``windows`` among the variants, the upstream announces OpenAI's ``x-ratelimit-*`` headers to every path.
Needs ``valgrind`` and ``nginx``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from ablate import VARIANTS, labelled, variant_config, variants
from common import (
    HOST,
    Processes,
    Spread,
    command_line,
    free_port,
    log,
    machine_note,
    missing_tools,
    raise_on_sigterm,
    split,
    static_nginx_conf,
    wait_http,
)
from otlp_sink import Sink
from overhead import BODY, PATH_PROXIED, slotproxy_yaml, start_nginx
from redis_backend import backend_yaml, config_yaml

VALGRIND_STARTUP_TIMEOUT = 180.0


def request_bytes(port: int) -> bytes:
    """The request wrk sends with ``ceiling.py``'s script."""
    body = BODY.encode()
    head = (f"POST {PATH_PROXIED} HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


class Client:
    """One keep-alive connection sending the same request and reading each whole answer before the next."""

    def __init__(self, port: int) -> None:
        self._sock = socket.create_connection((HOST, port), timeout=60)
        self._request = request_bytes(port)
        self._buffer = b""

    def send(self, count: int) -> None:
        for _ in range(count):
            self._sock.sendall(self._request)
            self._read_answer()

    def _read_answer(self) -> None:
        while b"\r\n\r\n" not in self._buffer:
            self._receive()
        head, _, self._buffer = self._buffer.partition(b"\r\n\r\n")
        status = head.split(b" ", 2)[1]
        if status != b"200":
            raise RuntimeError(f"the server answered {status.decode()}: {head[:200]!r}")
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(self._buffer) < length:
            self._receive()
        self._buffer = self._buffer[length:]

    def _receive(self) -> None:
        data = self._sock.recv(65536)
        if not data:
            raise RuntimeError("the server closed the connection")
        self._buffer += data

    def close(self) -> None:
        self._sock.close()


class Clients:
    """``count`` connections sending ``requests`` requests between them, all at once."""

    def __init__(self, port: int, count: int) -> None:
        self._clients = [Client(port) for _ in range(count)]

    def send(self, requests: int) -> None:
        failures: list[Exception] = []

        def run(client: Client, share: int) -> None:
            try:
                client.send(share)
            except (OSError, RuntimeError) as exc:
                failures.append(exc)

        threads = [threading.Thread(target=run, args=(client, share))
                   for client, share in zip(self._clients, split(requests, len(self._clients)), strict=True)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failures:
            raise failures[0]

    def close(self) -> None:
        for client in self._clients:
            client.close()


class Counted:
    """A server started under callgrind; ``dump()`` is the count of instructions since the last one."""

    def __init__(self, procs: Processes, name: str, argv: list[str], port: int, *, cwd: Path | None = None) -> None:
        self.name = name
        self.port = port
        self._out = procs.workdir / f"{name}.callgrind"
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        if cwd is not None:
            env["PYTHONPATH"] = str(cwd)
        command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={self._out}", *argv]
        with open(procs.workdir / f"{name}.log", "wb") as log_file:
            self.proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, cwd=cwd, env=env)
        procs.started.append(self.proc)
        wait_http(f"http://{HOST}:{port}{PATH_PROXIED}", self.proc, name, timeout=VALGRIND_STARTUP_TIMEOUT)
        self._dumps = 0
        self.last_dump: Path | None = None

    def _control(self, option: str) -> None:
        subprocess.run(["callgrind_control", option, str(self.proc.pid)], check=True, capture_output=True, timeout=120)

    def zero(self) -> None:
        self._control("--zero")

    def dump(self) -> int:
        self._control("--dump")
        self._dumps += 1
        path = Path(f"{self._out}.{self._dumps}")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if path.exists():
                for line in path.read_text().splitlines():
                    if line.startswith("totals:"):
                        self.last_dump = path
                        return int(line.split()[1])
            time.sleep(0.2)
        raise RuntimeError(f"{self.name}: callgrind wrote no totals to {path}")


def config_text(port: int, upstream: str, backend: str, redis_url: str, variant: str = "full",
                otlp_endpoint: str | None = None) -> str:
    """``ceiling.py``'s config on the memory backend; with ``--backends`` naming redis, the config of
    ``redis_backend.py`` (``limit: 10000``, so a slot is taken and given back in Redis) on either backend.
    The ``windows`` variant adds its windows to either, the ``telemetry`` variant its telemetry to ``otlp_endpoint``."""
    if backend == "memory" and redis_url == "":
        return variant_config(variant, slotproxy_yaml(port, {"bench": upstream}), otlp_endpoint)
    return variant_config(variant, config_yaml(port, backend_yaml(backend, redis_url, f"slotproxy-instructions-{port}"),
                                               "bench", upstream, limit=10_000), otlp_endpoint)


def start_targets(procs: Processes, args: argparse.Namespace, upstream_port: int) -> list[Counted]:
    """slotproxy (each ``--variants`` one, run by ``ablate.py``; then the ``--tree`` one), on each of
    ``--backends``, and the bare relay; with the ``telemetry`` variant, first the OTLP sink it exports to (a
    process of its own, not under valgrind)."""
    upstream = f"http://{HOST}:{upstream_port}"
    sink = Sink(procs).endpoint if "telemetry" in args.variants else None
    launches: list[tuple[str, list[str], Path | None, str]] = []
    for variant in args.variants:
        launches.append((labelled(variant), [sys.executable, str(Path(__file__).with_name("ablate.py")), "--serve",
                                             variant], None, variant))
    if args.tree:
        tree_variant = "windows" if args.tree_windows else "full"
        launches.append((labelled(tree_variant).replace("slotproxy", "slotproxy (--tree)", 1),
                         [sys.executable, "-m", "proxy"], Path(args.tree).resolve(), tree_variant))
    redis_url = args.redis_url if "redis" in args.backends else ""
    targets = []
    for name, launcher, tree, variant in launches:
        for backend in args.backends:
            port = free_port()
            config = procs.workdir / f"slotproxy-{port}.yaml"
            config.write_text(config_text(port, upstream, backend, redis_url, variant, sink))
            argv = [*launcher, "serve", "--config", str(config), "--port", str(port), "--log-level", "WARNING"]
            label = name if args.backends == ["memory"] else f"{name}, {backend}"
            targets.append(Counted(procs, label, argv, port, cwd=tree))
    port = free_port()
    relay = [sys.executable, str(Path(__file__).with_name("ceiling.py")), "--relay", str(port), upstream + "/"]
    targets.append(Counted(procs, "bare relay", relay, port))
    return targets


def count_round(target: Counted, args: argparse.Namespace, *, warmup: int) -> float:
    """Instructions per request over one round, on connections opened for it (an idle connection would
    meet the server's keep-alive timeout while the other targets are counted)."""
    clients = Clients(target.port, args.connections)
    try:
        clients.send(warmup + args.connections)
        target.zero()
        clients.send(args.requests)
        return target.dump() / args.requests
    finally:
        clients.close()


def keep_dumps(targets: list[Counted], folder: Path) -> None:
    """Each target's last round's callgrind file, for ``callgrind_annotate --inclusive=yes``."""
    folder.mkdir(parents=True, exist_ok=True)
    for target in targets:
        if target.last_dump is not None:
            name = target.name.replace(", ", "-").replace(" ", "-").replace("(", "").replace(")", "")
            shutil.copyfile(target.last_dump, folder / f"{name}.callgrind")
    log(f"callgrind files of the last round kept in {folder}")


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, list[float]]:
    procs = Processes(workdir)
    try:
        static_port = free_port()
        announce = "windows" in args.variants or args.tree_windows
        start_nginx(procs, "nginx-static", static_nginx_conf(workdir / "nginx-static", static_port,
                                                             rate_limit_headers=announce), "/")
        targets = start_targets(procs, args, static_port)
        results: dict[str, list[float]] = {target.name: [] for target in targets}
        for number in range(1, args.rounds + 1):
            for target in targets:
                results[target.name].append(count_round(target, args, warmup=args.warmup if number == 1 else 0))
                log(f"round {number} {target.name:<28} {results[target.name][-1]:10.0f} instructions/request")
        if args.keep:
            keep_dumps(targets, Path(args.keep))
        return results
    finally:
        procs.stop_all()


def report(results: dict[str, list[float]], args: argparse.Namespace, command: str) -> str:
    bare = results["bare relay"]
    lines = [
        (f"`{command}`: {args.connections} connection(s), each one request at a time, {args.requests} requests "
         f"a round after {args.warmup} to warm up, user-space instructions counted by callgrind."),
        machine_note(with_model=True),
        "",
        "| path | instructions / request | ratio to the bare relay |",
        "|---|---|---|",
    ]
    for name, counts in results.items():
        ratio = Spread.of([count / base for count, base in zip(counts, bare, strict=True)])
        lines.append(f"| {name} | {Spread.of(counts).fmt(0)} | {ratio.fmt(3)} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="counted rounds (default 3)")
    parser.add_argument("--requests", type=int, default=800, help="requests per round (default 800)")
    parser.add_argument("--warmup", type=int, default=400, help="requests before counting starts (default 400)")
    parser.add_argument("--connections", type=int, default=1, help="client connections (default 1)")
    parser.add_argument("--variants", default="full", type=variants,
                        help=f"slotproxy variants of bench/ablate.py to count, comma-separated (default full; "
                             f"known: {', '.join(VARIANTS)})")
    parser.add_argument("--backends", default="memory", type=lambda text: text.split(","),
                        help="backends to count slotproxy on, comma-separated: memory, redis (default memory)")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0",
                        help="the Redis of --backends redis (default redis://127.0.0.1:6379/0)")
    parser.add_argument("--tree", help="also count slotproxy from this checkout (a git worktree of another revision)")
    parser.add_argument("--tree-windows", action="store_true",
                        help="run the --tree slotproxy with the windows variant's config (token windows on)")
    parser.add_argument("--keep", metavar="DIR",
                        help="keep each target's last callgrind file in DIR (read with callgrind_annotate)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.connections < 1 or args.requests < args.connections or args.warmup < 0:
        parser.error("--rounds and --connections >= 1, --requests >= --connections, --warmup >= 0")
    if not args.backends or set(args.backends) - {"memory", "redis"}:
        parser.error("--backends: memory, redis or both, comma-separated")
    if args.tree and not (Path(args.tree) / "proxy" / "__main__.py").exists():
        parser.error(f"--tree {args.tree}: no proxy/__main__.py there")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if missing_tools("instructions.py", ("valgrind", "callgrind_control", "nginx"), "valgrind nginx"):
        return 2
    signal.signal(signal.SIGTERM, raise_on_sigterm)
    command = command_line("instructions.py", argv)
    with tempfile.TemporaryDirectory(prefix="slotproxy-instructions-") as tmp:
        results = measure(args, Path(tmp))
    print(report(results, args, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
