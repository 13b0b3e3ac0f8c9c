"""The NIXL data plane between two processes on 127.0.0.1 (UCX picks cross-memory
attach or TCP here): byte-exact round trips, leases held during transfers, a client
killed mid-transfer. The server process is ``tests/_nixl_server.py``."""

import importlib.util
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvstore.testing import IN_CI, make_keys

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 1 << 20
CAPACITY = 320 << 20

if importlib.util.find_spec("nixl") is None:
    if IN_CI:
        raise RuntimeError("nixl must be installed in CI (scripts/deps/60-nixl.sh)")
    pytest.skip("nixl is not installed (bash scripts/deps/60-nixl.sh installs it)", allow_module_level=True)

from kvstore.errors import BufferSizeError, ProtocolError, TransportError  # noqa: E402
from kvstore.net.nixl.endpoint import Descs, NixlEndpoint, descs_of, staging_buffer  # noqa: E402
from tests._nixl_server import HarnessClient, block_payload  # noqa: E402


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if not os.path.isdir("/sys/class/infiniband"):
        env.setdefault("UCX_MODULES", "^ib")
    return env


@pytest.fixture(scope="module")
def server():
    authkey = secrets.token_hex(16)
    env = {**_env(), "NIXL_TEST_AUTHKEY": authkey}
    proc = subprocess.Popen([sys.executable, "-m", "tests._nixl_server", "serve", "--capacity", str(CAPACITY)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if not line.startswith("PORT "):
            proc.kill()
            pytest.fail(f"NIXL test server did not start: {line!r} {proc.stderr.read()[-2000:]}")
        yield {"port": int(line.split()[1]), "proc": proc, "env": env, "authkey": authkey.encode()}
    finally:
        proc.kill()
        proc.wait(10)


@pytest.fixture
def client(server):
    c = HarnessClient(server["port"], server["authkey"])
    pool = np.zeros(16 * BLOCK, np.uint8)  # touched once, registered once, reused
    c.register(pool)
    c.pool = pool
    yield c
    c.close()


def _blocks(pool: np.ndarray, n: int) -> list[np.ndarray]:
    return [pool[i * BLOCK:(i + 1) * BLOCK] for i in range(n)]


def test_descs_wire_round_trip():
    bufs = [np.zeros(4096, np.uint8), np.zeros(8192, np.uint8)]
    d = descs_of(bufs)
    back = Descs.from_bytes(d.to_bytes())
    assert back.mem == "DRAM" and np.array_equal(back.rows, d.rows) and back.sizes == [4096, 8192]
    with pytest.raises(ProtocolError, match="needs"):
        Descs.from_bytes(d.to_bytes()[:-1])
    with pytest.raises(ProtocolError, match="truncated"):
        Descs.from_bytes(b"\x00")
    with pytest.raises(ProtocolError, match="memory kind"):
        Descs.from_bytes(b"\x07" + d.to_bytes()[1:])


def test_get_put_round_trip_byte_exact(server, client):
    keys = make_keys(8, salt="seeded")
    assert client.call("seed", "seeded", 8, BLOCK) == [True] * 8
    dst = _blocks(client.pool, 8)
    assert client.get(keys, dst) == [True] * 8
    for i, d in enumerate(dst):
        assert np.array_equal(d, block_payload("seeded", i, BLOCK)), f"block {i} differs"

    # put from the client's registered buffers, then read back into other buffers
    put_keys = make_keys(6, salt="put")
    srcs = _blocks(client.pool, 6)
    for i, s in enumerate(srcs):
        s[:] = block_payload("put", i, BLOCK)
    expected = [s.copy() for s in srcs]
    assert client.put(put_keys, srcs) == [True] * 6
    client.pool[:] = 0
    back = _blocks(client.pool[8 * BLOCK:], 6)
    assert client.get(put_keys, back) == [True] * 6
    for e, b in zip(expected, back):
        assert np.array_equal(e, b)


def test_miss_and_partial_hits(server, client):
    keys = make_keys(3, salt="partial")
    client.call("seed", "partial", 3, BLOCK)
    missing = make_keys(2, salt="never-stored")
    ask = [keys[0], missing[0], keys[2], missing[1]]
    dst = _blocks(client.pool, 4)
    for d in dst:
        d[:] = 7
    assert client.get(ask, dst) == [True, False, True, False]
    assert np.array_equal(dst[0], block_payload("partial", 0, BLOCK))
    assert np.array_equal(dst[2], block_payload("partial", 2, BLOCK))
    assert (dst[1] == 7).all() and (dst[3] == 7).all(), "a miss must leave the buffer untouched"


def test_unregistered_late_buffer_reregisters(server, client):
    """A buffer registered after the first exchange reaches the server with refreshed
    metadata, and round trips like the rest."""
    client.call("seed", "late", 2, BLOCK)
    late = np.zeros(2 * BLOCK, np.uint8)
    client.register(late)
    assert client.get(make_keys(2, salt="late"), _blocks(late, 2)) == [True, True]
    assert np.array_equal(late[:BLOCK], block_payload("late", 0, BLOCK))


def test_wrong_buffer_size_is_refused(server, client):
    client.call("seed", "size", 1, BLOCK)
    with pytest.raises(RuntimeError, match="BufferSizeError"):
        client.get(make_keys(1, salt="size"), [client.pool[:BLOCK - 4096]])


def test_leases_hold_during_transfer(server, client):
    """The server deletes the requested blocks and fills every free byte of its arena
    with 0xFF after taking the leases and before the transfer: the client still gets
    the original bytes, and the slots are freed once the transfer ends."""
    client.call("clear")
    keys = make_keys(8, salt="leased")
    client.call("seed", "leased", 8, BLOCK)
    dst = _blocks(client.pool, 8)
    assert client.get(keys, dst, churn=True) == [True] * 8
    for i, d in enumerate(dst):
        assert np.array_equal(d, block_payload("leased", i, BLOCK)), f"leased block {i} was overwritten"
    stats = client.call("clear")
    assert stats["used"] == 0 and stats["keys"] == 0
    assert stats["largest_free"] == stats["arena"], "a leased slot was never freed"


@pytest.mark.parametrize("op", ["get", "put"])
def test_client_killed_mid_transfer(server, client, op):
    """A client SIGKILLed while the server moves its bytes: the server keeps serving
    others, and no slot is leaked or left leased."""
    blocks = 128
    client.call("clear")
    if op == "get":
        assert all(client.call("seed", "big", blocks, BLOCK))
    proc = subprocess.run([sys.executable, "-m", "tests._nixl_server", "die", "--port", str(server["port"]),
                           "--op", op, "--blocks", str(blocks), "--block-bytes", str(BLOCK)],
                          cwd=ROOT, env=server["env"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert "SENT" in proc.stdout
    assert server["proc"].poll() is None, "the server died with its client"

    # the server finishes (or abandons) the dead client's transfer, then serves others
    deadline = time.monotonic() + 60
    def dying_events():
        return [e for e in client.call("events") if e[0] == op and "dying" in (e[1] or "")]

    while not dying_events() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert dying_events(), "the server never finished or failed the dead client's transfer"
    last = dying_events()[-1]
    print("dying client outcome:", last)
    client.call("seed", "after", 4, BLOCK)
    dst = _blocks(client.pool, 4)
    assert client.get(make_keys(4, salt="after"), dst) == [True] * 4
    assert all(np.array_equal(d, block_payload("after", i, BLOCK)) for i, d in enumerate(dst))

    stats = client.call("clear")
    assert stats["stuck"] == 0 and stats["abandoned"] == 0, (last, stats)
    assert stats["used"] == 0 and stats["largest_free"] == stats["arena"], f"slot leaked after {last}: {stats}"


def test_transfer_errors_are_transport_errors():
    """Transfers to an unknown peer and size mismatches fail with kvstore errors."""
    with NixlEndpoint("solo", timeout_s=5.0) as ep:
        a, b = np.zeros(4096, np.uint8), np.zeros(8192, np.uint8)
        ep.register(a)
        with pytest.raises(BufferSizeError):
            ep.write(descs_of([a]), "nobody", descs_of([b]))
        with pytest.raises(TransportError, match="nobody"):
            ep.write(descs_of([a]), "nobody", descs_of([a]))
    with pytest.raises(TransportError, match="closed"):
        ep.write(descs_of([a]), "nobody", descs_of([a]))


def test_covers_needs_each_descriptor_inside_one_region():
    """Buffers used in place must lie wholly inside a registered region; staging
    buffers are page-aligned (a copy between buffers apart modulo 64 bytes is slow)."""
    pool = staging_buffer(3 * 4096)
    assert pool.ctypes.data % 4096 == 0 and pool.nbytes == 3 * 4096
    with NixlEndpoint("solo", timeout_s=5.0) as ep:
        assert not ep.covers(descs_of([pool]))
        ep.register(pool[:2 * 4096])
        assert ep.covers(descs_of([pool[:4096], pool[4096:2 * 4096]]))
        assert not ep.covers(descs_of([pool[4096:]]))  # runs past the region's end
        assert not ep.covers(descs_of([pool[:4096], pool[2 * 4096:]]))  # one of two outside
        ep.register(pool[2 * 4096:])
        assert ep.covers(descs_of([pool[:4096], pool[2 * 4096:]]))
