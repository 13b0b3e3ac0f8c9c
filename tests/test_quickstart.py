"""The README's quick start, as a new user runs it: a fresh clone, a fresh venv (no
system site-packages, so no torch and no extras), the install line exactly as README.md
writes it (read from its "## Quick start" block, so the two cannot drift), then
``kvstore serve`` on free ports; ``/healthz`` answers, a ``Client`` in that venv saves,
looks up and loads blocks byte-exact, torch is not importable there, and SIGTERM stops
the server cleanly, leaving nothing in ``/dev/shm``.

It needs the package index. Locally it skips when pip cannot reach it; in CI (``$CI``
set) it never skips."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from kvstore.testing import IN_CI

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

# pip's words for "the index cannot be reached" (no route, no DNS, a proxy refusing)
_OFFLINE = re.compile(r"Failed to establish a new connection|Temporary failure in name resolution|"
                      r"Network is unreachable|Name or service not known|ProxyError|Connection refused|"
                      r"Could not fetch URL|connection broken", re.I)


def readme_quickstart() -> str:
    """The one command line of the README's quick-start ``bash`` block."""
    section = ROOT.joinpath("README.md").read_text().split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README.md's Quick start has no ```bash block"
    lines = [line for line in block.group(1).splitlines() if line.strip()]
    assert len(lines) == 1, f"the quick start is one command line, got {lines}"
    return lines[0]


def test_the_readme_quickstart_is_install_then_serve():
    install, _, serve = readme_quickstart().rpartition(" && ")
    assert serve == "kvstore serve" and "pip install" in install
    assert "torch" not in install   # a cache-server node needs no torch (and no CUDA wheel index)


def _clone(dst: Path) -> Path:
    """A copy of the checkout as a fresh clone has it (no build outputs, caches or data)."""
    ignore = shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", ".pytest_cache", ".hypothesis", "build",
                                    "kvstore-data", ".venv", ".whl", "*.pyc")
    shutil.copytree(ROOT, dst, symlinks=True, ignore=ignore)
    return dst


def _venv_env(venv: Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "KVSTORE_CONFIG") and not k.startswith("KVSTORE_")}
    env.update(PATH=f"{venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}", VIRTUAL_ENV=str(venv),
               PIP_QUIET="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return env


def _read_start_line(proc: subprocess.Popen, timeout_s: float) -> tuple[str, list[str]]:
    """The first line naming ``serving on``, and every line read (stdout and stderr merged)."""
    seen: list[str] = []
    found = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            seen.append(line)
            if "serving on " in line:
                found.set()
                return

    threading.Thread(target=read, daemon=True).start()
    found.wait(timeout_s)
    start = next((line for line in seen if "serving on " in line), "")
    return start, seen


_ROUND_TRIP = """
import os, sys
from kvstore import Client, Namespace

ns = Namespace(model="quickstart", dtype="bfloat16", chunk_tokens=16, layout="L1", rank=0, world_size=1)
keys = ns.chunk_keys(list(range(16 * 8)))
srcs = [os.urandom(256 * 1024) for _ in keys]
with Client(sys.argv[1]) as client:
    assert client.save(keys, srcs).result(30) == [True] * len(keys)
    assert client.lookup(keys) == len(keys)
    dsts = [bytearray(256 * 1024) for _ in keys]
    assert client.load(keys, dsts).result(30) == [True] * len(keys)
    assert [bytes(d) for d in dsts] == srcs, "loaded bytes differ from the saved ones"
    print("round trip ok", client.transport)
"""


def test_readme_quickstart_in_a_fresh_venv(tmp_path):
    install, _, _ = readme_quickstart().rpartition(" && ")
    repo = _clone(tmp_path / "kvstore")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    env = _venv_env(venv)

    t0 = time.monotonic()
    out = subprocess.run(["bash", "-c", install], cwd=repo, env=env, capture_output=True, text=True, timeout=1200)
    install_s = time.monotonic() - t0
    if out.returncode != 0:
        if not IN_CI and _OFFLINE.search(out.stdout + out.stderr):
            pytest.skip(f"the package index is unreachable: {out.stderr[-500:]}")
        raise AssertionError(f"the README's install line failed ({out.returncode}):\n{out.stdout}{out.stderr}")
    print(f"\nquick-start install line: {install_s:.1f} s")

    python = venv / "bin" / "python"
    for absent in ("torch", "msgspec"):   # a bare server install: neither core nor the server extra needs them
        probe = subprocess.run([str(python), "-c", f"import {absent}"], env=env, capture_output=True, text=True)
        assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr, f"{absent} is installed"

    work = tmp_path / "run"
    work.mkdir()
    shm_before = set(os.listdir("/dev/shm"))
    t0 = time.monotonic()
    proc = subprocess.Popen([str(venv / "bin" / "kvstore"), "serve", "--port", "0", "--admin-port", "0",
                             "--socket-path", str(work / "kvstore.sock"), "--data-dir", str(work / "data")],
                            cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        start, seen = _read_start_line(proc, 60)
        m = re.search(r"serving on (\S+):(\d+)", start)
        admin = re.search(r"admin=(\d+)", start)
        assert m and admin, f"no start line from kvstore serve: {''.join(seen)}"
        address = f"{m.group(1)}:{m.group(2)}"
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{admin.group(1)}/healthz", timeout=2) as reply:
                    assert reply.status == 200
                    break
            except OSError:
                assert time.monotonic() < deadline, "/healthz did not answer"
                time.sleep(0.2)
        print(f"kvstore serve up (healthz 200): {time.monotonic() - t0:.1f} s")

        rt = subprocess.run([str(python), "-c", _ROUND_TRIP, address], cwd=work, env=env, capture_output=True,
                            text=True, timeout=120)
        assert rt.returncode == 0, rt.stdout + rt.stderr
        assert "round trip ok" in rt.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    rest = proc.stdout.read()
    assert rc == 0, f"kvstore serve exited with {rc}: {rest}"
    shm = re.search(r"shm=(\S+)", start)
    if shm and shm.group(1) != "None":
        assert not os.path.exists(shm.group(1)), f"{shm.group(1)} left behind"
    left = sorted(set(os.listdir("/dev/shm")) - shm_before)
    assert not [name for name in left if str(proc.pid) in name], f"left in /dev/shm: {left}"
    assert not (work / "kvstore.sock").exists(), "the Unix socket was left behind"
