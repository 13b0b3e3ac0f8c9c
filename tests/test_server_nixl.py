"""The NIXL path end to end: ``kvstore serve`` in its own process, the Client in this
one (two processes on 127.0.0.1; UCX picks cross-memory attach or TCP here)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from kvstore.testing import IN_CI, make_keys, payload
from tests._servers import ROOT, ProcessServer, ThreadServer, config_dict

BLOCK = 1 << 20

if importlib.util.find_spec("nixl") is None:
    if IN_CI:
        raise RuntimeError("nixl must be installed in CI (scripts/deps/60-nixl.sh)")
    pytest.skip("nixl is not installed (bash scripts/deps/60-nixl.sh installs it)", allow_module_level=True)

from kvstore.client import Client  # noqa: E402
from kvstore.errors import BufferSizeError, ConfigError  # noqa: E402

UCX_ENV = {} if os.path.isdir("/sys/class/infiniband") else {"UCX_MODULES": "^ib"}

# A small first tier over a larger second one: blocks spill down, so loads see both
# arena hits (sent by NIXL) and lower-tier hits (fetched over TCP).
TWO_TIERS = [{"name": "hot", "kind": "dram", "capacity": "8MiB", "pin": False},
             {"name": "warm", "kind": "dram", "capacity": "256MiB", "pin": False}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ProcessServer(config_dict(tiers=TWO_TIERS, transport="nixl"), tmp_path_factory.mktemp("nixl"),
                      env=UCX_ENV)
    yield s
    s.kill()


@pytest.fixture
def client(server):
    c = Client(server.address, transport="nixl", timeout_s=30)
    assert c.transport == "nixl"
    yield c
    c.close()


def _first_tier(stats: dict) -> dict:
    return stats["tiers"][0]


def test_round_trip_staged_and_registered(client):
    keys = make_keys(6, salt="rt")
    srcs = [payload(i, BLOCK) for i in range(6)]
    assert client.save(keys, srcs).result() == [True] * 6
    # unregistered destinations: through the client's staging buffer
    dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
    assert client.load(keys, dsts).result() == [True] * 6
    assert all(np.array_equal(s, d) for s, d in zip(srcs, dsts))
    # registered destinations: the server writes straight into them
    pool = np.zeros(6 * BLOCK, np.uint8)
    client.register(pool)
    views = [pool[i * BLOCK:(i + 1) * BLOCK] for i in range(6)]
    assert client.load(keys, views).result() == [True] * 6
    assert all(np.array_equal(s, v) for s, v in zip(srcs, views))
    nixl = client.stats()["server"]["nixl"]
    assert nixl["gets"] >= 2 and nixl["bytes_out"] >= 6 * BLOCK and nixl["failures"] == 0
    assert client.fallbacks.total == 0


def test_save_from_registered_buffers_and_torch(client):
    torch = pytest.importorskip("torch")
    pool = np.zeros(4 * BLOCK, np.uint8)
    client.register(pool)
    for i in range(4):
        pool[i * BLOCK:(i + 1) * BLOCK] = payload(100 + i, BLOCK)
    keys = make_keys(4, salt="reg-put")
    assert client.save(keys, [pool[i * BLOCK:(i + 1) * BLOCK] for i in range(4)]).result() == [True] * 4
    dsts = [torch.zeros(BLOCK // 2, dtype=torch.float16) for _ in keys]
    assert client.load(keys, dsts).result() == [True] * 4
    for i, d in enumerate(dsts):
        assert np.array_equal(d.view(torch.uint8).numpy(), payload(100 + i, BLOCK))


def test_misses_lower_tier_and_size_mismatch(client):
    keys = make_keys(24, salt="spill")  # 24 MiB through an 8 MiB first tier: most spill down
    srcs = [payload(200 + i, BLOCK) for i in range(24)]
    assert all(client.save(keys, srcs).result())
    missing = make_keys(2, salt="never")
    ask = keys + missing
    dsts = [np.full(BLOCK, 7, np.uint8) for _ in ask]
    assert client.load(ask, dsts).result() == [True] * 24 + [False, False]
    assert all(np.array_equal(s, d) for s, d in zip(srcs, dsts))
    assert all((d == 7).all() for d in dsts[24:]), "a miss must leave the buffer untouched"
    assert client.stats()["server"]["nixl"]["not_sent"] > 0  # some came from the lower tier over TCP
    with pytest.raises(BufferSizeError):
        client.load(keys[-1:], [np.zeros(BLOCK // 2, np.uint8)]).result()


def test_auto_picks_nixl_for_a_server_without_shared_memory(server):
    with Client(server.address, transport="auto") as c:
        assert c.transport == "nixl"


def test_client_killed_mid_transfer(server, client):
    """A client SIGKILLed while the server WRITEs into its buffers: the server keeps
    serving, and once the blocks are deleted no slot is leaked or left leased."""
    hot = make_keys(6, salt="hot-big")
    srcs = [payload(300 + i, BLOCK) for i in range(6)]
    code = (
        "import os, signal, threading, numpy as np\n"
        "from kvstore.client import Client\n"
        "from kvstore.testing import make_keys\n"
        f"c = Client({server.address!r}, transport='nixl', timeout_s=30)\n"
        "assert c.transport == 'nixl'\n"
        "keys = make_keys(6, salt='hot-big')\n"
        "buf = np.empty(6 << 20, np.uint8)\n"  # fresh pages: the server's write faults them in
        "c.register(buf)\n"
        "threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGKILL)).start()\n"
        "print('LOADING', flush=True)\n"
        "while True:\n"
        "    c.load(keys, [buf[i << 20:(i + 1) << 20] for i in range(6)]).result()\n"
    )
    assert all(client.save(hot, srcs).result())
    env = {**os.environ, "PYTHONPATH": str(ROOT), **UCX_ENV}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert server.proc.poll() is None, "the server died with its client"
    # others are still served, byte-exact
    dsts = [np.zeros(BLOCK, np.uint8) for _ in hot]
    assert client.load(hot, dsts).result() == [True] * 6
    assert all(np.array_equal(s, d) for s, d in zip(srcs, dsts))
    # the dead client's connections close; then nothing stays leased
    deadline = time.monotonic() + 30
    while client.stats()["server"]["nixl"]["peers"] > 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    client.delete(hot + make_keys(24, salt="spill") + make_keys(6, salt="rt") + make_keys(4, salt="reg-put"))
    stats = client.stats()
    first = _first_tier(stats)
    assert first["used_bytes"] == 0 and first["abandoned_bytes"] == 0, first
    assert first["largest_free_bytes"] == first["capacity_bytes"], f"a slot stayed leased: {first}"
    assert stats["server"]["nixl"]["stuck_transfers"] == 0


def test_nixl_failure_falls_back_to_tcp(tmp_path, caplog):
    """A server whose UCX cannot start (no usable transport): the client logs, counts
    the fallback and works over TCP; the server counts the failure."""
    s = ProcessServer(config_dict("64MiB", transport="nixl"), tmp_path, env={**UCX_ENV, "UCX_TLS": "bogus"})
    try:
        with caplog.at_level("WARNING"):
            c = Client(s.address, transport="nixl", timeout_s=30)
        with c:
            assert c.transport == "tcp"
            assert c.fallbacks.stats() == {"nixl->tcp": 1}
            assert "falling back to tcp" in caplog.text
            keys = make_keys(3, salt="fb")
            srcs = [payload(i, BLOCK) for i in range(3)]
            assert c.save(keys, srcs).result() == [True] * 3
            dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
            assert c.load(keys, dsts).result() == [True] * 3
            assert all(np.array_equal(a, b) for a, b in zip(srcs, dsts))
            nixl = c.stats()["server"]["nixl"]
            assert nixl["failures"] == 1 and "could not start" in nixl["error"]
        # once NIXL failed to start, the server stops offering it: auto goes straight to TCP
        with Client(s.address, transport="auto") as c2:
            assert c2.transport == "tcp" and c2.fallbacks.total == 0
    finally:
        s.kill()


def test_explicit_nixl_refused_by_a_tcp_server():
    s = ThreadServer(config_dict("16MiB", transport="tcp"))
    try:
        with pytest.raises(ConfigError, match="does not offer NIXL"):
            Client(s.address, transport="nixl")
        with Client(s.address, transport="auto") as c:
            assert c.transport == "tcp"
    finally:
        s.stop()


def test_explicit_nixl_on_a_server_that_also_offers_shared_memory():
    """``transport="nixl"`` is honoured even where ``auto`` would pick shared memory."""
    s = ThreadServer(config_dict("32MiB", transport="auto"))
    try:
        with Client(s.address, transport="auto") as c:
            assert c.transport == "shm"
        with Client(s.address, transport="nixl") as c:
            assert c.transport == "nixl"
            keys = make_keys(3, salt="explicit")
            srcs = [payload(i, BLOCK) for i in range(3)]
            assert c.save(keys, srcs).result() == [True] * 3
            dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
            assert c.load(keys, dsts).result() == [True] * 3
            assert all(np.array_equal(a, b) for a, b in zip(srcs, dsts))
            assert c.stats()["server"]["nixl"]["gets"] == 1
    finally:
        s.stop()


def test_auto_falls_back_when_nixl_is_not_installed_on_the_client(server):
    """A client process where the nixl package cannot be found (its spec lookup hidden,
    as on a machine without it) talks to a NIXL server over TCP with ``auto``, and an
    explicit ``nixl`` says why it cannot."""
    code = (
        "import importlib.util as u, numpy as np\n"
        "orig = u.find_spec\n"
        "u.find_spec = lambda n, *a, **k: None if n == 'nixl' else orig(n, *a, **k)\n"
        "from kvstore.client import Client\n"
        "from kvstore.errors import ConfigError\n"
        "from kvstore.testing import make_keys, payload\n"
        f"c = Client({server.address!r}, transport='auto')\n"
        "assert c.info['nixl'] and c.transport == 'tcp' and c.fallbacks.total == 0, c.transport\n"
        "k = make_keys(2, salt='no-nixl'); s = [payload(i, 1 << 20) for i in range(2)]\n"
        "assert c.save(k, s).result() == [True, True]\n"
        "d = [np.zeros(1 << 20, np.uint8) for _ in k]\n"
        "assert c.load(k, d).result() == [True, True] and all((a == b).all() for a, b in zip(s, d))\n"
        "c.close()\n"
        "try:\n"
        f"    Client({server.address!r}, transport='nixl')\n"
        "except ConfigError as e:\n"
        "    assert 'not installed' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('explicit nixl must fail without nixl')\n"
        "print('fallback-ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), **UCX_ENV}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "fallback-ok" in out.stdout


def test_concurrent_clients_byte_exact(tmp_path):
    """Several clients (own NIXL agents) move blocks at once: every byte lands right.
    One roomy tier: this is about concurrent transfers, not spilling."""
    import threading

    server = ProcessServer(config_dict("256MiB", transport="nixl"), tmp_path, env=UCX_ENV)
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            with Client(server.address, transport="nixl", timeout_s=60, pool_size=2) as c:
                assert c.transport == "nixl"
                pool = np.zeros(8 * BLOCK, np.uint8)
                c.register(pool)
                for r in range(3):
                    keys = make_keys(8, salt=f"conc-{w}-{r}")
                    srcs = [payload(1000 * w + 10 * r + i, BLOCK) for i in range(8)]
                    ok = c.save(keys, srcs).result()
                    assert ok == [True] * 8, ("save", ok)
                    views = [pool[i * BLOCK:(i + 1) * BLOCK] for i in range(8)]
                    got = c.load(keys, views).result()
                    assert got == [True] * 8, ("load", got, c.contains(keys))
                    for s, v in zip(srcs, views):
                        assert np.array_equal(s, v), f"client {w} round {r}: wrong bytes"
                    c.delete(keys)
                assert c.fallbacks.total == 0
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    try:
        threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
    finally:
        server.kill()
    assert not errors, errors[0]
