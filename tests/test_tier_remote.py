"""The remote tier: the conformance suite against a real server, and a node-local Store
stacking a shared server beneath its DRAM."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.config import load_config
from kvstore.errors import TierUnavailableError
from kvstore.store import Store
from kvstore.testing import CAPACITY, TierConformance, free_port, make_keys, payload
from tests._servers import ThreadServer, config_dict
from tests._stray_dram import check_a_spill_keeps_drams_checksum
from kvstore.tiers.remote import RemoteTier


@pytest.fixture(scope="module")
def server():
    s = ThreadServer(config_dict("64MiB"))
    yield s
    s.stop()


@pytest.fixture(params=["tcp", "shm"])
def tier(request, server):
    from kvstore.client import Client

    server.store.clear()
    t = RemoteTier(server.address, CAPACITY, name="remote-test",
                   client=Client(server.address, transport=request.param))
    yield t
    t.close()


class TestRemoteConformance(TierConformance):
    CONCURRENCY_ROUNDS = 10


def test_store_stacks_a_server_beneath_dram(server):
    server.store.clear()
    raw = {"tiers": [{"name": "local", "kind": "dram", "capacity": "1MiB", "pin": False},
                     {"name": "shared", "kind": "remote", "address": server.address, "capacity": "32MiB"}]}
    block = 128 * 1024
    keys = make_keys(24, salt="stack")
    srcs = [payload(i, block) for i in range(24)]
    with Store(load_config(raw, env={})) as store:
        for lo in range(0, 24, 4):  # small batches: the local tier evicts and spills
            assert all(store.save(keys[lo:lo + 4], srcs[lo:lo + 4]).result(30))
        stats = store.stats()
        assert stats["tiers"][0]["spills"] > 0  # evicted from local DRAM into the server
        assert server.store.stats()["blocks"] == stats["tiers"][1]["blocks"]
        dsts = [np.zeros(block, np.uint8) for _ in keys]
        assert store.load(keys, dsts).result(30) == [True] * 24
        assert all(np.array_equal(a, b) for a, b in zip(srcs, dsts))


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_spill_keeps_drams_checksum_so_the_server_refuses_a_stray_write_after_its_check(server, transport):
    from kvstore.client import Client

    server.store.clear()
    lower = RemoteTier(server.address, 1 << 20, name="shared", client=Client(server.address, transport=transport))
    check_a_spill_keeps_drams_checksum({"name": "shared", "kind": "remote", "address": server.address,
                                        "capacity": "1MiB"}, lower, refused=True)


def test_unreachable_server_is_a_clear_error():
    with pytest.raises(TierUnavailableError, match="cannot connect"):
        RemoteTier(f"127.0.0.1:{free_port()}", 1 << 20, name="gone")
