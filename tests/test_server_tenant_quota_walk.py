"""Issue 20 (review F5): a tenant's quota eviction never walks the whole shared policy
under the Store's lock. A tenant holding no bytes in a tier (quota 0, or nothing there
yet) is refused there at once, without pulling a single key from the policy (a pull
has side effects: S3-FIFO and SIEVE move skipped keys on); a tenant whose own blocks
lie deep in the eviction order stops after ``WALK_STEPS`` keys, counted in
``walk_capped``. Real server on 127.0.0.1; keys pulled are counted, never timed."""

from __future__ import annotations

import numpy as np
import pytest

import kvstore.store.tenants as ledger
from kvstore.client import Client
from kvstore.keys import Namespace
from tests._servers import ThreadServer, config_dict

BLK = 4096
A, B = "token-of-a", "token-of-b"
TIERS = [{"name": "hot", "kind": "dram", "capacity": "4MiB", "pin": False, "eviction": "lru"},
         {"name": "warm", "kind": "dram", "capacity": "4MiB", "pin": False}]


def _keys(model: str, lo: int, n: int):
    return Namespace(model=model, dtype="uint8", chunk_tokens=1).chunk_keys(np.arange(lo, lo + n))


def _server(quota_b: dict) -> ThreadServer:
    tenants = [{"name": "a", "token": A, "salt": "salt-of-tenant-a-0001"},
               {"name": "b", "token": B, "salt": "salt-of-tenant-b-0001", "quota": quota_b}]
    return ThreadServer(config_dict(tiers=TIERS, tenants=tenants, transport="tcp"))


def _count_pulls(monkeypatch, policy) -> list[int]:
    pulled = [0]
    real = policy.victims

    def victims():
        for key in real():
            pulled[0] += 1
            yield key

    monkeypatch.setattr(policy, "victims", victims)
    return pulled


def _hot(s, tenant: str) -> dict:
    return s.server.stats()["tenants"][tenant]["tiers"]["hot"]


def test_a_tenant_with_nothing_in_a_tier_is_refused_without_a_walk(monkeypatch):
    s = _server({"hot": 0})
    try:
        buf = np.ones(BLK, np.uint8)
        with Client(s.address, token=A) as a, Client(s.address, token=B) as b:
            assert a.save(_keys("a", 0, 200), [buf] * 200).result(10) == [True] * 200
            pulled = _count_pulls(monkeypatch, s.server.store._levels[0].policy)
            for i in range(5):
                assert b.save(_keys("b", i, 1), [buf]).result(10) == [True]   # stored in warm
            assert pulled[0] == 0
            hot = _hot(s, "b")
            assert hot["quota_full"] == 5 and hot["used_bytes"] == 0 and hot["walk_capped"] == 0
            assert s.server.stats()["tenants"]["b"]["tiers"]["warm"]["blocks"] == 5
            assert _hot(s, "a")["blocks"] == 200 and _hot(s, "a")["evictions"] == 0
    finally:
        s.stop()


def test_a_quota_walk_stops_at_its_step_cap(monkeypatch):
    monkeypatch.setattr(ledger, "WALK_STEPS", 16)
    s = _server({"hot": str(BLK)})
    try:
        buf = np.ones(BLK, np.uint8)
        with Client(s.address, token=A) as a, Client(s.address, token=B) as b:
            mine = _keys("b", 0, 1)
            assert b.save(mine, [buf]).result(10) == [True]                   # B at its quota in hot
            assert a.save(_keys("a", 0, 64), [buf] * 64).result(10) == [True] * 64
            assert b.load(mine, [np.zeros(BLK, np.uint8)]).result(10) == [True]   # B's block: most recent
            pulled = _count_pulls(monkeypatch, s.server.store._levels[0].policy)
            assert b.save(_keys("b", 1, 1), [buf]).result(10) == [True]      # refused in hot, into warm
            assert pulled[0] <= 16 + 1
            hot = _hot(s, "b")
            assert hot["walk_capped"] == 1 and hot["quota_full"] == 1 and hot["blocks"] == 1
            assert _hot(s, "a")["evictions"] == 0
            metrics = s.server.metrics.registry.get_sample_value(
                "kvstore_tenant_walk_capped_total", {"tenant": "b", "tier": "hot"})
            assert metrics == 1
    finally:
        s.stop()
