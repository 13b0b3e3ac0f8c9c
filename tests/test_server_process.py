"""The server as users run it (``python -m kvstore serve`` in a subprocess): graceful
shutdown on SIGTERM, a kill mid-transfer, restart from a persistent tier, 16 concurrent
clients under a time bound, the ``kvstore stats`` command."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.errors import KVStoreError
from kvstore.testing import make_keys, payload
from tests._servers import ROOT, ProcessServer, config_dict

BLOCK = 256 * 1024


@pytest.fixture
def spawn(tmp_path):
    started: list[ProcessServer] = []

    def start(raw: dict, **kw) -> ProcessServer:
        s = ProcessServer(raw, tmp_path, **kw)
        started.append(s)
        return s

    yield start
    for s in started:
        s.kill()


def test_sigterm_is_graceful(spawn):
    s = spawn(config_dict("32MiB"))
    assert s.shm_path and os.path.exists(s.shm_path)
    with Client(s.address) as c:
        assert c.transport == "shm"
        assert all(c.save(make_keys(4), [payload(i, BLOCK) for i in range(4)]).result(10))
    assert s.terminate() == 0
    assert "stopped" in s.proc.stderr.read()
    assert not os.path.exists(s.shm_path)
    assert not os.path.exists(s.socket_path)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_kill_mid_transfer_never_returns_partial_data(spawn, transport):
    s = spawn(config_dict("256MiB", max_inflight_bytes="512MiB"))
    keys = make_keys(64, salt=transport)
    srcs = [payload(i, 1 << 20) for i in range(64)]
    client = Client(s.address, transport=transport, timeout_s=5, pool_size=4)
    try:
        assert all(client.save(keys, srcs).result(30))
        results: list[object] = []
        deadline = time.monotonic() + 60

        def reader() -> None:
            # Loads until the server is gone: each load either fails or returns
            # verified bytes; the loop ends at the first failure.
            dsts = [np.zeros(1 << 20, np.uint8) for _ in keys]
            while time.monotonic() < deadline:
                for d in dsts:
                    d[:] = 0
                try:
                    ok = client.load(keys, dsts).result(30)
                except KVStoreError as exc:
                    results.append(exc)
                    return
                for hit, d, src in zip(ok, dsts, srcs):
                    if hit and not np.array_equal(d, src):
                        results.append(AssertionError("wrong bytes reported as loaded"))
                        return
                results.append(sum(ok))

        threads = [threading.Thread(target=reader) for _ in range(3)]
        for t in threads:
            t.start()
        while len(results) < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        s.proc.kill()
        s.proc.wait(10)
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a client hung after the server died"
        assert not [r for r in results if isinstance(r, AssertionError)]
        assert any(isinstance(r, int) and r == 64 for r in results), "no load completed before the kill"
        assert sum(isinstance(r, KVStoreError) for r in results) == 3, "a reader missed the kill"
        # After the kill: every call fails cleanly (error, never a partial True).
        with pytest.raises(KVStoreError):
            client.load(keys[:1], [np.zeros(1 << 20, np.uint8)]).result(30)
    finally:
        client.close()


def test_restart_serves_blocks_from_persistent_tier(spawn, tmp_path):
    pytest.importorskip("kvstore.tiers.nvme", reason="the NVMe tier is not in this build")
    data = tmp_path / "nvme"
    data.mkdir()
    tiers = [{"name": "hot", "kind": "dram", "capacity": "16MiB", "pin": False},
             {"name": "disk", "kind": "nvme", "path": str(data), "capacity": "64MiB", "file_bytes": "16MiB"}]
    keys = make_keys(8, salt="restart")
    srcs = [payload(i, BLOCK) for i in range(8)]
    s = spawn(config_dict(tiers=tiers))
    with Client(s.address) as c:
        assert all(c.save(keys, srcs).result(30))
    assert s.terminate() == 0  # flushes DRAM-only blocks down to the disk tier
    s2 = spawn(config_dict(tiers=tiers))
    with Client(s2.address) as c:
        dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
        assert c.load(keys, dsts).result(30) == [True] * 8
        assert all(np.array_equal(a, b) for a, b in zip(srcs, dsts))


def test_sixteen_concurrent_clients(spawn):
    s = spawn(config_dict("64MiB"))
    block = 64 * 1024
    deadline = time.monotonic() + 4.0
    errors: list[BaseException] = []
    done = [0] * 16
    rss_before = s.rss_bytes()

    def worker(w: int) -> None:
        rng = random.Random(w)
        transport = "shm" if w % 2 else "tcp"
        try:
            with Client(s.address, transport=transport, pool_size=2, staging_bytes=4 << 20) as c:
                # Keys shared by all workers (same content per key) plus private ones.
                shared, own = make_keys(32, salt="shared"), make_keys(32, salt=f"w{w}")
                while done[w] < 8 or time.monotonic() < deadline:   # 8 ops at least, however slow the start
                    pool = shared if rng.random() < 0.5 else own
                    idx = rng.sample(range(32), rng.randint(1, 8))
                    keys = [pool[i] for i in idx]
                    seed = 0 if pool is shared else 1000 * (w + 1)
                    op = rng.random()
                    if op < 0.4:
                        c.save(keys, [payload(seed + i, block) for i in idx]).result(30)
                    elif op < 0.85:
                        dsts = [np.zeros(block, np.uint8) for _ in keys]
                        for hit, d, i in zip(c.load(keys, dsts).result(30), dsts, idx):
                            if hit:
                                assert np.array_equal(d, payload(seed + i, block)), "wrong bytes"
                    elif op < 0.9:
                        c.delete(keys)
                    elif op < 0.95:
                        c.lookup(keys, lease_s=1)
                    else:
                        c.contains(keys)
                    done[w] += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "deadlock: a client never finished"
    assert not errors, repr(errors[0])
    assert all(done), done
    # Bounded memory: the arena is preallocated; per-connection buffers are a few MiB.
    assert s.rss_bytes() < rss_before + (256 << 20)
    with Client(s.address, transport="tcp") as c:
        assert c.stats()["tiers"][0]["used_bytes"] <= 64 << 20
        assert c.ping() > 0


def test_stats_command(spawn):
    s = spawn(config_dict("8MiB"))
    with Client(s.address) as c:
        c.save(make_keys(2), [payload(0, 4096), payload(1, 4096)]).result(10)
    out = subprocess.run([sys.executable, "-m", "kvstore", "stats", "--server", s.address],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "hot" in out.stdout and "blocks 2" in out.stdout
