"""Issue 34 item 1: a tenant cannot escape its quota by racing re-saves of its own keys
with other sizes. Two connections of tenant a PUT the same 50 keys at once, one at 1 MiB
a block, the other at 4 KiB, then a DELETEs them, round after round. A key's size is
fixed by the save that first claims it: the other save of it is refused (counted in
``resave_size_mismatch``), never indexed, so every tier holding a key holds it at one
size, each tier's ledger charges exactly what that tier holds, and no ledger goes
negative. Tenant b's blocks, within its quota, survive all of it and a's saves after it.
(Before: a's hot-tier usage went to -52 MB within a few rounds, after which a kept
16 MiB in hot and evicted every block of b's.) Real server on 127.0.0.1, real threads."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.errors import BufferSizeError
from kvstore.keys import Namespace
from kvstore.testing import payload
from tests._servers import ThreadServer, config_dict

BIG, SMALL, B_BLOCK = 1 << 20, 4096, 256 * 1024
A, B = "token-of-a", "token-of-b"
TIERS = [{"name": "hot", "kind": "dram", "capacity": "16MiB", "pin": False},
         {"name": "warm", "kind": "dram", "capacity": "128MiB", "pin": False}]
TENANTS = [{"name": "a", "token": A, "salt": "salt-of-tenant-a-0001", "quota": {"hot": "512KiB"}},
           {"name": "b", "token": B, "salt": "salt-of-tenant-b-0001", "quota": {"hot": "2MiB"}}]
ROUNDS = 6


def _keys(model: str, n: int):
    return Namespace(model=model, dtype="uint8", chunk_tokens=1).chunk_keys(np.arange(n))


@pytest.fixture
def server():
    s = ThreadServer(config_dict(tiers=TIERS, tenants=TENANTS, transport="tcp"))
    yield s
    s.stop()


def _ledgers_match_the_tiers(s) -> dict:
    """Every tenant's ledger per tier is >= 0 and is the sum of the sizes that tier
    holds of that tenant's keys; returns the Store's stats."""
    store = s.server.store
    stats = store.stats()
    owner = store._tenants.owner
    for tier, entry in zip(store.tiers, stats["tiers"]):
        name = entry["name"]
        held = {k: tier.nbytes(k) for k in tier.keys()}
        for tenant, per in stats["tenants"].items():
            got = per["tiers"][name]
            assert got["used_bytes"] >= 0 and got["blocks"] >= 0, (tenant, name, got)
            mine = [k for k in held if owner(k) == tenant]
            assert got["blocks"] == len(mine), (tenant, name, got)
            assert got["used_bytes"] == sum(held[k] for k in mine), (tenant, name, got)
        assert sum(per["tiers"][name]["used_bytes"] for per in stats["tenants"].values()) == entry["used_bytes"]
    return stats


def _one_size_each(a: Client, keys, big, small) -> None:
    """Each key loads at exactly one of the two sizes, with that save's bytes."""
    for j, key in enumerate(keys):
        got = []
        for src in (big[j], small[j]):
            dst = np.zeros(src.nbytes, np.uint8)
            try:
                hit = a.load([key], [dst]).result(10) == [True]
            except BufferSizeError:
                hit = False
            if hit:
                assert np.array_equal(dst, src), f"key {j}: wrong bytes"
                got.append(src.nbytes)
        assert len(got) == 1, f"key {j} loads at sizes {got}"


def test_racing_resaves_at_two_sizes_never_let_a_tenant_escape_its_quota(server):
    s = server
    keys = _keys("race", 50)
    big = [payload(i, BIG) for i in range(50)]
    small = [payload(1000 + i, SMALL) for i in range(50)]
    theirs = _keys("b", 8)
    their_srcs = [payload(500 + i, B_BLOCK) for i in range(8)]
    with Client(s.address, token=B) as b:
        assert b.save(theirs, their_srcs).result(10) == [True] * 8          # exactly b's quota in hot
    ledger = s.server.store._tenants
    with Client(s.address, token=A) as a1, Client(s.address, token=A) as a2:
        for r in range(ROUNDS):
            # The big PUT is refused in hot (over a's quota) and goes on to warm; the small
            # one is sent as soon as hot has refused the big one (a counter, read without
            # the lock, so nothing waits on the server), while the big one is written into
            # warm: both passed the "held already?" check before either was indexed.
            refused_hot = ledger._quota_full["a"][0]
            results: dict[str, list[bool]] = {}
            big_put = threading.Thread(target=lambda: results.__setitem__("big", a1.save(keys, big).result(60)))
            big_put.start()
            while ledger._quota_full["a"][0] == refused_hot and big_put.is_alive():
                time.sleep(0.0002)
            results["small"] = a2.save(keys, small).result(60)
            big_put.join(60)
            assert set(results) == {"big", "small"}
            stats = _ledgers_match_the_tiers(s)
            assert stats["tenants"]["a"]["tiers"]["hot"]["used_bytes"] <= 512 * 1024
            _one_size_each(a1, keys, big, small)
            # a save refused for its key's size is counted, never stored
            assert stats["resave_size_mismatch"] >= results["big"].count(False) + results["small"].count(False)
            assert a1.delete(keys) == 50
            stats = _ledgers_match_the_tiers(s)
            for tier in ("hot", "warm"):
                got = stats["tenants"]["a"]["tiers"][tier]
                assert got["used_bytes"] == 0 and got["blocks"] == 0, (r, tier, got)
            b_hot = stats["tenants"]["b"]["tiers"]["hot"]
            assert b_hot["blocks"] == 8 and b_hot["evictions"] == 0, r
        # a, back to plain saves, keeps to its quota and b's blocks stay
        more = _keys("more", 64)
        assert a1.save(more, [payload(2000 + i, B_BLOCK) for i in range(64)]).result(30) == [True] * 64
        stats = _ledgers_match_the_tiers(s)
        assert stats["tenants"]["a"]["tiers"]["hot"]["used_bytes"] <= 512 * 1024
    b_hot = stats["tenants"]["b"]["tiers"]["hot"]
    assert b_hot["blocks"] == 8 and b_hot["evictions"] == 0
    with Client(s.address, token=B) as b:
        dsts = [np.zeros(B_BLOCK, np.uint8) for _ in theirs]
        assert b.load(theirs, dsts).result(10) == [True] * 8
        assert all(np.array_equal(x, d) for x, d in zip(their_srcs, dsts))
        assert s.server.store.tiers[0].contains(
            next(t for t in s.server.tenants.all if t.name == "b").keys(theirs, cached=False)) == [True] * 8


def test_a_resave_with_another_size_is_refused_and_counted(server):
    """Without a race: a key held at one size is not saved at another (refused, not
    'already stored'), and a lower tier never takes it either."""
    s = server
    keys = _keys("once", 2)
    with Client(s.address, token=A) as a:
        assert a.save(keys, [payload(1, SMALL), payload(2, SMALL)]).result(10) == [True, True]
        assert a.save(keys, [payload(3, BIG), payload(4, SMALL)]).result(10) == [False, True]
        stats = _ledgers_match_the_tiers(s)
        assert stats["resave_size_mismatch"] == 1
        assert s.server.metrics.registry.get_sample_value("kvstore_store_resave_size_mismatch_total") == 1
        assert stats["tenants"]["a"]["tiers"]["warm"]["blocks"] == 0
        dst = np.zeros(SMALL, np.uint8)
        assert a.load(keys[:1], [dst]).result(10) == [True] and np.array_equal(dst, payload(1, SMALL))
