"""A cache-server node needs no torch and no extra it does not use: with torch, msgspec and
pyzmq made unimportable, the server, the Client, a Store on host tiers and the CLI import
and run, and what does need them (a GPU tier, KV events, ``kvstore demo``,
``kvstore.testing`` without pytest) says which extra to install.

The modules are blocked by a ``sitecustomize`` on ``PYTHONPATH`` (a meta-path finder that
raises ``ModuleNotFoundError`` for them), so every subprocess, ``kvstore serve`` included,
runs as on a node without them. tests/test_quickstart.py does the same in a real venv
without torch (it needs the package index); this test needs nothing outside the suite."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("torch", "msgspec", "zmq")

_SITECUSTOMIZE = """
import importlib.abc, os, sys

_BLOCKED = set(os.environ["TEST_BLOCKED_MODULES"].split(","))


class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None


sys.meta_path.insert(0, _Blocked())
"""


def _env(tmp_path: Path, blocked=BLOCKED) -> dict:
    site_dir = tmp_path / "site"
    site_dir.mkdir(exist_ok=True)
    (site_dir / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    env = {**os.environ, "PYTHONPATH": f"{site_dir}:{ROOT}", "TEST_BLOCKED_MODULES": ",".join(blocked)}
    env.pop("KVSTORE_CONFIG", None)
    return env


def _python(tmp_path: Path, code: str, *args: str, blocked=BLOCKED, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=tmp_path,
                          env=_env(tmp_path, blocked), capture_output=True, text=True, timeout=timeout)


def _kvstore(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore", *args], cwd=tmp_path, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=timeout)


def test_the_block_works(tmp_path):
    out = _python(tmp_path, "import torch")
    assert out.returncode != 0 and "blocked by the test" in out.stderr


def test_server_client_store_and_cli_import_and_run_without_torch(tmp_path):
    out = _python(tmp_path, """
        import os, sys
        import kvstore.net.server, kvstore.net.client, kvstore.store, kvstore.doctor, kvstore.trace
        import kvstore.tiers.dram, kvstore.tiers.nvme, kvstore.tiers.nvme.fsck, kvstore.tiers.remote
        import kvstore.tiers.s3, kvstore.tiers.redis, kvstore.tiers.mooncake, kvstore.tiers.gpu
        from kvstore import Client, Namespace, Store
        from kvstore.cli import build_parser

        build_parser()   # imports every command's module
        ns = Namespace(model="m", dtype="bfloat16", chunk_tokens=4, layout="x", rank=0, world_size=1)
        keys = ns.chunk_keys(list(range(64)))
        srcs = [bytearray(os.urandom(256 * 1024)) for _ in keys]
        config = {"tiers": [{"name": "hot", "kind": "dram", "capacity": "1MiB", "pin": False},
                            {"name": "warm", "kind": "nvme", "path": "nvme", "capacity": "64MiB"}]}
        with Store.from_config(config) as store:     # 16 blocks of 256 KiB: most spill to NVMe
            assert store.save(keys, srcs).result() == [True] * 16
            assert store.lookup(keys) == 16
            dsts = [bytearray(256 * 1024) for _ in keys]
            assert store.load(keys, dsts).result() == [True] * 16 and dsts == srcs
            assert store.stats()["tiers"][1]["blocks"] > 0
        print(sorted(m for m in sys.modules if m.partition(".")[0] in ("torch", "msgspec", "zmq")))
        """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_serve_and_a_client_round_trip_without_torch(tmp_path):
    config = tmp_path / "kvstore.yaml"
    config.write_text(yaml.safe_dump({
        "tiers": [{"name": "hot", "kind": "dram", "capacity": "16MiB", "pin": False},
                  {"name": "warm", "kind": "nvme", "path": str(tmp_path / "nvme"), "capacity": "64MiB"}],
        "server": {"host": "127.0.0.1", "port": 0, "admin_port": 0, "socket_path": str(tmp_path / "s.sock")}}))
    log = (tmp_path / "serve.log").open("w+")     # serve logs its start-up steps at INFO
    proc = subprocess.Popen([sys.executable, "-m", "kvstore", "serve", "--config", str(config)], cwd=tmp_path,
                            env=_env(tmp_path), stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        line = proc.stdout.readline()      # the start line, or "" when serve exited
        assert "serving on " in line, line + (tmp_path / "serve.log").read_text()
        address = line.split("serving on ", 1)[1].split()[0]
        for transport in ("tcp", "shm"):
            out = _python(tmp_path, """
                import os, sys
                from kvstore import Client, Namespace
                ns = Namespace(model=sys.argv[2], dtype="bfloat16", chunk_tokens=4, layout="x", rank=0,
                               world_size=1)   # a key space per transport: a saved key is only touched
                keys = ns.chunk_keys(list(range(16)))
                srcs = [bytearray(os.urandom(65536)) for _ in keys]
                with Client(sys.argv[1], transport=sys.argv[2]) as c:
                    assert c.save(keys, srcs).result() == [True] * 4
                    assert c.lookup(keys) == 4
                    dsts = [bytearray(65536) for _ in keys]
                    assert c.load(keys, dsts).result() == [True] * 4 and dsts == srcs
                print("torch" in sys.modules)
                """, address, transport)
            assert out.returncode == 0, out.stderr
            assert out.stdout.strip() == "False"
        stats = _kvstore(tmp_path, "stats", "--server", address, "--json")
        assert stats.returncode == 0, stats.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
        log.close()
    assert rc == 0, (tmp_path / "serve.log").read_text()


def test_cli_commands_run_without_torch(tmp_path):
    config = tmp_path / "kvstore.yaml"
    config.write_text(yaml.safe_dump({
        "tiers": [{"name": "hot", "kind": "dram", "capacity": "4MiB", "pin": False},
                  {"name": "warm", "kind": "nvme", "path": str(tmp_path / "nvme"), "capacity": "64MiB"}]}))
    for args in (("config", "validate", str(config)), ("config", "show", str(config)),
                 ("bench", "--config", str(config), "--block-size", "256KiB", "--blocks", "16", "--batch", "4",
                  "--rounds", "1", "--json"),
                 ("fsck", str(tmp_path / "nvme"), "--no-progress"),
                 ("doctor", "--json", "--path", str(tmp_path))):
        out = _kvstore(tmp_path, *args)
        assert out.returncode == 0, f"kvstore {' '.join(args)}: {out.stdout}{out.stderr}"


def test_what_needs_an_extra_names_it(tmp_path):
    out = _python(tmp_path, """
        from kvstore import Store
        from kvstore.errors import ConfigError
        for config, extra in (
                ({"tiers": [{"name": "hbm", "kind": "gpu", "capacity": "1MiB"}]}, "[gpu]"),
                ({"tiers": [{"name": "hot", "kind": "dram", "capacity": "1MiB", "pin": False}],
                  "events": {"endpoint": "tcp://127.0.0.1:1"}}, "[events]")):
            try:
                Store.from_config(config).close()
            except ConfigError as exc:
                assert f"pip install 'kvstore-cache{extra}'" in str(exc), exc
            else:
                raise AssertionError(f"{config} built without its extra")
        """)
    assert out.returncode == 0, out.stderr
    demo = _kvstore(tmp_path, "demo")
    assert demo.returncode == 2
    assert "download.pytorch.org/whl/cpu" in demo.stderr and "kvstore-cache[demo]" in demo.stderr
    testing = _python(tmp_path, "import kvstore.testing", blocked=("pytest",))
    assert testing.returncode != 0 and "kvstore-cache[testing]" in testing.stderr
