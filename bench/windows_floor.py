"""The floor under the token windows' CPU: the least a request with windows must do, in plain Python, counted.

Issue 34 asks for windows to cost at most 10 µs a request more than no windows,
about 40 000 instructions on this machine (0.23 ns an instruction, ``bench/RESULTS.md``).
This counts, with callgrind, one tight function that does only the work no
implementation can leave out for an OpenAI request under a tokens and a requests
window (``bench/instructions.py``'s ``windows`` variant's request and answer):
estimate the cost from the body's bytes and its output maximum, refill and check two
buckets, take from them, lower them to the answer's ``-remaining`` counts, charge
what the usage shows beyond the estimate, give the reservation back and learn the
ratio and the output p90. It leaves out what slotproxy also does: the model group,
the key choice and the queue, the limits learned from headers, the drift and
re-costing, the estimate errors status shows, the Anthropic prompt-cache mirror.
It is a model of the work, not the code, but for two pieces it takes from slotproxy as they are: the
estimator's keeper of recent values and their p90 (``estimate._Recent``), and the collector's settings
(``heap.settle_heap``).

The count is the difference between two runs of ``--passes`` and twice that, so
the interpreter's start-up cancels out (both with one hash seed); the collector is set
as ``slotproxy serve`` sets it (what is loaded frozen, young passes after 2 000).

    python bench/windows_floor.py [--passes 2000]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from proxy.http.heap import settle_heap
from proxy.providers.estimate import _Recent

TARGET = 40_000
"""10 µs at 0.23 ns an instruction."""
_MAX_OUTPUT = re.compile(rb'"max_(?:completion_|output_)?tokens"\s*:\s*(\d{1,9})')
_REMAINING = (("tpm", "x-ratelimit-remaining-tokens"), ("rpm", "x-ratelimit-remaining-requests"))


class _Bucket:
    __slots__ = ("at", "capacity", "level", "rate", "reserved")

    def __init__(self, capacity: float) -> None:
        self.capacity, self.rate, self.level, self.at, self.reserved = capacity, capacity / 60, capacity, 0.0, 0.0


def one_request(body: bytes, buckets: dict[str, _Bucket], ratio: _Recent, outputs: _Recent,
                headers: dict[str, str], usage: tuple[int, int], now: float) -> bool:
    """Estimate, admit, take, correct from the answer's headers, settle and learn: the least there is."""
    at = body.find(b'"max_')
    found = _MAX_OUTPUT.match(body, at) if at >= 0 else None
    asked = int(found.group(1)) if found else None
    estimated = len(body) * (ratio.p90 or 0.4)
    output = outputs.p90 if outputs.p90 is not None else float(asked or 4096)
    cost = {"tpm": max(estimated, asked) if asked else estimated + output, "rpm": 1.0}
    for name, bucket in buckets.items():
        if now > bucket.at:
            bucket.level, bucket.at = min(bucket.capacity, bucket.level + bucket.rate * (now - bucket.at)), now
        if bucket.level < cost[name]:
            return False
    for name, bucket in buckets.items():
        bucket.level -= cost[name]
        bucket.reserved += cost[name]
    for name, header in _REMAINING:
        value = headers.get(header)
        if value is not None and value.isdigit() and buckets[name].level > int(value):
            buckets[name].level = int(value)
    inputs, produced = usage
    beyond = inputs + produced - cost["tpm"]
    if beyond > 0:
        buckets["tpm"].level -= beyond
    for name, bucket in buckets.items():
        bucket.reserved = max(0.0, bucket.reserved - cost[name])
    ratio.add(min(inputs / len(body), 4.0))
    outputs.add(float(produced))
    return True


def run_passes(passes: int, body: bytes) -> None:
    settle_heap()
    buckets = {"tpm": _Bucket(1e9), "rpm": _Bucket(1e9)}
    ratio, outputs = _Recent(), _Recent()
    headers = {"x-ratelimit-remaining-tokens": "999999912", "x-ratelimit-remaining-requests": "99999912"}
    for number in range(passes):
        one_request(body, buckets, ratio, outputs, headers, (12, 1), number * 0.001)


def counted(passes: int, body: str, workdir: Path) -> int:
    """Instructions callgrind counts for a run of ``passes`` requests (start-up included)."""
    out = workdir / f"callgrind.{passes}"
    subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, __file__,
                    "--run", str(passes), "--body", body], check=True, capture_output=True,
                   env={**os.environ, "PYTHONHASHSEED": "0"})
    for line in out.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passes", type=int, default=2000)
    parser.add_argument("--run", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--body", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run is not None:
        run_passes(args.run, args.body.encode())
        return 0
    from common import command_line, machine_note, missing_tools
    from overhead import BODY

    if missing_tools("windows_floor.py", ("valgrind",), "valgrind"):
        return 2
    with tempfile.TemporaryDirectory(prefix="windows-floor-") as workdir:
        once, twice = counted(args.passes, BODY, Path(workdir)), counted(2 * args.passes, BODY, Path(workdir))
    per_request = (twice - once) / args.passes
    print(f"`{command_line('windows_floor.py', argv)}`")
    print(machine_note())
    print(f"the least windows work, in plain Python: {per_request:,.0f} instructions a request "
          f"(target for all of it: {TARGET:,})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
