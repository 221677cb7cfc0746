"""The package as users get it: a wheel built from this tree, installed into a fresh virtualenv, serves the
example config and its dashboard (the page ships inside the wheel)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
import zipfile
from pathlib import Path

from ..conftest import machine_lock
from ..ports import free_port

REPO = Path(__file__).resolve().parents[2]


def building_in_the_checkout() -> contextlib.AbstractContextManager[None]:
    """Whatever the output folder, setuptools writes build/ and slotproxy.egg-info/ in the checkout, here and in
    test_first_run's editable install: one build at a time."""
    return machine_lock(f"build-{hashlib.sha256(str(REPO).encode()).hexdigest()[:12]}")


def _build_wheel(out: Path) -> Path:
    """Built with this environment's setuptools (no download: the test extras hold setuptools>=77)."""
    with building_in_the_checkout():
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                        "--wheel-dir", str(out), str(REPO)], check=True, timeout=180, capture_output=True)
    (wheel,) = out.glob("slotproxy-*.whl")
    return wheel


def _fresh_env(root: Path, wheel: Path) -> Path:
    """A new virtualenv with only the wheel installed; its dependencies come from this environment's
    site-packages, added as a plain path (so this checkout's own editable install is not)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--quiet",
                    str(wheel)], check=True, timeout=180, capture_output=True)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "test-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return root / "bin"


def test_a_wheel_installs_a_working_slotproxy_with_its_dashboard(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path / "wheels")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert "proxy/admin/dashboard.html" in names and "proxy/py.typed" in names
    bin_dir = _fresh_env(tmp_path / "env", wheel)
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(REPO / "config.example.yaml", work / "slotproxy.yaml")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SLOTPROXY_CONFIG")}

    where = subprocess.run([str(bin_dir / "python"), "-c", "import proxy; print(proxy.__file__)"], cwd=work,
                           env=env, check=True, capture_output=True, text=True).stdout
    assert str(tmp_path / "env") in where, f"proxy imported from {where!r}, not from the wheel"
    version = subprocess.run([str(bin_dir / "slotproxy"), "--version"], cwd=work, env=env, check=True,
                             capture_output=True, text=True).stdout.strip()
    assert re.fullmatch(r"slotproxy \d+\.\d+\.\d+", version)

    port = free_port()
    server = subprocess.Popen([str(bin_dir / "slotproxy"), "serve", "--port", str(port)], cwd=work, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = _dashboard_from_start_up_line(server)
        assert url == f"http://127.0.0.1:{port}/_slotproxy/"
        with urllib.request.urlopen(url, timeout=10) as page:
            assert page.status == 200
            assert "text/html" in page.headers["Content-Type"]
            assert "slotproxy" in page.read().decode()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/_slotproxy/status", timeout=10) as status:
            assert [p["provider"] for p in json.load(status)["providers"]] == ["openai", "anthropic"]
    finally:
        server.send_signal(signal.SIGTERM)
        server.communicate(timeout=30)


def _dashboard_from_start_up_line(server: subprocess.Popen[str]) -> str:
    assert server.stdout is not None
    deadline = time.monotonic() + 30
    seen = []
    while time.monotonic() < deadline:
        line = server.stdout.readline()
        if not line:
            break
        seen.append(line)
        found = re.search(r"slotproxy listening on .*dashboard: (\S+)", line)
        if found:
            return found.group(1)
    raise AssertionError(f"no start-up line naming the dashboard; output: {''.join(seen)}")
