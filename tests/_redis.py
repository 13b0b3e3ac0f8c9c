"""Test helpers: real ``redis-server`` processes on loopback (Debian's package, installed by
``scripts/deps/25-redis.sh``), standalone or as a 3-master Cluster made with
``redis-cli --cluster create``. Random free ports; every process is started, killed and
restarted by its own PID, never by name."""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from kvstore.testing import IN_CI, free_port


def need_redis() -> None:
    """Skip without the binaries, except under CI, where their absence is a failure."""
    missing = [b for b in ("redis-server", "redis-cli") if shutil.which(b) is None]
    if missing:
        if IN_CI:
            pytest.fail(f"{', '.join(missing)} missing: scripts/deps/25-redis.sh installs them")
        pytest.skip(f"{', '.join(missing)} not installed (bash scripts/deps/25-redis.sh)")


def free_cluster_port() -> int:
    """A free port ``p`` with ``p + 10000`` (the cluster bus port) free too, below 55536."""
    for _ in range(200):
        port = random.randint(20000, 45000)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisServer:
    """One ``redis-server`` in ``workdir`` on 127.0.0.1:``port``; ``extra`` are more
    ``--name value`` arguments. Data survives :meth:`restart` after :meth:`kill` when
    started with ``appendonly=True`` (``appendfsync always``: the AOF is written before
    each reply; under ``everysec`` Redis postpones the write for up to 2 s while a
    background fsync is slow, so a loaded machine lost acknowledged writes on a kill)."""

    def __init__(self, workdir: Path, *, port: int | None = None, appendonly: bool = False,
                 extra: tuple[str, ...] = ()) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
                     "--save", "", "--appendonly", "yes" if appendonly else "no",
                     *(("--appendfsync", "always") if appendonly else ()), "--daemonize", "no",
                     "--logfile", str(self.workdir / "redis.log"), *extra]
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 15.0) -> None:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.proc.stderr.read().decode()} "
                                   f"{self._log_tail()}")
            if self.cli("PING", check=False).strip() == "PONG":
                return
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server on {self.port} did not answer: {self._log_tail()}")
            time.sleep(0.05)

    def _log_tail(self) -> str:
        log = self.workdir / "redis.log"
        return log.read_text()[-2000:] if log.exists() else ""

    def cli(self, *args: str, check: bool = True) -> str:
        """``redis-cli`` against this server (as the default user)."""
        proc = subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(self.port), *args],
                              capture_output=True, text=True, timeout=30)
        if check and proc.returncode != 0:
            raise RuntimeError(f"redis-cli {' '.join(args)}: {proc.stderr}")
        return proc.stdout

    def client(self, **kw):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, **kw)

    def kill(self) -> None:
        """SIGKILL by PID, no shutdown save: like a crashed node."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        if self.proc is not None and self.proc.stderr:
            self.proc.stderr.close()

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


class RedisCluster:
    """Three masters, no replicas (``--cluster-replicas 0``), AOF on so a killed and
    restarted master comes back with its data; ``cluster-node-timeout`` short."""

    def __init__(self, workdir: Path, *, masters: int = 3) -> None:
        self.nodes: list[RedisServer] = []
        try:
            for i in range(masters):
                self.nodes.append(RedisServer(
                    Path(workdir) / f"node{i}", port=free_cluster_port(), appendonly=True,
                    extra=("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                           "--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no")))
            proc = subprocess.run(["redis-cli", "--cluster", "create", *(n.address for n in self.nodes),
                                   "--cluster-replicas", "0", "--cluster-yes"],
                                  capture_output=True, text=True, timeout=60)
            if proc.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {proc.stdout[-2000:]} {proc.stderr}")
            self.wait_ok()
        except BaseException:
            self.stop()
            raise

    @property
    def nodes_list(self) -> list[str]:
        return [n.address for n in self.nodes]

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every node reports ``cluster_state:ok`` and knows every other node."""
        deadline = time.monotonic() + timeout_s
        while True:
            infos = [n.cli("CLUSTER", "INFO", check=False) for n in self.nodes]
            if all("cluster_state:ok" in i and f"cluster_known_nodes:{len(self.nodes)}" in i for i in infos):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not ok: {infos}")
            time.sleep(0.1)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


def running_redis(tmp_path_factory, name: str, **kw):
    """Generator for a module fixture: one standalone server, stopped after the module."""
    need_redis()
    server = RedisServer(tmp_path_factory.mktemp(name), **kw)
    try:
        yield server
    finally:
        server.stop()


def running_cluster(tmp_path_factory, name: str):
    need_redis()
    cluster = RedisCluster(tmp_path_factory.mktemp(name))
    try:
        yield cluster
    finally:
        cluster.stop()
