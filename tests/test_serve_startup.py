"""``kvstore serve`` as a new user meets it: the flags work on any config, and a start
that fails says so in one line naming the field or address, exits non-zero and leaves
nothing behind (no arena under /dev/shm, no socket file)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile

import pytest
import yaml

from tests._servers import ROOT

ONE_TIER = [{"name": "hot", "kind": "dram", "capacity": "16MiB", "pin": False}]


def _env() -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("KVSTORE_CONFIG", None)
    return env


def _leftovers(pid: int) -> list[str]:
    """The arena and Unix socket a server with ``pid`` would have made."""
    shm = [f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if n.startswith(f"kvstore-{pid}-")]
    tmp = tempfile.gettempdir()
    socks = [os.path.join(tmp, n) for n in os.listdir(tmp) if re.fullmatch(rf"kvstore-\d+-{pid}\.sock", n)]
    return shm + socks


_INFO_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (INFO|DEBUG) kvstore[\w.]*: ")


def _serve_fails(tmp_path, raw: dict | None, *flags: str, quiet: bool = False) -> tuple[int, str]:
    args = [sys.executable, "-m", "kvstore", *(["--log-level", "WARNING"] if quiet else []), "serve", *flags]
    if raw is not None:
        path = tmp_path / "kv.yaml"
        path.write_text(yaml.safe_dump(raw))
        args += ["--config", str(path)]
    proc = subprocess.Popen(args, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "serving on" not in out, (out, err)
    # serve logs its start-up steps at INFO (its default level); the failure itself is one
    # line, and under --log-level WARNING it is all there is
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if not _INFO_LINE.match(line)]
    assert len(lines) == 1 and lines[0].startswith("kvstore: error: "), err
    assert err.splitlines()[-1] == lines[0], err
    if quiet:
        assert err.splitlines() == lines, err
    assert _leftovers(proc.pid) == []
    return proc.returncode, lines[0]


@pytest.fixture
def taken_port():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock.getsockname()[1]
    sock.close()


def test_port_zero_on_the_default_config(tmp_path):
    """`--port 0` (docs/server.md) on the built-in config: the flags no longer round-trip
    `token: null` into a refusal; the ready line names the real port."""
    proc = subprocess.Popen([sys.executable, "-m", "kvstore", "serve", "--port", "0", "--admin-port", "0",
                             "--data-dir", str(tmp_path / "data")], cwd=tmp_path, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        m = re.search(r"serving on 127\.0\.0\.1:(\d+) admin=(\d+)", line)
        assert m and int(m.group(1)) > 0 and int(m.group(2)) > 0, (line, proc.stderr.read() if not m else "")
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize("setting", ["port", "admin_port"])
def test_a_port_in_use_is_one_line_naming_it(tmp_path, taken_port, setting):
    server = {"port": 0, "admin_port": 0, setting: taken_port}
    rc, line = _serve_fails(tmp_path, {"tiers": ONE_TIER, "server": server})
    assert rc == 1
    assert f"server.{setting}: cannot listen on 127.0.0.1:{taken_port}" in line and "in use" in line


def test_a_port_in_use_under_log_level_warning_is_the_only_line(tmp_path, taken_port):
    rc, line = _serve_fails(tmp_path, {"tiers": ONE_TIER, "server": {"port": taken_port, "admin_port": 0}},
                            quiet=True)
    assert rc == 1 and f"server.port: cannot listen on 127.0.0.1:{taken_port}" in line


def test_the_port_flag_in_use(tmp_path, taken_port):
    rc, line = _serve_fails(tmp_path, {"tiers": ONE_TIER, "server": {"admin_port": None}}, "--port", str(taken_port))
    assert rc == 1 and f"server.port: cannot listen on 127.0.0.1:{taken_port}" in line


def test_a_socket_path_that_cannot_be_made(tmp_path):
    (tmp_path / "file").write_text("x")
    path = str(tmp_path / "file" / "kv.sock")
    rc, line = _serve_fails(tmp_path, {"tiers": ONE_TIER, "server": {"port": 0, "admin_port": None}},
                            "--socket-path", path)
    assert rc == 1 and f"server.socket_path: cannot listen on {path}" in line


def test_an_nvme_path_that_cannot_be_created(tmp_path):
    (tmp_path / "file").write_text("x")
    tiers = [*ONE_TIER, {"name": "warm", "kind": "nvme", "path": str(tmp_path / "file" / "data"),
                         "capacity": "64MiB"}]
    rc, line = _serve_fails(tmp_path, {"tiers": tiers, "server": {"port": 0, "admin_port": 0}})
    assert rc == 2 and "tiers.warm.path:" in line and "cannot be created" in line


def test_an_nvme_directory_in_use_frees_the_arena(tmp_path):
    """The arena is built before the NVMe tier finds its directory locked: it is removed."""
    from kvstore.tiers.nvme import NvmeTier

    data = tmp_path / "data"
    holder = NvmeTier(str(data), 16 << 20, name="holder", direct_io=False)
    try:
        tiers = [*ONE_TIER, {"name": "warm", "kind": "nvme", "path": str(data), "capacity": "16MiB",
                             "file_bytes": "4MiB"}]
        rc, line = _serve_fails(tmp_path, {"tiers": tiers, "server": {"port": 0, "admin_port": 0}})
    finally:
        holder.close()
    assert rc == 1 and "tiers.warm (nvme)" in line and "in use by another kvstore process" in line


def test_a_public_host_without_a_token(tmp_path):
    rc, line = _serve_fails(tmp_path, {"tiers": ONE_TIER}, "--host", "0.0.0.0", "--port", "0")
    assert rc == 2 and "server.host '0.0.0.0'" in line and "server.token" in line
