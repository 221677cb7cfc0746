"""Helpers shared by the benchmark scripts in this directory (not a benchmark itself).

The scripts are run as ``python bench/<name>.py`` from the repository root, so
this directory is ``sys.path[0]`` and they import these with ``from common import ...``.
Everything here behaves exactly as the per-script copies it replaced; where the
copies differed, the difference is a parameter.
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import platform
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp

HOST = "127.0.0.1"
STARTUP_TIMEOUT = 20.0
STOP_TIMEOUT = 5.0
TICK = os.sysconf("SC_CLK_TCK")
WRK_THREADS = 1
STATIC_REPLY = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "model": "bench-model",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13,
                  "prompt_tokens_details": {"cached_tokens": 0}, "completion_tokens_details": {"reasoning_tokens": 0}},
    },
    separators=(",", ":"),
)


# --- small helpers -------------------------------------------------------------------


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def pct(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Spread:
    """The median of per-round values and their range."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values))

    def fmt(self, digits: int = 2) -> str:
        if self.low == self.high:
            return f"{self.median:.{digits}f}"
        return f"{self.median:.{digits}f} ({self.low:.{digits}f}–{self.high:.{digits}f})"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def fmt(value: float | None, digits: int) -> str:
    """``n/a`` for None (and NaN), else the value with ``digits`` decimals."""
    return "n/a" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def pass_miss_table(rows: Iterable[tuple[str, str, str, bool]], measured: str = "measured") -> Iterator[str]:
    """The markdown PASS/MISS table of (label, measured, goal, ok) rows."""
    yield f"| target | {measured} | goal | |"
    yield "|---|---|---|---|"
    for label, value, goal, ok in rows:
        yield f"| {label} | {value} | {goal} | {verdict(ok)} |"


def raise_nofile() -> int:
    """Raise the open-file limit to the hard limit (children inherit it)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def enough_open_files(script: str, need: int, who: str = "the proxy") -> bool:
    """Raise the open-file limit to its hard limit; False, after one line on stderr, when that is below the
    ``need`` sockets ``who`` will hold."""
    hard = raise_nofile()
    log(f"open-file limit raised to {hard} ({who} needs about {need})")
    if hard < need:
        print(f"{script}: the open-file hard limit {hard} is below the ~{need} sockets {who} needs", file=sys.stderr)
        return False
    return True


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """How this run was started, as RESULTS.md quotes it: ``python bench/<script> <its arguments>``."""
    return " ".join(["python", f"bench/{script}", *(sys.argv[1:] if argv is None else argv)])


def missing_tools(script: str, tools: Sequence[str], install: str) -> bool:
    """Whether one of ``tools`` is not on PATH; the first missing one is named on stderr with the Debian
    packages that bring it (``install``)."""
    for tool in tools:
        if shutil.which(tool) is None:
            print(f"{script}: {tool} not found on PATH (apt-get install {install})", file=sys.stderr)
            return True
    return False


def raise_on_sigterm(signum: int, frame: object) -> None:
    """A SIGTERM handler: exit through ``finally`` blocks, so every started server gets stopped."""
    raise SystemExit(128 + signum)


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.load(response)


def split(total: int, parts: int) -> list[int]:
    """``total`` dealt into ``parts`` shares that differ by one at most."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def run_loop(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run on uvloop when it is installed, like ``slotproxy serve``; else asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


# --- the bare aiohttp relay (ceiling.py, overhead.py): the floor slotproxy is measured against ---


async def bare_relay_answer(request: Any, session: aiohttp.ClientSession, url: str, *, streaming: bool) -> Any:
    """The bare relay's handler: read the body, forward it on ``session`` to ``url``, answer."""
    from aiohttp import web

    body = await request.read()
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as answer:
        if not streaming:
            data = await answer.read()
            return web.Response(body=data, status=answer.status, headers={
                "Content-Type": answer.headers.get("Content-Type", "application/json")})
        response = web.StreamResponse(status=answer.status, headers={
            "Content-Type": answer.headers.get("Content-Type", "text/event-stream")})
        await response.prepare(request)
        async for chunk in answer.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response


