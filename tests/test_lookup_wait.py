"""A lookup that waits (bounded) for keys to be stored, woken by the save that lands
them: the embedded Store, and LOOKUP_WAIT through a real cache server."""

import threading
import time

import pytest

from kvstore.errors import InvalidArgumentError, ProtocolError
from kvstore.keys import Namespace
from kvstore.net import protocol as P
from kvstore.store import Store

servers = pytest.importorskip("tests._servers", reason="the cache server is not in this build")

NS = Namespace("m", "float16", 4)
KEYS = NS.chunk_keys(list(range(12)))      # 3 chunk keys


def _store():
    return Store.from_config({"tiers": [{"name": "hot", "kind": "dram", "capacity": "1MiB"}]})


def _save_when(event: threading.Event, store, keys):
    def run():
        event.wait(30)
        store.save(keys, [bytearray(b"x" * 16) for _ in keys]).result()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_store_lookup_waits_for_the_save_that_lands_the_keys():
    store = _store()
    try:
        store.save(KEYS[:1], [bytearray(16)]).result()
        go = threading.Event()
        t = _save_when(go, store, KEYS[1:])
        # The saver starts only once the waiter is known to wait: the answer can come
        # from nothing but the save's wake-up (a lookup without waiting says 1).
        threading.Timer(0.2, go.set).start()
        assert store.lookup(KEYS, wait_s=60) == 3
        t.join()
    finally:
        store.close()


def test_store_lookup_wait_ends_at_its_bound_with_the_held_prefix():
    store = _store()
    try:
        store.save(KEYS[:1], [bytearray(16)]).result()
        assert store.lookup(KEYS, wait_s=0.2) == 1
        assert store.lookup(KEYS) == 1
    finally:
        store.close()


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), 1e9, "1", True])
def test_bad_wait_is_a_clear_error(bad):
    store = _store()
    try:
        with pytest.raises(InvalidArgumentError, match="wait_s"):
            store.lookup(KEYS, wait_s=bad)
    finally:
        store.close()


def test_lookup_wait_body_roundtrip_and_bounds():
    limits = P.Limits()
    body = P.encode_lookup_wait(KEYS, 5.0, 2.5)
    lease, wait, keys = P.decode_lookup_wait(body, limits)
    assert (lease, wait, keys) == (5.0, 2.5, KEYS)
    for bad in (-1.0, float("nan"), 1e9):
        with pytest.raises(ProtocolError, match="wait"):
            P.decode_lookup_wait(P.encode_lookup_wait(KEYS, None, bad), limits)
    with pytest.raises(ProtocolError, match="too short"):
        P.decode_lookup_wait(b"\0" * 8, limits)


@pytest.fixture
def server():
    srv = servers.ThreadServer(servers.config_dict())
    yield srv
    srv.stop()


def test_server_lookup_waits_for_another_clients_save(server):
    from kvstore.client import Client

    waiter, writer = Client(server.address), Client(server.address)
    try:
        assert waiter.info.get("lookup_wait") is True
        writer.save(KEYS[:1], [bytearray(16)]).result()
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("n", waiter.lookup(KEYS, 30.0, wait_s=60)))
        t.start()
        # Until the writer saves the rest, the waiter is still waiting (it answers only
        # when every key landed, or after 60 s).
        time.sleep(0.3)
        assert t.is_alive()
        writer.save(KEYS[1:], [bytearray(16), bytearray(16)]).result()
        t.join(30)
        assert got["n"] == 3
        assert server.store.stats()["leases"] == 3     # leased as a plain LOOKUP leases
        # The connection serves plain lookups afterwards (socket timeout restored).
        assert waiter.lookup(KEYS) == 3
    finally:
        waiter.close()
        writer.close()


def test_server_lookup_wait_ends_at_its_bound(server):
    from kvstore.client import Client

    c = Client(server.address, timeout_s=5)
    try:
        c.save(KEYS[:2], [bytearray(16), bytearray(16)]).result()
        t0 = time.monotonic()
        assert c.lookup(KEYS, wait_s=0.3) == 2
        assert time.monotonic() - t0 < 5     # bounded by wait_s, not by the client timeout
    finally:
        c.close()


def test_tenant_scoped_lookup_wait(tmp_path):
    """With tenants, the waited-for keys are the tenant's own (LOOKUP_WAIT is scoped)."""
    from kvstore.client import Client

    cfg = servers.config_dict(tenants=[{"name": "a", "token": "tok-a-0123456789abcdef", "salt": "salt-a-0123456789abcdef"},
                                      {"name": "b", "token": "tok-b-0123456789abcdef", "salt": "salt-b-0123456789abcdef"}])
    srv = servers.ThreadServer(cfg)
    a, b = Client(srv.address, token="tok-a-0123456789abcdef"), Client(srv.address, token="tok-b-0123456789abcdef")
    try:
        b.save(KEYS, [bytearray(16)] * 3).result()
        assert a.lookup(KEYS, wait_s=0.2) == 0      # b's blocks are not a's
        a.save(KEYS, [bytearray(16)] * 3).result()
        assert a.lookup(KEYS, wait_s=5) == 3
    finally:
        a.close()
        b.close()
        srv.stop()


def test_server_shutdown_answers_a_waiting_lookup():
    """A server that stops does not leave a waiting lookup hanging until its wait_s."""
    from kvstore.client import Client

    srv = servers.ThreadServer(servers.config_dict())
    c = Client(srv.address, timeout_s=5)
    got = {}

    def wait():
        try:
            got["n"] = c.lookup(KEYS, wait_s=600)
        except Exception as exc:    # the connection closing under it is an answer too
            got["exc"] = exc

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    try:
        time.sleep(0.3)
        assert t.is_alive()
        srv.stop()
        t.join(60)
        assert not t.is_alive()
        assert got == {"n": 0}      # answered (nothing held), not cut off
    finally:
        c.close()
