"""Cost of one acquire+release pair in the limiter core with N waiters already queued.

Run:  python bench/limiter.py [--pairs 20000]

With N waiters queued at the limit, each measured step releases one held slot
(which grants the head waiter) and enqueues one new waiter with a random
priority, so the queue stays at N and every step does one heap push and one
heap pop: the steady state of a saturated provider. Printed: microseconds per
pair, and the ratio to the N=10 figure (target: under 20 µs, flat within 2x).
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxy.limiter import FakeClock, Lease, LimiterSettings, Priority, ProviderLimiter  # noqa: E402

T0 = 1_700_000_000.0


def measure(queued: int, pairs: int, seed: int = 7) -> float:
    rng = random.Random(seed)
    limiter = ProviderLimiter("bench", LimiterSettings(limit=8, slot_timeout=None, queue_timeout=None,
                                                       max_queue=queued + pairs + 10), FakeClock(T0))
    held: list[Lease] = []
    granted = held.append
    for _ in range(8):
        lease = limiter.try_acquire(Priority(prompt_started_at=T0))
        assert lease is not None
        held.append(lease)
    priorities = [
        Priority(prompt_started_at=T0 - rng.random() * 3600, workspace=f"w{rng.randrange(50)}",
                 starred=rng.random() < 0.1)
        for _ in range(queued + pairs)
    ]
    for priority in priorities[:queued]:
        limiter.enqueue(priority, granted)
    gc.collect()
    gc.disable()
    try:
        started = time.perf_counter()
        for i in range(pairs):
            held[i].release()
            limiter.enqueue(priorities[queued + i], granted)
        elapsed = time.perf_counter() - started
    finally:
        gc.enable()
    assert limiter.queued == queued
    return elapsed / pairs * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=20_000)
    args = parser.parse_args()
    print(f"# python bench/limiter.py --pairs {args.pairs}   (Python {sys.version.split()[0]})")
    print("| waiters queued | µs per acquire+release | vs N=10 |")
    print("|---:|---:|---:|")
    base = None
    for queued in (10, 1_000, 10_000, 100_000):
        best = min(measure(queued, args.pairs, seed) for seed in range(3))
        base = base or best
        print(f"| {queued:,} | {best:.2f} | {best / base:.2f}x |")


if __name__ == "__main__":
    main()