async def bare_relay(port: int, upstream: str, prefix: str, *, streaming: bool) -> None:
    """Read the body, forward it with one pooled ClientSession, answer: no limiter, no header rules, no
    metrics. ``streaming``: write each upstream chunk on as it arrives (else read the answer whole).
    Serves ``POST {prefix}{rest}`` → ``{upstream}{rest}`` on ``port`` (SO_REUSEPORT, so several may share it)."""
    from aiohttp import web

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False,
                                    cookie_jar=aiohttp.DummyCookieJar())

    async def handler(request: web.Request) -> web.StreamResponse:
        return await bare_relay_answer(request, session, upstream + request.match_info["rest"], streaming=streaming)

    app = web.Application()
    app.router.add_post(prefix + "{rest:.*}", handler)
    await serve_forever(app, port, reuse_port=True)


async def serve_forever(app: Any, port: int, *, reuse_port: bool = False) -> None:
    """Serve the aiohttp ``app`` on ``HOST:port`` (no access log) until the process is stopped."""
    from aiohttp import web

    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, HOST, port, reuse_port=reuse_port).start()
    await asyncio.Event().wait()


# --- client processes (streams.py, soak.py) ------------------------------------------


def serve_client(loop: Coroutine[Any, Any, Any]) -> None:
    """The body of a spawned client process: its parent decides when it stops (SIGINT is ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise_nofile()
    run_loop(loop)


class ClientPool:
    """Client processes spawned to run ``target(conn)``, each at the far end of a pipe of its own.

    Each benchmark speaks its own commands over the pipes; a pool only starts, answers and ends them."""

    def __init__(self, count: int, target: Any) -> None:
        context = multiprocessing.get_context("spawn")
        self.pipes: list[multiprocessing.connection.Connection] = []
        self.procs: list[Any] = []
        for _ in range(count):
            parent, child = context.Pipe()
            proc = context.Process(target=target, args=(child,), daemon=True)
            proc.start()
            child.close()
            self.pipes.append(parent)
            self.procs.append(proc)

    @property
    def pids(self) -> list[int]:
        return [int(proc.pid) for proc in self.procs]

    @staticmethod
    def reply(pipe: multiprocessing.connection.Connection, timeout: float) -> dict[str, Any]:
        if not pipe.poll(timeout):
            raise RuntimeError(f"a client process did not answer within {timeout:.0f}s")
        return dict(pipe.recv())

    def send_stop(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(("stop",))
            except (BrokenPipeError, OSError):
                pass

    def kill(self) -> None:
        """Wait for each to end, then terminate, then kill what is left; close the pipes."""
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for pipe in self.pipes:
            pipe.close()


# --- machine note --------------------------------------------------------------------


def tool_version(argv: list[str]) -> str:
    """The first line a ``--version``-style command prints (stdout or stderr), or ``?``."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except OSError:
        return "?"
    text = (done.stdout + done.stderr).strip()
    return text.splitlines()[0] if text else "?"


def nginx_version() -> str:
    return tool_version(["nginx", "-v"]).removeprefix("nginx version: ")


def wrk_version() -> str:
    return tool_version(["wrk", "-v"]).split(" [")[0]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


def machine_note(*extras: str, with_model: bool = False) -> str:
    """CPUs (and their model), Linux, Python and aiohttp versions, then ``extras``, comma-separated."""
    cpus = f"{os.cpu_count()} CPUs ({cpu_model()})" if with_model else f"{os.cpu_count()} CPUs"
    return ", ".join([cpus, f"Linux {platform.release()}", f"Python {platform.python_version()}",
                      f"aiohttp {aiohttp.__version__}", *extras])


# --- /proc ---------------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str]:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return raw[raw.rindex(")") + 2 :].split()


