"""Run ``python -m kvstore serve --config FILE`` as a subprocess for a test."""

from __future__ import annotations

import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_server(config: str, port: int, log_path) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvstore", "serve", "--config", config], cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT)
    from kvstore.client import Client

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"kvstore serve exited with {proc.returncode}: {open(log_path).read()[-2000:]}")
        try:
            Client(f"127.0.0.1:{port}").close()
            return proc
        except Exception:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"kvstore serve did not accept connections: {open(log_path).read()[-2000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
