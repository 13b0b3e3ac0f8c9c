"""A throwaway Mooncake Store pool on 127.0.0.1 for tests and benchmarks: the real
``mooncake_master`` (with its HTTP metadata server) and one ``mooncake_client`` storage
node holding the pool's memory segment, both from Mooncake's wheel.

``MooncakePool(tmp)`` starts both on free ports; ``stop_master()``/``start_master()``
take the master down and back on the same ports (its in-memory metadata is lost, as in a
real master restart); ``stop()`` ends every process by PID. Not thread-safe.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from kvstore.testing import free_port

# Mooncake binds to the external address unless told otherwise (../shared/MACHINE.md).
ENV = {"MC_LEGACY_RPC_PORT_BINDING": "1", "MC_TCP_BIND_ADDRESS": "127.0.0.1"}


WHEEL = "mooncake-transfer-engine-non-cuda==0.3.13.post1"


def binaries() -> tuple[str, str] | None:
    master, client = shutil.which("mooncake_master"), shutil.which("mooncake_client")
    return (master, client) if master and client else None


def missing() -> str | None:
    """Why Mooncake cannot run here (its wheel's binaries or Python client absent), or
    ``None`` when it can."""
    gone = [b for b in ("mooncake_master", "mooncake_client") if shutil.which(b) is None]
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        gone.append(f"the Python client (import mooncake.store: {exc})")
    if not gone:
        return None
    return (f"Mooncake is not installed ({', '.join(gone)} missing): scripts/deps/65-mooncake.sh installs "
            f"{WHEEL}; if it printed that the wheel did not install, that is why")


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port} within {timeout_s} s")


class MooncakePool:
    def __init__(self, tmp: Path, segment_mib: int = 256) -> None:
        found = binaries()
        if found is None:
            raise RuntimeError(missing() or "mooncake_master/mooncake_client not found")
        self._master_exe, self._client_exe = found
        self.tmp = tmp
        self.env = {**os.environ, **ENV}
        os.environ.update(ENV)   # the tier's own transfer engine binds to loopback too
        self.segment_mib = segment_mib
        self._master: subprocess.Popen | None = None
        self._client: subprocess.Popen | None = None
        # Free ports can be taken by another process between the check and the bind (a
        # master that cannot bind aborts at once): start afresh on new ports, a few times.
        for attempt in range(4):
            ports: set[int] = set()
            while len(ports) < 5:
                ports.add(free_port())
            self.p_meta, self.p_rpc, self.p_metrics, self.p_host, self.p_client = list(ports)
            self.metadata = f"http://127.0.0.1:{self.p_meta}/metadata"
            self.master = f"127.0.0.1:{self.p_rpc}"
            try:
                self.start_master()
                self._client = self._spawn([self._client_exe, f"--host=127.0.0.1:{self.p_host}",
                                            f"--port={self.p_client}", f"--global_segment_size={segment_mib}MB",
                                            "--local_buffer_size=0", f"--master_server_address={self.master}",
                                            f"--metadata_server={self.metadata}", "--protocol=tcp", "--threads=2"],
                                           "client")
                _wait_port(self.p_client, self._client, "mooncake_client")
                return
            except RuntimeError:
                self.stop()
                if attempt == 3:
                    raise

    def _spawn(self, argv: list[str], what: str) -> subprocess.Popen:
        log = open(self.tmp / f"mooncake_{what}.log", "ab")
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)

    def start_master(self) -> None:
        self._master = self._spawn([self._master_exe, "--enable_http_metadata_server=true",
                                    "--http_metadata_server_host=127.0.0.1",
                                    f"--http_metadata_server_port={self.p_meta}", "--rpc_address=127.0.0.1",
                                    f"--rpc_port={self.p_rpc}", "--metrics_host=127.0.0.1",
                                    f"--metrics_port={self.p_metrics}"], "master")
        _wait_port(self.p_rpc, self._master, "mooncake_master")
        _wait_port(self.p_meta, self._master, "mooncake_master metadata server")

    def stop_master(self) -> None:
        self._kill(self._master)
        self._master = None

    @staticmethod
    def _kill(proc: subprocess.Popen | None) -> None:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

    def stop(self) -> None:
        self._kill(self._client)
        self._kill(self._master)
        self._client = self._master = None