def cpu_seconds(pids: Sequence[int]) -> float:
    """utime + stime of these processes (all their threads), in seconds."""
    total = 0
    for pid in pids:
        try:
            fields = _stat_fields(pid)
        except (OSError, ValueError):
            continue
        total += int(fields[11]) + int(fields[12])
    return total / TICK


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int(_stat_fields(int(entry.name))[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return found


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process under it (slotproxy's ledger writer)."""
    tree, index = [pid], 0
    while index < len(tree):
        tree.extend(children_of(tree[index]))
        index += 1
    return tree


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


# --- Redis keys ----------------------------------------------------------------------


def redis_keys(client: Any, prefix: str) -> Iterator[bytes]:
    """The keys a run with ``key_prefix: <prefix>…`` left in Redis: slotproxy's keys are
    ``{<prefix>:<provider>}:…`` (one hash tag per provider); keys without a tag start with the prefix."""
    for pattern in (f"{prefix}*", f"{{{prefix}*"):
        yield from client.scan_iter(match=pattern, count=1000)


def delete_redis_keys(client: Any, prefix: str, max_keys: int = 200_000) -> int:
    """Delete the keys ``redis_keys`` finds (bounded); returns how many."""
    deleted = 0
    batch: list[bytes] = []
    for key in redis_keys(client, prefix):
        batch.append(key)
        if len(batch) >= 500:
            deleted += int(client.delete(*batch))
            batch.clear()
        if deleted + len(batch) >= max_keys:
            log(f"redis: stopped deleting after {max_keys} keys under {prefix}")
            break
    if batch:
        deleted += int(client.delete(*batch))
    return deleted


# --- processes -----------------------------------------------------------------------


class Processes:
    """Every server a script starts, each in its own process group; stop_all ends them.

    ``term_timeout``: how long each group gets after SIGTERM before the SIGKILL.
    """

    def __init__(self, workdir: Path, term_timeout: float = STOP_TIMEOUT) -> None:
        self.workdir = workdir
        self.term_timeout = term_timeout
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with open(self.workdir / f"{name}.log", "wb") as out:
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self.started.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.started):
            stop_group(proc, self.term_timeout)
        self.started.clear()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_group(proc: subprocess.Popen[bytes], term_timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left of it (nginx workers, say)."""
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=term_timeout)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        log(f"pid {proc.pid} did not exit after SIGKILL")


def wait_http(url: str, proc: subprocess.Popen[bytes], what: str, timeout: float = STARTUP_TIMEOUT, *,
              require_200: bool = False) -> None:
    """Poll a GET until it answers < 500 (or exactly 200 with ``require_200``);
    fail if the process died or the time ran out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} before it answered {url}")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if (response.status == 200) if require_200 else (response.status < 500):
                    return
        except urllib.error.HTTPError as exc:
            if not require_200 and exc.code < 500:
                return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    if require_200:
        raise RuntimeError(f"{what} did not answer 200 on {url} within {timeout:.0f}s")
    raise RuntimeError(f"{what} did not answer {url} within {timeout:.0f}s")


# --- servers -------------------------------------------------------------------------


def start_serve(procs: Processes, name: str, port: int, config_text: str, *, config_name: str | None = None,
                ready_path: str = "/healthz", require_200: bool = False) -> subprocess.Popen[bytes]:
    """Write ``config_text`` to ``<workdir>/<config_name or name>.yaml`` and start ``python -m proxy serve``
    on ``port`` with it; return once ``ready_path`` answers."""
    config = procs.workdir / f"{config_name or name}.yaml"
    config.write_text(config_text)
    argv = [sys.executable, "-m", "proxy", "serve", "--config", str(config), "--port", str(port),
            "--log-level", "WARNING"]
    proc = procs.start(name, argv)
    wait_http(f"http://{HOST}:{port}{ready_path}", proc, name, require_200=require_200)
    return proc


def start_fake_upstream(procs: Processes, name: str, options: list[str], *, what: str | None = None) \
        -> tuple[subprocess.Popen[bytes], int]:
    """``python -m proxy fake-upstream --port <free port> <options>``; return once ``/stats`` answers."""
    port = free_port()
    argv = [sys.executable, "-m", "proxy", "fake-upstream", "--port", str(port), *options]
    proc = procs.start(name, argv)
    wait_http(f"http://{HOST}:{port}/stats", proc, what or name)
    return proc, port


def nginx_head(prefix: Path) -> str:
    """nginx.conf up to and including the opening of ``http {``: one worker, temp paths under ``prefix``."""
    user = "user root;\n" if os.geteuid() == 0 else ""
    temps = "\n".join(f"    {kind}_temp_path {prefix}/{kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return (
        f"{user}worker_processes 1;\npid {prefix}/nginx.pid;\nerror_log {prefix}/error.log warn;\n"
        "events { worker_connections 4096; }\n"
        "http {\n    access_log off;\n    keepalive_timeout 75s;\n    keepalive_requests 1000000;\n"
        f"{temps}\n"
    )


RATE_LIMIT_HEADERS = {
    "x-ratelimit-limit-requests": "1000000000",
    "x-ratelimit-limit-tokens": "1000000000",
    "x-ratelimit-remaining-requests": "9999999$connection_requests",
    "x-ratelimit-remaining-tokens": "9999999$connection_requests",
    "x-ratelimit-reset-requests": "6ms",
    "x-ratelimit-reset-tokens": "6ms",
}
"""The windows OpenAI announces on every answer, far above what a bench sends: the limits fixed, the room
changing with each answer (``$connection_requests`` after nines: never below a tenth of the limit)."""


def static_nginx_conf(prefix: Path, port: int, *, rate_limit_headers: bool = False) -> str:
    """nginx answering every request (POST included) with a fixed small JSON, at once (with
    ``rate_limit_headers``, announcing ``RATE_LIMIT_HEADERS`` as OpenAI does)."""
    added = "".join(f"            add_header {name} {value};\n"
                    for name, value in RATE_LIMIT_HEADERS.items()) if rate_limit_headers else ""
    return nginx_head(prefix) + (
        f"    server {{\n        listen {HOST}:{port};\n"
        "        location / {\n            default_type application/json;\n"
        f"{added}"
        f"            return 200 '{STATIC_REPLY}';\n        }}\n    }}\n}}\n"
    )


def launch_nginx(procs: Processes, name: str, conf: str, *, exist_ok: bool = False) -> subprocess.Popen[bytes]:
    """Start nginx in the foreground with ``conf`` and the prefix ``<workdir>/<name>`` (not waiting for it)."""
    prefix = procs.workdir / name
    prefix.mkdir(exist_ok=exist_ok)
    (prefix / "nginx.conf").write_text(conf)
    argv = ["nginx", "-p", str(prefix), "-e", str(prefix / "error.log"), "-c", str(prefix / "nginx.conf"),
            "-g", "daemon off;"]
    return procs.start(name, argv)


# --- agent fleets (redis_backend.py, saturation.py) ----------------------------------

AGENT_MESSAGES = [{"role": "user", "content": "Write the next step of the plan."}]


class AgentCounts(Protocol):
    agent_429: int
    errors: int


def agent_body(index: int, model: str = "fake-model") -> dict[str, Any]:
    """Agent ``index``'s streaming chat completion request."""
    return {"model": model, "stream": True, "messages": AGENT_MESSAGES, "user": f"agent-{index}"}


async def count_refusal(response: aiohttp.ClientResponse, counts: AgentCounts) -> None:
    """A non-200 answer to an agent: read it, count a 429 as ``agent_429`` and anything else as ``errors``."""
    await response.read()
    if response.status == 429:
        counts.agent_429 += 1
    else:
        counts.errors += 1


async def read_to_done(response: aiohttp.ClientResponse) -> bool:
    """Read every SSE line; True when the stream ended with ``data: [DONE]``."""
    done = False
    async for line in response.content:
        done = done or line.strip() == b"data: [DONE]"
    return done


# --- wrk -----------------------------------------------------------------------------

WRK_LUA = """wrk.method = "POST"
wrk.body = [[%s]]
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('BENCHJSON {"requests": %%d, "duration_us": %%d, "p50_us": %%f, "p99_us": %%f, '
    .. '"errors": %%d, "non2xx": %%d}\\n', summary.requests, summary.duration,
    latency:percentile(50), latency:percentile(99), e.connect + e.read + e.write + e.timeout, e.status))
end
"""


def run_wrk(url: str, conns: int, duration: float, lua: Path) -> dict[str, Any]:
    """One wrk run with the WRK_LUA script ``lua``; its BENCHJSON line as a dict."""
    argv = ["wrk", f"-t{min(WRK_THREADS, conns)}", f"-c{conns}", f"-d{duration:g}s", "--timeout", "5s",
            "-s", str(lua), url]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 30, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("BENCHJSON "):
            return dict(json.loads(line[len("BENCHJSON "):]))
    raise RuntimeError(f"wrk printed no result (exit {done.returncode}): {done.stdout[-500:]} {done.stderr[-500:]}")


@dataclass(frozen=True)
class WrkFigures:
    """What every bench reads from one wrk run."""

    requests: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int

    @classmethod
    def of(cls, result: dict[str, Any]) -> WrkFigures:
        return cls(
            requests=int(result["requests"]),
            rps=result["requests"] / (result["duration_us"] / 1e6),
            p50_ms=result["p50_us"] / 1000,
            p99_ms=result["p99_us"] / 1000,
            errors=int(result["errors"]) + int(result["non2xx"]),
        )
