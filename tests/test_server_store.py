"""connectors/_server_store.py: a connector's cache-server store answers an unreachable
server without it (misses, skipped saves, failed loads, never True), logs the outage at
a bounded rate, and reconnects by itself (issue 35, finding 2). A real in-process
server started on a port nothing listened on, no stand-ins."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

pytest.importorskip("kvstore.client", reason="the cache server is not in this build")
servers = pytest.importorskip("tests._servers", reason="the cache server is not in this build")

from kvstore.client import Client  # noqa: E402
from kvstore.connectors._metrics import ConnectorMetrics  # noqa: E402
from kvstore.connectors._server_store import ServerStore  # noqa: E402
from kvstore.connectors._store_handle import open_store, release_store  # noqa: E402
from kvstore.errors import AuthError, TierUnavailableError  # noqa: E402
from kvstore.hint import Hint  # noqa: E402
from kvstore.keys import Namespace  # noqa: E402
from kvstore.testing import free_port  # noqa: E402

LOGGER = "kvstore.connectors._server_store"


def _keys(n: int):
    return Namespace("m", "float16", 4).chunk_keys(np.arange(4 * n, dtype=np.uint32))


def test_unreachable_server_is_answered_without_it_logged_once_and_found_again(caplog):
    port = free_port()
    address = f"127.0.0.1:{port}"
    caplog.set_level(logging.INFO, logger=LOGGER)
    store = ServerStore(lambda: Client(address), address, owner="test", retry_s=0.05, log_every_s=3600)
    metrics = ConnectorMetrics(store, "test")
    keys = _keys(3)
    src = [np.full(256, i + 1, np.uint8) for i in range(3)]
    try:
        assert store.client is None and not store.reachable
        for _ in range(200):
            assert store.lookup(keys) == 0
        assert store.contains(keys) == [False] * 3
        assert store.save(keys, src).result(10) == [False] * 3
        dst = [np.zeros(256, np.uint8) for _ in keys]
        assert store.load(keys, dst).result(10) == [False] * 3
        assert all(not d.any() for d in dst)
        assert store.hint(keys, Hint(retain_s=60)) == 0
        store.release(keys)
        with pytest.raises(TierUnavailableError):
            store.clear(namespaces=[keys[0].namespace])
        with pytest.raises(TierUnavailableError):
            store.delete(keys)
        assert metrics.snapshot()["unreachable_lookups"] == 200
        link = store.stats()["server_link"]
        assert link["reachable"] is False and link["outages"] == 1
        assert link["answered_without_server"] >= 205
        down = [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]
        assert len(down) == 1 and "unreachable" in down[0].getMessage()

        srv = servers.ThreadServer(servers.config_dict(port=port))
        try:
            deadline = time.monotonic() + 30
            while not store.reachable:
                assert time.monotonic() < deadline, "did not reconnect"
                time.sleep(0.02)
            assert store.save(keys, src).result(10) == [True] * 3
            assert store.lookup(keys) == 3
            assert store.load(keys, dst).result(10) == [True] * 3
            assert all(np.array_equal(d, s) for d, s in zip(dst, src))
            assert metrics.snapshot()["unreachable_lookups"] == 200
            lines = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]
            assert len(lines) == 2 and "reachable again" in lines[1]
        finally:
            srv.stop()
        # Stopped again mid-run: the next calls are misses, the engine's thread is not held.
        assert store.lookup(keys) == 0
        assert store.load(keys, dst).result(10) == [False] * 3
        assert store.stats()["server_link"]["outages"] == 2
    finally:
        metrics.close()
        store.close()


def test_a_wrong_token_still_fails_start_up():
    """Not an outage: a setting that can never work is an error at start-up."""
    srv = servers.ThreadServer(servers.config_dict(token="right-token"))
    try:
        with pytest.raises(AuthError):
            open_store({"server": srv.address, "token": "wrong-token"}, owner="test")
        store = open_store({"server": srv.address, "token": "right-token"}, owner="test")
        assert store.reachable
        release_store(store)
    finally:
        srv.stop()
