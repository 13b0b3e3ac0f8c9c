"""Start and stop the servers ``benchmarks/server.py`` measures: kvstore itself and its
peers (Mooncake Store, Redis, LMCache). Each raises with a reason when it cannot start."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS_VENV = ROOT / ".venv" / "peers"
DATA_BYTES = 1536 << 20   # room for the largest cell (16 clients x 64 MiB) with margin


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {_tail(proc)}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on port {port} within {timeout_s:.0f} s")


def _tail(proc: subprocess.Popen) -> str:
    log = getattr(proc, "log_path", None)
    if log and os.path.exists(log):
        return " | ".join(Path(log).read_text(errors="replace").strip().splitlines()[-3:])
    return ""


def _spawn(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    fh = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    proc.log_path = str(log)
    return proc


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)


def _peers_python() -> str:
    py = PEERS_VENV / "bin" / "python"
    if not py.exists():
        raise RuntimeError(f"{py} not found; run: bash benchmarks/install_peers.sh")
    return str(py)


class Peer:
    python = sys.executable
    worker_system = ""
    self_driven = False
    env: dict | None = None

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def client_spec(self, system: str, worker: int) -> dict:
        return {}

    def describe(self) -> str:
        return ""

    def stop(self) -> None:
        _stop(self.procs)


class KvstorePeer(Peer):
    worker_system = "kvstore"

    def __init__(self, tmp: Path, max_clients: int, *, tls: bool = False) -> None:
        super().__init__()
        self.address = self._serve(tmp, "kvstore", "")
        # "kvstore-tcp-tls": a second, identical server with server.tls (a throwaway CA
        # made here), so TLS and plain TCP run side by side, cell by cell
        self.tls_address, self.ca = None, None
        if tls:
            from tests._pki import make_pki   # needs cryptography (the test extra)

            pki = make_pki(tmp / "pki", name="bench")
            self.ca = pki.ca
            self.tls_address = self._serve(tmp, "kvstore-tls",
                                           f", tls: {{cert: {pki.server_cert}, key: {pki.server_key}}}")

    def _serve(self, tmp: Path, name: str, extra: str) -> str:
        cfg = tmp / f"{name}.yaml"
        cfg.write_text(f"tiers:\n  - {{name: hot, kind: dram, capacity: {DATA_BYTES}, pin: false}}\n"
                       f"server: {{host: 127.0.0.1, port: 0, admin_port: null, max_inflight_bytes: 1GiB{extra}}}\n")
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        log = tmp / f"{name}.log"
        proc = subprocess.Popen([sys.executable, "-m", "kvstore", "serve", "--config", str(cfg)], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, start_new_session=True)
        proc.log_path = str(log)
        self.procs.append(proc)
        line = proc.stdout.readline()
        if "serving on" not in line:
            raise RuntimeError(f"kvstore serve did not start: {line!r} {_tail(proc)}")
        return line.split("serving on ")[1].split()[0]

    def client_spec(self, system: str, worker: int) -> dict:
        # "kvstore-tcp-unverified": the same client with Client(verify=False), to measure
        # what checking every received block against its checksum costs
        tls = system.endswith("-tls")
        if tls and self.tls_address is None:
            raise RuntimeError(f"{system}: run benchmarks/server.py with --tls")
        return {"address": self.tls_address if tls else self.address, "transport": system.split("-")[1],
                "verify": not system.endswith("-unverified"), "tls": {"ca": self.ca} if tls else None,
                "copy_threads": int(os.environ["KVBENCH_COPY_THREADS"]) if "KVBENCH_COPY_THREADS" in os.environ else None}

    def describe(self) -> str:
        return self.address + (f", TLS {self.tls_address}" if self.tls_address else "")


class MooncakePeer(Peer):
    worker_system = "mooncake"

    def __init__(self, tmp: Path, max_clients: int) -> None:
        super().__init__()
        self.python = _peers_python()
        bindir = PEERS_VENV / "bin"
        master, client = bindir / "mooncake_master", bindir / "mooncake_client"
        if not master.exists() or not client.exists():
            raise RuntimeError("mooncake binaries not installed; run benchmarks/install_peers.sh")
        self.env = {**os.environ, "MC_LEGACY_RPC_PORT_BINDING": "1", "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        p_meta, p_rpc, p_metrics, p_host, p_client = (free_port() for _ in range(5))
        self.procs.append(_spawn([str(master), "--enable_http_metadata_server=true",
                                  "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={p_meta}",
                                  "--rpc_address=127.0.0.1", f"--rpc_port={p_rpc}", "--metrics_host=127.0.0.1",
                                  f"--metrics_port={p_metrics}"], tmp / "mooncake_master.log", self.env))
        _wait_port(p_rpc, self.procs[-1], "mooncake_master")
        _wait_port(p_meta, self.procs[-1], "mooncake_master metadata server")
        self.metadata = f"http://127.0.0.1:{p_meta}/metadata"
        self.master = f"127.0.0.1:{p_rpc}"
        self.procs.append(_spawn([str(client), f"--host=127.0.0.1:{p_host}", f"--port={p_client}",
                                  f"--global_segment_size={DATA_BYTES >> 20}MB", "--local_buffer_size=0",
                                  f"--master_server_address={self.master}", f"--metadata_server={self.metadata}",
                                  "--protocol=tcp", "--threads=2"], tmp / "mooncake_client.log", self.env))
        _wait_port(p_client, self.procs[-1], "mooncake_client")
        self.client_address = f"127.0.0.1:{p_client}"

    def client_spec(self, system: str, worker: int) -> dict:
        return {"transport": system.split("-")[1], "client_address": self.client_address,
                "metadata": self.metadata, "master": self.master, "local_port": free_port()}

    def describe(self) -> str:
        return f"master {self.master}, storage node {self.client_address}"


class RedisPeer(Peer):
    worker_system = "redis"

    def __init__(self, tmp: Path, max_clients: int) -> None:
        super().__init__()
        self.python = _peers_python()
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not installed (apt-get install redis-server)")
        self.port = free_port()
        self.procs.append(_spawn([exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                  "--appendonly", "no", "--maxmemory", str(2 * DATA_BYTES),
                                  "--proto-max-bulk-len", "1gb", "--dir", str(tmp)], tmp / "redis.log"))
        _wait_port(self.port, self.procs[-1], "redis-server")

    def client_spec(self, system: str, worker: int) -> dict:
        return {"port": self.port}

    def describe(self) -> str:
        return f"127.0.0.1:{self.port}"


def _lmcache():
    from benchmarks._server_lmcache import LmcachePeer

    return LmcachePeer


class _Lazy(dict):
    def __missing__(self, key: str):
        if key == "lmcache":
            return lambda tmp, n: _lmcache()(tmp, n)
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        return key == "lmcache" or dict.__contains__(self, key)


PEERS = _Lazy(kvstore=KvstorePeer, mooncake=MooncakePeer, redis=RedisPeer)
