"""The files under deploy/ are checked here, since no container engine or cluster runs in CI.

Each check ties a file to the code it drives: embedded configs go through
``parse_config``, commands through the real CLI parser, probe and healthcheck
commands are run against a live proxy, and ports, paths and names must agree
across the objects that reference each other.
"""

from __future__ import annotations

import asyncio
import configparser
import fnmatch
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from proxy.config import Config, parse_config
from proxy.http.guard import BrowserGuard

from ..conftest import Proxy, provider_yaml
from ..ports import free_port

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
PORT = 8787
CONFIG_DIR = "/etc/slotproxy"
CONFIG_PATH = f"{CONFIG_DIR}/slotproxy.yaml"
STATE_DIR = "/var/lib/slotproxy"


# --- helpers -------------------------------------------------------------------------------


def load_docs(path: Path) -> list[dict[str, Any]]:
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    assert docs, f"{path} holds no YAML document"
    return docs


def cli_help(argv: list[str]) -> str:
    """``python -m proxy <subcommand> --help``: exit 0 and the help text (the subcommand exists)."""
    result = subprocess.run([sys.executable, "-m", "proxy", *argv, "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 0, f"{argv}: {result.stderr}"
    return result.stdout


def assert_real_slotproxy_command(argv: list[str]) -> None:
    """``argv`` is ``slotproxy <subcommand> [flags]``, with every flag known to that subcommand."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert argv[0] == "slotproxy" and "slotproxy" in scripts, argv
    subcommand = argv[1]
    help_text = cli_help([subcommand])
    for flag in (arg.split("=")[0] for arg in argv[2:] if arg.startswith("--")):
        assert re.search(rf"(^|\s){re.escape(flag)}\b", help_text), f"`slotproxy {subcommand}` has no {flag}"


def config_port(config: Config) -> int:
    return config.server.port


def container_port(mapping: str) -> int:
    """``[host_ip:]host_port:container_port`` → container_port."""
    return int(str(mapping).rsplit(":", 1)[-1].split("/")[0])


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc.get("kind") == kind]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {entry["name"]: entry.get("value", entry.get("valueFrom")) for entry in container.get("env", [])}


def configmap_config(docs: list[dict[str, Any]], name: str, key: str) -> Config:
    (configmap,) = [cm for cm in by_kind(docs, "ConfigMap") if cm["metadata"]["name"] == name]
    return parse_config(configmap["data"][key], f"ConfigMap {name}/{key}")


def probe_text(probe: dict[str, Any]) -> str:
    if "httpGet" in probe:
        return f"{probe['httpGet']['path']} port {probe['httpGet']['port']}"
    return " ".join(probe["exec"]["command"])


async def run_against(argv: list[str], port: int) -> int:
    """Run a healthcheck/probe command with its 127.0.0.1:8787 pointed at ``port``; its exit status."""
    argv = [sys.executable if arg == "python" else arg.replace(f"127.0.0.1:{PORT}", f"127.0.0.1:{port}")
            for arg in argv]
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.DEVNULL,
                                                stderr=asyncio.subprocess.DEVNULL)
    return await asyncio.wait_for(proc.wait(), timeout=20)


@pytest.fixture
async def live_proxy(start_upstream: Any, start_proxy: Any) -> Proxy:
    upstream = await start_upstream()
    proxy: Proxy = await start_proxy(provider_yaml(upstream, limit=2))
    return proxy


# --- the image -----------------------------------------------------------------------------


class Dockerfile:
    def __init__(self, path: Path) -> None:
        text = path.read_text().replace("\\\n", " ")
        self.instructions: list[tuple[str, str]] = []
        for line in text.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keyword, _, rest = line.partition(" ")
                self.instructions.append((keyword.upper(), rest.strip()))

    def all(self, keyword: str) -> list[str]:
        return [rest for key, rest in self.instructions if key == keyword]

    def one(self, keyword: str) -> str:
        values = self.all(keyword)
        assert len(values) == 1, f"expected one {keyword}, got {values}"
        return values[0]

    def env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for rest in self.all("ENV"):
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                env[key] = value
        return env


@pytest.fixture(scope="module")
def dockerfile() -> Dockerfile:
    return Dockerfile(DEPLOY / "Dockerfile")


def test_dockerfile_base_user_port_signal(dockerfile: Dockerfile) -> None:
    assert dockerfile.one("FROM") == "python:3.12-slim"
    user = dockerfile.all("USER")[-1].split(":")[0]
    assert user not in {"root", "0"}
    assert re.search(rf"useradd .*\b{user}\b", " ".join(dockerfile.all("RUN"))), "the user is created"
    assert dockerfile.one("EXPOSE") == str(PORT)
    assert dockerfile.one("STOPSIGNAL") == "SIGTERM"


def test_dockerfile_installs_the_project_with_redis_and_uvloop(dockerfile: Dockerfile) -> None:
    """The plain install carries the Redis client and uvloop (a dependency by platform marker)."""
    installs = [run for run in dockerfile.all("RUN") if re.search(r"pip install \.(\s|$)", run)]
    assert installs, "no `pip install .` of the project"
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(dep.startswith("redis") for dep in dependencies)
    assert any(dep.startswith("uvloop") and "sys_platform" in dep for dep in dependencies)


def test_dockerfile_config_path_and_its_default_config(dockerfile: Dockerfile) -> None:
    assert dockerfile.env()["SLOTPROXY_CONFIG"] == CONFIG_PATH
    copies = [shlex.split(rest) for rest in dockerfile.all("COPY")]
    shipped = [src for *srcs, dest in copies for src in srcs if dest == CONFIG_PATH]
    assert shipped == ["deploy/slotproxy.yaml"]
    config = parse_config((REPO / shipped[0]).read_text(), shipped[0])
    assert config_port(config) == PORT
    # The config dir is read-only in every deployment: state goes to the user's writable dir.
    assert config.state.path is not None and config.state.path.startswith(STATE_DIR + "/")
    assert STATE_DIR in " ".join(dockerfile.all("RUN"))


def test_dockerfile_copies_only_files_that_exist_and_dockerignore_keeps(dockerfile: Dockerfile) -> None:
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]

    def ignored(path: str) -> bool:
        result = False
        for pattern in patterns:
            negate = pattern.startswith("!")
            pattern = pattern.lstrip("!").rstrip("/")
            parts = path.split("/")
            prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
            if any(fnmatch.fnmatch(prefix, pattern) or fnmatch.fnmatch(prefix, pattern.removeprefix("**/"))
                   for prefix in prefixes):
                result = not negate
        return result

    for rest in dockerfile.all("COPY"):
        *sources, _ = shlex.split(rest)
        for source in sources:
            assert (REPO / source).exists(), f"COPY {source}: no such file in the build context"
            assert not ignored(source), f"COPY {source}: excluded by .dockerignore"
            if (REPO / source).is_dir():
                files = [p for p in (REPO / source).rglob("*.py") if "__pycache__" not in p.parts]
                assert files and not any(ignored(str(p.relative_to(REPO))) for p in files)
    for heavy in (".git", ".venv", "tests", "bench", ".pytest_cache", "proxy/server/__pycache__/app.cpython-311.pyc"):
        assert ignored(heavy), f".dockerignore should exclude {heavy}"


def test_dockerfile_cmd_is_a_real_slotproxy_command(dockerfile: Dockerfile) -> None:
    cmd = json.loads(dockerfile.one("CMD"))
    assert cmd == ["slotproxy", "serve", "--host", "0.0.0.0"]
    assert_real_slotproxy_command(cmd)


def test_dockerfile_cmd_without_an_admin_token_is_refused_with_the_documented_fix(
    dockerfile: Dockerfile, tmp_path: Path
) -> None:
    """What the Dockerfile's header documents: 0.0.0.0 needs SLOTPROXY_ADMIN_TOKEN (nothing is bound)."""
    cmd = json.loads(dockerfile.one("CMD"))
    config = tmp_path / "slotproxy.yaml"
    config.write_text((DEPLOY / "slotproxy.yaml").read_text())
    env = {k: v for k, v in os.environ.items() if k != "SLOTPROXY_ADMIN_TOKEN"} | {"SLOTPROXY_CONFIG": str(config)}
    result = subprocess.run([sys.executable, "-m", "proxy", *cmd[1:]], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 2
    assert "SLOTPROXY_ADMIN_TOKEN" in result.stderr and "admin.allow_unauthenticated" in result.stderr
    text = (DEPLOY / "Dockerfile").read_text()
    assert "SLOTPROXY_ADMIN_TOKEN" in text and "admin.allow_unauthenticated" in text


async def test_dockerfile_healthcheck_passes_on_a_live_proxy_and_fails_without_one(
    dockerfile: Dockerfile, live_proxy: Proxy
) -> None:
    options, _, command = dockerfile.one("HEALTHCHECK").partition("CMD ")
    argv = json.loads(command)
    assert argv[0] == "python" and f"127.0.0.1:{PORT}/healthz" in argv[-1]
    assert "curl" not in command and "wget" not in command  # neither is in python:3.12-slim
    assert "--timeout=" in options and "--interval=" in options
    assert await run_against(argv, live_proxy.port) == 0
    assert await run_against(argv, free_port()) != 0


# --- docker compose ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    (doc,) = load_docs(DEPLOY / "docker-compose.yml")
    return doc


def _compose_proxies(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in compose["services"].items()
            if svc.get("command") is None and svc.get("image", "").startswith("slotproxy")}


def test_compose_has_two_replicas_a_redis_and_a_fake_upstream(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["redis"]["image"] == "redis:7-alpine"
    assert "fake-upstream" in services
    proxies = _compose_proxies(compose)
    assert len(proxies) == 2, sorted(services)
    host_ports = set()
    for name, svc in proxies.items():
        build = svc["build"]
        assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == (DEPLOY / "Dockerfile").resolve()
        (mapping,) = svc["ports"]
        assert container_port(mapping) == PORT
        assert str(mapping).startswith("127.0.0.1:"), f"{name}: publish on the host's loopback only"
        host_ports.add(str(mapping).split(":")[1])
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        assert "SLOTPROXY_ADMIN_TOKEN" in svc["environment"], f"{name} listens on 0.0.0.0"
    assert len(host_ports) == 2


def test_compose_config_is_valid_and_points_at_the_compose_services(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for svc in _compose_proxies(compose).values():
        path = svc["environment"]["SLOTPROXY_CONFIG"]
        assert path == CONFIG_PATH
        (volume,) = svc["volumes"]
        source, target, *_ = volume.split(":")
        assert target == CONFIG_DIR, "mount the directory, so edits reach the replicas"
        host_file = DEPLOY / source / Path(path).relative_to(CONFIG_DIR)
        config = parse_config(host_file.read_text(), str(host_file))
        assert config_port(config) == PORT
        assert config.backend.kind == "redis"
        redis_url = urlsplit(config.backend.url)
        assert redis_url.hostname in services and redis_url.hostname == "redis"
        assert (redis_url.port or 6379) == 6379
        assert config.state.path is None
        fake = urlsplit(config.provider("fake").upstream)
        assert fake.hostname == "fake-upstream"
        assert fake.port == int(services["fake-upstream"]["environment"]["FAKE_PORT"])
        grace = int(str(svc["stop_grace_period"]).rstrip("s"))
        assert grace > config.server.shutdown_grace


def test_compose_fake_upstream_script_serves_with_its_cap(compose: dict[str, Any]) -> None:
    svc = compose["services"]["fake-upstream"]
    assert svc["command"][0] == "python"
    (volume,) = svc["volumes"]
    source, target, *_ = volume.split(":")
    script = DEPLOY / source / Path(svc["command"][1]).relative_to(target)
    assert script.is_file()
    port = free_port()
    env = os.environ | {"FAKE_HOST": "127.0.0.1", "FAKE_PORT": str(port), "PYTHONPATH": str(REPO)}
    env["FAKE_CAP"] = svc["environment"]["FAKE_CAP"]
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=2) as response:
                    stats = json.load(response)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "the fake never answered"
                time.sleep(0.05)
        assert stats["cap"] == int(svc["environment"]["FAKE_CAP"])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- Kubernetes ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sidecar() -> list[dict[str, Any]]:
    return load_docs(DEPLOY / "kubernetes" / "sidecar.yaml")


@pytest.fixture(scope="module")
def shared() -> list[dict[str, Any]]:
    return load_docs(DEPLOY / "kubernetes" / "shared.yaml")


def _pod_spec(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    for doc in docs:
        if doc["kind"] == "Pod" and doc["metadata"]["name"] == name:
            return dict(doc["spec"])
        if doc["kind"] == "Deployment" and doc["metadata"]["name"] == name:
            return dict(doc["spec"]["template"]["spec"])
    raise AssertionError(f"no Pod or Deployment named {name}")


def _container(spec: dict[str, Any], name: str) -> dict[str, Any]:
    for container in spec.get("initContainers", []) + spec.get("containers", []):
        if container["name"] == name:
            return dict(container)
    raise AssertionError(f"no container {name}")


def _config_mount(spec: dict[str, Any], container: dict[str, Any]) -> str:
    """The ConfigMap name behind the container's /etc/slotproxy mount (a directory mount)."""
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == CONFIG_DIR]
    assert "subPath" not in mount, "a subPath mount never sees ConfigMap updates"
    assert mount.get("readOnly") is True
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    return str(volume["configMap"]["name"])


def _check_state_dir_is_writable(spec: dict[str, Any], container: dict[str, Any], config: Config) -> None:
    if config.state.path is None:
        return
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    state_dir = str(Path(config.state.path).parent)
    assert state_dir in mounts and not mounts[state_dir].get("readOnly")
    (volume,) = [v for v in spec["volumes"] if v["name"] == mounts[state_dir]["name"]]
    assert "emptyDir" in volume or "persistentVolumeClaim" in volume


def test_kubernetes_files_are_well_formed_objects(sidecar: list[dict[str, Any]],
                                                  shared: list[dict[str, Any]]) -> None:
    for doc in sidecar + shared:
        assert doc["apiVersion"] and doc["kind"] and doc["metadata"]["name"]
    assert {d["kind"] for d in sidecar} == {"ConfigMap", "Pod"}
    assert sorted(d["kind"] for d in shared) == ["ConfigMap", "Deployment", "Deployment", "Service", "Service"]


def test_sidecar_pod_wiring(sidecar: list[dict[str, Any]]) -> None:
    spec = _pod_spec(sidecar, "coding-agent")
    proxy = _container(spec, "slotproxy")
    if proxy in spec.get("initContainers", []):
        assert proxy["restartPolicy"] == "Always", "an init container is a sidecar only with restartPolicy: Always"
    assert_real_slotproxy_command(proxy["command"])
    configmap = _config_mount(spec, proxy)
    env = env_of(proxy)
    assert env["SLOTPROXY_CONFIG"] == CONFIG_PATH
    config = configmap_config(sidecar, configmap, Path(CONFIG_PATH).name)
    assert config_port(config) == PORT
    # Loopback bind: only the agent in the Pod reaches it, and no admin token is required.
    host = proxy["command"][proxy["command"].index("--host") + 1]
    assert host == "127.0.0.1" and config.server.host == "127.0.0.1"
    _check_state_dir_is_writable(spec, proxy, config)
    assert spec["terminationGracePeriodSeconds"] > config.server.shutdown_grace
    assert "/readyz" in probe_text(proxy["readinessProbe"]) and str(PORT) in probe_text(proxy["readinessProbe"])
    assert "/healthz" in probe_text(proxy["livenessProbe"]) and str(PORT) in probe_text(proxy["livenessProbe"])
    agent_env = env_of(_container(spec, "agent"))
    guard = BrowserGuard.for_listener(host, config.server.allowed_hosts, config.server.allowed_origins)
    for variable, provider in (("OPENAI_BASE_URL", "openai"), ("ANTHROPIC_BASE_URL", "anthropic")):
        assert agent_env[variable] == f"http://127.0.0.1:{PORT}/{provider}"
        assert provider in config.provider_names()
        assert guard.host_allowed(str(urlsplit(agent_env[variable]).netloc)), "the agent's Host must be served"


async def test_sidecar_exec_probes_pass_on_a_live_proxy(sidecar: list[dict[str, Any]], live_proxy: Proxy) -> None:
    proxy = _container(_pod_spec(sidecar, "coding-agent"), "slotproxy")
    for name in ("startupProbe", "readinessProbe", "livenessProbe"):
        if name in proxy:
            command = proxy[name]["exec"]["command"]
            assert await run_against(command, live_proxy.port) == 0, name
            assert await run_against(command, free_port()) != 0, name


def test_shared_deployment_service_and_redis(shared: list[dict[str, Any]]) -> None:
    (deployment,) = [d for d in by_kind(shared, "Deployment") if d["metadata"]["name"] == "slotproxy"]
    assert deployment["spec"]["replicas"] >= 2
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    spec = _pod_spec(shared, "slotproxy")
    proxy = _container(spec, "slotproxy")
    assert_real_slotproxy_command(proxy["command"])
    assert [p["containerPort"] for p in proxy["ports"]] == [PORT]
    config = configmap_config(shared, _config_mount(spec, proxy), Path(CONFIG_PATH).name)
    assert env_of(proxy)["SLOTPROXY_CONFIG"] == CONFIG_PATH
    assert config_port(config) == PORT
    assert "secretKeyRef" in env_of(proxy)["SLOTPROXY_ADMIN_TOKEN"], "0.0.0.0 needs the admin token"
    assert proxy["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": PORT}
    assert proxy["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": PORT}
    host = proxy["command"][proxy["command"].index("--host") + 1]
    guard = BrowserGuard.for_listener(host, config.server.allowed_hosts, config.server.allowed_origins)
    # The Service names agents use, and the Pod IP the kubelet's httpGet probes send as Host.
    for client_host in ("slotproxy:8787", "slotproxy.agents.svc.cluster.local:8787", "10.1.2.3:8787"):
        assert guard.host_allowed(client_host), client_host
    assert spec["terminationGracePeriodSeconds"] > config.server.shutdown_grace
    _check_state_dir_is_writable(spec, proxy, config)

    services = {s["metadata"]["name"]: s for s in by_kind(shared, "Service")}
    service = services["slotproxy"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(PORT, PORT)]

    assert config.backend.kind == "redis"
    redis_url = urlsplit(config.backend.url)
    redis_service = services[str(redis_url.hostname)]
    redis_port = redis_url.port or 6379
    assert [p["port"] for p in redis_service["spec"]["ports"]] == [redis_port]
    redis_spec = _pod_spec(shared, str(redis_url.hostname))
    (redis,) = redis_spec["containers"]
    assert redis["image"] == "redis:7-alpine"
    assert [p["containerPort"] for p in redis["ports"]] == [redis_service["spec"]["ports"][0]["targetPort"]]
    (redis_deployment,) = [d for d in by_kind(shared, "Deployment") if d["metadata"]["name"] == redis_url.hostname]
    assert redis_service["spec"]["selector"].items() <= redis_deployment["spec"]["template"]["metadata"]["labels"].items()


# --- systemd -------------------------------------------------------------------------------

UNIT = DEPLOY / "systemd" / "slotproxy.service"


def _unit() -> configparser.RawConfigParser:
    # systemd allows repeated keys (SystemCallFilter=...): not strict; keys are case-sensitive.
    parser = configparser.RawConfigParser(strict=False, delimiters=("=",), comment_prefixes=("#", ";"))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(UNIT.read_text())
    return parser


def test_systemd_unit_content() -> None:
    unit = _unit()
    assert set(unit.sections()) == {"Unit", "Service", "Install"}
    service = unit["Service"]
    assert service["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert service["User"] == "slotproxy" and service["Group"] == "slotproxy"
    assert service["Environment"] == f"SLOTPROXY_CONFIG={CONFIG_PATH}"
    assert service["KillSignal"] == "SIGTERM"
    assert int(service["TimeoutStopSec"]) > 30  # longer than the default server.shutdown_grace
    assert service["StateDirectory"] == "slotproxy"  # /var/lib/slotproxy, the config's state dir
    for key, value in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
                       "PrivateTmp": "yes", "PrivateDevices": "yes", "CapabilityBoundingSet": ""}.items():
        assert service[key] == value, key
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    exec_start = shlex.split(service["ExecStart"])
    assert Path(exec_start[0]).name == "slotproxy"
    assert_real_slotproxy_command(["slotproxy", *exec_start[1:]])


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    """``systemd-analyze verify`` where it exists; the content test above runs everywhere."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        unit = _unit()
        assert unit["Service"]["ExecStart"].startswith("/") and unit["Service"]["Type"] in {"exec", "simple"}
        return
    # verify checks that ExecStart is executable: point it at this environment's slotproxy.
    executable = shutil.which("slotproxy") or sys.executable
    text = UNIT.read_text()
    original = shlex.split(_unit()["Service"]["ExecStart"])[0]
    copy = tmp_path / UNIT.name
    copy.write_text(text.replace(original, executable))
    result = subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60,
                            check=False)
    about_unit = [line for line in (result.stdout + result.stderr).splitlines() if UNIT.name in line]
    assert result.returncode == 0 and not about_unit, result.stdout + result.stderr


# --- every YAML file -----------------------------------------------------------------------


def test_every_yaml_file_under_deploy_parses_and_every_slotproxy_config_is_valid() -> None:
    files = sorted(DEPLOY.rglob("*.y*ml"))
    assert len(files) >= 5
    configs = 0
    for path in files:
        for doc in load_docs(path):
            if "providers" in doc:  # a slotproxy config file
                parse_config(path.read_text(), str(path))
                configs += 1
            for key, value in (doc.get("data") or {}).items() if doc.get("kind") == "ConfigMap" else ():
                if key.endswith((".yaml", ".yml")):
                    parse_config(value, f"{path}: {key}")
                    configs += 1
    assert configs >= 4
