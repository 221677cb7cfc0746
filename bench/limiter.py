"""Cost of one acquire+release pair in the limiter core with N waiters already queued.

Run:  python bench/limiter.py [--pairs 20000] [--rounds 3]

With N waiters queued at the limit, each measured step releases one held slot
(which grants the head waiter) and enqueues one new waiter with a random
priority, so the queue stays at N and every step does one heap push and one
heap pop: the steady state of a saturated provider. Two cases:

``1 level``   provider ``limit: 8`` only, one heap (the original rows);
``3 levels``  provider ``limit: 8``, a pool of two keys (``a`` and ``b``,
              ``limit: 4`` each) and a model cap (``big-*``, ``limit: 2``);
              half the waiters ask for ``big-model`` (capped), half for
              ``small-model`` (not), so each of the two class heaps holds
              N/2, and each request carries a conversation id (2000 of them),
              so the key choice looks up and remembers the conversation's key.
              A slot is taken at the provider, at a key and, for
              ``big-model``, at the cap; a grant looks at both classes' heads.
              The new waiter of each step asks for the model of the waiter
              just granted (read from its conversation id, ~0.1 µs of the
              figure), so the classes keep N/2 each and no class runs dry
              (an empty ``small-model`` class with the cap full would leave a
              release with no one to grant).

Every release frees one slot at each level the lease held, and the provider's
limit equals the keys' together, so each step grants exactly one waiter in
both cases. Each cell is timed ``--rounds`` times (a different seed each);
printed: microseconds per pair as the median over rounds (min–max), and the
ratio of the median to the same case's N=10 median (targets: under 20 µs,
flat within 2x). No network, no servers, no event loop.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxy.limiter import (
    FakeClock,
    KeySettings,
    Lease,
    LimiterSettings,
    ModelCap,
    Priority,
    ProviderLimiter,
)

T0 = 1_700_000_000.0
LIMIT = 8
QUEUED = (10, 1_000, 10_000, 100_000)
CASES = ("1 level", "3 levels")
BIG, SMALL = "big-model", "small-model"


def settings_for(case: str, max_queue: int) -> LimiterSettings:
    common = {"limit": LIMIT, "slot_timeout": None, "queue_timeout": None, "max_queue": max_queue}
    if case == "1 level":
        return LimiterSettings(**common)  # type: ignore[arg-type]
    return LimiterSettings(**common, keys=(KeySettings("a", 4), KeySettings("b", 4)),  # type: ignore[arg-type]
                           models=(ModelCap("big-*", 2),))


def _priority(rng: random.Random, conversation: str | None = None) -> Priority:
    return Priority(prompt_started_at=T0 - rng.random() * 3600, workspace=f"w{rng.randrange(50)}",
                    starred=rng.random() < 0.1, conversation=conversation)


def measure(case: str, queued: int, pairs: int, seed: int = 7) -> float:
    """µs per release+enqueue pair with ``queued`` waiters queued, in ``case``."""
    rng = random.Random(seed)
    limiter = ProviderLimiter("bench", settings_for(case, queued + pairs + 10), FakeClock(T0))
    held: list[Lease] = []
    granted = held.append
    three = case == "3 levels"
    for i in range(LIMIT):  # fill every slot (3 levels: 2 on the capped model, the rest on the other)
        model = (BIG if i < 2 else SMALL) if three else None
        lease = limiter.try_acquire(Priority(prompt_started_at=T0), model=model)
        assert lease is not None
        held.append(lease)
    enqueue = limiter.enqueue
    if not three:
        priorities = [_priority(rng) for _ in range(queued + pairs)]
        for priority in priorities[:queued]:
            enqueue(priority, granted)
    else:
        # conversation ids: "b…" ask for big-model, "s…" for small-model
        bigs = [_priority(rng, f"b{rng.randrange(1000)}") for _ in range(queued // 2 + pairs)]
        smalls = [_priority(rng, f"s{rng.randrange(1000)}") for _ in range(queued - queued // 2 + pairs)]
        for priority in bigs[:queued // 2]:
            enqueue(priority, granted, model=BIG)
        for priority in smalls[:queued - queued // 2]:
            enqueue(priority, granted, model=SMALL)
        next_big, next_small = iter(bigs[queued // 2:]).__next__, iter(smalls[queued - queued // 2:]).__next__
    assert limiter.queued == queued
    gc.collect()
    gc.disable()
    try:
        started = time.perf_counter()
        if not three:
            for i in range(pairs):
                held[i].release()
                enqueue(priorities[queued + i], granted)
        else:
            for i in range(pairs):
                held[i].release()
                if held[-1].priority.conversation[0] == "b":  # type: ignore[index]
                    enqueue(next_big(), granted, model=BIG)
                else:
                    enqueue(next_small(), granted, model=SMALL)
        elapsed = time.perf_counter() - started
    finally:
        gc.enable()
    assert limiter.queued == queued, (case, queued, limiter.queued)
    assert len(held) == LIMIT + pairs, (case, queued, len(held))
    return elapsed / pairs * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3, help="timings per cell, one seed each (default 3)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    args = parser.parse_args()
    cases = [case.strip() for case in args.cases.split(",") if case.strip()]
    if args.pairs < 1 or args.rounds < 1 or not cases or any(case not in CASES for case in cases):
        parser.error(f"--pairs and --rounds must be >= 1; --cases of: {', '.join(CASES)}")
    print(f"# python bench/limiter.py --pairs {args.pairs} --rounds {args.rounds}   "
          f"(Python {sys.version.split()[0]})")
    print("| levels | waiters queued | µs per acquire+release: median (min–max) | vs N=10 |")
    print("|---|---:|---:|---:|")
    for case in cases:
        base = None
        for queued in QUEUED:
            times = [measure(case, queued, args.pairs, seed) for seed in range(args.rounds)]
            median = statistics.median(times)
            base = base or median
            print(f"| {case} | {queued:,} | {median:.2f} ({min(times):.2f}–{max(times):.2f}) "
                  f"| {median / base:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
