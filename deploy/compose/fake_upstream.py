"""The fake upstream for docker-compose.yml, listening on every interface of its container.

``slotproxy fake-upstream`` listens on 127.0.0.1 only, which other containers
cannot reach; this serves the same fake (``proxy.tools.fake_upstream``) on
``FAKE_HOST`` (default 0.0.0.0) and ``FAKE_PORT`` (default 9100) with a hard
concurrency cap of ``FAKE_CAP`` (default 4), until SIGTERM or SIGINT.
"""

from __future__ import annotations

import asyncio
import os
import signal

from proxy.tools.fake_upstream import FakeUpstream, start_fake_upstream


async def main() -> None:
    host = os.environ.get("FAKE_HOST", "0.0.0.0")
    port = int(os.environ.get("FAKE_PORT", "9100"))
    fake = FakeUpstream(
        cap=int(os.environ.get("FAKE_CAP", "4")),
        chunks=int(os.environ.get("FAKE_CHUNKS", "20")),
        delay_ms=float(os.environ.get("FAKE_DELAY_MS", "50")),
    )
    runner, bound = await start_fake_upstream(fake, host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"fake upstream on http://{host}:{bound} (cap {fake.cap}); GET /stats for its counters", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
