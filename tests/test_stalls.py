"""The stall watch (``tests/stalls.py``): a test stuck on an await is stopped, failed, and shows its tasks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_stuck_async_test_fails_and_shows_where_it_waited(tmp_path: Path) -> None:
    (tmp_path / "test_stuck.py").write_text(textwrap.dedent("""\
        import asyncio

        async def wait_for_nobody() -> None:
            await asyncio.get_running_loop().create_future()

        async def test_stuck() -> None:
            await wait_for_nobody()

        async def test_after() -> None:
            await asyncio.sleep(0)
        """))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-p", "tests.stalls",
         "-o", "asyncio_mode=auto", "--rootdir", str(tmp_path), str(tmp_path / "test_stuck.py")],
        cwd=REPO, env={**os.environ, "SLOTPROXY_TEST_STALL_LIMIT": "1", "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=60, check=False)
    out = result.stdout + result.stderr
    assert "1 failed, 1 passed" in out, out
    assert "test_stuck.py::test_stuck (call) ran past 1 s; its tasks:" in out, out
    assert "in wait_for_nobody" in out, out
