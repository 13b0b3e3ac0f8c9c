"""Test helpers: a cache server in a background thread (fast, in-process) or in a
subprocess (for signals, kills and restarts). Both listen on 127.0.0.1, random ports."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from kvstore.config import load_config

ROOT = Path(__file__).resolve().parent.parent


def config_dict(capacity: str = "64MiB", *, tiers: list | None = None, **server: Any) -> dict:
    srv = {"host": "127.0.0.1", "port": 0, "admin_port": 0, **server}
    return {"tiers": tiers or [{"name": "hot", "kind": "dram", "capacity": capacity, "pin": False}],
            "server": srv}


class ThreadServer:
    """A :class:`Server` on its own event loop in a daemon thread. ``store``: serve this
    Store (the caller's, e.g. one with an injected clock; the caller closes it) instead
    of one built from ``raw``."""

    def __init__(self, raw: dict, *, store: Any = None) -> None:
        from kvstore.server import Server

        self.config = load_config(raw, env={})
        self.loop = asyncio.new_event_loop()
        self.server = Server(self.config, store=store)
        started = threading.Event()
        errors: list[BaseException] = []

        def main() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                self.loop.run_until_complete(self.server.start())
            except BaseException as exc:
                errors.append(exc)
                started.set()
                return
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()
        started.wait(10)
        if errors:
            raise errors[0]
        self.address = f"127.0.0.1:{self.server.port}"

    @property
    def store(self):
        return self.server.store

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        fut = asyncio.run_coroutine_threadsafe(self.server.shutdown(2.0), self.loop)
        fut.result(15)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class ProcessServer:
    """``python -m kvstore serve`` in a subprocess; addresses parsed from its ready line."""

    READY = re.compile(r"serving on (\S+):(\d+) admin=(\S+) socket=(\S+) shm=(\S+)")

    def __init__(self, raw: dict, tmp: Path, *, env: dict | None = None, preexec_fn: Any = None,
                 stderr_path: Path | None = None, cli_args: list[str] = ()) -> None:
        """``stderr_path``: the server's stderr goes to that file instead of a pipe (a
        pipe nobody reads stalls a server that logs much); ``preexec_fn`` runs in the
        child before it starts (e.g. to set resource limits); ``cli_args``: global
        options before ``serve`` (``--log-level``). ``ready_line``: its start line."""
        self.path = tmp / f"server-{time.monotonic_ns()}.yaml"
        self.path.write_text(yaml.safe_dump(raw))
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        full_env.pop("KVSTORE_CONFIG", None)
        err = open(stderr_path, "w") if stderr_path is not None else subprocess.PIPE
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvstore", *cli_args, "serve", "--config", str(self.path)],
                                         cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=err, text=True,
                                         preexec_fn=preexec_fn)
        finally:
            if stderr_path is not None:
                err.close()
        line = self.ready_line = self._ready_line(30.0)
        m = self.READY.search(line)
        if not m:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(10)
            errors = self.proc.stderr.read() if self.proc.stderr else Path(stderr_path).read_text()
            self.kill()
            raise RuntimeError(f"server did not start: {line!r} {errors}")
        self.address = f"{m.group(1)}:{m.group(2)}"
        self.port = int(m.group(2))
        self.admin_port = None if m.group(3) == "None" else int(m.group(3))
        self.socket_path = None if m.group(4) == "None" else m.group(4)
        self.shm_path = None if m.group(5) == "None" else m.group(5)

    def _ready_line(self, timeout_s: float) -> str:
        out: list[str] = []
        reader = threading.Thread(target=lambda: out.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        return out[0] if out else ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def terminate(self, timeout_s: float = 30.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream:
                stream.close()
        for path in (self.shm_path if hasattr(self, "shm_path") else None,
                     self.socket_path if hasattr(self, "socket_path") else None):
            if path and os.path.exists(path):
                os.unlink(path)
