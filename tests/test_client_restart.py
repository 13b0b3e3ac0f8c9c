"""A Client across a same-host server restart (issue 35, finding 3): with
``transport="auto"`` the Client moves bytes through the server's Unix socket and DRAM
arena, both named after the server's pid. After a restart the Client finds the new
instance again from the TCP address it was given (a new HELLO, the new arena mapped),
with no new Client. Real ``kvstore serve`` subprocesses on a loopback port."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from kvstore.testing import free_port

_missing = [m for m in ("kvstore.tiers.nvme", "kvstore.client", "kvstore.server") if importlib.util.find_spec(m) is None]
if _missing:
    pytest.skip(f"needs {', '.join(_missing)} (the NVMe tier and the cache server)", allow_module_level=True)

from kvstore.client import Client  # noqa: E402
from kvstore.errors import TierUnavailableError  # noqa: E402
from kvstore.keys import Namespace  # noqa: E402
from tests._serve import start_server, stop_server  # noqa: E402

BLOCK = 64 << 10


def _config(tmp_path, port: int, *, nvme: bool = True) -> str:
    disk = f"\n  - {{name: disk, kind: nvme, path: {tmp_path / 'nvme'}, capacity: 64MiB, file_bytes: 16MiB}}" \
        if nvme else ""
    path = tmp_path / "serve.yaml"
    path.write_text(f"""
server: {{host: 127.0.0.1, port: {port}, admin_port: null}}
placement: {{write: through}}
tiers:
  - {{name: hot, kind: dram, capacity: 32MiB}}{disk}
""")
    return str(path)


def _blocks(n: int, seed: int) -> tuple[list, list[np.ndarray]]:
    keys = Namespace("restart-model", "float16", 16).chunk_keys(np.arange(n * 16, dtype=np.uint32) + seed * 1000)
    rng = np.random.default_rng(seed)
    return keys, [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in keys]


def _load(client: Client, keys) -> tuple[list[bool], list[np.ndarray]]:
    dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
    return client.load(keys, dsts).result(), dsts


def test_client_finds_a_restarted_same_host_server_again_over_shm(tmp_path):
    port = free_port()
    config = _config(tmp_path, port)
    log_path = tmp_path / "serve.log"
    keys, data = _blocks(4, seed=3)
    proc = start_server(config, port, log_path)
    client = Client(f"127.0.0.1:{port}", transport="auto")
    try:
        assert client.transport == "shm"
        assert client.save(keys, data).result() == [True] * 4
        stop_server(proc)
        proc = None
        # Down: a call fails as unavailable (the caller decides what that means).
        with pytest.raises(TierUnavailableError):
            client.lookup(keys)
        proc = start_server(config, port, log_path)
        # The new instance recovered the blocks from the same NVMe directory; the same
        # Client reaches it on its new socket and maps its new arena.
        assert client.lookup(keys) == 4
        assert client.transport == "shm"
        ok, got = _load(client, keys)
        assert ok == [True] * 4
        assert all(np.array_equal(g, d) for g, d in zip(got, data))
        # Saves go to the new instance as well, through its arena, and load back exactly.
        more, more_data = _blocks(2, seed=9)
        assert client.save(more, more_data).result() == [True, True]
        ok, got = _load(client, more)
        assert ok == [True, True] and all(np.array_equal(g, d) for g, d in zip(got, more_data))
    finally:
        client.close()
        if proc is not None:
            stop_server(proc)


def test_a_restarted_server_without_the_blocks_is_a_miss_never_old_bytes(tmp_path):
    """A restart that lost the blocks (DRAM only): every key is a miss on the new
    instance, and its arena (mapped anew) never yields the old instance's bytes."""
    port = free_port()
    config = _config(tmp_path, port, nvme=False)
    log_path = tmp_path / "serve.log"
    keys, data = _blocks(3, seed=5)
    proc = start_server(config, port, log_path)
    client = Client(f"127.0.0.1:{port}", transport="auto")
    try:
        assert client.save(keys, data).result() == [True] * 3
        stop_server(proc)
        proc = start_server(config, port, log_path)
        assert client.lookup(keys) == 0
        ok, got = _load(client, keys)
        assert ok == [False] * 3
        assert client.transport == "shm"
    finally:
        client.close()
        if proc is not None:
            stop_server(proc)


def test_loads_in_flight_across_a_restart_are_exact_or_misses(tmp_path):
    """Several threads load through one Client while its server restarts: a call fails
    as unavailable or answers from one instance, never a block reported loaded with
    other bytes (the old arena stays mapped until its last call is done)."""
    import threading
    import time

    port = free_port()
    config = _config(tmp_path, port)
    log_path = tmp_path / "serve.log"
    keys, data = _blocks(8, seed=7)
    proc = start_server(config, port, log_path)
    client = Client(f"127.0.0.1:{port}", transport="auto", pool_size=4)
    stop = threading.Event()
    full, wrong, errors = [0], [], []

    def loader() -> None:
        while not stop.is_set():
            dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
            try:
                ok = client.load(keys, dsts).result(60)
            except TierUnavailableError:
                continue
            except Exception as exc:   # anything else is a finding
                errors.append(exc)
                return
            wrong.extend(i for i, (o, d, e) in enumerate(zip(ok, dsts, data)) if o and not np.array_equal(d, e))
            if all(ok):
                full[0] += 1

    threads = [threading.Thread(target=loader) for _ in range(3)]
    try:
        assert client.save(keys, data).result() == [True] * 8
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while full[0] < 3:
            assert time.monotonic() < deadline and not errors, errors
            time.sleep(0.01)
        stop_server(proc)
        proc = start_server(config, port, log_path)
        seen = full[0]
        while full[0] < seen + 3:
            assert time.monotonic() < deadline + 60 and not errors, errors
            time.sleep(0.01)
        assert client.transport == "shm"
    finally:
        stop.set()
        for t in threads:
            if t.is_alive():
                t.join(60)
        client.close()
        if proc is not None:
            stop_server(proc)
    assert not errors and not wrong
