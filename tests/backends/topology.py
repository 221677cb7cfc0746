"""Redis as platforms give it, for the tests: a primary with a replica behind three sentinels, and a
three-primary Redis Cluster, each process a ``redis-server`` from Debian's package on a free port of its own,
in a folder of its own, stopped by PID.

Started once per test session, in each pytest-xdist worker that runs a test asking for one
(``sentinel_topology`` and ``cluster_topology`` in ``conftest.py``), on ports of that worker's own
(``tests/ports.py``). A test may kill a process (a failover) and start it again.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from ..ports import free_ports

__all__ = ["ClusterTopology", "RedisProcess", "SentinelTopology"]

SERVICE = "slotproxy-test"
_START_TIMEOUT = 20.0


def _binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError("redis-server is not installed: scripts/test-setup installs it (apt-get install redis-server)")
    return found


@dataclass
class RedisProcess:
    """One redis-server (a data node or a sentinel) with its config file; ``kill`` is SIGKILL by PID."""

    port: int
    folder: Path
    config: str
    sentinel: bool = False
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / ("sentinel.conf" if self.sentinel else "redis.conf")
        if not path.exists() or not self.sentinel:  # a sentinel rewrites its own file: keep what it learnt
            path.write_text(self.config)
        argv = [_binary(), str(path)] + (["--sentinel"] if self.sentinel else [])
        self.process = subprocess.Popen(argv, cwd=self.folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.wait_ready()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT
        client = redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.RedisError:
                    if self.process is not None and self.process.poll() is not None:
                        raise RuntimeError(f"redis-server on {self.address} exited at start") from None
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL, as a crash: no shutdown, no save."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
        self.process = None

    def pause(self) -> None:
        """SIGSTOP: the process holds its data and its connections but answers nothing, as a hung host."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


def _data_config(port: int, extra: str = "") -> str:
    return (f"port {port}\nbind 127.0.0.1\nprotected-mode no\nsave \"\"\nappendonly no\ndaemonize no\n"
            f"loglevel warning\nlogfile redis.log\n{extra}")


@dataclass
class SentinelTopology:
    """A primary, its replica and three sentinels watching them as ``SERVICE`` (quorum 2, fast failover)."""

    folder: Path
    primary: RedisProcess
    replica: RedisProcess
    sentinels: list[RedisProcess]

    @classmethod
    def start(cls) -> SentinelTopology:
        folder = Path(tempfile.mkdtemp(prefix="slotproxy-sentinel-"))
        primary_port, replica_port, *sentinel_ports = free_ports(5)
        primary = RedisProcess(primary_port, folder / "primary", _data_config(primary_port))
        replica = RedisProcess(replica_port, folder / "replica",
                               _data_config(replica_port, f"replicaof 127.0.0.1 {primary_port}\n"))
        sentinels = [RedisProcess(port, folder / f"sentinel-{port}", _sentinel_config(port, primary_port),
                                  sentinel=True) for port in sentinel_ports]
        topology = cls(folder, primary, replica, sentinels)
        try:
            for process in (primary, replica, *sentinels):
                process.start()
            topology.wait_replicated()
        except BaseException:
            topology.stop()
            raise
        return topology

    @property
    def sentinel_addresses(self) -> list[str]:
        return [sentinel.address for sentinel in self.sentinels]

    def current_primary(self) -> str:
        """The primary the sentinels name now (host:port)."""
        client = redis.Redis(port=self.sentinels[0].port, socket_timeout=1)
        try:
            host, port = client.sentinel_get_master_addr_by_name(SERVICE)
            return f"{host.decode() if isinstance(host, bytes) else host}:{port}"
        finally:
            client.close()

    def wait_replicated(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT
        client = redis.Redis(port=self.replica.port, socket_timeout=1)
        try:
            while client.info("replication").get("master_link_status") != "up":
                if time.monotonic() > deadline:
                    raise RuntimeError("the replica did not sync with the primary")
                time.sleep(0.05)
        finally:
            client.close()

    def wait_failover(self, away_from: str, timeout: float = 30.0) -> str:
        """Wait until the sentinels name a primary other than ``away_from``; returns it."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(redis.RedisError):
                current = self.current_primary()
                if current != away_from:
                    return current
            if time.monotonic() > deadline:
                raise RuntimeError(f"no failover away from {away_from} within {timeout:g}s")
            time.sleep(0.1)

    def stop(self) -> None:
        for process in (*self.sentinels, self.replica, self.primary):
            process.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


def _sentinel_config(port: int, primary_port: int) -> str:
    return (f"port {port}\nbind 127.0.0.1\nprotected-mode no\ndaemonize no\nloglevel warning\nlogfile sentinel.log\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {primary_port} 2\n"
            f"sentinel down-after-milliseconds {SERVICE} 1000\n"
            f"sentinel failover-timeout {SERVICE} 5000\n"
            f"sentinel parallel-syncs {SERVICE} 1\n")


@dataclass
class ClusterTopology:
    """Three primaries (no replicas) sharing the 16 384 slots."""

    folder: Path
    nodes: list[RedisProcess]

    @classmethod
    def start(cls) -> ClusterTopology:
        folder = Path(tempfile.mkdtemp(prefix="slotproxy-cluster-"))
        ports = free_ports(3, bus=True)
        nodes = [RedisProcess(port, folder / f"node-{port}", _data_config(
            port, "cluster-enabled yes\ncluster-config-file nodes.conf\ncluster-node-timeout 2000\n"))
            for port in ports]
        topology = cls(folder, nodes)
        try:
            for node in nodes:
                node.start()
            topology._create()
        except BaseException:
            topology.stop()
            raise
        return topology

    @property
    def seeds(self) -> list[str]:
        return [node.address for node in self.nodes]

    def _create(self) -> None:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not installed (it comes with Debian's redis-server package)")
        subprocess.run([cli, "--cluster", "create", *self.seeds, "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        deadline = time.monotonic() + _START_TIMEOUT
        for node in self.nodes:
            client = redis.Redis(port=node.port, socket_timeout=1)
            try:
                while client.cluster("info").get("cluster_state") != "ok":
                    if time.monotonic() > deadline:
                        raise RuntimeError("the cluster did not come up")
                    time.sleep(0.1)
            finally:
                client.close()

    def node_for_slot(self, slot: int) -> RedisProcess:
        client = redis.Redis(port=self.nodes[0].port, socket_timeout=1)
        try:
            for start, end, primary, *_ in client.cluster("slots"):
                if start <= slot <= end:
                    port = int(primary[1])
                    return next(node for node in self.nodes if node.port == port)
        finally:
            client.close()
        raise LookupError(f"no node serves slot {slot}")

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()
        shutil.rmtree(self.folder, ignore_errors=True)
